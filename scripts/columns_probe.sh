#!/usr/bin/env bash
# scripts/wgmma_columns_probe.cu on the GPU machine (nvcc only, no attnrnn build): every layout at its
# default shapes, then ncu on each layout at B8-T8192-H16 (the shape every layout fills): speed of
# light, pipe utilization, scheduler and warp-state statistics, and the stall reasons per issued
# instruction. Output under $OUT: columns_probe.txt, ncu_<layout>.txt, and a summary on stdout.
#   OUT=$OUT bash scripts/columns_probe.sh
set -uo pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
bin=/tmp/attnrnn_columns_probe
nvcc -std=c++17 -gencode arch=compute_90a,code=sm_90a -O3 -Xptxas -v --expt-relaxed-constexpr -DATTNRNN_WITH_CUDA \
  -DATTNRNN_WGMMA -I include -I csrc -I csrc/core -o "$bin" scripts/wgmma_columns_probe.cu \
  >"$OUT/columns_probe_build.txt" 2>&1 || { tail -20 "$OUT/columns_probe_build.txt"; exit 1; }
grep -E "registers|spill" "$OUT/columns_probe_build.txt"
"$bin" | tee "$OUT/columns_probe.txt"
stalls='regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio'
for layout in lib wg1-n64 wg2-n32 wg2-n64 wg4-n32; do
  # launch 0 is the checked run; profile the first timed one
  ncu --clock-control none --kernel-name 'regex:forward_kernel|chunk_wg_kernel' --launch-skip 1 --launch-count 1 \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section SchedulerStats \
    --section WarpStateStats --section Occupancy --metrics "$stalls" \
    "$bin" 8 8192 16 "$layout" >"$OUT/ncu_$layout.txt" 2>&1
  echo "== $layout (ncu, B8-T8192-H16)"
  grep -E "^ +(Duration|Compute \(SM\) Throughput|SM Busy|Issue Slots Busy|Active Warps Per Scheduler|Eligible Warps Per Scheduler|No Eligible|Warp Cycles Per Issued Instruction|Achieved Occupancy) " \
    "$OUT/ncu_$layout.txt" | sed 's/  */ /g'
  grep -E "stalled_.*per_issue_active" "$OUT/ncu_$layout.txt" | awk '{print $NF, $1}' | sort -g -r | head -5
done
