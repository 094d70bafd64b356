#!/usr/bin/env bash
# Long context on one GPU: the memory savers' CUDA tests, then tools/bench_train.py --long (qwen3-1.7b full
# fine-tune and qwen3-8b LoRA at 32k/64k/128k with and without tiling/offload, measured peak beside validate's
# prediction, transformers + Liger with gradient checkpointing where it fits). Writes $OUT/long.log.
#   bash tools/gpu/long.sh [BUDGET_S]      # LONG_ARGS adds bench arguments (e.g. "--presets qwen3-1.7b")
BUDGET=${1:-480}; OUT=${OUT:-/tmp/long-out}; LOG="$OUT/long.log"
source "$(dirname "$0")/common.sh"
: >"$LOG"
say "memory savers on CUDA"
run 120 python3 -m pytest -q -rf tests/models/test_memory_savers_cuda.py
say "bench_train --long"
run $(( $(left) - 5 )) python3 tools/bench_train.py --long --hf ${LONG_ARGS:-}
printf '%s\n' "${SUMMARY[@]}" | tee -a "$LOG"
