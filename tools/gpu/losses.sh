#!/usr/bin/env bash
# The fused loss kernel on one GPU, all output in $OUT/losses.log (and the before/after numbers in
# $OUT/bench_losses.json): (a) the kernel tests compiled on CUDA (mostly Triton compiles), (b) before/after
# timings of a baseline copy of fastlm and this tree in one process (tools/bench_losses.py --baseline), then a
# summary. A failing section prints its traceback and the next one still runs.
#   local:  bash tools/bench/make_baseline.sh [COMMIT]    # the baseline's code -> .baseline/fastlm_base
#   device: bash tools/gpu/losses.sh [BUDGET_S]           # carry .baseline; default budget 570 s
# LOSSES_MODE: all (default: tests, then the bench in the last 240 s), tests, bench, or check (only the
#   tests of the document passes and GSPO, -k "gspo or document or seam or seq", then the bench).
# LOSSES_SPECS: the bench's specs (default "grpo+z grpo(seq)+z gspo+z", ~1 min with compiles; "all": every spec,
#   ~3-4 min); LOSSES_SHAPES: TOKENSxVOCAB shapes (default "16384x32000 16384x131072 4096x32000").
# HEAD_LIMIT=SECONDS (default 0: off): then (c) the whole head before/after (tools/bench_head.py --baseline, at
#   16384 x 2048 x 131072; HEAD_SPECS, default "ce ce+z+grpo ce+kd"), inside the bench's share of the budget.
# SMOKE=1: a CPU try-out (Triton interpreted, a few tests, tiny bench shapes) to catch script errors.
BUDGET=${1:-570}; OUT=${OUT:-/tmp/losses-out}; LOG="$OUT/losses.log"
source "$(dirname "$0")/common.sh"
MODE=${LOSSES_MODE:-all}
SMOKE=${SMOKE:-0}
case $MODE in
  all|check) BENCH_LIMIT=240; TEST_LIMIT=$(( BUDGET - BENCH_LIMIT - ${HEAD_LIMIT:-0} )) ;;
  *) TEST_LIMIT=$BUDGET; BENCH_LIMIT=$BUDGET ;;
esac
SPECS=${LOSSES_SPECS:-"grpo+z grpo(seq)+z gspo+z"}
SPEC_ARGS=(); [ "$SPECS" = all ] || { read -ra SPEC_LIST <<< "$SPECS"; SPEC_ARGS=(--specs "${SPEC_LIST[@]}"); }
read -ra SHAPES <<< "${LOSSES_SHAPES:-16384x32000 16384x131072 4096x32000}"
SELECT=(); BENCH_MODE=(--ab-shapes "${SHAPES[@]}" "${SPEC_ARGS[@]}")
[ "$MODE" = check ] && SELECT=(-k "gspo or document or seam or seq")
if [ "$SMOKE" = 1 ]; then
  SELECT=(-k "kd_both or document or seq-mean or seam"); BENCH_MODE=(--cpu-smoke --specs grpo+z "grpo(seq)+z" gspo+z ce+kd "ce+kd(both)")
fi
{
  section "environment"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  python3 -c "import torch, triton, pydantic; print('torch', torch.__version__, 'triton', triton.__version__, 'pydantic', pydantic.__version__, 'cuda', torch.cuda.is_available())"
  python3 -c "import liger_kernel; print('liger-kernel ok')" 2>/dev/null || echo "liger-kernel: not installed (its column prints -)"
  [ -d .baseline/fastlm_base ] && echo "baseline $(cat .baseline/COMMIT 2>/dev/null)" || echo "NO .baseline (run tools/bench/make_baseline.sh locally and carry it): (b) will fail"

  if [ "$MODE" != bench ]; then
    section "(a) kernel tests compiled on CUDA"
    XDIST=(); python3 -c "import xdist" 2>/dev/null && [ "$SMOKE" != 1 ] && XDIST=(-n 8)  # Triton compiles in parallel
    timeout "$TEST_LIMIT" python3 -m pytest -q -p no:cacheprovider -W error::RuntimeWarning -rfEs "${XDIST[@]}" \
      tests/losses/test_triton.py tests/losses/test_triton_distillation.py tests/losses/test_fused_terms.py \
      tests/losses/test_matrix.py tests/losses/test_document_weights.py tests/losses/test_kernel_interface.py \
      tests/losses/test_chunked_head.py "${SELECT[@]}" > /tmp/losses-pytest.txt 2>&1
    echo "pytest exit status: $? (124: timed out)" >> /tmp/losses-pytest.txt
    tail -80 /tmp/losses-pytest.txt
  fi

  if [ "$MODE" != tests ]; then
    section "(b) before (.baseline) / after, tools/bench_losses.py --baseline .baseline"
    timeout "$BENCH_LIMIT" python3 tools/bench_losses.py --baseline .baseline --rep-ms 100 "${BENCH_MODE[@]}"
    echo "bench exit status: $?"
    if [ "$SMOKE" != 1 ] && [ "${HEAD_LIMIT:-0}" -gt 0 ]; then
      section "(c) the whole head before/after: tools/bench_head.py --baseline .baseline (${HEAD_SPECS:-ce ce+z+grpo ce+kd})"
      read -ra HEAD_SPEC_LIST <<< "${HEAD_SPECS:-ce ce+z+grpo ce+kd}"
      timeout "$HEAD_LIMIT" python3 tools/bench_head.py --baseline .baseline --tokens 16384 --specs "${HEAD_SPEC_LIST[@]}" \
        | grep -v '^{'
      echo "head bench exit status: ${PIPESTATUS[0]}"
    fi
  fi
  section "summary"
  [ -f /tmp/losses-pytest.txt ] && grep -E "passed|failed|error|exit status" /tmp/losses-pytest.txt | tail -3
  python3 - <<'PY' || true
import json, os
path = os.path.join(os.environ["OUT"], "bench_losses.json")
if os.path.exists(path):
    rows = json.load(open(path)).get("ab_rows", [])
    print("spec@TxV: kernel after/before, deferred after/before, host ms before -> after (before = .baseline)")
    for r in rows:
        b, a = r.get("before", {}), r.get("after", {})
        ratio = lambda c: f"{a[c] / b[c]:.3f}" if a.get(c) and b.get(c) else "-"
        host = lambda t: f"{t['host']:.3f}" if t.get("host") else "-"
        print(f"  {r['spec']}@{r['tokens']}x{r['vocab']}: {ratio('kernel')}, {ratio('deferred')}, {host(b)} -> {host(a)}")
PY
} 2>&1 | tee "$LOG"
