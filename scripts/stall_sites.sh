#!/usr/bin/env bash
# The library's 64-token forward sweep (chunk_wg_kernel, launched by scripts/wgmma_columns_probe.cu as
# layout "lib") against the probe's wg1-n64 and its variants toward the library (wg1-n64-vN) on the
# same inputs, on the GPU machine with nvcc and ncu only: each timed and checked at B8-T8192-H16 (256
# blocks, two per SM) and B4-T8192-H16 (one per SM), then ncu's warp-stall samples per SASS instruction
# of the PROFILED layouts at B8-T8192-H16 (scripts/stall_sites.py). Output under $OUT: stall_sites.txt
# (the summary, also on stdout), sass_<layout>.csv, ncu_sites_<layout>.txt.
#   OUT=$OUT bash scripts/stall_sites.sh        (PROFILED="lib wg1-n64" and TIMED, every variant, by default)
set -uo pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
timed=${TIMED:-lib wg1-n64 wg1-n64-v1 wg1-n64-v2 wg1-n64-v5 wg1-n64-v8 wg1-n64-v15}
profiled=${PROFILED:-lib wg1-n64}
bin=/tmp/attnrnn_columns_probe
nvcc -std=c++17 -gencode arch=compute_90a,code=sm_90a -O3 -lineinfo --expt-relaxed-constexpr -DATTNRNN_WITH_CUDA \
  -DATTNRNN_WGMMA -I include -I csrc -I csrc/core -o "$bin" scripts/wgmma_columns_probe.cu \
  >"$OUT/stall_build.txt" 2>&1 || { tail -20 "$OUT/stall_build.txt"; exit 1; }
summary=$OUT/stall_sites.txt
for shape in "8 8192 16" "4 8192 16"; do
  for layout in $timed; do "$bin" $shape "$layout"; done
done | tee "$summary"
for layout in $profiled; do
  rep=/tmp/stall_sites_$layout
  # launch 0 is the checked run; profile the first timed one
  ncu --clock-control none --kernel-name 'regex:forward_kernel|chunk_wg_kernel' --launch-skip 1 --launch-count 1 \
    --section SourceCounters --section WarpStateStats --section LaunchStats \
    --metrics smsp__inst_executed.sum,sm__cycles_elapsed.avg --export "$rep" --force-overwrite \
    "$bin" 8 8192 16 "$layout" >"$OUT/ncu_sites_$layout.txt" 2>&1
  ncu -i "$rep.ncu-rep" --page details >>"$OUT/ncu_sites_$layout.txt" 2>&1
  ncu -i "$rep.ncu-rep" --page source --csv --print-source sass >"$OUT/sass_$layout.csv" 2>>"$OUT/ncu_sites_$layout.txt"
  {
    echo "== $layout"
    grep -E "^ +(Duration|Registers Per Thread|Warp Cycles Per Issued Instruction|smsp__inst_executed.sum|sm__cycles_elapsed.avg) " \
      "$OUT/ncu_sites_$layout.txt" | sed 's/  */ /g' | sort -u
    python3 scripts/stall_sites.py "$OUT/sass_$layout.csv" 30
  } | tee -a "$summary"
done
