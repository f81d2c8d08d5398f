#!/bin/bash
# Kernel durations under ncu (locked clocks) for A = working tree and C = session-4 sm90.
# Run from the repository root at commit 6711401 (the experiment), with ab_tmp/sm90_old/ holding csrc/sm90/ of 7ee8b87
# (mkdir -p ab_tmp/sm90_old; git show 7ee8b87:csrc/sm90/FILE > ab_tmp/sm90_old/FILE for each file).
CASES=("sm90 bfloat16 128 512" "sm90 bfloat16 128 1024" "sm90 bfloat16 64 1024" "sm90 bfloat16 64 1024 causal")
REPO=$(pwd)
prof() {
  for c in "${CASES[@]}"; do
    d=$(cd /tmp && timeout 60 ncu -k "regex:attention" --launch-skip 1 --launch-count 1 --section SpeedOfLight python3 $REPO/.ci/profile_case.py $c 2>&1 | grep -E "^ +Duration" | awk '{print $2, $3}')
    echo "$1 | $c | $d" | tee -a $OUT/ncu_ab.txt
  done
}
build() { CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install --no-build-isolation --no-deps . > $OUT/build_$1.log 2>&1 || tail -30 $OUT/build_$1.log; echo "built $1 $(date +%T)"; }
build A; prof A
cp ab_tmp/sm90_old/* csrc/sm90/
build C; prof C
