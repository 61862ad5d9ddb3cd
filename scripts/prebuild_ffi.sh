#!/usr/bin/env bash
# Build the extension on this machine for the GPU machine, so that a device call skips its build (about
# 2 minutes of the session's device time a tree):
#   scripts/prebuild_ffi.sh [TREE] [NAME]   -> .prebuilt/NAME/ (default this)
# then name ".prebuilt" in the device call's carry. The build's Python must have the GPU machine's jax and jaxlib
# (the XLA FFI headers) and nanobind, on its Python minor version (the extension's ABI): PREBUILD_PYTHON, or by
# default a venv (PREBUILD_VENV, default /tmp/jax_nvfp4_prebuild/venv) of python3 made once with PREBUILD_PINS
# (default the H200 machine's: jax==0.11.2 jaxlib==0.11.2 nanobind==3.1.0). gpu_ffi.sh takes a prebuilt extension
# only for a tree with the same ffi_stamp.sh and a jax of the version it was built against, else it builds.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
tree=$(cd "${1:-.}" && pwd); name=${2:-this}
if [[ -n ${PREBUILD_PYTHON:-} ]]; then
  py=$(command -v "$PREBUILD_PYTHON")
else
  venv=${PREBUILD_VENV:-/tmp/jax_nvfp4_prebuild/venv}; py=$venv/bin/python
  if [[ ! -x $py ]]; then
    rm -rf "$venv.tmp" && (cd "$root" && python3 -m venv "$venv.tmp")  # (the repository's python3: .python-version)
    # shellcheck disable=SC2086
    "$venv.tmp/bin/python" -m pip install -q ${PREBUILD_PINS:-jax==0.11.2 jaxlib==0.11.2 nanobind==3.1.0}
    mv "$venv.tmp" "$venv"  # (only a whole venv is taken; python -m pip still works after the move)
  fi
fi
bdir=${PREBUILD_DIR:-/tmp/jax_nvfp4_prebuild/build-$(echo "$tree" | sha256sum | cut -c1-12)}; mkdir -p "$bdir"
cmake -S "$tree" -B "$bdir" -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$py" \
  -DJAX_NVFP4_CUDA_ARCHS="${GPU_ARCHS:-90a}" >"$bdir.configure.log" 2>&1 || { cat "$bdir.configure.log"; exit 1; }
grep -q "CUDA kernels:" "$bdir.configure.log" ||
  { echo "no nvcc: a CPU-only build is no use on the GPU machine"; exit 1; }
cmake --build "$bdir" -j "$(nproc)"
mkdir -p "$root/.prebuilt"
tmp=$(mktemp -d "$root/.prebuilt/.tmp.XXXXXX")  # written whole, then renamed into place
cp "$bdir"/_ffi*.so "$tmp/"
bash "$root/scripts/ffi_stamp.sh" "$tree" >"$tmp/stamp"
rm -rf "${root:?}/.prebuilt/$name" && mv "$tmp" "$root/.prebuilt/$name"
jax_version=$("$py" -c 'import jax; print(jax.__version__)')
echo "prebuilt: .prebuilt/$name ($(cat "$root/.prebuilt/$name/stamp"), jax $jax_version)"
