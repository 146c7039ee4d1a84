#!/usr/bin/env bash
# Compiles the torch-free library with its CUDA kernels for other targets than the GPU machine's,
# without a GPU: by default sm_80 and sm_100a (Blackwell), where the wgmma kernels must compile to
# their empty bodies (ptxas rejects a wgmma instruction for any target but sm_90a). Each build goes
# to build/arch-<target>; any compiler error fails the script.
#   scripts/check_arch_builds.sh [TARGET ...]    (default: 80 100a; any CMAKE_CUDA_ARCHITECTURES entry)
# JOBS (default 2) sets ninja's parallel jobs; CXX (default /usr/bin/g++ where it exists) the host
# compiler. A build takes minutes per target on two cores.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p build
targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(80 100a)
cxx=${CXX:-}
[ -z "$cxx" ] && [ -x /usr/bin/g++ ] && cxx=/usr/bin/g++
compilers=()
[ -n "$cxx" ] && compilers=(-DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_CUDA_HOST_COMPILER="$cxx")

for target in "${targets[@]}"; do
  dir=build/arch-$target
  echo "== $target -> $dir"
  start=$(date +%s)
  cmake -S . -B "$dir" -G Ninja -DATTNRNN_BUILD_TORCH=OFF -DATTNRNN_CUDA=ON \
    -DATTNRNN_CUDA_ARCHITECTURES="$target" "${compilers[@]}" >"$dir.configure.log" 2>&1 ||
    { tail -30 "$dir.configure.log"; exit 1; }
  grep "attnrnn: CUDA architectures" "$dir.configure.log"
  ninja -C "$dir" -j "${JOBS:-2}" attnrnn >"$dir.build.log" 2>&1 ||
    { grep -E "error|Error" "$dir.build.log" | head -40; tail -20 "$dir.build.log"; exit 1; }
  echo "$target: built in $(( $(date +%s) - start )) s"
done
