"""An independent float64 numpy implementation of the Qwen3-MoE forward pass (Hugging Face math), on
Hugging Face tensor names, for one unpadded sequence. Used as the oracle of tests/test_qwen3_moe.py.

Written from the model definition, not from jax_nvfp4.nn: per-head loops, rotary as explicit
(cos, sin) pair rotations, experts one at a time, NVFP4 weights decoded from the code table.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float64)


def decode_nvfp4(data, scales, global_scale):
    """uint8 ``[R, K/2]`` (low nibble first), e4m3 ``[R, K/16]``, float32 ``[]`` -> float64 ``[R, K]``."""
    data = np.asarray(data)
    codes = np.stack([data & 0xF, data >> 4], axis=-1).reshape(data.shape[0], -1)
    s = np.asarray(scales).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return E2M1[codes] * np.repeat(s, 16, axis=1) * np.float64(global_scale)


def rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x, theta):
    """x ``[T, D]`` of one head; pairs (i, i + D/2) rotated by ``pos * theta^(-2i/D)``."""
    t, d = x.shape
    ang = np.arange(t)[:, None] * theta ** (-np.arange(d // 2) * 2.0 / d)[None, :]
    c, s = np.cos(ang), np.sin(ang)
    a, b = x[:, : d // 2], x[:, d // 2:]
    return np.concatenate([a * c - b * s, b * c + a * s], axis=1)


def silu(v):
    return v / (1 + np.exp(-v))


def expert_weights(w, layer, e, nvfp4_parts=None):
    """(gate [I, H], up [I, H], down [H, I]) float64 of one expert, from bf16 tensors or NVFP4 parts."""
    p = f"model.layers.{layer}.mlp.experts.{e}"
    if nvfp4_parts is None:
        return tuple(w[f"{p}.{n}_proj.weight"].astype(np.float64) for n in ("gate", "up", "down"))
    gu = decode_nvfp4(*nvfp4_parts[f"{p}.gate_up_proj"])
    i = gu.shape[0] // 2
    return gu[:i], gu[i:], decode_nvfp4(*nvfp4_parts[f"{p}.down_proj"])


def forward(w, cfg, tokens, *, nvfp4_parts=None, force_ids=None):
    """Logits of one sequence.

    Parameters
    ----------
    w : dict of Hugging Face tensor name -> numpy array (bf16 / f32)
    cfg : the Hugging Face config dict
    tokens : int ``[T]``
    nvfp4_parts : optional dict ``"<module>.experts.N.<gate_up|down>_proj" -> (data, scales, global)``:
        decode these instead of the bf16 expert weights
    force_ids : optional int ``[L, T, k]``: use these experts (as sets) instead of selecting; the
        weights are still this reference's own softmax / renormalization at those ids

    Returns
    -------
    (logits float64 ``[T, V]``, selected expert ids int ``[L, T, k]``, sorted by descending weight)
    """
    f = {k: np.asarray(v).astype(np.float64) for k, v in w.items() if ".experts." not in k}
    n_h, n_kv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps, theta, k_top = cfg["rms_norm_eps"], cfg["rope_theta"], cfg["num_experts_per_tok"]
    n_exp = cfg["num_experts"]
    t = len(tokens)
    x = f["model.embed_tokens.weight"][np.asarray(tokens)]
    causal = np.tril(np.ones((t, t), bool))
    all_ids = []
    for L in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{L}."
        h = rms_norm(x, f[p + "input_layernorm.weight"], eps)
        q = (h @ f[p + "self_attn.q_proj.weight"].T).reshape(t, n_h, d)
        kk = (h @ f[p + "self_attn.k_proj.weight"].T).reshape(t, n_kv, d)
        v = (h @ f[p + "self_attn.v_proj.weight"].T).reshape(t, n_kv, d)
        heads = []
        for hh in range(n_h):
            g = hh // (n_h // n_kv)
            qh = rope(rms_norm(q[:, hh], f[p + "self_attn.q_norm.weight"], eps), theta)
            kh = rope(rms_norm(kk[:, g], f[p + "self_attn.k_norm.weight"], eps), theta)
            s = np.where(causal, qh @ kh.T / np.sqrt(d), -np.inf)
            a = np.exp(s - s.max(1, keepdims=True))
            heads.append((a / a.sum(1, keepdims=True)) @ v[:, g])
        x = x + np.concatenate(heads, axis=1) @ f[p + "self_attn.o_proj.weight"].T

        h = rms_norm(x, f[p + "post_attention_layernorm.weight"], eps)
        logits = h @ f[p + "mlp.gate.weight"].T
        prob = np.exp(logits - logits.max(1, keepdims=True))
        prob /= prob.sum(1, keepdims=True)
        y = np.zeros_like(x)
        ids_layer = []
        experts = [expert_weights(w, L, e, nvfp4_parts) for e in range(n_exp)]
        for tt in range(t):
            ids = np.argsort(-prob[tt], kind="stable")[:k_top] if force_ids is None else np.asarray(force_ids[L][tt])
            wts = prob[tt, ids]
            if cfg["norm_topk_prob"]:
                wts = wts / wts.sum()
            order = np.argsort(-wts, kind="stable")
            ids_layer.append(ids[order])
            for e, we in zip(ids, wts):
                gate, up, down = experts[e]
                y[tt] += we * (down @ (silu(gate @ h[tt]) * (up @ h[tt])))
        all_ids.append(ids_layer)
        x = x + y
    x = rms_norm(x, f["model.norm.weight"], eps)
    head = f["model.embed_tokens.weight"] if cfg.get("tie_word_embeddings") else f["lm_head.weight"]
    return x @ head.T, np.asarray(all_ids)


def random_weights(cfg, seed=0):
    """Random bf16 Hugging Face tensors of a Qwen3-MoE config (norm weights around 1)."""
    rng = np.random.default_rng(seed)
    bf16 = ml_dtypes.bfloat16
    h, n_h, n_kv, d = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    i, n_exp, v = cfg["moe_intermediate_size"], cfg["num_experts"], cfg["vocab_size"]

    def lin(out, inp, scale=1.0):
        return (rng.standard_normal((out, inp)) * scale / np.sqrt(inp)).astype(bf16)

    def norm(n):
        return (1 + 0.1 * rng.standard_normal(n)).astype(bf16)

    w = {"model.embed_tokens.weight": rng.standard_normal((v, h)).astype(bf16), "model.norm.weight": norm(h)}
    if not cfg.get("tie_word_embeddings"):
        w["lm_head.weight"] = lin(v, h, 2.0)
    for L in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{L}."
        w[p + "input_layernorm.weight"] = norm(h)
        w[p + "post_attention_layernorm.weight"] = norm(h)
        w[p + "self_attn.q_proj.weight"] = lin(n_h * d, h)
        w[p + "self_attn.k_proj.weight"] = lin(n_kv * d, h)
        w[p + "self_attn.v_proj.weight"] = lin(n_kv * d, h)
        w[p + "self_attn.o_proj.weight"] = lin(h, n_h * d)
        w[p + "self_attn.q_norm.weight"] = norm(d)
        w[p + "self_attn.k_norm.weight"] = norm(d)
        w[p + "mlp.gate.weight"] = lin(n_exp, h, 3.0)  # spread-out router logits: few near-ties
        for e in range(n_exp):
            q = f"{p}mlp.experts.{e}."
            w[q + "gate_proj.weight"] = lin(i, h)
            w[q + "up_proj.weight"] = lin(i, h)
            w[q + "down_proj.weight"] = lin(h, i)
    return w
