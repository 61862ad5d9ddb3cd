"""A Qwen3-MoE decoder in Flax NNX whose MoE blocks are :class:`jax_nvfp4.nn.MoE` (bf16 or NVFP4).

The math is Hugging Face's ``Qwen3MoeForCausalLM``: RMSNorm (normalized in float32, rounded, then
scaled), grouped-query attention with RMSNorm on each query and key head before rotary embeddings
(``rotate_half`` convention, ``rope_theta``), MoE blocks routed softmax -> top-k (-> renormalize when
``norm_topk_prob``, i.e. routing ``"renormalize_naive"``) with SwiGLU experts, a final RMSNorm and
the LM head. Module paths mirror the Hugging Face names (``model.layers.0.mlp`` is an MoE block), so
``quantize_moe``'s ignore patterns and the checkpoint converter's agree.

Activations are bfloat16; matmuls accumulate in float32; attention softmax, router and logits are
float32. The attention runs over a :class:`KVCache` (prefill and decode) or, without one, causally
over the given tokens (scoring); either way a key mask supports left-padded batches.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from flax import nnx

from .moe import MoE

BF16 = jnp.bfloat16


@dataclasses.dataclass(frozen=True)
class Qwen3MoeConfig:
    """Shapes and options of a Qwen3-MoE model (Hugging Face ``config.json`` field names).

    ``moe_backend`` (the :func:`jax_nvfp4.moe` backend) and ``param_dtype`` are jax_nvfp4 options.
    Only models whose every layer is an MoE block (``decoder_sparse_step`` 1, no
    ``mlp_only_layers``), without attention bias, rope scaling or sliding windows, are supported;
    :meth:`from_hf` rejects the others. That covers the released Qwen3-MoE models.
    """

    vocab_size: int = 151936
    hidden_size: int = 2048
    num_hidden_layers: int = 48
    num_attention_heads: int = 32
    num_key_value_heads: int = 4
    head_dim: int = 128
    moe_intermediate_size: int = 768
    num_experts: int = 128
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    moe_backend: str = "auto"
    param_dtype: Any = BF16

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (rotary pairs), got {self.head_dim}")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                             f"got {self.num_experts_per_tok}")

    @property
    def routing(self) -> str:
        """The :func:`jax_nvfp4.route` method: renormalized top-k of the softmax, or not."""
        return "renormalize_naive" if self.norm_topk_prob else "softmax_topk"

    def replace(self, **changes) -> "Qwen3MoeConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf(cls, config, **overrides) -> "Qwen3MoeConfig":
        """From a Hugging Face config: a dict, a ``config.json`` path, or a checkpoint folder."""
        if not isinstance(config, dict):
            path = Path(config)
            config = json.loads((path / "config.json" if path.is_dir() else path).read_text())
        mt = config.get("model_type")
        if mt not in (None, "qwen3_moe"):
            raise ValueError(f"config model_type is {mt!r}, not 'qwen3_moe'")
        unsupported = []
        if config.get("mlp_only_layers"):
            unsupported.append(f"mlp_only_layers={config['mlp_only_layers']}")
        if config.get("decoder_sparse_step", 1) != 1:
            unsupported.append(f"decoder_sparse_step={config['decoder_sparse_step']}")
        if config.get("attention_bias"):
            unsupported.append("attention_bias=true")
        if config.get("rope_scaling"):
            unsupported.append(f"rope_scaling={config['rope_scaling']}")
        if config.get("use_sliding_window"):
            unsupported.append("use_sliding_window=true")
        if unsupported:
            raise ValueError(f"unsupported Qwen3-MoE config: {', '.join(unsupported)} (every layer must be "
                             "an MoE block with plain rotary attention)")
        fields = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in config.items() if k in fields and k not in ("moe_backend", "param_dtype")}
        if kw.get("head_dim") is None:
            kw["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
        kw.update(overrides)
        return cls(**kw)


CONFIGS = {
    # CPU tests and notebooks (seconds)
    "tiny": Qwen3MoeConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, num_experts=8,
                           num_experts_per_tok=2, max_position_embeddings=1024, rope_theta=10000.0),
    # CPU examples (a few seconds per rollout)
    "small": Qwen3MoeConfig(vocab_size=2048, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                            num_key_value_heads=2, head_dim=32, moe_intermediate_size=128, num_experts=32,
                            num_experts_per_tok=4, max_position_embeddings=4096),
    # Qwen/Qwen3-30B-A3B
    "qwen3-30b-a3b": Qwen3MoeConfig(),
    # Qwen/Qwen3-235B-A22B
    "qwen3-235b-a22b": Qwen3MoeConfig(hidden_size=4096, num_hidden_layers=94, num_attention_heads=64,
                                      moe_intermediate_size=1536),
}


# --------------------------------------------------------------------------------------------
# Building blocks


class RMSNorm(nnx.Module):
    """Hugging Face RMSNorm: ``weight * bf16(x / sqrt(mean(x^2) + eps))`` with the norm in float32.

    Attributes
    ----------
    weight : nnx.Param ``[dim]``
    """

    def __init__(self, dim: int, eps: float, param_dtype=BF16):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x):
        """``x [..., dim]`` -> same shape and dtype."""
        xf = x.astype(jnp.float32)
        y = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (self.weight[...].astype(x.dtype) * y.astype(x.dtype)).astype(x.dtype)


def rotary(x, positions, theta: float):
    """Rotary embedding, Hugging Face's ``rotate_half`` convention (first half paired with second).

    Parameters
    ----------
    x : ``[B, T, N, D]``
    positions : int ``[B, T]``
    theta : rope base

    Returns
    -------
    ``[B, T, N, D]`` in ``x.dtype`` (computed in float32).
    """
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    xf = x.astype(jnp.float32)
    rot = jnp.concatenate([-xf[..., d // 2:], xf[..., : d // 2]], axis=-1)
    return (xf * jnp.cos(emb) + rot * jnp.sin(emb)).astype(x.dtype)


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
    def create(cls, config: Qwen3MoeConfig, batch: int, max_len: int, dtype=BF16) -> "KVCache":
        """An empty cache of ``max_len`` slots."""
        shape = (batch, max_len, config.num_key_value_heads, config.head_dim)
        zeros = tuple(jnp.zeros(shape, dtype) for _ in range(config.num_hidden_layers))
        return cls(zeros, tuple(jnp.zeros(shape, dtype) for _ in range(config.num_hidden_layers)),
                   jnp.zeros((batch, max_len), bool), jnp.zeros((), jnp.int32))

    @property
    def max_len(self) -> int:
        return self.mask.shape[1]


class Attention(nnx.Module):
    """Qwen3 grouped-query attention with per-head q/k RMSNorm and rotary embeddings.

    Attributes
    ----------
    q_proj : ``H -> num_attention_heads * head_dim``; k_proj, v_proj : ``H -> num_key_value_heads * head_dim``;
    o_proj : ``num_attention_heads * head_dim -> H`` (nnx.Linear, no bias, kernels ``[in, out]``)
    q_norm, k_norm : RMSNorm over ``head_dim``
    """

    def __init__(self, config: Qwen3MoeConfig, *, rngs: nnx.Rngs):
        c = config
        lin = functools.partial(nnx.Linear, use_bias=False, dtype=BF16, param_dtype=c.param_dtype, rngs=rngs)
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.rope_theta = c.rope_theta
        self.q_proj = lin(c.hidden_size, c.num_attention_heads * c.head_dim)
        self.k_proj = lin(c.hidden_size, c.num_key_value_heads * c.head_dim)
        self.v_proj = lin(c.hidden_size, c.num_key_value_heads * c.head_dim)
        self.o_proj = lin(c.num_attention_heads * c.head_dim, c.hidden_size)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, c.param_dtype)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, c.param_dtype)

    def __call__(self, x, positions, key_mask, kv=None, index=None):
        """Attend.

        Parameters
        ----------
        x : bf16 ``[B, T, H]``
        positions : int32 ``[B, T]`` rotary positions
        key_mask : bool ``[B, S]`` keys that hold real tokens (``S = T`` without a cache)
        kv : optional (keys, values) bf16 ``[B, S, KV, D]`` of this layer; the new keys and values are
            written at slots ``[index, index + T)`` and queries attend causally by slot
        index : int32 ``[]`` (with ``kv``)

        Returns
        -------
        (bf16 ``[B, T, H]``, (keys, values) updated, or those of ``x`` without a cache).
        """
        b, t, _ = x.shape
        n, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        q = rotary(self.q_norm(self.q_proj(x).reshape(b, t, n, d)), positions, self.rope_theta)
        k = rotary(self.k_norm(self.k_proj(x).reshape(b, t, nkv, d)), positions, self.rope_theta)
        v = self.v_proj(x).reshape(b, t, nkv, d)
        if kv is None:
            keys, values, q_slot = k, v, jnp.arange(t)
        else:
            keys = lax.dynamic_update_slice(kv[0], k.astype(kv[0].dtype), (0, index, 0, 0))
            values = lax.dynamic_update_slice(kv[1], v.astype(kv[1].dtype), (0, index, 0, 0))
            q_slot = index + jnp.arange(t)
        k_slot = jnp.arange(keys.shape[1])
        causal = k_slot[None, :] <= q_slot[:, None]  # [T, S]
        # A query always sees its own slot, so rows of padding never softmax over nothing.
        allowed = causal[None] & (key_mask[:, None, :] | (k_slot[None, :] == q_slot[:, None])[None])  # [B, T, S]
        qg = q.reshape(b, t, nkv, n // nkv, d)
        scores = jnp.einsum("btkgd,bskd->bkgts", qg, keys, preferred_element_type=jnp.float32) * d ** -0.5
        scores = jnp.where(allowed[:, None, None], scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(values.dtype)
        out = jnp.einsum("bkgts,bskd->btkgd", probs, values, preferred_element_type=jnp.float32)
        return self.o_proj(out.astype(BF16).reshape(b, t, n * d)), (keys, values)


class DecoderLayer(nnx.Module):
    """``x + attn(norm(x))``, then ``x + moe(norm(x))``.

    Attributes
    ----------
    input_layernorm, post_attention_layernorm : RMSNorm
    self_attn : Attention
    mlp : :class:`jax_nvfp4.nn.MoE` (routing ``config.routing``, SwiGLU)
    """

    def __init__(self, config: Qwen3MoeConfig, *, rngs: nnx.Rngs):
        c = config
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, c.param_dtype)
        self.self_attn = Attention(c, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, c.param_dtype)
        self.mlp = MoE(c.hidden_size, c.moe_intermediate_size, c.num_experts, c.num_experts_per_tok,
                       routing=c.routing, activation="swiglu", backend=c.moe_backend, param_dtype=c.param_dtype,
                       rngs=rngs)

    def __call__(self, x, positions, key_mask, kv=None, index=None, topk_ids=None):
        """Returns (bf16 ``[B, T, H]``, (keys, values), expert ids int32 ``[B, T, k]``)."""
        h, kv = self.self_attn(self.input_layernorm(x), positions, key_mask, kv, index)
        x = x + h
        m, (ids, _) = self.mlp(self.post_attention_layernorm(x), topk_ids=topk_ids, return_routing=True)
        return x + m, kv, ids


class Qwen3MoeModel(nnx.Module):
    """Embedding, decoder layers, final norm (Hugging Face ``model.*``).

    Attributes
    ----------
    embed_tokens : nnx.Embed ``[V, H]``; layers : nnx.List of DecoderLayer; norm : RMSNorm
    """

    def __init__(self, config: Qwen3MoeConfig, *, rngs: nnx.Rngs):
        c = config
        self.embed_tokens = nnx.Embed(c.vocab_size, c.hidden_size, dtype=BF16, param_dtype=c.param_dtype,
                                      embedding_init=nnx.initializers.normal(1.0), rngs=rngs)
        self.layers = nnx.List([DecoderLayer(c, rngs=rngs) for _ in range(c.num_hidden_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, c.param_dtype)


class CausalLMOutput(NamedTuple):
    """Output of :class:`Qwen3MoeForCausalLM`.

    logits : float32 ``[B, T, V]`` (``[B, 1, V]`` with ``last_only``)
    cache : the updated :class:`KVCache`, or None
    routing : int32 ``[L, B, T, k]`` expert ids of every layer (``return_routing``), or None
    """

    logits: Any
    cache: Any = None
    routing: Any = None


class DecoderOutput(NamedTuple):
    """Output of :meth:`Qwen3MoeForCausalLM.hidden_states`: as :class:`CausalLMOutput` with the
    final-norm hidden states bf16 ``[B, T, H]`` in place of the logits."""

    hidden: Any
    cache: Any = None
    routing: Any = None


class Qwen3MoeForCausalLM(nnx.Module):
    """Qwen3-MoE causal language model.

    Parameters
    ----------
    config : Qwen3MoeConfig (see :data:`CONFIGS`)
    rngs : nnx.Rngs, for random weights (use :func:`jax_nvfp4.nn.load_qwen3_moe` for a checkpoint)

    Attributes
    ----------
    config : Qwen3MoeConfig (static)
    model : Qwen3MoeModel
    lm_head : nnx.Linear ``H -> V`` (kernel ``[H, V]``), or None with ``tie_word_embeddings``

    Examples
    --------
    >>> model = Qwen3MoeForCausalLM(CONFIGS["tiny"], rngs=nnx.Rngs(0))
    >>> logits = model(tokens).logits                  # [B, T, V] float32
    >>> qmodel = jax_nvfp4.nn.quantize_moe(model)       # NVFP4 experts, w4a16
    """

    def __init__(self, config: Qwen3MoeConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.model = Qwen3MoeModel(config, rngs=rngs)
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
