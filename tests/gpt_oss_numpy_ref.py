"""An independent float64 numpy implementation of the gpt-oss forward pass (Hugging Face math), on Hugging Face
tensor names, for one unpadded sequence. Used as the oracle of tests/test_gpt_oss.py.

Written from the model definition, not from jax_nvfp4.nn: per-head loops, YaRN frequencies from their formulas in
float64, the sink as an extra softmax column, experts one at a time with gate and up read from alternating columns,
MXFP4 experts decoded through ml_dtypes' E2M1.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np


def rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def yarn(cfg):
    """(inverse frequencies [D/2], attention factor) of the config's YaRN rope, in float64."""
    d, base = cfg["head_dim"], cfg["rope_theta"]
    rs = cfg["rope_scaling"]
    original = rs["original_max_position_embeddings"]
    factor = cfg["max_position_embeddings"] / original
    dim_of = lambda rot: d * math.log(original / (rot * 2 * math.pi)) / (2 * math.log(base))  # noqa: E731
    low, high = dim_of(rs["beta_fast"]), dim_of(rs["beta_slow"])
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    keep = 1 - np.clip((np.arange(d // 2) - low) / (high - low), 0, 1)  # 1: the original frequency
    freq = base ** (-np.arange(0, d, 2) / d)
    return freq / factor * (1 - keep) + freq * keep, 0.1 * math.log(factor) + 1


def rope(x, inv_freq, scale):
    """x ``[T, D]`` of one head; pairs (i, i + D/2) rotated by ``pos * inv_freq[i]``, cos and sin times ``scale``."""
    t, d = x.shape
    ang = np.arange(t)[:, None] * inv_freq[None, :]
    c, s = np.cos(ang) * scale, np.sin(ang) * scale
    a, b = x[:, : d // 2], x[:, d // 2:]
    return np.concatenate([a * c - b * s, b * c + a * s], axis=1)


def decode_mxfp4(blocks, scales):
    """float64 ``[..., N, K]`` of MXFP4 blocks ``[..., N, K/32, 16]`` (low nibble first) and E8M0 scales."""
    codes = np.stack([blocks & 15, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)
    vals = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    return (vals * np.exp2(scales.astype(np.float64) - 127)[..., None]).reshape(*blocks.shape[:-2], -1)


def hf_experts(w, layer):
    """(gate_up [E, H, 2I] (columns gate, up alternating), its bias [E, 2I], down [E, I, H], its bias [E, H]), float64,
    from bf16 stacked tensors or MXFP4 blocks (stored [E, N, K/32, 16]: transposed here)."""
    p = f"model.layers.{layer}.mlp.experts."
    out = []
    for proj in ("gate_up_proj", "down_proj"):
        if p + proj in w:
            m = np.asarray(w[p + proj]).astype(np.float64)
        else:
            m = decode_mxfp4(w[p + proj + "_blocks"], w[p + proj + "_scales"]).transpose(0, 2, 1)
        out += [m, np.asarray(w[p + proj + "_bias"]).astype(np.float64)]
    return tuple(out)


def forward(w, cfg, tokens, *, experts=None, force_ids=None):
    """Logits of one sequence.

    Parameters
    ----------
    w : dict of Hugging Face tensor name -> numpy array
    cfg : the Hugging Face config dict
    tokens : int ``[T]``
    experts : optional {layer: :func:`hf_experts`-style tuple}: these experts instead of the checkpoint's
    force_ids : optional int ``[L, T, k]``: use these experts instead of selecting; the weights are still the
        softmax of their router logits

    Returns
    -------
    (logits float64 ``[T, V]``, selected expert ids int ``[L, T, k]``, by descending logit)
    """
    f = {k: np.asarray(v).astype(np.float64) for k, v in w.items() if ".experts." not in k}
    n_h, n_kv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps, k_top, window = cfg["rms_norm_eps"], cfg["num_experts_per_tok"], cfg["sliding_window"]
    inv_freq, att_scale = yarn(cfg)
    t = len(tokens)
    x = f["model.embed_tokens.weight"][np.asarray(tokens)]
    i, j = np.arange(t)[:, None], np.arange(t)[None, :]
    all_ids = []
    for L in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{L}."
        allowed = j <= i
        if cfg["layer_types"][L] == "sliding_attention":
            allowed &= i - j < window
        h = rms_norm(x, f[p + "input_layernorm.weight"], eps)
        proj = {n: h @ f[p + f"self_attn.{n}_proj.weight"].T + f[p + f"self_attn.{n}_proj.bias"] for n in "qkv"}
        q, kk, v = proj["q"].reshape(t, n_h, d), proj["k"].reshape(t, n_kv, d), proj["v"].reshape(t, n_kv, d)
        heads = []
        for hh in range(n_h):
            g = hh // (n_h // n_kv)
            s = rope(q[:, hh], inv_freq, att_scale) @ rope(kk[:, g], inv_freq, att_scale).T / np.sqrt(d)
            s = np.concatenate([np.where(allowed, s, -np.inf), np.full((t, 1), f[p + "self_attn.sinks"][hh])], 1)
            a = np.exp(s - s.max(1, keepdims=True))
            heads.append((a / a.sum(1, keepdims=True))[:, :-1] @ v[:, g])
        x = x + np.concatenate(heads, axis=1) @ f[p + "self_attn.o_proj.weight"].T + f[p + "self_attn.o_proj.bias"]

        h = rms_norm(x, f[p + "post_attention_layernorm.weight"], eps)
        logits = h @ f[p + "mlp.router.weight"].T + f[p + "mlp.router.bias"]
        w_gu, b_gu, w_dn, b_dn = experts[L] if experts is not None else hf_experts(w, L)
        y = np.zeros_like(x)
        ids_layer = []
        for tt in range(t):
            ids = np.argsort(-logits[tt], kind="stable")[:k_top] if force_ids is None else np.asarray(force_ids[L][tt])
            top = logits[tt, ids]
            wts = np.exp(top - top.max())
            wts /= wts.sum()
            ids_layer.append(ids[np.argsort(-top, kind="stable")])
            for e, we in zip(ids, wts):
                gu = h[tt] @ w_gu[e] + b_gu[e]
                gate, up = np.minimum(gu[0::2], 7.0), np.clip(gu[1::2], -7.0, 7.0)
                glu = gate / (1 + np.exp(-1.702 * gate))
                y[tt] += we * (((up + 1) * glu) @ w_dn[e] + b_dn[e])
        all_ids.append(ids_layer)
        x = x + y
    x = rms_norm(x, f["model.norm.weight"], eps)
    head = f["model.embed_tokens.weight"] if cfg.get("tie_word_embeddings") else f["lm_head.weight"]
    return x @ head.T, np.asarray(all_ids)


def random_weights(cfg, seed=0, *, mxfp4=False):
    """Random Hugging Face tensors of a gpt-oss config: bf16, experts stacked (bf16, or MXFP4 blocks and scales)."""
    rng = np.random.default_rng(seed)
    bf16 = ml_dtypes.bfloat16
    h, n_h, n_kv, d = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    i, n_exp, v = cfg["intermediate_size"], cfg["num_local_experts"], cfg["vocab_size"]

    def lin(shape, fan_in, scale=1.0):
        return (rng.standard_normal(shape) * scale / np.sqrt(fan_in)).astype(bf16)

    def small(*shape):
        return (0.3 * rng.standard_normal(shape)).astype(bf16)

    def norm(n):
        return (1 + 0.1 * rng.standard_normal(n)).astype(bf16)

    w = {"model.embed_tokens.weight": rng.standard_normal((v, h)).astype(bf16), "model.norm.weight": norm(h)}
    if not cfg.get("tie_word_embeddings"):
        w["lm_head.weight"] = lin((v, h), h, 2.0)
    for L in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{L}."
        w[p + "input_layernorm.weight"] = norm(h)
        w[p + "post_attention_layernorm.weight"] = norm(h)
        for n, (o, k) in dict(q=(n_h * d, h), k=(n_kv * d, h), v=(n_kv * d, h), o=(h, n_h * d)).items():
            w[p + f"self_attn.{n}_proj.weight"] = lin((o, k), k)
            w[p + f"self_attn.{n}_proj.bias"] = small(o)
        w[p + "self_attn.sinks"] = (rng.standard_normal(n_h) + 1).astype(bf16)
        w[p + "mlp.router.weight"] = lin((n_exp, h), h, 3.0)  # spread-out router logits: few near-ties
        w[p + "mlp.router.bias"] = small(n_exp)
        q = p + "mlp.experts."
        for proj, (n, k) in (("gate_up_proj", (2 * i, h)), ("down_proj", (h, i))):
            if mxfp4:  # values of about 1 / sqrt(k): E8M0 scales 2^-6 .. 2^-4 on E2M1 codes
                w[q + proj + "_blocks"] = rng.integers(0, 256, (n_exp, n, k // 32, 16), dtype=np.uint8)
                w[q + proj + "_scales"] = rng.integers(121, 124, (n_exp, n, k // 32), dtype=np.uint8)
            else:
                w[q + proj] = lin((n_exp, k, n), k)  # [E, K, N]: used as x @ w
            w[q + proj + "_bias"] = small(n_exp, n)
    return w
