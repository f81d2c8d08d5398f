#!/usr/bin/env bash
# Session 7 A/B on the GPU machine: binaries of tests/harness/sm90_ab.cu built here (nvcc, one per value of
# JAX_FLASH_SM90_VARIANT) and carried in build/ab; correctness check, alternating timed runs, Nsight Compute
# durations at its locked clock, and the key loop's SASS of each variant.
#   bash docs/ab_session7/run.sh "s 0 1 2 3"      (binaries build/ab/sm90_ab_v<name>; s: no -D, the shipped switches)
#   NCU_SHAPES="64 4096;64 4096 causal" SASS_VARIANTS="" bash docs/ab_session7/run.sh ...
set -uo pipefail
OUT=${OUT:-/tmp/jax_flash_out}
mkdir -p "$OUT"
VARIANTS=${1:-"0 1 2 3"}
NCU=${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
for v in $VARIANTS; do timeout 120 build/ab/sm90_ab_v$v --check 64 512 | head -2; done
for round in 1 2; do
  for v in $VARIANTS; do timeout 120 build/ab/sm90_ab_v$v; done
done > "$OUT/ab_time.txt" 2>&1
IFS=';' read -ra SHAPES <<< "${NCU_SHAPES:-64 1024;64 4096;128 1024;128 4096}"  # "D S [causal]" entries
for v in $VARIANTS; do
  for shape in "${SHAPES[@]}"; do
    t=$(timeout 60 "$NCU" -k regex:attention --launch-skip 3 --launch-count 1 --section SpeedOfLight \
        build/ab/sm90_ab_v$v $shape 2>&1 | grep -E "^\s+Duration" | awk '{print $3, $2}')
    echo "ncu variant $v D,S=$shape: $t"
  done
done > "$OUT/ab_ncu.txt" 2>&1
for v in ${SASS_VARIANTS-$VARIANTS}; do cuobjdump -sass build/ab/sm90_ab_v$v > "$OUT/sass_v$v.txt" 2>&1; done
ls "$OUT"/sass_v*.txt > /dev/null 2>&1 && gzip -f "$OUT"/sass_v*.txt
cat "$OUT/ab_ncu.txt"
# median over the rounds, per variant and shape
python3 - "$OUT/ab_time.txt" <<'PY'
import collections, re, statistics, sys
rows = collections.defaultdict(list)
for line in open(sys.argv[1]):
    m = re.match(r"variant (-?\d+) D=(\d+) S=(\d+c?) kv(\d+): ([\d.]+) us ([\d.]+) TFLOP/s", line)
    if m: rows[(int(m[2]), m[3] + "_kv" + m[4], int(m[1]))].append(float(m[6]))
    elif line.strip(): print(line.rstrip())
shapes = sorted({k[:2] for k in rows}); variants = sorted({k[2] for k in rows})
print("TFLOP/s (median of rounds)  " + "  ".join(f"v{v:<6d}" for v in variants))
for d, s in shapes:
    print(f"D={d:<4d} S={s:<12s}        " + "  ".join(f"{statistics.median(rows[(d, s, v)]):7.1f}" for v in variants))
PY
