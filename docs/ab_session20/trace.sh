#!/usr/bin/env bash
# Session 20: the sm90 kernel's timeline (csrc/sm90/trace.cuh). On the GPU machine, with build/ab carried:
#   OUT=$OUT bash docs/ab_session20/trace.sh
# build/ab/sm90_ab_vb: the shipped kernels; sm90_ab_vt: the same with -DJAX_FLASH_TRACE (the tracer's clock reads
# and stores, to see how much it perturbs). Times both alternately, writes one traced launch per shape and prints
# docs/ab_session20/trace_report.py for the shapes in TRACE_SHAPES.
set -uo pipefail
OUT=${OUT:-/tmp/jax_flash_out}
mkdir -p "$OUT" /tmp/trace
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
for round in 1 2; do
  for v in b t; do
    for d in ${TRACE_DIMS:-128 64}; do timeout 120 build/ab/sm90_ab_v$v $d | sed "s/^variant -1/$v/"; done
  done
done 2>&1 | tee "$OUT/trace_time.txt" | grep -E "S=(1024|2048|16384)c? "
for d in ${TRACE_DIMS:-128 64}; do TRACE_FILE=/tmp/trace/tr timeout 120 build/ab/sm90_ab_vt $d > /dev/null; done
ls /tmp/trace
IFS=';' read -ra SHAPES <<< "${TRACE_SHAPES:-D128_S2048;D128_S1024;D128_S16384;D64_S1024c;D64_S1024}"
for s in "${SHAPES[@]}"; do
  echo "=== $s"
  python3 docs/ab_session20/trace_report.py /tmp/trace/tr_$s.bin
done 2>&1 | tee "$OUT/trace_report.txt"
python3 - "$OUT" <<'PY'
import sys, numpy as np
for name in ("D128_S2048", "D64_S1024c"):
    raw = np.fromfile(f"/tmp/trace/tr_{name}.bin", dtype=np.uint64).reshape(-1, 4, 8192, 2)
    keep = raw[:24]  # the first 24 blocks, for reading offline
    np.savez_compressed(f"{sys.argv[1]}/trace_{name}.npz", raw=keep)
PY
ls -la "$OUT"
