#!/usr/bin/env bash
# Session 14: Nsight Compute source counters (every SASS instruction: executions, warp-stall samples) of one A/B
# harness binary at given shapes; the binary is built with -lineinfo so each instruction maps to its source line.
#   SRC_SHAPES="128 512 causal;64 512 causal" bash docs/ab_session14/src_profile.sh l
set -uo pipefail
OUT=${OUT:-/tmp/jax_flash_out}
mkdir -p "$OUT"
v=${1:?name of the binary (build/ab/sm90_ab_v<name>)}
NCU=${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}
IFS=';' read -ra SHAPES <<< "${SRC_SHAPES:-128 512 causal}"
for shape in "${SHAPES[@]}"; do
  name=$(echo "$shape" | tr ' ' '_')
  timeout 120 "$NCU" -k regex:attention --launch-skip 3 --launch-count 1 --section SpeedOfLight \
    --section WarpStateStats --section SourceCounters --import-source no -f -o "/tmp/src_$name" \
    build/ab/sm90_ab_v$v $shape > "/tmp/src_$name.log" 2>&1
  echo "src $v $shape: exit $? $(grep -E '^\s+Duration' /tmp/src_$name.log | head -1)"
  "$NCU" -i "/tmp/src_$name.ncu-rep" --page source --csv --print-source sass 2>&1 | gzip > "$OUT/src_${v}_$name.csv.gz"
  "$NCU" -i "/tmp/src_$name.ncu-rep" --page source --csv --print-source cuda,sass 2>&1 | gzip > "$OUT/srcline_${v}_$name.csv.gz"
  "$NCU" -i "/tmp/src_$name.ncu-rep" --page details 2>&1 | grep -E "Duration|Stall|Warp Cycles|Issued" | head -20
done
