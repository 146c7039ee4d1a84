#!/usr/bin/env bash
# Stages the GPU machine's copy here, before a device call: .gpu/ holds `git archive` of REV (default
# HEAD), each of the OLD revisions under .gpu/<name> (for scripts/ab_forward.sh), and fla's wheel
# from ../shared/wheels when present (gpu_suite.sh's fla step). Carry ".gpu" in the call.
#   scripts/stage_gpu.sh [REV] [name=REV ...]      e.g. scripts/stage_gpu.sh fused-dkv old=main
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
rev=${1:-HEAD}
[ $# -gt 0 ] && shift
rm -rf .gpu && mkdir .gpu
git archive "$rev" | tar -x -C .gpu
for pair in "$@"; do
  name=${pair%%=*}
  mkdir -p ".gpu/$name"
  git archive "${pair#*=}" | tar -x -C ".gpu/$name"
done
if ls ../shared/wheels/fla_core-*.whl >/dev/null 2>&1; then
  mkdir -p .gpu/.whl && cp ../shared/wheels/fla_core-*.whl .gpu/.whl/
elif ls .whl/fla_core-*.whl >/dev/null 2>&1; then
  cp -r .whl .gpu/.whl
fi
du -sh .gpu
