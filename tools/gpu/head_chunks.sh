#!/usr/bin/env bash
# Where the chunked head's time over the GEMM floor goes (tools/profile/head_chunks.py: its variants interleaved,
# then a kernel profile; ~3 minutes) into $OUT/head_chunks.log.
#   bash tools/gpu/head_chunks.sh [BUDGET_S]     # default 230 s; HEAD_CHUNKS_ARGS: other arguments for it
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/head-chunks-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
timeout -k 5 "${1:-230}" python3 tools/profile/head_chunks.py ${HEAD_CHUNKS_ARGS:-} 2>&1 | tee "$OUT/head_chunks.log"
