"""MoE routing (spec section 5): an independent numpy reference, the routing the golden MoE
outputs imply, tie-breaking, gradients and argument validation."""

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jax_nvfp4 as nv
from conftest import GOLDEN, golden, golden_names, run_on_cpu_devices

MOE_FILES = golden_names("moe_")
E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6] + [-v for v in (0, .5, 1, 1.5, 2, 3, 4, 6)], np.float64)


# ------------------------------------------------------------------------------------------
# Independent numpy reference (float32 like the spec; stable sort => lower id wins ties)

def _topk(v, k):
    idx = np.argsort(-v, axis=-1, kind="stable")[:, :k]
    return np.take_along_axis(v, idx, -1), idx


def _softmax(v):
    z = np.exp(v - v.max(-1, keepdims=True))
    return z / z.sum(-1, keepdims=True)


def _sigmoid(v):
    return 1 / (1 + np.exp(-v))


def np_route(logits, method, k, bias=None, n_group=1, topk_group=1, scale=1.0):
    l = np.asarray(logits, np.float32)
    if method == "deepseek_v3":
        t, e = l.shape
        s = _sigmoid(l)
        b = s + np.asarray(bias, np.float32)
        size = e // n_group
        gs = np.sort(b.reshape(t, n_group, size), -1)[..., -2:].sum(-1)
        _, keep = _topk(gs, topk_group)
        # The kept groups' experts, ascending, stably by descending b (ties: the lower id), the first k.
        kept = [np.sort(np.concatenate([np.arange(g * size, (g + 1) * size) for g in row])) for row in keep]
        ids = np.array([c[np.argsort(-b[i, c], kind="stable")[:k]] for i, c in enumerate(kept)])
        sel = np.take_along_axis(s, ids, -1)
        w = sel / (sel.sum(-1, keepdims=True) + 1e-20)
    else:
        if bias is not None:
            l = l + np.asarray(bias, np.float32)
        if method == "softmax_topk":
            w, ids = _topk(_softmax(l), k)
        elif method == "renormalize_naive":
            w, ids = _topk(_softmax(l), k)
            w = w / (w.sum(-1, keepdims=True) + 1e-20)
        elif method == "renormalize":
            v, ids = _topk(l, k)
            w = _softmax(v)
        elif method == "topk_uniform":
            _, ids = _topk(l, k)
            w = np.full(ids.shape, 1 / k)
        elif method == "llama4":
            v, ids = _topk(l, 1)
            w = _sigmoid(v)
    return ids, w * scale


# ------------------------------------------------------------------------------------------
# Golden MoE files

def _bf16(bits):
    return np.asarray(bits).view(ml_dtypes.bfloat16)


def _decode(data, scales):
    codes = np.stack([data & 15, data >> 4], -1).reshape(data.shape[:-1] + (-1,))
    vals = E2M1[codes]
    s = np.asarray(scales).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return (vals.reshape(s.shape + (16,)) * s[..., None]).reshape(vals.shape)


def golden_moe(name):
    """(data, routing kwargs for nv.route) of one golden MoE file."""
    d = golden(name)
    p = json.loads((GOLDEN / "MANIFEST.json").read_text())[name]
    method = name[len("moe_"):-len(".npz")]
    kw = dict(top_k=p["top_k"])
    if method == "deepseek_v3":
        kw.update(bias=jnp.asarray(_bf16(d["bias_bf16_bits"])), n_group=p["n_group"],
                  topk_group=p["topk_group"], routed_scaling_factor=p["routed_scaling_factor"])
    return d, method, kw


@pytest.mark.parametrize("name", MOE_FILES)
def test_route_matches_numpy_reference_on_golden(name):
    d, method, kw = golden_moe(name)
    logits = _bf16(d["logits_bf16_bits"])
    ids, w = jax.jit(nv.route, static_argnames=("method", "top_k", "n_group", "topk_group"))(
        jnp.asarray(logits), method=method, **kw)
    rids, rw = np_route(logits.astype(np.float32), method, kw["top_k"], bias=kw.get("bias"),
                        n_group=kw.get("n_group", 1), topk_group=kw.get("topk_group", 1),
                        scale=kw.get("routed_scaling_factor", 1.0))
    assert ids.dtype == jnp.int32 and w.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(ids), rids)
    np.testing.assert_allclose(np.asarray(w), rw, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("name", MOE_FILES)
def test_route_reproduces_golden_output_in_float64(name):
    """Recompute the golden output in float64 from the decoded weights with route()'s choice:
    it must agree with the bf16 golden output to within bf16 rounding."""
    d, method, kw = golden_moe(name)
    ids, w = nv.route(jnp.asarray(_bf16(d["logits_bf16_bits"])), method, **kw)
    ids, w = np.asarray(ids), np.asarray(w, np.float64)
    x = _bf16(d["x_bf16_bits"]).astype(np.float64)
    w13 = _decode(d["w13_data"], d["w13_scales"])  # [E, 2I, H], rows [up; gate]
    w2 = _decode(d["w2_data"], d["w2_scales"])
    inter = w13.shape[1] // 2
    g = np.einsum("th,tknh->tkn", x, w13[ids])
    up, gate = g[..., :inter], g[..., inter:]
    a = gate / (1 + np.exp(-gate)) * up
    y = np.einsum("tk,tki,tkhi->th", w, a, w2[ids])
    gold = _bf16(d["out_bf16_bits"]).astype(np.float64)
    scale = np.abs(gold).max()
    assert np.all(np.abs(y - gold) <= 2.0 ** -8 * np.abs(y) + 1e-5 * scale)
    assert np.linalg.norm(y - gold) / np.linalg.norm(gold) < 2e-3


# ------------------------------------------------------------------------------------------
# Semantics, ties, properties

def _route_np(logits, method, k, **kw):
    ids, w = nv.route(jnp.asarray(logits), method, top_k=k, **kw)
    return np.asarray(ids), np.asarray(w)


@pytest.mark.parametrize("method", ["softmax_topk", "renormalize", "renormalize_naive", "topk_uniform"])
def test_ties_pick_lower_expert_id(method):
    logits = np.array([[0., 1., 1., 0., 1.], [2., 2., 2., 2., 2.]], np.float32)
    ids, _ = _route_np(logits, method, 3)
    np.testing.assert_array_equal(ids, [[1, 2, 4], [0, 1, 2]])


def test_ties_llama4_and_deepseek():
    ids, w = _route_np(np.array([[3., 5., 5.]], np.float32), "llama4", 1)
    np.testing.assert_array_equal(ids, [[1]])
    np.testing.assert_allclose(w, [[1 / (1 + np.exp(-5.0))]], rtol=1e-6)
    # All scores equal: groups 0 and 1 are kept (lower ids), then experts 0..3 in order.
    ids, _ = _route_np(np.zeros((1, 8), np.float32), "deepseek_v3", 3, bias=jnp.zeros(8),
                       n_group=4, topk_group=2)
    np.testing.assert_array_equal(ids, [[0, 1, 2]])


def test_deepseek_minus_inf_bias_stays_in_the_kept_groups():
    """An expert of a kept group with b = -inf still ranks above every expert of the groups left out."""
    ids, _ = _route_np(np.zeros((1, 6), np.float32), "deepseek_v3", 3, bias=jnp.array([-1., -1, -1, 0, 0, -jnp.inf]),
                       n_group=2, topk_group=1)
    np.testing.assert_array_equal(ids, [[3, 4, 5]])


def test_deepseek_groups_restrict_selection_and_bias_only_selects():
    # Group 0 = {0, 1} holds the single best expert but a poor second; group 1 = {2, 3} wins.
    logits = np.array([[4.0, -4.0, 2.0, 2.0, -1.0, -1.0, -2.0, -2.0]], np.float32)
    ids, w = _route_np(logits, "deepseek_v3", 2, bias=jnp.zeros(8), n_group=4, topk_group=1)
    np.testing.assert_array_equal(ids, [[2, 3]])
    np.testing.assert_allclose(w, [[0.5, 0.5]], rtol=1e-6)
    # A bias moves the choice but not the weights (which use sigmoid(l) without bias).
    bias = jnp.array([0, 0, 0, 0, 0, 0, 5.0, 0])
    ids, w = _route_np(logits, "deepseek_v3", 2, bias=bias, n_group=4, topk_group=1,
                       routed_scaling_factor=2.5)
    np.testing.assert_array_equal(ids, [[6, 7]])
    np.testing.assert_allclose(w, [[1.25, 1.25]], rtol=1e-6)


def test_weights_per_method():
    logits = np.array([[0.5, -1.0, 2.0, 0.0]], np.float32)
    p = _softmax(logits.astype(np.float64))
    _, w = _route_np(logits, "softmax_topk", 2)
    np.testing.assert_allclose(w, [[p[0, 2], p[0, 0]]], rtol=1e-6)
    _, w = _route_np(logits, "renormalize", 2, routed_scaling_factor=3.0)
    np.testing.assert_allclose(w.sum(), 3.0, rtol=1e-6)
    _, w = _route_np(logits, "topk_uniform", 4)
    np.testing.assert_allclose(w, 0.25)
    ids, _ = _route_np(logits, "renormalize", 2, bias=jnp.array([0, 10.0, 0, 0]))
    np.testing.assert_array_equal(ids, [[1, 2]])


@settings(max_examples=15, deadline=None)
@given(data=st.data(), method=st.sampled_from(["renormalize", "topk_uniform", "llama4"]))
def test_logit_selected_methods_match_reference_with_ties(data, method):
    # Small integer logits: ties are frequent and must resolve to the lower id.
    logits = np.array(data.draw(st.lists(st.lists(st.integers(-2, 2), min_size=6, max_size=6),
                                         min_size=3, max_size=3)), np.float32)
    k = 1 if method == "llama4" else data.draw(st.integers(1, 6))
    ids, w = _route_np(logits, method, k)
    rids, rw = np_route(logits, method, k)
    np.testing.assert_array_equal(ids, rids)
    np.testing.assert_allclose(w, rw, rtol=1e-6)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), method=st.sampled_from(nv.ROUTING_METHODS), with_bias=st.booleans())
def test_random_logits_match_reference(seed, method, with_bias):
    """Every method, with and without a bias (added to the logits; deepseek_v3: to the sigmoid scores)."""
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((5, 16)).astype(np.float32) * 3
    kw = dict(bias=rng.standard_normal(16).astype(np.float32)) if with_bias or method == "deepseek_v3" else {}
    if method == "deepseek_v3":
        kw.update(n_group=4, topk_group=2)
    k = 1 if method == "llama4" else 4
    ids, w = _route_np(logits, method, k, **kw)
    rids, rw = np_route(logits, method, k, **kw)
    np.testing.assert_array_equal(ids, rids)
    np.testing.assert_allclose(w, rw, rtol=1e-5)


# Floats whose order lax.top_k fixes (IEEE total order): signed zeros and NaNs, infinities, subnormals, ties.
_ORDERED = np.array([0.0, -0.0, np.inf, -np.inf, 1.0, -1.0, 1e-45, -1e-45, 3e38], np.float32)
_NANS = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF], np.uint32).view(np.float32)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 40), k_frac=st.floats(0, 1), groups=st.booleans())
def test_top_k_sorted_is_lax_top_k_bitwise(seed, n, k_frac, groups):
    rng = np.random.default_rng(seed)
    pool = np.concatenate([_ORDERED, _NANS, rng.standard_normal(4).astype(np.float32)])
    x = rng.choice(pool, size=(5, 3, n) if groups else (6, n))
    k = max(1, round(k_frac * n))
    v, ids = jax.jit(jax.lax.top_k, static_argnums=1)(x, k)
    sv, sids = jax.jit(nv.routing.top_k_sorted, static_argnums=1)(x, k)
    np.testing.assert_array_equal(np.asarray(sids), np.asarray(ids))
    assert np.asarray(sv).tobytes() == np.asarray(v).tobytes()
    assert sids.dtype == jnp.int32 and sv.shape == v.shape


# Plain jit over 4 CPU devices, router logits split along T: every method selects on each device's tokens alone.
_ROUTE_SPLIT = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import jax_nvfp4 as nv
logits = jax.random.normal(jax.random.key(0), (64, 32)) * 2
keys = jax.random.split(jax.random.key(1), 3)
ex = nv.quantize_experts(jax.random.normal(keys[0], (32, 64, 128)) * 0.2,
                         jax.random.normal(keys[1], (32, 128, 32)) * 0.2)
x = jax.random.normal(keys[2], (64, 128), jnp.bfloat16)
def check(mesh, grads):
    split = jax.device_put(logits, NamedSharding(mesh, P("dp")))
    for method in nv.ROUTING_METHODS:
        kw = dict(bias=jnp.linspace(-1, 1, 32), n_group=4, topk_group=2) if method == "deepseek_v3" else {}
        k = 1 if method == "llama4" else 4
        f = jax.jit(lambda l: nv.route(l, method, top_k=k, **kw))
        gathered = all_gathers(f.lower(split).compile().as_text())
        assert not gathered, (mesh, method, gathered)
        (ids, w), (ids1, w1) = f(split), f(logits)
        np.testing.assert_array_equal(np.asarray(ids), np.asarray(ids1), err_msg=method)
        np.testing.assert_array_equal(np.asarray(w), np.asarray(w1), err_msg=method)
        if grads:  # through the weights (jax differentiates on Explicit axes only inside set_mesh)
            g = jax.jit(jax.grad(lambda l: (f(l)[1] * jnp.arange(k)).sum()))
            np.testing.assert_allclose(np.asarray(g(split)), np.asarray(g(logits)), rtol=1e-6, atol=1e-7,
                                       err_msg=method)
    # A whole layer routed from logits, tokens split, experts on every device: nothing to gather.
    layer = jax.jit(lambda x, l: nv.moe(x, ex, router_logits=l, top_k=4, backend="xla"))
    assert not all_gathers(layer.lower(jax.device_put(x, NamedSharding(mesh, P("dp"))), split).compile().as_text())
for types in ((AxisType.Auto,), (AxisType.Explicit,)):
    mesh = jax.make_mesh((4,), ("dp",), axis_types=types)
    check(mesh, grads=types == (AxisType.Auto,))
    with jax.set_mesh(mesh):  # (Explicit axes: the shardings are then in the types)
        check(mesh, grads=True)
print("ok")
"""


def test_route_keeps_tokens_split_over_devices():
    run_on_cpu_devices(_ROUTE_SPLIT, n=4)


def test_jit_grad_and_empty_batch():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((4, 8)), jnp.float32)
    for method in ("softmax_topk", "renormalize", "renormalize_naive", "llama4", "deepseek_v3"):
        k = 1 if method == "llama4" else 3
        kw = dict(bias=jnp.zeros(8), n_group=2) if method == "deepseek_v3" else {}
        c = jnp.asarray(rng.standard_normal((4, k)), jnp.float32)
        f = lambda l: (nv.route(l, method, top_k=k, **kw)[1] * c).sum()  # noqa: E731
        g = jax.jit(jax.grad(f))(logits)
        eps = 1e-3  # central difference along a random direction (the selection stays put)
        d = jnp.asarray(rng.standard_normal((4, 8)), jnp.float32)
        fd = (f(logits + eps * d) - f(logits - eps * d)) / (2 * eps)
        np.testing.assert_allclose(float((g * d).sum()), float(fd), rtol=1e-2, atol=1e-4)
        assert bool(jnp.any(g != 0))
    ids, w = nv.route(jnp.zeros((0, 8)), "deepseek_v3", top_k=2, bias=jnp.zeros(8), n_group=2)
    assert ids.shape == (0, 2) and w.shape == (0, 2)


@pytest.mark.parametrize("kwargs, err, match", [
    (dict(method="nope", top_k=1), ValueError, "routing method must be one of"),
    (dict(method="softmax_topk", top_k=9), ValueError, "top_k"),
    (dict(method="softmax_topk", top_k=0), ValueError, "top_k"),
    (dict(method="softmax_topk", top_k=2.0), TypeError, "top_k"),
    (dict(method="llama4", top_k=2), ValueError, "top_k must be 1"),
    (dict(method="deepseek_v3", top_k=2), ValueError, "needs bias"),
    (dict(method="deepseek_v3", top_k=2, bias=jnp.zeros(8), n_group=3), ValueError, "n_group"),
    (dict(method="deepseek_v3", top_k=2, bias=jnp.zeros(8), n_group=4, topk_group=5), ValueError,
     "topk_group"),
    (dict(method="deepseek_v3", top_k=5, bias=jnp.zeros(8), n_group=4, topk_group=2), ValueError,
     "exceeds"),
    (dict(method="deepseek_v3", top_k=2, bias=jnp.zeros(7)), ValueError, "bias must have shape"),
    (dict(method="deepseek_v3", top_k=2, bias=jnp.zeros(8, jnp.int32)), TypeError, "bias"),
    (dict(method="softmax_topk", top_k=2, n_group=2), ValueError, "only to routing 'deepseek_v3'"),
])
def test_bad_arguments(kwargs, err, match):
    with pytest.raises(err, match=match):
        nv.route(jnp.zeros((2, 8)), **kwargs)


def test_bad_logits():
    with pytest.raises(TypeError, match="router_logits"):
        nv.route(jnp.zeros((2, 8), jnp.int32), "softmax_topk", top_k=1)
    with pytest.raises(ValueError, match="router_logits must be 2-D"):
        nv.route(jnp.zeros((8,)), "softmax_topk", top_k=1)
