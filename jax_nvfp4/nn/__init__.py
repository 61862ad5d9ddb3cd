"""Flax NNX integration: an NVFP4-capable MoE module, online quantization of live models, Qwen3-MoE and
gpt-oss decoders and jitted generation for RL rollouts. Needs flax (``pip install jax_nvfp4[flax]``).

Use in a Flax model::

    from jax_nvfp4 import nn as nvnn

    self.mlp = nvnn.MoE(hidden, inter, num_experts, top_k, routing="renormalize_naive", rngs=rngs)
    ...
    qmodel = nvnn.quantize_moe(model, ignore=["model.layers.0.mlp"])   # NVFP4 experts, w4a16
    qmodel = nvnn.expert_parallel(qmodel, mesh, "ep")                   # optional: experts split over devices
    out = nvnn.generate(qmodel, prompts, key=key, max_new_tokens=128, temperature=1.0)

Modules: :mod:`.moe` (the MoE module), :mod:`.quantization` (quantize_moe, load_experts),
:mod:`.decoder` (what the decoders share), :mod:`.qwen3_moe` and :mod:`.gpt_oss` (the models),
:mod:`.loader` (Hugging Face checkpoints), :mod:`.generation` (sampling and scoring).
"""

import importlib

try:  # an optional dependency: say which extra installs it
    importlib.import_module("flax")
except ModuleNotFoundError as e:
    raise ModuleNotFoundError("jax_nvfp4.nn needs flax (>= 0.12): pip install 'jax_nvfp4[flax]'", name="flax") from e

from .moe import BF16ExpertWeights, MoE, NVFP4ExpertWeights, QuantizedWeight, replay_weights
from .quantization import expert_parallel, load_experts, moe_modules, quantize_moe, set_moe_options
from .decoder import CausalLM, CausalLMOutput, DecoderOutput, KVCache, RMSNorm, rotary
from .qwen3_moe import CONFIGS, Qwen3MoeConfig, Qwen3MoeForCausalLM
from .gpt_oss import CONFIGS as GPT_OSS_CONFIGS, GptOssConfig, GptOssForCausalLM
from .loader import load_gpt_oss, load_qwen3_moe
from .generation import GenerationOutput, generate, sample_logits, sequence_logprobs

__all__ = [
    "MoE", "BF16ExpertWeights", "NVFP4ExpertWeights", "QuantizedWeight", "quantize_moe", "set_moe_options",
    "expert_parallel",
    "load_experts", "moe_modules", "replay_weights",
    "Qwen3MoeConfig", "Qwen3MoeForCausalLM", "CONFIGS", "KVCache", "CausalLMOutput", "DecoderOutput", "RMSNorm",
    "rotary", "load_qwen3_moe", "CausalLM", "GptOssConfig", "GptOssForCausalLM", "GPT_OSS_CONFIGS", "load_gpt_oss",
    "generate", "sequence_logprobs", "sample_logits", "GenerationOutput",
]
