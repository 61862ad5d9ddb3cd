"""What the decoder models of :mod:`jax_nvfp4.nn` share: RMSNorm, rotary embeddings, the KV cache, grouped-query
attention over it (optionally with a sliding window and attention sinks), and the causal-LM forward pass.

Activations are bfloat16; matmuls accumulate in float32; attention softmax, router and logits are float32. The
attention runs over a :class:`KVCache` (prefill and decode) or, without one, causally over the given tokens
(scoring); either way a key mask supports left-padded batches.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from flax import nnx

BF16 = jnp.bfloat16


def check_config(config, num_experts: int) -> None:
    """What every decoder config must hold: whole KV head groups, an even head_dim, 1 <= top-k <= experts."""
    c = config
    if c.num_attention_heads % c.num_key_value_heads:
        raise ValueError(f"num_attention_heads={c.num_attention_heads} must be a multiple of "
                         f"num_key_value_heads={c.num_key_value_heads}")
    if c.head_dim % 2:
        raise ValueError(f"head_dim must be even (rotary pairs), got {c.head_dim}")
    if not 1 <= c.num_experts_per_tok <= num_experts:
        raise ValueError(f"num_experts_per_tok must be in [1, {num_experts} experts], got {c.num_experts_per_tok}")


def hf_config(config, model_type: str) -> dict:
    """A Hugging Face config (a dict, a ``config.json`` path, or a checkpoint folder) as a dict, refused unless its
    ``model_type`` (when given) is ``model_type``."""
    if not isinstance(config, dict):
        path = Path(config)
        config = json.loads((path / "config.json" if path.is_dir() else path).read_text())
    mt = config.get("model_type")
    if mt not in (None, model_type):
        raise ValueError(f"config model_type is {mt!r}, not {model_type!r}")
    return config


def hf_fields(cls, config: dict) -> dict:
    """The fields of the config dataclass ``cls`` that ``config`` gives (not the jax_nvfp4 options ``moe_backend``,
    ``param_dtype``), with ``head_dim`` defaulted to ``hidden_size / num_attention_heads``."""
    fields = {f.name for f in dataclasses.fields(cls)}
    kw = {k: v for k, v in config.items() if k in fields and k not in ("moe_backend", "param_dtype")}
    if kw.get("head_dim") is None:
        kw["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    return kw


class RMSNorm(nnx.Module):
    """Hugging Face RMSNorm: ``weight * bf16(x / sqrt(mean(x^2) + eps))`` with the norm in float32 (Llama, Qwen3),
    or with ``scale_in_float32`` ``bf16(weight * x / sqrt(...))``, scaled before the one rounding (gpt-oss).

    Attributes
    ----------
    weight : nnx.Param ``[dim]``
    """

    def __init__(self, dim: int, eps: float, param_dtype=BF16, *, scale_in_float32: bool = False):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps
        self.scale_in_float32 = scale_in_float32

    def __call__(self, x):
        """``x [..., dim]`` -> same shape and dtype."""
        xf = x.astype(jnp.float32)
        y = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        if self.scale_in_float32:
            return (self.weight[...].astype(jnp.float32) * y).astype(x.dtype)
        return (self.weight[...].astype(x.dtype) * y.astype(x.dtype)).astype(x.dtype)


def rotary(x, positions, theta, *, scale: float = 1.0):
    """Rotary embedding, Hugging Face's ``rotate_half`` convention (first half paired with second).

    Parameters
    ----------
    x : ``[B, T, N, D]``
    positions : int ``[B, T]``
    theta : float rope base, or float32 inverse frequencies ``[D/2]`` (e.g. :func:`yarn_frequencies`)
    scale : multiplies cos and sin (YaRN's attention factor)

    Returns
    -------
    ``[B, T, N, D]`` in ``x.dtype`` (computed in float32).
    """
    d = x.shape[-1]
    if isinstance(theta, (int, float)):
        theta = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(theta, jnp.float32)  # [B, T, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    xf = x.astype(jnp.float32)
    rot = jnp.concatenate([-xf[..., d // 2:], xf[..., : d // 2]], axis=-1)
    return (xf * (jnp.cos(emb) * scale) + rot * (jnp.sin(emb) * scale)).astype(x.dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Keys and values of every layer for ``S`` slots (a pytree; pass it through ``jit``/loops).

    Attributes
    ----------
    keys, values : tuple of bf16 ``[B, S, num_key_value_heads, head_dim]``, one per layer
        (post-norm, post-rotary keys).
    mask : bool ``[B, S]``
        Slots holding real tokens (False: empty, or left padding).
    index : int32 ``[]``
        Next slot to write; every sequence of the batch advances together.
    """

    keys: tuple
    values: tuple
    mask: Any
    index: Any

    @classmethod
    def create(cls, config, batch: int, max_len: int, dtype=BF16) -> "KVCache":
        """An empty cache of ``max_len`` slots (``config``: ``num_hidden_layers``, ``num_key_value_heads``,
        ``head_dim``)."""
        shape = (batch, max_len, config.num_key_value_heads, config.head_dim)
        zeros = tuple(jnp.zeros(shape, dtype) for _ in range(config.num_hidden_layers))
        return cls(zeros, tuple(jnp.zeros(shape, dtype) for _ in range(config.num_hidden_layers)),
                   jnp.zeros((batch, max_len), bool), jnp.zeros((), jnp.int32))

    @property
    def max_len(self) -> int:
        return self.mask.shape[1]


def attend(q, k, v, key_mask, kv=None, index=None, *, window: int | None = None, sinks=None):
    """Grouped-query attention of new tokens over the cache (or, without one, over themselves), causal by slot.

    Parameters
    ----------
    q : ``[B, T, N, D]``; k, v : ``[B, T, KV, D]`` (post-rotary), N a multiple of KV
    key_mask : bool ``[B, S]`` keys that hold real tokens (``S = T`` without a cache)
    kv : optional (keys, values) bf16 ``[B, S, KV, D]`` of this layer; ``k``, ``v`` are written at slots
        ``[index, index + T)``
    index : int32 ``[]`` (with ``kv``)
    window : optional int: a query sees only the keys of the last ``window`` slots, its own included (a sliding
        window; left padding sits before a sequence's tokens, so slots count its tokens)
    sinks : optional float ``[N]``: a logit per head that joins every softmax and takes its share of the mass,
        attending to nothing (gpt-oss)

    Returns
    -------
    (bf16 ``[B, T, N * D]``, (keys, values): updated, or ``(k, v)`` without a cache)
    """
    b, t, n, d = q.shape
    nkv = k.shape[2]
    if kv is None:
        keys, values, q_slot = k, v, jnp.arange(t)
    else:
        keys = lax.dynamic_update_slice(kv[0], k.astype(kv[0].dtype), (0, index, 0, 0))
        values = lax.dynamic_update_slice(kv[1], v.astype(kv[1].dtype), (0, index, 0, 0))
        q_slot = index + jnp.arange(t)
    k_slot = jnp.arange(keys.shape[1])
    allowed = k_slot[None, :] <= q_slot[:, None]  # [T, S]
    if window is not None:
        allowed &= k_slot[None, :] > q_slot[:, None] - window
    # A query always sees its own slot, so rows of padding never softmax over nothing.
    allowed = allowed[None] & (key_mask[:, None, :] | (k_slot[None, :] == q_slot[:, None])[None])  # [B, T, S]
    qg = q.reshape(b, t, nkv, n // nkv, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, keys, preferred_element_type=jnp.float32) * d ** -0.5
    scores = jnp.where(allowed[:, None, None], scores, jnp.finfo(jnp.float32).min)
    if sinks is None:
        probs = jax.nn.softmax(scores, axis=-1)
    else:  # softmax over [scores, sink], the sink's column dropped
        sink = jnp.asarray(sinks, jnp.float32).reshape(1, nkv, n // nkv, 1, 1)
        top = jnp.maximum(jnp.max(scores, axis=-1, keepdims=True), sink)
        e = jnp.exp(scores - top)
        probs = e / (jnp.sum(e, axis=-1, keepdims=True) + jnp.exp(sink - top))
    out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(values.dtype), values, preferred_element_type=jnp.float32)
    return out.astype(BF16).reshape(b, t, n * d), (keys, values)


class CausalLMOutput(NamedTuple):
    """Output of a :class:`CausalLM` (:class:`~jax_nvfp4.nn.Qwen3MoeForCausalLM`, ...).

    logits : float32 ``[B, T, V]`` (``[B, 1, V]`` with ``last_only``)
    cache : the updated :class:`KVCache`, or None
    routing : int32 ``[L, B, T, k]`` expert ids of every layer (``return_routing``), or None
    """

    logits: Any
    cache: Any = None
    routing: Any = None


class DecoderOutput(NamedTuple):
    """Output of :meth:`CausalLM.hidden_states`: as :class:`CausalLMOutput` with the
    final-norm hidden states bf16 ``[B, T, H]`` in place of the logits."""

    hidden: Any
    cache: Any = None
    routing: Any = None


class DecoderLayer(nnx.Module):
    """``x + attn(norm(x))``, then ``x + moe(norm(x))``: a subclass sets ``input_layernorm``, ``self_attn``,
    ``post_attention_layernorm`` and ``mlp`` (a :class:`jax_nvfp4.nn.MoE`)."""

    def __call__(self, x, positions, key_mask, kv=None, index=None, topk_ids=None):
        """Returns (bf16 ``[B, T, H]``, (keys, values), expert ids int32 ``[B, T, k]``)."""
        h, kv = self.self_attn(self.input_layernorm(x), positions, key_mask, kv, index)
        x = x + h
        m, (ids, _) = self.mlp(self.post_attention_layernorm(x), topk_ids=topk_ids, return_routing=True)
        return x + m, kv, ids


class CausalLM(nnx.Module):
    """The forward pass of a decoder-only language model whose ``model`` holds ``embed_tokens`` (nnx.Embed),
    ``layers`` (each called ``layer(x, positions, key_mask, kv, index, topk_ids)`` and returning ``(x, kv,
    expert ids)``) and ``norm``, with an ``lm_head`` (or None: tied embeddings) and a ``config`` with
    ``num_hidden_layers``, ``num_key_value_heads``, ``head_dim`` and ``num_experts_per_tok``. This is the
    interface :mod:`jax_nvfp4.nn.generation` takes."""

    def __init__(self, config, model: nnx.Module, *, rngs: nnx.Rngs):
        self.config = config
        self.model = model
        self.lm_head = None if config.tie_word_embeddings else nnx.Linear(
            config.hidden_size, config.vocab_size, use_bias=False, dtype=BF16, param_dtype=config.param_dtype,
            preferred_element_type=jnp.float32, rngs=rngs)

    def init_cache(self, batch: int, max_len: int) -> KVCache:
        """An empty :class:`KVCache` for ``batch`` sequences of up to ``max_len`` tokens."""
        return KVCache.create(self.config, batch, max_len)

    def hidden_states(self, tokens, positions=None, *, attention_mask=None, cache: KVCache | None = None,
                      topk_ids=None, return_routing: bool = False) -> DecoderOutput:
        """Final-norm hidden states (the part of :meth:`__call__` before the LM head).

        Parameters
        ----------
        tokens : int32 ``[B, T]``
        positions : optional int32 ``[B, T]``
            Default: each token's index among the real tokens of its sequence (counting the cache's),
            so left-padded batches get positions 0, 1, ... from their first real token.
        attention_mask : optional bool ``[B, T]``: False for padding (never attended to)
        cache : optional KVCache; the tokens fill slots ``[cache.index, cache.index + T)`` (which must
            fit in ``cache.max_len``: it is not checked under jit)
        topk_ids : optional int32 ``[L, B, T, k]``: replay these expert selections (see :class:`MoE`)
        return_routing : bool: also return the expert ids ``[L, B, T, k]``

        Returns
        -------
        DecoderOutput(hidden bf16 ``[B, T, H]``, cache or None, routing or None)
        """
        c = self.config
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [B, T], got shape {tuple(tokens.shape)}")
        b, t = tokens.shape
        mask = jnp.ones((b, t), bool) if attention_mask is None else attention_mask.astype(bool)
        if mask.shape != (b, t):
            raise ValueError(f"attention_mask must have shape {(b, t)} (tokens'), got {tuple(mask.shape)}")
        want = (c.num_hidden_layers, b, t, c.num_experts_per_tok)
        if topk_ids is not None and tuple(topk_ids.shape) != want:
            raise ValueError(f"topk_ids must be [layers, B, T, num_experts_per_tok] = {list(want)}, "
                             f"got {tuple(topk_ids.shape)}")
        if cache is None:
            key_mask, index, before = mask, None, 0
        else:
            if len(cache.keys) != c.num_hidden_layers or cache.mask.shape[0] != b:
                raise ValueError(f"cache holds {len(cache.keys)} layers x batch {cache.mask.shape[0]}, the model "
                                 f"has {c.num_hidden_layers} layers and tokens batch {b}")
            index = cache.index
            key_mask = lax.dynamic_update_slice(cache.mask, mask, (0, index))
            before = jnp.sum(cache.mask, axis=1, dtype=jnp.int32)[:, None]
        if positions is None:
            positions = jnp.maximum(before + jnp.cumsum(mask, axis=1, dtype=jnp.int32) - 1, 0)
        x = self.model.embed_tokens(tokens).astype(BF16)
        new_k, new_v, routing = [], [], []
        for i, layer in enumerate(self.model.layers):
            kv = None if cache is None else (cache.keys[i], cache.values[i])
            x, (k, v), ids = layer(x, positions, key_mask, kv, index,
                                   None if topk_ids is None else topk_ids[i])
            new_k.append(k)
            new_v.append(v)
            routing.append(ids)
        new_cache = None if cache is None else KVCache(tuple(new_k), tuple(new_v), key_mask, index + t)
        return DecoderOutput(self.model.norm(x), new_cache, jnp.stack(routing) if return_routing else None)

    def logits(self, hidden):
        """float32 logits ``[..., V]`` of final-norm hidden states ``[..., H]`` (bf16 operands, fp32 accumulation)."""
        if self.lm_head is not None:
            return self.lm_head(hidden)
        emb = self.model.embed_tokens.embedding[...].astype(BF16)
        return jnp.einsum("...h,vh->...v", hidden.astype(BF16), emb, preferred_element_type=jnp.float32)

    def __call__(self, tokens, positions=None, *, attention_mask=None, cache: KVCache | None = None, topk_ids=None,
                 return_routing: bool = False, last_only: bool = False) -> CausalLMOutput:
        """Logits of ``tokens``; arguments as :meth:`hidden_states`, plus ``last_only`` (logits of the last
        position only, ``[B, 1, V]``: what decoding needs).

        Returns
        -------
        CausalLMOutput(logits float32 ``[B, T, V]``, cache or None, routing int32 ``[L, B, T, k]`` or None)
        """
        out = self.hidden_states(tokens, positions, attention_mask=attention_mask, cache=cache, topk_ids=topk_ids,
                                 return_routing=return_routing)
        h = out.hidden[:, -1:] if last_only else out.hidden
        return CausalLMOutput(self.logits(h), out.cache, out.routing)
