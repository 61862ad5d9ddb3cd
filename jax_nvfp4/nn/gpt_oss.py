"""A gpt-oss decoder in Flax NNX whose MoE blocks are :class:`jax_nvfp4.nn.MoE` (bf16 or NVFP4).

The math is Hugging Face's ``GptOssForCausalLM``: RMSNorm (normalized and scaled in float32, then rounded),
grouped-query attention with biases, a learned sink logit per head and, on every other layer (``layer_types``),
a sliding window of ``sliding_window`` tokens; YaRN rotary embeddings (``rotate_half`` convention, the
attention factor on cos and sin); MoE blocks routed top-k of the router's logits (with its bias) -> softmax
(routing ``"renormalize"``) with gpt-oss SwiGLU experts (``swiglu_oai``, with biases); a final RMSNorm and the
LM head. Module paths mirror the Hugging Face names (``model.layers.0.mlp`` is an MoE block; its router's bias is
``mlp.router_bias``), so ``quantize_moe``'s ignore patterns and the checkpoint converter's agree. The layers it
shares with the other decoders are :mod:`jax_nvfp4.nn.decoder`'s.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import numpy as np
import jax.numpy as jnp
from flax import nnx

from .. import activations
from . import decoder
from .decoder import BF16, CausalLM, RMSNorm, attend, check_config, hf_config, hf_fields, rotary
from .moe import MoE

LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclasses.dataclass(frozen=True)
class GptOssConfig:
    """Shapes and options of a gpt-oss model (Hugging Face ``config.json`` field names; the YaRN fields of its
    ``rope_scaling`` as ``rope_*``).

    ``layer_types`` (default: sliding on even layers, full on odd ones, as Hugging Face's) says which layers attend
    over a sliding window. ``moe_backend`` (the :func:`jax_nvfp4.moe` backend) and ``param_dtype`` are jax_nvfp4
    options. :meth:`from_hf` rejects what this model does not compute (another activation, SwiGLU limit or rope).
    """

    vocab_size: int = 201088
    hidden_size: int = 2880
    num_hidden_layers: int = 36
    num_attention_heads: int = 64
    num_key_value_heads: int = 8
    head_dim: int = 64
    intermediate_size: int = 2880
    num_local_experts: int = 128
    num_experts_per_tok: int = 4
    sliding_window: int = 128
    layer_types: tuple[str, ...] | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 150000.0
    rope_factor: float = 32.0
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_original_max_position_embeddings: int = 4096
    rope_truncate: bool = False
    max_position_embeddings: int = 131072
    tie_word_embeddings: bool = False
    moe_backend: str = "auto"
    param_dtype: Any = BF16

    def __post_init__(self):
        check_config(self, self.num_local_experts)
        if self.layer_types is None:
            object.__setattr__(self, "layer_types", tuple(LAYER_TYPES[i % 2] for i in range(self.num_hidden_layers)))
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if len(self.layer_types) != self.num_hidden_layers or not set(self.layer_types) <= set(LAYER_TYPES):
            raise ValueError(f"layer_types must name {LAYER_TYPES} for each of the {self.num_hidden_layers} layers, "
                             f"got {self.layer_types}")
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")

    @property
    def num_experts(self) -> int:
        return self.num_local_experts

    def replace(self, **changes) -> "GptOssConfig":
        """A copy with ``changes``; fewer ``num_hidden_layers`` without ``layer_types`` keep the first layers' types."""
        n = changes.get("num_hidden_layers", self.num_hidden_layers)
        if "layer_types" not in changes and n < self.num_hidden_layers:
            changes["layer_types"] = self.layer_types[:n]
        elif "layer_types" not in changes and n > self.num_hidden_layers:
            raise ValueError(f"num_hidden_layers={n} (more than {self.num_hidden_layers}) needs layer_types")
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf(cls, config, **overrides) -> "GptOssConfig":
        """From a Hugging Face config: a dict, a ``config.json`` path, or a checkpoint folder."""
        config = hf_config(config, "gpt_oss")
        unsupported = []
        if config.get("hidden_act", "silu") != "silu":
            unsupported.append(f"hidden_act={config['hidden_act']!r}")
        if config.get("swiglu_limit", activations.SWIGLU_OAI_LIMIT) != activations.SWIGLU_OAI_LIMIT:
            unsupported.append(f"swiglu_limit={config['swiglu_limit']} "
                               f"(swiglu_oai's is {activations.SWIGLU_OAI_LIMIT})")
        if not config.get("attention_bias", True):
            unsupported.append("attention_bias=false")
        rope = dict(config.get("rope_scaling") or {})
        if rope.get("rope_type", rope.get("type")) != "yarn":
            unsupported.append(f"rope_scaling={config.get('rope_scaling')} (yarn only)")
        if rope.get("attention_factor") is not None or rope.get("mscale") or rope.get("mscale_all_dim"):
            unsupported.append(f"rope_scaling={rope} (attention_factor / mscale)")
        if unsupported:
            raise ValueError(f"unsupported gpt-oss config: {', '.join(unsupported)}")
        kw = hf_fields(cls, config)
        if kw.get("layer_types") is not None:
            kw["layer_types"] = tuple(kw["layer_types"])
        max_pos = config.get("max_position_embeddings", cls.max_position_embeddings)
        original = rope.get("original_max_position_embeddings")
        kw.update(rope_factor=float(rope.get("factor", 1.0)), rope_beta_fast=float(rope.get("beta_fast", 32.0)),
                  rope_beta_slow=float(rope.get("beta_slow", 1.0)), rope_truncate=bool(rope.get("truncate", True)),
                  rope_original_max_position_embeddings=int(original or max_pos))
        if original:  # Hugging Face then takes the factor from the two lengths
            kw["rope_factor"] = max_pos / original
        kw.update(overrides)
        return cls(**kw)


CONFIGS = {
    # CPU tests and notebooks (seconds)
    "tiny": GptOssConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, intermediate_size=48, num_local_experts=8,
                         num_experts_per_tok=2, sliding_window=4, rope_theta=10000.0, rope_factor=4.0,
                         rope_original_max_position_embeddings=64, max_position_embeddings=256),
    # openai/gpt-oss-20b
    "gpt-oss-20b": GptOssConfig(num_hidden_layers=24, num_local_experts=32),
    # openai/gpt-oss-120b
    "gpt-oss-120b": GptOssConfig(),
}


@functools.lru_cache(maxsize=16)
def yarn_frequencies(head_dim: int, theta: float, factor: float, beta_fast: float, beta_slow: float,
                     original_max_position_embeddings: int, truncate: bool) -> tuple[np.ndarray, float]:
    """YaRN's inverse frequencies ``[head_dim / 2]`` (float32) and attention factor, as Hugging Face computes them:
    interpolated (divided by ``factor``) below the ``beta_slow`` rotations, kept above ``beta_fast``, a linear ramp
    between; the factor ``0.1 ln(factor) + 1`` multiplies cos and sin."""
    d = head_dim

    def correction_dim(rotations):
        return d * math.log(original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(d // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = (1 - ramp).astype(np.float32)  # 1: the original frequency
    pos = (theta ** (np.arange(0, d, 2, dtype=np.float32) / d)).astype(np.float32)
    inv = (1 / (factor * pos)) * (1 - extrapolation) + (1 / pos) * extrapolation
    return inv.astype(np.float32), (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)


class Attention(nnx.Module):
    """gpt-oss grouped-query attention: q/k/v/o projections with biases, YaRN rotary embeddings, a sink logit per
    head and, on sliding layers, a window of ``sliding_window`` tokens.

    Attributes
    ----------
    q_proj : ``H -> num_attention_heads * head_dim``; k_proj, v_proj : ``H -> num_key_value_heads * head_dim``;
    o_proj : ``num_attention_heads * head_dim -> H`` (nnx.Linear with biases, kernels ``[in, out]``)
    sinks : nnx.Param ``[num_attention_heads]``
    window : int or None (static): the sliding window of this layer
    """

    def __init__(self, config: GptOssConfig, layer: int, *, rngs: nnx.Rngs):
        c = config
        lin = functools.partial(nnx.Linear, use_bias=True, dtype=BF16, param_dtype=c.param_dtype, rngs=rngs)
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.rope = (c.head_dim, c.rope_theta, c.rope_factor, c.rope_beta_fast, c.rope_beta_slow,
                     c.rope_original_max_position_embeddings, c.rope_truncate)
        self.window = c.sliding_window if c.layer_types[layer] == "sliding_attention" else None
        self.q_proj = lin(c.hidden_size, c.num_attention_heads * c.head_dim)
        self.k_proj = lin(c.hidden_size, c.num_key_value_heads * c.head_dim)
        self.v_proj = lin(c.hidden_size, c.num_key_value_heads * c.head_dim)
        self.o_proj = lin(c.num_attention_heads * c.head_dim, c.hidden_size)
        self.sinks = nnx.Param(jnp.zeros((c.num_attention_heads,), c.param_dtype))

    def __call__(self, x, positions, key_mask, kv=None, index=None):
        """As :meth:`jax_nvfp4.nn.qwen3_moe.Attention.__call__`: (bf16 ``[B, T, H]``, (keys, values))."""
        b, t, _ = x.shape
        n, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        inv_freq, scale = yarn_frequencies(*self.rope)
        inv_freq = jnp.asarray(inv_freq)
        q = rotary(self.q_proj(x).reshape(b, t, n, d), positions, inv_freq, scale=scale)
        k = rotary(self.k_proj(x).reshape(b, t, nkv, d), positions, inv_freq, scale=scale)
        v = self.v_proj(x).reshape(b, t, nkv, d)
        out, kv = attend(q, k, v, key_mask, kv, index, window=self.window, sinks=self.sinks[...])
        return self.o_proj(out), kv


class DecoderLayer(decoder.DecoderLayer):
    """``x + attn(norm(x))``, then ``x + moe(norm(x))``.

    Attributes
    ----------
    input_layernorm, post_attention_layernorm : RMSNorm (scaled in float32)
    self_attn : Attention
    mlp : :class:`jax_nvfp4.nn.MoE` (routing ``"renormalize"``, ``swiglu_oai``, router and expert biases)
    """

    def __init__(self, config: GptOssConfig, layer: int, *, rngs: nnx.Rngs):
        c = config
        norm = functools.partial(RMSNorm, c.hidden_size, c.rms_norm_eps, c.param_dtype, scale_in_float32=True)
        self.input_layernorm = norm()
        self.self_attn = Attention(c, layer, rngs=rngs)
        self.post_attention_layernorm = norm()
        self.mlp = MoE(c.hidden_size, c.intermediate_size, c.num_local_experts, c.num_experts_per_tok,
                       routing="renormalize", activation="swiglu_oai", router_bias=True, expert_bias=True,
                       backend=c.moe_backend, param_dtype=c.param_dtype, rngs=rngs)


class GptOssModel(nnx.Module):
    """Embedding, decoder layers, final norm (Hugging Face ``model.*``)."""

    def __init__(self, config: GptOssConfig, *, rngs: nnx.Rngs):
        c = config
        self.embed_tokens = nnx.Embed(c.vocab_size, c.hidden_size, dtype=BF16, param_dtype=c.param_dtype,
                                      embedding_init=nnx.initializers.normal(1.0), rngs=rngs)
        self.layers = nnx.List([DecoderLayer(c, i, rngs=rngs) for i in range(c.num_hidden_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, c.param_dtype, scale_in_float32=True)


class GptOssForCausalLM(CausalLM):
    """gpt-oss causal language model (:class:`~jax_nvfp4.nn.decoder.CausalLM`: ``__call__``, ``hidden_states``,
    ``logits``, ``init_cache``; :func:`jax_nvfp4.nn.generate` runs it).

    Parameters
    ----------
    config : GptOssConfig (see :data:`CONFIGS`)
    rngs : nnx.Rngs, for random weights (use :func:`jax_nvfp4.nn.load_gpt_oss` for a checkpoint)

    Examples
    --------
    >>> model = GptOssForCausalLM(CONFIGS["tiny"], rngs=nnx.Rngs(0))
    >>> logits = model(tokens).logits                  # [B, T, V] float32
    >>> qmodel = jax_nvfp4.nn.quantize_moe(model)       # NVFP4 experts, w4a16
    """

    def __init__(self, config: GptOssConfig, *, rngs: nnx.Rngs):
        super().__init__(config, GptOssModel(config, rngs=rngs), rngs=rngs)
