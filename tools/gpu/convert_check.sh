#!/usr/bin/env bash
# `fastlm convert --from-hf DIR --check --device cuda` (bf16, its own tolerance) on the tiny checkpoint
# tools/make_tiny_hf.py makes of every registered model_type: logits, greedy KV-cache decode, export round
# trip and unmapped tensors against transformers on the GPU (without CUDA: the fp32 CPU check, a smoke run).
#   bash tools/gpu/convert_check.sh [BUDGET_S]     # from the repository root; writes $OUT/convert_check.log
BUDGET=${1:-420}; OUT=${OUT:-/tmp/convert-check-out}; LOG="$OUT/convert_check.log"
source "$(dirname "$0")/common.sh"
: >"$LOG"
DEVICE=cuda; python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || DEVICE=cpu
TYPES=$(python3 -c "from fastlm.models.registry import hf_model_types; print(' '.join(hf_model_types()))")
say "device $DEVICE; model types: $TYPES"
run 120 python3 tools/make_tiny_hf.py "$OUT/tokenizer" --conversations 1  # trains the tokenizer the others copy
for model_type in $TYPES; do
  run 120 python3 tools/make_tiny_hf.py "$OUT/$model_type" --family "$model_type" --conversations 1 \
      --tokenizer-from "$OUT/tokenizer/hf-model"
  run "$(min $(( $(left) - 5 )) 120)" python3 -m fastlm convert --from-hf "$OUT/$model_type/hf-model" --check \
      --device "$DEVICE" --check-tokens 256 --check-new-tokens 16
done
grep -E "^parity|^  |checks|exit " "$LOG" | tail -120
