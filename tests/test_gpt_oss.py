"""The gpt-oss model (jax_nvfp4.nn): against an independent float64 numpy reference on small random weights (bf16
experts, MXFP4 ones, NVFP4 ones quantized while loading), its YaRN frequencies, sliding windows and sinks (each
one checked to matter), the KV cache with left padding, generation, and config errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")
from flax import nnx  # noqa: E402

import jax_nvfp4 as nv  # noqa: E402
from jax_nvfp4 import nn as nvnn  # noqa: E402
from jax_nvfp4.checkpoint import CheckpointError  # noqa: E402
from jax_nvfp4.nn import gpt_oss  # noqa: E402
import conftest  # noqa: E402
import gpt_oss_numpy_ref as ref  # noqa: E402

# gpt-oss-20b's config.json at tiny sizes: H = I = 64 are not multiples of 128, as 2880 is not.
HF_CONFIG = dict(model_type="gpt_oss", vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, intermediate_size=64, num_local_experts=8,
                 num_experts_per_tok=2, experts_per_token=2, sliding_window=4,
                 layer_types=["sliding_attention", "full_attention"], rms_norm_eps=1e-5, rope_theta=10000.0,
                 rope_scaling=dict(beta_fast=32.0, beta_slow=1.0, factor=4.0, original_max_position_embeddings=64,
                                   rope_type="yarn", truncate=False),
                 max_position_embeddings=256, tie_word_embeddings=False, hidden_act="silu", swiglu_limit=7.0,
                 attention_bias=True, initial_context_length=64)
T = 14


def write_hf(root, weights, config=HF_CONFIG):
    return conftest.write_hf(root, weights, config)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """{kind: (weights, folder)} for bf16 and MXFP4 experts."""
    root = tmp_path_factory.mktemp("gpt_oss")
    return {kind: (w, write_hf(root / kind, w)) for kind, w in (
        ("bf16", ref.random_weights(HF_CONFIG, seed=0)), ("mxfp4", ref.random_weights(HF_CONFIG, seed=1, mxfp4=True)))}


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(2).integers(0, HF_CONFIG["vocab_size"], T)


def nvfp4_experts(model, layer):
    """The model's NVFP4 experts of ``layer`` in :func:`ref.hf_experts`' form (decoded, float64)."""
    ex = model.model.layers[layer].mlp.experts.experts()
    ex = nv.from_blocked_experts(ex) if ex.gate_up.order == "blocked" else ex
    gu, dn = (np.asarray(nv.dequantize(w), np.float64) for w in (ex.gate_up, ex.down))  # [E, 2I, H], [E, H, I]
    i = gu.shape[1] // 2
    inter = np.empty_like(gu)
    inter[:, 0::2], inter[:, 1::2] = gu[:, :i], gu[:, i:]  # back to alternating gate, up
    b1 = np.asarray(ex.gate_up_bias, np.float64)
    b1 = np.stack([b1[:, :i], b1[:, i:]], -1).reshape(b1.shape)
    return inter.transpose(0, 2, 1), b1, dn.transpose(0, 2, 1), np.asarray(ex.down_bias, np.float64)


def assert_close_to_reference(model, w, toks, experts=None, tol=0.06):
    """The model's expert choices equal the reference's own, and its logits are within bf16 tolerance of the
    float64 reference run with those choices (one near-tie flipped by rounding cannot fail the test)."""
    out = model(jnp.asarray(toks)[None], return_routing=True)
    got = np.asarray(out.logits[0], np.float64)
    ids = np.asarray(out.routing[:, 0])
    _, ref_ids = ref.forward(w, HF_CONFIG, toks, experts=experts)
    k = HF_CONFIG["num_experts_per_tok"]
    agree = np.mean([set(a) == set(b) for a, b in zip(ids.reshape(-1, k), ref_ids.reshape(-1, k))])
    assert agree >= 0.9, f"expert selections agree on only {agree:.0%} of (layer, token)"
    want, _ = ref.forward(w, HF_CONFIG, toks, experts=experts, force_ids=ids)
    err = np.abs(got - want)
    scale = np.std(want)
    assert err.max() < tol * scale and err.mean() < tol / 6 * scale, (err.max(), err.mean(), scale)
    assert np.mean(np.argmax(got, -1) == np.argmax(want, -1)) >= 0.85
    return got


# ------------------------------------------------------------------------------------------ config, rope

def test_config_from_hf_and_presets(ckpts):
    c = nvnn.GptOssConfig.from_hf(ckpts["bf16"][1])
    assert (c.hidden_size, c.num_experts, c.head_dim, c.sliding_window, c.rope_factor, c.rope_truncate) == (
        64, 8, 16, 4, 4.0, False)
    assert c.layer_types == ("sliding_attention", "full_attention")
    no_types = {k: v for k, v in HF_CONFIG.items() if k != "layer_types"}
    assert nvnn.GptOssConfig.from_hf(no_types).layer_types == ("sliding_attention", "full_attention")
    big = nvnn.GPT_OSS_CONFIGS["gpt-oss-120b"]
    assert (big.hidden_size, big.num_hidden_layers, big.num_local_experts, big.num_experts_per_tok,
            big.intermediate_size, big.num_key_value_heads, big.vocab_size, big.layer_types[:2]) == (
        2880, 36, 128, 4, 2880, 8, 201088, ("sliding_attention", "full_attention"))
    assert nvnn.GPT_OSS_CONFIGS["gpt-oss-20b"].num_local_experts == 32
    assert big.replace(num_hidden_layers=3).layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    with pytest.raises(ValueError, match="needs layer_types"):
        c.replace(num_hidden_layers=3)
    for bad, msg in ((dict(swiglu_limit=10.0), "swiglu_limit"), (dict(rope_scaling={"rope_type": "linear"}), "yarn"),
                     (dict(model_type="qwen3_moe"), "model_type"), (dict(attention_bias=False), "attention_bias"),
                     (dict(layer_types=["full_attention"]), "layer_types")):
        with pytest.raises(ValueError, match=msg):
            nvnn.GptOssConfig.from_hf(dict(HF_CONFIG, **bad))


@pytest.mark.parametrize("truncate", [False, True])
def test_yarn_frequencies_match_the_formulas(truncate):
    cfg = dict(HF_CONFIG, head_dim=64, rope_theta=150000.0, max_position_embeddings=131072,
               rope_scaling=dict(HF_CONFIG["rope_scaling"], factor=32.0, original_max_position_embeddings=4096,
                                 truncate=truncate))
    want, want_scale = ref.yarn(cfg)
    got, scale = gpt_oss.yarn_frequencies(64, 150000.0, 32.0, 32.0, 1.0, 4096, truncate)
    np.testing.assert_allclose(got, want, rtol=2e-6)
    assert abs(scale - want_scale) < 1e-12 and abs(scale - (0.1 * np.log(32) + 1)) < 1e-12
    assert not np.allclose(got, 150000.0 ** (-np.arange(0, 64, 2) / 64))  # YaRN changes the low frequencies


def test_model_structure():
    m = nnx.eval_shape(lambda: nvnn.GptOssForCausalLM(gpt_oss.CONFIGS["tiny"], rngs=nnx.Rngs(0)))
    assert list(nvnn.moe_modules(m)) == ["model.layers.0.mlp", "model.layers.1.mlp"]
    blk = m.model.layers[0].mlp
    assert (blk.routing, blk.activation, blk.router_bias is not None) == ("renormalize", "swiglu_oai", True)
    assert [layer.self_attn.window for layer in m.model.layers] == [4, None]
    assert m.model.layers[0].self_attn.sinks.shape == (4,)


# ------------------------------------------------------------------------------------------ against the reference

def test_bf16_checkpoint_matches_numpy_reference(ckpts, tokens):
    w, src = ckpts["bf16"]
    model = nvnn.load_gpt_oss(src)
    assert not model.model.layers[0].mlp.quantized
    assert_close_to_reference(model, w, tokens)


def test_sliding_window_and_sinks_count(ckpts, tokens):
    """Without the window, or with zero sinks, the model is far from the reference: both are computed."""
    w, src = ckpts["bf16"]
    want, _ = ref.forward(w, HF_CONFIG, tokens)
    for change in ("window", "sinks"):
        model = nvnn.load_gpt_oss(src)
        if change == "window":
            model.model.layers[0].self_attn.window = None
        else:
            model.model.layers[1].self_attn.sinks[...] = jnp.full((4,), -1e4, jnp.bfloat16)
        got = np.asarray(model(jnp.asarray(tokens)[None]).logits[0], np.float64)
        assert np.abs(got - want).mean() > 0.05 * np.std(want), change


@pytest.mark.parametrize("kind", ["bf16", "mxfp4"])
def test_quantized_while_loading_matches_reference_on_its_nvfp4_experts(ckpts, tokens, kind):
    """quantize=True: NVFP4 experts (from bf16, or from MXFP4 decoded) in the blocked order, zero-padded (I = 64), on
    the ffi backend; the reference runs on the same NVFP4 weights decoded. An MXFP4 checkpoint also loads unquantized
    (MXFP4 decoded to bf16) and matches the reference on its own weights."""
    w, src = ckpts[kind]
    q = nvnn.load_gpt_oss(src, quantize=True, order="blocked", moe_backend="ffi")
    ex = q.model.layers[0].mlp.experts.experts()
    assert ex.gate_up.order == "blocked" and ex.valid_sizes == (64, 64) and ex.gate_up.shape == (8, 256, 128)
    experts = {L: nvfp4_experts(q, L) for L in range(2)}
    assert_close_to_reference(q, w, tokens, experts=experts)
    if kind == "mxfp4":
        assert_close_to_reference(nvnn.load_gpt_oss(src), w, tokens)


def test_converted_checkpoint_loads_and_matches_quantized_while_loading(ckpts, tokens, tmp_path):
    w, src = ckpts["mxfp4"]
    dst = tmp_path / "nvfp4"
    nv.convert_checkpoint(src, dst, progress=False)
    a = nvnn.load_gpt_oss(dst, order="rows")
    b = nvnn.load_gpt_oss(src, quantize=True, order="rows")
    toks = jnp.asarray(tokens)[None]
    np.testing.assert_array_equal(np.asarray(a(toks).logits), np.asarray(b(toks).logits))


def modelopt_stacked(w: dict) -> tuple[dict, dict]:
    """ModelOpt's NVFP4 export of the bf16 stacked experts of ``w``: each projection ``[E, K, N]`` (x @ w) quantized
    along K with one global scale over all experts, stored ``[E, K/2, N]`` / ``[E, K/16, N]`` (transposed back), its
    columns as they were (gpt-oss: gate and up alternating). Returns (tensors, rows-order parts by projection)."""
    out, parts = dict(w), {}
    for name in [n for n in w if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        x = np.swapaxes(w[name], 1, 2)  # [E, N, K]
        q = nv.quantize(jnp.asarray(x), global_amax=jnp.max(jnp.abs(jnp.asarray(x, jnp.float32))))
        data, scales = np.asarray(q.data), np.asarray(q.scales)
        parts[name] = data, scales, np.asarray(q.global_scale)
        out[name] = np.ascontiguousarray(np.swapaxes(data, 1, 2))
        out[name + "_weight_scale"] = np.ascontiguousarray(np.swapaxes(scales, 1, 2))
        out[name + "_weight_scale_2"] = np.asarray(q.global_scale, np.float32)
        out[name + "_input_scale"] = np.array(0.01, np.float32)
    return out, parts


def test_modelopt_stacked_nvfp4_experts_load_as_stored(ckpts, tokens, tmp_path):
    """A ModelOpt NVFP4 gpt-oss checkpoint (stacked, transposed, interleaved experts): the experts' bytes as stored,
    gate rows first, and the model matches the reference on them."""
    w, _ = ckpts["bf16"]
    tensors, parts = modelopt_stacked(w)
    root = write_hf(tmp_path / "modelopt", tensors)
    experts = nv.load_nvfp4_experts(root)
    for L in range(HF_CONFIG["num_hidden_layers"]):
        ex, q = experts[f"model.layers.{L}.mlp"], f"model.layers.{L}.mlp.experts."
        data, scales, g = parts[q + "gate_up_proj"]
        for got, want in ((ex.gate_up.data, data), (ex.gate_up.scales, scales)):
            want = np.concatenate([want[:, 0::2], want[:, 1::2]], axis=1)  # alternating -> [gate; up]
            np.testing.assert_array_equal(np.asarray(got).view(np.uint8), want.view(np.uint8))
        np.testing.assert_array_equal(ex.gate_up.global_scale, np.full(HF_CONFIG["num_local_experts"], g))
        # the projections' one static activation scale each, for every expert
        np.testing.assert_array_equal(ex.input_scales, np.full((HF_CONFIG["num_local_experts"], 2), 0.01, np.float32))
        np.testing.assert_array_equal(np.asarray(ex.down.data), parts[q + "down_proj"][0])
        b = np.asarray(w[q + "gate_up_proj_bias"], np.float32)
        np.testing.assert_array_equal(np.asarray(ex.gate_up_bias, np.float32),
                                      np.concatenate([b[:, 0::2], b[:, 1::2]], axis=1))
    model = nvnn.load_gpt_oss(root)
    assert model.model.layers[0].mlp.quantized
    assert_close_to_reference(model, w, tokens, experts={L: nvfp4_experts(model, L) for L in range(2)})
    bad, name = dict(tensors), "model.layers.1.mlp.experts.down_proj_weight_scale"
    bad[name] = bad[name][:, :, :-1]
    with pytest.raises(CheckpointError, match="down_proj.*NVFP4 block scales"):
        nv.load_nvfp4_experts(write_hf(tmp_path / "bad", bad))


# ------------------------------------------------------------------------------------------ cache, generation

def test_cache_and_left_padding_give_the_full_forward(ckpts, tokens):
    """Prefill then one-token decode steps (sliding window over the cache's slots) give the logits of one forward
    pass over the whole sequence, also behind left padding."""
    model = nvnn.load_gpt_oss(ckpts["bf16"][1])
    toks = jnp.asarray(tokens)[None]
    full = np.asarray(model(toks).logits[0])
    pad = 3
    padded = jnp.concatenate([jnp.zeros((1, pad), jnp.int32), toks[:, :6]], axis=1)
    mask = jnp.arange(pad + 6)[None] >= pad
    cache = model.init_cache(1, pad + T)
    out = model(padded, attention_mask=mask, cache=cache)
    steps = [np.asarray(out.logits[0, -1])]
    cache = out.cache
    for t in range(6, T):
        out = model(toks[:, t:t + 1], cache=cache)
        cache = out.cache
        steps.append(np.asarray(out.logits[0, -1]))
    err = np.abs(np.stack(steps) - full[5:])  # (bf16 rounding; on an H100 0.034 std at most, 0.0057 std mean)
    assert err.max() < 0.08 * np.std(full) and err.mean() < 0.012 * np.std(full), (err.max(), err.mean())
    assert np.abs(np.stack(steps) - full[4:-1]).mean() > 0.1 * np.std(full)  # (one position off is far)


def test_generate_runs_on_gpt_oss(ckpts):
    """jax_nvfp4.nn.generate drives the gpt-oss model (greedy: deterministic, and the first token is the argmax of
    the prompt's logits)."""
    model = nvnn.load_gpt_oss(ckpts["bf16"][1], quantize=True)
    prompts = jnp.asarray(np.random.default_rng(3).integers(0, 256, (2, 5)), jnp.int32)
    a = nvnn.generate(model, prompts, key=jax.random.key(0), max_new_tokens=4, temperature=0.0)
    b = nvnn.generate(model, prompts, key=jax.random.key(1), max_new_tokens=4, temperature=0.0)
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    first = np.argmax(np.asarray(model(prompts).logits[:, -1]), -1)
    np.testing.assert_array_equal(np.asarray(a.tokens[:, 0]), first)
