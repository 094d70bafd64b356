#!/usr/bin/env bash
# GRPO with and without LoRA from one warmed-up base, on one GPU: (1) configs/grpo_gpu.yaml's 200 supervised
# warm-up steps (and one rollout) train the base in full and checkpoint it; (2) GRPO from that checkpoint
# (`run.init_path`, no warm-up) for RL_STEPS steps, once in full and once with `model.lora` (rank 16, every
# linear, the adapters' lr LORA_LR_X times the full run's), the same seed, task and rollouts. Each run's
# reward and eval table (tools/rl_summary.py) goes to $OUT/lora_grpo.log and its metrics to
# $OUT/{full,lora}_metrics.jsonl, the two reward curves side by side for the LoRA issue.
#   bash tools/gpu/lora_grpo.sh [BUDGET_S]        # default 540 s; RL_STEPS (default 120), LORA_LR_X (default 10)
#   SMOKE=1 bash tools/gpu/lora_grpo.sh 600       # CPU: configs/grpo.yaml at a tiny shape, for script errors
BUDGET=${1:-540}; OUT=${OUT:-/tmp/lora-grpo-out}; LOG="$OUT/lora_grpo.log"
source "$(dirname "$0")/common.sh"
SMOKE=${SMOKE:-0}
RL_STEPS=${RL_STEPS:-120}
LORA_LR_X=${LORA_LR_X:-10}
RUNS=$(mktemp -d)
: >"$LOG"
if [ "$SMOKE" = 1 ]; then
  CONFIG=configs/grpo.yaml; WARMUP=4; RL_STEPS=4; LR=3e-3
  SHAPE=(model.hidden_size=64 model.num_layers=2 model.num_heads=4 model.num_kv_heads=2 model.intermediate_size=192
         model.max_seq_len=256 data.seq_len=256 data.micro_batch_size=4 rl.max_new_tokens=32 rl.prompts_per_rollout=4
         rl.eval_prompts=8 trainer.log_every=2 trainer.eval_every=2)
else
  CONFIG=configs/grpo_gpu.yaml; WARMUP=200; LR=6e-4; SHAPE=()
fi
COMMON=(logging.wandb.enabled=false ${SHAPE[@]+"${SHAPE[@]}"})

say "(1) the base: $WARMUP supervised warm-up steps and one rollout, checkpointed"
run "$(( $(left) / 4 ))" python3 -m fastlm train "$CONFIG" "${COMMON[@]}" run.name=base run.output_dir="$RUNS/base" rl.warmup_steps="$WARMUP" \
    trainer.steps=$(( WARMUP + 2 )) trainer.checkpoint_every=$(( WARMUP + 2 ))
for setup in full lora; do
  ARGS=(run.name="$setup" run.output_dir="$RUNS/$setup" run.init_path="$RUNS/base" rl.warmup_steps=0 trainer.steps="$RL_STEPS" trainer.checkpoint_every=0)
  [ "$setup" = lora ] && ARGS+=("model.lora={rank: 16, alpha: 32.0, targets: [all-linear]}"
                               optimizer.lr="$(python3 -c "print($LR * $LORA_LR_X)")")
  say "(2) GRPO from the base, $setup, $RL_STEPS steps"
  share=2; [ "$setup" = lora ] && share=1
  run "$(( $(left) / share - 10 ))" python3 -m fastlm train "$CONFIG" "${COMMON[@]}" "${ARGS[@]}"
  if [ -f "$RUNS/$setup/metrics.jsonl" ]; then
    cp "$RUNS/$setup/metrics.jsonl" "$OUT/${setup}_metrics.jsonl"
    python3 tools/rl_summary.py "$RUNS/$setup" 2>&1 | tee -a "$LOG"
  fi
done
rm -rf "$RUNS"
say "summary"; printf '%s\n' "${SUMMARY[@]}" | tee -a "$LOG"
