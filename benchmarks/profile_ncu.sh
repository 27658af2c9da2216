#!/usr/bin/env bash
# Nsight Compute counters of the MoE-LoRA kernels, per (path, stage) at chosen (M, R) points, on a
# GPU host whose runtime lets ncu read them (Firecracker; gVisor does not). Runs
# benchmarks/profile_moe_lora.py --eager under ncu with the clocks left alone (--clock-control
# none), kernels matching KERNEL_REGEX only, and writes a raw CSV (one row per launch: its NVTX
# range path/stage/M/R, duration, DRAM bytes and throughput, grid, waves, occupancy and its limits).
# Usage: bash benchmarks/profile_ncu.sh OUT_DIR "M:R ..." [KERNEL_REGEX]
set -u
out=${1:?OUT_DIR}; points=${2:?"M:R ..."}; regex=${3:-moe_lora}
mkdir -p "$out"
export PYTHONPATH=packages/core/src:packages/kernels/src:packages/backends/src:reference/src
metrics=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum
metrics+=,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed
metrics+=,launch__grid_size,launch__block_size,launch__waves_per_multiprocessor,launch__registers_per_thread
metrics+=,launch__occupancy_limit_shared_mem,launch__occupancy_limit_registers,launch__occupancy_limit_warps
metrics+=,launch__shared_mem_per_block_dynamic,launch__shared_mem_per_block_static
metrics+=,sm__warps_active.avg.pct_of_peak_sustained_active,sm__cycles_active.avg,sm__cycles_elapsed.avg
metrics+=,lts__t_bytes.sum,smsp__warp_issue_stalled_long_scoreboard_per_warp_active.pct
# shellcheck disable=SC2086  # the points are words
ncu --clock-control none --nvtx -k "regex:$regex" --metrics "$metrics" --csv --page raw --print-units base \
  python3 benchmarks/profile_moe_lora.py --eager 3 --points $points > "$out/ncu.csv" 2> "$out/ncu.err"
echo "ncu rc=$? $(wc -l < "$out/ncu.csv") lines"
