#!/usr/bin/env bash
# Times the kernel choices of ATTNRNN_TC_WGMMA against each other in one build (gpu_suite.sh built
# it): per mask, the kernel times of forward+backward (scripts/kernel_times.py, the backward's
# sweeps in one stream so that each kernel's time is its own), twice over, alternating; then the
# per-call times with the default overlap (scripts/tc_sweep.py, one JSON per mask).
#   MASKS="7 63" OUT=$OUT bash scripts/ab_masks.sh     (on the GPU machine, from the tree's root)
# KT_ARGS passes options to kernel_times.py (e.g. "--backward --shapes B1-T65536-H16-D128");
# SWEEP=0 skips the per-call times.
set -uo pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:$PWD/python${PYTHONPATH:+:$PYTHONPATH}
masks=${MASKS:-7 63}
for run in 1 2; do
  for m in $masks; do
    ATTNRNN_BWD_CONCURRENT=0 ATTNRNN_TC_WGMMA=$m python3 scripts/kernel_times.py ${KT_ARGS:---backward} 2>&1 |
      grep -v -i warn | sed "s/^/mask$m run$run /"
  done
done | tee -a "$OUT/ab_masks.txt"
if [ "${SWEEP:-1}" != 0 ]; then
  for m in $masks; do
    ATTNRNN_TC_WGMMA=$m python3 scripts/tc_sweep.py --out "$OUT/sweep_mask$m.json" 2>&1 | sed "s/^/mask$m per call /"
  done | tee -a "$OUT/ab_masks.txt"
fi
