#!/usr/bin/env bash
# The GPU machine's call brings back at most 8 files from $OUT. Run this last in a call: it keeps
# the files named as arguments (default: h200.json h200.png, where they exist) and packs every other
# file under $OUT into $OUT/logs.tar.gz (unpack here with tar xzf). Nothing to do with 8 or fewer.
#   OUT=$OUT bash scripts/pack_out.sh [KEEP ...]
set -euo pipefail
OUT=${OUT:?set OUT to the folder to pack}
cd "$OUT"
[ $# -gt 0 ] || set -- h200.json h200.png
mapfile -t files < <(find . -type f ! -name logs.tar.gz | sed 's|^\./||' | sort)
[ "${#files[@]}" -le 8 ] && exit 0
pack=()
for f in "${files[@]}"; do
  keep=0
  for k in "$@"; do [ "$f" = "$k" ] && keep=1; done
  [ $keep -eq 0 ] && pack+=("$f")
done
[ "${#pack[@]}" -eq 0 ] && exit 0
tar czf logs.tar.gz -- "${pack[@]}"
rm -f -- "${pack[@]}"
find . -mindepth 1 -type d -empty -delete
echo "pack_out: ${#pack[@]} files into $OUT/logs.tar.gz"
