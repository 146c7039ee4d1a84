#!/usr/bin/env bash
# Kernel times of chunk_linear_attn's forward (scripts/kernel_times.py) for this tree and for another
# source tree built beside it, in one GPU session, so that two versions meet on the same machine.
#   git archive <commit> | tar -x -C .gpu/old      (here, before the device call)
#   OLD=old OUT=$OUT bash scripts/ab_forward.sh    (on the GPU machine, from the tree's root, built)
# KT_ARGS=--backward times forward+backward instead (the backward's sweeps one after another,
# ATTNRNN_BWD_CONCURRENT=0, so that each kernel's time is its own).
set -uo pipefail
OLD=${OLD:?set OLD to the directory of the other tree}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
if [ -x /usr/bin/g++ ]; then export CC=/usr/bin/gcc CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++; fi
(cd "$OLD" && ATTNRNN_CUDA=ON ATTNRNN_BUILD_JOBS=$(nproc) python3 setup.py -q build_ext --inplace >"$OUT/build_old.log" 2>&1) ||
  { tail -20 "$OUT/build_old.log"; exit 1; }
for run in 1 2; do  # each tree twice, alternating, to see the run-to-run spread
  for tree in "$OLD" "$PWD"; do
    label=$([ "$tree" = "$PWD" ] && echo this || echo old)
    PYTHONPATH=$tree/python ATTNRNN_BWD_CONCURRENT=0 python3 scripts/kernel_times.py ${KT_ARGS:-} 2>&1 |
      grep -v -i warn | sed "s/^/$label run$run /"
  done
done | tee "$OUT/ab_forward.txt"
