#!/usr/bin/env bash
# The GPU machine's whole job in one call: build attnrnn with CUDA, run the test suite on CUDA,
# optionally compute-sanitizer and the benchmarks. Logs and JSON go to $OUT (default ./out).
#   scripts/gpu_suite.sh [tests] [sanitize] [sweep] [bench] [fla]
# TEST_FILES="test_cuda.py ..." limits "tests" to those files of tests/python. "sweep" times the
# tensor-core scan at the training shapes with the library's segment rule and a forced split.
# "fla" installs .whl/fla_core-*.whl (copied from shared/wheels) so the benchmarks include fla.
set -uo pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
want() { [[ " $* " == *" all "* ]] || [[ " $STEPS " == *" $1 "* ]]; }
STEPS=" $* "
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"

if want fla && ls .whl/fla_core-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/fla_core-*.whl && export PYTHONPATH=/tmp/site
fi

# The image's default C++ compiler (/opt/gcc) puts its own copy of libstdc++'s locale machinery
# into shared libraries, which crashes when they format numbers inside torch's process: build
# with the system compiler, the one torch's libstdc++ belongs to.
if [ -x /usr/bin/g++ ]; then
  export CC=/usr/bin/gcc CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++
fi
echo "compilers: CXX=${CXX:-default} ($(${CXX:-c++} --version | head -1))"

rm -rf build/cmake-py*  # a fresh configure: a cached compiler from an earlier call would stick
start=$(date +%s)
if ! ATTNRNN_CUDA=ON ATTNRNN_BUILD_JOBS=$(nproc) python3 setup.py -q build_ext --inplace >"$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log"
  exit 1
fi
echo "build: $(( $(date +%s) - start )) s"
export PYTHONPATH=$PWD/python:$PWD/tests/python${PYTHONPATH:+:$PYTHONPATH}
grep -E "registers|spill" "$OUT/build.log" | sort | uniq -c | sort -rn | head -5 > "$OUT/ptxas.txt"

status=0
if want tests; then
  # One process per file, so that a crash in one cannot hide the others' results.
  files=$(ls tests/python/test_*.py)
  [ -n "${TEST_FILES:-}" ] && files=$(printf 'tests/python/%s ' $TEST_FILES)
  for f in $files; do
    python3 -m pytest -q -p no:cacheprovider "$f" -k "cuda" -rf >>"$OUT/pytest_cuda.log" 2>&1
    rc=$?
    [ $rc -ne 0 ] && [ $rc -ne 5 ] && status=1
    printf '%-48s %s\n' "$(basename "$f")" "$(tail -1 "$OUT/pytest_cuda.log")"
  done
fi
if want sweep; then
  # segments: 0 = the library's rule, 8 = forced (each in its own process: the knob is read once)
  for seg in 0 8; do
    PYTHONPATH=$PWD:$PYTHONPATH ATTNRNN_TC_SEGMENTS=$seg python3 scripts/tc_sweep.py --out "$OUT/sweep_seg$seg.json" 2>&1 |
      sed "s/^/seg=$seg /"
  done
fi
if want sanitize; then
  for tool in memcheck racecheck initcheck synccheck; do
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool $tool --error-exitcode 9 \
      python3 -m pytest -q -p no:cacheprovider tests/python/test_sanitizer_cases.py -k cuda -x \
      >"$OUT/sanitize_$tool.log" 2>&1
    echo "compute-sanitizer $tool: exit $? ($(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize_$tool.log" | tail -1))"
  done
fi
if want bench; then
  python3 -m bench --device cuda --out "$OUT/h200.json" 2>&1 | tee "$OUT/bench.log" | tail -60
fi
exit $status
