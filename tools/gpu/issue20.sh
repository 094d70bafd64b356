#!/usr/bin/env bash
# Issue 20 on one H200, all output in $OUT/i20.log (and the A/B numbers in $OUT/bench_losses.json):
#   local:  tools/gpu/make_baseline.sh          # main's fastlm (9398690) -> .baseline/fastlm_base
#   device: bash tools/gpu/issue20.sh [tests|bench|all|check]   (run with carry=[".baseline"], and the pydantic wheel dir)
# (a) the kernel tests compiled on CUDA (~3-5 min, mostly Triton compiles), (b) before/after timings of
# main's code and this tree in one process (~2-3 min with compiles), then the summary. If (a) hits its
# limit in `all`, run `tests` and `bench` as two calls (each gets 560 s). A failing
# section prints its traceback and the next one still runs. SMOKE=1: a CPU try-out (Triton
# interpreted, a few tests, tiny bench shapes) to catch script errors.
# BENCH_SPECS: the bench's specs (default: GSPO+z, GRPO+z with loss_type grpo and their peer GRPO+z,
# the rows issue 20b changes: ~1 min with compiles); BENCH_SPECS=all times every spec (~3-4 min).
# `check` (issue 20b, one call of ~4-6 min): (a) only the tests of the document passes and GSPO
# (-k "gspo or document or seam or seq"), then (b).
set -u
cd "$(dirname "$0")/../.."
export OUT=${OUT:-/tmp/i20-out}
mkdir -p "$OUT"
LOG="$OUT/i20.log"
WHAT=${1:-${I20_WHAT:-all}}  # I20_WHAT: the mode when run through run_all.sh
SMOKE=${SMOKE:-0}
TEST_LIMIT=330; BENCH_LIMIT=240  # both in one 10-minute run; alone, each gets 560 s
case $WHAT in all) ;; check) TEST_LIMIT=300 ;; *) TEST_LIMIT=560; BENCH_LIMIT=560 ;; esac
TEST_LIMIT=${I20_TEST_LIMIT:-$TEST_LIMIT}
BENCH_SPECS=${BENCH_SPECS:-"grpo+z grpo(seq)+z gspo+z"}
SPEC_ARGS=(); [ "$BENCH_SPECS" = all ] || { read -ra SPEC_LIST <<< "$BENCH_SPECS"; SPEC_ARGS=(--specs "${SPEC_LIST[@]}"); }
read -ra SHAPES <<< "${I20_SHAPES:-16384x32000 16384x131072 4096x32000}"
SELECT=(); BENCH_MODE=(--ab-shapes "${SHAPES[@]}" "${SPEC_ARGS[@]}")
[ "$WHAT" = check ] && SELECT=(-k "gspo or document or seam or seq")
if [ "$SMOKE" = 1 ]; then
  SELECT=(-k "kd_both or document or seq-mean or seam"); BENCH_MODE=(--cpu-smoke --specs grpo+z "grpo(seq)+z" gspo+z ce+kd "ce+kd(both)")
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export WANDB_MODE=disabled

section() { echo; echo "== $1 ($(date +%T))"; }
{
  section "environment"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  if ! python -c "import pydantic" 2>/dev/null; then
    for wheels in .whl wheels; do
      [ -d "$wheels" ] && python -m pip install -q --no-index --find-links "$wheels" pydantic && break
    done
  fi
  python -c "import torch, triton, pydantic; print('torch', torch.__version__, 'triton', triton.__version__, 'pydantic', pydantic.__version__, 'cuda', torch.cuda.is_available())"
  python -c "import liger_kernel; print('liger-kernel ok')" 2>/dev/null || echo "liger-kernel: not installed (not needed here)"
  [ -d .baseline/fastlm_base ] && echo "baseline $(cat .baseline/COMMIT 2>/dev/null)" || echo "NO .baseline (run tools/gpu/make_baseline.sh locally and carry it): (b) will fail"

  if [ "$WHAT" != bench ]; then
    section "(a) kernel tests compiled on CUDA"
    XDIST=(); python -c "import xdist" 2>/dev/null && [ "$SMOKE" != 1 ] && XDIST=(-n 8)  # Triton compiles in parallel
    timeout $TEST_LIMIT python -m pytest -q -p no:cacheprovider -W error::RuntimeWarning -rfEs "${XDIST[@]}" \
      tests/losses/test_triton.py tests/losses/test_triton_distillation.py tests/losses/test_fused_terms.py \
      tests/losses/test_matrix.py tests/losses/test_document_weights.py "${SELECT[@]}" > /tmp/i20-pytest.txt 2>&1
    echo "pytest exit status: $? (124: timed out)" >> /tmp/i20-pytest.txt
    tail -80 /tmp/i20-pytest.txt
  fi

  if [ "$WHAT" != tests ]; then
    section "(b) before (main 9398690) / after, tools/bench_losses.py --baseline .baseline"
    timeout $BENCH_LIMIT python tools/bench_losses.py --baseline .baseline --rep-ms 100 "${BENCH_MODE[@]}"
    echo "bench exit status: $?"
  fi
  section "summary"
  [ -f /tmp/i20-pytest.txt ] && grep -E "passed|failed|error|exit status" /tmp/i20-pytest.txt | tail -3
  python - <<'PY' || true
import json, os
path = os.path.join(os.environ["OUT"], "bench_losses.json")
if os.path.exists(path):
    rows = json.load(open(path)).get("ab_rows", [])
    print("spec@TxV: kernel after/before, deferred after/before, host ms before -> after (before = main 9398690)")
    for r in rows:
        b, a = r.get("before", {}), r.get("after", {})
        ratio = lambda c: f"{a[c] / b[c]:.3f}" if a.get(c) and b.get(c) else "-"
        host = lambda t: f"{t['host']:.3f}" if t.get("host") else "-"
        print(f"  {r['spec']}@{r['tokens']}x{r['vocab']}: {ratio('kernel')}, {ratio('deferred')}, {host(b)} -> {host(a)}")
PY
} 2>&1 | tee "$LOG"
