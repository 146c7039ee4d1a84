#!/usr/bin/env bash
# One kernel launch under ncu (the second that matches: the first is a warm-up or a checked run),
# with warp-stall samples per SASS instruction, summarized on stdout: duration, registers, cycles
# per issued instruction, DRAM and memory throughput, L2 hit rate, occupancy, then
# scripts/stall_sites.py's samples per opcode and reason and its top instructions. Files:
# OUTDIR/NAME.ncu-rep, NAME.txt (ncu's pages), NAME.sass.csv (per instruction).
#   scripts/ncu_sites.sh OUTDIR NAME "KERNEL FILTER" COMMAND...
#   e.g. scripts/ncu_sites.sh out lib "--kernel-name regex:chunk_wg_kernel" /tmp/probe 8 8192 16 lib
# The filter is split into words unglobbed (regexes may hold * and parentheses). Used by
# scripts/stall_sites.sh and scripts/profile_sweeps.sh.
set -uo pipefail
set -f
out=$1 name=$2 filter=$3
shift 3
# shellcheck disable=SC2086  # the filter: ncu options, split on purpose
ncu --clock-control none $filter --launch-skip 1 --launch-count 1 \
  --section SourceCounters --section WarpStateStats --section LaunchStats --section SpeedOfLight \
  --section MemoryWorkloadAnalysis --section Occupancy \
  --metrics smsp__inst_executed.sum,sm__cycles_elapsed.avg --export "$out/$name" --force-overwrite \
  "$@" >"$out/$name.txt" 2>&1
ncu -i "$out/$name.ncu-rep" --page details >>"$out/$name.txt" 2>&1
ncu -i "$out/$name.ncu-rep" --page source --csv --print-source sass >"$out/$name.sass.csv" 2>>"$out/$name.txt"
echo "== $name ($*)"
grep -E "^ +(Duration|Registers Per Thread|Warp Cycles Per Issued Instruction|smsp__inst_executed.sum|sm__cycles_elapsed.avg|DRAM Throughput|Memory Throughput|L2 Hit Rate|Achieved Occupancy|Theoretical Occupancy|Mem Busy|Max Bandwidth) " \
  "$out/$name.txt" | sed 's/  */ /g' | sort -u
python3 scripts/stall_sites.py "$out/$name.sass.csv" "${TOP:-25}"
