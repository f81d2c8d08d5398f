#!/usr/bin/env bash
# One call on the GPU machine (the device tool): build, GPU tests, benchmark; a short table last.
#   bash .ci/gpu.sh [pytest -k expression] [benchmark args...]
#   PYTEST_FILES="tests/test_decode.py tests/test_api.py" bash .ci/gpu.sh ...   (test files; default: tests/, which
#                                    takes longer than one 10-minute call on one GPU: split it over calls)
#   PYTEST_WORKERS=8 (default; pytest-xdist workers sharing the GPU)
#   BUILD_ARGS="-Ccmake.define.JAX_FLASH_CONFIG_SET=sweep" bash .ci/gpu.sh ...   (extra pip build arguments)
#   HARNESS=1 bash .ci/gpu.sh ...   (also the standalone kernel harness under compute-sanitizer: .ci/harness.sh;
#                                    HARNESS_OUT=dir keeps its logs out of $OUT, SANITIZER_TOOLS picks the tools)
#   AB_NAMES="base new" bash .ci/gpu.sh ...   (also tools/ab/run.sh on carried build/ab binaries, before the benchmark)
# Writes build.log, pytest.log, bench.log, bench.json, bench.png under $OUT.
# The GPU machine has no network: where it lacks the scipy-openblas32 wheel (the CPU path's OpenBLAS), download it
# beforehand with `pip download scipy-openblas32 --no-deps -d .whl` and carry `.whl` (ignored by git).
set -uo pipefail
OUT=${OUT:-/tmp/jax_flash_out}
mkdir -p "$OUT"
REPO=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONUNBUFFERED=1
K_EXPR=${1:-}
shift || true
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"

if ! python3 -c "import scipy_openblas32" 2>/dev/null; then
  python3 -m pip install --no-deps -q "$REPO"/.whl/scipy_openblas32-*.whl \
    || echo "no scipy-openblas32 and no carried .whl: the CPU-path tests will fail (see above)"
fi
start=$(date +%s)
(cd "$REPO" && CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install --no-build-isolation --no-deps -v ${BUILD_ARGS:-} . ) \
  > "$OUT/build.log" 2>&1 || { tail -60 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - start )) s"
# (bounded: a dump that does not finish must not take the rest of the call's 10 minutes)
(cd /tmp && so=$(python3 -c "import jax_flash._jax_flash as m; print(m.__file__)"); \
  timeout ${SASS_TIMEOUT:-90} bash -c "cuobjdump -sass '$so' | python3 '$REPO/tools/sass_report.py'" > "$OUT/sass.txt" 2>&1)
echo "SASS (exit $?): $(grep -c . "$OUT/sass.txt") kernels listed; with LDL/STL in the KV loop:"
awk 'NR > 1 && $NF > 0' "$OUT/sass.txt" | head -5

cd /tmp
start=$(date +%s)
TEST_PATHS=$(for f in ${PYTEST_FILES:-tests}; do echo "$REPO/$f"; done)
timeout ${PYTEST_TIMEOUT:-420} python3 -m pytest -q -n ${PYTEST_WORKERS:-8} -rfE --tb=short --maxfail=20 -p no:cacheprovider ${K_EXPR:+-k "$K_EXPR"} $TEST_PATHS > "$OUT/pytest.log" 2>&1
echo "pytest: exit $? in $(( $(date +%s) - start )) s"
grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -20
tail -3 "$OUT/pytest.log"

if [ -n "${HARNESS:-}" ]; then
  start=$(date +%s)
  OUT="${HARNESS_OUT:-$OUT}" bash "$REPO/.ci/harness.sh"
  echo "harness: exit $? in $(( $(date +%s) - start )) s"
fi

if [ -n "${AB_NAMES:-}" ]; then
  start=$(date +%s)
  NAMES="$AB_NAMES" OUT="$OUT" bash "$REPO/tools/ab/run.sh" > "$OUT/ab.log" 2>&1
  echo "A/B ($AB_NAMES): exit $? in $(( $(date +%s) - start )) s"
  grep -E "check:" "$OUT/ab.log"; sed -n "/TFLOP\/s, median/,\$p" "$OUT/ab.log"
fi

timeout ${BENCH_TIMEOUT:-400} python3 -m jax_flash.benchmark --json "$OUT/bench.json" --plot "$OUT/bench.png" "$@" > "$OUT/bench.log" 2>&1
echo "benchmark: exit $?"
grep "^#" "$OUT/bench.log" | head -5
sed -n '/^TFLOP/,$p' "$OUT/bench.log"
