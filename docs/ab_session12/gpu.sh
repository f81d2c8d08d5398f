#!/usr/bin/env bash
# Session 12 GPU calls (session 15 added BENCH_CAUSAL=on|off|both, default both; session 16 BENCH_ORDER=
# sequential|interleaved, default the benchmark's, and SMI=1: nvidia-smi samples the SM clock, power and throttle
# reasons every 250 ms during the benchmark into smi.csv): package build + SASS report, then
# any of: the kernel harness under compute-sanitizer (HARNESS=1), GPU tests (TEST_EXPR), the benchmark
# (BENCH_DTYPES, BENCH_HEAD_DIMS). Full logs go to /tmp/o; what
# comes back ($OUT, at most 8 files): sass.txt, harness.log (the harness's and each tool's summary lines and any
# FAIL), pytest.log (failures and the summary), bench_<dtype>.json and the benchmark tables (bench.log).
set -uo pipefail
OUT=${OUT:-/tmp/jax_flash_out}; mkdir -p "$OUT" /tmp/o
REPO=$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/bench.log"
start=$(date +%s)
CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install --no-build-isolation --no-deps -v . > /tmp/o/build.log 2>&1 || { tail -40 /tmp/o/build.log; exit 1; }
echo "build: $(( $(date +%s) - start )) s"
(cd /tmp && so=$(python3 -c "import jax_flash._jax_flash as m; print(m.__file__)"); cuobjdump -sass "$so" | python3 "$REPO/.ci/sass_report.py" > "$OUT/sass.txt" 2>&1)
echo "SASS kernels: $(($(grep -c . "$OUT/sass.txt") - 1)); with LDL/STL:"; awk 'NR > 1 && $NF > 0' "$OUT/sass.txt" | head -5
if [ -n "${HARNESS:-}" ]; then
  OUT=/tmp/o/h SANITIZER_TOOLS="${SANITIZER_TOOLS:-memcheck racecheck synccheck}" SANITIZER_TIMEOUT=${SANITIZER_TIMEOUT:-100} \
    bash .ci/harness.sh 2>&1 | tee "$OUT/harness.log"
  grep -h FAIL /tmp/o/h/harness_*.log | head -20 >> "$OUT/harness.log"
fi
cd /tmp
if [ -n "${TEST_EXPR:-}" ]; then
  start=$(date +%s)
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider -k "$TEST_EXPR" "$REPO/tests" > /tmp/o/pytest.log 2>&1
  echo "pytest exit $? in $(( $(date +%s) - start )) s" | tee "$OUT/pytest.log"
  grep -E "^(FAILED|ERROR)" /tmp/o/pytest.log | head -30 >> "$OUT/pytest.log"; tail -2 /tmp/o/pytest.log | tee -a "$OUT/pytest.log"
fi
if [ -n "${SMI:-}" ] && [ -n "${BENCH_DTYPES:-}" ]; then
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,power.limit,temperature.gpu,clocks_throttle_reasons.active \
    --format=csv,noheader -lms 250 > "$OUT/smi.csv" 2>&1 &
  smi_pid=$!
fi
for dt in ${BENCH_DTYPES:-}; do
  timeout ${BENCH_TIMEOUT:-230} python3 -m jax_flash.benchmark --dtypes $dt --head-dims ${BENCH_HEAD_DIMS:-64,128} --causal ${BENCH_CAUSAL:-both} \
    ${BENCH_ORDER:+--order $BENCH_ORDER} --json "$OUT/bench_$dt.json" > /tmp/o/bench_$dt.log 2>&1
  echo "benchmark $dt: exit $?" >> "$OUT/bench.log"
  sed -n '/^TFLOP/,$p' /tmp/o/bench_$dt.log >> "$OUT/bench.log"
done
[ -n "${smi_pid:-}" ] && kill "$smi_pid"
cat "$OUT/bench.log"
