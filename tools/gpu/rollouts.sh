#!/usr/bin/env bash
# Rollouts on one GPU: (a) the generation tests on CUDA (FlexAttention decode kernel against float64, the
# CUDA-graph step against eager), (b) tools/bench_rollouts.py for llama-350m (every decode mode and transformers'
# `generate`) and llama-1b, (c) the GRPO run of configs/grpo_gpu.yaml with its reward and timing per log record.
# Writes $OUT/rollouts.log and $OUT/grpo_gpu_metrics.jsonl; each section gets its share of the time budget and a
# failure does not stop the rest.
#   bash tools/gpu/rollouts.sh [BUDGET_S]           (repository root; default budget 450 s; OUT defaults to /tmp/out)
#   SMOKE=1 bash tools/gpu/rollouts.sh              (CPU: the same sections at tiny shapes, for Python errors)
BUDGET=${1:-450}; OUT=${OUT:-/tmp/out}
source "$(dirname "$0")/common.sh"
SMOKE=${SMOKE:-0}
PY=${PYTHON:-python3}
exec > >(tee "$OUT/rollouts.log") 2>&1
STATUS=()

share() {  # share NAME SHARE_PERCENT COMMAND...: run under its share of the budget, record status and seconds
    local name=$1 limit=$(( BUDGET * $2 / 100 )) started rc
    shift 2
    echo; echo "=== $name (limit ${limit}s, $(date +%T))"
    started=$(date +%s)
    timeout --kill-after=10 "$limit" "$@"
    rc=$?
    STATUS+=("$name: rc=$rc, $(( $(date +%s) - started ))s")
    echo "=== $name: rc=$rc"
}

$PY -c "import torch, triton, transformers; print('torch', torch.__version__, '| triton', triton.__version__, \
'| transformers', transformers.__version__, '|', torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU')"

share "a. generation tests (CUDA)" 22 $PY -m pytest -q -s -p no:cacheprovider tests/generation/test_generator_cuda.py

if [ "$SMOKE" = 1 ]; then
    share "b. bench (CPU smoke)" 27 $PY tools/bench_rollouts.py --cpu-smoke
    GRPO_ARGS=(model.hidden_size=64 model.num_layers=2 model.num_heads=4 model.num_kv_heads=2 model.intermediate_size=192
               model.max_seq_len=256 data.seq_len=256 data.micro_batch_size=4 rl.max_new_tokens=32 rl.prompts_per_rollout=4
               rl.eval_prompts=8 optimizer.lr=3e-3 trainer.steps=12 rl.warmup_steps=6 trainer.eval_every=6 trainer.log_every=2)
else
    share "b1. bench llama-350m" 27 \
        $PY tools/bench_rollouts.py --presets llama-350m --modes graph-sdpa,graph,compile,hf --hf-new-tokens 32
    share "b2. bench llama-1b" 13 $PY tools/bench_rollouts.py --presets llama-1b --modes graph,hf --hf-new-tokens 32
    GRPO_ARGS=()
fi

rm -rf /tmp/grpo_gpu
share "c. GRPO configs/grpo_gpu.yaml" 38 $PY -m fastlm train configs/grpo_gpu.yaml logging.wandb.enabled=false \
    run.output_dir=/tmp/grpo_gpu ${GRPO_ARGS[@]+"${GRPO_ARGS[@]}"}
if [ -f /tmp/grpo_gpu/metrics.jsonl ]; then
    cp /tmp/grpo_gpu/metrics.jsonl "$OUT/grpo_gpu_metrics.jsonl"
    $PY tools/rl_summary.py /tmp/grpo_gpu
fi

echo; echo "=== summary"
printf '%s\n' "${STATUS[@]}"
