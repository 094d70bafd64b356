#!/usr/bin/env bash
# Where the chunked head's time over the GEMM floor goes (tools/profile/head_chunks.py: its variants interleaved,
# then a kernel profile; ~3 minutes) into $OUT/head_chunks.log.
#   bash tools/gpu/head_chunks.sh [BUDGET_S]     # default 230 s; HEAD_CHUNKS_ARGS: other arguments for it
BUDGET=${1:-230}; OUT=${OUT:-/tmp/head-chunks-out}
source "$(dirname "$0")/common.sh"
timeout -k 5 "$BUDGET" python3 tools/profile/head_chunks.py ${HEAD_CHUNKS_ARGS:-} 2>&1 | tee "$OUT/head_chunks.log"
