#!/usr/bin/env bash
# Nsight Compute counters of the attention kernels at the benchmark's shapes (docs/NOTES.md, "what limits it"):
#   bash .ci/profile.sh "IMPL DTYPE HEAD_DIM SEQ [causal]" ...   (after a build: .ci/gpu.sh or pip install .)
# One report per case under $OUT/ncu_<case>.txt (speed of light, compute pipes, scheduler, warp stalls, memory,
# occupancy) and a summary of the headline metrics last.
set -uo pipefail
OUT=${OUT:-/tmp/jax_flash_out}
mkdir -p "$OUT"
REPO=$(cd "$(dirname "$0")/.." && pwd)
NCU=${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}
# our kernels (attention_kernel), cuDNN's fused attention (names with sdpa / fmha / flash / attention)
FILTER=${FILTER:-regex:attention|sdpa|fmha|flash|fprop}
cd /tmp
for case in "$@"; do
  name=$(echo "$case" | tr ' ' '_')
  timeout ${NCU_TIMEOUT:-150} "$NCU" --target-processes all -k "$FILTER" --launch-skip 1 --launch-count 1 \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section SchedulerStats --section WarpStateStats \
    --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
    python3 "$REPO/.ci/profile_case.py" $case > "$OUT/ncu_$name.txt" 2>&1
  echo "== $case (exit $?)"
  grep -E "^  [a-zA-Z_].*\(|Duration|Compute \(SM\) Throughput|Memory Throughput|Issue Slots Busy|Issued Warp Per Scheduler|No Eligible|Active Warps Per Scheduler|Eligible Warps|Warp Cycles Per Issued|Registers Per Thread|Achieved Occupancy|L2 Hit Rate|ERR|rror" \
    "$OUT/ncu_$name.txt" | head -16
done
