#!/usr/bin/env bash
# Build the FFI extension on a GPU machine, run the ffi GPU tests, a CUDA-graph check and a short
# benchmark; logs and JSON go to $OUT (default ./out).
# Usage: scripts/gpu_ffi.sh [all|test|graph|bench] [pytest -k expression]
# Env: BUDGET (seconds in all, default 400), FFI_BENCH_BACKENDS (default "ffi,xla").
set -uo pipefail
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
what=${1:-all}; kexpr=${2:-}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
log() { echo "== $*" | tee -a "$OUT/ffi_summary.txt"; }
# BUDGET: seconds this script may take in all (default 400); each stage gets at most what is left.
BUDGET=${BUDGET:-400}; start=$(date +%s)
left() { local l=$(( BUDGET - ($(date +%s) - start) - 5 )); (( l < $1 )) && echo $(( l > 1 ? l : 1 )) || echo "$1"; }

log "$(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null)"
t0=$(date +%s)
python3 -m pip install -q --no-build-isolation --no-deps -e . >"$OUT/ffi_build.log" 2>&1 \
  || { log "BUILD FAILED"; tail -60 "$OUT/ffi_build.log"; exit 1; }
log "build $(( $(date +%s) - t0 )) s"
python3 - <<'PY' 2>&1 | tee -a "$OUT/ffi_summary.txt"
import jax, jax_nvfp4._ffi as f
from jax_nvfp4.backends import ffi
print(jax.__version__, jax.devices(), f.build_info())
print("arch probe:", f.cuda_arch_probe(), "| decode selftest wrong:", f._selftest_decode())
print("ffi unavailable_reason:", ffi.FFIBackend().unavailable_reason())
PY

if [[ $what == all || $what == test ]]; then
  log "GPU tests"
  kargs=(); [[ -n $kexpr ]] && kargs=(-k "$kexpr")
  timeout $(left 250) python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_ffi.py --maxfail=40 -rf \
    --durations=10 "${kargs[@]}" >"$OUT/ffi_pytest.log" 2>&1
  log "pytest rc=$?"
  grep -E "passed|failed|^FAILED|^ERROR|s call" "$OUT/ffi_pytest.log" | tail -50 | tee -a "$OUT/ffi_summary.txt"
fi

if [[ $what == all || $what == graph ]]; then
  # The same MoE with XLA command buffers forced on for custom calls: the handlers are captured
  # into CUDA graphs and replayed; the output must be bitwise the one without graphs.
  log "CUDA graph check"
  cat >"$OUT/graph_check.py" <<'PY'
import sys, numpy as np, jax, jax.numpy as jnp
import jax_nvfp4 as nv
sys.path.insert(0, "tests")
from test_ffi import make_experts, make_routing, make_x
ex = make_experts(1, 32, 512, 256)
f = jax.jit(lambda x, i, w: nv.moe(x, ex, topk_ids=i, topk_weights=w, backend="ffi"))
outs = []
for t in (1, 8, 300):
    x = make_x(t, t, 512); ids, w = make_routing(t, t, 4, 32)
    for _ in range(3):
        o = f(x, ids, w)
    outs.append(np.asarray(o.astype(jnp.float32)))
np.savez(sys.argv[1], *outs)
print("ok", sys.argv[1], [o.shape for o in outs])
PY
  timeout $(left 60) python3 "$OUT/graph_check.py" "$OUT/nograph.npz" 2>&1 | tail -2 | tee -a "$OUT/ffi_summary.txt"
  XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1" \
    timeout $(left 60) python3 "$OUT/graph_check.py" "$OUT/graph.npz" 2>&1 | tail -2 | tee -a "$OUT/ffi_summary.txt"
  python3 -c "
import numpy as np; a = np.load('$OUT/nograph.npz'); b = np.load('$OUT/graph.npz')
print('graph == no graph (bitwise):', all((a[k] == b[k]).all() for k in a.files))" 2>&1 | tee -a "$OUT/ffi_summary.txt"
  rm -f "$OUT/graph.npz" "$OUT/nograph.npz"
fi

if [[ $what == all || $what == bench ]]; then
  log "benchmark: benchmarks/moe_bench.py, layers chained in one jit (no dispatch overhead), ffi vs xla vs ragged_dot"
  timeout $(left 400) python3 benchmarks/moe_bench.py --backends "${FFI_BENCH_BACKENDS:-ffi,xla}" --modes w4a16,w4a4 \
    --chain 20 --json "$OUT/moe_ffi.json" 2>&1 | tail -60 | tee -a "$OUT/ffi_summary.txt"
fi
log "done in $(( $(date +%s) - t0 )) s"
