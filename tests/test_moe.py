"""The MoE layer (spec section 5) on the ``xla`` backend: golden files, a float64 reference for
every mode and activation, dispatch/matmul strategies, properties, transformations
(jit, scan, while_loop, grad), expert parallelism and argument validation."""


import dataclasses
import functools
import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jax_nvfp4 as nv
from jax_nvfp4 import ops as ffi_ops, activations, arg_specs
from jax_nvfp4.backends import base
from jax_nvfp4.backends.xla import XLABackend, choose_dispatch, choose_gmm, gmm_ragged, gmm_tiled, moe_experts
from conftest import golden_moe, golden_names, run_on_cpu_devices

BF16 = jnp.bfloat16
MOE_FILES = golden_names("moe_")
STRATEGIES = [(d, g) for d in ("gather", "all") for g in ("ragged", "tiled")]
T, H, I, E, K = 12, 64, 32, 8, 3


def moe(*args, **kwargs):
    """nv.moe pinned to the backend under test (``auto`` may pick another one)."""
    kwargs.setdefault("backend", "xla")
    return nv.moe(*args, **kwargs)


# ------------------------------------------------------------------------------------------
# Problem builders and a float64 numpy reference

def make_experts(seed=0, e=E, h=H, inter=I, gated=True, bf16=False):
    """Random NVFP4 experts (random codes, E4M3 scales in [1/4, 4], global scales ~ 1/sqrt(K)),
    or their exact bf16 decoding (times 1 + 1/8 so that bf16 weights are not all on the grid)."""
    rng = np.random.default_rng(seed)
    n1 = (2 if gated else 1) * inter

    def part(n, k):
        data = rng.integers(0, 256, (e, n, k // 2), dtype=np.uint8)
        scales = rng.choice(np.array([.25, .375, .5, .75, 1, 1.5, 2, 3, 4], ml_dtypes.float8_e4m3fn),
                            (e, n, k // 16))
        gs = (rng.uniform(0.5, 1.0, e) / (2.5 * np.sqrt(k))).astype(np.float32)
        return nv.NVFP4Array(jnp.asarray(data), jnp.asarray(scales), jnp.asarray(gs))

    q = nv.NVFP4Experts(part(n1, h), part(h, inter), gated)
    if bf16:
        f = lambda a: (nv.dequantize(a) * 1.125).astype(BF16)  # noqa: E731
        return nv.BF16Experts(f(q.gate_up), f(q.down), gated)
    return q


def make_inputs(seed=0, t=T, e_global=E, h=H):
    rng = np.random.default_rng(seed + 100)
    x = jnp.asarray(rng.standard_normal((t, h)), BF16)
    logits = jnp.asarray(rng.standard_normal((t, e_global)), jnp.float32)
    return x, logits


def weights64(ex):
    """(gate_up, down, alpha1, alpha2) as float64 numpy, without the global scale."""
    if isinstance(ex, nv.NVFP4Experts):
        def f(q):
            return np.asarray(nv.dequantize(q, jnp.float32, apply_global_scale=False), np.float64)
        return (f(ex.gate_up), f(ex.down), np.asarray(ex.gate_up.global_scale, np.float64),
                np.asarray(ex.down.global_scale, np.float64))
    ones = np.ones(ex.num_experts)
    return np.asarray(ex.gate_up, np.float64), np.asarray(ex.down, np.float64), ones, ones


def np_act(name, g):
    if name == "relu2":
        return np.maximum(g, 0) ** 2
    gate, up = np.split(g, 2, axis=-1)
    if name == "swiglu":
        return gate / (1 + np.exp(-gate)) * up
    if name == "geglu":
        return 0.5 * gate * (1 + np.tanh(np.sqrt(2 / np.pi) * (gate + 0.044715 * gate ** 3))) * up
    gate, up = np.minimum(gate, 7.0), np.clip(up, -7.0, 7.0)
    return gate / (1 + np.exp(-1.702 * gate)) * (up + 1)


_quantize_rows = jax.jit(lambda a: nv.quantize(a, per_token=True))


def _nvfp4_rows(a):
    """Per-row NVFP4 quantization (the library's, bit-exact with FlashInfer) -> (values, scale)."""
    q = _quantize_rows(jnp.asarray(a, jnp.float32))
    return (np.asarray(nv.dequantize(q, jnp.float32, apply_global_scale=False), np.float64),
            np.asarray(q.global_scale, np.float64))


def ref_moe(x, ex, ids, wts, *, activation="swiglu", mode="w4a16", offset=0, fake_quant_x=None):
    """Spec section 5 in float64 numpy, one (token, expert) pair at a time (vectorized).

    ``fake_quant_x``: quantize x per token (default: iff mode == "w4a4").
    """
    w1, w2, a1, a2 = weights64(ex)
    x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    ids, wts = np.asarray(ids), np.asarray(wts, np.float64)
    t, k = ids.shape
    local = ids - offset
    valid = (ids >= 0) & (local >= 0) & (local < w1.shape[0])
    le = np.where(valid, local, 0)
    dx = np.ones(t)
    if mode == "w4a4" if fake_quant_x is None else fake_quant_x:
        x, dx = _nvfp4_rows(x)
    b1, b2 = (np.zeros((w1.shape[0], n)) if b is None else np.asarray(jnp.asarray(b, jnp.float32), np.float64)
              for b, n in ((ex.gate_up_bias, w1.shape[1]), (ex.down_bias, w2.shape[1])))
    g = np.einsum("th,tknh->tkn", x, w1[le]) * (a1[le] * dx[:, None])[..., None] + b1[le]
    a = np_act(activation, g)
    da = np.ones((t, k))
    if mode == "w4a4":
        a, da = _nvfp4_rows(a.reshape(t * k, -1).astype(np.float32))
        a, da = a.reshape(t, k, -1), da.reshape(t, k)
    else:
        a = a.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
    y = np.einsum("tki,tkhi->tkh", a, w2[le]) * (a2[le] * da)[..., None] + b2[le]
    return (y * np.where(valid, wts, 0)[..., None]).sum(1)


def relerr(out, ref):
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    return np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30)


def f32(a):
    return np.asarray(jnp.asarray(a, jnp.float32))


# ------------------------------------------------------------------------------------------
# Golden files (FlashInfer's reference W4A16 MoE)

def _golden_problem(name):
    g = golden_moe(name)
    return g.x, g.logits, g.experts, g.route_kwargs, g.out.astype(np.float64)


@pytest.mark.parametrize("name", MOE_FILES)
def test_golden(name):
    x, logits, ex, kw, ref = _golden_problem(name)
    out, (ids, w) = moe(x, ex, router_logits=logits, return_routing=True, **kw)
    assert out.dtype == BF16 and out.shape == x.shape
    assert relerr(out, ref) < 1e-2
    assert relerr(nv.moe(x, ex, router_logits=logits, backend="auto", **kw), ref) < 1e-2
    if name == "moe_deepseek_v3.npz":  # every strategy on the largest file (E = 64, k = 8)
        for dispatch, gmm in STRATEGIES:
            out = XLABackend(dispatch, gmm)(x, ex, ids, w, problem=_problem(ex, ids, "w4a16", "swiglu"),
                                            local_expert_offset=0)
            assert relerr(out, ref) < 1e-2, (dispatch, gmm)


def _problem(ex, ids, mode, activation):
    return base.MoEProblem(ids.shape[0], ex.hidden_size, ex.intermediate_size, ex.num_experts,
                           ids.shape[1], mode, activation)


# ------------------------------------------------------------------------------------------
# Every mode and activation against the float64 reference

@pytest.mark.parametrize("mode, activation", [
    (m, a) for m in ("bf16", "w4a16") for a in ("swiglu", "geglu", "relu2", "swiglu_oai")]
    + [("w4a4", "swiglu"), ("w4a4", "relu2")])  # w4a4's quantization does not depend on the activation
def test_modes_and_activations_match_reference(mode, activation):
    ex = make_experts(1, gated=activation != "relu2", bf16=mode == "bf16")
    x, logits = make_inputs(1)
    x = x * 3 if activation == "swiglu_oai" else x  # reach the clamps at +-7
    out, (ids, w) = moe(x, ex, router_logits=logits, top_k=K, activation=activation, mode=mode,
                           return_routing=True)
    assert relerr(out, ref_moe(x, ex, ids, w, activation=activation, mode=mode)) < 5e-3


def test_w4a4_differs_from_w4a16_off_grid():
    ex = make_experts(2)
    x, logits = make_inputs(2)
    a = moe(x, ex, router_logits=logits, top_k=K, mode="w4a4")
    b = moe(x, ex, router_logits=logits, top_k=K, mode="w4a16")
    assert relerr(a, f32(b).astype(np.float64)) > 1e-2  # activations really are quantized


@pytest.mark.parametrize("dispatch, gmm, mode", [s + ("w4a16",) for s in STRATEGIES]
                         + [("gather", "ragged", "w4a4"), ("all", "tiled", "w4a4")])
def test_strategies_agree_with_padding_and_foreign_ids(dispatch, gmm, mode):
    ex = make_experts(3)
    x, _ = make_inputs(3)
    rng = np.random.default_rng(3)
    ids = rng.integers(-2, E + 4, size=(T, K)).astype(np.int32)  # padding, local and foreign ids
    ids[0] = [5, 5, 5]  # the same expert thrice
    w = rng.random((T, K)).astype(np.float32)
    offset = 2 if mode == "w4a16" else 0
    out = XLABackend(dispatch, gmm)(x, ex, jnp.asarray(ids), jnp.asarray(w),
                                    problem=_problem(ex, ids, mode, "swiglu"), local_expert_offset=offset)
    assert relerr(out, ref_moe(x, ex, ids, w, mode=mode, offset=offset)) < 5e-3


def test_grouped_matmuls_agree_with_gradients():
    rng = np.random.default_rng(4)
    lhs = jnp.asarray(rng.standard_normal((23, 32)), BF16)
    rhs = jnp.asarray(rng.standard_normal((5, 24, 32)), BF16)
    sizes = jnp.array([4, 0, 9, 1, 6], jnp.int32)  # sum 20 < 23: the last rows give zeros
    ref = np.zeros((23, 24))
    start = 0
    for g, s in enumerate(np.asarray(sizes)):
        ref[start:start + s] = f32(lhs[start:start + s]) @ f32(rhs[g]).T
        start += s
    tiled = jax.jit(gmm_tiled, static_argnums=3)
    for tile in (None, 1, 4, 64):
        out = tiled(lhs, rhs, sizes, tile)
        np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.asarray(gmm_ragged(lhs, rhs, sizes)), ref, rtol=1e-5, atol=1e-4)
    cot = jnp.asarray(rng.standard_normal((23, 24)), jnp.float32)
    g1 = jax.jit(jax.grad(lambda a: (gmm_tiled(a, rhs, sizes, 4) * cot).sum()))(lhs)
    g2 = jax.jit(jax.grad(lambda a: (gmm_ragged(a, rhs, sizes) * cot).sum()))(lhs)
    np.testing.assert_allclose(f32(g1), f32(g2), rtol=1e-2, atol=1e-2)


def test_strategy_choice_by_static_shapes():
    assert choose_dispatch(8, 32) == "gather"  # DeepSeek-V3 EP8 decode: 1 token x 8 of 32
    assert choose_dispatch(32, 32) == "all"
    ds, qw = 3 * 2048 * 7168, 3 * 768 * 2048  # weights of one DeepSeek-V3 / Qwen3-30B-A3B expert
    assert choose_gmm(8, 8, ds, "gpu") == "ragged"  # decode: 8 rows over the 8 experts hit
    assert choose_gmm(32768, 32, ds, "gpu") == "tiled"  # prefill: dense expansion would cost 32x
    assert choose_gmm(8192, 128, qw, "gpu") == "tiled"
    assert choose_gmm(8, 8, ds, "cpu") == "tiled"  # XLA:CPU's ragged_dot is slow at any size


@pytest.mark.parametrize("shape", list(arg_specs.QUICK_SHAPES.values()), ids=lambda s: s.name)
@pytest.mark.parametrize("local_only", [True, False])
def test_shared_problem_shapes(shape, local_only):
    """The benchmark's problem builders (arg_specs), with and without ids on other shards."""
    key = jax.random.key(0)
    ex = arg_specs.random_nvfp4_experts(key, shape)
    x = arg_specs.random_hidden(jax.random.fold_in(key, 1), 16, shape)
    ids, w = arg_specs.random_routing(jax.random.fold_in(key, 2), 16, shape, local_only=local_only)
    hit = arg_specs.experts_hit(ids, shape)
    assert 0 < hit <= shape.local_experts
    if local_only:
        ids_local = np.asarray(ids) - shape.local_expert_offset
        assert np.all((ids_local >= 0) & (ids_local < shape.local_experts))
    out = moe(x, ex, topk_ids=ids, topk_weights=w, local_expert_offset=shape.local_expert_offset)
    ref = ref_moe(x, ex, ids, w, offset=shape.local_expert_offset)
    assert relerr(out, ref) < 5e-3
    b = arg_specs.to_bf16_experts(ex)
    out = moe(x, b, topk_ids=ids, topk_weights=w, local_expert_offset=shape.local_expert_offset)
    assert relerr(out, ref) < 2e-2  # bf16 rounding of alpha * weights


# ------------------------------------------------------------------------------------------
# Properties

@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**16))
def test_permuting_tokens_permutes_output(seed):
    ex = make_experts(5)
    x, logits = make_inputs(seed)
    perm = np.random.default_rng(seed).permutation(T)
    out = f32(moe(x, ex, router_logits=logits, top_k=K))
    outp = f32(moe(x[perm], ex, router_logits=logits[perm], top_k=K))
    np.testing.assert_allclose(outp, out[perm], rtol=1e-2, atol=1e-2 * np.abs(out).max())


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.sampled_from([1, 5]))
def test_token_output_independent_of_batch(seed, n):
    ex = make_experts(6)
    x, logits = make_inputs(seed)
    full = f32(moe(x, ex, router_logits=logits, top_k=K))
    part = f32(moe(x[:n], ex, router_logits=logits[:n], top_k=K))  # other strategies for small n
    np.testing.assert_allclose(part, full[:n], rtol=1e-2, atol=1e-2 * np.abs(full).max())


@pytest.mark.parametrize("activation", ["swiglu", "relu2"])
def test_bf16_equals_w4a16_for_nvfp4_representable_weights(activation):
    q = make_experts(7, gated=activation != "relu2")
    # Power-of-two global scales keep the fully decoded weights exact in bf16.
    gs = 2.0 ** -(4 + jnp.arange(E, dtype=jnp.float32) % 3)
    pow2 = lambda a: nv.NVFP4Array(a.data, a.scales, gs, a.dtype)  # noqa: E731
    q = nv.NVFP4Experts(pow2(q.gate_up), pow2(q.down), q.gated)
    b = nv.BF16Experts(nv.dequantize(q.gate_up, BF16), nv.dequantize(q.down, BF16), q.gated)
    np.testing.assert_array_equal(f32(b.gate_up), f32(nv.dequantize(q.gate_up)))  # exact
    x, logits = make_inputs(7)
    for t in (2, T):  # the gather and the all-experts dispatch
        o4 = moe(x[:t], q, router_logits=logits[:t], top_k=K, activation=activation, mode="w4a16")
        ob = moe(x[:t], b, router_logits=logits[:t], top_k=K, activation=activation, mode="bf16")
        # Equal up to summation order (XLA may pick different dot kernels): at most one bf16 ulp.
        o4, ob = f32(o4), f32(ob)
        assert np.all(np.abs(o4 - ob) <= 2.0 ** -7 * np.abs(ob)) and np.mean(o4 == ob) > 0.9


def _on_grid_activations(seed, t=T, h=H, j=-12):
    """x whose per-token NVFP4 quantization is exact: every block holds a +-6 code, the first
    block has scale 448 (so amax = 2688 * 2^j and the global scale is 2^j), others powers of two."""
    rng = np.random.default_rng(seed)
    e2m1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6])
    codes = e2m1[rng.integers(0, 8, (t, h // 16, 16))] * rng.choice([-1, 1], (t, h // 16, 16))
    codes[..., 0] = 6 * rng.choice([-1, 1], (t, h // 16))
    scales = 2.0 ** rng.integers(-3, 7, (t, h // 16, 1))
    scales[:, 0] = 448
    return jnp.asarray((codes * scales * 2.0 ** j).reshape(t, h), BF16)


def test_w4a4_on_grid_equals_w4a16_up_to_stated_scales():
    x = _on_grid_activations(8)
    xq, dx = _nvfp4_rows(x)
    np.testing.assert_array_equal(xq * dx[:, None], f32(x))  # x is on the grid, exactly
    ex = make_experts(8)
    _, logits = make_inputs(8)
    ids, w = nv.route(logits, "softmax_topk", top_k=K)
    out = moe(x, ex, topk_ids=ids, topk_weights=w, mode="w4a4")
    # The w4a16 computation of x itself, with only the intermediate quantized per row.
    ref = ref_moe(x, ex, ids, w, mode="w4a4", fake_quant_x=False)
    assert np.all(np.abs(f32(out) - ref) <= 2.0 ** -8 * np.abs(ref) + 1e-6 * np.abs(ref).max())


@pytest.mark.parametrize("backend", ["xla", "ffi"])
def test_w4a4_gemm2_scales_in_the_spec_order(backend):
    """Spec section 5: ``w * da * alpha2 * acc``, left to right. One pair whose fp32 products round apart:
    ``((w * da) * alpha2) * 2688`` is 0.693359375 (bf16 0.6953125), ``((w * alpha2) * da) * 2688`` rounds to bf16
    0.69140625."""
    h, inter = 64, 64  # (the CUDA kernels take multiples of 64)
    w, alpha2 = np.float32(0.881618), np.float32(0.7864623)

    def one_hot(rows, gs):  # code 2 (1.0) at column 0 of the given rows, block scales 1
        codes = (rows[None] == 1).astype(np.uint8) * 2
        scales = np.ones((1, rows.shape[0], rows.shape[1] // 16), ml_dtypes.float8_e4m3fn)
        return nv.NVFP4Array(jnp.asarray(codes[..., 0::2] | codes[..., 1::2] << 4), jnp.asarray(scales),
                             jnp.asarray([gs], jnp.float32))

    w1, w2 = np.zeros((inter, h)), np.zeros((h, inter))
    w1[0, 0], w2[:, 0] = 1, 1  # relu2: a = [1, 0, ...] (da = 1/2688, acc = 2688)
    ex = nv.NVFP4Experts(one_hot(w1, 1.0), one_hot(w2, alpha2), gated=False)
    x = jnp.zeros((1, h), BF16).at[0, 0].set(1)
    want = np.float32(np.float32(np.float32(w * (np.float32(1) / np.float32(2688))) * alpha2) * 2688)
    assert want == np.float32(0.693359375)
    out = nv.moe(x, ex, topk_ids=jnp.zeros((1, 1), jnp.int32), topk_weights=jnp.asarray([[w]]),
                 activation="relu2", mode="w4a4", backend=backend)
    np.testing.assert_array_equal(f32(out), np.full((1, h), 0.6953125, np.float32))  # = bf16(want)


# ------------------------------------------------------------------------------------------
# Transformations

def test_jit_matches_eager_and_static_arguments():
    ex = make_experts(9)
    x, logits = make_inputs(9)
    eager = moe(x, ex, router_logits=logits, top_k=K, routing="renormalize")
    f = jax.jit(moe, static_argnames=("top_k", "routing"))
    np.testing.assert_array_equal(f32(f(x, ex, router_logits=logits, top_k=K, routing="renormalize")),
                                  f32(eager))


def test_scan_and_while_loop_bodies():
    ex = make_experts(10)
    x, logits = make_inputs(10)
    xs = jnp.stack([x, x * 0.5, -x])

    def layer(h):
        return (h + moe(h, ex, router_logits=logits, top_k=K)).astype(BF16)

    expect = x
    for _ in range(3):
        expect = layer(expect)
    _, scanned = jax.lax.scan(lambda c, xi: (c, layer(xi)), None, xs)
    np.testing.assert_allclose(f32(scanned[1]), f32(layer(xs[1])), rtol=1e-2, atol=1e-2)
    looped = jax.jit(lambda h: jax.lax.fori_loop(0, 3, lambda i, c: layer(c), h))(x)
    np.testing.assert_allclose(f32(looped), f32(expect), rtol=2e-2, atol=2e-2)
    wl = jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, layer(c[1])), (0, x))[1]
    np.testing.assert_allclose(f32(wl), f32(expect), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("backend", ["xla", "ffi"])
def test_stacked_layers_under_scan_and_vmap(backend):
    """Experts stacked over layers [L, E, N, K]: lax.scan over them equals the layers run one by one (bitwise,
    jitted), vmap over them each layer's output; moe itself refuses a stack, naming what to do. (Each layer its own
    routing; H and I of 128, which the CUDA kernels take too.)"""
    layers = [make_experts(20 + l, h=128, inter=128) for l in range(3)]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *layers)
    x = make_inputs(20, h=128)[0]
    routes = [nv.route(make_inputs(21 + l)[1], "softmax_topk", top_k=K) for l in range(3)]
    ids, w = (jnp.stack(v) for v in zip(*routes))

    def layer(h, ex, ids, w):
        return (h + moe(h, ex, topk_ids=ids, topk_weights=w, backend=backend)).astype(BF16)

    expect = x
    for l in range(3):
        expect = jax.jit(layer)(expect, layers[l], *routes[l])
    scan = jax.jit(lambda h, xs: jax.lax.scan(lambda c, xs: (layer(c, *xs), None), h, xs)[0])
    np.testing.assert_array_equal(f32(scan(x, (stacked, ids, w))), f32(expect))
    xs = jnp.stack([x, -x, 0.5 * x])
    per = jax.jit(jax.vmap(layer))(xs, stacked, ids, w)
    for l in range(3):  # one layer after the other
        np.testing.assert_array_equal(f32(per[l]), f32(jax.jit(layer)(xs[l], layers[l], *routes[l])))
    with pytest.raises(ValueError, match=r"stacked over leading axes \(3,\).*experts\[i\]"):
        layer(x, stacked, *routes[0])


@pytest.mark.parametrize("dispatch,gmm", STRATEGIES)
def test_vmap_on_one_device_runs_each_batching(dispatch, gmm):
    """jax.vmap of the layer on one device, whatever is batched: token sets run as one set, expert sets one after
    the other, each element's call. (The function batched as it is would reach ragged_dot's batching rule, which
    refuses tokens batched with a routing that is not.) Derivatives stay the function's own. All bitwise on the CPU;
    on a GPU close: its matmuls round otherwise at another row count (H100: 1-2 bf16 ulps where folded), and it fuses
    the jitted gradient, the function's but for the order of its residuals, otherwise (measured on the H100, session
    48: dx differs in 74-189 of 768 elements, relative norm 1.2-2.5e-3; the jvp and the weights' cotangent were
    bitwise)."""
    ex = make_experts(30)
    x, logits = make_inputs(30)
    ids, w = nv.route(logits, "softmax_topk", top_k=K)
    backend = XLABackend(dispatch, gmm)

    def same(a, b, what):
        if jax.default_backend() == "cpu":
            np.testing.assert_array_equal(f32(a), f32(b), err_msg=what)
        else:
            assert np.linalg.norm(f32(a) - f32(b)) <= 1e-2 * np.linalg.norm(f32(b)), what

    def f(x, ex, ids, w):
        return backend(x, ex, ids, w, problem=_problem(ex, ids, "w4a16", "swiglu"), local_expert_offset=0)

    stacked = jax.tree.map(lambda *a: jnp.stack(a), ex, make_experts(31))
    xs, idss, ws = jnp.stack([x, -x]), jnp.stack([ids, ids[::-1]]), jnp.stack([w, w[::-1]])
    for axes, args in (((0, None, None, None), (xs, ex, ids, w)), ((0, None, 0, 0), (xs, ex, idss, ws)),
                       ((0, 0, None, None), (xs, stacked, ids, w)), ((None, None, 0, 0), (x, ex, idss, ws))):
        out = jax.jit(jax.vmap(f, in_axes=axes))(*args)
        for i in range(2):
            one = [a if ax is None else jax.tree.map(lambda v: v[i], a) for a, ax in zip(args, axes)]
            same(out[i], jax.jit(f)(*one), str(axes))
    def derivatives(fn):
        loss = lambda x, w: (fn(x, ex, ids, w).astype(jnp.float32) ** 2).sum()  # noqa: E731
        return jax.jit(jax.grad(loss, (0, 1)))(x, w), jax.jvp(lambda x: fn(x, ex, ids, w), (x,), (x,))[1]

    plain = functools.partial(moe_experts, mode="w4a16", activation="swiglu", local_expert_offset=0,
                              dispatch=dispatch, gmm=gmm)
    for a, b in zip(jax.tree.leaves(derivatives(f)), jax.tree.leaves(derivatives(plain))):
        same(a, b, "derivatives")


def _dense_jnp(x, logits, weights, activation, routing, k):
    """Differentiable dense reference: every (token, slot) pair multiplies its gathered expert."""
    w1, w2, a1, a2 = (jnp.asarray(v, jnp.float32) for v in weights)
    ids, wt = nv.route(logits, routing, top_k=k)
    g = jnp.einsum("th,tknh->tkn", x.astype(jnp.float32), w1[ids]) * a1[ids][..., None]
    a = activations.apply(activation, g)
    y = jnp.einsum("tki,tkhi->tkh", a, w2[ids]) * (wt * a2[ids])[..., None]
    return y.sum(1)


def test_grad_allow_int_over_nvfp4_experts():
    """jax.grad(..., allow_int=True) over NVFP4Experts: float0 for the codes, the global scales' gradient as taken
    through them alone."""
    ex = make_experts(12)
    x, logits = make_inputs(12)
    loss = lambda ex: moe(x, ex, router_logits=logits, top_k=K).astype(jnp.float32).sum()  # noqa: E731
    g = jax.grad(loss, allow_int=True)(ex)
    assert isinstance(g, nv.NVFP4Experts) and g.gate_up.data.dtype == jax.dtypes.float0
    rebuilt = lambda gs: dataclasses.replace(ex, down=dataclasses.replace(ex.down, global_scale=gs))  # noqa: E731
    np.testing.assert_array_equal(g.down.global_scale, jax.grad(lambda gs: loss(rebuilt(gs)))(ex.down.global_scale))


@pytest.mark.parametrize("mode", ["bf16", "w4a16"])
def test_grad_matches_dense_reference(mode):
    ex = make_experts(11, bf16=mode == "bf16")
    x, logits = make_inputs(11)
    cot = jnp.asarray(np.random.default_rng(11).standard_normal((T, H)), jnp.float32)
    w64 = weights64(ex)
    for dispatch in ("gather", "all")[mode == "bf16":]:
        def loss(x, l):
            ids, w = nv.route(l, "renormalize", top_k=K)
            out = XLABackend(dispatch, "tiled" if dispatch == "all" else "ragged")(
                x, ex, ids, w, problem=_problem(ex, ids, mode, "swiglu"), local_expert_offset=0)
            return (out.astype(jnp.float32) * cot).sum()

        gx, gl = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, logits)
        dense = lambda x, l: (_dense_jnp(x, l, w64, "swiglu", "renormalize", K) * cot).sum()  # noqa: E731
        rx, rl = jax.jit(jax.grad(dense, argnums=(0, 1)))(x, logits)
        assert gx.dtype == BF16 and gl.dtype == jnp.float32
        assert relerr(gx, np.asarray(rx, np.float64)) < 2e-2
        assert relerr(gl, np.asarray(rl, np.float64)) < 2e-2
    # The public API differentiates too.
    g = jax.grad(lambda l: moe(x, ex, router_logits=l, top_k=K).astype(jnp.float32).sum())(logits)
    assert bool(jnp.all(jnp.isfinite(g))) and bool(jnp.any(g != 0))


# ------------------------------------------------------------------------------------------
# Expert parallelism, padding, empty batch, routing replay

def _shard(ex, lo, hi):
    return nv.NVFP4Experts(ex.gate_up[lo:hi], ex.down[lo:hi], ex.gated)


def test_expert_parallel_shards_sum_to_full():
    ex = make_experts(12)
    x, logits = make_inputs(12)
    full = f32(moe(x, ex, router_logits=logits, top_k=K))
    f = jax.jit(lambda x, ex, l, off: moe(x, ex, router_logits=l, top_k=K, local_expert_offset=off))
    parts = [f32(moe(x, _shard(ex, 0, 3), router_logits=logits, top_k=K, local_expert_offset=0)),
             f32(f(x, _shard(ex, 3, E), logits, jnp.int32(3)))]  # traced offset under jit
    np.testing.assert_allclose(parts[0] + parts[1], full, rtol=2e-2, atol=1e-2 * np.abs(full).max())
    ids, w = nv.route(logits, "softmax_topk", top_k=K)
    assert relerr(parts[1], ref_moe(x, ex, np.where(np.asarray(ids) >= 3, ids, -1), w)) < 5e-3


# Plain jit over 4 CPU devices with the experts (bf16 or NVFP4) sharded along E and the tokens along T.
_JIT_SHARDED = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    import jax_nvfp4 as nv
    assert jax.device_count() == 4, jax.devices()
    key = jax.random.split(jax.random.PRNGKey(0), 4)
    gate_up = (jax.random.normal(key[0], (8, 64, 128)) * 0.2).astype(jnp.bfloat16)  # E 8, 2I 64, H 128
    down = (jax.random.normal(key[1], (8, 128, 32)) * 0.2).astype(jnp.bfloat16)
    x = jax.random.normal(key[2], (12, 128), jnp.bfloat16)
    ids, w = nv.route(jax.random.normal(key[3], (12, 8)), "softmax_topk", top_k=2)
    f32 = lambda v: np.asarray(v, np.float32)
    cases = [(("dp", "ep"), P("dp"), P("ep"), 2),              # data x expert parallel
             (("a", "b"), P(), P(("a", "b")), 4),              # experts over both axes
             (("dp", "ep"), P(("dp", "ep")), P("ep"), 2)]      # tokens also on the expert axis: gathered over it
    for ex, mode in ((nv.BF16Experts(gate_up, down), "bf16"), (nv.quantize_experts(gate_up, down), "w4a16"),
                     (nv.quantize_experts(gate_up, down), "w4a4")):
        def layer(x, ex, ids, w, off=0):
            return nv.moe(x, ex, topk_ids=ids, topk_weights=w, mode=mode, backend="xla", local_expert_offset=off)
        def shards_summed(n):  # n expert shards, each run alone; their bf16 outputs summed in f32, rounded
            e = 8 // n
            parts = [f32(layer(x, jax.tree_util.tree_map(lambda a: a[s * e:(s + 1) * e], ex), ids, w, s * e))
                     for s in range(n)]
            return f32(jnp.asarray(sum(parts), jnp.bfloat16))
        one = f32(layer(x, ex, ids, w))
        for types in ((AxisType.Auto,) * 2, (AxisType.Explicit,) * 2):
            for axes, x_spec, ex_spec, n in cases:
                mesh = jax.make_mesh((2, 2), axes, axis_types=types)
                put = lambda v, spec: jax.device_put(v, NamedSharding(mesh, spec))
                args = put(x, x_spec), put(ex, ex_spec), put(ids, x_spec), put(w, x_spec)
                with jax.set_mesh(mesh):
                    hlo = jax.jit(layer).lower(*args).compile().as_text()
                    out = jax.jit(layer)(*args)
                    xb, ib, wb = (jnp.stack([v, v[::-1]]) for v in (x, ids, w))
                    vlayer = jax.jit(jax.vmap(layer, in_axes=(0, None, 0, 0)))  # folded into one token set
                    batched = vlayer(xb, args[1], ib, wb)
                    hlo += vlayer.lower(xb, args[1], ib, wb).compile().as_text()
                assert not expert_gathers(hlo), (mode, axes)
                assert ("reduce-scatter" in hlo) == (x_spec == P(("dp", "ep"))), (mode, axes)
                assert tuple(out.sharding.spec)[:1] == tuple(x_spec)[:1] or out.sharding.is_fully_replicated
                np.testing.assert_array_equal(f32(out), shards_summed(n), err_msg=str((mode, types, axes)))
                assert np.linalg.norm(f32(out) - one) <= 1e-2 * np.linalg.norm(one)
                assert vlayer(xb[:0], args[1], ib[:0], wb[:0]).shape == (0, 12, 128)  # an empty batch
                for b in range(2):  # vmap: the plain function, per batch element
                    np.testing.assert_allclose(f32(batched[b]), f32(layer(xb[b], ex, ib[b], wb[b])), rtol=1e-2,
                                               atol=1e-2)
                if x_spec == P("dp"):  # vmap over stacked experts (layers): each element split as alone
                    st = jax.tree_util.tree_map(lambda a: jnp.stack([a, a[::-1]]), ex)
                    sargs = put(xb, P(None, *x_spec)), put(st, P(None, *ex_spec))
                    with jax.set_mesh(mesh):
                        slayer = jax.jit(jax.vmap(layer, in_axes=(0, 0, None, None)))
                        per = slayer(*sargs, ids, w)
                        assert not expert_gathers(slayer.lower(*sargs, ids, w).compile().as_text()), (mode, types)
                    for b in range(2):  # (the shards' bf16 sums round otherwise: a norm, not each value)
                        want_b = f32(layer(xb[b], st[b], ids, w))
                        assert np.linalg.norm(f32(per[b]) - want_b) <= 1e-2 * np.linalg.norm(want_b), (mode, b)
            # Gradients split alike (expert_sharding.over_experts_vjp): no expert gathered, on either axis type,
            # and equal to one device's but for the shards' bf16 roundings (w4a4: d out / d x is zero).
            loss = lambda x, ex, w: (layer(x, ex, ids, w).astype(jnp.float32) ** 2).sum()
            argnums = (0, 1, 2) if mode == "bf16" else (0, 2)  # (NVFP4: x and the routing weights)
            want = jax.tree_util.tree_leaves(jax.grad(loss, argnums)(x, ex, w))
            for axes, x_spec, ex_spec, n in cases:
                mesh = jax.make_mesh((2, 2), axes, axis_types=types)
                put = lambda v, spec: jax.device_put(v, NamedSharding(mesh, spec))
                args = put(x, x_spec), put(ex, ex_spec), put(w, x_spec)
                with jax.set_mesh(mesh):
                    grad = jax.jit(jax.grad(loss, argnums))
                    got = jax.tree_util.tree_leaves(grad(*args))
                    hlo = grad.lower(*args).compile().as_text()
                assert not expert_gathers(hlo), (mode, types, axes)
                for g, v in zip(got, want):
                    assert np.linalg.norm(f32(g) - f32(v)) <= 1e-2 * np.linalg.norm(f32(v)) + 1e-30, (mode, axes)
                if mode == "bf16":  # the experts' cotangents stay split along E
                    assert tuple(got[1].sharding.spec)[:1] == tuple(ex_spec)[:1], got[1].sharding
            xb, wb = jnp.stack([x, x[::-1]]), jnp.stack([w, w[::-1]])
            with jax.set_mesh(mesh):  # per-example gradients: one batch element after the other
                per = jax.jit(jax.vmap(jax.grad(loss, 2), in_axes=(0, None, 0)))(xb, args[1], wb)
            for b in range(2):
                v = f32(jax.grad(loss, 2)(xb[b], ex, wb[b]))
                assert np.linalg.norm(f32(per[b]) - v) <= 1e-2 * np.linalg.norm(v)
            try:  # forward mode: the custom_vjp refuses it (as the ffi kernels' does)
                jax.jvp(lambda x: layer(x, args[1], ids, w), (args[0],), (args[0],))
                raise AssertionError("jvp ran")
            except TypeError as err:
                assert "forward-mode" in str(err)
    print("ok")
""")


def test_moe_under_jit_with_sharded_experts_and_tokens():
    """Plain jax.jit over 4 CPU devices (Auto and Explicit mesh axes), bf16 and NVFP4 experts sharded along E and
    tokens along T: expert_sharding's rule runs each device's experts (no expert gathered; before, Explicit axes
    refused to trace); the output equals the shards run alone and summed, bitwise; vmap, grad and jvp run the
    plain function."""
    run_on_cpu_devices(_JIT_SHARDED, n=4)


def test_padding_ids_contribute_nothing():
    ex = make_experts(13)
    x, logits = make_inputs(13)
    ids, w = nv.route(logits, "softmax_topk", top_k=K)
    pad = np.zeros((T, K), bool)
    pad[::3, 1] = True
    pad[5] = True  # a token with no expert at all
    out_pad = moe(x, ex, topk_ids=jnp.where(pad, -1, ids), topk_weights=jnp.where(pad, jnp.nan, w))
    out_zero = moe(x, ex, topk_ids=ids, topk_weights=jnp.where(pad, 0.0, w))
    np.testing.assert_allclose(f32(out_pad), f32(out_zero), rtol=1e-2, atol=1e-3)
    assert not np.any(f32(out_pad)[5])


def test_empty_batch():
    ex = make_experts(14)
    x, logits = make_inputs(14, t=0)
    out, (ids, w) = moe(x, ex, router_logits=logits, top_k=K, return_routing=True)
    assert out.shape == (0, H) and out.dtype == BF16 and ids.shape == (0, K) and w.shape == (0, K)
    out = jax.jit(lambda x: moe(x, ex, topk_ids=jnp.zeros((0, 2), jnp.int32),
                                   topk_weights=jnp.zeros((0, 2))))(x)
    assert out.shape == (0, H)


def test_routing_replay_reproduces_output():
    ex = make_experts(15)
    x, logits = make_inputs(15)
    bias = jnp.linspace(-0.1, 0.1, E)
    out, (ids, w) = moe(x, ex, router_logits=logits, routing="deepseek_v3", top_k=K, bias=bias,
                           n_group=4, topk_group=2, routed_scaling_factor=2.5, return_routing=True)
    assert ids.dtype == jnp.int32 and w.dtype == jnp.float32
    np.testing.assert_array_equal(f32(moe(x, ex, topk_ids=ids, topk_weights=w)), f32(out))


# ------------------------------------------------------------------------------------------
# Expert biases (gpt-oss): g = alpha1 * acc + b1, y += w * (alpha2 * acc + b2)

def with_biases(ex, seed, scale=1.0):
    rng = np.random.default_rng(seed + 200)
    n1 = ex.gate_up.shape[-2]
    return dataclasses.replace(ex, gate_up_bias=jnp.asarray(rng.standard_normal((E, n1)) * scale, jnp.float32),
                               down_bias=jnp.asarray(rng.standard_normal((E, H)) * scale, BF16))


@pytest.mark.parametrize("mode, activation, dispatch, gmm", [
    ("bf16", "swiglu_oai", "gather", "ragged"), ("w4a16", "swiglu_oai", "all", "tiled"),
    ("w4a16", "relu2", "gather", "tiled"), ("w4a4", "swiglu", "all", "ragged")])
def test_expert_biases_match_reference(mode, activation, dispatch, gmm):
    """Biases added in the order of FlashInfer's kernels (and gpt-oss): GEMM1's after alpha1, before the activation;
    GEMM2's after alpha2, before the routing weight; padding and other shards' ids add none."""
    ex = with_biases(make_experts(30, gated=activation != "relu2", bf16=mode == "bf16"), 30)
    x, _ = make_inputs(30)
    rng = np.random.default_rng(30)
    ids = jnp.asarray(rng.integers(-1, E + 3, size=(T, K)), jnp.int32)  # padding, local and foreign ids
    w = jnp.asarray(rng.random((T, K)), jnp.float32)
    out = XLABackend(dispatch, gmm)(x, ex, ids, w, problem=_problem(ex, ids, mode, activation), local_expert_offset=2)
    ref = ref_moe(x, ex, ids, w, activation=activation, mode=mode, offset=2)
    assert relerr(out, ref) < 5e-3
    plain = dataclasses.replace(ex, gate_up_bias=None, down_bias=None)
    assert relerr(out, ref_moe(x, plain, ids, w, activation=activation, mode=mode, offset=2)) > 0.1  # biases count
    auto = nv.moe(x, ex, topk_ids=ids, topk_weights=w, mode=mode, activation=activation, local_expert_offset=2)
    assert relerr(auto, ref) < 5e-3  # "auto": the ffi kernels where built (their C++ handlers on the CPU)


def test_expert_bias_gradients():
    """d loss / d down_bias[e] is the sum of w * cotangent over the rows routed to e (exactly, in fp32); the GEMM1
    bias's gradient matches a dense differentiable reference; jit and eager agree."""
    ex = with_biases(make_experts(31, bf16=True), 31)
    x, logits = make_inputs(31)
    ids, w = nv.route(logits, "softmax_topk", top_k=K)
    cot = jnp.asarray(np.random.default_rng(31).standard_normal((T, H)), jnp.float32)

    def loss(b1, b2):
        e = dataclasses.replace(ex, gate_up_bias=b1, down_bias=b2)
        return (moe(x, e, topk_ids=ids, topk_weights=w, activation="swiglu_oai").astype(jnp.float32) * cot).sum()

    g1, g2 = jax.jit(jax.grad(loss, (0, 1)))(ex.gate_up_bias, ex.down_bias)
    e1, e2 = jax.grad(loss, (0, 1))(ex.gate_up_bias, ex.down_bias)
    if jax.default_backend() == "cpu":
        np.testing.assert_array_equal(f32(g1), f32(e1))
    else:  # XLA:GPU fuses the jitted gradient's fp32 sums otherwise than eager ops (H100: 3e-6 apart)
        np.testing.assert_allclose(f32(g1), f32(e1), rtol=2e-5, atol=1e-6)
    assert g2.dtype == BF16 and g1.dtype == jnp.float32
    want2 = np.zeros((E, H))
    np.add.at(want2, np.asarray(ids), np.asarray(w, np.float64)[..., None] * np.asarray(cot)[:, None, :])
    np.testing.assert_allclose(f32(g2), want2, rtol=1e-2, atol=1e-2)
    w1, w2 = (jnp.asarray(v, jnp.float32) for v in (ex.gate_up, ex.down))

    def dense(b1):
        g = jnp.einsum("th,tknh->tkn", x.astype(jnp.float32), w1[ids]) + b1[ids]
        a = activations.apply("swiglu_oai", g).astype(BF16).astype(jnp.float32)
        y = jnp.einsum("tki,tkhi->tkh", a, w2[ids]) + ex.down_bias.astype(jnp.float32)[ids]
        return ((y * w[..., None]).sum(1) * cot).sum()

    assert relerr(g1, np.asarray(jax.grad(dense)(ex.gate_up_bias), np.float64)) < 2e-2


_JIT_SHARDED_BIASES = textwrap.dedent("""
    import dataclasses, jax, jax.numpy as jnp, numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    import jax_nvfp4 as nv
    key = jax.random.split(jax.random.PRNGKey(1), 6)
    gate_up = (jax.random.normal(key[0], (8, 64, 128)) * 0.2).astype(jnp.bfloat16)  # E 8, 2I 64, H 128
    down = (jax.random.normal(key[1], (8, 128, 32)) * 0.2).astype(jnp.bfloat16)
    b1, b2 = jax.random.normal(key[4], (8, 64)), jax.random.normal(key[5], (8, 128))
    x = jax.random.normal(key[2], (12, 128), jnp.bfloat16)
    ids, w = nv.route(jax.random.normal(key[3], (12, 8)), "softmax_topk", top_k=2)
    f32 = lambda v: np.asarray(v, np.float32)
    layer = lambda x, ex, w, off=0: nv.moe(x, ex, topk_ids=ids, topk_weights=w, activation="swiglu_oai",
                                          local_expert_offset=off)
    for ex in (nv.BF16Experts(gate_up, down, gate_up_bias=b1, down_bias=b2),
               nv.quantize_experts(gate_up, down, gate_up_bias=b1, down_bias=b2)):
        parts = [f32(layer(x, jax.tree_util.tree_map(lambda a: a[s * 4:(s + 1) * 4], ex), w, s * 4)) for s in (0, 1)]
        for types in ((AxisType.Auto,) * 2, (AxisType.Explicit,) * 2):
            mesh = jax.make_mesh((2, 2), ("dp", "ep"), axis_types=types)
            args = (jax.device_put(x, NamedSharding(mesh, P("dp"))), jax.device_put(ex, NamedSharding(mesh, P("ep"))),
                    jax.device_put(w, NamedSharding(mesh, P("dp"))))
            with jax.set_mesh(mesh):
                f = jax.jit(layer)
                out, hlo = f(*args), f.lower(*args).compile().as_text()
                grad = jax.jit(jax.grad(lambda x, ex, w: (layer(x, ex, w).astype(jnp.float32) ** 2).sum(), 1,
                                        allow_int=True))
                g, ghlo = grad(*args), grad.lower(*args).compile().as_text()
            assert not [a for a in all_gathers(hlo + ghlo) if a.startswith(("f32[8,", "bf16[8,", "u8[8,"))], types
            np.testing.assert_array_equal(f32(out), f32(jnp.asarray(parts[0] + parts[1], jnp.bfloat16)))
            assert tuple(g.down_bias.sharding.spec)[:1] == ("ep",), g.down_bias.sharding  # stays split along E
    print("ok")
""")


def test_expert_biases_under_jit_with_sharded_experts():
    """Biased experts (bf16, NVFP4) sharded along E and tokens along T under plain jit (4 CPU devices, Auto and
    Explicit axes): the biases split with their experts (none gathered, forward or backward), and the output is the
    shards run alone and summed, bitwise."""
    run_on_cpu_devices(_JIT_SHARDED_BIASES, n=4)


def test_expert_bias_errors(bad_setup):
    ex, x, logits = bad_setup
    biased = with_biases(ex, 32)
    with pytest.raises(ValueError, match="prepare_flashinfer_weights: experts with biases"):
        nv.prepare_flashinfer_weights(biased)
    with pytest.raises(ValueError, match=r"NVFP4Experts.gate_up_bias must have shape \[8, 64\]"):
        dataclasses.replace(ex, gate_up_bias=jnp.zeros((E, I)))
    with pytest.raises(ValueError, match=r"BF16Experts.down_bias must have shape \[8, 64\]"):
        nv.BF16Experts(jnp.zeros((E, 2 * I, H), BF16), jnp.zeros((E, H, I), BF16), down_bias=jnp.zeros((E, I)))
    with pytest.raises(TypeError, match="down_bias must be a float array"):
        dataclasses.replace(ex, down_bias=jnp.zeros((E, H), jnp.int32))
    stacked = jax.tree.map(lambda *a: jnp.stack(a), biased, biased)
    assert stacked[1].has_bias and stacked[1].down_bias.shape == (E, H) and not ex.has_bias


# ------------------------------------------------------------------------------------------
# Backend selection and bad input

def test_backend_selection():
    ex = make_experts(16)
    x, logits = make_inputs(16)
    p = _problem(ex, jnp.zeros((T, K)), "w4a16", "swiglu")
    assert base.select("xla", p).name == "xla" and "xla" in base.names()
    assert base.select("auto", p).unsupported_reason(p) is None
    with pytest.raises(ValueError, match=r"backend must be one of .*'xla'"):
        nv.moe(x, ex, router_logits=logits, top_k=K, backend="nope")
    with pytest.raises(TypeError, match="backend must be a name or a backend instance"):
        nv.moe(x, ex, router_logits=logits, top_k=K, backend=object())


def test_moe_runs_the_backend_instance_it_is_given():
    """backend=<instance> runs that instance, with its own options, for this call only (jitted, weight_order
    too); the registered backend of the same name is left as it is; batch_invariant judges the instance's name."""
    calls = []

    class Ragged(XLABackend):
        def __call__(self, *args, **kw):
            calls.append(self.gmm)
            return super().__call__(*args, **kw)

    ex = make_experts(16)
    x, logits = make_inputs(16)
    mine = Ragged(gmm="ragged")
    got = jax.jit(lambda x, l: nv.moe(x, ex, router_logits=l, top_k=K, backend=mine))(x, logits)
    want = moe_experts(x, ex, *nv.route(logits, "softmax_topk", top_k=K), mode="w4a16", activation="swiglu",
                       gmm="ragged")
    assert calls == ["ragged"] and base.get("xla") is not mine and base.get("xla").gmm == "auto"
    if jax.default_backend() == "cpu":
        np.testing.assert_array_equal(f32(got), f32(want))
    else:  # (XLA:GPU may fuse the jitted layer's ops otherwise than moe_experts' own jit)
        np.testing.assert_allclose(f32(got), f32(want), rtol=1e-2, atol=1e-3)
    assert nv.weight_order(mine, hidden_size=H, intermediate_size=I) == "rows"
    with pytest.raises(ValueError, match="batch_invariant=True runs on backend 'ffi'.*got backend='xla'"):
        nv.moe(x, ex, router_logits=logits, top_k=K, backend=mine, batch_invariant=True)


def test_backend_instances_with_equal_options_are_equal():
    """A backend's options make its value: equal instances hash alike, so a jit with the backend as a static
    argument traces once for them and again for other options; the repr names the options set."""
    from jax_nvfp4.backends.ffi import FFIBackend
    from jax_nvfp4.backends.flashinfer import FlashInferBackend

    assert XLABackend(gmm="ragged") == XLABackend(gmm="ragged") != XLABackend()
    assert hash(FFIBackend(k_split=1)) == hash(FFIBackend(k_split=1)) and FFIBackend(k_split=1) != FFIBackend()
    assert FFIBackend(k_split=1) != XLABackend() and FlashInferBackend(tactic=[1, 2]) == FlashInferBackend(tactic=(1, 2))
    assert repr(XLABackend()) == "XLABackend()" and repr(FFIBackend(k_split=(1, 2))) == "FFIBackend(k_split=(1, 2))"
    assert repr(FlashInferBackend(deterministic=True)) == "FlashInferBackend(deterministic=True)"

    class Logged(XLABackend):  # a subclass with a constructor of its own keeps XLABackend's options
        def __init__(self, log, **kw):
            super().__init__(**kw)
            self.log = log

    assert Logged([], gmm="ragged") == Logged([1], gmm="ragged") != Logged([], gmm="tiled")
    assert repr(Logged([], gmm="ragged")) == "Logged(gmm='ragged')" and hash(Logged([], dispatch="all"))

    class Listed(base.Options):
        def __init__(self, sizes=None):
            self.sizes = sizes

    assert len({Listed([1, 2]), Listed([1, 2]), Listed()}) == 2 and repr(Listed([1])) == "Listed(sizes=[1])"
    ex = make_experts(16)
    x, logits = make_inputs(16)
    traces = []

    @functools.partial(jax.jit, static_argnums=2)
    def layer(x, l, backend):
        traces.append(backend)
        return nv.moe(x, ex, router_logits=l, top_k=K, backend=backend)

    for b in (XLABackend(gmm="ragged"), XLABackend(gmm="ragged"), XLABackend(gmm="tiled")):
        layer(x, logits, b)
    assert traces == [XLABackend(gmm="ragged"), XLABackend(gmm="tiled")]


@pytest.fixture(scope="module")
def bad_setup():
    ex = make_experts(17)
    x, logits = make_inputs(17)
    return ex, x, logits


_IDS, _W = jnp.zeros((T, K), jnp.int32), jnp.ones((T, K), jnp.float32)


@pytest.mark.parametrize("kwargs, err, match", [
    (dict(mode="w8a8"), ValueError, "mode must be one of"),
    (dict(mode="bf16"), ValueError, "needs BF16Experts"),
    (dict(activation="gelu"), ValueError, "activation must be one of"),
    (dict(activation="relu2"), ValueError, "not gated"),
    (dict(routing="sparsemixer"), ValueError, "routing must be one of"),
    (dict(top_k=E + 1), ValueError, "top_k"),
    (dict(top_k=None), ValueError, "top_k is required"),
    (dict(routing="deepseek_v3"), ValueError, "needs bias"),
    (dict(routing="deepseek_v3", bias=jnp.zeros(E), n_group=3), ValueError, "n_group"),
    (dict(routing="deepseek_v3", bias=jnp.zeros(E), n_group=2, topk_group=3), ValueError, "topk_group"),
    (dict(router_logits=jnp.zeros((T + 1, E))), ValueError, "router_logits must be"),
    (dict(router_logits=jnp.zeros((T, E), jnp.int32)), TypeError, "router_logits"),
    (dict(x=jnp.zeros((T, H), jnp.float32)), TypeError, "x must be bfloat16"),
    (dict(x=jnp.zeros((T, H + 16), BF16)), ValueError, r"x.shape\[1\]"),
    (dict(x=jnp.zeros((T,), BF16)), ValueError, "x must be 2-D"),
    (dict(local_expert_offset=2, router_logits=jnp.zeros((T, E))), ValueError, "exceed"),
    (dict(local_expert_offset=-1), ValueError, "local_expert_offset"),
    (dict(local_expert_offset=np.int32(-1)), ValueError, "local_expert_offset must be >= 0"),
    (dict(local_expert_offset=np.int64(2), router_logits=jnp.zeros((T, E))), ValueError, "exceed"),
    (dict(local_expert_offset=jnp.int32(-2)), ValueError, "local_expert_offset must be >= 0"),  # concrete arrays:
    (dict(local_expert_offset=jnp.int32(2), router_logits=jnp.zeros((T, E))), ValueError, "exceed"),  # as ints
    (dict(top_k=np.float32(2)), TypeError, "top_k must be a Python int"),
    (dict(local_expert_offset=1.5), TypeError, "local_expert_offset"),
    (dict(topk_ids=_IDS, topk_weights=_W), ValueError, "not both"),
    (dict(router_logits=None), ValueError, "give router_logits"),
    (dict(router_logits=None, topk_ids=_IDS), ValueError, "give router_logits"),
    (dict(router_logits=None, topk_ids=_IDS.astype(jnp.float32), topk_weights=_W), TypeError, "topk_ids"),
    (dict(router_logits=None, topk_ids=_IDS, topk_weights=_IDS), TypeError, "topk_weights"),
    (dict(router_logits=None, topk_ids=_IDS, topk_weights=_W[:, :2]), ValueError, "topk_weights shape"),
    (dict(router_logits=None, topk_ids=_IDS[1:], topk_weights=_W[1:]), ValueError, "topk_ids must be"),
    (dict(router_logits=None, topk_ids=_IDS, topk_weights=_W, routed_scaling_factor=2.0), ValueError,
     "routed_scaling_factor"),
    (dict(router_logits=None, topk_ids=_IDS, topk_weights=_W, top_k=2), ValueError, "top_k=2"),
])
def test_bad_input(bad_setup, kwargs, err, match):
    ex, x, logits = bad_setup
    kw = dict(x=x, router_logits=logits, top_k=K)
    kw.update(kwargs)
    x = kw.pop("x")
    with pytest.raises(err, match=match):
        jax.jit(lambda x: moe(x, ex, **kw))(x)  # errors at trace time


@pytest.mark.usefixtures("on_cpu")
def test_numpy_scalars_and_padding_at_any_offset(bad_setup):
    """Sizes read from numpy configs are ints; padding ids (-1) contribute nothing on either backend at a traced
    offset, negative too (before, ffi shifted them onto a local expert)."""
    ex, x, logits = bad_setup
    np.testing.assert_array_equal(f32(moe(x, ex, router_logits=logits, top_k=np.int64(K))),
                                  f32(moe(x, ex, router_logits=logits, top_k=K)))
    ids, w = nv.route(logits, top_k=K)
    out = moe(x, ex, topk_ids=ids, topk_weights=w, routed_scaling_factor=np.float32(1.0))
    np.testing.assert_array_equal(f32(out), f32(moe(x, ex, topk_ids=ids, topk_weights=w)))
    pad = jnp.full((T, K), -1, jnp.int32).at[:, 0].set(ids[:, 0] - 2)
    for offset in (-2, 0):
        for backend in ("xla", "ffi"):
            got = jax.jit(lambda x, o: moe(x, ex, topk_ids=pad, topk_weights=w, local_expert_offset=o,
                                           backend=backend))(x, jnp.int32(offset))
            want = moe(x, ex, topk_ids=jnp.where(pad >= 0, pad - offset, -1), topk_weights=w, backend="xla")
            np.testing.assert_array_equal(f32(got), f32(want), err_msg=f"{backend} at offset {offset}")


def test_bad_experts(bad_setup):
    ex, x, logits = bad_setup
    with pytest.raises(TypeError, match="experts must be"):
        moe(x, {"gate_up": 1}, router_logits=logits, top_k=K)
    b32 = nv.BF16Experts(jnp.zeros((E, 2 * I, H)), jnp.zeros((E, H, I)))
    with pytest.raises(TypeError, match="experts.gate_up must be bfloat16"):
        moe(x, b32, router_logits=logits, top_k=K)
    with pytest.raises(ValueError, match="needs NVFP4Experts"):
        moe(x, make_experts(bf16=True), router_logits=logits, top_k=K, mode="w4a16")


def test_blocked_experts_are_the_same_layer_on_every_reader():
    """Experts in the blocked order (jax_nvfp4.to_blocked_experts) give the rows order's bytes on
    the xla backend (eager and jitted, one expert shard too) and FlashInfer's preparation; the
    checkpoint order comes back exactly."""
    ex = make_experts(21, e=4, h=256, inter=128)
    bl = nv.to_blocked_experts(ex)
    assert bl.gate_up.order == bl.down.order == "blocked" and nv.from_blocked_experts(bl).gate_up.order == "rows"
    for a, b in zip(jax.tree.leaves(nv.from_blocked_experts(bl)), jax.tree.leaves(ex)):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    x, logits = make_inputs(21, e_global=4, h=256)
    want = f32(moe(x, ex, router_logits=logits, top_k=2))
    np.testing.assert_array_equal(f32(moe(x, bl, router_logits=logits, top_k=2)), want)
    run = jax.jit(lambda x, ex, lg: moe(x, ex, router_logits=lg, top_k=2))
    np.testing.assert_array_equal(f32(run(x, bl, logits)), want)
    np.testing.assert_array_equal(f32(moe(x, _shard(bl, 1, 3), router_logits=logits, top_k=2, local_expert_offset=1)),
                                  f32(moe(x, _shard(ex, 1, 3), router_logits=logits, top_k=2, local_expert_offset=1)))
    p_rows, p_blocked = (nv.prepare_flashinfer_weights(e, "cutedsl") for e in (ex, bl))
    for a, b in zip(jax.tree.leaves(p_blocked), jax.tree.leaves(p_rows)):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    with pytest.raises(ValueError, match=r"from_blocked_experts: gate_up: needs an NVFP4Array in the 'blocked'"):
        nv.from_blocked_experts(ex)
    with pytest.raises(TypeError, match="to_blocked_experts needs NVFP4Experts, got BF16Experts"):
        nv.to_blocked_experts(make_experts(21, bf16=True))


@pytest.mark.usefixtures("on_cpu")  # H, I = 80, 48: the CPU handlers' shapes (the CUDA kernels take multiples of 64)
@pytest.mark.parametrize("gated", [True, False])
def test_blocked_experts_zero_pad_h_and_i_to_whole_chunks(gated):
    """Where H or I is not a multiple of 128 (gpt-oss: 2880), to_blocked_experts pads both with zeros: gate and up
    rows each to I', K to H', down to [H', I'], the biases alike; valid_sizes keeps H and I. The padded experts
    are the same layer (equal bytes on the xla and CPU ffi backends, eager and jitted, w4a16 and w4a4), and
    from_blocked_experts gives the rows experts back exactly."""
    act = "swiglu_oai" if gated else "relu2"
    e, h, i = 4, 80, 48
    k = jax.random.split(jax.random.key(5), 4)
    gu = jax.random.normal(k[0], (e, (2 if gated else 1) * i, h), jnp.bfloat16)
    ex = nv.quantize_experts(gu, jax.random.normal(k[1], (e, h, i), jnp.bfloat16), gated=gated,
                             gate_up_bias=jax.random.normal(k[2], gu.shape[:2]),
                             down_bias=jax.random.normal(k[3], (e, h), jnp.bfloat16))
    bl = nv.to_blocked_experts(ex)
    halves = 2 if gated else 1
    assert (bl.gate_up.shape, bl.down.shape, bl.valid_sizes) == ((e, halves * 128, 128), (e, 128, 128), (h, i))
    assert (bl.hidden_size, bl.intermediate_size, bl.gate_up.order) == (h, i, "blocked")
    assert bl.gate_up_bias.shape == (e, halves * 128) and bl.down_bias.shape == (e, 128)
    # Each half in place, zeros around it (decoded, so codes and scales both).
    want = np.zeros((e, halves, 128, 128), np.float32)
    want[:, :, :i, :h] = f32(nv.dequantize(ex.gate_up)).reshape(e, halves, i, h)
    np.testing.assert_array_equal(f32(nv.dequantize(bl.gate_up)), want.reshape(e, halves * 128, 128))
    down = np.zeros((e, 128, 128), np.float32)
    down[:, :h, :i] = f32(nv.dequantize(ex.down))
    np.testing.assert_array_equal(f32(nv.dequantize(bl.down)), down)
    bias = np.zeros((e, halves, 128), np.float32)
    bias[:, :, :i] = f32(ex.gate_up_bias).reshape(e, halves, i)
    np.testing.assert_array_equal(f32(bl.gate_up_bias), bias.reshape(e, -1))
    back = nv.from_blocked_experts(bl)
    assert back.valid_sizes is None and jax.tree.structure(back) == jax.tree.structure(ex)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(ex)):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    x, logits = make_inputs(22, e_global=e, h=h)
    for backend, mode in (("xla", "w4a16"), ("xla", "w4a4"), ("ffi", "w4a16"), ("ffi", "w4a4")):
        run = functools.partial(moe, router_logits=logits, top_k=2, activation=act, mode=mode, backend=backend,
                                return_routing=True)
        want, routing = run(x, ex)
        got, got_routing = run(x, bl)
        assert got.shape == (x.shape[0], h)
        np.testing.assert_array_equal(f32(got), f32(want))
        np.testing.assert_array_equal(f32(jax.jit(lambda x, ex: run(x, ex)[0])(x, bl)), f32(want))
        np.testing.assert_array_equal(np.asarray(got_routing[0]), np.asarray(routing[0]))
    with pytest.raises(ValueError, match=r"valid_sizes \(H, I\) = \(80, 48\) is for blocked experts zero-padded"):
        dataclasses.replace(ex, valid_sizes=(h, i))  # rows experts
    with pytest.raises(ValueError, match="valid_sizes .* is for blocked experts"):
        dataclasses.replace(bl, valid_sizes=(h, 144))  # (I' would be 256)
    with pytest.raises(ValueError, match="valid_sizes must be None or a tuple"):
        dataclasses.replace(bl, valid_sizes=(h, 50))
    with pytest.raises(ValueError, match=r"moe_forward: these experts are zero-padded .* experts.padded_layer\(\)"):
        ffi_ops.moe_forward(x, bl, *nv.route(logits, "softmax_topk", top_k=2), activation=act)


def test_weight_order():
    """The order each backend reads fastest: rows everywhere on the CPU (the CUDA ffi kernels'
    blocked order is checked in tests/test_ffi.py on the GPU)."""
    if jax.devices()[0].platform == "cpu":
        for b in ("auto",) + base.names():
            assert nv.weight_order(b, hidden_size=256, intermediate_size=128) == "rows", b
    assert nv.weight_order("xla", hidden_size=256, intermediate_size=128) == "rows"
    with pytest.raises(ValueError, match="backend must be one of"):
        nv.weight_order("cuda", hidden_size=256, intermediate_size=128)
