#!/usr/bin/env bash
# On-policy distillation beside GRPO alone and offline KD (tools/bench_opd.py), time-boxed: a qwen3-1.7b teacher
# trained here on the arithmetic-chain task (supervised warm-up + GRPO), then the qwen3-0.6b student per arm with
# the same steps and seeds. The table goes to $OUT/opd.log, the report to $OUT/bench_opd.json (rewritten after each
# arm) and the eval-reward plot to $OUT/bench_opd.png.
#   bash tools/gpu/opd.sh [BUDGET_S]    # TEACHER_WARMUP (80), TEACHER_STEPS (10), STUDENT_WARMUP (10), STEPS (15),
#                                       # ARMS (opd,gkd,grpo,kd; none: the teacher only), EXTRA: more bench_opd flags
# Two calls when one is too short: ARMS=none EXTRA="--keep-teacher runs/opd_teacher" first, then
# EXTRA="--teacher runs/opd_teacher" on the same (warm) machine.
BUDGET=${1:-540}; OUT=${OUT:-/tmp/opd-out}; LOG="$OUT/opd.log"
source "$(dirname "$0")/common.sh"
say "bench_opd: teacher ${TEACHER_WARMUP:-80}+${TEACHER_STEPS:-10}, students ${STUDENT_WARMUP:-10}+${STEPS:-15}, arms ${ARMS:-opd,gkd,grpo,kd} ${EXTRA:-}"
run "$(( $(left) - 5 ))" python3 tools/bench_opd.py --teacher-warmup "${TEACHER_WARMUP:-80}" \
    --teacher-steps "${TEACHER_STEPS:-10}" --student-warmup "${STUDENT_WARMUP:-10}" --steps "${STEPS:-15}" \
    --arms "${ARMS:-opd,gkd,grpo,kd}" --out "$OUT/bench_opd.json" --plot "$OUT/bench_opd.png" ${EXTRA:-}
say "summary"; printf '%s\n' "${SUMMARY[@]}" | tee -a "$LOG"
