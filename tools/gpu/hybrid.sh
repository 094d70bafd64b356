#!/usr/bin/env bash
# The hybrid Qwen3.5 family on one GPU: (a) the CUDA tests of Gated DeltaNet (fla-core's chunked kernel against
# the PyTorch form, packed documents, values and gradients) and of the CUDA-graph decode step over recurrent
# states, (b) training throughput at seq 8192 on packed documents for qwen3.5-0.8b and qwen3.5-2b beside
# transformers' own class on the same weights (bench_train --hf; fla-core's kernels on both sides when
# installed), (c) decode tokens/s of the generator beside transformers' generate, batch 64, 256 new tokens.
# fla-core is not on the machine's index: carry it (and einops, its one dependency) in .whl/ and run through
# run_all.sh, which installs .whl/*.whl:
#   bash tools/gpu/run_all.sh hybrid:540          # .whl/fla_core-0.6.0-py3-none-any.whl + .whl/einops-*.whl
#   bash tools/gpu/hybrid.sh [BUDGET_S]           # from the repository root; writes $OUT/hybrid.log
BUDGET=${1:-540}; OUT=${OUT:-/tmp/hybrid-out}; LOG="$OUT/hybrid.log"
source "$(dirname "$0")/common.sh"
: >"$LOG"
SMOKE=(); python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || SMOKE=(--cpu-smoke)
python3 -c "import importlib.util as u, torch, transformers; print('torch', torch.__version__, 'transformers',
transformers.__version__, '| fla-core', 'installed' if u.find_spec('fla') else 'MISSING (PyTorch form)',
'|', torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA: smoke run')" 2>&1 | tee -a "$LOG"

say "(a) Gated DeltaNet and the hybrid generator on CUDA"
run "$(min $(( $(left) - 300 )) 120)" python3 -m pytest -q -s -p no:cacheprovider -m gpu \
    tests/models/test_gated_deltanet.py tests/models/test_qwen3_5.py
if (( ${#SMOKE[@]} )); then
  run "$(min $(( $(left) - 20 )) 200)" python3 tools/bench_train.py --cpu-smoke --smoke-preset qwen3.5-tiny --hf
  run "$(min $(( $(left) - 5 )) 100)" python3 tools/bench_rollouts.py --cpu-smoke --smoke-preset qwen3.5-tiny
else
  say "(b) qwen3.5-0.8b and qwen3.5-2b, seq 8192, packed, beside transformers"
  run "$(min $(( $(left) - 150 )) 260)" python3 tools/bench_train.py --presets qwen3.5-0.8b qwen3.5-2b --batch 1 1 \
      --seq-len 8192 --variants packed packed+compile --hf
  say "(c) decode: batch 64, 128-token prompts, 256 new tokens, beside transformers' generate"
  run $(( $(left) - 5 )) python3 tools/bench_rollouts.py --presets qwen3.5-0.8b --modes graph,compile,hf \
      --batch 64 --new-tokens 256 --hf-new-tokens 64 --repeats 2 --out "$OUT"
fi
grep -E "^\| |passed|failed|error|exit |FAILED" "$LOG" | tail -60
