#!/usr/bin/env bash
# Builds attnrnn with CUDA in place in each tree given, side by side (the cores shared between them),
# with the system g++ (scripts/gpu_suite.sh says why). A tree that already holds a build is left as
# it is. Logs: $OUT/build_<tree>.log. Exits 1 if any build failed.
#   OUT=$OUT bash scripts/build_trees.sh TREE...       (scripts/ab_forward.sh, scripts/ab_suite.sh)
set -uo pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
if [ -x /usr/bin/g++ ]; then export CC=/usr/bin/gcc CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++; fi
per_tree=$(( $(nproc) / $# ))
[ "$per_tree" -ge 1 ] || per_tree=1
for tree in "$@"; do
  ls "$tree"/python/attnrnn/_C*.so >/dev/null 2>&1 && continue
  log="$OUT/build_$(basename "$(realpath "$tree")").log"
  (cd "$tree" && rm -rf build/cmake-py* &&
    ATTNRNN_CUDA=ON ATTNRNN_BUILD_JOBS=$per_tree python3 setup.py -q build_ext --inplace >"$log" 2>&1) ||
    { echo "build of $tree FAILED"; tail -20 "$log"; exit 1; } &
done
status=0
for job in $(jobs -p); do wait "$job" || status=1; done
exit $status
