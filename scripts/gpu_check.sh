#!/usr/bin/env bash
# Build, test and benchmark jax_nvfp4 on a GPU machine in one command; logs and JSON go to $OUT
# (default ./out). Usage: scripts/gpu_check.sh [parts...]   parts: quant moe ffi (default: all)
# CUDA_BUILD=0 skips compiling the CUDA kernels (faster when only pure-JAX parts are checked).
set -uo pipefail
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
parts=" ${*:-quant moe ffi} "
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
log() { echo "== $*" | tee -a "$OUT/summary.txt"; }
SHARED=${SHARED:-$PWD/../shared}; [ -d "$SHARED/golden" ] || SHARED=$PWD/shared
export JAX_NVFP4_GOLDEN=$SHARED/golden

log "$(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null) parts:$parts"
cuda_flag=(); [[ ${CUDA_BUILD:-1} == 0 ]] && cuda_flag=(--config-settings=cmake.define.JAX_NVFP4_CUDA=OFF)
python3 -m pip install -q --no-build-isolation --no-deps "${cuda_flag[@]}" -e . >"$OUT/build.log" 2>&1 \
  || { log "BUILD FAILED"; tail -40 "$OUT/build.log"; exit 1; }
python3 -c "
import jax, jax_nvfp4._ffi as f
print(jax.devices(), f.build_info())
if f.build_info()['cuda']: print('arch probe:', f.cuda_arch_probe())" 2>&1 | tee -a "$OUT/summary.txt"

if [[ $parts == *" quant "* ]]; then
  log "exactness probe"; python3 scripts/gpu_exactness_probe.py "$SHARED/golden" 2>&1 | tee -a "$OUT/summary.txt"
  log "quantize tests on GPU (golden, oracle and exact-arithmetic tests)"
  python3 -m pytest -q -p no:cacheprovider tests/test_quantize.py tests/test_layouts.py \
    -k "golden or numpy or mul_rn or div_rn or e4m3 or experts" 2>&1 | tee "$OUT/test_quantize.log" | tail -3 | tee -a "$OUT/summary.txt"
  log "quantize benchmark"; python3 benchmarks/quantize.py --json "$OUT/quantize.json" 2>&1 | tee -a "$OUT/summary.txt"
fi
if [[ $parts == *" moe "* ]]; then
  log "moe tests on GPU"
  python3 -m pytest -q -p no:cacheprovider tests/test_moe.py tests/test_routing.py 2>&1 | tee "$OUT/test_moe.log" | tail -3 | tee -a "$OUT/summary.txt"
  log "moe benchmark"
  python3 benchmarks/moe_bench.py --backends "${MOE_BACKENDS:-xla}" --json "$OUT/moe.json" --plot "$OUT/moe.png" 2>&1 | tee "$OUT/moe_bench.log" | tail -40
fi
if [[ $parts == *" ffi "* && -f scripts/gpu_ffi.sh ]]; then
  log "ffi"; bash scripts/gpu_ffi.sh 2>&1 | tee -a "$OUT/summary.txt"
fi
