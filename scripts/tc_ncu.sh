#!/usr/bin/env bash
# Profiles the tensor-core chunk scan with ncu after a gpu_suite build: stall reasons, throughput,
# and per-SASS-line samples (CSV) under $OUT. Usage: [KERNEL=regex] scripts/tc_ncu.sh NAME B T H D [--backward]
set -uo pipefail
name=$1; shift
metrics='regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio'
ncu --clock-control none --kernel-name regex:${KERNEL:-chunk_tc} --launch-skip "${SKIP:-2}" --launch-count 1 \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
  --section SchedulerStats --section MemoryWorkloadAnalysis --section SourceCounters --metrics "$metrics" \
  --export "$OUT/$name" --force-overwrite python3 scripts/tc_profile.py "$@" > "$OUT/$name.txt" 2>&1
ncu -i "$OUT/$name.ncu-rep" --page details >> "$OUT/$name.txt" 2>&1
ncu -i "$OUT/$name.ncu-rep" --page source --csv --print-source sass > "$OUT/$name.sass.csv" 2>/dev/null
grep -E "Duration|Throughput|Registers|Achieved Occupancy|Warp Cycles Per Issued|Theoretical Occ|Block Limit" "$OUT/$name.txt" | head -20
grep -E "stalled" "$OUT/$name.txt" | sort -k3 -t' ' | awk '{print $1, $NF}' | sort -k2 -g -r | head -8
