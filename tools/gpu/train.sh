#!/usr/bin/env bash
# The training step on one GPU (about 3 minutes at the default budget, 180 s, compiles included):
#   (b) bench_train --compare-cli at llama-350m (8 x 2048, packed ~300-token documents, compiled, Triton loss):
#       the CLI trainer's gap to bench_train's loop taken apart in one process (tools/compare_cli.py): rows
#       A bench loop, B the loop on the CLI loader's batches, C Trainer.train_step without read points, D with a
#       read every 10 steps, E `fastlm train`'s logged windows, F the loop again (GPU drift); SM clock and power
#       per row, a profile of device busy time against wall time (A, B, C) with the kernels that changed, and the
#       two setups diffed. Its --time-limit skips late rows rather than lose the report;
#   (a1) then the trainer's no-sync step tests (tests/engine/test_trainer_cuda.py);
#   (a2) tests/models/test_packed_attention_cuda.py and the llama-1b compare only with a larger budget.
# Writes $OUT/train.log only (tests, tables, a summary at the end); a failing section never stops the others.
#   bash tools/gpu/train.sh [BUDGET_S]     # from the repository root; each section gets a share of what is left
# TRAIN_CLI_STEPS: the CLI run's steps (default 40); TRAIN_1B_S: seconds the llama-1b compare needs (default 120).
# Without CUDA (a smoke run of this script) the GPU tests skip and the compare runs at its --cpu-smoke shape.
BUDGET=${1:-180}; OUT=${OUT:-/tmp/train-out}; LOG="$OUT/train.log"
source "$(dirname "$0")/common.sh"
: >"$LOG"
SMOKE=(); python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || SMOKE=(--cpu-smoke)
# /dev/shm for the trainer's final checkpoint (a 350M run writes ~4.2 GB) when it has room, else the temp dir
RUNS=/tmp; [ -d /dev/shm ] && (( $(df -Pk /dev/shm | awk 'NR==2 {print $4}') > 40000000 )) && RUNS=/dev/shm
export TMPDIR=$RUNS

say "environment (runs in $RUNS)"
python3 -c "import torch, triton, pydantic; print('torch', torch.__version__, 'triton', triton.__version__, 'pydantic',
pydantic.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA: smoke run')" 2>&1 | tee -a "$LOG"

# The decomposition first (its report prints before its own limit), then the sync tests in what is left.
COMPARE_S=$(min $(( $(left) - 65 )) 115)  # from its start; the box adds imports and a last section's overrun
say "(b) CLI trainer's gap to bench_train, llama-350m (report within ~${COMPARE_S}s)"
run $(( COMPARE_S + 25 )) env -u OUT TORCH_LOGS=recompiles python3 tools/bench_train.py --compare-cli \
    --presets llama-350m --batch 8 --seq-len 2048 --cli-steps "${TRAIN_CLI_STEPS:-40}" --log-every 10 --profile-steps 3 \
    --time-limit "$COMPARE_S" "${SMOKE[@]}"
say "(a1) trainer step without syncs"
run "$(min $(( $(left) - 3 )) 90)" python3 -m pytest -v -s -p no:cacheprovider tests/engine/test_trainer_cuda.py
if (( $(left) > 60 )); then
  say "(a2) packed attention on CUDA"
  run $(( $(left) - 40 )) python3 -m pytest -v -p no:cacheprovider tests/models/test_packed_attention_cuda.py
fi
if (( $(left) > ${TRAIN_1B_S:-120} )); then
  say "(b) CLI trainer's gap to bench_train, llama-1b"
  run $(( $(left) - 5 )) env -u OUT python3 tools/bench_train.py --compare-cli --presets llama-1b --batch 4 \
      --seq-len 2048 --cli-steps 30 --log-every 10 --time-limit $(( $(left) - 25 )) "${SMOKE[@]}"
else
  say "llama-1b compare skipped: $(left)s left, it needs ${TRAIN_1B_S:-120}s (raise the budget to run it)"
fi

say "summary"
{
  printf '%s\n' "${SUMMARY[@]}"
  grep -E "::[^ ]+ (PASSED|FAILED|ERROR|SKIPPED)|^(FAILED|ERROR|SKIPPED) |(passed|failed|skipped|error)[a-z, 0-9]* in [0-9.]+s" "$LOG"
  grep -i "recompiling" "$LOG" | head -5  # TORCH_LOGS=recompiles: why dynamo compiled again
  awk '/^== CLI gap/ {on = 1} on {print} /^(alike:|FAILED sections)/ {on = 0}' "$LOG"
} >"$OUT/.summary"
tee -a "$LOG" <"$OUT/.summary"; rm -f "$OUT/.summary"
