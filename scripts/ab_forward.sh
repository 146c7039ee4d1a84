#!/usr/bin/env bash
# Kernel times of chunk_linear_attn (scripts/kernel_times.py) for this tree and for other source trees
# built beside it, in one GPU session, so that versions meet on the same machine.
#   git archive <commit> | tar -x -C .gpu/old      (here, before the device call; or scripts/stage_gpu.sh)
#   OLD=old OUT=$OUT bash scripts/ab_forward.sh    (on the GPU machine, from the tree's root, built)
# OLD may name several trees ("old1 old2"): each is built (unless it already holds a build) and
# timed, then this tree, twice over, alternating. KT_ARGS=--backward times forward+backward instead
# (the backward's sweeps one after another, ATTNRNN_BWD_CONCURRENT=0, so that each kernel's time is
# its own). BITWISE=1 first saves each tree's outputs and gradients on fixed cases
# (scripts/outputs_of.py, with ATTNRNN_TC_WGMMA=63 and 127) and compares them with this tree's.
set -uo pipefail
OLD=${OLD:?set OLD to the directory of the other tree, or several separated by spaces}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
OUT=$OUT bash scripts/build_trees.sh $OLD || exit 1
if [ -n "${BITWISE:-}" ]; then
  for mask in 63 127; do
    for tree in $OLD "$PWD"; do
      label=$([ "$tree" = "$PWD" ] && echo this || basename "$tree")
      PYTHONPATH=$tree/python:$PWD/tests/python ATTNRNN_TC_WGMMA=$mask python3 scripts/outputs_of.py \
        "$OUT/outputs_${label}_$mask.pt" >"$OUT/outputs_${label}_$mask.log" 2>&1 ||
        { echo "mask $mask: saving the outputs of $label FAILED"; tail -5 "$OUT/outputs_${label}_$mask.log"; }
    done
    for tree in $OLD; do
      python3 scripts/outputs_of.py --compare "$OUT/outputs_$(basename "$tree")_$mask.pt" "$OUT/outputs_this_$mask.pt" 2>&1 |
        grep -v -i warn | head -30 | sed "s/^/mask $mask: /"
    done
  done | tee -a "$OUT/ab_bitwise.txt"
fi
for run in 1 2; do  # each tree twice, alternating, to see the run-to-run spread
  for tree in $OLD "$PWD"; do
    label=$([ "$tree" = "$PWD" ] && echo this || basename "$tree")
    PYTHONPATH=$tree/python ATTNRNN_BWD_CONCURRENT=0 python3 scripts/kernel_times.py ${KT_ARGS:-} 2>&1 |
      grep -v -i warn | sed "s/^/$label run$run /"
  done
done | tee -a "$OUT/ab_kernel_times.txt"
