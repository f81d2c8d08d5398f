#!/usr/bin/env bash
# Builds one A/B binary of tools/ab/HARNESS.cu (on any machine with nvcc; no GPU needed) into build/ab/HARNESS_NAME.
#   [HARNESS=sm90_ab|sm90_bwd_ab] bash tools/ab/build.sh NAME [REF [PATCH]] [-- NVCC_FLAGS...]
# HARNESS: sm90_ab (the forward, default) or sm90_bwd_ab (the backward).
# REF: a git commit or branch to build the kernels from (default: the working tree); PATCH: a patch applied to that
# tree first (the alternative under test). NVCC_FLAGS: e.g. -DJAX_FLASH_TRACE for a timeline build. The harness
# itself always comes from the working tree. Carry build/ab to the GPU machine and run tools/ab/run.sh there.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
NAME=${1:?name}; shift
REF=""; PATCH=""
if [ $# -gt 0 ] && [ "$1" != "--" ]; then REF=$1; shift; fi
if [ $# -gt 0 ] && [ "$1" != "--" ]; then PATCH=$(cd "$(dirname "$1")" && pwd)/$(basename "$1"); shift; fi
[ "${1:-}" = "--" ] && shift
SRC="$REPO"
if [ -n "$REF$PATCH" ]; then
  SRC=$(mktemp -d /tmp/jax_flash_ab_XXXX)
  if [ -n "$REF" ]; then git -C "$REPO" archive "$REF" csrc | tar -x -C "$SRC"; else cp -r "$REPO/csrc" "$SRC/"; fi
  [ -n "$PATCH" ] && (cd "$SRC" && patch -p1 --quiet < "$PATCH")
  # The CPU reference is not under test: every build checks against this tree's CPU implementation.
  rm -rf "$SRC/csrc/cpu" && cp -r "$REPO/csrc/cpu" "$SRC/csrc/"
fi
H=${HARNESS:-sm90_ab}
mkdir -p "$REPO/build/ab"
nvcc -std=c++20 -O3 -gencode=arch=compute_90a,code=sm_90a -I "$SRC/csrc" -I "$REPO/tests/harness" "$@" \
  -Xptxas -v -o "$REPO/build/ab/${H}_$NAME" "$REPO/tools/ab/$H.cu" "$SRC"/csrc/cpu/*.cc -lpthread -ldl \
  2> "$REPO/build/ab/${H}_$NAME.ptxas.txt"
echo "build/ab/${H}_$NAME: $(grep -c 'bytes spill stores' "$REPO/build/ab/${H}_$NAME.ptxas.txt") kernels," \
     "spill bytes max $(grep -o '[0-9]* bytes spill stores' "$REPO/build/ab/${H}_$NAME.ptxas.txt" | sort -n | tail -1)"
