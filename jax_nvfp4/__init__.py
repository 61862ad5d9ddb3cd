"""jax_nvfp4: NVFP4 Mixture-of-Experts inference for JAX.

Online quantization bit-exact with FlashInfer's reference quantizer (:func:`quantize`,
:func:`quantize_experts`), kernel layouts, and the MoE layer.
"""

from .formats import (BF16Experts, NVFP4Array, NVFP4Experts, dequantize, from_blocked_experts, from_blocked_weights,
                      to_blocked_experts, to_blocked_weights)
from .layouts import (cutedsl_gemm1_rows, gate_up_to_up_gate, swizzle_scales, trtllm_gemm1_rows,
                      trtllm_gemm2_rows, unswizzle_scales)
from .quantize import RECIPES, quantize, quantize_experts
from .routing import ROUTING_METHODS, route
from .moe import moe, weight_order
from .backends import ffi as _ffi_backend  # noqa: F401  (registers backend "ffi")
from .backends.flashinfer import prepare_flashinfer_weights  # registers backend "flashinfer"
from .backends.flashinfer_prepare import PreparedWeights
from .checkpoint import (CheckpointError, ConversionSummary, convert_checkpoint, load_nvfp4_experts,
                         quantize_checkpoint_experts)

__version__ = "0.1.0"

__all__ = [
    "NVFP4Array", "NVFP4Experts", "BF16Experts", "quantize", "dequantize", "quantize_experts", "RECIPES",
    "to_blocked_weights", "from_blocked_weights", "to_blocked_experts", "from_blocked_experts", "weight_order",
    "swizzle_scales", "unswizzle_scales", "trtllm_gemm1_rows", "trtllm_gemm2_rows", "cutedsl_gemm1_rows",
    "gate_up_to_up_gate",
    "route", "ROUTING_METHODS", "moe", "prepare_flashinfer_weights", "PreparedWeights",
    "convert_checkpoint", "load_nvfp4_experts", "quantize_checkpoint_experts", "ConversionSummary",
    "CheckpointError",
]


def __getattr__(name):
    # jax_nvfp4.nn (Flax NNX modules) needs flax, an optional dependency: import it on first use.
    if name == "nn":
        import importlib
        return importlib.import_module(".nn", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
