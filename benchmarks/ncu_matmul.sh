#!/usr/bin/env bash
# Nsight Compute on the MXFP4 matmul (issue 14: what bounds each kernel; docs/mxfp4.md), one device call:
#   bash benchmarks/ncu_matmul.sh [CASE ...]   CASE: N x K : M : CONFIG   (CONFIG: default, bf16, or
#                                              block_n,tiles,split_k,warps,stages,block_m)
# Each case profiles the 5th call (no CUDA graph) with the speed-of-light, compute, memory, occupancy and warp
# state sections; the full report goes to $OUT/ncu_<n>x<k>_m<m>_<config>.txt, a short summary to stdout.
set -uo pipefail
OUT=${OUT:-ncu-out}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-.}
cases=("$@")
[ ${#cases[@]} -eq 0 ] && cases=(4096x4096:1:default 28672x4096:1:default 6144x4096:160:default
  6144x4096:160:bf16 28672x4096:160:default 6144x4096:128:64,1,1,4,3,128)
for c in "${cases[@]}"; do
  IFS=: read -r shape m config <<<"$c"
  name="$OUT/ncu_${shape}_m${m}_${config//,/-}.txt"
  kernel=regex:_mxfp4_matmul
  [ "$config" = bf16 ] && kernel=regex:'gemm|gemv|sm90|cutlass|nvjet'
  timeout 240 ncu -k "$kernel" --launch-skip 4 --launch-count 1 --section SpeedOfLight \
    --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section Occupancy \
    --section LaunchStats --section WarpStateStats --section SchedulerStats \
    python benchmarks/mxfp4_matmul.py --profile "$config" --shapes "$shape" --ms "$m" >"$name" 2>&1
  echo "=== $shape M=$m $config"
  grep -E "^  [a-z_0-9]+|Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Block Limit|Grid Size|Dynamic Shared|Stall" \
    "$name" | head -40
done
