#!/usr/bin/env bash
# Issue 19 on one H200 (about 4 minutes): (a) the generation tests on CUDA (FlexAttention decode kernel vs
# float64, the CUDA-graph step vs eager), (b) tools/bench_rollouts.py for llama-350m and llama-1b, (c) the GRPO
# run of configs/grpo_gpu.yaml with its reward and timing per log step. Writes $OUT/i19.log and
# $OUT/grpo_gpu_metrics.jsonl; every section runs under its own time limit and a failure does not stop the rest.
#   OUT=/tmp/out bash tools/gpu/issue19.sh        (from the repository root; needs pydantic and pyyaml)
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
LOG="$OUT/i19.log"
export PYTHONPATH=$PWD
exec > >(tee "$LOG") 2>&1
STATUS=()

section() {  # section NAME LIMIT_S COMMAND...: run, time and record the exit status
    local name=$1 limit=$2 started rc
    shift 2
    echo; echo "=== $name (limit ${limit}s, $(date +%T))"
    started=$(date +%s)
    timeout --kill-after=10 "$limit" "$@"
    rc=$?
    STATUS+=("$name: rc=$rc, $(( $(date +%s) - started ))s")
    echo "=== $name: rc=$rc"
}

python -c "import torch, triton, transformers; print('torch', torch.__version__, '| triton', triton.__version__, \
'| transformers', transformers.__version__, '|', torch.cuda.get_device_name())"

section "a. generation tests (CUDA)" 75 \
    python -m pytest -q -s -p no:cacheprovider tests/generation/test_generator_cuda.py tests/generation/test_kv_cache.py

section "b1. bench llama-350m" 110 \
    python tools/bench_rollouts.py --presets llama-350m --modes graph-sdpa,graph,compile,hf --hf-new-tokens 32
section "b2. bench llama-1b" 45 \
    python tools/bench_rollouts.py --presets llama-1b --modes graph,hf --hf-new-tokens 32

rm -rf /tmp/grpo_gpu
section "c. GRPO configs/grpo_gpu.yaml" 170 \
    python -m fastlm train configs/grpo_gpu.yaml logging.wandb.enabled=false run.output_dir=/tmp/grpo_gpu
if [ -f /tmp/grpo_gpu/metrics.jsonl ]; then
    cp /tmp/grpo_gpu/metrics.jsonl "$OUT/grpo_gpu_metrics.jsonl"
    python tools/rl_summary.py /tmp/grpo_gpu
fi

echo; echo "=== summary"
printf '%s\n' "${STATUS[@]}"
