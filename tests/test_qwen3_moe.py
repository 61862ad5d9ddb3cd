"""The Qwen3-MoE model (jax_nvfp4.nn): against an independent numpy reference on small random weights
(bf16 and NVFP4 experts), Hugging Face checkpoint loading, the KV cache, left padding, generation
(greedy consistency, sampling, EOS, routing capture and replay) and quantization inside jit."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors

pytest.importorskip("flax")
from flax import nnx  # noqa: E402

import jax_nvfp4 as nv  # noqa: E402
from jax_nvfp4 import nn as nvnn  # noqa: E402
from jax_nvfp4.checkpoint import CheckpointError  # noqa: E402
import conftest  # noqa: E402
import qwen3_moe_numpy_ref as ref  # noqa: E402

HF_CONFIG = dict(model_type="qwen3_moe", vocab_size=256, hidden_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, moe_intermediate_size=32,
                 num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, rms_norm_eps=1e-6,
                 rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=False, mlp_only_layers=[],
                 decoder_sparse_step=1, attention_bias=False, rope_scaling=None, use_sliding_window=False)
T = 20


def write_hf(root, weights, config=HF_CONFIG):
    return conftest.write_hf(root, weights, config)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """(weights, bf16 checkpoint folder, converted NVFP4 checkpoint folder)."""
    w = ref.random_weights(HF_CONFIG, seed=0)
    root = tmp_path_factory.mktemp("qwen3")
    src = write_hf(root / "bf16", w)
    dst = root / "nvfp4"
    nv.convert_checkpoint(src, dst, progress=False)
    return w, src, dst


@pytest.fixture(scope="module")
def bf16_model(ckpt):
    return nvnn.load_qwen3_moe(ckpt[1])


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(1).integers(0, HF_CONFIG["vocab_size"], T)


def nvfp4_parts(dst):
    """Raw NVFP4 tensors of a converted checkpoint, by ``<module>.experts.N.<proj>`` (read with safetensors)."""
    raw = {}
    for f in dst.glob("*.safetensors"):
        for name, t in safetensors.deserialize(f.read_bytes()):
            dt = {"U8": np.uint8, "F8_E4M3": np.uint8, "F32": np.float32}.get(t["dtype"])
            if dt is not None and ".experts." in name:
                raw[name] = np.frombuffer(bytes(t["data"]), dt).reshape(t["shape"])
    parts = {}
    for name in raw:
        if name.endswith(".weight") and (name[: -len(".weight")] + ".weight_scale") in raw:
            p = name[: -len(".weight")]
            parts[p] = (raw[name], raw[p + ".weight_scale"], raw[p + ".weight_global_scale"])
    return parts


def assert_close_to_reference(model, w, toks, parts=None):
    """The model's expert choices equal the reference's own (random weights with spread-out router
    logits), and its logits are within bf16 tolerance of the float64 reference run with those choices
    (so that one near-tie flipped by rounding cannot fail the test)."""
    out = model(jnp.asarray(toks)[None], return_routing=True)
    got = np.asarray(out.logits[0], np.float64)
    ids = np.asarray(out.routing[:, 0])
    _, ref_ids = ref.forward(w, HF_CONFIG, toks, nvfp4_parts=parts)
    agree = np.mean([set(a) == set(b) for a, b in zip(ids.reshape(-1, 2), ref_ids.reshape(-1, 2))])
    assert agree >= 0.95, f"expert selections agree on only {agree:.0%} of (layer, token)"
    want, _ = ref.forward(w, HF_CONFIG, toks, nvfp4_parts=parts, force_ids=ids)
    err = np.abs(got - want)
    scale = np.std(want)
    assert err.max() < 0.06 * scale and err.mean() < 0.01 * scale, (err.max(), err.mean(), scale)
    assert np.mean(np.argmax(got, -1) == np.argmax(want, -1)) >= 0.9


# ------------------------------------------------------------------------------------------ config

def test_config_from_hf_and_presets(ckpt):
    c = nvnn.Qwen3MoeConfig.from_hf(ckpt[1])
    assert (c.hidden_size, c.num_experts, c.head_dim, c.routing) == (64, 8, 16, "renormalize_naive")
    assert nvnn.Qwen3MoeConfig.from_hf(dict(HF_CONFIG, norm_topk_prob=False)).routing == "softmax_topk"
    no_head_dim = {k: v for k, v in HF_CONFIG.items() if k != "head_dim"}
    assert nvnn.Qwen3MoeConfig.from_hf(no_head_dim).head_dim == 16
    big = nvnn.CONFIGS["qwen3-30b-a3b"]
    assert (big.hidden_size, big.num_hidden_layers, big.num_experts, big.num_experts_per_tok,
            big.moe_intermediate_size, big.num_key_value_heads, big.vocab_size) == (2048, 48, 128, 8, 768, 4, 151936)
    for bad, msg in ((dict(mlp_only_layers=[0]), "mlp_only_layers"), (dict(rope_scaling={"type": "yarn"}), "rope_scaling"),
                     (dict(model_type="llama"), "model_type")):
        with pytest.raises(ValueError, match=msg):
            nvnn.Qwen3MoeConfig.from_hf(dict(HF_CONFIG, **bad))
    with pytest.raises(ValueError, match="num_key_value_heads"):
        nvnn.Qwen3MoeConfig(num_attention_heads=6, num_key_value_heads=4)


def test_model_structure():
    """Module paths are the Hugging Face names (abstract models: no weights drawn)."""
    m = nnx.eval_shape(lambda: nvnn.Qwen3MoeForCausalLM(nvnn.CONFIGS["tiny"], rngs=nnx.Rngs(0)))
    assert list(nvnn.moe_modules(m)) == ["model.layers.0.mlp", "model.layers.1.mlp"]
    blk = m.model.layers[0].mlp
    assert blk.routing == "renormalize_naive" and blk.experts.gate_up.shape == (8, 64, 64)
    assert m.lm_head.kernel.shape == (64, 256) and m.model.embed_tokens.embedding.dtype == jnp.bfloat16
    paths = {".".join(map(str, p)) for p, v in nnx.iter_graph(m) if isinstance(v, nnx.Variable)}
    assert {"model.layers.1.self_attn.q_norm.weight", "model.layers.0.post_attention_layernorm.weight",
            "model.layers.0.mlp.router.kernel", "model.norm.weight", "lm_head.kernel"} <= paths
    tied = nvnn.Qwen3MoeForCausalLM(nvnn.CONFIGS["tiny"].replace(tie_word_embeddings=True, num_hidden_layers=1),
                                    rngs=nnx.Rngs(0))
    assert tied.lm_head is None
    h = jnp.ones((2, 64), jnp.bfloat16)
    np.testing.assert_allclose(tied.logits(h), h.astype(jnp.float32) @ tied.model.embed_tokens.embedding[...].T.astype(
        jnp.float32), rtol=1e-5)


# ------------------------------------------------------------------------------------------ reference

def test_bf16_checkpoint_matches_numpy_reference(ckpt, bf16_model, tokens):
    assert_close_to_reference(bf16_model, ckpt[0], tokens)


def test_nvfp4_checkpoint_matches_reference_and_online_quantization(ckpt, bf16_model, tokens):
    w, src, dst = ckpt
    loaded = nvnn.load_qwen3_moe(dst)
    blk = loaded.model.layers[1].mlp
    assert blk.quantized and blk.mode == "w4a16"
    assert_close_to_reference(loaded, w, tokens, parts=nvfp4_parts(dst))
    # the same bytes as quantizing the live bf16 model, or quantizing while loading
    online = nvnn.quantize_moe(bf16_model)
    on_load = nvnn.load_qwen3_moe(src, quantize=True)
    for other in (online, on_load):
        for a, b in zip(jax.tree.leaves(nnx.state(loaded, nvnn.QuantizedWeight)),
                        jax.tree.leaves(nnx.state(other, nvnn.QuantizedWeight))):
            assert a.dtype == b.dtype and np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    toks = jnp.asarray(tokens)[None]
    np.testing.assert_array_equal(loaded(toks).logits, online(toks).logits)


def test_load_ignore_and_errors(ckpt, tmp_path):
    w, src, _ = ckpt
    m = nvnn.load_qwen3_moe(src, quantize=True, ignore=["layers.0.mlp"])
    assert not m.model.layers[0].mlp.quantized and m.model.layers[1].mlp.quantized
    # a converted checkpoint with an ignored module loads it in bf16
    dst = tmp_path / "partial"
    nv.convert_checkpoint(src, dst, ignore=["model.layers.1.mlp"], progress=False)
    p = nvnn.load_qwen3_moe(dst)
    assert p.model.layers[0].mlp.quantized and not p.model.layers[1].mlp.quantized
    np.testing.assert_array_equal(np.asarray(p.model.layers[1].mlp.experts.down[...][3]),
                                  w["model.layers.1.mlp.experts.3.down_proj.weight"])
    with pytest.raises(ValueError, match="already an NVFP4"):
        nvnn.load_qwen3_moe(dst, quantize=True)
    with pytest.raises(FileNotFoundError, match="checkpoint not found"):  # not the parent's checkpoint
        nvnn.load_qwen3_moe(dst / "typo")
    blocked = nvnn.load_qwen3_moe(dst, order="blocked")  # H = 64, I = 32: zero-padded to 128, the same model
    assert blocked.model.layers[0].mlp.experts.experts().valid_sizes == (64, 32)
    tokens = jnp.arange(12, dtype=jnp.int32).reshape(2, 6) % 256
    got, want = np.asarray(blocked(tokens).logits), np.asarray(p(tokens).logits)
    if jax.devices()[0].platform == "cpu":
        np.testing.assert_array_equal(got, want)
    else:  # p's experts are rows there: other kernels, other sums, whose bf16 roundings two layers spread (H100:
        # 9 of 3072 logits off by 2-3% of their spread)
        err = np.abs(got - want)
        assert err.max() < 0.1 * np.std(want) and err.mean() < 0.005 * np.std(want), (err.max(), err.mean())
    with pytest.raises(ValueError, match="order must be one of"):
        nvnn.load_qwen3_moe(dst, order="columns")
    with pytest.raises(ValueError, match="ignore and recipe"):
        nvnn.load_qwen3_moe(src, ignore=["x"])
    missing = dict(w)
    del missing["model.layers.1.self_attn.k_norm.weight"]
    with pytest.raises(CheckpointError, match="k_norm.weight"):
        nvnn.load_qwen3_moe(write_hf(tmp_path / "missing", missing))
    bad = dict(w, **{"model.layers.0.self_attn.q_proj.weight": w["model.layers.0.self_attn.q_proj.weight"][:8]})
    with pytest.raises(CheckpointError, match="q_proj.weight.*shape"):
        nvnn.load_qwen3_moe(write_hf(tmp_path / "bad", bad))
    extra = dict(w, **{"model.rotary_emb.inv_freq": np.zeros(8, np.float32)})
    with pytest.warns(UserWarning, match="not used"):
        nvnn.load_qwen3_moe(write_hf(tmp_path / "extra", extra))


# ------------------------------------------------------------------------------------------ generation
# Tests share shapes and static arguments where they can: on the CPU, compiling dominates their time.

forward = nnx.jit(lambda m, toks, mask: m(toks, attention_mask=mask, return_routing=True))
N_GREEDY = 7


@pytest.fixture(scope="module")
def prompts():
    """Left-padded prompts: tokens int32 [3, 6], mask (row 1 has 2 pads, row 2 one)."""
    rng = np.random.default_rng(3)
    toks = jnp.asarray(rng.integers(0, 256, (3, 6)), jnp.int32)
    mask = jnp.asarray([[True] * 6, [False] * 2 + [True] * 4, [False] + [True] * 5])
    return jnp.where(mask, toks, 0), mask


@pytest.fixture(scope="module")
def greedy(bf16_model, prompts):
    toks, mask = prompts
    g = nvnn.generate(bf16_model, toks, prompt_mask=mask, key=jax.random.key(0), max_new_tokens=N_GREEDY,
                      temperature=0.0, return_routing=True)
    return g, jnp.concatenate([toks, g.tokens], axis=1), jnp.concatenate([mask, g.mask], axis=1)


def test_greedy_generation_matches_teacher_forcing(bf16_model, greedy):
    """The KV-cache decode loop agrees with one forward pass over the generated sequences: each greedy
    token is the argmax of the teacher-forced logits, log-probabilities and expert choices agree."""
    g, seq, smask = greedy
    assert g.tokens.shape == (3, N_GREEDY) and bool(g.mask.all()) and g.routing.shape == (2, 3, 6 + N_GREEDY, 2)
    full = forward(bf16_model, seq, smask)
    np.testing.assert_array_equal(jnp.argmax(full.logits[:, 5:-1], -1), g.tokens)
    lp = nvnn.sequence_logprobs(bf16_model, seq, attention_mask=smask, chunk=5)  # 12 positions: 3 chunks
    assert lp.shape == (3, 5 + N_GREEDY) and bool(jnp.all(lp[:, :4][~smask[:, 1:5]] == 0))
    np.testing.assert_allclose(lp[:, 5:], g.logprobs, atol=0.02)
    np.testing.assert_allclose(lp[:, 5:], jax.nn.log_softmax(full.logits[:, 5:-1])[
        jnp.arange(3)[:, None], jnp.arange(N_GREEDY)[None], g.tokens], atol=1e-5)
    live = np.asarray(smask)
    np.testing.assert_array_equal(np.asarray(g.routing)[:, live], np.asarray(full.routing)[:, live])


def test_prompts_are_checked(bf16_model, prompts):
    """Concrete prompts: ids outside the vocabulary (masked padding may hold any) and right-padded masks are
    refused, not turned into NaN log-probabilities or continuations of a pad."""
    toks, mask = prompts
    v = HF_CONFIG["vocab_size"]
    run = lambda t, m: nvnn.generate(bf16_model, t, prompt_mask=m, key=jax.random.key(0), max_new_tokens=1)
    with pytest.raises(ValueError, match=rf"prompt_tokens must be ids in \[0, vocab_size={v}\).*got {v}"):
        run(toks.at[0, 3].set(v), mask)
    with pytest.raises(ValueError, match="got -1"):
        run(toks.at[2, 5].set(-1), mask)
    with pytest.raises(ValueError, match="prompt_mask must be left-padded"):
        run(toks, mask[:, ::-1])
    with pytest.raises(ValueError, match=r"tokens must be ids in \[0, vocab_size"):
        nvnn.sequence_logprobs(bf16_model, toks.at[1, 4].set(v), attention_mask=mask)
    assert run(jnp.where(mask, toks, v + 7), mask).tokens.shape == (3, 1)  # padding is never read
    with pytest.raises(ValueError, match=f"got {v}"):  # numpy inputs are checked on the host; 0/1 masks
        run(np.asarray(toks.at[2, 3].set(v)), np.asarray(mask, np.int32))
    with pytest.raises(ValueError, match=f"got {v}"):
        run(toks.at[2, 3].set(v), mask.astype(jnp.float32))
    want = run(toks, mask).tokens  # narrow id types compare in int32 (uint8's 255 < vocab 256, not a wrap)
    np.testing.assert_array_equal(run(toks.astype(jnp.uint8), mask.astype(jnp.int32)).tokens, want)
    np.testing.assert_array_equal(run(np.asarray(toks, np.uint8), np.asarray(mask)).tokens, want)
    right = nvnn.sequence_logprobs(bf16_model, toks[:, ::-1], attention_mask=mask[:, ::-1])  # scoring: any mask
    assert bool(jnp.all(jnp.isfinite(right)))


def test_sequence_logprobs_in_passes(bf16_model, greedy):
    """batch_chunk scores the batch in passes of that many sequences (padding rows dropped): the log-probabilities
    of one pass, also with routing replay, and a pass's memory that of its sequences only."""
    g, seq, smask = greedy
    whole = nvnn.sequence_logprobs(bf16_model, seq, attention_mask=smask, batch_chunk=3)
    replay = nvnn.sequence_logprobs(bf16_model, seq, attention_mask=smask, topk_ids=g.routing, batch_chunk=3)
    for bc in (1, 2):  # (2: one padding row)
        got = nvnn.sequence_logprobs(bf16_model, seq, attention_mask=smask, batch_chunk=bc)
        assert got.shape == whole.shape
        np.testing.assert_allclose(got, whole, atol=1e-5)
        np.testing.assert_allclose(nvnn.sequence_logprobs(bf16_model, seq, attention_mask=smask, topk_ids=g.routing,
                                                          batch_chunk=bc), replay, atol=1e-5)
    with pytest.raises(ValueError, match="batch_chunk must be an int >= 1"):
        nvnn.sequence_logprobs(bf16_model, seq, attention_mask=smask, batch_chunk=0)
    from jax_nvfp4.nn import generation
    graphdef, state = nnx.split(bf16_model)
    big = jnp.zeros((32, 64), jnp.int32)

    def temp(bc):  # compiled temporary memory of one call
        return generation._sequence_logprobs.lower(graphdef, state, big, big > -1, None, temperature=1.0, chunk=8,
                                                   batch_chunk=bc).compile().memory_analysis().temp_size_in_bytes
    assert temp(4) < temp(32) / 3


def test_left_padding_does_not_leak(bf16_model, greedy):
    """Real tokens see the same logits whether the padding is on the left or (masked) on the right."""
    _, seq, smask = greedy
    n_pad = 2  # row 1
    right = jnp.concatenate([seq[1, n_pad:], jnp.full((n_pad,), 9, jnp.int32)])
    rmask = jnp.arange(seq.shape[1]) < seq.shape[1] - n_pad
    got = forward(bf16_model, seq.at[1].set(right), smask.at[1].set(rmask)).logits[1, : -n_pad]
    want = forward(bf16_model, seq, smask).logits[1, n_pad:]
    np.testing.assert_allclose(got, want, atol=0.02 * float(jnp.std(want)))


def test_sample_logits():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]] * 2000))
    keys = jax.random.key(0)
    tok, lp = nvnn.sample_logits(keys, logits, temperature=1.0, top_p=0.7)
    assert set(np.asarray(tok).tolist()) == {0, 1}  # the nucleus: 0.5 + 0.3 >= 0.7
    np.testing.assert_allclose(lp, jnp.log(jnp.where(tok == 0, 0.5, 0.3)), rtol=1e-5)
    assert 0.55 < float(jnp.mean(tok == 0)) < 0.70  # 0.5 / 0.8
    tok, _ = nvnn.sample_logits(keys, logits, temperature=1.0, top_p=1e-6)
    assert bool(jnp.all(tok == 0))
    tok, lp = nvnn.sample_logits(keys, logits, temperature=0.0)
    assert bool(jnp.all(tok == 0)) and np.allclose(lp, np.log(0.5))
    tok, lp = nvnn.sample_logits(keys, logits, temperature=2.0)
    np.testing.assert_allclose(lp, jax.nn.log_softmax(logits / 2.0)[jnp.arange(2000), tok], rtol=1e-6)


def test_sampling_eos_and_determinism(bf16_model, prompts):
    toks, mask = prompts
    run = lambda seed, **kw: nvnn.generate(bf16_model, toks, prompt_mask=mask, key=jax.random.key(seed),  # noqa: E731
                                           max_new_tokens=12, temperature=1.0, top_p=0.9, **kw)
    a, b, c = run(1), run(1), run(2)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert not np.array_equal(a.tokens, c.tokens)
    assert bool(jnp.all(a.logprobs <= 0)) and bool(jnp.all(a.logprobs > -20))
    # stop at the token row 0 emits third: rows stop at its first occurrence, the loop when all have
    eos = int(a.tokens[0, 2])
    e = run(1, eos_id=eos, pad_id=-1)
    for r in range(3):
        row = np.asarray(a.tokens[r]).tolist()
        stop = row.index(eos) + 1 if eos in row else 12
        assert np.asarray(e.mask[r]).tolist() == [True] * stop + [False] * (12 - stop)
        np.testing.assert_array_equal(e.tokens[r, :stop], a.tokens[r, :stop])
        assert bool(jnp.all(e.tokens[r, stop:] == -1)) and bool(jnp.all(e.logprobs[r, stop:] == 0))
    with pytest.raises(ValueError, match="top_p"):
        nvnn.generate(bf16_model, toks, key=jax.random.key(0), max_new_tokens=2, top_p=0.0)
    with pytest.raises(ValueError, match="prompt_mask"):
        nvnn.generate(bf16_model, toks, prompt_mask=mask[:, :3], key=jax.random.key(0), max_new_tokens=2)


QUANT_ROLLOUT = dict(max_new_tokens=N_GREEDY, return_routing=True)  # shared by the two tests below


def test_routing_replay(bf16_model, prompts, greedy):
    """Scoring with replayed expert ids: the policy's own routing reproduces its plain scores exactly; a
    quantized rollout's routing replays into the bf16 policy."""
    toks, mask = prompts
    _, seq, smask = greedy
    own = forward(bf16_model, seq, smask).routing
    plain = nvnn.sequence_logprobs(bf16_model, seq, attention_mask=smask, chunk=5)
    np.testing.assert_array_equal(nvnn.sequence_logprobs(bf16_model, seq, attention_mask=smask, topk_ids=own, chunk=5),
                                  plain)
    q = nvnn.quantize_moe(bf16_model)
    g = nvnn.generate(q, toks, prompt_mask=mask, key=jax.random.key(3), **QUANT_ROLLOUT)
    qseq = jnp.concatenate([toks, g.tokens], axis=1)
    qmask = jnp.concatenate([mask, g.mask], axis=1)
    replayed = nvnn.sequence_logprobs(bf16_model, qseq, attention_mask=qmask, topk_ids=g.routing, chunk=5)
    assert replayed.shape == plain.shape and bool(jnp.all(jnp.isfinite(replayed)))
    # the arguments named as sequence_logprobs calls them; replayed routing of the blocks' top_k, integer ids
    with pytest.raises(ValueError, match="attention_mask must have tokens' shape"):
        nvnn.sequence_logprobs(bf16_model, seq, attention_mask=smask[:, :3])
    with pytest.raises(ValueError, match=r"topk_ids must be \[layers, B, T, num_experts_per_tok\]"):
        nvnn.sequence_logprobs(bf16_model, seq, attention_mask=smask, topk_ids=own[..., :1])
    with pytest.raises(TypeError, match="topk_ids must be integer"):
        nvnn.sequence_logprobs(bf16_model, seq, attention_mask=smask, topk_ids=own.astype(jnp.float32))
    with pytest.raises(ValueError, match="topk_ids"):
        bf16_model(seq, topk_ids=g.routing[:1])


def test_quantize_and_generate_inside_one_jit(bf16_model, prompts):
    """An RL step: merge the bf16 policy, quantize its experts and roll out, all in one jax.jit."""
    toks, mask = prompts
    graphdef, state = nnx.split(bf16_model)

    @jax.jit
    def rollout(state, key):
        policy = nnx.merge(graphdef, state)
        return nvnn.generate(nvnn.quantize_moe(policy), toks, prompt_mask=mask, key=key, **QUANT_ROLLOUT)

    got = rollout(state, jax.random.key(4))
    want = nvnn.generate(nvnn.quantize_moe(bf16_model), toks, prompt_mask=mask, key=jax.random.key(4), **QUANT_ROLLOUT)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.routing, want.routing)
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)


def test_rl_rollout_example_runs(tmp_path):
    """examples/rl_rollout.py end to end on a tiny configuration (two iterations: update, requantize)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "rl_rollout.py"
    spec = importlib.util.spec_from_file_location("rl_rollout_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    out = example.main(["--iters", "2", "--batch", "2", "--prompt-len", "4", "--new-tokens", "4", "--modes",
                        "bf16,w4a16", "--no-progress", "--json", str(tmp_path / "rl.json")])
    assert json.loads((tmp_path / "rl.json").read_text())["results"] == out["results"]
    rows = {r["mode"]: r for r in out["results"]}
    assert set(rows) == {"bf16", "w4a16"} and all(r["tokens_per_s"] > 0 for r in rows.values())
    assert rows["w4a16"]["mean_abs_dlogp"] > rows["bf16"]["mean_abs_dlogp"] >= 0


def test_rl_rollout_example_splits_the_experts_over_devices():
    """--expert-parallel 2 on two CPU devices: the same rollouts as on one (tokens; mismatch within 25%, the expert
    sums differing in their last bits)."""
    from pathlib import Path
    from conftest import run_on_cpu_devices
    example = Path(__file__).resolve().parents[1] / "examples" / "rl_rollout.py"
    run_on_cpu_devices(f"EXAMPLE = {str(example)!r}\n" + _RL_EP)


_RL_EP = """import importlib.util, pathlib
import numpy as np
path = pathlib.Path(EXAMPLE)
spec = importlib.util.spec_from_file_location("rl_rollout_example", path)
example = importlib.util.module_from_spec(spec); spec.loader.exec_module(example)
common = ["--iters", "2", "--batch", "2", "--prompt-len", "4", "--new-tokens", "4", "--modes", "w4a16,w4a4",
          "--no-progress", "--temperature", "0"]
one = {r["mode"]: r for r in example.main(common)["results"]}
out = example.main(common + ["--expert-parallel", "2"])
two = {r["mode"]: r for r in out["results"]}
assert out["expert_parallel"] == 2 and set(two) == {"w4a16", "w4a4"}
for m in two:  # the same rollouts but for the last bits of the expert sums
    assert two[m]["tokens_per_s"] > 0 and two[m]["generated_tokens"] == one[m]["generated_tokens"]
    assert abs(two[m]["mean_abs_dlogp"] - one[m]["mean_abs_dlogp"]) <= 0.25 * one[m]["mean_abs_dlogp"] + 1e-3, (m, one[m], two[m])
print("ok")
"""
