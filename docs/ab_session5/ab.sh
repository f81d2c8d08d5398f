#!/bin/bash
# A/B/C of the sm90 epilogue changes in one call: A = working tree, B = no cross-tile overlap, C = session-4 sm90.
# Run from the repository root at commit 6711401 (the experiment), with ab_tmp/sm90_old/ holding csrc/sm90/ of 7ee8b87
# (mkdir -p ab_tmp/sm90_old; git show 7ee8b87:csrc/sm90/FILE > ab_tmp/sm90_old/FILE for each file).
BENCH="--dtypes bf16 --head-dims 128,64 --causal both --seqs 512,1024,2048,8192 --xla-max-seq 0 --reps 3"
PYTEST_TIMEOUT=200 bash .ci/gpu.sh "(sm90 or compiled or see_nothing) and not cpu" $BENCH > $OUT/A.txt 2>&1; cp $OUT/bench.json $OUT/A.json; tail -22 $OUT/A.txt
cp $OUT/pytest.log $OUT/pytestA.log
BUILD_ARGS="-Ccmake.define.CMAKE_CUDA_FLAGS=-DJAX_FLASH_SM90_NO_TILE_OVERLAP" bash .ci/gpu.sh "zzz_nothing" $BENCH > $OUT/B.txt 2>&1; cp $OUT/bench.json $OUT/B.json; tail -18 $OUT/B.txt
cp ab_tmp/sm90_old/* csrc/sm90/
bash .ci/gpu.sh "zzz_nothing" $BENCH > $OUT/C.txt 2>&1; cp $OUT/bench.json $OUT/C.json; tail -18 $OUT/C.txt
rm -f $OUT/bench.json $OUT/bench.png $OUT/build.log $OUT/pytest.log $OUT/bench.log $OUT/sass.txt
