#!/usr/bin/env bash
# Session 10 GPU call: package build, SASS report, the sm90 / compiled-config GPU tests (head dim 256 included),
# then the head-dim-256 benchmark (BENCH_DTYPES, default bf16 and fp16) beside cuDNN, sm80 and Mosaic.
set -uo pipefail
OUT=${OUT:-/tmp/jax_flash_out}; mkdir -p "$OUT"
REPO=$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if [ -z "${SKIP_BUILD:-}" ]; then
  start=$(date +%s)
  CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install --no-build-isolation --no-deps -v . > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
  echo "build: $(( $(date +%s) - start )) s"
  (cd /tmp && so=$(python3 -c "import jax_flash._jax_flash as m; print(m.__file__)"); cuobjdump -sass "$so" | python3 "$REPO/.ci/sass_report.py" > "$OUT/sass.txt" 2>&1)
  echo "SASS kernels: $(grep -c . "$OUT/sass.txt"); with LDL/STL:"; awk 'NR > 1 && $NF > 0' "$OUT/sass.txt" | head -5
fi
cd /tmp
if [ -n "${TEST_EXPR:-}" ]; then
  start=$(date +%s)
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider -k "$TEST_EXPR" "$REPO/tests" > "$OUT/pytest.log" 2>&1
  echo "pytest exit $? in $(( $(date +%s) - start )) s"; grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head; tail -2 "$OUT/pytest.log"
fi
for dt in ${BENCH_DTYPES:-bfloat16 float16}; do
  timeout ${BENCH_TIMEOUT:-200} python3 -m jax_flash.benchmark --dtypes $dt --head-dims ${BENCH_HEAD_DIMS:-256} --causal both \
    --json "$OUT/bench_$dt.json" > "$OUT/bench_$dt.log" 2>&1
  echo "benchmark $dt: exit $?"
  sed -n '/^TFLOP/,$p' "$OUT/bench_$dt.log"
done
