#!/usr/bin/env bash
# Issue 21 / tuning-log entry 19: the fused kernel's split rows (SPLIT programs per row, one launch
# exchanging stats) measured on one GPU; everything in $OUT/i21split.log. About 7 minutes (budget 8):
#   (a) <=100 s test_triton_distillation.py -k "split_rows or masked or prefetch": the one-launch exchange
#              compiled, against float64 (the interpreter runs it as two launches in CI);
#   (b) <=200 s bench_losses.py --tune: CE+kd's kernel alone at 2048 and 16384 x 131072, blocks 2048/4096 x
#              warps 4/8 x split 1/4/8/16 (2048 rows: one head chunk at the default logits budget);
#   (c) <=170 s bench_head.py --specs ce+kd --splits 4 8 16: the whole head against the three-GEMM floor
#              at 16384 and 65536 x 2048 x 131072, today's default (split 1) and each split side by side;
#   (d) the rest: with SPLIT_DEFAULT patched to 8 in this copy, test_chunked_head.py -k "kd or distill"
#              (the chunked head's distillation cases compiled with the split as the default).
# A failing or overrunning section prints its traceback and the next one still runs.
set -u
cd "$(dirname "$0")/../.."
export OUT=${OUT:-/tmp/i21split-out}
mkdir -p "$OUT"
LOG="$OUT/i21split.log"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export WANDB_MODE=disabled PYTHONUNBUFFERED=1
START=$(date +%s)
BUDGET=${SPLIT_BUDGET_S:-480}
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
section() { echo; echo "== $1 ($(date +%T), $(left) s left)"; }
capped() { local cap=$1 reserve=$2; local t=$(( $(left) - reserve )); echo $(( t < cap ? (t > 20 ? t : 20) : cap )); }

{
  section "environment"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  python3 -c "import torch, triton, pydantic; print('torch', torch.__version__, 'triton', triton.__version__, 'pydantic', pydantic.__version__, 'cuda', torch.cuda.is_available())"

  section "(a) the one-launch exchange compiled: test_triton_distillation.py"
  FASTLM_COMPILE=0 timeout "$(capped 100 370)" python3 -m pytest -q -p no:cacheprovider -rfEs -s \
    tests/losses/test_triton_distillation.py -k "split_rows or masked or prefetch" > /tmp/split-tests.txt 2>&1
  echo "pytest exit status: $? (124: timed out)" >> /tmp/split-tests.txt
  grep -E "split|rel|passed|failed|Error|exit status" /tmp/split-tests.txt | tail -40

  section "(b) bench_losses.py --tune: CE+kd's kernel alone, split 1/4/8/16"
  timeout "$(capped 200 170)" python3 tools/bench_losses.py --tune --tune-spec ce+kd --tune-tokens 2048 16384 \
    --tune-vocab 131072 --tune-block 2048 4096 --tune-warps 4 8 --tune-split 1 4 8 16 > /tmp/split-tune.txt 2>&1
  echo "bench_losses exit status: $? (124: timed out)" >> /tmp/split-tune.txt
  grep -v '^{' /tmp/split-tune.txt | tail -45

  section "(c) bench_head.py --specs ce+kd --splits 4 8 16"
  timeout "$(capped 170 40)" python3 tools/bench_head.py --specs ce+kd --splits 4 8 16 --rep-ms 200 > /tmp/split-head.txt 2>&1
  echo "bench_head exit status: $? (124: timed out)" >> /tmp/split-head.txt
  tail -12 /tmp/split-head.txt

  section "(d) SPLIT_DEFAULT = 8 in this copy: test_chunked_head.py -k 'kd or distill'"
  sed -i 's/^SPLIT_DEFAULT = .*/SPLIT_DEFAULT = 8/' fastlm/losses/triton/launcher.py
  grep -n "^SPLIT_DEFAULT" fastlm/losses/triton/launcher.py
  FASTLM_COMPILE=0 timeout "$(capped 90 5)" python3 -m pytest -q -p no:cacheprovider -rfEs \
    tests/losses/test_chunked_head.py -k "kd or distill" > /tmp/split-chunked.txt 2>&1
  echo "pytest exit status: $? (124: timed out)" >> /tmp/split-chunked.txt
  tail -6 /tmp/split-chunked.txt
  git checkout -q fastlm/losses/triton/launcher.py 2>/dev/null || sed -i 's/^SPLIT_DEFAULT = .*/SPLIT_DEFAULT = 1/' fastlm/losses/triton/launcher.py

  cp /tmp/split-*.txt "$OUT"/ 2>/dev/null
  echo "total $(( $(date +%s) - START )) s"
} 2>&1 | tee "$LOG"
