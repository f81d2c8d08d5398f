#!/usr/bin/env bash
# SASS of every shipped kernel, one file per instantiation, for comparing two trees without a GPU: a refactor that
# must not move performance should leave this output byte-identical.
#   bash tools/sass_snapshot.sh OUT_DIR [SOURCE_ROOT]      then: diff -r OLD_DIR NEW_DIR
# Builds csrc/instantiations/*.cu to cubins (sm80 family: sm_80 and sm_90; sm90 family: sm_90a), disassembles them
# and drops the addresses and encodings, so only the instruction stream is compared. Needs nvcc and cuobjdump.
set -euo pipefail
OUT=$(mkdir -p "$1" && cd "$1" && pwd)
ROOT=$(cd "${2:-$(dirname "$0")/..}" && pwd)
JOBS=${JOBS:-$(nproc)}
compile() {  # instantiation file -> $OUT/<name>.<arch>.sass
  local src=$1 name arch
  name=$(basename "$src" .cu)
  case "$name" in sm90_*) archs="90a" ;; *) archs="80 90" ;; esac
  for arch in $archs; do
    nvcc -std=c++20 -O3 -gencode="arch=compute_$arch,code=sm_$arch" -I "$ROOT/csrc" -cubin \
      -o "$OUT/$name.$arch.cubin" "$src"
    cuobjdump -sass "$OUT/$name.$arch.cubin" |
      sed -E 's@/\*[0-9a-f]{4,}\*/@@; s@/\* 0x[0-9a-f]+ \*/@@; s/[[:space:]]+$//' | grep -v '^\s*$' \
      > "$OUT/$name.$arch.sass"
    rm "$OUT/$name.$arch.cubin"
  done
}
export -f compile
export OUT ROOT
ls "$ROOT"/csrc/instantiations/sm*_*.cu | xargs -P "$JOBS" -I{} bash -c 'compile {}'
echo "$(ls "$OUT" | wc -l) SASS files in $OUT"
