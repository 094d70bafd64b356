#!/usr/bin/env bash
# Issue 19's goal row again with the transformers baseline side by side (run 3's hf rows failed on the
# export): llama-350m compiled decode vs transformers `generate` on the same weights, one run. ~90 s.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python3 tools/bench_rollouts.py --presets llama-350m --modes compile,hf --hf-new-tokens 32 2>&1 | tee "$OUT/i19hf.log" \
    | grep -v "^  " | tail -20
