#!/usr/bin/env bash
# Session 20: Nsight Compute's source page (per-SASS-instruction executions and warp-stall samples) of the A/B
# harness's kernel at one shape, as gzipped CSV (digest: docs/ab_session6/sass_digest.py --listing):
#   OUT=$OUT bash docs/ab_session20/src.sh b "128 2048" ["64 1024 causal" ...]
set -uo pipefail
OUT=${OUT:-/tmp/jax_flash_out}
mkdir -p "$OUT"
NCU=${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}
v=$1; shift
for shape in "$@"; do
  name=$(echo "$v $shape" | tr ' ' '_')
  timeout 200 "$NCU" -k regex:attention --launch-skip 3 --launch-count 1 --section SpeedOfLight \
    --section WarpStateStats --section SourceCounters -o "/tmp/rep_$name" build/ab/sm90_ab_v$v $shape > /tmp/ncu_$name.log 2>&1
  echo "== $name (exit $?)"; tail -3 /tmp/ncu_$name.log
  "$NCU" -i "/tmp/rep_$name.ncu-rep" --page source --csv --print-source sass | gzip > "$OUT/src_$name.csv.gz"
  "$NCU" -i "/tmp/rep_$name.ncu-rep" > "$OUT/ncu_$name.txt" 2>&1
  grep -E "Duration|Warp Cycles Per Issued" "$OUT/ncu_$name.txt"
  python3 docs/ab_session6/sass_digest.py "$OUT/src_$name.csv.gz" | head -45
done
