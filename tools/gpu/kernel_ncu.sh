#!/usr/bin/env bash
# Nsight Compute on the fused loss kernel alone (tools/profile/kernel_ncu.py): CE+kd at the head's piece
# (1536 rows) and at 16384 rows, CE at 4096 rows for comparison (V = 131072). Output: $OUT/kernel_ncu.log.
#   bash tools/gpu/kernel_ncu.sh [BUDGET_S]     # default 300 s (three profiled launches, compiles included)
BUDGET=${1:-300}; OUT=${OUT:-/tmp/kernel-ncu-out}
source "$(dirname "$0")/common.sh"
METRICS=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,sm__cycles_elapsed.avg.per_second,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__inst_executed.sum,sm__instruction_throughput.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,smsp__warps_active.avg.per_cycle_active,smsp__warps_eligible.avg.per_cycle_active,lts__t_sector_hit_rate.pct,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,smsp__average_warp_latency_issue_stalled_long_scoreboard.ratio,smsp__average_warp_latency_issue_stalled_barrier.ratio,launch__registers_per_thread,launch__occupancy_limit_registers
{
  nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv,noheader
  for shape in "ce+kd 1536" "ce+kd 16384" "ce 4096"; do
    set -- $shape
    echo "== $1 $2"
    timeout $(( BUDGET / 3 )) ncu --clock-control none -k regex:lm_loss_kernel --launch-skip 1 --launch-count 1 --metrics "$METRICS" \
      python3 tools/profile/kernel_ncu.py --spec "$1" --tokens "$2" 2>&1 | grep -v "^==PROF==" | tail -30
  done
} 2>&1 | tee "$OUT/kernel_ncu.log"
