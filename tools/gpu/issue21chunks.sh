#!/usr/bin/env bash
# Issue 21: the chunked head's cost by chunk size (tools/gpu/head_chunks.py, ~2 minutes) into $OUT/i21chunks.log.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/i21-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
timeout -k 5 "${I21_CHUNKS_S:-150}" python3 tools/gpu/head_chunks.py 2>&1 | tee "$OUT/i21chunks.log"
