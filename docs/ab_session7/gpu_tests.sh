set -uo pipefail
OUT=${OUT:-/tmp/jax_flash_out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
start=$(date +%s)
CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install --no-build-isolation --no-deps -v . > $OUT/build.log 2>&1 || { tail -40 $OUT/build.log; exit 1; }
echo "build: $(( $(date +%s) - start )) s"
REPO=$PWD
(cd /tmp && so=$(python3 -c "import jax_flash._jax_flash as m; print(m.__file__)"); cuobjdump -sass "$so" | python3 "$REPO/.ci/sass_report.py" > "$OUT/sass.txt" 2>&1)
echo "SASS kernels: $(grep -c . $OUT/sass.txt); with LDL/STL:"; awk 'NR > 1 && $NF > 0' $OUT/sass.txt | head -5
cd /tmp; start=$(date +%s)
timeout 330 python3 -m pytest -q -x -p no:cacheprovider -k "(sm90 or compiled or see_nothing) and not cpu" $REPO/tests > $OUT/pytest.log 2>&1
echo "pytest exit $? in $(( $(date +%s) - start )) s"; tail -3 $OUT/pytest.log
