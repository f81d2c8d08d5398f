#!/usr/bin/env bash
# Session 6 A/B under Nsight Compute (locked clock): the overlap schedule (shipped) against the schedule without
# intra-warpgroup overlap (pingpong on the exponentials), bf16, after a sweep_sm90 build:
#   BUILD_ARGS="-Ccmake.define.JAX_FLASH_CONFIG_SET=sweep_sm90" bash .ci/gpu.sh "..." ... ; bash docs/ab_session6/ncu_ab.sh
set -uo pipefail
OUT=${OUT:-/tmp/jax_flash_out}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
NCU=${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}
cd /tmp
run() {  # impl head_dim seq [causal]
  local t
  t=$(timeout 150 "$NCU" -k regex:attention --launch-skip 1 --launch-count 1 --section SpeedOfLight \
      python3 "$REPO/.ci/profile_case.py" "$1" bfloat16 "$2" "$3" ${4:-} 2>&1 | grep -E "^\s+Duration" | awk '{print $3, $2}')
  echo "$1 D=$2 S=$3 ${4:-noncausal}: $t"
}
for shape in "64 1024" "64 4096" "128 1024" "128 4096" "128 1024 causal"; do
  set -- $shape
  base=sm90_q128_kv128_st2_wg2_pp1; [ "${3:-}" = causal ] && base=sm90_q128_kv128_st2_wg2_pp0
  run $base $1 $2 ${3:-}
  run sm90_q128_kv128_st2_wg2_pp1_ov0 $1 $2 ${3:-}
done
run sm90_q128_kv192_st2_wg2_pp1 64 4096
run sm90_q128_kv192_st2_wg2_pp1_ov0 64 4096
