#!/usr/bin/env bash
# Rollouts on one GPU: (a) the generation tests on CUDA (FlexAttention decode kernels against references, the
# static generator's and the engine's CUDA-graph steps against eager), (b) tools/bench_rollouts.py --workload grpo
# per preset (the static generator, the continuous-batching engine and transformers' `generate` on one GRPO-shaped
# rollout: 64 prompts x G=8, 256-token prompts, lognormal lengths median 500 capped at 4096), (c) the GRPO run of
# configs/grpo_gpu.yaml (the engine samples) with its reward and timing per log record. SECTIONS picks them.
# Writes $OUT/rollouts.log, $OUT/bench_rollouts_grpo_<preset>.json and $OUT/grpo_gpu_metrics.jsonl; each section
# gets its share of the time budget and a failure does not stop the rest.
#   bash tools/gpu/rollouts.sh [BUDGET_S]              (repository root; default 470 s: sections a and b)
#   SECTIONS=c bash tools/gpu/rollouts.sh 300          (the GRPO run alone)
#   SMOKE=1 bash tools/gpu/rollouts.sh                 (CPU: the same sections at tiny shapes, for Python errors)
BUDGET=${1:-470}; OUT=${OUT:-/tmp/out}
source "$(dirname "$0")/common.sh"
SMOKE=${SMOKE:-0}
SECTIONS=${SECTIONS:-ab}
PRESETS=${PRESETS:-llama-350m llama-1b qwen3-0.6b}
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

if [[ $SECTIONS == *a* ]]; then
    share "a. generation tests (CUDA)" 20 $PY -m pytest -q -s -p no:cacheprovider tests/generation/test_engine_cuda.py \
        tests/generation/test_generator_cuda.py
fi

if [[ $SECTIONS == *b* ]]; then
    if [ "$SMOKE" = 1 ]; then
        share "b. bench grpo workload (CPU smoke)" 30 $PY tools/bench_rollouts.py --workload grpo --cpu-smoke
    else
        for preset in $PRESETS; do  # 350m: the goals' preset, the largest share; qwen3's static batches of 64 rows
            extra=(); [ "$preset" = qwen3-0.6b ] && extra=(--static-rows 64)  # (its KV: 114 KB a token)
            share "b. bench grpo workload $preset" $([ "$preset" = llama-350m ] && echo 28 || echo 24) \
                $PY tools/bench_rollouts.py --workload grpo --presets "$preset" --out "$OUT/grpo_$preset" "${extra[@]}"
        done
    fi
fi

if [[ $SECTIONS == *c* ]]; then
    if [ "$SMOKE" = 1 ]; then
        GRPO_ARGS=(model.hidden_size=64 model.num_layers=2 model.num_heads=4 model.num_kv_heads=2 model.intermediate_size=192
                   model.max_seq_len=256 data.seq_len=256 data.micro_batch_size=4 rl.max_new_tokens=32 rl.prompts_per_rollout=4
                   rl.eval_prompts=8 optimizer.lr=3e-3 trainer.steps=12 rl.warmup_steps=6 trainer.eval_every=6 trainer.log_every=2)
    else
        GRPO_ARGS=()
    fi
    rm -rf /tmp/grpo_gpu
    share "c. GRPO configs/grpo_gpu.yaml" 95 $PY -m fastlm train configs/grpo_gpu.yaml logging.wandb.enabled=false \
        run.output_dir=/tmp/grpo_gpu ${GRPO_ARGS[@]+"${GRPO_ARGS[@]}"}
    if [ -f /tmp/grpo_gpu/metrics.jsonl ]; then
        cp /tmp/grpo_gpu/metrics.jsonl "$OUT/grpo_gpu_metrics.jsonl"
        $PY tools/rl_summary.py /tmp/grpo_gpu
    fi
fi

echo; echo "=== summary"
printf '%s\n' "${STATUS[@]}"
