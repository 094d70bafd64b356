#!/usr/bin/env bash
# GRPO end to end on one GPU, fastlm beside TRL's GRPOTrainer (tools/bench_rl.py), time-boxed; the table goes to
# $OUT/rl_bench.log, the summaries and reward curves to $OUT/bench_rl.json (written after each side) and the plot
# to $OUT/bench_rl_rewards.png. TRL and its dependencies come from the carried wheels (run_all.sh installs them).
#   bash tools/gpu/rl_bench.sh [BUDGET_S]    # PRESETS (default llama-350m), WARMUP (100), STEPS (24), TRL_STEPS (12),
#                                            # EXTRA: more bench_rl flags (e.g. "--ignore-eos --lr 2e-5"), TAG: a name suffix
BUDGET=${1:-540}; OUT=${OUT:-/tmp/rl-bench-out}; LOG="$OUT/rl_bench.log"
source "$(dirname "$0")/common.sh"
say "bench_rl ${PRESETS:-llama-350m}: warm-up ${WARMUP:-100}, fastlm ${STEPS:-24} steps, TRL ${TRL_STEPS:-12} steps ${EXTRA:-}"
run "$(( $(left) - 5 ))" python3 tools/bench_rl.py --presets "${PRESETS:-llama-350m}" --warmup-steps "${WARMUP:-100}" \
    --steps "${STEPS:-24}" --trl-steps "${TRL_STEPS:-12}" --out "$OUT/bench_rl${TAG:-}.json" \
    --plot "$OUT/bench_rl${TAG:-}_rewards.png" ${EXTRA:-}
say "summary"; printf '%s\n' "${SUMMARY[@]}" | tee -a "$LOG"
