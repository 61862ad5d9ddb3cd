#!/usr/bin/env bash
# Build, test and benchmark jax_nvfp4 on a GPU machine in one command; logs and JSON go to $OUT
# (default ./out). Usage: scripts/gpu_check.sh [quick|quant|moe|ffi|all]   (default: all)
set -uo pipefail
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
what=${1:-all}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
log() { echo "== $*" | tee -a "$OUT/summary.txt"; }
SHARED=${SHARED:-$PWD/../shared}; [ -d "$SHARED/golden" ] || SHARED=$PWD/shared

log "$(date -u +%FT%TZ) commit $(git rev-parse --short HEAD 2>/dev/null) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null)"
python3 -m pip install -q --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1 || { log "BUILD FAILED"; tail -40 "$OUT/build.log"; exit 1; }
python3 -c "import jax, jax_nvfp4._ffi as f; print(jax.devices()); print(f.build_info()); print('arch probe:', f.cuda_arch_probe())" 2>&1 | tee -a "$OUT/summary.txt"

if [[ $what == all || $what == quant || $what == quick ]]; then
  log "exactness probe"; python3 scripts/gpu_exactness_probe.py "$SHARED/golden" 2>&1 | tee -a "$OUT/summary.txt"
  log "quantize tests on GPU"
  python3 -m pytest -q -p no:cacheprovider tests/test_quantize.py tests/test_layouts.py 2>&1 | tee "$OUT/test_quantize.log" | tail -3 | tee -a "$OUT/summary.txt"
fi
if [[ $what == all || $what == quant ]]; then
  log "quantize benchmark"; python3 benchmarks/quantize.py --json "$OUT/quantize.json" 2>&1 | tee -a "$OUT/summary.txt"
fi
if [[ ($what == all || $what == moe) && -f benchmarks/moe_bench.py ]]; then
  log "moe tests on GPU"
  python3 -m pytest -q -p no:cacheprovider tests/test_moe.py tests/test_routing.py 2>&1 | tee "$OUT/test_moe.log" | tail -3 | tee -a "$OUT/summary.txt"
  log "moe benchmark"; python3 benchmarks/moe_bench.py --json "$OUT/moe.json" --plot "$OUT/moe.png" 2>&1 | tee -a "$OUT/summary.txt"
fi
if [[ ($what == all || $what == ffi) && -f scripts/gpu_ffi.sh ]]; then
  log "ffi"; bash scripts/gpu_ffi.sh 2>&1 | tee -a "$OUT/summary.txt"
fi
