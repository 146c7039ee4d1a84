#!/usr/bin/env bash
# A branch's whole first GPU call on nvidia-h200-x2: this tree and the OLD trees built side by side,
# then on GPU 0 scripts/ab_forward.sh (outputs bit for bit, kernel times) followed by the CUDA test
# files, and on GPU 1 compute-sanitizer over the chunk cases at each wgmma mask. Everything stops at
# LIMIT seconds from the start (what ran by then comes back), and pack_out.sh runs last.
#   scripts/stage_gpu.sh <branch> old=main                                   (here)
#   cd .gpu && OLD=old OUT=$OUT bash scripts/ab_suite.sh                      (the device call)
# Knobs (defaults): KT_ARGS ("--backward --shapes B4-T8192-H16-D128,B1-T65536-H16-D128"), BITWISE (1),
# MASKS ("63 127"), SANITIZE_TOOLS ("racecheck synccheck memcheck"), SANITIZE_K ("cuda and chunk and
# (K128 or T2048) and not fp32"), TEST_FILES ("test_cuda.py test_numerics.py"), LIMIT (540).
# With two trees (sixteenth session) the build took 71-93 s, ab_forward.sh ~2.5 minutes, the
# sanitizers ~4.5 and test_cuda ~3.5: the tests follow ab_forward.sh rather than the sanitizers.
# On a one-GPU machine the three run in turn on GPU 0: ab_forward.sh, the sanitizers, the tests.
# TEST_FILES="" runs no test file.
set -uo pipefail
OLD=${OLD:?set OLD to the other trees, e.g. OLD=old}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
deadline=$(( $(date +%s) + ${LIMIT:-540} ))

# Runs "$1" in its own process group, killed as a whole at the deadline.
until_deadline() {
  setsid bash -c "$1" &
  local pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    if [ "$(date +%s)" -ge "$deadline" ]; then
      kill -TERM -- "-$pid" 2>/dev/null; sleep 2; kill -KILL -- "-$pid" 2>/dev/null
      echo "stopped at the deadline: $1"
      break
    fi
    sleep 2
  done
  wait "$pid" 2>/dev/null
}

OUT=$OUT bash scripts/build_trees.sh . $OLD || exit 1
echo "built in $(( $(date +%s) - deadline + ${LIMIT:-540} )) s"

gpus=$(nvidia-smi -L | wc -l)
test_files=${TEST_FILES-test_cuda.py test_numerics.py}
ab="export CUDA_VISIBLE_DEVICES=0; OLD='$OLD' BITWISE=${BITWISE-1} OUT='$OUT' \
  KT_ARGS='${KT_ARGS:---backward --shapes B4-T8192-H16-D128,B1-T65536-H16-D128}' bash scripts/ab_forward.sh >'$OUT/ab.log' 2>&1"
tests="export CUDA_VISIBLE_DEVICES=0; [ -z '$test_files' ] ||
  SKIP_BUILD=1 OUT='$OUT/tests' TEST_FILES='$test_files' bash scripts/gpu_suite.sh tests | grep '^test_'"
sanitize="export CUDA_VISIBLE_DEVICES=$(( gpus > 1 ? 1 : 0 )) SKIP_BUILD=1; for m in ${MASKS:-63 127}; do
  ATTNRNN_TC_WGMMA=\$m OUT='$OUT/sanitize_mask'\$m SANITIZE_TOOLS='${SANITIZE_TOOLS:-racecheck synccheck memcheck}' \
    SANITIZE_K='${SANITIZE_K:-cuda and chunk and (K128 or T2048) and not fp32}' bash scripts/gpu_suite.sh sanitize |
    grep compute-sanitizer | sed \"s/^/mask \$m: /\"; done"
if [ "$gpus" -gt 1 ]; then
  until_deadline "$ab; $tests" >"$OUT/gpu0_summary.txt" 2>&1 &
  until_deadline "$sanitize" >"$OUT/gpu1_summary.txt" 2>&1 &
  wait
else
  until_deadline "$ab; $sanitize" >"$OUT/gpu1_summary.txt" 2>&1
  until_deadline "$tests" >"$OUT/gpu0_summary.txt" 2>&1
fi

{
  cat "$OUT/ab_bitwise.txt" 2>/dev/null
  cat "$OUT/gpu1_summary.txt" "$OUT/gpu0_summary.txt"
} | tee "$OUT/summary.txt"
grep -v -i warn "$OUT/ab_kernel_times.txt" 2>/dev/null
rm -f "$OUT"/outputs_*.pt  # the saved tensors: too large to come back
OUT=$OUT bash scripts/pack_out.sh summary.txt ab_kernel_times.txt ab_bitwise.txt
