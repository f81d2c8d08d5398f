#!/usr/bin/env bash
# Session 20 A/B on the GPU machine, with build/ab carried (binaries sm90_ab_v<name>, tests/harness/sm90_ab.cu):
#   NAMES="b p e pe" DIMS="128 64" ROUNDS=2 TRACE_NAME=pet NCU_SHAPES="128 2048;64 1024 causal" OUT=$OUT bash docs/ab_session20/ab.sh
# The harness's correctness check per binary, ROUNDS rounds of the head dims' shapes (first binary rotating), the
# median table, then (TRACE_NAME) one traced binary's timeline report at D = 128 2048 keys and D = 64 causal 1024.
set -uo pipefail
OUT=${OUT:-/tmp/jax_flash_out}
mkdir -p "$OUT" /tmp/trace
read -ra NAME_LIST <<< "${NAMES:?}"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
for v in "${NAME_LIST[@]}"; do timeout 120 build/ab/sm90_ab_v$v --check 64 512 | sed "s/^variant -\?[0-9]*/$v/" | grep -E "FAIL|check D=128 kv128 wg2 S=1024|check D=64 kv128 wg3 causal S=1030"; echo "$v check rc ${PIPESTATUS[0]}"; done | tee "$OUT/ab_check.txt"
for round in $(seq ${ROUNDS:-2}); do
  for i in "${!NAME_LIST[@]}"; do
    v=${NAME_LIST[$(( (i + round - 1) % ${#NAME_LIST[@]} ))]}
    for d in ${DIMS:-128 64}; do timeout 150 build/ab/sm90_ab_v$v $d | sed "s/^variant -\?[0-9]*/$v/"; done
  done
done > "$OUT/ab_time.txt" 2>&1
python3 - "$OUT/ab_time.txt" "${NAMES}" <<'PY'
import collections, re, statistics, sys
names = sys.argv[2].split()
rows = collections.defaultdict(list)
for line in open(sys.argv[1]):
    m = re.match(r"(\S+) D=(\d+) S=(\d+c?) kv(\d+)(?: wg\d)?: ([\d.]+) us ([\d.]+) TFLOP/s", line)
    if m: rows[(int(m[2]), m[3], m[1])].append(float(m[6]))
    elif line.strip(): print(line.rstrip())
shapes = sorted({k[:2] for k in rows})
print("TFLOP/s (median of rounds)  " + "  ".join(f"{v:>7s}" for v in names))
for d, s in shapes:
    print(f"D={d:<4d} S={s:<12s}        " + "  ".join(f"{statistics.median(rows[(d, s, v)]):7.1f}" for v in names))
PY
# NCU_SHAPES="D S [causal];...": Nsight Compute durations (its locked clock) per binary
NCU=${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}
IFS=';' read -ra SHAPES <<< "${NCU_SHAPES:-}"
for shape in "${SHAPES[@]}"; do
  for v in "${NAME_LIST[@]}"; do
    t=$(timeout 60 "$NCU" -k regex:attention --launch-skip 3 --launch-count 1 --section SpeedOfLight \
        build/ab/sm90_ab_v$v $shape 2>&1 | grep -E "^\s+Duration" | awk '{print $3, $2}')
    echo "ncu $v D,S=$shape: $t"
  done
done 2>&1 | tee "$OUT/ab_ncu.txt"
if [ -n "${TRACE_NAME:-}" ]; then
  TRACE_FILE=/tmp/trace/tr timeout 120 build/ab/sm90_ab_v$TRACE_NAME 128 2048 > /dev/null
  TRACE_FILE=/tmp/trace/tr timeout 120 build/ab/sm90_ab_v$TRACE_NAME 64 1024 causal > /dev/null
  for s in D128_S2048 D64_S1024c; do echo "=== $TRACE_NAME $s"; python3 docs/ab_session20/trace_report.py /tmp/trace/tr_$s.bin | head -12; done 2>&1 | tee "$OUT/trace_report.txt"
fi
