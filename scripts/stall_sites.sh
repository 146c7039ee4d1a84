#!/usr/bin/env bash
# The library's 64-token forward sweep (chunk_wg_kernel, launched by scripts/wgmma_columns_probe.cu as
# layout "lib") against the probe's wg1-n64 and its variants toward the library (wg1-n64-vN) on the
# same inputs, on the GPU machine with nvcc and ncu only: each timed and checked at B8-T8192-H16 (256
# blocks, two per SM) and B4-T8192-H16 (one per SM), then ncu's warp-stall samples per SASS instruction
# of the PROFILED layouts at B8-T8192-H16 (scripts/stall_sites.py). Output under $OUT: stall_sites.txt
# (the summary, also on stdout) and scripts/ncu_sites.sh's files per profiled layout.
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
  # launch 0 is the checked run; ncu_sites.sh profiles the first timed one
  bash scripts/ncu_sites.sh "$OUT" "$layout" "--kernel-name regex:forward_kernel|chunk_wg_kernel" "$bin" 8 8192 16 "$layout" |
    tee -a "$summary"
done
