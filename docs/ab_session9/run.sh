#!/usr/bin/env bash
# Session 9 A/B on the GPU machine (session 15 added ROUNDS, timed rounds, default 2; AB_CAUSAL_ONLY=1, the causal
# shapes only; NCU_SHAPES="", no Nsight Compute shape, unset the default three): harness binaries
# (tests/harness/sm90_ab.cu) built on the CPU machine and carried in build/ab as sm90_ab_v<name>; each binary's
# lines are relabelled with its name (a build without -DJAX_FLASH_SM90_VARIANT prints "variant -1"). Correctness
# check, alternating timed runs, Nsight Compute durations at its locked clock.
#   NCU_SHAPES="128 512;64 4096" bash docs/ab_session9/run.sh "b s n"
#   TIME_D=256 bash docs/ab_session9/run.sh "k80 k64"   (TIME_D: time one head dim's shapes only; session 10)
# (session 12: the timing lines may name the consumer warpgroups, "kv128 wg3")
set -uo pipefail
OUT=${OUT:-/tmp/jax_flash_out}
mkdir -p "$OUT"
NAMES=${1:?names of the binaries}
NCU=${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
for v in $NAMES; do timeout 120 build/ab/sm90_ab_v$v --check 64 512 | sed "s/^variant -\?[0-9]*/$v/" | grep check; done | tee "$OUT/ab_check.txt"
# (session 18: the first binary of a round rotates, round r starting at name r mod n: in run 7 of session 18 the last
# binary of each round read up to 1.5% high on shapes where it ran the same code as the one before it)
read -ra NAME_LIST <<< "$NAMES"
for round in $(seq ${ROUNDS:-2}); do
  for i in "${!NAME_LIST[@]}"; do
    v=${NAME_LIST[$(( (i + round - 1) % ${#NAME_LIST[@]} ))]}
    timeout 120 build/ab/sm90_ab_v$v ${TIME_D:-} | sed "s/^variant -\?[0-9]*/$v/"
  done
done > "$OUT/ab_time.txt" 2>&1
IFS=';' read -ra SHAPES <<< "${NCU_SHAPES-128 512;128 1024;64 4096}"  # "D S [causal]" entries
for shape in "${SHAPES[@]}"; do
  for v in $NAMES; do
    t=$(timeout 60 "$NCU" -k regex:attention --launch-skip 3 --launch-count 1 --section SpeedOfLight \
        build/ab/sm90_ab_v$v $shape 2>&1 | grep -E "^\s+Duration" | awk '{print $3, $2}')
    echo "ncu $v D,S=$shape: $t"
  done
done > "$OUT/ab_ncu.txt" 2>&1
cat "$OUT/ab_ncu.txt"
python3 - "$OUT/ab_time.txt" "$NAMES" <<'PY'
import collections, re, statistics, sys
names = sys.argv[2].split()
rows = collections.defaultdict(list)
for line in open(sys.argv[1]):
    m = re.match(r"(\S+) D=(\d+) S=(\d+c?) kv(\d+)(?: wg\d)?: ([\d.]+) us ([\d.]+) TFLOP/s", line)
    if m: rows[(int(m[2]), m[3], m[1])].append(float(m[6]))  # (the key block may differ between builds)
    elif line.strip(): print(line.rstrip())
shapes = sorted({k[:2] for k in rows})
print("TFLOP/s (median of rounds)  " + "  ".join(f"{v:>7s}" for v in names))
for d, s in shapes:
    print(f"D={d:<4d} S={s:<12s}        " + "  ".join(f"{statistics.median(rows[(d, s, v)]):7.1f}" for v in names))
PY
