# What every runner in tools/gpu/ starts with; a runner sets BUDGET (its seconds, from $1) and OUT's default,
# then sources this file:
#   BUDGET=${1:-180}; OUT=${OUT:-/tmp/NAME-out}; LOG="$OUT/NAME.log"
#   source "$(dirname "$0")/common.sh"
# It works from the repository root, makes and exports $OUT, puts this tree first on PYTHONPATH, turns wandb
# off and Python's output buffering off, runs pytest without pyproject's xdist workers, starts the clock, and
# gives the runners their helpers:
#   left              seconds of BUDGET left
#   min A B           the smaller number
#   section NAME      a header line with the time and the seconds left
#   say TEXT          a header line with the elapsed and left seconds, also appended to $LOG
#   run SECONDS CMD   CMD time-boxed, its output appended to $LOG, its exit status said and kept in SUMMARY
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
mkdir -p "$OUT"
export OUT PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" WANDB_MODE=disabled PYTHONUNBUFFERED=1
# pyproject's addopts run the CPU suite on two pytest-xdist workers; here the tests share one card and the
# image may lack xdist, so the runners' pytest calls run serially (a runner may still pass -n itself).
export PYTEST_ADDOPTS="-o addopts=-ra ${PYTEST_ADDOPTS:-}"
START=$(date +%s)
SUMMARY=()

left() { echo $(( BUDGET - ($(date +%s) - START) )); }
min() { echo $(( $1 < $2 ? $1 : $2 )); }
section() { echo; echo "== $1 ($(date +%T), $(left) s left)"; }
say() { echo "=== $* [t=$(( $(date +%s) - START ))s, $(left)s left]" | tee -a "$LOG"; }
run() {
  local limit=$1; shift
  if (( limit < 10 )); then say "skipped (no time left): $*"; return; fi
  timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$LOG" >/dev/null
  local status=${PIPESTATUS[0]}
  say "exit $status$( ((status == 124)) && echo ' (timed out)'): $*"
  SUMMARY+=("exit $status: $*")
}
