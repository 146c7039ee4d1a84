#!/usr/bin/env bash
# Times kernel choices made by environment settings against each other in one build (gpu_suite.sh
# built it): per setting, the kernel times of forward+backward (scripts/kernel_times.py, the
# backward's sweeps in one stream so that each kernel's time is its own), twice over, alternating;
# then the per-call times with the default overlap (scripts/tc_sweep.py, one JSON per setting).
#   MASKS="7 63" OUT=$OUT bash scripts/ab_masks.sh     (on the GPU machine, from the tree's root)
#   ENVS="ATTNRNN_TC_WGMMA=7;ATTNRNN_TC_WGMMA=7 ATTNRNN_WG_STATE_PASS=0" OUT=$OUT bash scripts/ab_masks.sh
# MASKS are values of ATTNRNN_TC_WGMMA; ENVS, when given, are settings separated by ';', each one or
# more VAR=value. KT_ARGS passes options to kernel_times.py (e.g. "--backward --shapes
# B1-T65536-H16-D128"); SWEEP=0 skips the per-call times.
set -uo pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:$PWD/python${PYTHONPATH:+:$PYTHONPATH}
if [ -z "${ENVS:-}" ]; then
  for m in ${MASKS:-7 63}; do ENVS="${ENVS:+$ENVS;}ATTNRNN_TC_WGMMA=$m"; done
fi
IFS=';' read -r -a settings <<<"$ENVS"
# a setting's label, in characters a device call brings back in file names
label_of() { echo "$1" | sed 's/ATTNRNN_//g; s/=/-/g; s/ /_/g'; }
for run in 1 2; do
  for setting in "${settings[@]}"; do
    env ATTNRNN_BWD_CONCURRENT=0 $setting python3 scripts/kernel_times.py ${KT_ARGS:---backward} 2>&1 |
      grep -v -i warn | sed "s/^/$(label_of "$setting") run$run /"
  done
done | tee -a "$OUT/ab_masks.txt"
if [ "${SWEEP:-1}" != 0 ]; then
  for setting in "${settings[@]}"; do
    label=$(label_of "$setting")
    env $setting python3 scripts/tc_sweep.py --out "$OUT/sweep_$label.json" 2>&1 | sed "s/^/$label per call /"
  done | tee -a "$OUT/ab_masks.txt"
fi
