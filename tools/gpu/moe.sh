#!/usr/bin/env bash
# MoE whole-model training steps on one GPU (tools/bench_moe.py): olmoe-1b-7b cut to 4 layers against its dense
# twin of equal active size, batch 4 x 2048, at 1, 4 and 8 micro-batches a step (AdamW's share of the step falls
# with accumulation), --profile at 1 (where the MoE step's extra time goes) and the MoE CUDA tests. Log: $OUT/moe.log.
# With BEFORE=DIR (another commit's tree: git archive COMMIT fastlm tools configs | tar -x -C DIR, carried), its
# rows at 1 micro-batch run first, in the same call, for a before/after.
#   bash tools/gpu/moe.sh [BUDGET_S]        # PRESET (default olmoe-1b-7b), LAYERS (4), BEFORE (none)
BUDGET=${1:-300}; OUT=${OUT:-/tmp/moe-out}; LOG="$OUT/moe.log"
source "$(dirname "$0")/common.sh"
ARGS=(tools/bench_moe.py --models "${PRESET:-olmoe-1b-7b}" --num-layers "${LAYERS:-4}" --batch 4 --seq-len 2048 --models-only)
if [ -n "${BEFORE:-}" ]; then
  say "before: $(cat "$BEFORE/COMMIT" 2>/dev/null || echo "$BEFORE"), 1 micro-batch a step"
  (cd "$BEFORE" && PYTHONPATH="$PWD:${PYTHONPATH#*:}" run "$(min 90 "$(left)")" python3 "${ARGS[@]}" --backends grouped)
fi
say "profile, 1 micro-batch a step"
run "$(min 130 "$(left)")" python3 "${ARGS[@]}" --backends grouped --profile
say "the MoE CUDA tests"
run "$(min 70 "$(left)")" python3 -m pytest -q -p no:cacheprovider -rfEs tests/models/test_moe_layer.py tests/models/test_moe_triton.py \
    tests/generation/test_moe_generator_cuda.py
for accumulation in 4 8; do
  say "$accumulation micro-batches a step"
  run "$(min 90 "$(( $(left) - 5 ))")" python3 "${ARGS[@]}" --backends grouped --grad-accumulation "$accumulation" --steps 5
done
say "summary"; printf '%s\n' "${SUMMARY[@]}" | tee -a "$LOG"
