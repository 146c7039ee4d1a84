#!/usr/bin/env bash
# Whether a change leaves the device code as it was: every CUDA translation unit compiled to PTX
# (sm_90a, as the build does) at REV and in the working tree, compared after removing the hashes
# nvcc gives anonymous namespaces. Needs nvcc only, no GPU. Prints one line per file; exits 1 if
# any file's PTX differs or a file of REV is gone.  Usage: scripts/ptx_diff.sh [REV=HEAD] [JOBS=2]
set -euo pipefail
rev=${1:-HEAD}
jobs=${JOBS:-2}
root=$(git rev-parse --show-toplevel)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/old" "$work/ptx"
git -C "$root" archive "$rev" | tar -x -C "$work/old"
export root work
compare() {
  local f=$1 name
  name=$(echo "$f" | tr / _)
  local flags=(-std=c++17 -gencode arch=compute_90a,code=sm_90a -O3 -DATTNRNN_WITH_CUDA -DATTNRNN_WGMMA
               --expt-relaxed-constexpr -I include -I csrc -I csrc/core -ptx)
  if [ ! -f "$work/old/$f" ]; then echo "new   $f"; return 0; fi
  (cd "$root" && nvcc "${flags[@]}" -o "$work/ptx/new_$name" "$f") || { echo "FAIL  $f (working tree)"; return 1; }
  (cd "$work/old" && nvcc "${flags[@]}" -o "$work/ptx/old_$name" "$f") || { echo "FAIL  $f ($rev)"; return 1; }
  sed -i 's/_GLOBAL__N__[0-9a-f]*_/_GLOBAL__N__/g' "$work/ptx/new_$name" "$work/ptx/old_$name"
  if cmp -s "$work/ptx/new_$name" "$work/ptx/old_$name"; then echo "same  $f"; else echo "DIFF  $f"; return 1; fi
}
export -f compare
cd "$root"
status=0
for f in $(cd "$work/old" && find csrc/cuda -name '*.cu' | sort); do
  [ -f "$f" ] || { echo "gone  $f"; status=1; }
done
find csrc/cuda -name '*.cu' | sort | xargs -P "$jobs" -I{} bash -c 'compare {}' || status=1
exit $status
