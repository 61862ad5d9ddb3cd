"""Validate the ``flashinfer`` backend end to end on a Blackwell GPU, then time it.

Run this on the B200/GB200 (sm_100a) or B300/GB300 (sm_103a) you serve on, after the offline setup
of ``docs/blackwell.md`` (``pip install 'jax_nvfp4[blackwell]'``, cubins in ``FLASHINFER_CUBIN_DIR``):

    python benchmarks/blackwell_check.py [--quick] [--skip-timing] [--json out.json]

Steps (each line reports PASS / FAIL / SKIP; the exit status is 1 if anything FAILed):

1. environment: device, versions against the pins, the offline cubin check, and the installed
   FlashInfer's signatures and enums against ``jax_nvfp4.backends.flashinfer.SIGNATURES``;
2. layouts: ``prepare_flashinfer_weights`` byte for byte against FlashInfer's own
   ``prepare_cute_dsl_weights`` / ``prepare_trtllm_fp4_weights`` (on the GPU, from bf16 weights
   that are exactly representable);
3. correctness under ``jax.jit`` against the ``xla`` backend: every kernel x mode x activation x
   routing method (JAX routing, and in-kernel routing for trtllm), padding ids and
   expert-parallel shards, eager and jitted, and the golden W4A16 files (``../shared/golden``);
4. the same inputs through FlashInfer's own PyTorch entry points (``cute_dsl_fused_moe``,
   ``trtllm_fp4_block_scale_routed_moe``), compared with the bridge's output;
5. trtllm: the workspace peak (``jax_tvm_ffi.get_last_workspace_peak``) against the bound, and a
   CUDA-graph run (XLA command buffers, in a subprocess) against the plain run;
6. timing (median of jitted calls) of ``flashinfer`` (cutedsl w4a16/w4a4, trtllm w4a4, with
   precomputed and in-kernel routing) against the ``ffi`` and ``xla`` backends on the DeepSeek-V3
   EP8 and Qwen3-30B-A3B shapes of ``jax_nvfp4.arg_specs``.

``--dry-run`` runs steps 1, 3 and 6 on any machine against the fake FlashInfer of
``tests/flashinfer_fake.py`` (a smoke test of this script, not of the kernels).

XLA preallocates most GPU memory by default; the CuTe DSL path takes its scratch memory from
PyTorch's allocator, so this script sets ``XLA_PYTHON_CLIENT_MEM_FRACTION=0.6`` unless set.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")
os.environ.setdefault("FLASHINFER_DISABLE_FP4_QUANT_FAST_MATH", "1")  # step 2: exact FlashInfer quantizer

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _timing import device_name, median_time  # noqa: E402

import jax_nvfp4 as nv  # noqa: E402
from jax_nvfp4 import arg_specs as specs  # noqa: E402
from jax_nvfp4.backends import base  # noqa: E402
from jax_nvfp4.backends import flashinfer as fb  # noqa: E402
from jax_nvfp4.backends import flashinfer_prepare as fp  # noqa: E402

W4A16_TOL = 1e-2  # relative Frobenius error against the xla backend
W4A4_TOL = 5e-2  # the kernels requantize GEMM1's bf16 output (fast math): a few codes differ
ROUTINGS = ("softmax_topk", "renormalize", "renormalize_naive", "topk_uniform", "llama4", "deepseek_v3")
RESULTS: list[dict] = []


def report(step, name, status, detail="", **extra):
    RESULTS.append(dict(step=step, check=name, status=status, detail=detail, **extra))
    print(f"[{status:4s}] {step}: {name}" + (f"  ({detail})" if detail else ""), flush=True)


def guarded(step, name):
    """Decorator-free try/except around one check: an exception is a FAIL with its message."""
    class _G:
        def __enter__(self):
            return self

        def __exit__(self, et, ev, tb):
            if et is not None:
                report(step, name, "FAIL", f"{et.__name__}: {ev}")
                if os.environ.get("JAX_NVFP4_CHECK_TRACEBACKS"):
                    traceback.print_exception(et, ev, tb)
            return True
    return _G()


def relerr(a, b):
    a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    b = np.asarray(jnp.asarray(b, jnp.float32), np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def tol(mode):
    return W4A4_TOL if mode == "w4a4" else W4A16_TOL


# ------------------------------------------------------------------------------------------------
# 1. environment

def step_environment(args):
    platform, cc, kind = fb.device_info()
    report("1 env", "device", "PASS" if cc in fb.SUPPORTED_CAPABILITIES or args.dry_run else "FAIL",
           f"{kind}, platform {platform}, compute capability {cc}")
    for dist in ("flashinfer-python", "jax-tvm-ffi", "apache-tvm-ffi", "torch", "nvidia-cutlass-dsl",
                 "flashinfer-cubin", "flashinfer-jit-cache", "jax", "jaxlib"):
        v = fb.gating._dist_version(dist)
        pinned = {"flashinfer-python": fb.FLASHINFER_VERSION, "jax-tvm-ffi": fb.JAX_TVM_FFI_VERSION}.get(dist)
        status = "INFO" if pinned is None else "PASS" if v == pinned else ("SKIP" if args.dry_run else "FAIL")
        report("1 env", f"{dist} version", status, f"{v}" + (f" (pinned {pinned})" if pinned else ""))
    why = base.get("flashinfer").unavailable_reason()
    report("1 env", "backend available", "PASS" if why is None else "FAIL", why or "")
    missing = fb.missing_trtllm_artifacts()
    status = "PASS" if not missing else ("SKIP" if args.dry_run else "FAIL")
    report("1 env", "offline cubins for trtllm", status,
           f"{fb.cubin_dir()}" + (f": {len(missing)} missing, first {missing[0]}" if missing else ""))
    with guarded("1 env", "runtime load and API check"):
        rt = fb.runtime()  # imports flashinfer, checks the version and SIGNATURES (inspect.signature)
        report("1 env", "runtime load and API check", "PASS", type(rt).__name__)
    if os.environ.get(fb.ENV_ALLOW_DOWNLOAD) == "1":
        report("1 env", "no downloads at run time", "SKIP",
               f"{fb.ENV_ALLOW_DOWNLOAD}=1 lets FlashInfer download")
    else:
        blocked = os.environ.get("FLASHINFER_NO_DOWNLOAD") == "1" or args.dry_run
        report("1 env", "no downloads at run time", "PASS" if blocked else "FAIL",
               f"FLASHINFER_NO_DOWNLOAD={os.environ.get('FLASHINFER_NO_DOWNLOAD')}")


# ------------------------------------------------------------------------------------------------
# 2. layouts against FlashInfer's own preparation (GPU only)

def _representable_experts(key, e, h, inter, gated):
    """NVFP4 experts with global scale 1 and a +-6 code in every block: their bf16 decoding is
    quantized back to the same bytes by FlashInfer's quantizer."""
    def part(k, rows, cols):
        kd, ks = jax.random.split(k)
        data = jax.random.bits(kd, (e, rows, cols // 2), jnp.uint8)
        data = data.reshape(e, rows, cols // 16, 8).at[..., 0].set(
            (data.reshape(e, rows, cols // 16, 8)[..., 0] & 0xF0) | 0x07).reshape(e, rows, cols // 2)  # code 6
        idx = jax.random.randint(ks, (e, rows, cols // 16), 0, 8)
        scales = jnp.asarray(specs._SCALE_CHOICES).astype(jnp.float8_e4m3fn)[idx]
        return nv.NVFP4Array(data, scales, jnp.ones((e,), jnp.float32))
    k1, k2 = jax.random.split(key)
    return nv.NVFP4Experts(part(k1, (2 if gated else 1) * inter, h), part(k2, h, inter), gated)


def step_layouts(args):
    if args.dry_run:
        report("2 layouts", "against FlashInfer's preparation", "SKIP", "dry run (needs the GPU quantizer)")
        return
    with guarded("2 layouts", "FlashInfer preparation"):
        import torch
        from flashinfer.fused_moe.api import QuantConfig, QuantFormat
        from flashinfer.fused_moe.prepare import prepare_cute_dsl_weights, prepare_trtllm_fp4_weights

        e, h, inter = 4, 512, 256
        for gated in (True, False):
            ex = _representable_experts(jax.random.key(7), e, h, inter, gated)
            canon = nv.dequantize(ex.gate_up, jnp.bfloat16)
            if gated:  # FlashInfer's canonical GEMM1 order is [up; gate]
                canon = canon[:, nv.gate_up_to_up_gate(2 * inter)]
            w1 = torch.from_dlpack(canon)
            w2 = torch.from_dlpack(nv.dequantize(ex.down, jnp.bfloat16))
            act = None
            if not gated:
                from flashinfer.fused_moe.api import ReLU2
                act = ReLU2()
            w4a16 = QuantConfig(weight=QuantFormat.NVFP4, activation=QuantFormat.BF16)
            w4a4 = QuantConfig(weight=QuantFormat.NVFP4, activation=QuantFormat.NVFP4)
            for kernel, prep, quant in (("cutedsl", prepare_cute_dsl_weights, w4a16),
                                        ("trtllm", prepare_trtllm_fp4_weights, w4a4)):
                name = f"{kernel} {'gated' if gated else 'relu2'}"
                with guarded("2 layouts", name):
                    view = prep(w1, w2, quant=quant, num_local_experts=e, hidden_size=h,
                                intermediate_size=inter, activation=act)
                    ours = nv.prepare_flashinfer_weights(ex, kernel)
                    if kernel == "cutedsl":
                        k1, k2, s1, s2 = "w1_weight", "w2_weight", "w1_weight_sf", "w2_weight_sf"
                    else:
                        k1, k2, s1, s2 = ("gemm1_weights", "gemm2_weights", "gemm1_weights_scale",
                                          "gemm2_weights_scale")

                    def raw(t):  # the bytes in storage order (the MMA view is a strided view)
                        t = t.view(torch.uint8) if t.dtype != torch.uint8 else t
                        if not t.is_contiguous():  # 6-D MMA view: back to (E, m_tiles, k_tiles, 32, 4, 4)
                            t = t.permute(5, 2, 4, 0, 1, 3).contiguous()
                        return t.reshape(e, -1).cpu().numpy()

                    def mine(a):
                        a = np.asarray(a)
                        return (a.view(np.uint8) if a.dtype != np.uint8 else a).reshape(e, -1)

                    same = [np.array_equal(raw(view[k]), mine(v)) for k, v in
                            ((k1, ours.w1), (k2, ours.w2), (s1, ours.w1_scales), (s2, ours.w2_scales))]
                    report("2 layouts", name, "PASS" if all(same) else "FAIL",
                           "w1, w2, w1 scales, w2 scales equal: " + ", ".join(map(str, same)))


# ------------------------------------------------------------------------------------------------
# 3. correctness against the xla backend

def _problem_inputs(seed, t, h, e_global):
    kx, kl, kb = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(kx, (t, h), jnp.bfloat16), jax.random.normal(kl, (t, e_global), jnp.float32),
            0.1 * jax.random.normal(kb, (e_global,), jnp.float32))


def _routing_kwargs(method, e_global, bias):
    kw = dict(routing=method, top_k=1 if method == "llama4" else 4)
    if method == "deepseek_v3":
        kw.update(bias=bias, n_group=4, topk_group=2, routed_scaling_factor=2.5)
    return kw


def step_correctness(args):
    t, h, inter, e = (8, 128, 64, 16) if args.dry_run else (37, 1024, 512, 16)
    x, logits, bias = _problem_inputs(1, t, h, e)
    cases = [("cutedsl", m, a) for m in ("w4a16", "w4a4") for a in ("swiglu", "geglu", "relu2", "swiglu_oai")]
    cases += [("trtllm", "w4a4", a) for a in ("swiglu", "relu2")]
    for kernel, mode, activation in cases:
        gated = activation != "relu2"
        ex = specs.random_nvfp4_experts(jax.random.key(2), specs.MoEShape(
            "check", e, e, h, inter if gated else 2 * inter, 4, gated=gated))
        p = nv.prepare_flashinfer_weights(ex, kernel)
        xs = x * 3 if activation == "swiglu_oai" else x
        for method in ROUTINGS:
            name = f"{kernel} {mode} {activation} {method}"
            with guarded("3 xla", name):
                kw = dict(_routing_kwargs(method, e, bias), mode=mode, activation=activation)
                ref, (rids, _) = nv.moe(xs, ex, router_logits=logits, backend="xla", return_routing=True, **kw)
                f = jax.jit(lambda xs, p, logits, kw=kw: nv.moe(xs, p, router_logits=logits,
                                                                return_routing=True, **kw))
                out, (ids, _) = f(xs, p, logits)
                same = np.all(np.sort(np.asarray(ids), 1) == np.sort(np.asarray(rids), 1), axis=1)
                err = relerr(np.asarray(out, np.float32)[same], np.asarray(ref, np.float32)[same])
                ok = err < tol(mode) and same.mean() >= 0.95
                report("3 xla", name, "PASS" if ok else "FAIL",
                       f"relerr {err:.2e} on {same.sum()}/{t} tokens routed alike", relerr=err)
    # padding ids, foreign ids and expert-parallel shards (precomputed routing)
    rng = np.random.default_rng(3)
    ids = jnp.asarray(rng.integers(-1, 2 * e, (t, 4)), jnp.int32)
    w = jnp.asarray(rng.random((t, 4)), jnp.float32)
    for kernel, mode in (("cutedsl", "w4a16"), ("cutedsl", "w4a4"), ("trtllm", "w4a4")):
        name = f"{kernel} {mode} expert-parallel shards with padding"
        with guarded("3 xla", name):
            ex = specs.random_nvfp4_experts(jax.random.key(4), specs.MoEShape("ep", 2 * e, 2 * e, h, inter, 4))
            ref = nv.moe(x, ex, topk_ids=ids, topk_weights=w, mode=mode, backend="xla")
            total = 0
            for lo in (0, e):
                sub = jax.tree_util.tree_map(lambda a, lo=lo: a[lo:lo + e], ex)
                part = nv.moe(x, nv.prepare_flashinfer_weights(sub, kernel), topk_ids=ids, topk_weights=w,
                              mode=mode, local_expert_offset=lo)
                total = total + jnp.asarray(part, jnp.float32)
            err = relerr(total, ref)
            report("3 xla", name, "PASS" if err < tol(mode) else "FAIL", f"relerr {err:.2e}", relerr=err)
    # golden W4A16 files: FlashInfer's reference MoE
    golden = pathlib.Path(os.environ.get("JAX_NVFP4_GOLDEN", HERE.parent.parent / "shared" / "golden"))
    if not (golden / "MANIFEST.json").exists():
        report("3 golden", "golden W4A16 files", "SKIP", f"{golden} not found (set JAX_NVFP4_GOLDEN)")
        return
    manifest = json.loads((golden / "MANIFEST.json").read_text())
    for fname in sorted(f for f in manifest if f.startswith("moe_")):
        with guarded("3 golden", fname):
            g = specs.load_golden_moe(golden, fname)
            out = nv.moe(g.x, nv.prepare_flashinfer_weights(g.experts, "cutedsl"),
                         router_logits=g.logits, **g.route_kwargs)
            err = relerr(out, g.out)
            report("3 golden", fname, "PASS" if err < W4A16_TOL else "FAIL", f"relerr {err:.2e}", relerr=err)


# ------------------------------------------------------------------------------------------------
# 4. FlashInfer's own PyTorch entry points on the same inputs (GPU only)

def step_direct(args):
    if args.dry_run:
        report("4 direct", "FlashInfer's PyTorch API", "SKIP", "dry run")
        return
    with guarded("4 direct", "FlashInfer's PyTorch API"):
        import torch
        import flashinfer
        from flashinfer.fused_moe.core import trtllm_fp4_block_scale_routed_moe
        from flashinfer.tllm_enums import SfLayout

        rt = fb.runtime()
        t, h, inter, e, k = 64, 1024, 512, 16, 4
        ex = specs.random_nvfp4_experts(jax.random.key(5), specs.MoEShape("direct", e, e, h, inter, k))
        x = jax.random.normal(jax.random.key(6), (t, h), jnp.bfloat16)
        ids, w = specs.random_routing(jax.random.key(8), t, specs.MoEShape("direct", e, e, h, inter, k))
        tt = lambda a: torch.from_dlpack(jnp.asarray(a))  # noqa: E731
        # E4M3 arrays cross as bytes and are viewed as float8 in PyTorch
        t8 = lambda a: tt(jax.lax.bitcast_convert_type(a, jnp.uint8)).view(torch.float8_e4m3fn)  # noqa: E731
        q = jax.block_until_ready(nv.quantize(x, per_token=True))
        for kernel, mode in (("cutedsl", "w4a16"), ("cutedsl", "w4a4"), ("trtllm", "w4a4")):
            with guarded("4 direct", f"{kernel} {mode}"):
                p = nv.prepare_flashinfer_weights(ex, kernel)
                ours = jax.block_until_ready(fb.flashinfer_moe(x, p, ids, w, mode=mode, num_experts=e,
                                                               deterministic=True))
                out = torch.empty((t, h), dtype=torch.bfloat16, device="cuda")
                if kernel == "cutedsl":
                    cfg = fb.CallConfig(kernel, mode, "swiglu", "precomputed", e, k, 0, e, h, inter, True,
                                        deterministic=True)
                    bufs = dict(x=tt(x), x_q=tt(q.data), x_scales=t8(q.scales), x_global=tt(q.global_scale),
                                topk_ids=tt(ids), topk_weights=tt(w), w1=tt(p.w1), w1_scales=t8(p.w1_scales),
                                w1_alpha=tt(p.w1_alpha), w2=tt(p.w2), w2_scales=t8(p.w2_scales),
                                w2_alpha=tt(p.w2_alpha), fc2_input_scale=tt(jnp.full((1,), fb.FC2_INPUT_SCALE)),
                                out=out)
                    flashinfer.cute_dsl_fused_moe(**fb.cutedsl_kwargs(cfg, bufs, rt))
                else:
                    trtllm_fp4_block_scale_routed_moe(
                        topk_ids=(tt(ids), tt(w)), routing_bias=None, hidden_states=tt(q.data),
                        hidden_states_scale=t8(q.scales), gemm1_weights=tt(p.w1),
                        gemm1_weights_scale=t8(p.w1_scales), gemm1_bias=None, gemm1_alpha=None, gemm1_beta=None,
                        gemm1_clamp_limit=None, gemm2_weights=tt(p.w2), gemm2_weights_scale=t8(p.w2_scales),
                        gemm2_bias=None, output1_scale_scalar=tt(p.w1_alpha),
                        output1_scale_gate_scalar=tt(p.w1_alpha), output2_scale_scalar=tt(p.w2_alpha),
                        num_experts=e, top_k=k, n_group=None, topk_group=None, intermediate_size=inter,
                        local_expert_offset=0, local_num_experts=e, routed_scaling_factor=None,
                        per_token_scale=tt(q.global_scale), output=out,
                        hidden_states_scale_layout=SfLayout.layout_linear)
                torch.cuda.synchronize()
                theirs = jnp.asarray(np.asarray(out.float().cpu()))
                err = relerr(ours, theirs)
                bitwise = bool(np.array_equal(np.asarray(ours, np.float32), np.asarray(theirs, np.float32)))
                report("4 direct", f"{kernel} {mode}", "PASS" if err < 1e-3 else "FAIL",
                       f"relerr {err:.2e}, bitwise equal: {bitwise}", relerr=err, bitwise=bitwise)


# ------------------------------------------------------------------------------------------------
# 5. trtllm workspace and CUDA graphs (GPU only)

def _graph_problem():
    shape = specs.MoEShape("graph", 64, 64, 1024, 512, 8)
    ex = specs.random_nvfp4_experts(jax.random.key(11), shape)
    x = jax.random.normal(jax.random.key(12), (16, shape.hidden), jnp.bfloat16)
    ids, w = specs.random_routing(jax.random.key(13), 16, shape)
    return ex, x, ids, w


def graph_child(path, cuda_graph):
    ex, x, ids, w = _graph_problem()
    p = nv.prepare_flashinfer_weights(ex, "trtllm")
    f = jax.jit(lambda x, ids, w: fb.flashinfer_moe(x, p, ids, w, mode="w4a4", cuda_graph=cuda_graph))
    outs = [np.asarray(jnp.asarray(f(x, ids, w), jnp.float32)) for _ in range(5)]
    np.save(path, np.stack(outs))


def step_trtllm_runtime(args):
    if args.dry_run:
        report("5 trtllm", "workspace and CUDA graphs", "SKIP", "dry run")
        return
    with guarded("5 trtllm", "workspace peak"):
        import jax_tvm_ffi
        for shape in (specs.DEEPSEEK_V3_EP8, specs.QWEN3_30B_A3B):
            ex = specs.random_nvfp4_experts(jax.random.key(0), shape)
            p = nv.prepare_flashinfer_weights(ex, "trtllm")
            for t in (1, 64, 1024):
                x = specs.random_hidden(jax.random.key(1), t, shape)
                ids, w = specs.random_routing(jax.random.key(2), t, shape)
                jax.block_until_ready(fb.flashinfer_moe(x, p, ids, w, mode="w4a4",
                                                        local_expert_offset=shape.local_expert_offset))
                peak = jax_tvm_ffi.get_last_workspace_peak()
                e_k = fb.kernel_num_experts(0, shape.local_experts, None)
                bound = fb.trtllm_workspace_bytes(t, shape.hidden, shape.intermediate, shape.local_experts,
                                                  shape.top_k, e_k)
                report("5 trtllm", f"workspace {shape.name} T={t}", "PASS" if 0 < peak <= bound else "FAIL",
                       f"peak {peak / 2**20:.1f} MiB, bound {bound / 2**20:.1f} MiB", peak=peak, bound=bound)
    with guarded("5 trtllm", "CUDA graph (XLA command buffers)"):
        with tempfile.TemporaryDirectory() as tmp:
            runs = {}
            for graph in (False, True):
                env = dict(os.environ)
                if graph:
                    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_graph_min_graph_size=1"
                                        " --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL").strip()
                path = os.path.join(tmp, f"graph_{graph}.npy")
                cmd = [sys.executable, __file__, "--graph-child", path] + (["--graph"] if graph else [])
                subprocess.run(cmd, env=env, check=True)
                runs[graph] = np.load(path)
            repeat = all(np.array_equal(r, runs[True][0]) for r in runs[True])
            err = relerr(runs[True][0], runs[False][0])
            report("5 trtllm", "CUDA graph (XLA command buffers)", "PASS" if repeat and err < 1e-3 else "FAIL",
                   f"5 graph replays identical: {repeat}; relerr vs plain run {err:.2e}")


# ------------------------------------------------------------------------------------------------
# 6. timing

def step_timing(args):
    shapes = ([specs.TINY, specs.TINY_EP] if args.dry_run or args.quick
              else [specs.DEEPSEEK_V3_EP8, specs.QWEN3_30B_A3B])
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else \
        ([1, 16] if args.dry_run or args.quick else [1, 8, 64, 512, 4096])
    warmup, repeats = (1, 3) if args.dry_run or args.quick else (5, 30)
    for shape in shapes:
        key = jax.random.key(0)
        q = specs.random_nvfp4_experts(key, shape)
        prepared = {k: nv.prepare_flashinfer_weights(q, k) for k in fp.KERNELS}
        off = shape.local_expert_offset
        for t in tokens:
            sets = []
            for i in range(3):
                kx, kr, kl = jax.random.split(jax.random.fold_in(key, 1000 * t + i), 3)
                ids, w = specs.random_routing(kr, t, shape)
                sets.append((specs.random_hidden(kx, t, shape), ids, w,
                             jax.random.normal(kl, (t, shape.num_experts), jnp.float32)))
            runs = [("flashinfer[cutedsl]", "w4a16", "cutedsl"), ("flashinfer[cutedsl]", "w4a4", "cutedsl"),
                    ("flashinfer[trtllm]", "w4a4", "trtllm"),
                    ("flashinfer[trtllm]+routing", "w4a4", "trtllm-logits")]
            runs += [(b, m, None) for b in ("ffi", "xla") for m in ("w4a16", "w4a4")]
            for name, mode, kind in runs:
                if kind is None:
                    b = base.get(name)
                    why = b.unavailable_reason() or b.unsupported_reason(shape.problem(t, mode))
                    if why:
                        report("6 timing", f"{shape.name} T={t} {name} {mode}", "SKIP", why)
                        continue

                    def fn(x, ids, w, logits, name=name, mode=mode):
                        return nv.moe(x, q, topk_ids=ids, topk_weights=w, mode=mode, backend=name,
                                      local_expert_offset=off)
                elif kind == "trtllm-logits":
                    def fn(x, ids, w, logits, p=prepared["trtllm"]):
                        return nv.moe(x, p, router_logits=logits, routing="renormalize", top_k=shape.top_k,
                                      local_expert_offset=off)
                else:
                    def fn(x, ids, w, logits, p=prepared[kind], mode=mode):
                        return fb.flashinfer_moe(x, p, ids, w, mode=mode, local_expert_offset=off)
                label = f"{shape.name} T={t} {name} {mode}"
                try:
                    sec = median_time(jax.jit(fn), sets, warmup=warmup, repeats=repeats)
                except Exception as err:
                    report("6 timing", label, "FAIL", f"{type(err).__name__}: {err}")
                    continue
                report("6 timing", label, "PASS", f"{1e6 * sec:9.1f} us", median_us=1e6 * sec, shape=shape.name,
                       tokens=t, backend=name, mode=mode)


# ------------------------------------------------------------------------------------------------

def install_dry_run():
    """Point the backend at tests/flashinfer_fake.py (any machine)."""
    sys.path.insert(0, str(HERE.parent / "tests"))
    import flashinfer_fake as fake

    fb.set_runtime(fake.FakeRuntime())
    fb.gating.device_info = lambda: ("cuda", "10.0", "fake B200 (dry run)")
    fb.gating.software_unavailable_reason = lambda: None
    if not fb.gating._find_spec("jax_tvm_ffi"):
        fb.bridge._launch = fake.host_launch


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small shapes and few timing repeats")
    p.add_argument("--skip-timing", action="store_true")
    p.add_argument("--tokens", default=None, help="comma-separated token counts for the timing")
    p.add_argument("--dry-run", action="store_true", help="fake FlashInfer, any machine (smoke test)")
    p.add_argument("--json", default=None, help="write every result as JSON here")
    p.add_argument("--graph-child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--graph", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.graph_child:
        return graph_child(args.graph_child, args.graph)
    if args.dry_run:
        install_dry_run()
    print(f"device: {device_name()}  jax {jax.__version__}  jax_nvfp4 {nv.__version__}  "
          f"pinned flashinfer {fb.FLASHINFER_VERSION}", flush=True)
    step_environment(args)
    if any(r["status"] == "FAIL" and r["check"] in ("device", "backend available", "runtime load and API check")
           for r in RESULTS):
        print("the flashinfer backend cannot run here; stopping after step 1", flush=True)
    else:
        step_layouts(args)
        step_correctness(args)
        step_direct(args)
        step_trtllm_runtime(args)
        if not args.skip_timing:
            step_timing(args)
    failed = [r for r in RESULTS if r["status"] == "FAIL"]
    count = lambda status: sum(r["status"] == status for r in RESULTS)  # noqa: E731
    print(f"\n{count('PASS')} passed, {len(failed)} failed, {count('SKIP')} skipped", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=device_name(), jax=jax.__version__, dry_run=args.dry_run,
                           flashinfer_pinned=fb.FLASHINFER_VERSION, results=RESULTS), f, indent=1, default=str)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
