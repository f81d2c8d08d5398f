#!/usr/bin/env bash
# Session 7's last GPU call: package build, SASS report, sm90 GPU tests, then the bf16 and fp16 benchmarks.
set -uo pipefail
OUT=${OUT:-/tmp/jax_flash_out}; mkdir -p "$OUT"
bash "$(dirname "$0")/gpu_tests.sh" || exit 1
cd /tmp
for dt in bfloat16 float16; do
  timeout 200 python3 -m jax_flash.benchmark --dtypes $dt --causal both --json "$OUT/bench_$dt.json" > "$OUT/bench_$dt.log" 2>&1
  echo "benchmark $dt: exit $?"
  sed -n '/^TFLOP/,$p' "$OUT/bench_$dt.log"
done
