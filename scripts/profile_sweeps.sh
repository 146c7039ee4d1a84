#!/usr/bin/env bash
# Where the library's sweep kernels wait: builds attnrnn (scripts/gpu_suite.sh, unless SKIP_BUILD=1),
# then for each profile "name|kernel regex|B T H D [--backward] [--normalize]" one ncu run of
# scripts/tc_profile.py (scripts/ncu_sites.sh: the second matching launch, warp-stall samples per SASS
# instruction, summarized by scripts/stall_sites.py). The regex matches
# the demangled name, so a sweep's role is picked by its TcRole (0 fwd, 2 dq, 3 dk, 4 dv, 5 dk + dv).
# Output under $OUT: profile_sweeps.txt (the summary, also on stdout) and scripts/ncu_sites.sh's files.
#   OUT=$OUT bash scripts/profile_sweeps.sh          (PROFILES: the normalize backward's dk and dq by default)
set -uo pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
[ -n "${SKIP_BUILD:-}" ] || OUT=$OUT bash scripts/gpu_suite.sh || exit 1
export PYTHONPATH=$PWD/python
default_profiles='pair-dk-norm|chunk_wg_pair_kernel<.*TcRole\)3|4 8192 16 128 --backward --normalize
pair-dk-unnorm|chunk_wg_pair_kernel<.*TcRole\)3|4 8192 16 128 --backward
pair-dq-norm|chunk_wg_pair_kernel<.*TcRole\)2|4 8192 16 128 --backward --normalize
wg-dk-norm|chunk_wg_kernel<.*TcRole\)3|1 65536 16 128 --backward --normalize
wg-dk-unnorm|chunk_wg_kernel<.*TcRole\)3|1 65536 16 128 --backward'
summary=$OUT/profile_sweeps.txt
: >"$summary"
while IFS='|' read -r name regex args; do
  [ -n "$name" ] || continue
  # shellcheck disable=SC2086  # args: the shape and flags, split on purpose
  bash scripts/ncu_sites.sh "$OUT" "$name" "--kernel-name-base demangled --kernel-name regex:$regex" \
    python3 scripts/tc_profile.py $args | tee -a "$summary"
done <<<"${PROFILES:-$default_profiles}"
