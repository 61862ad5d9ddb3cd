"""The ``flashinfer`` backend (FlashInfer's Blackwell NVFP4 MoE kernels) up to the kernel launch.

No Blackwell GPU runs these tests; what they check:

- weight preparation: bit-equal to the golden row orders and 128x4 swizzle, exact and invertible;
- the call table: ``SIGNATURES`` against the pinned FlashInfer sources (when a copy of the wheel is
  given in ``JAX_NVFP4_FLASHINFER_SRC``: a ``.whl`` or an unpacked directory), and every call we
  build against ``SIGNATURES`` and the kernels' argument contracts;
- the bridge callbacks, end to end through ``jax_nvfp4.moe`` under ``jax.jit``, with a fake
  FlashInfer that emulates the kernels from the layouts it is given (``flashinfer_fake.py``),
  against the ``xla`` backend and the golden W4A16 MoE files: through ``jax.pure_callback``
  always, and through the real jax-tvm-ffi registration (on the CPU) when it is installed;
- capability gating, error messages, the offline cubin check.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import pathlib
import re
import sys
import warnings
import zipfile

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_nvfp4 as nv
from jax_nvfp4.backends import base
from jax_nvfp4.backends import flashinfer as fb
from jax_nvfp4.backends import flashinfer_prepare as fp
from conftest import golden, golden_moe, golden_names, run_on_cpu_devices
import flashinfer_fake as fake

HAS_JAX_TVM_FFI = all(importlib.util.find_spec(m) is not None for m in ("jax_tvm_ffi", "tvm_ffi"))
BRIDGES = ["host"] + (["jax-tvm-ffi"] if HAS_JAX_TVM_FFI else [])
BF16 = jnp.bfloat16
E4M3 = ml_dtypes.float8_e4m3fn
# w4a4: the kernels requantize GEMM1's output after rounding it to bf16, the xla backend from fp32,
# so a few E2M1 codes of the GEMM2 input differ (a layout or argument error gives errors ~ 1).
W4A4_TOL = 4e-2


def make_experts(seed=0, e=4, h=128, inter=64, gated=True):
    """Random NVFP4 experts (random codes, E4M3 scales in [1/4, 4], global scales ~ 1/sqrt(K))."""
    rng = np.random.default_rng(seed)

    def part(n, k):
        data = rng.integers(0, 256, (e, n, k // 2), dtype=np.uint8)
        scales = rng.choice(np.array([.25, .375, .5, .75, 1, 1.5, 2, 3, 4], E4M3), (e, n, k // 16))
        gs = (rng.uniform(0.5, 1.0, e) / (2.5 * np.sqrt(k))).astype(np.float32)
        return nv.NVFP4Array(jnp.asarray(data), jnp.asarray(scales), jnp.asarray(gs))

    return nv.NVFP4Experts(part((2 if gated else 1) * inter, h), part(h, inter), gated)


def relerr(a, b):
    a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    b = np.asarray(jnp.asarray(b, jnp.float32), np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def np_swizzle(lin):
    """Independent numpy 128x4 swizzle (spec section 3 offset formula), no padding."""
    m, kb = lin.shape
    out = np.zeros(m * kb, lin.dtype)
    mm, kk = np.meshgrid(np.arange(m), np.arange(kb), indexing="ij")
    off = (mm // 128) * (kb // 4) * 512 + (kk // 4) * 512 + (mm % 32) * 16 + ((mm % 128) // 32) * 4 + kk % 4
    out[off] = lin
    return out


# ------------------------------------------------------------------------------------------------
# Weight preparation against the golden files

@pytest.mark.parametrize("name", golden_names("swizzle_"))
def test_numpy_swizzle_oracle_matches_golden(name):
    z = golden(name)
    lin, sw = z["linear"], z["swizzled"]
    if lin.shape[0] % 128 or lin.shape[1] % 4:
        pytest.skip("padded case: prepared layouts never pad")
    np.testing.assert_array_equal(np_swizzle(lin), sw)


@pytest.mark.parametrize("kernel", fp.KERNELS)
@pytest.mark.parametrize("m", [256, 1024])
def test_prepared_gemm1_golden_rows_and_scales(kernel, m):
    """GEMM1 of gated experts (2I = m rows): rows = golden ``w13_rows`` of ``[up; gate]``."""
    z = golden(f"{kernel}_rows_{m}.npz")
    golden_rows = z["w13_rows"]  # rows[new] = old, for [up; gate] input
    inter, h, e = m // 2, 128, 2
    ex = make_experts(1, e=e, h=h, inter=inter)
    p = nv.prepare_flashinfer_weights(ex, kernel)
    gu_data, gu_scales = np.asarray(ex.gate_up.data), np.asarray(ex.gate_up.scales).view(np.uint8)
    up_gate = np.concatenate([np.arange(inter, m), np.arange(inter)])  # [up; gate] row -> [gate; up] row
    src = up_gate[golden_rows]
    for g in range(e):
        np.testing.assert_array_equal(np.asarray(p.w1[g]), gu_data[g][src])
        np.testing.assert_array_equal(np.asarray(p.w1_scales[g]).view(np.uint8).reshape(-1),
                                      np_swizzle(gu_scales[g][src]))
    np.testing.assert_array_equal(np.asarray(p.w1_alpha), np.asarray(ex.gate_up.global_scale))


@pytest.mark.parametrize("kernel", fp.KERNELS)
def test_prepared_gemm2_scales_bit_equal_golden_swizzle(kernel):
    """GEMM2 [E, H=256, I=128]: the prepared scale bytes are the golden swizzled bytes when the
    canonical scales are chosen so that the kernel's row order yields the golden linear scales."""
    z = golden("swizzle_256x8.npz")
    lin, sw = z["linear"], z["swizzled"]  # [256, 8] = [H, I/16]
    rows = golden("trtllm_rows_256.npz")["epilogue_shuffle"] if kernel == "trtllm" else np.arange(256)
    ex = make_experts(2, e=1, h=256, inter=128)
    canon = np.empty_like(lin)
    canon[rows] = lin  # prepared rows = canon[rows] = lin
    down = nv.NVFP4Array(ex.down.data, jnp.asarray(canon[None].view(E4M3)), ex.down.global_scale)
    ex = nv.NVFP4Experts(ex.gate_up, down, True)
    p = nv.prepare_flashinfer_weights(ex, kernel)
    np.testing.assert_array_equal(np.asarray(p.w2_scales[0]).view(np.uint8).reshape(-1), sw)
    np.testing.assert_array_equal(np.asarray(p.w2[0]), np.asarray(ex.down.data[0])[rows])
    np.testing.assert_array_equal(np.asarray(p.w2_alpha), np.asarray(ex.down.global_scale))


@pytest.mark.parametrize("kernel", fp.KERNELS)
def test_prepared_relu2_rows(kernel):
    ex = make_experts(3, e=2, h=128, inter=256, gated=False)
    p = nv.prepare_flashinfer_weights(ex, kernel)
    rows = (golden("trtllm_rows_256.npz")["epilogue_shuffle"] if kernel == "trtllm" else np.arange(256))
    np.testing.assert_array_equal(np.asarray(p.w1), np.asarray(ex.gate_up.data)[:, rows])
    assert p.activations == (("relu2",))


@pytest.mark.parametrize("kernel", fp.KERNELS)
@pytest.mark.parametrize("gated", [True, False])
def test_prepare_is_exact_and_invertible_under_jit(kernel, gated):
    ex = make_experts(4, e=3, h=256, inter=128, gated=gated)
    p = jax.jit(fp.prepare_weights, static_argnums=1)(ex, kernel)
    back = fp.restore_experts(p)
    for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(ex)):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8) if a.dtype == E4M3 else np.asarray(a),
                                      np.asarray(b).view(np.uint8) if b.dtype == E4M3 else np.asarray(b))
    assert p.kernel == kernel and p.gated == gated and p.num_experts == 3
    assert (p.hidden_size, p.intermediate_size) == (256, 128)
    leaves, tree = jax.tree_util.tree_flatten(p)  # a pytree with static kernel/gated
    assert len(leaves) == 6 and jax.tree_util.tree_unflatten(tree, leaves).kernel == kernel
    assert repr(p).startswith(f"PreparedWeights(w1=uint8[3, {256 if gated else 128}, 128], w1_scales=float8_e4m3fn")
    assert repr(p).endswith(f"w2_alpha=float32[3], kernel={kernel!r}, gated={gated}, weight_only=False)")


def test_prepare_errors():
    with pytest.raises(ValueError, match="H % 128"):
        nv.prepare_flashinfer_weights(make_experts(5, h=64), "cutedsl")
    with pytest.raises(ValueError, match="I % 64"):
        nv.prepare_flashinfer_weights(make_experts(5, inter=32), "trtllm")
    with pytest.raises(ValueError, match="I % 128"):
        nv.prepare_flashinfer_weights(make_experts(5, inter=64, gated=False), "trtllm")
    with pytest.raises(ValueError, match="kernel must be one of"):
        fp.prepare_weights(make_experts(5), "cutlass")
    with pytest.raises(TypeError, match="NVFP4Experts"):
        fp.prepare_weights("weights", "cutedsl")
    with pytest.raises(TypeError, match=r"needs NVFP4Experts, got dict \(load_nvfp4_experts returns one per"):
        nv.prepare_flashinfer_weights({"model.layers.0.mlp": make_experts(5)}, "cutedsl")
    p = nv.prepare_flashinfer_weights(make_experts(5), "cutedsl")
    with pytest.raises(ValueError, match=r"w1_scales must be float8_e4m3fn"):
        fp.PreparedWeights(p.w1, p.w1_scales.view(jnp.uint8), p.w1_alpha, p.w2, p.w2_scales, p.w2_alpha)


# ------------------------------------------------------------------------------------------------
# The call table against the pinned FlashInfer sources

def _pinned_source():
    src = os.environ.get("JAX_NVFP4_FLASHINFER_SRC")
    if not src:
        pytest.skip("set JAX_NVFP4_FLASHINFER_SRC to a flashinfer_python-"
                    f"{fb.FLASHINFER_VERSION} wheel or its unpacked directory")
    path = pathlib.Path(src)
    if path.suffix == ".whl":
        z = zipfile.ZipFile(path)
        return lambda rel: z.read(rel).decode()
    return lambda rel: (path / rel).read_text()


def _ast_signature(code, name):
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            a = node.args
            params = [p.arg for p in a.posonlyargs + a.args]
            return params, len(params) - len(a.defaults), [p.arg for p in a.kwonlyargs]
    raise AssertionError(f"{name} not found")


def test_signatures_match_pinned_sources():
    read = _pinned_source()
    assert f'__version__ = "{fb.FLASHINFER_VERSION}"' in read("flashinfer/_build_meta.py")
    assert fb.FLASHINFER_COMMIT in read("flashinfer/_build_meta.py")
    for name, rel in (("cute_dsl_fused_moe", "flashinfer/fused_moe/cute_dsl/fused_moe.py"),
                      ("trtllm_fp4_block_scale_moe", "flashinfer/fused_moe/core.py"),
                      ("trtllm_fp4_block_scale_routed_moe", "flashinfer/fused_moe/core.py")):
        params, required, kwonly = _ast_signature(read(rel), name)
        sig = fb.SIGNATURES[name]
        assert (tuple(params), required, tuple(kwonly)) == (sig.params, sig.required, sig.keyword_only), name
    # the C++ launcher: names and types in order
    cu = read("flashinfer/data/csrc/trtllm_fused_moe_kernel_launcher.cu")
    m = re.search(r"Array<Tensor> trtllm_fp4_block_scale_moe\((.*?)\)\s*\{", cu, re.S)
    params = [p.strip() for p in m.group(1).split(",")]
    got = [(p.rsplit(" ", 1)[0].replace("const", "").replace("&", "").strip(), p.rsplit(" ", 1)[1].lstrip("&"))
           for p in params]
    assert [n for _, n in got] == list(fb.SIGNATURES["trtllm_fp4_block_scale_moe[C++]"].params)
    assert [t for t, _ in got] == list(fb.TRTLLM_LAUNCHER_TYPES)
    assert "TVM_FFI_DLL_EXPORT_TYPED_FUNC(trtllm_fp4_block_scale_moe, trtllm_fp4_block_scale_moe);" in cu
    # the Python wrappers call that launcher positionally with the routing input mode first
    core = read("flashinfer/fused_moe/core.py")
    assert ("get_trtllm_moe_sm100_module().trtllm_fp4_block_scale_moe(\n        RoutingInputMode.FromLogits,"
            in core)
    assert "moe_op=moe_op," in core
    # enums
    enums = read("flashinfer/tllm_enums.py")
    for table, cls in ((fb.ACTIVATION_TYPE, "ActivationType"), (fb.ROUTING_METHOD_TYPE, "RoutingMethodType"),
                       (fb.ROUTING_INPUT_MODE, "RoutingInputMode")):
        body = enums.split(f"class {cls}(IntEnum):", 1)[1].split("\nclass ", 1)[0]
        for key, value in table.items():
            assert re.search(rf"^\s+{key} = \(?{value},?\)?\s*$", body, re.M), (cls, key, value)
    # artifacts and the headers the trtllm JIT build fetches
    arts = read("flashinfer/artifacts.py")
    assert f'"{fb.TRTLLM_BMM_ARTIFACT}"' in arts
    jit = read("flashinfer/jit/fused_moe.py")
    headers = re.search(r"BMM_EXPORT_HEADERS = \[(.*?)\]", jit, re.S).group(1)
    assert tuple(re.findall(r'"([^"]+)"', headers)) == fb.TRTLLM_BMM_HEADERS
    # the other names the runtime uses
    assert re.search(r"def convert_sf_to_mma_layout\(\s*sf: torch.Tensor,\s*m: int,\s*k: int,"
                     r"\s*num_groups: int = 1,\s*sf_vec_size: int = 16,", read("flashinfer/cute_dsl/utils.py"))
    assert "def is_cute_dsl_available() -> bool:" in read("flashinfer/cute_dsl/availability.py")
    assert "def get_trtllm_moe_sm100_module():" in core
    assert "FLASHINFER_CUBIN_DIR: pathlib.Path = _get_cubin_dir()" in read("flashinfer/jit/env.py")
    assert 'if os.getenv("FLASHINFER_NO_DOWNLOAD"):' in read("flashinfer/jit/cubin_loader.py")
    # the per-token GEMM2-input scale the CuTe DSL path requires (1 / (6 * e4m3_max))
    assert "fc2_input_scale == 1 / (6 * e4m3_max)" in read("flashinfer/fused_moe/cute_dsl/fused_moe.py")


def test_signature_problems_detects_drift():
    import inspect

    def f(x, x_sf, token_selected_experts, *, quant_mode="w4a4"):
        pass

    problems = fb.signature_problems("cute_dsl_fused_moe", inspect.signature(f))
    assert any("parameters" in p for p in problems) and any("keyword-only" in p for p in problems)


# ------------------------------------------------------------------------------------------------
# The calls we build, against the table and the contracts

T, K = 6, 2


def _buffers(cfg, seed=0):
    """Numpy buffers with the operand/result specs of ``cfg`` (the callback's view of XLA's)."""
    rng = np.random.default_rng(seed)
    env = dict(T=T, H=cfg.hidden, I=cfg.intermediate, E=cfg.local_num_experts, M1=cfg.m1, k=cfg.top_k,
               EG=cfg.num_experts, W=1024)
    out = {}
    for name, dtypes, template in cfg.operand_spec + cfg.result_spec:
        if name == "workspace":
            continue
        dt = np.dtype(fake._DTYPES.get(dtypes.split("|")[0], dtypes.split("|")[0]))
        shape = fb.spec_shape(template, env)
        out[name] = (rng.integers(0, 4, shape).astype(dt) if name != "topk_ids"
                     else rng.integers(0, cfg.num_experts, shape).astype(np.int32)).view(fake.FT)
    return out


def _cfg(kernel, mode="w4a4", activation="swiglu", routing="precomputed", **kw):
    gated = activation != "relu2"
    return fb.CallConfig(kernel=kernel, mode=mode, activation=activation, routing=routing, num_experts=12,
                         top_k=K, local_expert_offset=4, local_num_experts=4, hidden=128,
                         intermediate=128 if not gated else 64, gated=gated, **kw)


@pytest.mark.parametrize("mode, activation", [(m, a) for m in ("w4a16", "w4a4")
                                              for a in ("swiglu", "geglu", "relu2", "swiglu_oai")])
def test_cutedsl_call_matches_signature_and_contract(mode, activation):
    cfg = _cfg("cutedsl", mode, activation, deterministic=mode == "w4a4")
    t = _buffers(cfg)
    kw = fb.cutedsl_kwargs(cfg, t, fake.FakeRuntime())
    sig = fb.SIGNATURES["cute_dsl_fused_moe"]
    assert set(sig.params[:sig.required]) <= set(kw) <= set(sig.params) | set(sig.keyword_only)
    h, e = cfg.hidden, cfg.local_num_experts
    assert kw["quant_mode"] == mode and kw["moe_output"] is t["out"]
    assert (kw["num_experts"], kw["top_k"], kw["num_local_experts"], kw["local_expert_offset"]) == (12, K, 4, 4)
    assert kw["use_fused_finalize"] is (mode != "w4a4")
    act_name, extra = fb.CUTEDSL_ACTIVATION[activation]
    assert kw["activation_type"] == {"Swiglu": 3, "GegluTanh": 8, "Relu2": 6}[act_name]
    if activation == "swiglu_oai":
        assert (kw["swiglu_alpha"], kw["swiglu_beta"], kw["swiglu_limit"]) == (1.702, 1.0, 7.0)
    else:
        assert "swiglu_alpha" not in kw
    fake.expect(kw["w1_weight_sf"], "float8_e4m3fn", (32, 4, cfg.m1 // 128, 4, h // 64, e), "w1_weight_sf")
    fake.expect(kw["w2_weight_sf"], "float8_e4m3fn", (32, 4, h // 128, 4, cfg.intermediate // 64, e),
                "w2_weight_sf")
    if mode == "w4a16":
        fake.expect(kw["x"], "bfloat16", (T, h), "x")
        assert kw["x_sf"] is None and kw["fc2_input_scale"] is None and kw["per_token_scale"] is None
    else:
        fake.expect(kw["x"], "uint8", (T, h // 2), "x")
        fake.expect(kw["x_sf"], "float8_e4m3fn", (T, h // 16, 1), "x_sf")
        fake.expect(kw["per_token_scale"], "float32", (T,), "per_token_scale")
        fake.expect(kw["fc2_input_scale"], "float32", (1,), "fc2_input_scale")


@pytest.mark.parametrize("routing, activation", [("precomputed", "swiglu"), ("precomputed", "relu2"),
                                                 ("logits", "swiglu")])
def test_trtllm_call_matches_launcher(routing, activation):
    extra = {}
    if routing == "logits":
        extra = dict(routing_method=2, n_group=4, topk_group=2, routed_scaling_factor=2.5)
    cfg = _cfg("trtllm", "w4a4", activation, routing, tactic=(64, 3), **extra)
    t = _buffers(cfg)
    if routing == "logits":
        t["routing_bias"] = np.zeros(12, np.float32)
    args = fb.trtllm_args(cfg, t)
    names = fb.SIGNATURES["trtllm_fp4_block_scale_moe[C++]"].params
    assert tuple(args) == names  # every launcher parameter, in order
    for (name, value), ctype in zip(args.items(), fb.TRTLLM_LAUNCHER_TYPES):
        fake.check_ctype(name, value, ctype)
    assert args["routing_input_mode"] == (0 if routing == "logits" else 2)
    assert args["act_type"] == (6 if activation == "relu2" else 3)
    assert args["config_index"] == [64, 3] and args["output"] is t["out"]
    assert args["output1_scales_scalar"] is t["w1_alpha"]
    assert args["output1_scales_gate_scalar"] is t["w1_alpha"]
    assert args["per_token_scales"] is t["x_global"] and args["hidden_states_scale"] is t["x_scales"]
    if routing == "logits":
        assert args["routing_logits"] is t["router_logits"] and args["routing_bias"] is t["routing_bias"]
        assert (args["routing_method_type"], args["n_group"], args["topk_group"]) == (2, 4, 2)
        assert args["routed_scaling_factor"] == 2.5
    else:
        assert args["routing_logits"] is None and args["routing_method_type"] == 0


def test_operand_specs_are_checked():
    cfg = _cfg("cutedsl", "w4a16")
    env = dict(T=T, H=128, I=64, E=4, M1=128, k=K)
    ops = {n: jnp.zeros(fb.spec_shape(s, env), d.split("|")[0]) for n, d, s in cfg.operand_spec}
    fb.check_operands(cfg.operand_spec, ops, env)
    bad = dict(ops, w1_scales=jax.lax.bitcast_convert_type(ops["w1_scales"], jnp.float8_e4m3fn))
    with pytest.raises(ValueError, match="w1_scales: want uint8"):
        fb.check_operands(cfg.operand_spec, bad, env)
    with pytest.raises(ValueError, match="operands"):
        fb.check_operands(cfg.operand_spec, dict(reversed(list(ops.items()))), env)


# ------------------------------------------------------------------------------------------------
# End to end through jax_nvfp4.moe with the fake kernels

def _install_fake(monkeypatch, bridge):
    """A fake "B200" with the fake FlashInfer; ``bridge``: "host" (jax.pure_callback) or
    "jax-tvm-ffi" (the backend's own registration path, on the CPU)."""
    rt = fake.FakeRuntime()
    prev = fb.set_runtime(rt)
    monkeypatch.setattr(fb.gating, "device_info", lambda: ("cuda", "10.0", "NVIDIA B200 (fake)"))
    monkeypatch.setattr(fb.gating, "software_unavailable_reason", lambda: None)
    if bridge == "host":
        monkeypatch.setattr(fb.bridge, "_launch", fake.host_launch)
    warnings.simplefilter("ignore")  # the per-call preparation warnings
    return rt, prev


@pytest.fixture(params=BRIDGES)
def fake_flashinfer(request, monkeypatch):
    """Both bridges (jax-tvm-ffi only when installed)."""
    rt, prev = _install_fake(monkeypatch, request.param)
    yield rt
    fb.set_runtime(prev)


@pytest.fixture
def fake_host(monkeypatch):
    """The host bridge only (for tests whose subject is not the bridge)."""
    rt, prev = _install_fake(monkeypatch, "host")
    yield rt
    fb.set_runtime(prev)


def _inputs(seed, t=8, h=128, e_global=8):
    rng = np.random.default_rng(seed + 100)
    return (jnp.asarray(rng.standard_normal((t, h)), BF16),
            jnp.asarray(rng.standard_normal((t, e_global)), jnp.float32))


CASES = [("cutedsl", "w4a16", a) for a in ("swiglu", "geglu", "relu2", "swiglu_oai")] + \
        [("cutedsl", "w4a4", "swiglu"), ("cutedsl", "w4a4", "relu2"),
         ("trtllm", "w4a4", "swiglu"), ("trtllm", "w4a4", "relu2")]


@pytest.mark.parametrize("kernel, mode, activation", CASES)
def test_moe_matches_xla_through_the_bridge(fake_host, kernel, mode, activation):
    gated = activation != "relu2"
    ex = make_experts(10, e=8, h=128, inter=64 if gated else 128, gated=gated)
    x, logits = _inputs(10)
    x = x * 3 if activation == "swiglu_oai" else x  # reach the clamps
    p = nv.prepare_flashinfer_weights(ex, kernel)
    kw = dict(router_logits=logits, routing="topk_uniform", top_k=2, activation=activation, mode=mode)
    f = jax.jit(lambda x, p, logits: nv.moe(x, p, **dict(kw, router_logits=logits)))
    out = f(x, p, logits)
    ref = nv.moe(x, ex, backend="xla", **kw)
    assert out.dtype == BF16 and out.shape == x.shape
    tol = W4A4_TOL if mode == "w4a4" else 5e-3
    assert relerr(out, ref) < tol
    name, args = fake_host.calls[-1]
    assert name == ("cute_dsl_fused_moe" if kernel == "cutedsl" else "trtllm_fp4_block_scale_moe[C++]")
    if kernel == "cutedsl":
        assert fake_host.streams[-1] == 0  # XLA's stream (0 on the CPU) was made current


def test_layout_errors_are_caught_by_the_emulator(fake_host):
    """A preparation bug (here: trtllm rows given to the CuTe DSL kernel) gives a wrong output."""
    ex = make_experts(11, e=8, h=128, inter=64)
    x, logits = _inputs(11)
    good = nv.prepare_flashinfer_weights(ex, "cutedsl")
    wrong = nv.prepare_flashinfer_weights(ex, "trtllm")
    wrong = fp.PreparedWeights(wrong.w1, wrong.w1_scales, wrong.w1_alpha, wrong.w2, wrong.w2_scales,
                               wrong.w2_alpha, kernel="cutedsl")
    kw = dict(router_logits=logits, routing="renormalize", top_k=2, mode="w4a16")
    ref = nv.moe(x, ex, backend="xla", **kw)
    assert relerr(nv.moe(x, good, **kw), ref) < 5e-3
    assert relerr(nv.moe(x, wrong, **kw), ref) > 0.3


@pytest.mark.parametrize("routing", ["softmax_topk", "renormalize", "renormalize_naive", "deepseek_v3"])
def test_trtllm_routes_from_logits_in_kernel(fake_host, routing):
    ex = make_experts(12, e=16, h=128, inter=64)
    x, logits = _inputs(12, e_global=16)
    rkw = dict(routing=routing, top_k=2)
    if routing == "deepseek_v3":
        rkw.update(bias=jnp.asarray(np.random.default_rng(1).standard_normal(16) * .1, jnp.float32),
                   n_group=4, topk_group=2, routed_scaling_factor=2.5)
    p = nv.prepare_flashinfer_weights(ex, "trtllm")
    out, (ids, w) = jax.jit(lambda x, p, l: nv.moe(x, p, router_logits=l, mode="w4a4", return_routing=True,
                                                    **rkw))(x, p, logits)
    jax.block_until_ready(out)  # the callback runs when XLA executes
    name, args = fake_host.calls[-1]
    assert args["routing_input_mode"] == fb.ROUTING_INPUT_MODE["FromLogits"]
    ref_ids, ref_w = nv.route(logits, **{("method" if k == "routing" else k): v for k, v in rkw.items()})
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(ref_ids))
    np.testing.assert_allclose(np.asarray(w), np.asarray(ref_w), rtol=1e-2)  # the kernel's weights are bf16
    ref = nv.moe(x, ex, backend="xla", router_logits=logits, mode="w4a4", **rkw)
    assert relerr(out, ref) < W4A4_TOL


def test_unsupported_in_kernel_routing_falls_back_to_jax(fake_host):
    ex = make_experts(13, e=8, h=128, inter=64)
    x, logits = _inputs(13)
    p = nv.prepare_flashinfer_weights(ex, "trtllm")
    out = jax.block_until_ready(nv.moe(x, p, router_logits=logits, routing="renormalize", top_k=2,
                                       routed_scaling_factor=2.0))
    assert fake_host.calls[-1][1]["routing_input_mode"] == fb.ROUTING_INPUT_MODE["UnpackedPrecomputed"]
    ref = nv.moe(x, ex, backend="xla", router_logits=logits, routing="renormalize", top_k=2,
                 routed_scaling_factor=2.0, mode="w4a4")
    assert relerr(out, ref) < W4A4_TOL


@pytest.mark.parametrize("kernel", fp.KERNELS)
def test_expert_parallel_padding_and_foreign_ids(fake_flashinfer, kernel):
    """Precomputed global ids with padding (-1) and other shards' experts: the kernels see ids in
    their expert space only; the shards sum to the whole layer."""
    ex = make_experts(14, e=8, h=128, inter=64)
    x, _ = _inputs(14)
    rng = np.random.default_rng(14)
    ids = jnp.asarray(rng.integers(-1, 8, (8, 2)), jnp.int32)
    w = jnp.asarray(rng.random((8, 2)), jnp.float32)
    mode = "w4a4" if kernel == "trtllm" else "w4a16"
    ref = nv.moe(x, ex, topk_ids=ids, topk_weights=w, mode=mode, backend="xla")

    def shard(lo, hi):
        sub = jax.tree_util.tree_map(lambda a: a[lo:hi], ex)
        return nv.moe(x, nv.prepare_flashinfer_weights(sub, kernel), topk_ids=ids, topk_weights=w, mode=mode,
                      local_expert_offset=lo)

    total = sum(jnp.asarray(shard(lo, lo + 4), jnp.float32) for lo in (0, 4))
    assert relerr(total, ref) < (W4A4_TOL if mode == "w4a4" else 5e-3)
    kw = fake_flashinfer.calls[-1][1]
    ids_seen = np.asarray(fake.to_numpy(kw.get("token_selected_experts", kw.get("topk_ids"))))
    assert ids_seen.min() >= 0 and kw.get("local_expert_offset") == 4


@pytest.mark.parametrize("kernel", fp.KERNELS)
@pytest.mark.parametrize("routed", [False, True])
def test_traced_offset_moves_the_ids_into_the_shard(fake_flashinfer, kernel, routed):
    """A traced local_expert_offset (shard_map's axis_index): the kernels get this shard's ids and offset 0
    (other shards' experts at the sentinel), the same layer as the int offset; routing from logits too."""
    ex = make_experts(16, e=8, h=128, inter=64)
    x, logits = _inputs(16)
    mode = "w4a4" if kernel == "trtllm" else "w4a16"
    sub = nv.prepare_flashinfer_weights(jax.tree_util.tree_map(lambda a: a[4:8], ex), kernel)
    ids, w = nv.route(logits, "renormalize", top_k=2)
    kw = dict(router_logits=logits, routing="renormalize", top_k=2) if routed else dict(topk_ids=ids, topk_weights=w)
    want = nv.moe(x, sub, mode=mode, local_expert_offset=4, **kw)
    got = jax.block_until_ready(jax.jit(lambda o: nv.moe(x, sub, mode=mode, local_expert_offset=o, **kw))(jnp.int32(4)))
    args = fake_flashinfer.calls[-1][1]
    if routed and kernel == "trtllm":  # the int offset routed in-kernel (bf16 weights), the traced one in JAX
        assert args["routing_input_mode"] == fb.ROUTING_INPUT_MODE["UnpackedPrecomputed"]
        assert relerr(got, want) < W4A4_TOL
    else:
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    seen = np.asarray(fake.to_numpy(args.get("token_selected_experts", args.get("topk_ids"))))
    assert args.get("local_expert_offset") == 0 and seen.max() <= 4  # 0-3 this shard's, 4 the sentinel


# Plain jit over 4 CPU devices with the fake FlashInfer: the expert_sharding rule splits the kernels' work. Compiled
# only: the host bridge's callbacks cannot run inside a custom partitioning, and the fake kernels called through
# jax-tvm-ffi (Python on XLA's device threads) stall the CPU collectives. What each device computes is checked by
# test_a_device_of_the_split_computes_its_shard.
_JIT_SHARDED = r"""
import sys, warnings
sys.path.insert(0, "tests")
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import jax_nvfp4 as nv
from jax_nvfp4.backends import flashinfer as fb
import flashinfer_fake as fake
from test_flashinfer import make_experts
fb.set_runtime(fake.FakeRuntime())
fb.gating.device_info = lambda: ("cuda", "10.0", "NVIDIA B200 (fake)")
fb.gating.software_unavailable_reason = lambda: None
fb.bridge._launch = fake.host_launch
warnings.simplefilter("ignore")
assert jax.device_count() == 4
ex = make_experts(30, e=8, h=128, inter=64)
x, logits = jnp.zeros((12, 128), jnp.bfloat16), jnp.zeros((12, 8), jnp.float32)
for kernel, mode in (("cutedsl", "w4a16"), ("trtllm", "w4a4")):
    w = nv.prepare_flashinfer_weights(ex, kernel)
    layer = jax.jit(lambda x, w, logits: nv.moe(x, w, router_logits=logits, top_k=2, mode=mode))
    for types in ((AxisType.Auto,) * 2, (AxisType.Explicit,) * 2):
        mesh = jax.make_mesh((2, 2), ("dp", "ep"), axis_types=types)
        put = lambda v, spec: jax.device_put(v, NamedSharding(mesh, spec))
        for x_spec, w_spec, summed in ((P("dp"), P("ep"), True), (P(), P(("dp", "ep")), True), (P("dp"), P(), False)):
            hlo = layer.lower(put(x, x_spec), put(w, w_spec), put(logits, x_spec)).compile().as_text()
            assert not expert_gathers(hlo), (kernel, types, x_spec, w_spec, expert_gathers(hlo))
            assert ("all-reduce" in hlo) == summed, (kernel, types, x_spec, w_spec)
            assert hlo.count("custom-call") >= 1
print("ok")
"""


def test_moe_under_jit_with_sharded_weights_and_tokens():
    """Plain jax.jit over 4 CPU devices, the prepared weights sharded along E and/or the tokens along T (Auto and
    Explicit mesh axes): the kernels run split, no expert bytes gathered, the outputs summed over the expert axes."""
    run_on_cpu_devices(_JIT_SHARDED, n=4)


@pytest.mark.parametrize("kernel", fp.KERNELS)
def test_a_device_of_the_split_computes_its_shard(fake_flashinfer, kernel):
    """What one device of the split runs (the rule's function on one device: the shard's ids at offset 0, in the
    kernels' sentinel space) is the shard run alone, bitwise."""
    ex = make_experts(31, e=8, h=128, inter=64)
    x, logits = _inputs(31)
    ids, w = nv.route(logits, "renormalize", top_k=2)
    mode = "w4a4" if kernel == "trtllm" else "w4a16"
    for lo in (0, 4):
        sub = nv.prepare_flashinfer_weights(jax.tree_util.tree_map(lambda a: a[lo:lo + 4], ex), kernel)
        alone = nv.moe(x, sub, topk_ids=ids, topk_weights=w, mode=mode, local_expert_offset=lo)
        leaves, treedef = jax.tree_util.tree_flatten(sub)
        device = fb.backend._over_devices(treedef, mode, "swiglu", lo, ())(x, ids, w, tuple(leaves))
        np.testing.assert_array_equal(np.asarray(device, np.float32), np.asarray(alone, np.float32))
        kw = fake_flashinfer.calls[-1][1]
        assert kw.get("local_expert_offset") == 0


@pytest.mark.parametrize("name", golden_names("moe_"))
def test_golden_moe_through_cutedsl(fake_host, name):
    """FlashInfer's reference W4A16 MoE (golden) through prepared weights and the CuTe DSL call."""
    g = golden_moe(name)
    p = nv.prepare_flashinfer_weights(g.experts, "cutedsl")
    out = nv.moe(g.x, p, router_logits=g.logits, **g.route_kwargs)
    assert relerr(out, g.out) < 1e-2


def test_unprepared_experts_are_prepared_once(fake_host):
    ex = make_experts(15, e=8, h=128, inter=64)
    x, logits = _inputs(15)
    fb.calls._PREPARED.clear()
    a = nv.moe(x, ex, router_logits=logits, top_k=2, backend="flashinfer")
    b = jax.block_until_ready(nv.moe(x, ex, router_logits=logits, top_k=2, backend="auto"))  # auto: "sm_100"
    assert len(fb.calls._PREPARED) == 1 and fake_host.calls[-1][0] == "cute_dsl_fused_moe"
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    f = jax.jit(lambda x, ex, l: nv.moe(x, ex, router_logits=l, top_k=2, backend="flashinfer"))
    np.testing.assert_array_equal(np.asarray(f(x, ex, logits), np.float32), np.asarray(a, np.float32))


@pytest.mark.skipif(not HAS_JAX_TVM_FFI, reason="jax-tvm-ffi is not installed")
def test_jax_tvm_ffi_registration(monkeypatch):
    """The real registration path (on the CPU): flags, in-kernel routing outputs, CUDA-graph opt-in."""
    rt, prev = _install_fake(monkeypatch, "jax-tvm-ffi")
    try:
        ex = make_experts(16, e=8, h=128, inter=64)
        x, logits = _inputs(16)
        for kernel, mode in (("cutedsl", "w4a16"), ("cutedsl", "w4a4"), ("trtllm", "w4a4")):
            out = nv.moe(x, nv.prepare_flashinfer_weights(ex, kernel), router_logits=logits, routing="llama4",
                         mode=mode)
            ref = nv.moe(x, ex, router_logits=logits, routing="llama4", mode=mode, backend="xla")
            assert relerr(out, ref) < (W4A4_TOL if mode == "w4a4" else 5e-3)
        # (CUDA graph, workspace output)
        assert [r[1:] for r in rt.registered] == [(False, False), (False, False), (False, True)]
        p = nv.prepare_flashinfer_weights(ex, "trtllm")
        out, (ids, w) = jax.jit(lambda x, l: nv.moe(x, p, router_logits=l, routing="renormalize", top_k=2,
                                                     return_routing=True))(x, logits)
        ref_ids, ref_w = nv.route(logits, "renormalize", top_k=2)
        np.testing.assert_array_equal(np.asarray(ids), np.asarray(ref_ids))
        np.testing.assert_allclose(np.asarray(w), np.asarray(ref_w), rtol=1e-2)
        assert relerr(out, nv.moe(x, ex, router_logits=logits, routing="renormalize", top_k=2, mode="w4a4",
                                  backend="xla")) < W4A4_TOL
        graph = fb.FlashInferBackend("trtllm", cuda_graph=True)  # (its options for this call only)
        jax.block_until_ready(nv.moe(x, p, topk_ids=ids, topk_weights=w, backend=graph))
        assert rt.registered[-1][1:] == (True, True)
        jax.block_until_ready(nv.moe(x, p, topk_ids=ids, topk_weights=w, mode="w4a4"))
        assert rt.registered[-1][1:] == (False, True)  # the registered backend's default again
    finally:
        fb.set_runtime(prev)


# ------------------------------------------------------------------------------------------------
# Gating, selection and errors

def _problem(mode="w4a16", activation="swiglu", h=128, inter=64, e=8, k=2, global_e=None, traced_offset=False):
    return base.MoEProblem(8, h, inter, e, k, mode, activation, global_e, traced_offset)


class _NoImport:
    """A meta-path finder that fails the test if flashinfer or torch get imported."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("flashinfer", "torch", "tvm_ffi", "jax_tvm_ffi"):
            raise AssertionError(f"{name} imported during a capability check")
        return None


@pytest.mark.parametrize("info, match", [
    (("cpu", None, "cpu"), r"default JAX device is 'cpu'"),
    (("cuda", "9.0", "NVIDIA H200"), r"compute capability 9.0"),
    (("cuda", "12.0", "NVIDIA RTX PRO 6000"), r"compute capability 12.0"),
    (("cuda", "10.7", "Rubin"), r"compute capability 10.7"),
    (("rocm", None, "MI300X"), r"platform 'rocm'"),
])
def test_unavailable_off_blackwell_without_importing(monkeypatch, info, match):
    monkeypatch.setattr(fb.gating, "device_info", lambda: info)
    finder = _NoImport()
    sys.meta_path.insert(0, finder)
    try:
        why = base.get("flashinfer").unavailable_reason()
    finally:
        sys.meta_path.remove(finder)
    assert re.search(match, why) and "sm_100a" in why
    p = _problem()
    with pytest.raises(ValueError, match="backend='flashinfer' cannot run this MoE"):
        base.select("flashinfer", p)
    assert base.select("auto", p).name != "flashinfer"


def test_real_device_gating():
    why = base.get("flashinfer").unavailable_reason()  # this machine: no Blackwell GPU
    assert why is not None and "sm_100a" in why
    ex = make_experts(20)
    x, logits = _inputs(20)
    with pytest.raises(ValueError, match="backend='flashinfer' cannot run this MoE: .*Blackwell"):
        nv.moe(x, ex, router_logits=logits, top_k=2, backend="flashinfer")
    with pytest.raises(ValueError, match="backend='flashinfer' cannot run this MoE"):
        nv.moe(x, nv.prepare_flashinfer_weights(ex), router_logits=logits, top_k=2)


def test_software_checks(monkeypatch):
    monkeypatch.setattr(fb.gating, "device_info", lambda: ("cuda", "10.0", "NVIDIA B200"))
    have = {"flashinfer", "jax_tvm_ffi", "tvm_ffi"}
    monkeypatch.setattr(fb.gating, "_find_spec", lambda m: object() if m in have else None)
    why = base.get("flashinfer").unavailable_reason()
    assert re.search(r"torch not installed: .*jax_nvfp4\[blackwell\]", why) and isinstance(why, base.InstallProblem)
    monkeypatch.setattr(base, "_WARNED", set())
    with pytest.warns(RuntimeWarning, match="passes over backend 'flashinfer': torch not installed"):
        assert base.select("auto", _problem()).name != "flashinfer"  # (a B200 without the optional packages)
    have.add("torch")
    versions = {"flashinfer-python": "0.7.4", "jax-tvm-ffi": fb.JAX_TVM_FFI_VERSION}
    monkeypatch.setattr(fb.gating, "_dist_version", versions.get)
    assert re.search(r"flashinfer-python 0.7.4 is installed, .*==0.7.2.post1", fb.software_unavailable_reason())
    monkeypatch.setenv(fb.ENV_UNPINNED, "1")
    assert fb.software_unavailable_reason() is None
    monkeypatch.delenv(fb.ENV_UNPINNED)
    versions["flashinfer-python"] = fb.FLASHINFER_VERSION
    assert base.get("flashinfer").unavailable_reason() is None
    assert base.select("auto", _problem()).name == "flashinfer"
    assert base.select("auto", _problem(mode="bf16")).name != "flashinfer"
    assert base.select("auto", _problem(traced_offset=True)).name == "flashinfer"  # (shard_map's axis_index)
    assert base.select("auto", _problem(e=2, k=8, traced_offset=True)).name == "ffi"  # 4 experts in its space


@pytest.mark.parametrize("problem, kernel, match", [
    (_problem(mode="bf16"), "auto", "mode 'bf16' has no FlashInfer"),
    (_problem(mode="w4a16"), "trtllm", "runs modes"),
    (_problem(mode="w4a4", activation="geglu"), "trtllm", "runs activations"),
    (_problem(h=64), "auto", "H % 128"),
    (_problem(inter=32), "cutedsl", "I % 64"),
    (_problem(k=33), "auto", "top_k <= 32"),
    (_problem(global_e=1024), "auto", "at most 512 experts"),
    (_problem(e=2, k=8, traced_offset=True), "auto", r"traced local_expert_offset .* fewer than top_k=8"),
])
def test_unsupported_problems(problem, kernel, match):
    assert re.search(match, fb.FlashInferBackend(kernel).unsupported_reason(problem))


def test_kernel_choice():
    b = fb.FlashInferBackend()
    assert b.kernel_for(_problem(mode="w4a16")) == "cutedsl"
    assert b.kernel_for(_problem(mode="w4a4")) == "trtllm"
    assert b.kernel_for(_problem(mode="w4a4", activation="geglu")) == "cutedsl"
    assert b.kernel_for(_problem(mode="w4a4", activation="relu2", inter=64)) == "cutedsl"  # trtllm: I % 128
    assert b.unsupported_reason(_problem(mode="w4a4", activation="swiglu_oai")) is None
    with pytest.raises(ValueError, match="kernel must be one of"):
        fb.FlashInferBackend("cutlass")


def test_prepared_weights_errors():
    ex = make_experts(21)
    x, logits = _inputs(21)
    p = nv.prepare_flashinfer_weights(ex, "trtllm")
    with pytest.raises(ValueError, match="run only on backend 'flashinfer', not 'xla'"):
        nv.moe(x, p, router_logits=logits, top_k=2, backend="xla")
    with pytest.raises(ValueError, match="prepared for kernel 'trtllm' run modes .*'w4a16'"):
        nv.moe(x, p, router_logits=logits, top_k=2, mode="w4a16")
    with pytest.raises(ValueError, match="does not run activation 'geglu'"):
        nv.moe(x, p, router_logits=logits, top_k=2, activation="geglu")
    with pytest.raises(ValueError, match="in-kernel .* takes no bias"):
        fb.flashinfer_moe_from_logits(x, p, logits, routing="renormalize", top_k=2, bias=jnp.zeros(8))


def test_routing_limits():
    r = fb.routing_unsupported_reason
    ok = dict(num_experts=256, top_k=8, bias=None, n_group=None, topk_group=None, routed_scaling_factor=1.0)
    assert r("renormalize", **ok) is None
    assert "no in-kernel equivalent" in r("topk_uniform", **ok)
    assert "no in-kernel equivalent" in r("llama4", **ok)  # TRT-LLM's Llama4 scales the input
    assert "Python number" in r("renormalize", **dict(ok, routed_scaling_factor=jnp.float32(1)))
    ds = dict(ok, bias=jnp.zeros(256), n_group=8, topk_group=4, routed_scaling_factor=2.5)
    assert r("deepseek_v3", **ds) is None
    assert "topk_group <= 4" in r("deepseek_v3", **dict(ds, topk_group=5))
    assert "E/n_group <= 32" in r("deepseek_v3", **dict(ds, n_group=2))


def test_kernel_expert_space():
    ids = jnp.asarray([[-1, 0, 3], [4, 7, 11]], jnp.int32)
    w = jnp.ones((2, 3), jnp.float32)
    k_ids, k_w, e_k = fb.calls._kernel_routing(ids, w, 4, 4, None)  # shard [4, 8) of unknown E
    assert e_k == 8 and e_k == fb.kernel_num_experts(4, 4, None)
    np.testing.assert_array_equal(np.asarray(k_ids), [[0, 0, 3], [4, 7, 0]])  # 0 is foreign here
    np.testing.assert_array_equal(np.asarray(k_w), [[0, 1, 1], [1, 1, 0]])
    k_ids, k_w, e_k = fb.calls._kernel_routing(ids, w, 0, 8, None)
    assert e_k == 12
    np.testing.assert_array_equal(np.asarray(k_ids), [[8, 0, 3], [4, 7, 8]])
    assert fb.calls._kernel_routing(ids, w, 0, 8, 16)[2] == 16


def test_workspace_bound_grows_with_tokens():
    small = fb.trtllm_workspace_bytes(1, 7168, 2048, 32, 8, 256)
    large = fb.trtllm_workspace_bytes(8192, 7168, 2048, 32, 8, 256)
    assert small % (1 << 20) == 0 and 0 < small < large
    # covers at least GEMM2's bf16 output for the worst padding
    assert large >= (8192 * 8 + 32 * 255) * 7168 * 2


# ------------------------------------------------------------------------------------------------
# Offline setup

def _fake_artifacts(root, cubins=("a.cubin", "b.cubin"), drop=()):
    bmm = root / fb.TRTLLM_BMM_ARTIFACT
    (bmm / "include" / "trtllmGen_bmm_export" / "trtllm" / "gen").mkdir(parents=True)
    files = ["include/flashinferMetaInfo.h"] + [f"include/trtllmGen_bmm_export/{h}"
                                                for h in fb.TRTLLM_BMM_HEADERS]
    for f in files:
        if f not in drop:
            (bmm / f).write_text("x")
    (bmm / "cubins").mkdir()
    for c in cubins:
        if c not in drop:
            (bmm / "cubins" / c).write_bytes(b"\0")
    listed = files + [f"cubins/{c}" for c in cubins]
    (bmm / "checksums.txt").write_text("".join(f"{'0' * 64} {f}\n" for f in listed))
    return bmm


def test_offline_cubin_check(tmp_path, monkeypatch):
    assert any("checksums.txt" in m for m in fb.missing_trtllm_artifacts(tmp_path))
    _fake_artifacts(tmp_path / "ok")
    assert fb.missing_trtllm_artifacts(tmp_path / "ok") == []
    _fake_artifacts(tmp_path / "bad", drop=("b.cubin", "include/trtllmGen_bmm_export/Enums.h"))
    missing = fb.missing_trtllm_artifacts(tmp_path / "bad")
    assert any(m.endswith("b.cubin") for m in missing) and any(m.endswith("Enums.h") for m in missing)
    monkeypatch.setenv("FLASHINFER_CUBIN_DIR", str(tmp_path / "bad"))
    assert fb.cubin_dir() == tmp_path / "bad"
    msg = str(fb.gating._offline_error(missing))
    assert "download-cubin" in msg and "FLASHINFER_CUBIN_DIR" in msg and "b.cubin" in msg
    monkeypatch.delenv("FLASHINFER_CUBIN_DIR")
    monkeypatch.setenv("FLASHINFER_WORKSPACE_BASE", str(tmp_path))
    monkeypatch.setattr(fb.gating, "_dist_version", lambda name: None)
    assert fb.cubin_dir() == tmp_path / ".cache" / "flashinfer" / "cubins"


def test_runtime_needs_the_optional_packages(monkeypatch):
    if all(importlib.util.find_spec(m) for m in ("flashinfer", "torch", "jax_tvm_ffi")):
        pytest.skip("the optional packages are installed")
    monkeypatch.setenv(fb.ENV_ALLOW_DOWNLOAD, "1")  # leave FLASHINFER_NO_DOWNLOAD alone
    prev = fb.set_runtime(None)
    try:
        with pytest.raises(ImportError):
            fb.runtime()
    finally:
        fb.set_runtime(prev)
