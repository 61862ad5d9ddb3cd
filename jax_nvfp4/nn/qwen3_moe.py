"""A Qwen3-MoE decoder in Flax NNX whose MoE blocks are :class:`jax_nvfp4.nn.MoE` (bf16 or NVFP4).

The math is Hugging Face's ``Qwen3MoeForCausalLM``: RMSNorm (normalized in float32, rounded, then
scaled), grouped-query attention with RMSNorm on each query and key head before rotary embeddings
(``rotate_half`` convention, ``rope_theta``), MoE blocks routed softmax -> top-k (-> renormalize when
``norm_topk_prob``, i.e. routing ``"renormalize_naive"``) with SwiGLU experts, a final RMSNorm and
the LM head. Module paths mirror the Hugging Face names (``model.layers.0.mlp`` is an MoE block), so
``quantize_moe``'s ignore patterns and the checkpoint converter's agree.

The layers shared with the other decoders (RMSNorm, rotary, the KV cache and the attention, the causal-LM
forward pass) are :mod:`jax_nvfp4.nn.decoder`'s.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from flax import nnx

from . import decoder
from .decoder import BF16, CausalLM, RMSNorm, attend, check_config, hf_config, hf_fields, rotary
from .moe import MoE



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
        check_config(self, self.num_experts)

    @property
    def routing(self) -> str:
        """The :func:`jax_nvfp4.route` method: renormalized top-k of the softmax, or not."""
        return "renormalize_naive" if self.norm_topk_prob else "softmax_topk"

    def replace(self, **changes) -> "Qwen3MoeConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf(cls, config, **overrides) -> "Qwen3MoeConfig":
        """From a Hugging Face config: a dict, a ``config.json`` path, or a checkpoint folder."""
        config = hf_config(config, "qwen3_moe")
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
        kw = hf_fields(cls, config)
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
        out, kv = attend(q, k, v, key_mask, kv, index)
        return self.o_proj(out), kv


class DecoderLayer(decoder.DecoderLayer):
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


class Qwen3MoeForCausalLM(CausalLM):
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
        super().__init__(config, Qwen3MoeModel(config, rngs=rngs), rngs=rngs)
