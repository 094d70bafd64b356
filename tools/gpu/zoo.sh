#!/usr/bin/env bash
# The model zoo on one GPU: (a) the CUDA tests of the attention paths and the generator (per-layer windows
# through FlexAttention, SDPA and the CUDA-graph decode step; Gemma 2's softcaps, GPT-OSS's sinks, Gemma 4's two head widths and shared KV), then (b) training throughput at real shapes
# side by side with transformers' own model class on the same weights (bench_train --hf: bf16, SDPA, fused
# AdamW, Liger's fused linear CE when it imports): qwen3-0.6b and llama3.2-1b at seq 8192 on packed rows,
# compiled blocks, and (c) qwen3-0.6b at seq 32768 with activation checkpointing.
#   bash tools/gpu/zoo.sh [BUDGET_S]     # from the repository root; writes $OUT/zoo.log
BUDGET=${1:-540}; OUT=${OUT:-/tmp/zoo-out}; LOG="$OUT/zoo.log"
source "$(dirname "$0")/common.sh"
: >"$LOG"
SMOKE=(); python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || SMOKE=(--cpu-smoke)
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__,
torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA: smoke run')" 2>&1 | tee -a "$LOG"

say "(b) qwen3-0.6b and llama3.2-1b, seq 8192, packed, compiled, beside transformers"
if (( ${#SMOKE[@]} )); then
  run "$(min $(( $(left) - 20 )) 300)" python3 tools/bench_train.py --cpu-smoke --hf
else
  run "$(min $(( $(left) - 150 )) 330)" python3 tools/bench_train.py --presets qwen3-0.6b llama3.2-1b --batch 1 1 \
      --seq-len 8192 --variants packed+compile --hf
  say "(c) qwen3-0.6b, seq 32768, activation checkpointing"
  run "$(min $(( $(left) - 60 )) 150)" python3 tools/bench_train.py --presets qwen3-0.6b --batch 1 --seq-len 32768 \
      --variants packed+compile+ac --hf
fi
say "(a) attention paths and the generator on CUDA"
run $(( $(left) - 5 )) python3 -m pytest -q -p no:cacheprovider tests/models/test_packed_attention_cuda.py \
    tests/generation/test_generator_cuda.py tests/models/test_gemma4_cuda.py
grep -E "^\| |passed|failed|error|exit " "$LOG" | tail -60
