#!/usr/bin/env bash
# ffi_stamp.sh [TREE]: what a build of the extension depends on, in one line: the content hash of TREE's
# C++/CUDA sources and CMakeLists.txt, and the CUDA archs (GPU_ARCHS, default 90a). prebuild_ffi.sh writes it
# beside a prebuilt extension; gpu_ffi.sh takes that extension only for a tree with the same stamp.
set -euo pipefail
cd "${1:-.}"
src=$(find ffi CMakeLists.txt -type f \( -name '*.cc' -o -name '*.cu' -o -name '*.h' -o -name '*.cuh' \
  -o -name CMakeLists.txt \) -print0 | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16)
echo "sources=$src archs=${GPU_ARCHS:-90a}"
