#!/usr/bin/env bash
# The whole pytest suite on a GPU machine, where the CUDA paths run (CPU CI skips them or takes other
# kernels): every failure and error printed by name (-rfE), the 30 slowest tests, a JUnit XML beside the log.
# Time-boxed by its budget: pytest gets SIGINT 20 s before the end, so the tests that ran still report.
#   bash tools/gpu/suite.sh [BUDGET_S] [PYTEST ARGS...]   # default: the whole of tests/; writes $OUT/suite.log
#   bash tools/gpu/run_all.sh suite:540                    # one device call
BUDGET=${1:-540}; OUT=${OUT:-/tmp/suite-out}; LOG="$OUT/suite.log"
source "$(dirname "$0")/common.sh"
shift $(( $# > 0 ? 1 : 0 ))
TARGETS=("${@:-tests}")
: >"$LOG"
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available()
else 'no CUDA: the CPU suite'); import pytest, hypothesis, peft" 2>&1 | tee -a "$LOG"

say "pytest ${TARGETS[*]}"
if (( $(left) < 40 )); then say "no time left for pytest (budget $BUDGET s)"; exit 124; fi
timeout -s INT -k 15 $(( $(left) - 20 )) python3 -m pytest -q -p no:cacheprovider -rfE --durations=30 \
    --junitxml="$OUT/suite.xml" "${TARGETS[@]}" 2>&1 | tee -a "$LOG" >/dev/null
status=${PIPESTATUS[0]}
say "pytest exit $status$( ((status == 124 || status == 130 || status == 2)) && echo ' (interrupted at the budget?)')"
grep -E "^(FAILED|ERROR) |passed|failed|^=+ slowest" "$LOG" | tail -80
exit "$status"
