"""Experts whose GEMM1 up rows have their own global decode scale (``NVFP4Experts.up_global_scale``: NVIDIA ModelOpt
quantizes gate and up apart), on every backend and GEMM kernel.

The bitwise anchor: experts with ``up_global_scale = 2 * gate's`` hold exactly the values of experts sharing the gate's
scale whose up rows' block scales are doubled (E4M3 doubles exactly), and every sum of the up half is then exactly
doubled too (a power of two), so every backend must give the same bytes for both, in every mode and activation, biases
included. Random scales are checked against the pure-JAX twin and the xla backend."""

from __future__ import annotations

import dataclasses
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nvfp4 as nv
from jax_nvfp4 import ops
from conftest import ffi_call_now, has_gpu, run_on_cpu_devices
from test_ffi import BF16, f32, make_experts, make_routing, make_x, random_nvfp4, relerr, used_rows

GATED = ("swiglu", "geglu", "swiglu_oai")


def doubled_up(experts: nv.NVFP4Experts) -> tuple[nv.NVFP4Experts, nv.NVFP4Experts]:
    """(experts with up_global_scale = 2 * gate's, the same values with the up rows' block scales doubled)."""
    gu = experts.gate_up
    half = gu.shape[-2] // 2
    s = gu.scales.astype(jnp.float32)
    scales = jnp.concatenate([s[:, :half], 2 * s[:, half:]], axis=1).astype(jnp.float8_e4m3fn)
    assert bool(jnp.all(scales.astype(jnp.float32)[:, half:] == 2 * s[:, half:]))  # exact
    own = dataclasses.replace(experts, up_global_scale=2 * gu.global_scale)
    folded = dataclasses.replace(experts, gate_up=nv.NVFP4Array(gu.data, scales, gu.global_scale, gu.dtype, gu.order))
    return own, folded


def with_biases(experts, seed):
    rng = np.random.default_rng(seed)
    e, n1, h = experts.gate_up.shape
    return dataclasses.replace(experts, gate_up_bias=jnp.asarray(rng.standard_normal((e, n1)), jnp.float32),
                               down_bias=jnp.asarray(rng.standard_normal((e, h)), jnp.float32))


@pytest.mark.parametrize("backend", ["xla", "ffi"])
@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
@pytest.mark.parametrize("act", GATED)
@pytest.mark.parametrize("order", ["rows", "blocked"])
@pytest.mark.parametrize("t", [5, 300])  # (on the GPU: the align-in-GEMM decode kernel; 64-row and wgmma tiles)
def test_moe_up_scale_is_bitwise_the_folded_experts(backend, mode, act, order, t):
    ex = make_experts(3, 8, 128, 128)
    if act == "swiglu_oai":
        ex = with_biases(ex, 4)
    if order == "blocked":
        ex = nv.to_blocked_experts(ex)
    own, folded = doubled_up(ex)
    x = make_x(5, t, 128)
    ids, w = make_routing(6, t, 4, 8)
    run = jax.jit(lambda ex: nv.moe(x, ex, topk_ids=ids, topk_weights=w, mode=mode, activation=act, backend=backend))
    got, want = run(own), run(folded)
    assert np.isfinite(f32(want)).all() and (f32(want) != 0).any()
    np.testing.assert_array_equal(f32(got), f32(want))
    assert relerr(got, run(ex)) > 1e-2  # (the up scale matters)


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
@pytest.mark.parametrize("act", ["swiglu", "swiglu_oai"])
def test_moe_random_up_scales_match_twin_and_xla(mode, act):
    ex = make_experts(7, 8, 128, 64)
    if act == "swiglu_oai":
        ex = with_biases(ex, 8)
    up = jnp.asarray(np.random.default_rng(9).uniform(0.1, 3, 8) / 8, jnp.float32)
    ex = dataclasses.replace(ex, up_global_scale=up)
    x = make_x(10, 33, 128)
    ids, w = make_routing(11, 33, 4, 8)
    got = ops.moe(x, ex, ids, w, mode=mode, activation=act)
    twin = ops.moe(x, ex, ids, w, mode=mode, activation=act, impl="jax")
    # jitted, the twin keeps its finalize's bf16 rounding before the down bias's sum (XLA would drop it as excess
    # precision: one bf16 ulp in ~20% of the outputs before 2026-12-06)
    jitted = jax.jit(lambda x: ops.moe(x, ex, ids, w, mode=mode, activation=act, impl="jax"))(x)
    np.testing.assert_array_equal(f32(jitted), f32(twin))
    assert relerr(got, twin) < (1e-2 if jax.default_backend() == "gpu" else 1e-4)
    xla = nv.moe(x, ex, topk_ids=ids, topk_weights=w, mode=mode, activation=act, backend="xla")
    assert relerr(got, xla) < 1e-2
    if mode == "w4a16":  # against the experts' values in bf16 (weights rounded: a looser bound)
        bf = nv.moe(x, ex.dequantized(), topk_ids=ids, topk_weights=w, mode="bf16", activation=act, backend="xla")
        assert relerr(xla, bf) < 2e-2
        # gradients (x, routing weights and the up scales' own) as the xla backend's
        def grads(backend):
            f = lambda x, w, up: jnp.sum(nv.moe(x, dataclasses.replace(ex, up_global_scale=up), topk_ids=ids,
                                                topk_weights=w, activation=act, backend=backend)
                                         .astype(jnp.float32) ** 2)
            return jax.jit(jax.grad(f, argnums=(0, 1, 2)))(x, w, up)
        for g, r in zip(grads("ffi"), grads("xla")):
            assert relerr(g, r) < 2e-2 and np.abs(f32(r)).max() > 0


GEMM_KERNELS = [  # (tile_m, k_split, kernel_flags, blocked, pairing, gathered): every gated epilogue on the GPU
    (8, 1, 0, False, ops.Pairing.NONE, True),  # mma.sync decode tiles (the per-value activation switch)
    (8, 4, 0, True, ops.Pairing.NONE, True),  # K split over the CTA's warps, blocked weights
    (16, 2, 0, False, ops.Pairing.OUT, True),
    (64, 1, int(ops.KernelFlag.NO_WGMMA), False, ops.Pairing.NONE, True),  # mma.sync 64-row tiles (batched)
    (64, 1, 0, True, ops.Pairing.CHUNK_A | ops.Pairing.CHUNK_OUT, True),  # warp-specialized wgmma
    (32, 1, int(ops.KernelFlag.ROWS96), True, ops.Pairing.CHUNK_A | ops.Pairing.CHUNK_OUT, True),  # split gated
    (64, 1, 0, True, ops.Pairing.CHUNK_A, False),  # the TMA-fed wgmma kernel's gated instance
]


@pytest.mark.parametrize("on_gpu", [False, pytest.param(True, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("kernel", range(len(GEMM_KERNELS)))
@pytest.mark.parametrize("act,row_mode,out_dtype", [(ops.Activation.SWIGLU, ops.RowScale.NONE, BF16),
                                                    (ops.Activation.GEGLU, ops.RowScale.TOKEN, jnp.float32)])
def test_gemm_up_alpha(on_gpu, kernel, act, row_mode, out_dtype):
    """grouped_gemm's ``up_alpha`` on each kernel: equal to ``alpha`` it gives the bytes of no ``up_alpha``; twice
    ``alpha`` exactly twice them (the activations are linear in up: the up half's scale, and only it, is
    applied); random ones the twin's values."""
    if on_gpu and not has_gpu():
        pytest.skip("needs an NVIDIA GPU")
    tile_m, k_split, flags, blocked, pairing, gather = GEMM_KERNELS[kernel]
    if not gather and (out_dtype != BF16 or row_mode != ops.RowScale.NONE):
        pytest.skip("the TMA-fed kernel writes bfloat16, without token scales")
    rng = np.random.default_rng(kernel)
    t, k, e, h, n = (600 if on_gpu else 60), 4, 5, 256, 256
    w = random_nvfp4(rng, (e, 2 * n, h), rng.uniform(0.5, 2, e) / np.sqrt(h))
    w = nv.to_blocked_weights(w) if blocked else w
    ids = jnp.asarray(rng.integers(-1, e, (t, k)), jnp.int32)
    sid, te, _ = ops.moe_align(ids, e, tile_m=tile_m, impl="jax")
    a = jnp.asarray(rng.standard_normal((t if gather else sid.shape[0], h)), BF16)
    a = ops.to_chunk_order(a) if pairing & ops.Pairing.CHUNK_A else a
    rs = jnp.asarray(rng.uniform(0.5, 2, t), jnp.float32) if row_mode == ops.RowScale.TOKEN else None
    dev = jax.devices()[0] if on_gpu else jax.devices("cpu")[0]

    def run(up, impl="ffi"):
        with jax.default_device(dev):
            return f32(ops.grouped_gemm(a, w, sid, te, tile_m=tile_m, activation=act, top_k=k, gather=gather,
                                        row_scale=rs, row_scale_mode=row_mode, out_dtype=out_dtype, k_split=k_split,
                                        pairing=pairing, kernel_flags=flags, up_alpha=up, impl=impl))

    used = used_rows(sid, te, tile_m)
    base = run(None)[used]
    assert np.isfinite(base).all() and (base != 0).any()
    np.testing.assert_array_equal(run(w.global_scale)[used], base)
    np.testing.assert_array_equal(run(2 * w.global_scale)[used], 2 * base)
    up = jnp.asarray(rng.uniform(0.2, 3, e) / np.sqrt(h), jnp.float32)
    # (the twin's dot sums in another order: on the GPU a few bf16 outputs round the other way; a wrong scale is ~1)
    assert relerr(run(up)[used], run(up, "jax")[used]) < (1e-3 if on_gpu else 1e-5)


def test_dequantized_and_indexing():
    ex = make_experts(12, 4, 128, 128)
    up = jnp.asarray([0.5, 1.0, 2.0, 0.25], jnp.float32) * ex.gate_up.global_scale
    own = dataclasses.replace(ex, up_global_scale=up)
    d = own.dequantized(jnp.float32)
    gu = nv.dequantize(ex.gate_up, jnp.float32, apply_global_scale=False)
    np.testing.assert_array_equal(d.gate_up[:, :128], gu[:, :128] * ex.gate_up.global_scale[:, None, None])
    np.testing.assert_array_equal(d.gate_up[:, 128:], gu[:, 128:] * up[:, None, None])
    np.testing.assert_array_equal(d.down, nv.dequantize(ex.down, jnp.float32))
    np.testing.assert_array_equal(nv.to_blocked_experts(own).dequantized(jnp.float32).gate_up, d.gate_up)
    # zero-padded (blocked, H = 64 and I = 32 to 128): the values cut back to H and I
    small = dataclasses.replace(make_experts(15, 4, 64, 32), up_global_scale=up)
    padded = nv.to_blocked_experts(small)
    assert padded.valid_sizes == (64, 32)
    for a, b in zip(jax.tree.leaves(padded.dequantized(jnp.float32)), jax.tree.leaves(small.dequantized(jnp.float32))):
        np.testing.assert_array_equal(a, b)
    shared = dataclasses.replace(ex, up_global_scale=ex.gate_up.global_scale)
    stacked = jax.tree.map(lambda *v: jnp.stack(v), shared, own)  # (layers)
    np.testing.assert_array_equal(stacked[1].up_global_scale, up)
    np.testing.assert_array_equal(stacked[0].dequantized(jnp.float32).gate_up, ex.dequantized(jnp.float32).gate_up)


def test_bad_up_scales_are_named():
    ex = make_experts(13, 4, 64, 32)
    with pytest.raises(ValueError, match=r"up_global_scale must be float32 \[..., E\]=\[4\]"):
        dataclasses.replace(ex, up_global_scale=jnp.ones((3,), jnp.float32))
    with pytest.raises(ValueError, match="up_global_scale is for gated experts"):
        dataclasses.replace(make_experts(13, 4, 64, 32, gated=False), up_global_scale=jnp.ones((4,), jnp.float32))
    sid, te, _ = ops.moe_align(jnp.zeros((2, 1), jnp.int32), 4, tile_m=8, impl="jax")
    a = jnp.zeros((2, 64), BF16)
    with pytest.raises(ValueError, match=r"up_alpha must be float32 \[E\] = \[4\] with a gated activation"):
        ops.grouped_gemm(a, nv.NVFP4Array(ex.gate_up.data[:, :32], ex.gate_up.scales[:, :32], ex.gate_up.global_scale),
                         sid, te, tile_m=8, activation=ops.Activation.RELU2, up_alpha=jnp.ones((4,), jnp.float32))
    # the custom call's own check (the alpha operand [2, E] is for gated activations)
    ops.ensure_registered()
    with pytest.raises(Exception, match=r"alpha must be \[E\] = \[4\] \(\[2, E\] only with a gated activation\), "
                                        r"got \[2, 4\]"):
        ffi_call_now(ops.TARGET_GEMM, jax.ShapeDtypeStruct((sid.shape[0], 64), BF16))(
            a, ex.gate_up.data, ex.gate_up.scales, jnp.ones((2, 4), jnp.float32),
            jnp.zeros((0,), jnp.float32), sid, te, jnp.zeros((1,), jnp.float32),
            activation=np.int64(ops.Activation.IDENTITY), row_scale_mode=np.int64(0), top_k=np.int64(1),
            gather=np.int64(1), tile_m=np.int64(8), k_split=np.int64(1), pairing=np.int64(0),
            kernel_flags=np.int64(0))


def test_flashinfer_declines_up_scales():
    from jax_nvfp4.backends import base
    from jax_nvfp4.backends.flashinfer import FlashInferBackend
    problem = base.MoEProblem(4, 256, 256, 8, 2, "w4a16", "swiglu", up_global_scale=True)
    assert "up_global_scale" in FlashInferBackend().unsupported_reason(problem)
    ex = dataclasses.replace(make_experts(14, 8, 256, 256), up_global_scale=jnp.ones((8,), jnp.float32))
    with pytest.raises(ValueError, match="up_global_scale"):
        nv.prepare_flashinfer_weights(ex)


def sharded_script(replace: str, mode: str = "w4a16") -> str:
    """A script for :func:`run_on_cpu_devices`: experts changed by ``dataclasses.replace(ex, <replace>)`` placed along
    E over 2 CPU devices under plain jit give bitwise the sum of the shards run alone (backend ffi)."""
    return textwrap.dedent(f"""
        import dataclasses, jax, jax.numpy as jnp, numpy as np
        from jax.sharding import NamedSharding, PartitionSpec as P
        import jax_nvfp4 as nv
        k = jax.random.split(jax.random.key(0), 4)
        ex = nv.quantize_experts(jax.random.normal(k[0], (8, 128, 128), jnp.bfloat16),
                                 jax.random.normal(k[1], (8, 128, 64), jnp.bfloat16))
        ex = dataclasses.replace(ex, {replace})
        x = jax.random.normal(k[2], (12, 128), jnp.bfloat16)
        logits = jax.random.normal(k[3], (12, 8), jnp.float32)
        f32 = lambda v: np.asarray(v, np.float32)
        layer = jax.jit(lambda x, ex: nv.moe(x, ex, router_logits=logits, top_k=2, mode="{mode}"))
        halves = [jax.tree_util.tree_map(lambda a: a[s], ex) for s in (slice(0, 4), slice(4, 8))]
        want = f32(jnp.asarray(sum(f32(nv.moe(x, h, router_logits=logits, top_k=2, local_expert_offset=o,
                                              mode="{mode}", backend="ffi")) for h, o in zip(halves, (0, 4))),
                               jnp.bfloat16))
        mesh = jax.make_mesh((2,), ("ep",))
        got = layer(jax.device_put(x, NamedSharding(mesh, P())), jax.device_put(ex, NamedSharding(mesh, P("ep"))))
        np.testing.assert_array_equal(f32(got), want)
        print("ok")
    """)


def test_up_scales_split_with_their_experts():
    """Experts with up_global_scale placed along E over 2 CPU devices under plain jit: each device's up scales go with
    its experts (the output is the sum of the shards run alone, bitwise)."""
    run_on_cpu_devices(sharded_script("up_global_scale=ex.gate_up.global_scale * jnp.linspace(0.5, 2, 8)"))
