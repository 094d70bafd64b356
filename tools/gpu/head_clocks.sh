#!/usr/bin/env bash
# SM clock and power (nvidia-smi every 50 ms) while CE+kd's loss kernel runs alone (bench_losses.py, the default
# schedule at 1536 and 4096 rows) and inside the chunked head at 65536 tokens (head_chunks.py), medians per
# phase -> stdout; samples in $OUT/clocks.csv. Why the kernel is slower in the head (docs/tuning-log.md,
# entry 20).
#   bash tools/gpu/head_clocks.sh [BUDGET_S]     # default 240 s: half for the kernel alone, half in the head
BUDGET=${1:-240}; OUT=${OUT:-/tmp/head-clocks-out}
source "$(dirname "$0")/common.sh"
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader,nounits -lms 50 > "$OUT/clocks.csv" &
SMI=$!
sleep 1
rm -f "$OUT/marks.txt"
mark() { echo "$1 $(date +%s.%N)" >> "$OUT/marks.txt"; }
mark alone_start
timeout $(( BUDGET / 2 )) python3 tools/bench_losses.py --tune --tune-spec ce+kd --tune-tokens 1536 4096 --tune-vocab 131072 --tune-block 16384 --tune-warps 8 --tune-prefetch 1 --tune-split 2 --rep-ms 2000 2>&1 | grep "^| ce"
mark alone_end
timeout $(( BUDGET / 2 - 5 )) python3 tools/profile/head_chunks.py --specs ce+kd --tokens 65536 --rounds 5 --variants default --no-profile 2>&1 | grep "^| ce"
mark head_end
kill "$SMI"
python3 - <<'PY'
import os, datetime, statistics
out = os.environ["OUT"]
marks = dict((l.split()[0], float(l.split()[1])) for l in open(f"{out}/marks.txt"))
rows = []
for line in open(f"{out}/clocks.csv"):
    f = [x.strip() for x in line.split(",")]
    try:
        t = datetime.datetime.strptime(f[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
        rows.append((t, float(f[1]), float(f[2]), float(f[3]), float(f[4])))
    except ValueError:
        pass
for name, a, b in (("alone", marks["alone_start"], marks["alone_end"]), ("head", marks["alone_end"], marks["head_end"])):
    sel = [r for r in rows if a <= r[0] <= b]
    busy = [r for r in sel if r[3] > 200]
    for label, s in (("all", sel), ("power>200W", busy)):
        if s:
            print(f"{name} {label}: n={len(s)} sm MHz median {statistics.median(r[1] for r in s):.0f} min {min(r[1] for r in s):.0f}, mem {statistics.median(r[2] for r in s):.0f}, power median {statistics.median(r[3] for r in s):.0f} max {max(r[3] for r in s):.0f} W, temp max {max(r[4] for r in s):.0f}")
PY
