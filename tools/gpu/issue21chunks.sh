#!/usr/bin/env bash
# Issue 21: where the chunked head's time goes (tools/gpu/head_chunks.py: its variants interleaved, then a
# kernel profile; ~3 minutes) into $OUT/i21chunks.log. I21_CHUNKS_ARGS: other arguments for it.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/i21-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
timeout -k 5 "${I21_CHUNKS_S:-230}" python3 tools/gpu/head_chunks.py ${I21_CHUNKS_ARGS:-} 2>&1 | tee "$OUT/i21chunks.log"
