#!/usr/bin/env bash
# The fused kernel's split rows (SPLIT programs per row, one launch exchanging stats; with distillation for rows
# over 65536 columns) on one GPU, all in $OUT/split_rows.log. About 9 minutes at the default budget (540 s):
#   (a) <=100 s tests compiled: test_triton_distillation.py (split_rows: the one-launch exchange against
#              float64) and test_chunked_head.py + test_lm_head.py (every child chunked, the split default);
#   (b) <=90 s  bench_losses.py --tune: CE+kd's kernel alone at 2048 and 16384 tokens, V = 32000, 152064,
#              262144, split 1/2/4/8/16 at 4096/4 (a short row's default); then V = 32000, 131072, 152064,
#              262144 at 16384/8 (a long row's), split 1/2/4/8;
#   (c) <=130 s tools/profile/head_chunks.py: CE+kd's chunked head, default (split rows) and `unsplit` (4096/4,
#              one program a row) interleaved at 16384 and 65536 tokens, then a kernel-time profile of both and
#              the floor at 16384;
#   (d) the rest: bench_head.py (SPLIT_HEAD_SPECS, default ce, ce+z+grpo, ce+kd at 16384 and 65536 x 2048 x
#              131072: the floor, the chunked and full heads, Liger, CCE).
#   bash tools/gpu/split_rows.sh [BUDGET_S]
# SPLIT_SECTIONS="a c": only those; SPLIT_VARIANTS / SPLIT_PROFILE_TOKENS: head_chunks.py's variants and
# profile size in (c). A failing or overrunning section prints its traceback; the next runs.
BUDGET=${1:-540}; OUT=${OUT:-/tmp/split-rows-out}; LOG="$OUT/split_rows.log"
source "$(dirname "$0")/common.sh"
SECTIONS=${SPLIT_SECTIONS:-a b c d}
capped() { local cap=$1 reserve=$2; local t=$(( $(left) - reserve )); echo $(( t < cap ? (t > 20 ? t : 20) : cap )); }
wanted() { [[ " $SECTIONS " == *" $1 "* ]]; }

{
  section "environment"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  python3 -c "import torch, triton, pydantic; print('torch', torch.__version__, 'triton', triton.__version__, 'pydantic', pydantic.__version__, 'cuda', torch.cuda.is_available())"
  grep -n "^SPLIT_SEGMENT_COLUMNS" fastlm/losses/triton/launcher.py

  if wanted a; then
    section "(a) tests compiled: test_triton_distillation.py, test_chunked_head.py, test_lm_head.py"
    FASTLM_COMPILE=0 timeout "$(capped 100 360)" python3 -m pytest -q -p no:cacheprovider -rfEs \
      tests/losses/test_triton_distillation.py tests/losses/test_chunked_head.py tests/losses/test_lm_head.py \
      -k "not tensor_parallel" > /tmp/split-tests.txt 2>&1
    echo "pytest exit status: $? (124: timed out)" >> /tmp/split-tests.txt
    tail -8 /tmp/split-tests.txt
  fi

  if wanted b; then
    section "(b) bench_losses.py --tune: CE+kd's kernel alone, programs per row x vocabulary"
    timeout "$(capped 90 320)" python3 tools/bench_losses.py --tune --tune-spec ce+kd --tune-tokens 2048 16384 \
      --tune-vocab 32000 152064 262144 --tune-block 4096 --tune-warps 4 --tune-split 1 2 4 8 16 > /tmp/split-tune.txt 2>&1
    echo "bench_losses exit status: $? (124: timed out)" >> /tmp/split-tune.txt
    grep -v '^{' /tmp/split-tune.txt | tail -36
    timeout "$(capped 60 250)" python3 tools/bench_losses.py --tune --tune-spec ce+kd --tune-tokens 2048 16384 \
      --tune-vocab 32000 131072 152064 262144 --tune-block 16384 --tune-warps 8 --tune-split 1 2 4 8 > /tmp/split-tune-big.txt 2>&1
    echo "bench_losses exit status: $? (124: timed out)" >> /tmp/split-tune-big.txt
    grep -v '^{' /tmp/split-tune-big.txt | tail -40
  fi

  if wanted c; then
    section "(c) head_chunks.py: CE+kd chunked head, variants ${SPLIT_VARIANTS:-default unsplit} interleaved; profile"
    timeout "$(capped 130 140)" python3 tools/profile/head_chunks.py --specs ce+kd --tokens 16384 65536 --rounds 7 \
      --variants ${SPLIT_VARIANTS:-default unsplit} --profile-specs ce+kd --profile-tokens ${SPLIT_PROFILE_TOKENS:-16384} \
      > /tmp/split-chunks.txt 2>&1
    echo "head_chunks exit status: $? (124: timed out)" >> /tmp/split-chunks.txt
    grep -v -e UserWarning -e _warn_once /tmp/split-chunks.txt | head -80  # the comparison rows first
  fi

  if wanted d; then
    section "(d) bench_head.py at 16384 and 65536"
    timeout "$(capped 600 5)" python3 tools/bench_head.py --specs ${SPLIT_HEAD_SPECS:-ce ce+z+grpo ce+kd} --rep-ms 200 > /tmp/split-head.txt 2>&1
    echo "bench_head exit status: $? (124: timed out)" >> /tmp/split-head.txt
    tail -10 /tmp/split-head.txt
  fi

  cp /tmp/split-*.txt "$OUT"/ 2>/dev/null
  echo "total $(( $(date +%s) - START )) s"
} 2>&1 | tee "$LOG"
