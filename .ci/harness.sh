#!/usr/bin/env bash
# Builds tests/harness/kernel_harness (needs nvcc, a GPU, and jax + nanobind for the CMake configure) and runs it
# plainly (full matrix) and under compute-sanitizer memcheck, racecheck, initcheck and synccheck (--quick matrix).
#   bash .ci/harness.sh            # writes harness_*.log under $OUT (default /tmp/jax_flash_out)
set -uo pipefail
OUT=${OUT:-/tmp/jax_flash_out}
mkdir -p "$OUT"
REPO=$(cd "$(dirname "$0")/.." && pwd)
BUILD="$REPO/build/harness"
cmake -S "$REPO" -B "$BUILD" -G Ninja -DSKBUILD_PROJECT_NAME=jax_flash -DJAX_FLASH_BUILD_HARNESS=ON \
  -DCMAKE_CUDA_ARCHITECTURES="${HARNESS_ARCH:-90}" -Dnanobind_DIR="$(python3 -m nanobind --cmake_dir)" \
  > "$OUT/harness_build.log" 2>&1 && cmake --build "$BUILD" --target kernel_harness -j "$(nproc)" \
  >> "$OUT/harness_build.log" 2>&1 || { tail -30 "$OUT/harness_build.log"; exit 1; }
status=0
echo "harness (full matrix): $("$BUILD/kernel_harness" > "$OUT/harness_plain.log" 2>&1; echo "exit $?"; tail -1 "$OUT/harness_plain.log")"
grep -m5 FAIL "$OUT/harness_plain.log" && status=1
for tool in ${SANITIZER_TOOLS:-memcheck racecheck initcheck synccheck}; do
  timeout "${SANITIZER_TIMEOUT:-150}" compute-sanitizer --tool "$tool" --error-exitcode 3 "$BUILD/kernel_harness" --quick \
    > "$OUT/harness_$tool.log" 2>&1
  rc=$?
  echo "compute-sanitizer $tool: exit $rc; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/harness_$tool.log" | tail -1); $(grep -E 'passed, ' "$OUT/harness_$tool.log" | tail -1)"
  [ $rc -eq 0 ] || status=1
done
exit $status
