"""The Flax NNX MoE module and online quantization (jax_nvfp4.nn): agreement with jax_nvfp4.moe,
bit-exact quantization of a live model (eagerly, under nnx.jit and inside jax.jit), ignore lists,
mode switches, routing replay, gradients, loading NVFP4 experts from a converted checkpoint, errors."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

pytest.importorskip("flax")
from flax import nnx  # noqa: E402

import jax_nvfp4 as nv  # noqa: E402
from jax_nvfp4 import nn as nvnn  # noqa: E402
from jax_nvfp4.backends.xla import XLABackend  # noqa: E402
from conftest import run_on_cpu_devices  # noqa: E402

H, I, E, K, T = 64, 32, 8, 2, 10
# jitted: one compilation instead of many eager ones (exact either way)
quantize_experts = jax.jit(nv.quantize_experts, static_argnames=("recipe", "gated"))


def test_nn_without_flax_names_the_extra():
    """Without flax, the core package imports and ``jax_nvfp4.nn`` says which extra installs it."""
    code = "import sys; sys.modules['flax'] = None; import jax_nvfp4; import jax_nvfp4.nn"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "jax_nvfp4.nn needs flax (>= 0.12): pip install 'jax_nvfp4[flax]'" in r.stderr.splitlines()[-1]


class Block(nnx.Module):
    def __init__(self, rngs, **moe_kw):
        self.norm = nnx.LayerNorm(H, rngs=rngs)
        self.mlp = nvnn.MoE(H, I, E, K, rngs=rngs, **moe_kw)

    def __call__(self, x):
        return x + self.mlp(self.norm(x))


class Tiny(nnx.Module):
    """A model whose MoE blocks are named like a Hugging Face checkpoint's (``model.layers.L.mlp``)."""

    def __init__(self, rngs, layers=2, **moe_kw):
        self.model = nnx.Module()
        self.model.layers = nnx.List([Block(rngs, **moe_kw) for _ in range(layers)])

    def __call__(self, x):
        for blk in self.model.layers:
            x = blk(x)
        return x


@pytest.fixture(scope="module")
def model():
    return Tiny(nnx.Rngs(0), routing="renormalize_naive")


@pytest.fixture(scope="module")
def x():
    return jax.random.normal(jax.random.key(1), (2, T // 2, H), jnp.bfloat16)


def functional(blk: nvnn.MoE, x, mode=None, backend="auto"):
    """The block by hand: its router, then jax_nvfp4.moe on its experts."""
    xt = x.reshape(-1, H)
    logits = jnp.dot(xt, blk.router.kernel[...], preferred_element_type=jnp.float32)
    return nv.moe(xt, blk.experts.experts(), router_logits=logits, routing=blk.routing, top_k=blk.top_k,
                  activation=blk.activation, mode=mode, backend=backend).reshape(x.shape)


def test_moe_module_matches_functional(model, x):
    blk = model.model.layers[0].mlp
    assert isinstance(blk.experts, nvnn.BF16ExpertWeights) and blk.experts.gate_up.shape == (E, 2 * I, H)
    out, (ids, w) = blk(x, return_routing=True)
    assert out.shape == x.shape and out.dtype == jnp.bfloat16 and ids.shape == (2, T // 2, K)
    np.testing.assert_array_equal(out, functional(blk, x))
    np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-6)  # renormalize_naive


def quantized_leaves(m):
    return jax.tree.leaves(nnx.state(m, nvnn.QuantizedWeight))


def assert_same_bytes(a, b):
    la, lb = quantized_leaves(a), quantized_leaves(b)
    assert len(la) == len(lb) > 0
    for u, v in zip(la, lb):
        assert u.dtype == v.dtype and u.shape == v.shape
        np.testing.assert_array_equal(np.asarray(u).view(np.uint8), np.asarray(v).view(np.uint8))


def test_quantize_moe_is_bit_exact_and_leaves_the_policy_alone(model, x):
    q = nvnn.quantize_moe(model)
    for name, blk in nvnn.moe_modules(q).items():
        src = nvnn.moe_modules(model)[name]
        assert not src.quantized and src.mode is None  # the bf16 policy is unchanged
        assert blk.quantized and blk.mode == "w4a16"
        ref = quantize_experts(src.experts.gate_up[...], src.experts.down[...])
        got = blk.experts.experts()
        for a, b in ((got.gate_up, ref.gate_up), (got.down, ref.down)):
            np.testing.assert_array_equal(a.data, b.data)
            np.testing.assert_array_equal(np.asarray(a.scales).view(np.uint8), np.asarray(b.scales).view(np.uint8))
            np.testing.assert_array_equal(a.global_scale, b.global_scale)
        # everything else is shared with the policy, not copied
        assert blk.router.kernel[...] is src.router.kernel[...]
    blk = q.model.layers[0].mlp
    np.testing.assert_array_equal(blk(x), functional(blk, x, "w4a16"))
    # NVFP4 weights are not trainable parameters
    assert not any(v.dtype == jnp.uint8 for v in jax.tree.leaves(nnx.state(q, nnx.Param)))


def test_quantize_moe_under_jit(model, x):
    eager = nvnn.quantize_moe(model)
    under_nnx_jit = nnx.jit(lambda m: nvnn.quantize_moe(m))(model)
    assert_same_bytes(under_nnx_jit, eager)
    graphdef, state = nnx.split(model)

    @jax.jit
    def requantize_and_run(state, x):
        q = nvnn.quantize_moe(nnx.merge(graphdef, state))
        return q(x), nnx.state(q, nvnn.QuantizedWeight)

    y, qstate = requantize_and_run(state, x)
    np.testing.assert_array_equal(y, eager(x))
    for u, v in zip(jax.tree.leaves(qstate), quantized_leaves(eager)):
        np.testing.assert_array_equal(np.asarray(u).view(np.uint8), np.asarray(v).view(np.uint8))


def test_quantize_moe_refuses_non_finite_weights(model):
    """Eagerly an error naming the block, the tensor and the experts (one host sync after all blocks); under jit
    the experts' global scales are NaN (quantize_experts)."""
    bad = nnx.clone(model)
    ex = bad.model.layers[1].mlp.experts
    ex.down[...] = ex.down[...].at[2, 0, 0].set(jnp.inf)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down: experts \[2\]"):
        nvnn.quantize_moe(bad)
    with pytest.raises(ValueError, match=r"MoE block \(the model itself\): down: the last dimension K must be a "
                                         "multiple of 16"):  # I = 40
        nvnn.quantize_moe(nvnn.MoE(64, 40, 8, 2, rngs=nnx.Rngs(0)))
    q = nnx.jit(lambda m: nvnn.quantize_moe(m))(bad)
    assert np.isnan(np.asarray(q.model.layers[1].mlp.experts.experts().down.global_scale)).tolist() == [
        e == 2 for e in range(E)]


def test_layers_stacked_by_nnx_vmap_quantize_and_scan(x):
    """MoE blocks made by nnx.vmap (experts [L, E, N, K]) quantize as each layer alone (bitwise) and run under
    nnx.scan as the layers one by one (bitwise), in bf16 and in NVFP4."""
    layers = nnx.vmap(lambda key: Block(nnx.Rngs(key)))(jax.random.split(jax.random.key(3), 3))
    q = nvnn.quantize_moe(layers)
    assert q.mlp.quantized and q.mlp.experts.experts().stack_shape == (3,)
    step = lambda h, blk: blk(h).astype(h.dtype)  # noqa: E731
    scan = nnx.jit(nnx.scan(step, in_axes=(nnx.Carry, 0), out_axes=nnx.Carry))
    graphdef, state = nnx.split(layers)
    qgraphdef, qstate = nnx.split(q)
    for model, (gd, st) in ((layers, (graphdef, state)), (q, (qgraphdef, qstate))):
        h = x
        for l in range(3):
            blk = nnx.merge(gd, jax.tree.map(lambda a: a[l], st))
            if blk.mlp.quantized:  # this layer's bytes: its bf16 experts quantized alone
                assert_same_bytes(blk, nvnn.quantize_moe(nnx.merge(graphdef, jax.tree.map(lambda a: a[l], state))))
            h = nnx.jit(lambda b, h: step(h, b))(blk, h)
        np.testing.assert_array_equal(scan(x, model), h)


def test_ignore_inplace_modes_and_recipe(model, x):
    with pytest.warns(UserWarning, match="'layers.7.mlp' matches no MoE block"):
        q = nvnn.quantize_moe(model, ignore=["model.layers.0", "layers.7.mlp"])
    assert not q.model.layers[0].mlp.quantized and q.model.layers[1].mlp.quantized
    # one quantization serves both modes: w4a4 switches mode, keeps the very same arrays
    q4 = nvnn.quantize_moe(q, mode="w4a4", ignore="model.layers.0.mlp")
    assert q4.model.layers[1].mlp.mode == "w4a4" and q.model.layers[1].mlp.mode == "w4a16"
    assert q4.model.layers[1].mlp.experts.down_data[...] is q.model.layers[1].mlp.experts.down_data[...]
    blk = q4.model.layers[1].mlp
    np.testing.assert_array_equal(blk(x), functional(blk, x, "w4a4"))
    # set_moe_options: quantized modes apply to the NVFP4 blocks, the bf16 block stays bf16
    s = nvnn.set_moe_options(q4, mode="w4a16", backend="xla")
    assert [b.mode for b in nvnn.moe_modules(s).values()] == [None, "w4a16"]
    assert all(b.backend == "xla" for b in nvnn.moe_modules(s).values()) and q4.model.layers[1].mlp.backend == "auto"
    blk = s.model.layers[1].mlp
    np.testing.assert_array_equal(blk(x), functional(blk, x, "w4a16", backend="xla"))
    with pytest.raises(ValueError, match="'model.layers.1.mlp' holds NVFP4 experts"):
        nvnn.set_moe_options(q4, mode="bf16")
    # a backend instance (its options) for every block, under nnx.jit too
    ragged = XLABackend(gmm="ragged")
    r = nvnn.set_moe_options(s, backend=ragged)
    assert all(b.backend is ragged for b in nvnn.moe_modules(r).values())
    blk = r.model.layers[1].mlp
    eager = blk(x)
    np.testing.assert_array_equal(eager, functional(blk, x, "w4a16", backend=ragged))
    jitted = nnx.jit(lambda b, x: b(x))(blk, x)
    np.testing.assert_allclose(np.asarray(jitted, np.float32), np.asarray(eager, np.float32), rtol=1e-2, atol=1e-3)
    c = nnx.clone(model)
    assert nvnn.quantize_moe(c, inplace=True) is c and c.model.layers[0].mlp.quantized
    assert c.model.layers[0].mlp.experts.experts().gate_up.data.shape == (E, 2 * I, H // 2)


def test_errors(model, x):
    with pytest.raises(ValueError, match="mode must be one of"):
        nvnn.quantize_moe(model, mode="bf16")
    with pytest.raises(ValueError, match="recipe must be one of"):
        nvnn.quantize_moe(model, recipe="int4")
    with pytest.raises(ValueError, match="has no jax_nvfp4.nn.MoE block"):
        nvnn.quantize_moe(nnx.Linear(4, 4, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="routing must be one of"):
        nvnn.MoE(H, I, E, K, routing="top2", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="top_k must be in"):
        nvnn.MoE(H, I, E, 9, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="router_bias=True"):
        nvnn.MoE(H, I, E, K, routing="deepseek_v3", rngs=nnx.Rngs(0))
    # refused when built, not at the first call
    with pytest.raises(TypeError, match=r"top_k must be a Python int \(a static argument\), got float"):
        nvnn.MoE(H, I, E, 2.0, rngs=nnx.Rngs(0))
    assert nvnn.MoE(H, I, E, np.int64(2), rngs=nnx.Rngs(0)).top_k == 2  # (a size read from a numpy config)
    with pytest.raises(ValueError, match="routing 'llama4' selects one expert"):
        nvnn.MoE(H, I, E, 2, routing="llama4", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="n_group must be a positive divisor"):
        nvnn.MoE(H, I, E, K, routing="deepseek_v3", router_bias=True, n_group=3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="backend must be one of"):
        nvnn.MoE(H, I, E, K, backend="cuda", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="backend must be one of"):
        nvnn.set_moe_options(model, backend="cuda")
    with pytest.raises(TypeError, match="backend must be a name or a backend instance .* got the class XLABackend"):
        nvnn.MoE(H, I, E, K, backend=XLABackend, rngs=nnx.Rngs(0))
    blk = nnx.clone(model.model.layers[0].mlp)
    blk.mode = "w4a4"
    with pytest.raises(ValueError, match="quantize_moe"):
        blk(x)
    with pytest.raises(ValueError, match="hidden_size"):
        blk(x[..., :32])


@pytest.mark.parametrize("routing", nv.ROUTING_METHODS)
def test_replay_weights_reproduce_route(routing):
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((16, 8)), jnp.float32)
    k = 1 if routing == "llama4" else 3
    bias = jnp.asarray(rng.standard_normal(8) * 0.1, jnp.float32)
    kw = dict(n_group=4, topk_group=2) if routing == "deepseek_v3" else {}
    for b in (bias, None) if routing != "deepseek_v3" else (bias,):
        ids, w = nv.route(logits, routing, top_k=k, bias=b, routed_scaling_factor=2.5, **kw)
        for replay in (nvnn.replay_weights, jax.jit(nvnn.replay_weights, static_argnums=2)):  # eager and jitted
            np.testing.assert_array_equal(replay(logits, ids, routing, bias=b, routed_scaling_factor=2.5), w)
    # padding ids get weight 0 and leave the others' normalization alone
    padded = nvnn.replay_weights(logits, ids.at[:, -1].set(-1), routing, bias=bias)
    assert bool(jnp.all(padded[:, -1] == 0))


def test_module_routing_replay_and_other_options(x):
    blk = nvnn.MoE(H, I, E, 3, routing="deepseek_v3", router_bias=True, n_group=4, topk_group=2,
                   routed_scaling_factor=1.5, activation="geglu", rngs=nnx.Rngs(2))
    blk.router_bias[...] = jnp.linspace(-0.1, 0.1, E)
    out, (ids, w) = blk(x, return_routing=True)
    np.testing.assert_array_equal(blk(x, topk_ids=ids), out)
    relu = nvnn.MoE(H, I, E, K, activation="relu2", rngs=nnx.Rngs(3))
    assert not relu.experts.gated and relu.experts.gate_up.shape == (E, I, H)
    q = nvnn.quantize_moe(relu)
    assert q.quantized and q(x).shape == x.shape
    with pytest.raises(ValueError, match="topk_ids must have shape"):
        blk(x, topk_ids=ids[0])
    # ids outside [0, E) are padding, as negative ones (their weight 0, left out of the normalization)
    np.testing.assert_array_equal(blk(x, topk_ids=ids.at[..., 0].set(E + 3)), blk(x, topk_ids=ids.at[..., 0].set(-1)))
    assert bool(jnp.all(jnp.isfinite(blk(x, topk_ids=ids.at[..., 0].set(E)).astype(jnp.float32))))


def test_gradients_reach_router_and_bf16_experts(model, x):
    def loss(m):
        return jnp.mean(m(x).astype(jnp.float32) ** 2)

    grads = nnx.grad(loss)(model)
    g = grads["model"]["layers"][0]["mlp"]
    assert float(jnp.abs(g["router"]["kernel"][...].astype(jnp.float32)).sum()) > 0
    assert float(jnp.abs(g["experts"]["gate_up"][...].astype(jnp.float32)).sum()) > 0


_BIASED_EXPERT_PARALLEL = textwrap.dedent("""
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
import jax_nvfp4 as nv
from jax_nvfp4 import nn as nvnn
mesh = jax.make_mesh((2,), ("ep",))
m = nvnn.MoE(64, 32, 8, 2, activation="swiglu_oai", expert_bias=True, rngs=nnx.Rngs(0))
m.experts.down_bias[...] = jax.random.normal(jax.random.key(2), (8, 64), jnp.bfloat16)
x = jax.random.normal(jax.random.key(1), (6, 64), jnp.bfloat16)
for model in (m, nvnn.quantize_moe(m)):
    got = nnx.jit(lambda m, x: m(x))(nvnn.expert_parallel(model, mesh, "ep"), x)
    halves = [jax.tree_util.tree_map(lambda a: a[s], model.experts.experts()) for s in (slice(0, 4), slice(4, 8))]
    ref = sum(np.asarray(nv.moe(x, h, router_logits=model.router_logits(x), top_k=2, activation="swiglu_oai",
                                local_expert_offset=o), np.float32) for h, o in zip(halves, (0, 4)))
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(jnp.asarray(ref, jnp.bfloat16), np.float32))
print("ok")
""")


def test_expert_biases_in_blocks(x):
    """MoE(expert_bias=True) (gpt-oss): zero bias Params at first; the block is jax_nvfp4.moe on its biased experts
    (bitwise); quantize_moe keeps the biases unquantized beside the NVFP4 bytes; gradients reach them; a checkpoint's
    experts without biases are refused for it; under expert_parallel (2 CPU devices) the biases split with their
    experts (the block is the shards' sum, bitwise)."""
    blk = nvnn.MoE(H, I, E, K, activation="swiglu_oai", expert_bias=True, rngs=nnx.Rngs(3))
    ex = blk.experts
    assert isinstance(ex.gate_up_bias, nnx.Param) and ex.gate_up_bias.shape == (E, 2 * I)
    assert not np.any(np.asarray(ex.down_bias[...], np.float32))
    ex.gate_up_bias[...] = jax.random.normal(jax.random.key(4), (E, 2 * I), jnp.bfloat16)
    ex.down_bias[...] = jax.random.normal(jax.random.key(5), (E, H), jnp.bfloat16)
    out = blk(x)
    np.testing.assert_array_equal(out, functional(blk, x))
    q = nvnn.quantize_moe(blk)
    qb = q.experts
    assert isinstance(qb.down_bias, nvnn.QuantizedWeight)
    np.testing.assert_array_equal(qb.down_bias[...], ex.down_bias[...])
    want = quantize_experts(ex.gate_up[...], ex.down[...])
    np.testing.assert_array_equal(qb.experts().down.data, want.down.data)
    np.testing.assert_array_equal(q(x), functional(q, x, "w4a16"))
    unbiased = nvnn.MoE(H, I, E, K, activation="swiglu_oai", rngs=nnx.Rngs(3))
    assert not unbiased.experts.biases() and not nvnn.quantize_moe(unbiased).experts.biases()
    assert np.abs(np.asarray(out, np.float32) - np.asarray(unbiased(x), np.float32)).max() > 0.1
    g = nnx.grad(lambda m: jnp.mean(m(x).astype(jnp.float32) ** 2))(blk)
    assert float(jnp.abs(g["experts"]["down_bias"][...].astype(jnp.float32)).sum()) > 0
    assert float(jnp.abs(g["experts"]["gate_up_bias"][...].astype(jnp.float32)).sum()) > 0
    with pytest.raises(ValueError, match="experts without biases, but the block has some"):
        nvnn.load_experts(blk, {"": want})
    run_on_cpu_devices(_BIASED_EXPERT_PARALLEL)


def test_load_experts_from_converted_checkpoint(tmp_path, model, x):
    """A converted checkpoint's experts go into a model whose blocks match its module names; the
    bytes equal quantizing the same bf16 weights online."""
    import ml_dtypes
    tensors = {}
    for name, blk in nvnn.moe_modules(model).items():
        gu = np.asarray(blk.experts.gate_up[...])
        dn = np.asarray(blk.experts.down[...])
        for e in range(E):
            tensors[f"{name}.experts.{e}.gate_proj.weight"] = gu[e, :I].astype(ml_dtypes.bfloat16)
            tensors[f"{name}.experts.{e}.up_proj.weight"] = gu[e, I:].astype(ml_dtypes.bfloat16)
            tensors[f"{name}.experts.{e}.down_proj.weight"] = dn[e].astype(ml_dtypes.bfloat16)
    src = tmp_path / "src"
    src.mkdir()
    save_file(tensors, str(src / "model.safetensors"))
    dst = tmp_path / "dst"
    nv.convert_checkpoint(src, dst, ignore=["model.layers.1.mlp"], progress=False)
    target = nnx.clone(model)
    assert nvnn.load_experts(target, dst) == ["model.layers.0.mlp"]
    assert target.model.layers[0].mlp.quantized and not target.model.layers[1].mlp.quantized
    assert_same_bytes(target, nvnn.quantize_moe(model, ignore="model.layers.1.mlp"))
    # also into an abstract model: nothing bf16 is materialised for the loaded block
    abstract = nnx.eval_shape(lambda: Tiny(nnx.Rngs(0), routing="renormalize_naive"))
    nvnn.load_experts(abstract, nv.load_nvfp4_experts(dst), mode="w4a4")
    assert abstract.model.layers[0].mlp.mode == "w4a4"
    assert isinstance(abstract.model.layers[1].mlp.experts.down.get_value(), jax.ShapeDtypeStruct)
    with pytest.raises(ValueError, match="matches no MoE block"):
        nvnn.load_experts(nnx.clone(model), {"model.layers.5.mlp": target.model.layers[0].mlp.experts.experts()})
    wrong = Tiny(nnx.Rngs(0), layers=1, activation="relu2")
    with pytest.raises(ValueError, match="do not fit"):
        nvnn.load_experts(wrong, dst)


def test_weight_order_of_quantized_and_loaded_blocks(monkeypatch):
    """quantize_moe / load_experts put the experts in ``order`` (``"auto"``: jax_nvfp4.weight_order
    of the block's backend); the block gives the same bytes in either order (here K is too short for
    the GPU kernels to split it), and the order is part of the state's structure."""
    blk = nvnn.MoE(256, 128, 4, 2, rngs=nnx.Rngs(3), routing="renormalize_naive", backend="ffi")
    xb = jax.random.normal(jax.random.key(4), (6, 256), jnp.bfloat16)
    rows = nvnn.quantize_moe(blk, order="rows")
    blocked = nvnn.quantize_moe(blk, order="blocked")
    assert rows.experts.order == "rows" and blocked.experts.experts().gate_up.order == "blocked"
    np.testing.assert_array_equal(blocked(xb), rows(xb))
    on_xla = lambda m: nvnn.set_moe_options(m, backend="xla")(xb)  # noqa: E731
    np.testing.assert_array_equal(on_xla(blocked), on_xla(rows))
    assert nvnn.quantize_moe(blocked, order="rows").experts.order == "rows"  # already NVFP4: reordered
    assert nvnn.quantize_moe(rows, mode="w4a4").experts.order == "rows"  # "auto" keeps a block's order
    assert nvnn.quantize_moe(rows, mode="w4a4").experts.gate_up_data is not None
    flat = lambda m: {p[-1] for p, _ in nnx.to_flat_state(nnx.state(m, nvnn.QuantizedWeight))}  # noqa: E731
    assert flat(blocked) == {f"{g}_{p}{t}" for g in ("gate_up", "down")
                             for p, t in (("data", "_blocked2"), ("scales", "_blocked2"), ("global_scale", ""))}
    assert flat(rows) == {f"{g}_{p}" for g in ("gate_up", "down") for p in ("data", "scales", "global_scale")}
    mixed = nnx.clone(rows)
    nnx.update(mixed, nnx.state(blocked))  # a state of the other order: refused, not misread
    with pytest.raises(ValueError, match="a state saved in the other byte order"):
        mixed(xb)
    old = nnx.clone(blocked)  # a state of the first blocked layout (whole code bytes, until 2026-12-04) merged in
    old.experts.gate_up_data_blocked = nvnn.QuantizedWeight(old.experts.gate_up_data_blocked2[...])
    with pytest.raises(ValueError, match="before 2026-12-04"):
        old(xb)
    expected = nv.weight_order("ffi", hidden_size=256, intermediate_size=128)
    assert nvnn.quantize_moe(blk).experts.order == expected
    seen = []
    monkeypatch.setattr(nvnn.quantization, "weight_order",
                        lambda b, **shape: seen.append((b, shape)) or "blocked")
    assert nvnn.quantize_moe(blk).experts.order == "blocked"
    assert seen == [("ffi", dict(hidden_size=256, intermediate_size=128))]
    target = nnx.clone(blk)
    nvnn.load_experts(target, {"mlp": rows.experts.experts()}, strict=False)  # no such block: nothing loaded
    assert not target.quantized
    nvnn.load_experts(target, {"": rows.experts.experts()}, order="blocked")
    assert target.experts.order == "blocked"
    np.testing.assert_array_equal(on_xla(target), on_xla(rows))
    with pytest.raises(ValueError, match="order"):
        nvnn.quantize_moe(blk, order="columns")
    small = nvnn.MoE(64, 48, 4, 2, rngs=nnx.Rngs(3), routing="renormalize_naive", backend="ffi")  # zero-padded
    padded = nvnn.quantize_moe(small, order="blocked")
    assert padded.experts.experts().gate_up.shape == (4, 256, 128) and padded.experts.experts().valid_sizes == (64, 48)
    xs = xb[:, :64]
    with jax.default_device(jax.devices("cpu")[0]):  # I = 48: the CPU handlers' (the CUDA kernels take 64s)
        np.testing.assert_array_equal(padded(xs), nvnn.quantize_moe(small, order="rows")(xs))
    back = nvnn.quantize_moe(padded, order="rows").experts.experts()
    assert back.gate_up.shape == (4, 96, 64) and back.valid_sizes is None


@pytest.mark.usefixtures("on_cpu")  # I = 32: the CPU handlers' shapes
def test_batch_invariant_block_runs_the_ffi_backend(model, x):
    """MoE(batch_invariant=True) reaches jax_nvfp4.moe: NVFP4 experts run on the ffi backend with the K split fixed
    (on the CPU the same bytes as the ffi layer by hand); a block of bf16 experts with it is an error saying why."""
    blk = nvnn.quantize_moe(model).model.layers[0].mlp
    blk.batch_invariant = True
    np.testing.assert_array_equal(blk(x), functional(blk, x, "w4a16", backend="ffi"))
    with pytest.raises(ValueError, match="batch_invariant=True runs on backend 'ffi'"):
        nvnn.MoE(H, I, E, K, rngs=nnx.Rngs(0), batch_invariant=True)(x)


# Expert parallelism in a model (its own process: the CPU device count is fixed when JAX starts).
_EXPERT_PARALLEL = textwrap.dedent("""
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
import jax_nvfp4 as nv
from jax_nvfp4 import nn as nvnn, ops
assert jax.device_count() == 2
mesh = jax.make_mesh((2,), ("ep",))
H, I, E, K = 128, 64, 8, 2
x = jax.random.normal(jax.random.key(1), (3, 4, H), jnp.bfloat16)
plain = nvnn.MoE(H, I, E, K, routing="renormalize_naive", rngs=nnx.Rngs(0))
for quant in (False, True):
    model = nvnn.quantize_moe(plain) if quant else plain
    ep = nvnn.expert_parallel(model, mesh, "ep")
    assert plain.expert_axis is None and ep.expert_axis == "ep"
    leaf = jax.tree_util.tree_leaves(nnx.state(ep.experts))[0]
    assert leaf.addressable_shards[0].data.shape[0] == E // 2  # each device holds its 4 experts
    f = nnx.jit(lambda m, x: m(x, return_routing=True))
    (want, (ids, w)), (got, (ids_ep, w_ep)) = f(model, x), f(ep, x)
    np.testing.assert_array_equal(np.asarray(ids_ep), np.asarray(ids))
    np.testing.assert_array_equal(np.asarray(w_ep), np.asarray(w))
    xt = x.reshape(-1, H)
    halves = [jax.tree_util.tree_map(lambda a: a[s], model.experts.experts()) for s in (slice(0, 4), slice(4, 8))]
    ref = sum(np.asarray(nv.moe(xt, h, router_logits=model.router_logits(xt), routing="renormalize_naive", top_k=K,
                                local_expert_offset=o), np.float32) for h, o in zip(halves, (0, 4)))
    np.testing.assert_array_equal(np.asarray(got, np.float32).reshape(-1, H),
                                  np.asarray(jnp.asarray(ref).astype(jnp.bfloat16), np.float32))
    a, b = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.linalg.norm(a - b) <= 1e-2 * np.linalg.norm(b), np.linalg.norm(a - b) / np.linalg.norm(b)
    if quant:
        assert ops.TARGET_GEMM in nnx.jit(lambda m, x: m(x)).lower(ep, x).as_text()
    replay = nnx.jit(lambda m, x, i: m(x, topk_ids=i))
    np.testing.assert_array_equal(np.asarray(replay(ep, x, ids)), np.asarray(got))
# A whole model's jitted generation (on Explicit mesh axes, jax 0.12's default, under jax.set_mesh)
lm = nvnn.quantize_moe(nvnn.Qwen3MoeForCausalLM(nvnn.CONFIGS["tiny"], rngs=nnx.Rngs(0)))
prompts = jax.random.randint(jax.random.key(0), (2, 8), 0, 200)
gen = lambda m: nvnn.generate(m, prompts, key=jax.random.key(1), max_new_tokens=8, temperature=0.0,
                              return_routing=True)
a = gen(lm)
lm_ep = nvnn.expert_parallel(lm, mesh, "ep")
with jax.set_mesh(mesh):
    b = gen(lm_ep)
assert b.tokens.shape == a.tokens.shape and (np.asarray(b.routing) == np.asarray(a.routing)).mean() > 0.9
# Without the mesh set, generate and sequence_logprobs set it and place a one-device prompt_mask there; inside
# jax.jit, where they cannot, they say so
for mask in (jnp.ones(prompts.shape, bool), np.ones(prompts.shape, bool)):
    d = nvnn.generate(lm_ep, prompts, prompt_mask=mask, key=jax.random.key(1), max_new_tokens=8, temperature=0.0,
                      return_routing=True)
    np.testing.assert_array_equal(np.asarray(d.tokens), np.asarray(b.tokens))
seq = jnp.concatenate([prompts, b.tokens], axis=1)
with jax.set_mesh(mesh):
    lp = nvnn.sequence_logprobs(lm_ep, seq)
np.testing.assert_array_equal(np.asarray(nvnn.sequence_logprobs(lm_ep, seq, attention_mask=jnp.ones(seq.shape, bool))),
                              np.asarray(lp))
try:
    jax.jit(lambda p: gen(lm_ep).tokens)(prompts)
    raise SystemExit("generate set no mesh inside jit, yet ran")
except ValueError as err:
    assert "inside jax.jit or another transformation, run it under `with jax.set_mesh(mesh):`" in str(err), err
# Or the experts only placed along "ep" (no expert_parallel): plain jit splits the ffi kernels by their
# partitioning rule (jax_nvfp4.expert_sharding), the same sums as shard_map's
placed = nnx.clone(lm)
for block in nvnn.moe_modules(placed).values():
    nnx.update(block.experts, jax.device_put(nnx.state(block.experts),
                                             jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("ep"))))
with jax.set_mesh(mesh):
    c = gen(placed)
np.testing.assert_array_equal(np.asarray(c.tokens), np.asarray(b.tokens))
np.testing.assert_array_equal(np.asarray(c.routing), np.asarray(b.routing))
c = gen(placed)  # no ambient mesh
assert c.tokens.shape == a.tokens.shape and (np.asarray(c.routing) == np.asarray(a.routing)).mean() > 0.9
try:
    nvnn.MoE(H, I, 3, K, expert_axis="ep", mesh=mesh, rngs=nnx.Rngs(0))
    raise SystemExit("3 experts over 2 devices accepted")
except ValueError as err:
    assert "must be a multiple of the 2 devices of mesh axis 'ep'" in str(err), err
print("ok")
""")


def test_expert_parallel_blocks_split_their_experts_over_a_mesh_axis():
    """nvnn.expert_parallel on 2 CPU devices: each device holds 4 of 8 experts; the block (bf16 on xla, NVFP4 on the
    ffi kernels) routes as before and its output is the two shards' sum, bitwise; routing replay alike. A Qwen3-MoE
    model generates under it, and with its experts only placed along the axis (plain jit, the ffi partitioning rule)
    the same tokens, bitwise."""
    run_on_cpu_devices(_EXPERT_PARALLEL)


def test_expert_axis_needs_its_mesh():
    with pytest.raises(ValueError, match="expert_axis=.ep. needs mesh, a jax.sharding.Mesh"):
        nvnn.MoE(64, 32, 4, 2, expert_axis="ep", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="expert_axis=.tp. is not an axis of the mesh"):
        nvnn.expert_parallel(nvnn.MoE(64, 32, 4, 2, rngs=nnx.Rngs(0)), jax.make_mesh((1,), ("ep",)), "tp")


_DATA_AND_EXPERT_PARALLEL = textwrap.dedent("""
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
import jax_nvfp4 as nv
from jax_nvfp4 import nn as nvnn
assert jax.device_count() == 4
mesh = jax.make_mesh((2, 2), ("dp", "ep"))
H, I, E, K = 128, 64, 8, 2
x = jax.random.normal(jax.random.key(1), (4, 3, H), jnp.bfloat16)
xs = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("dp")))
model = nvnn.quantize_moe(nvnn.MoE(H, I, E, K, routing="renormalize_naive", rngs=nnx.Rngs(0)))
ep = nvnn.expert_parallel(model, mesh, "ep", token_axis="dp")
with jax.set_mesh(mesh):
    got, (ids, w) = nnx.jit(lambda m, x: m(x, return_routing=True))(ep, xs)
assert got.sharding.spec[0] == "dp", got.sharding
want, (ids0, w0) = model(x, return_routing=True)
np.testing.assert_array_equal(np.asarray(ids), np.asarray(ids0))
np.testing.assert_allclose(np.asarray(w), np.asarray(w0), rtol=1e-5)  # (router logits of 6 tokens, or of 12)
xt = x.reshape(-1, H)
ids, w = np.asarray(ids).reshape(-1, K), np.asarray(w).reshape(-1, K)
halves = [jax.tree_util.tree_map(lambda a: a[s], model.experts.experts()) for s in (slice(0, 4), slice(4, 8))]
for t in (slice(0, 6), slice(6, 12)):  # each dp shard's tokens (with the routing it used) on the two expert shards
    ref = sum(np.asarray(nv.moe(xt[t], h, topk_ids=ids[t], topk_weights=w[t], local_expert_offset=o), np.float32)
              for h, o in zip(halves, (0, 4)))
    np.testing.assert_array_equal(np.asarray(got, np.float32).reshape(-1, H)[t],
                                  np.asarray(jnp.asarray(ref).astype(jnp.bfloat16), np.float32))
a, b = np.asarray(got, np.float32), np.asarray(want, np.float32)
assert np.linalg.norm(a - b) <= 1e-2 * np.linalg.norm(b)
for bad, match in (("ep", "must name axes of the mesh other than"), ("tp", "must name axes of the mesh other than")):
    try:
        nvnn.expert_parallel(model, mesh, "ep", token_axis=bad)
        raise SystemExit(f"token_axis={bad!r} accepted")
    except ValueError as err:
        assert match in str(err), err
print("ok")
""")


def test_expert_parallel_with_tokens_split_over_another_axis():
    """A 2 x 2 mesh of CPU devices ("dp", "ep"): tokens split over dp, experts over ep; each device's output rows are
    its tokens' sum over the two expert shards (with the routing it used), bitwise; the routing is the unsplit
    block's (its ids; its weights to rounding: XLA's router matmul of 6 tokens need not equal that of 12)."""
    run_on_cpu_devices(_DATA_AND_EXPERT_PARALLEL, n=4)
