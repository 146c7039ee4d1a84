#!/usr/bin/env bash
# Host share of a call, this tree against OLD trees built beside it (scripts/build_trees.sh): on GPU 0,
# scripts/call_host.py per config and tree (one process each, trees alternating), then
# scripts/host_paths.py per tree, then the TEST_FILES of tests/python on CUDA. The tests come last,
# never beside the timings: in the twentieth session's first run they shared the host with them and
# made torch.empty's host time 2.2 -> 3.9 us (raw/h200_host_path_s20_host_paths.txt).
#   scripts/stage_gpu.sh <branch> old=main                      (here)
#   cd .gpu && OLD=old OUT=$OUT bash scripts/host_ab.sh         (the device call, nvidia-h200-x2)
set -uo pipefail
OLD=${OLD:?set OLD to the other trees, e.g. OLD=old}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
CONFIGS=${CONFIGS:-"B8-T4096-H32-D64 --no-grad|B8-T4096-H32-D64 --no-grad --normalize|B4-T8192-H16-D128 --no-grad|B8-T4096-H32-D64 --backward|B4-T8192-H16-D128 --backward|B1-T65536-H16-D128 --backward"}
OUT=$OUT bash scripts/build_trees.sh . $OLD || exit 1
export CUDA_VISIBLE_DEVICES=0
IFS='|' read -ra configs <<<"$CONFIGS"
for config in "${configs[@]}"; do
  for tree in $OLD "$PWD"; do
    label=$([ "$tree" = "$PWD" ] && echo this || basename "$tree")
    PYTHONPATH=$tree/python:$PWD:$PWD/scripts python3 scripts/call_host.py $config 2>&1 | grep -v -i warn | sed "s/^/$label /"
  done
done | tee "$OUT/call_host.txt"
for tree in $OLD "$PWD"; do
  label=$([ "$tree" = "$PWD" ] && echo this || basename "$tree")
  PYTHONPATH=$tree/python:$PWD:$PWD/scripts python3 scripts/host_paths.py 2>&1 | grep -v -i warn | sed "s/^/$label /"
done | tee "$OUT/host_paths.txt"
SKIP_BUILD=1 OUT="$OUT/tests" TEST_FILES="${TEST_FILES:-test_eager_call.py test_gradcheck.py test_errors.py test_opcheck.py test_cuda.py}" \
  bash scripts/gpu_suite.sh tests | grep '^test_' | tee "$OUT/tests_summary.txt"
