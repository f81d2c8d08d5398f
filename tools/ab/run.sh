#!/usr/bin/env bash
# A/B comparison on the GPU machine of binaries built by tools/ab/build.sh (carry build/ab):
#   [HARNESS=sm90_bwd_ab] NAMES="base new" [DIMS="128 64"] [DTYPE=bf16|fp16|fp8] [ROUNDS=2] [TIME_ARGS="--softcap 30"] \
#     [CHECK=0] [NCU_SHAPES="128 2048;64 1024 causal"] [TRACE_NAME=t] \
#     OUT=$OUT bash tools/ab/run.sh
# Each binary's correctness check (DTYPE, bf16 by default, with TIME_ARGS; CHECK=0 skips it, for probes whose
# results are wrong by design; DTYPE=fp8 with DIMS="128 256": the forward harness's FP8 kernels), ROUNDS
# rounds of the head dims' shapes (the first binary rotating from round to round, so a drift of clock or temperature
# reaches all alike), the median TFLOP/s per binary and shape; then
# Nsight Compute durations at its locked clock (NCU_SHAPES: "D S [causal]" entries) and, for a -DJAX_FLASH_TRACE
# binary (TRACE_NAME), its timeline report at D = 128 2048 keys and D = 64 causal 1024.
set -uo pipefail
OUT=${OUT:-/tmp/jax_flash_out}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
BIN="$REPO/build/ab"
H=${HARNESS:-sm90_ab}  # sm90_ab: the forward; sm90_bwd_ab: the backward
mkdir -p "$OUT" /tmp/trace
read -ra NAME_LIST <<< "${NAMES:?}"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
for v in "${NAME_LIST[@]}"; do
  [ "${CHECK:-1}" = 0 ] && break
  timeout 300 "$BIN/${H}_$v" --check --dtype "${DTYPE:-bf16}" ${TIME_ARGS:-} 64 1024 > "$OUT/ab_check_$v.txt" 2>&1
  echo "$v check: exit $? ($(grep -c ' ok$' "$OUT/ab_check_$v.txt") ok, $(grep -c FAIL "$OUT/ab_check_$v.txt") FAIL)"
done
for round in $(seq "${ROUNDS:-2}"); do
  for i in "${!NAME_LIST[@]}"; do
    v=${NAME_LIST[$(( (i + round - 1) % ${#NAME_LIST[@]} ))]}
    for d in ${DIMS:-128 64 256}; do timeout 300 "$BIN/${H}_$v" ${DTYPE:+--dtype $DTYPE} ${TIME_ARGS:-} "$d" | sed "s/^/$v /"; done
  done
done > "$OUT/ab_time.txt" 2>&1
python3 - "$OUT/ab_time.txt" "${NAMES}" <<'PY'
import collections, re, statistics, sys
names = sys.argv[2].split()
rows = collections.defaultdict(list)
for line in open(sys.argv[1]):
    m = re.match(r"(\S+) (\w+) D=(\d+) S=(\d+c?) .*: ([\d.]+) us ([\d.]+) TFLOP/s", line)
    if m: rows[(m[2], int(m[3]), m[4], m[1])].append(float(m[6]))
    elif line.strip(): print(line.rstrip())
shapes = sorted({k[:3] for k in rows}, key=lambda s: (s[0], s[1], s[2].endswith("c"), int(s[2].rstrip("c"))))
base = names[0]
print("TFLOP/s, median of rounds".ljust(26) + "".join(f"{v:>10s}" for v in names) + "   vs " + base)
for t, d, s in shapes:
    med = {v: statistics.median(rows[(t, d, s, v)]) for v in names if rows[(t, d, s, v)]}
    cells = "".join(f"{med.get(v, float('nan')):10.1f}" for v in names)
    rel = " ".join(f"{100 * (med[v] / med[base] - 1):+.1f}%" for v in names[1:] if v in med and base in med)
    print(f"{t} D={d:<4d} S={s:<8s}".ljust(26) + cells + "   " + rel)
PY
NCU=${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}
IFS=';' read -ra SHAPES <<< "${NCU_SHAPES:-}"
for shape in "${SHAPES[@]}"; do
  for v in "${NAME_LIST[@]}"; do
    t=$(timeout 120 "$NCU" -k regex:attention_kernel\|attention_bwd_kernel --launch-skip 3 --launch-count 1 \
        --section SpeedOfLight "$BIN/${H}_$v" $shape 2>&1 | grep -E "^\s+Duration" | awk '{print $3, $2}')
    echo "ncu $v D,S=$shape: $t"
  done
done 2>&1 | tee "$OUT/ab_ncu.txt"
if [ -n "${TRACE_NAME:-}" ]; then
  TRACE_FILE=/tmp/trace/tr timeout 120 "$BIN/${H}_$TRACE_NAME" --dtype bf16 128 2048 > /dev/null
  TRACE_FILE=/tmp/trace/tr timeout 120 "$BIN/${H}_$TRACE_NAME" --dtype bf16 64 1024 causal > /dev/null
  for s in bf16_D128_S2048 bf16_D64_S1024c; do
    echo "=== $TRACE_NAME $s"; python3 "$REPO/tools/ab/trace_report.py" "/tmp/trace/tr_$s.bin" | head -12
  done 2>&1 | tee "$OUT/trace_report.txt"
fi
