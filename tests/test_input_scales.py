"""Mode w4a4 on static activation scales (``NVFP4Experts.input_scales``: NVIDIA ModelOpt's calibrated ``input_scale``),
on every backend that runs it.

Bitwise anchors: a pair's result depends only on its own expert's scales, so run with each pair's routing column alone
it must equal the run where every expert has that pair's expert's scales; the ffi finalize sums a token's bf16 rows in
fp32 in column order, so the full layer is those columns' sum. A float64 numpy pipeline (the numpy reference quantizer
with the given encode scales) checks the arithmetic itself."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nvfp4 as nv
from jax_nvfp4 import ops
from jax_nvfp4.quantize import quant_dequant_static
from conftest import run_on_cpu_devices
from nvfp4_numpy_ref import quantize_ref
from test_ffi import BF16, f32, make_experts, make_routing, make_x, relerr
from test_up_global_scale import sharded_script, with_biases


def intermediate(g, act):
    """The float64 activation of GEMM1's output rows ``g [..., N1]`` (swiglu_oai taken as swiglu: a calibration)."""
    n = g.shape[-1] // 2
    return g * (g > 0) * g if act == "relu2" else g[..., :n] / (1 + np.exp(-g[..., :n])) * g[..., n:]


def calibrated_scales(seed, x, ex, act="swiglu"):
    """float32 [E, 2]: each expert's amax of x and of its intermediate over all tokens, / 2688, times a factor in
    [0.7, 1.3] (calibrated as ModelOpt does, on other data: a few values saturate)."""
    x = f32(x).astype(np.float64)
    g = np.einsum("enh,th->etn", np.asarray(ex.dequantized(jnp.float32).gate_up, np.float64), x)
    amax = np.stack([np.full(g.shape[0], np.abs(x).max()), np.abs(intermediate(g, act)).max(axis=(1, 2))], axis=1)
    u = np.random.default_rng(seed).uniform(0.7, 1.3, amax.shape)
    return jnp.asarray(amax * u / 2688, jnp.float32)


def run_layer(backend, mode="w4a4", act="swiglu"):
    return jax.jit(lambda x, ex, ids, w: nv.moe(x, ex, topk_ids=ids, topk_weights=w, mode=mode, activation=act,
                                                backend=backend))


def test_static_rows_are_the_quantizer_with_the_reciprocal_encode_scale():
    x = make_x(1, 40, 256).astype(jnp.float32) * 3
    s = jnp.asarray(np.random.default_rng(2).uniform(1.5, 10, 40) / 2688, jnp.float32)  # (some rows saturate)
    got, scale = quant_dequant_static(x, s)
    q = nv.quantize(x, global_encode_scale=np.float32(1) / np.asarray(s))
    np.testing.assert_array_equal(f32(got), f32(nv.dequantize(q, jnp.float32, apply_global_scale=False)))
    np.testing.assert_array_equal(scale, s)  # the row decode scale is the input scale itself
    # quant_dequant_rows' static form (any impl: in JAX): unused rows zero, scales times the row weights
    ids = jnp.where(jnp.arange(40) % 5 == 0, -1, jnp.arange(40) // 2).astype(jnp.int32)
    rw = jnp.asarray(np.random.default_rng(3).random(20), jnp.float32)
    for impl in ("ffi", "jax"):
        rows, rs = ops.quant_dequant_rows(x, ids, row_weights=rw, input_scale=s, impl=impl)
        used = np.asarray(ids) >= 0
        np.testing.assert_array_equal(f32(rows)[used], f32(got)[used])
        assert not f32(rows)[~used].any() and not np.asarray(rs)[~used].any()
        np.testing.assert_array_equal(np.asarray(rs)[used], (np.asarray(rw)[np.asarray(ids)] * np.asarray(s))[used])
    with pytest.raises(ValueError, match=r"input_scale must be float32 \[R\] = \[40\]"):
        ops.quant_dequant_rows(x, input_scale=s[:3])
    # rows of amax 2688 * 2^-m on s = 2^-m: the encode scale is the amax's, so the bytes are per-token quantization's
    m = np.arange(40) % 7 + 3
    y = np.asarray(x) / np.abs(np.asarray(x)).max(axis=1, keepdims=True) * (2688 * 2.0 ** -m)[:, None]
    y = jnp.asarray(y, jnp.float32)
    want, want_s = ops.quant_dequant_rows(y, impl="jax")
    got, _ = quant_dequant_static(y, jnp.asarray(2.0 ** -m, jnp.float32))
    np.testing.assert_array_equal(f32(got), f32(want))
    np.testing.assert_array_equal(want_s, 2.0 ** -m)


def columns(ids, j):
    """ids with every column but j padding (-1)."""
    return jnp.where(jnp.arange(ids.shape[1]) == j, ids, -1)


@pytest.mark.parametrize("backend", ["xla", "ffi"])
@pytest.mark.parametrize("act", ["swiglu", "relu2", "swiglu_oai"])
@pytest.mark.parametrize("order", ["rows", "blocked"])
@pytest.mark.parametrize("t", [5, 300])  # (on the GPU: decode tiles; 64-row and wgmma tiles)
def test_each_pair_quantizes_on_its_experts_scales(backend, act, order, t):
    e, k = 6, 3
    ex = make_experts(3, e, 128, 128, gated=act != "relu2")
    if act == "swiglu_oai":
        ex = with_biases(ex, 4)
    if order == "blocked":
        ex = nv.to_blocked_experts(ex)
    x = make_x(6, t, 128)
    s = calibrated_scales(5, x, ex, act)
    ids, w = make_routing(7, t, k, e)
    run = run_layer(backend, act=act)
    own = dataclasses.replace(ex, input_scales=s)
    for j in range(k):
        got = f32(run(x, own, columns(ids, j), w))
        assert np.isfinite(got).all() and (got != 0).any()
        for i in range(e):
            rows = np.asarray(ids[:, j] == i)
            uniform = dataclasses.replace(ex, input_scales=jnp.broadcast_to(s[i], (e, 2)))
            np.testing.assert_array_equal(got[rows], f32(run(x, uniform, columns(ids, j), w))[rows])
    full = run(x, own, ids, w)
    if backend == "ffi" and not ex.has_bias:  # the finalize: a token's bf16 rows summed in fp32 in column order
        want = sum((f32(run(x, own, columns(ids, j), w)) for j in range(k)), np.zeros((t, 128), np.float32))
        np.testing.assert_array_equal(f32(full), f32(jnp.asarray(want, BF16)))
    assert relerr(full, run(x, ex, ids, w)) > 1e-2  # (not the per-token scales)
    if backend == "ffi":  # (on the GPU: the static path through the decode, wgmma and warp-specialized kernels)
        assert relerr(full, run_layer("xla", act=act)(x, own, ids, w)) < 1e-2


def reference(x, ex, ids, w, act):
    """float64 w4a4 on static scales: each pair's x row and intermediate quantized by the numpy reference with the
    encode scale fp32(1 / s) and decoded times s; weights decoded exactly."""
    w1 = np.asarray(nv.dequantize(ex.gate_up, jnp.float32), np.float64)
    w2 = np.asarray(nv.dequantize(ex.down, jnp.float32), np.float64)
    s = np.asarray(ex.input_scales)

    def fake_quant(v, scale):
        data, sbits, _ = quantize_ref(v[None].astype(np.float32), enc=np.float32(1) / scale)
        q = nv.NVFP4Array(jnp.asarray(data), jax.lax.bitcast_convert_type(jnp.asarray(sbits), jnp.float8_e4m3fn),
                          jnp.float32(1))
        return np.asarray(nv.dequantize(q, jnp.float32), np.float64)[0] * np.float64(scale)

    out = np.zeros(x.shape, np.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e < 0:
                continue
            a = intermediate(w1[e] @ fake_quant(np.asarray(x[t], np.float32), s[e, 0]), act)
            out[t] += float(w[t, j]) * (w2[e] @ fake_quant(a, s[e, 1]))
    return out


@pytest.mark.parametrize("act", ["swiglu", "relu2"])
def test_static_scales_match_a_float64_reference(act):
    e = 6
    ex = make_experts(8, e, 128, 64, gated=act == "swiglu")
    x = make_x(10, 24, 128)
    ex = dataclasses.replace(ex, input_scales=calibrated_scales(9, x, ex, act))
    ids, w = make_routing(11, 24, 2, e)
    want = reference(f32(x), ex, np.asarray(ids), np.asarray(w), act)
    for backend in ("xla", "ffi"):
        got = nv.moe(x, ex, topk_ids=ids, topk_weights=w, mode="w4a4", activation=act, backend=backend)
        assert relerr(got, want) < 5e-3, backend
    # the test tells the scales apart: GEMM1's and GEMM2's swapped, or per-token ones, are far off
    swapped = dataclasses.replace(ex, input_scales=ex.input_scales[:, ::-1])
    for other in (swapped, dataclasses.replace(ex, input_scales=None)):
        bad = nv.moe(x, other, topk_ids=ids, topk_weights=w, mode="w4a4", activation=act, backend="xla")
        assert relerr(bad, want) > 3e-2


def test_jit_vmap_grads_and_w4a16():
    e = 8
    x = make_x(14, 20, 128)
    ex = make_experts(12, e, 128, 64)
    ex = dataclasses.replace(ex, input_scales=calibrated_scales(13, x, ex))
    ids, w = make_routing(15, 20, 2, e)
    layer = lambda x, w, ex, backend: nv.moe(x, ex, topk_ids=ids, topk_weights=w, mode="w4a4",  # noqa: E731
                                             backend=backend)
    for backend in ("xla", "ffi"):
        eager = layer(x, w, ex, backend)
        np.testing.assert_array_equal(f32(jax.jit(layer, static_argnums=3)(x, w, ex, backend)), f32(eager))
        # a batch of token sets runs as one set
        xs = jnp.stack([x, make_x(16, 20, 128)])
        batched = jax.vmap(lambda x: layer(x, w, ex, backend))(xs)
        np.testing.assert_array_equal(f32(batched[0]), f32(eager))
    np.testing.assert_array_equal(f32(layer(x, w, ex, "ffi")), f32(ops.moe(x, ex, ids, w, mode="w4a4", impl="jax")))

    # gradients: routing weights and the input scales (through the GEMMs' row scales) as the xla backend's; x's is
    # zero (its rounding onto the NVFP4 grid), as with per-token scales
    def grads(backend):
        f = lambda x, w, s: jnp.sum(layer(x, w, dataclasses.replace(ex, input_scales=s), backend)  # noqa: E731
                                    .astype(jnp.float32) ** 2)
        return jax.jit(jax.grad(f, argnums=(0, 1, 2)))(x, w, ex.input_scales)
    (gx, gw, gs), (rx, rw, rs) = grads("ffi"), grads("xla")
    assert not np.asarray(gx, np.float32).any() and not np.asarray(rx, np.float32).any()
    for g, r in ((gw, rw), (gs, rs)):
        assert relerr(g, r) < 2e-2 and np.abs(f32(r)).max() > 0
    # w4a16 ignores the scales
    for backend in ("xla", "ffi"):
        a = nv.moe(x, ex, topk_ids=ids, topk_weights=w, mode="w4a16", backend=backend)
        b = nv.moe(x, dataclasses.replace(ex, input_scales=None), topk_ids=ids, topk_weights=w, mode="w4a16",
                   backend=backend)
        np.testing.assert_array_equal(f32(a), f32(b))


def test_scales_follow_the_experts():
    e = 4
    ex = make_experts(18, e, 64, 32)
    x = make_x(19, 7, 64)
    s = calibrated_scales(17, x, ex)
    ex = dataclasses.replace(ex, input_scales=s)
    stacked = jax.tree.map(lambda *v: jnp.stack(v), ex, dataclasses.replace(ex, input_scales=2 * s))
    np.testing.assert_array_equal(stacked[1].input_scales, 2 * s)
    padded = nv.to_blocked_experts(ex)  # (H = 64, I = 32: zero-padded to 128)
    np.testing.assert_array_equal(padded.input_scales, s)
    np.testing.assert_array_equal(nv.from_blocked_experts(padded).input_scales, s)
    ids, w = make_routing(20, 7, 2, e)
    for backend in ("xla", "ffi"):
        np.testing.assert_array_equal(
            f32(nv.moe(x, padded, topk_ids=ids, topk_weights=w, mode="w4a4", backend=backend)),
            f32(nv.moe(x, nv.to_blocked_experts(ex), topk_ids=ids, topk_weights=w, mode="w4a4", backend=backend)))
    assert relerr(nv.moe(x, padded, topk_ids=ids, topk_weights=w, mode="w4a4", backend="ffi"),
                  nv.moe(x, ex, topk_ids=ids, topk_weights=w, mode="w4a4", backend="xla")) < 1e-2
    from jax_nvfp4 import nn as nvnn
    kept = nvnn.NVFP4ExpertWeights(ex).experts()
    np.testing.assert_array_equal(kept.input_scales, s)
    assert nvnn.NVFP4ExpertWeights(make_experts(18, e, 64, 32)).experts().input_scales is None


def test_bad_scales_are_named():
    ex = make_experts(21, 4, 64, 32)
    with pytest.raises(ValueError, match=r"input_scales must be float32 \[..., E, 2\]=\[4, 2\]"):
        dataclasses.replace(ex, input_scales=jnp.ones((4,), jnp.float32))
    with pytest.raises(ValueError, match=r"input_scales must be float32"):
        dataclasses.replace(ex, input_scales=jnp.ones((4, 2), jnp.bfloat16))
    parts = (ex.gate_up.data, ex.gate_up.scales, ex.gate_up.global_scale, ex.down.data, ex.down.scales,
             ex.down.global_scale)
    for bad in (0.0, -1.0, np.inf, np.nan):
        with pytest.raises(ValueError, match="input_scales must be finite and > 0"):
            nv.NVFP4Experts.from_parts(*parts, input_scales=np.full((4, 2), bad, np.float32))
    ok = nv.NVFP4Experts.from_parts(*parts, input_scales=np.full((4, 2), 0.01, np.float32))
    # gradients and tree maps rebuild the experts with other values (zeros): not refused
    zeros = jax.tree.map(jnp.zeros_like, ok)
    assert not np.asarray(zeros.input_scales).any()
    x = make_x(23, 5, 64)
    ids, w = make_routing(24, 5, 2, 4)
    for mode in ("w4a16", "w4a4"):
        g = jax.grad(lambda e: jnp.sum(nv.moe(x, e, topk_ids=ids, topk_weights=w, mode=mode).astype(jnp.float32)),
                     allow_int=True)(ok)
        assert g.input_scales.shape == (4, 2) and (np.asarray(g.input_scales).any() == (mode == "w4a4"))


def test_flashinfer_declines_static_scales():
    from jax_nvfp4.backends import base
    from jax_nvfp4.backends.flashinfer import FlashInferBackend
    problem = base.MoEProblem(4, 256, 256, 8, 2, "w4a4", "swiglu", static_input_scales=True)
    assert "input_scales" in FlashInferBackend().unsupported_reason(problem)
    assert FlashInferBackend().unsupported_reason(dataclasses.replace(problem, static_input_scales=False)) is None
    # w4a16 ignores the scales: such experts run on FlashInfer's w4a16 (cutedsl) as without them; w4a4 is refused
    ex = dataclasses.replace(make_experts(22, 8, 256, 256), input_scales=jnp.ones((8, 2), jnp.float32))
    prepared = nv.prepare_flashinfer_weights(ex, "cutedsl")
    assert prepared.weight_only and prepared.modes == ("w4a16",)
    plain = nv.prepare_flashinfer_weights(dataclasses.replace(ex, input_scales=None), "cutedsl")
    assert plain.modes == ("w4a16", "w4a4")
    for a, b in zip(jax.tree.leaves(prepared), jax.tree.leaves(plain), strict=True):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    from jax_nvfp4.backends.flashinfer_prepare import check_prepared
    assert check_prepared(prepared, "w4a16", "swiglu") == "w4a16"
    with pytest.raises(ValueError, match="prepared from experts with static activation scales"):
        check_prepared(prepared, "w4a4", "swiglu")
    with pytest.raises(ValueError, match="input_scales"):
        nv.prepare_flashinfer_weights(ex, "trtllm")


def test_scales_split_with_their_experts():
    """Experts with input_scales placed along E over 2 CPU devices under plain jit: each device quantizes on its own
    experts' scales (the output is the sum of the shards run alone, bitwise)."""
    run_on_cpu_devices(sharded_script(
        "input_scales=jnp.stack([jnp.linspace(2, 4, 8), jnp.linspace(200, 600, 8)], 1) / 2688", "w4a4"))
