#!/usr/bin/env bash
# The GPU machine's whole job in one call: build attnrnn with CUDA, run the test suite on CUDA,
# optionally compute-sanitizer and the benchmarks. Logs and JSON go to $OUT (default ./out).
#   scripts/gpu_suite.sh [tests] [sanitize] [bench] [fla] [fla_model] [multigpu]
# TEST_FILES="test_cuda.py ..." limits "tests" to those files of tests/python (TEST_K: their "-k"
# expression, default "cuda"); SANITIZE_TOOLS and SANITIZE_K ("-k" expression) limit "sanitize"
# (one tool per visible GPU at a time, or per entry of SANITIZE_GPUS; SANITIZE_SHARDS processes of
# each tool side by side). "fla" installs .whl/fla_core-*.whl (copied from shared/wheels) so the
# benchmarks include fla ("bench" splits the shapes over two GPUs when there are two; BENCH_SHAPES
# runs only those shapes, into h200_part.json); with .whl/flash_linear_attention-*.whl beside it,
# it installs fla's layers and models too, which "fla_model" needs: tests/python/test_integration_fla.py
# and bench/fla_model_step.py (fla's LinearAttentionForCausalLM on fla's and attnrnn's kernels;
# transformers comes with the image). "multigpu"
# runs the context-parallel tests over NCCL on all GPUs and bench/distributed.py at B=1 H=16 D=128
# bf16, T = 256k/512k/1M, on all GPUs and on one (CP_MODES="norm unnorm": normalize on/off).
# SKIP_BUILD=1 reuses an in-place build. A device call brings back 8 files of $OUT: end it with
# scripts/pack_out.sh, which packs the rest into $OUT/logs.tar.gz.
set -uo pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# NVLink multicast stays off in every process (it can take a shared host's GPUs out of service).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
want() { [[ " $* " == *" all "* ]] || [[ " $STEPS " == *" $1 "* ]]; }
gpu_count() { python3 -c "import torch; print(torch.cuda.device_count())"; }
STEPS=" $* "
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"

if want fla && ls .whl/fla_core-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/fla_core-*.whl \
    $(ls .whl/flash_linear_attention-*.whl 2>/dev/null) && export PYTHONPATH=/tmp/site
fi

# The image's default C++ compiler (/opt/gcc) puts its own copy of libstdc++'s locale machinery
# into shared libraries, which crashes when they format numbers inside torch's process: build
# with the system compiler, the one torch's libstdc++ belongs to.
if [ -x /usr/bin/g++ ]; then
  export CC=/usr/bin/gcc CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++
fi
echo "compilers: CXX=${CXX:-default} ($(${CXX:-c++} --version | head -1))"

if [ -z "${SKIP_BUILD:-}" ]; then
  rm -rf build/cmake-py*  # a fresh configure: a cached compiler from an earlier call would stick
  start=$(date +%s)
  if ! ATTNRNN_CUDA=ON ATTNRNN_BUILD_JOBS=$(nproc) python3 setup.py -q build_ext --inplace >"$OUT/build.log" 2>&1; then
    tail -40 "$OUT/build.log"
    exit 1
  fi
  echo "build: $(( $(date +%s) - start )) s"
  # the targets the build chose (by default the GPUs present: sm_90a on Hopper; ATTNRNN_CUDA_ARCHITECTURES
  # overrides; scripts/check_arch_builds.sh compiles other targets on a machine without a GPU)
  grep -o "attnrnn: CUDA architectures.*" "$OUT/build.log" | tail -1
  grep -E "registers|spill" "$OUT/build.log" | sort | uniq -c | sort -rn | head -5 > "$OUT/ptxas.txt"
fi
export PYTHONPATH=$PWD/python:$PWD/tests/python${PYTHONPATH:+:$PYTHONPATH}

status=0
if want tests; then
  # One process per file, so that a crash in one cannot hide the others' results.
  files=$(ls tests/python/test_*.py)
  [ -n "${TEST_FILES:-}" ] && files=$(printf 'tests/python/%s ' $TEST_FILES)
  for f in $files; do
    python3 -m pytest -q -p no:cacheprovider "$f" -k "${TEST_K:-cuda}" -rf >>"$OUT/pytest_cuda.log" 2>&1
    rc=$?
    [ $rc -ne 0 ] && [ $rc -ne 5 ] && status=1
    printf '%-48s %s\n' "$(basename "$f")" "$(tail -1 "$OUT/pytest_cuda.log")"
  done
fi
if want sanitize; then
  # One tool per GPU at a time (tools on different GPUs run side by side). SANITIZE_SHARDS (default 1)
  # splits the selected cases round-robin over that many processes of the tool on its GPU at once:
  # the cases are small, and racecheck's instrumented kernels leave the GPU mostly idle, so shards
  # run side by side (racecheck took ~60 s for each of the larger cases in one process).
  cases=$(python3 -m pytest -q -p no:cacheprovider --collect-only tests/python/test_sanitizer_cases.py \
    -k "${SANITIZE_K:-cuda}" 2>/dev/null | grep '::')
  shards=${SANITIZE_SHARDS:-1}
  sanitize_shard() {  # tool, gpu, shard index
    local ids
    mapfile -t ids < <(awk -v n="$shards" -v i="$3" 'NF && (NR - 1) % n == i' <<< "$cases")
    [ ${#ids[@]} -eq 0 ] && return 0
    CUDA_VISIBLE_DEVICES=$2 PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool $1 --error-exitcode 9 \
      python3 -m pytest -q -p no:cacheprovider -x "${ids[@]}" >"$OUT/sanitize_$1_$3.log" 2>&1
  }
  sanitize() {  # tool, gpu: every shard, then one line for the tool
    local i pids=() codes=()
    for (( i = 0; i < shards; i++ )); do sanitize_shard "$1" "$2" "$i" & pids+=($!); done
    for i in "${pids[@]}"; do wait "$i"; codes+=($?); done
    local summaries passed failed
    summaries=$(grep -hE 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT"/sanitize_"$1"_*.log | sort | uniq -c |
      sed 's/^ *//; s/=\+ *//' | paste -sd';')
    count() { grep -ohE "[0-9]+ $1" "$OUT"/sanitize_"$2"_*.log | awk '{s += $1} END {print s + 0}'; }
    passed=$(count passed "$1")
    failed=$(count failed "$1")
    echo "compute-sanitizer $1: exits ${codes[*]}, $passed passed, $failed failed of $(grep -c :: <<< "$cases") cases ($summaries)"
  }
  # SANITIZE_GPUS: the GPU of each tool slot, tools in as many slots side by side ("0,0,0,0": all
  # four tools at once on GPU 0); default one slot per visible GPU.
  visible=${SANITIZE_GPUS:-${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $(( $(gpu_count) - 1 )))}}
  read -ra devices <<< "${visible//,/ }"
  slot=0
  for tool in ${SANITIZE_TOOLS:-memcheck racecheck initcheck synccheck}; do
    sanitize $tool "${devices[$slot]}" &
    slot=$(( (slot + 1) % ${#devices[@]} ))
    [ $slot -eq 0 ] && wait
  done
  wait
fi
if want fla_model; then
  python3 -m pytest -q -p no:cacheprovider tests/python/test_integration_fla.py -rfs >"$OUT/pytest_fla.log" 2>&1 ||
    status=1
  echo "test_integration_fla.py: $(tail -1 "$OUT/pytest_fla.log")"
  python3 -m bench.fla_model_step --out "$OUT/fla_model_step.json" >"$OUT/fla_model_step.log" 2>&1 || status=1
  tail -25 "$OUT/fla_model_step.log"
fi
if want multigpu; then
  gpus=$(gpu_count)
  python3 -m pytest -q -p no:cacheprovider tests/python/test_distributed.py -k nccl -rf >"$OUT/pytest_nccl.log" 2>&1 ||
    status=1
  echo "context-parallel tests over NCCL ($gpus GPUs): $(tail -1 "$OUT/pytest_nccl.log")"
  for mode in ${CP_MODES:-norm unnorm}; do
    flag=$([ $mode = unnorm ] && echo --unnormalized)
    for n in $gpus 1; do
      torchrun --standalone --nproc-per-node "$n" bench/distributed.py --B 1 --H 16 --Hkv 16 --K 128 --V 128 \
        --dtype bfloat16 --T 262144 524288 1048576 --warmup 2 --reps 7 $flag --out "$OUT/cp_h200_w${n}_$mode.json" \
        >"$OUT/cp_h200_w${n}_$mode.log" 2>&1 || status=1
      grep -E "^# |local \(|allgather/initial_state  |chain/initial_state" "$OUT/cp_h200_w${n}_$mode.log"
    done
  done
fi
if want bench; then
  gpus=$(gpu_count)
  # SM clock, power and temperature every 200 ms while the benchmark runs (read only): whether a
  # row's per-call time moved with the clocks under sustained load.
  nvidia-smi --query-gpu=timestamp,index,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv -lms 200 \
    >"$OUT/bench_clocks.csv" 2>/dev/null &
  sampler=$!
  if [ -n "${BENCH_SHAPES:-}" ]; then
    # Part of the shapes on one GPU (a call is too short for all of them on one): merge the parts
    # afterwards with `python -m bench --merge A.json B.json --out h200.json --png h200.png`.
    python3 -m bench --device cuda --shapes "$BENCH_SHAPES" --out "$OUT/h200_part.json" 2>&1 |
      tee "$OUT/bench.log" | tail -60
  elif [ "$gpus" -ge 2 ]; then
    # Two halves of the shapes, each process alone on its own GPU (fla's autotuning halves too),
    # then one file with ratios and targets recomputed (bench/results/README.md).
    half_a=B8-T2048-H16-D64,B4-T8192-H16-D128,B64-H32-D128,B256-H32-D128
    half_b=B1-T65536-H16-D128,B8-T4096-H32-D64
    CUDA_VISIBLE_DEVICES=0 python3 -m bench --device cuda --shapes $half_a --out "$OUT/h200_a.json" >"$OUT/bench_a.log" 2>&1 &
    first_half=$!
    CUDA_VISIBLE_DEVICES=1 python3 -m bench --device cuda --shapes $half_b --out "$OUT/h200_b.json" >"$OUT/bench_b.log" 2>&1
    wait "$first_half"
    python3 -m bench --merge "$OUT/h200_a.json" "$OUT/h200_b.json" --out "$OUT/h200.json" --png "$OUT/h200.png" 2>&1 |
      tee "$OUT/bench.log" | tail -60
  else
    python3 -m bench --device cuda --out "$OUT/h200.json" --png "$OUT/h200.png" 2>&1 | tee "$OUT/bench.log" | tail -60
  fi
  kill "$sampler" 2>/dev/null
fi
exit $status
