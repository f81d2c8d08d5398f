#!/usr/bin/env bash
# Per-instruction SASS with Nsight Compute's warp-stall samples, ours beside cuDNN (docs/NOTES.md, session 6):
#   bash .ci/sass_profile.sh "IMPL DTYPE HEAD_DIM SEQ [causal]" ...   (after a build: .ci/gpu.sh or pip install .)
# For each case: $OUT/src_<case>.csv (the source page: SASS, stall samples per instruction) and the headline
# counters in $OUT/sum_<case>.txt.
set -uo pipefail
OUT=${OUT:-/tmp/jax_flash_out}
mkdir -p "$OUT"
REPO=$(cd "$(dirname "$0")/.." && pwd)
NCU=${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}
FILTER=${FILTER:-regex:attention|sdpa|fmha|flash|fprop}
cd /tmp
for case in "$@"; do
  name=$(echo "$case" | tr ' ' '_')
  rm -f "/tmp/rep_$name.ncu-rep"
  start=$(date +%s)
  timeout ${NCU_TIMEOUT:-240} "$NCU" --target-processes all -k "$FILTER" --launch-skip 1 --launch-count 1 \
    --section SpeedOfLight --section SchedulerStats --section WarpStateStats --section SourceCounters \
    --section LaunchStats -o "/tmp/rep_$name" python3 "$REPO/.ci/profile_case.py" $case > "/tmp/ncu_$name.log" 2>&1
  echo "== $case (exit $?, $(( $(date +%s) - start )) s)"
  tail -3 "/tmp/ncu_$name.log"
  "$NCU" -i "/tmp/rep_$name.ncu-rep" > "$OUT/sum_$name.txt" 2>&1
  grep -E "^  [a-zA-Z_].*\(|Duration|Issue Slots Busy|Eligible Warps|Warp Cycles Per Issued" "$OUT/sum_$name.txt" | head -8
  "$NCU" -i "/tmp/rep_$name.ncu-rep" --page source --csv --print-source sass > "$OUT/src_$name.csv" 2>&1 \
    || "$NCU" -i "/tmp/rep_$name.ncu-rep" --page source --csv > "$OUT/src_$name.csv" 2>&1
  echo "source page: $(wc -l < "$OUT/src_$name.csv") lines"; head -c 600 "$OUT/src_$name.csv"; echo
done
