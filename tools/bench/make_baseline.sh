#!/usr/bin/env bash
# Write another commit's fastlm (default: main) to .baseline/fastlm_base, imports rewritten to fastlm_base, so one
# process can time it next to this tree's fastlm (before/after in one run, on the same GPU):
#   bash tools/bench/make_baseline.sh [COMMIT [DIR]]   # run locally (needs git history); DIR defaults to .baseline (ignored)
# then carry .baseline to the device for `tools/bench_losses.py --baseline .baseline` (tools/gpu/losses.sh) or
# `tools/profile/host_ops.py --baseline .baseline`.
set -euo pipefail
commit=${1:-main}
root=$(git rev-parse --show-toplevel)
out=${2:-$root/.baseline}
rm -rf "$out"
mkdir -p "$out"
git -C "$root" archive "$commit" fastlm | tar -x -C "$out"
mv "$out/fastlm" "$out/fastlm_base"
find "$out/fastlm_base" -name '*.py' -exec sed -E -i \
  -e 's/\bfastlm\./fastlm_base./g' -e 's/\bfrom fastlm import\b/from fastlm_base import/g' -e 's/^import fastlm$/import fastlm_base/' {} +
git -C "$root" rev-parse "$commit" > "$out/COMMIT"
echo "baseline $(cat "$out/COMMIT") written to $out/fastlm_base ($(find "$out/fastlm_base" -name '*.py' | wc -l) files)"
