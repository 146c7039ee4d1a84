#!/usr/bin/env bash
# Host share of a call, this tree against OLD trees built beside it (scripts/build_trees.sh): on GPU 0,
# scripts/call_host.py per config and tree (one process each, trees alternating), then
# scripts/host_paths.py per tree; on GPU 1 (when there is one) the TEST_FILES of tests/python on CUDA.
#   scripts/stage_gpu.sh <branch> old=main                      (here)
#   cd .gpu && OLD=old OUT=$OUT bash scripts/host_ab.sh         (the device call, nvidia-h200-x2)
set -uo pipefail
OLD=${OLD:?set OLD to the other trees, e.g. OLD=old}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
CONFIGS=${CONFIGS:-"B8-T4096-H32-D64 --no-grad|B8-T4096-H32-D64 --no-grad --normalize|B4-T8192-H16-D128 --no-grad|B8-T4096-H32-D64 --backward|B4-T8192-H16-D128 --backward|B1-T65536-H16-D128 --backward"}
OUT=$OUT bash scripts/build_trees.sh . $OLD || exit 1
if [ "$(nvidia-smi -L | wc -l)" -gt 1 ]; then
  (export CUDA_VISIBLE_DEVICES=1; SKIP_BUILD=1 OUT="$OUT/tests" \
    TEST_FILES="${TEST_FILES:-test_gradcheck.py test_errors.py test_opcheck.py test_cuda.py}" \
    bash scripts/gpu_suite.sh tests | grep '^test_' >"$OUT/tests_summary.txt") &
fi
export CUDA_VISIBLE_DEVICES=0
IFS='|' read -ra configs <<<"$CONFIGS"
for config in "${configs[@]}"; do
  for tree in $OLD "$PWD"; do
    label=$([ "$tree" = "$PWD" ] && echo this || basename "$tree")
    PYTHONPATH=$tree/python:$PWD/scripts python3 scripts/call_host.py $config 2>&1 | grep -v -i warn | sed "s/^/$label /"
  done
done | tee "$OUT/call_host.txt"
for tree in $OLD "$PWD"; do
  label=$([ "$tree" = "$PWD" ] && echo this || basename "$tree")
  PYTHONPATH=$tree/python:$PWD/scripts python3 scripts/host_paths.py 2>&1 | grep -v -i warn | sed "s/^/$label /"
done | tee "$OUT/host_paths.txt"
wait
cat "$OUT/tests_summary.txt" 2>/dev/null
