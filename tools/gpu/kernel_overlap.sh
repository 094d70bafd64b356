#!/usr/bin/env bash
# Can CE+kd's loss kernel hide under the GEMMs when cuBLASLt leaves it SMs (a carve-out), and does the long-row
# schedule want prefetch? All in $OUT/kernel_overlap.log, ~4 minutes at the default budget (360 s):
#   (a) tools/profile/overlap_probe.py (two thirds of the budget): a chunk's dH + dW GEMMs beside another
#       chunk's loss kernel, one stream and two, cuBLAS and cuBLASLt with 0/8/16/24/32 SMs carved out of the GEMMs;
#   (b) bench_losses.py --tune (the rest): CE+kd's kernel alone at the long-row schedule (16384/8), prefetch 0/1,
#       split 2/4, V = 131072 and 262144.
#   bash tools/gpu/kernel_overlap.sh [BUDGET_S]
BUDGET=${1:-360}; OUT=${OUT:-/tmp/kernel-overlap-out}
source "$(dirname "$0")/common.sh"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>/dev/null
  echo "== (a) overlap probe ($(date +%T))"
  timeout $(( BUDGET * 2 / 3 )) python3 tools/profile/overlap_probe.py --specs ce+kd ce --rows 2048 4096 \
    --blas cublas cublaslt --carveouts 0 8 16 24 32 2>&1 | grep -v -e UserWarning -e _warn_once -e "Warning: Setting the SM"
  echo "== (b) prefetch at the long-row schedule ($(date +%T))"
  timeout $(( BUDGET / 3 )) python3 tools/bench_losses.py --tune --tune-spec ce+kd --tune-tokens 2048 16384 \
    --tune-vocab 131072 262144 --tune-block 16384 --tune-warps 8 --tune-prefetch 0 1 --tune-split 2 4 2>&1 | grep -v '^{' | tail -30
  echo "== done ($(date +%T))"
} 2>&1 | tee "$OUT/kernel_overlap.log"
