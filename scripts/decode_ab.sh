#!/usr/bin/env bash
# The decode step of this tree against OLD trees (scripts/build_trees.sh builds them beside it):
# scripts/decode_probe.py per tree, alternating, on GPU 0 alone (one call and the kernel alone; the
# first round also with normalize; then this tree once per KNOB_RUNS entry, e.g.
# KNOB_RUNS="ATTNRNN_STEP_TILES=2 ATTNRNN_STEP_TILES=4"); then this tree's step tests on CUDA (also
# per KNOB_RUNS entry) and compute-sanitizer's four tools over them (GPU 1 when present); then
# bench's decode rows with fla beside ours.
#   scripts/stage_gpu.sh <branch> old=main                      (here)
#   cd .gpu && OLD=old OUT=$OUT bash scripts/decode_ab.sh       (the device call)
set -uo pipefail
OLD=${OLD:?set OLD to the other trees, e.g. OLD=old}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
OUT=$OUT bash scripts/build_trees.sh . $OLD || exit 1
fla=$(ls .whl/fla_core-*.whl 2>/dev/null | head -1)
probe=$PWD/scripts/decode_probe.py  # this tree's probe for every tree (its --normalize)
run_probe() {  # tree label extra-args...; KNOB: an optional VAR=value for the probe's process
  local tree=$1 label=$2
  shift 2
  (cd "$tree" && CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$PWD:$PWD/python env ${KNOB:-} python3 "$probe" --B ${PROBE_B:-8 64 256} "$@" 2>&1 |
    grep -v -i warn | sed "s/^/$label /")
}
for round in 1 2; do
  for tree in $OLD "$PWD"; do
    label=$([ "$tree" = "$PWD" ] && echo this || basename "$tree")
    run_probe "$tree" "$label round $round"
    [ $round = 1 ] && run_probe "$tree" "$label round $round" --normalize
  done
done | tee "$OUT/decode_probe.txt"
for knob in ${KNOB_RUNS:-}; do
  KNOB=$knob run_probe "$PWD" "this $knob"
done | tee -a "$OUT/decode_probe.txt"
export PYTHONPATH=$PWD/python:$PWD/tests/python
sanitizer_gpu=$([ "$(nvidia-smi -L | wc -l)" -gt 1 ] && echo 1 || echo 0)
STEP_TESTS=(python3 -m pytest -q -p no:cacheprovider -rf tests/python/test_decode.py tests/python/test_sanitizer_cases.py
  tests/python/test_cuda.py)
STEP_K="cuda and step and not softmax"
# knobs are read once per process: one run per KNOB_RUNS entry, after the default ("")
for knob in "" ${KNOB_RUNS:-}; do
  log="$OUT/tests${knob:+_${knob//=/_}}.log"
  CUDA_VISIBLE_DEVICES=0 env $knob "${STEP_TESTS[@]}" -k "$STEP_K" >"$log" 2>&1
  echo "step tests on CUDA${knob:+, $knob}: $(tail -1 "$log")"
done | tee "$OUT/summary.txt"
# Not the CUDA-graph test: capture cannot allocate without the caching allocator (its cudaMalloc
# invalidates the capture), which the sanitizer runs switch off.
for tool in memcheck racecheck initcheck synccheck; do
  CUDA_VISIBLE_DEVICES=$sanitizer_gpu PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool $tool --error-exitcode 9 \
    "${STEP_TESTS[@]}" -k "$STEP_K and not graph" >"$OUT/sanitize_$tool.log" 2>&1
  echo "compute-sanitizer $tool: exit $? ($(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize_$tool.log" | tail -1))"
done | tee -a "$OUT/summary.txt"
if [ -n "$fla" ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site "$fla" && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$PWD:$PYTHONPATH python3 -m bench --device cuda --suite decode --out "$OUT/decode_bench.json" 2>&1 |
  grep -E "^decode|^target|step" | tee -a "$OUT/summary.txt"
