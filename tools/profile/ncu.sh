#!/usr/bin/env bash
# Nsight Compute counters of the attention kernels at the benchmark's shapes, on the GPU machine after a build
# (.ci/gpu.sh or pip install .):
#   bash tools/profile/ncu.sh "IMPL DTYPE HEAD_DIM SEQ [causal] [backward]" ...   (IMPL: tools/profile/ncu_case.py)
# (backward: FILTER=regex:attention_bwd_kernel, or cuDNN's regex:bprop, picks the backward's main kernel)
# One report per case under $OUT/ncu_<case>.txt (speed of light, compute pipes, scheduler, warp stalls, memory,
# occupancy) and a summary of the headline metrics last.
# SOURCE=1 also collects the source counters and writes $OUT/src_<case>.csv: every SASS instruction with its
# execution count and warp-stall samples (digest: tools/profile/sass_digest.py).
set -uo pipefail
OUT=${OUT:-/tmp/jax_flash_out}
mkdir -p "$OUT"
REPO=$(cd "$(dirname "$0")/../.." && pwd)
NCU=${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}
# our kernels (attention_kernel), cuDNN's fused attention (names with sdpa / fmha / flash / attention)
FILTER=${FILTER:-regex:attention|sdpa|fmha|flash|fprop}
# JAX takes 75% of the GPU's memory up front, and Nsight Compute saves the device's allocated memory to the host
# before replaying each kernel: on an H200 the second kernel profiled in one process failed. Allocate on demand.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
SOURCE_SECTION=()
[ -n "${SOURCE:-}" ] && SOURCE_SECTION=(--section SourceCounters)
cd /tmp
for case in "$@"; do
  name=$(echo "$case" | tr ' ' '_')
  rm -f "/tmp/rep_$name.ncu-rep"
  timeout ${NCU_TIMEOUT:-240} "$NCU" --target-processes all -k "$FILTER" --launch-skip 1 --launch-count 1 \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section SchedulerStats --section WarpStateStats \
    --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats "${SOURCE_SECTION[@]}" \
    -o "/tmp/rep_$name" python3 "$REPO/tools/profile/ncu_case.py" $case > "/tmp/ncu_$name.log" 2>&1
  echo "== $case (exit $?)"
  tail -2 "/tmp/ncu_$name.log"
  "$NCU" -i "/tmp/rep_$name.ncu-rep" > "$OUT/ncu_$name.txt" 2>&1
  grep -E "^  [a-zA-Z_].*\(|Duration|Compute \(SM\) Throughput|Memory Throughput|Issue Slots Busy|Issued Warp Per Scheduler|No Eligible|Active Warps Per Scheduler|Eligible Warps|Warp Cycles Per Issued|Registers Per Thread|Achieved Occupancy|L2 Hit Rate|ERR|rror" \
    "$OUT/ncu_$name.txt" | head -16
  if [ -n "${SOURCE:-}" ]; then
    "$NCU" -i "/tmp/rep_$name.ncu-rep" --page source --csv --print-source sass > "$OUT/src_$name.csv" 2>&1
    echo "source page: $(wc -l < "$OUT/src_$name.csv") lines"
  fi
done
