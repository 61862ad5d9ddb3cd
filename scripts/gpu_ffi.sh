#!/usr/bin/env bash
# Build the FFI extension on a GPU machine, run the ffi GPU tests, a CUDA-graph check and a short
# benchmark; logs and JSON go to $OUT (default ./out).
# Usage: scripts/gpu_ffi.sh [all|test|graph|bench] [pytest -k expression]
# Env: BUDGET (seconds in all, default 400), FFI_BENCH_BACKENDS (default "ffi xla").
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
  log "benchmark: us per MoE layer (N chained layers in one jit, minus 1); floor = max(hit NVFP4 bytes / 4.3 TB/s, MMA / 790 TFLOP/s)"
  cat >"$OUT/ffi_bench.py" <<'PY'
import json, os, sys, time
import numpy as np, jax, jax.numpy as jnp
from jax import lax
import jax_nvfp4 as nv

def rand_nvfp4(key, shape, g):
    kd, ks = jax.random.split(key)
    data = jax.random.bits(kd, shape[:-1] + (shape[-1] // 2,), jnp.uint8)
    sc = jax.random.randint(ks, shape[:-1] + (shape[-1] // 16,), 0x20, 0x48).astype(jnp.uint8)
    return nv.NVFP4Array(data, lax.bitcast_convert_type(sc, jnp.float8_e4m3fn), jnp.full(shape[:1], g, jnp.float32))

def rand_experts(e, h, i):
    k1, k2 = jax.random.split(jax.random.key(e + h + i))
    return nv.NVFP4Experts(rand_nvfp4(k1, (e, 2 * i, h), 1 / np.sqrt(h)), rand_nvfp4(k2, (e, h, i), 1 / np.sqrt(i)))

def timed(backend, ex, x, ids, w, n=20):
    @jax.jit
    def run(x, ex, ids, w, m):
        body = lambda _, x: nv.moe(x, ex, topk_ids=ids, topk_weights=w, backend=backend)
        return lax.fori_loop(0, m, body, x)
    run(x, ex, ids, w, 1).block_until_ready()
    best = []
    for m in (1, n + 1):
        ts = []
        for _ in range(3):
            t0 = time.perf_counter(); run(x, ex, ids, w, m).block_until_ready(); ts.append(time.perf_counter() - t0)
        best.append(min(ts))
    return (best[1] - best[0]) / n * 1e6

rows = []
for name, e_loc, e_glob, h, i, k, tokens in [("qwen3-30b-a3b", 128, 128, 2048, 768, 8, (1, 64, 4096)),
                                             ("dsv3-ep8-shard", 32, 256, 7168, 2048, 8, (1, 64, 1024))]:
    ex = rand_experts(e_loc, h, i)
    for t in tokens:
        rng = np.random.default_rng(t)
        ids = jnp.asarray(np.stack([rng.permutation(e_glob)[:k] for _ in range(t)]).astype(np.int32))
        w = jnp.asarray(rng.random((t, k)), jnp.float32)
        x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
        hit = len(set(np.asarray(ids).ravel().tolist()) & set(range(e_loc)))
        pairs = int((np.asarray(ids) < e_loc).sum())
        floor = max(hit * 3 * h * i * 0.5625 / 4.3e12, 2 * pairs * 3 * h * i / 790e12) * 1e6
        r = dict(model=name, T=t, hit_experts=hit, pairs=pairs, floor_us=round(floor, 1))
        for b in os.environ.get("FFI_BENCH_BACKENDS", "ffi xla").split():
            try:
                r[b + "_us"] = round(timed(b, ex, x, ids, w), 1)
            except Exception as err:  # keep going: report what failed
                r[b + "_us"] = f"error: {type(err).__name__}: {str(err)[:300]}"
        if isinstance(r.get("ffi_us"), float):
            r["ffi_vs_floor"] = round(r["ffi_us"] / max(r["floor_us"], 1e-9), 2)
            r["ffi_tflops"] = round(2 * pairs * 3 * h * i / (r["ffi_us"] * 1e-6) / 1e12, 1)
        print(json.dumps(r), flush=True)
        rows.append(r)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
PY
  timeout $(left 170) python3 "$OUT/ffi_bench.py" "$OUT/ffi_bench.json" 2>&1 | tail -20 | tee -a "$OUT/ffi_summary.txt"
fi
log "done in $(( $(date +%s) - t0 )) s"
