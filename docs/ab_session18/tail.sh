#!/usr/bin/env bash
# Session 18, run 1: does the last partial wave cost what the arithmetic says? The benchmark's D = 128 shapes all
# have 2048 tiles of 128 rows (16384 tokens x 16 heads / 128) over 132 SMs: 15.5 waves, so 68 blocks run the 16th
# tile while 64 idle (-3% if idle time is lost). hidden 4096 (32 heads: 4096 tiles, 31.03 waves) and 4224 (33 heads:
# 4224 tiles, exactly 32 waves) do 2x and 2.06x the work; if the tail is idle time, 33 heads read 3.1% more TFLOP/s
# than 32 (and 16). cuDNN beside it in the same rounds. Package build first (docs/ab_session12/gpu.sh, no tests).
set -uo pipefail
OUT=${OUT:-/tmp/jax_flash_out}; mkdir -p "$OUT" /tmp/o
bash docs/ab_session12/gpu.sh > /tmp/o/gpu.log 2>&1; tail -5 /tmp/o/gpu.log
cd /tmp
for dt in ${DTYPES:-bfloat16}; do
  for hidden in ${HIDDENS:-2048 4096 4224}; do
    timeout 200 python3 -m jax_flash.benchmark --dtypes $dt --head-dims ${D:-128} --causal ${CAUSAL:-off} \
      --seqs ${SEQS:-1024,2048,4096,16384} --hidden $hidden --xla-max-seq 0 --json "$OUT/tail_${dt}_$hidden.json" \
      > /tmp/o/tail_$hidden.log 2>&1
    echo "hidden $hidden: exit $?"; sed -n '/^TFLOP/,$p' /tmp/o/tail_$hidden.log
  done
done | tee "$OUT/tail.log"
