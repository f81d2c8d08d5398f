#!/usr/bin/env bash
# Builds one jax_flash wheel and runs the quick test subset against it in a fresh venv per jax version: the check
# that a wheel built once loads under every jaxlib pyproject.toml allows.
#   bash tools/install_matrix.sh [jax versions...]        (default: 0.9.2 and the newest available)
#   WHEEL_ARGS=-Ccmake.define.JAX_FLASH_CUDA=OFF bash tools/install_matrix.sh 0.9.2 0.10.2   (CPU handler only)
#   MANYLINUX=1 bash tools/install_matrix.sh ...   (the wheel through `auditwheel repair`: a manylinux tag, checked to
#                                                   link nothing outside the policy; needs auditwheel and patchelf)
# The CUDA runtime is linked statically and the driver is found at run time, so a CUDA wheel needs no nvidia-*
# wheels; its manylinux tag is the build machine's glibc and libstdc++ (manylinux_2_35 from Debian 12's GCC 12).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
WORK=${WORK:-$(mktemp -d)}
VERSIONS=("$@")
[ ${#VERSIONS[@]} -gt 0 ] || VERSIONS=(0.9.2 "$(python3 -m pip index versions jax 2>/dev/null | sed -n 's/^jax (\(.*\))$/\1/p')")

start=$(date +%s)
python3 -m pip wheel --no-deps -q -w "$WORK/wheel" ${WHEEL_ARGS:-} "$REPO"
echo "wheel: $(ls "$WORK"/wheel) in $(( $(date +%s) - start )) s"
if [ -n "${MANYLINUX:-}" ]; then
  python3 -m auditwheel repair -w "$WORK/repaired" "$WORK"/wheel/*.whl
  rm "$WORK"/wheel/*.whl && mv "$WORK"/repaired/*.whl "$WORK/wheel/"
  echo "repaired: $(ls "$WORK"/wheel)"
fi
for version in "${VERSIONS[@]}"; do
  venv="$WORK/venv-$version"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q "jax==$version" "jaxlib==$version" pytest hypothesis flax flatbuffers \
    "$WORK"/wheel/*.whl
  echo "== jax $("$venv/bin/python" -c 'import jax; print(jax.__version__)')"
  (cd "$WORK" && "$venv/bin/python" -m pytest -q -p no:cacheprovider -m "not slow" "$REPO/tests" | tail -2)
done
