#!/usr/bin/env bash
# Issue 19 on one H200 (about 4 minutes): (a) the generation tests on CUDA (FlexAttention decode kernel vs
# float64, the CUDA-graph step vs eager), (b) tools/bench_rollouts.py for llama-350m and llama-1b, (c) the GRPO
# run of configs/grpo_gpu.yaml with its reward and timing per log record. Writes $OUT/i19.log and
# $OUT/grpo_gpu_metrics.jsonl; every section runs under its own time limit and a failure does not stop the rest.
#   OUT=/tmp/out bash tools/gpu/issue19.sh          (repository root; needs pydantic and pyyaml; no wandb)
#   SMOKE=1 OUT=/tmp/out bash tools/gpu/issue19.sh  (CPU: the same sections at tiny shapes, for Python errors)
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}
SMOKE=${SMOKE:-0}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
exec > >(tee "$OUT/i19.log") 2>&1
STATUS=()

section() {  # section NAME LIMIT_S COMMAND...: run under a time limit, record the exit status and seconds
    local name=$1 limit=$2 started rc
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

section "a. generation tests (CUDA)" 100 $PY -m pytest -q -s -p no:cacheprovider tests/generation/test_generator_cuda.py

if [ "$SMOKE" = 1 ]; then
    section "b. bench (CPU smoke)" 120 $PY tools/bench_rollouts.py --cpu-smoke
    GRPO_ARGS=(model.hidden_size=64 model.num_layers=2 model.num_heads=4 model.num_kv_heads=2 model.intermediate_size=192
               model.max_seq_len=256 data.seq_len=256 data.micro_batch_size=4 rl.max_new_tokens=32 rl.prompts_per_rollout=4
               rl.eval_prompts=8 optimizer.lr=3e-3 trainer.steps=12 rl.warmup_steps=6 trainer.eval_every=6 trainer.log_every=2)
else
    section "b1. bench llama-350m" 120 \
        $PY tools/bench_rollouts.py --presets llama-350m --modes graph-sdpa,graph,compile,hf --hf-new-tokens 32
    section "b2. bench llama-1b" 60 $PY tools/bench_rollouts.py --presets llama-1b --modes graph,hf --hf-new-tokens 32
    GRPO_ARGS=()
fi

rm -rf /tmp/grpo_gpu
section "c. GRPO configs/grpo_gpu.yaml" 170 $PY -m fastlm train configs/grpo_gpu.yaml logging.wandb.enabled=false \
    run.output_dir=/tmp/grpo_gpu ${GRPO_ARGS[@]+"${GRPO_ARGS[@]}"}
if [ -f /tmp/grpo_gpu/metrics.jsonl ]; then
    cp /tmp/grpo_gpu/metrics.jsonl "$OUT/grpo_gpu_metrics.jsonl"
    $PY tools/rl_summary.py /tmp/grpo_gpu
fi

echo; echo "=== summary"
printf '%s\n' "${STATUS[@]}"
