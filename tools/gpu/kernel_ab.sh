#!/usr/bin/env bash
# This tree's fused loss kernel against another version of kernel.py on one GPU, all in $OUT/kernel_ab.log:
#   (1) Nsight Compute on this tree's kernel alone (tools/gpu/kernel_ncu.sh: CE+kd at 1536 and 16384 rows, CE at
#       4096), within a quarter of the budget;
#   (2) the kernel's CUDA tests compiled (test_triton.py, test_triton_distillation.py, test_chunked_head.py,
#       test_lm_head.py), within a third of the budget;
#   (3) tools/profile/head_chunks.py: the head with this tree's kernel (`default`) and with KERNEL_FILE's
#       (`kernel-file`), interleaved, for ce, ce+z+grpo, ce+kd at 16384 and 65536 tokens, then a kernel-time
#       profile of both, in what is left.
#   KERNEL_FILE=.ab/kernel_before.py bash tools/gpu/kernel_ab.sh [BUDGET_S]    # default 580 s
#   KERNEL_FILE must take this tree's kernel signature (a body change); across a signature change compare trees:
#   tools/bench/make_baseline.sh + tools/gpu/losses.sh (bench_losses --baseline).
#   KERNEL_SPECS, KERNEL_ROUNDS: head_chunks' specs and rounds.
BUDGET=${1:-580}; OUT=${OUT:-/tmp/kernel-ab-out}
source "$(dirname "$0")/common.sh"
{
  bash tools/gpu/kernel_ncu.sh $(( BUDGET / 4 )) | grep -e "^==" -e "R1 bytes" -e duration -e dram__ -e issue_active -e warps_ -e stalled -e registers
  echo "== tests compiled"
  FASTLM_COMPILE=0 timeout $(( BUDGET / 3 )) python3 -m pytest -q -p no:cacheprovider -rfEs tests/losses/test_triton.py \
    tests/losses/test_triton_distillation.py tests/losses/test_chunked_head.py tests/losses/test_lm_head.py \
    -k "not tensor_parallel" 2>&1 | tail -6
  echo "== head_chunks: default (this tree's kernel) against kernel-file ($KERNEL_FILE)"
  timeout "$(left)" python3 tools/profile/head_chunks.py --specs ${KERNEL_SPECS:-ce ce+z+grpo ce+kd} --tokens 16384 65536 \
    --rounds ${KERNEL_ROUNDS:-7} --variants default kernel-file --kernel-file "$KERNEL_FILE" --profile-specs ce ce+kd \
    --profile-tokens 65536 2>&1 | grep -v -e UserWarning -e _warn_once
} 2>&1 | tee "$OUT/kernel_ab.log"
