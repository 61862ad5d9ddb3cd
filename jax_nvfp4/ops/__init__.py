"""XLA FFI custom calls of the NVFP4 MoE, their pure-JAX twins, and the MoE pipeline built on them.

Six ops (C++ in ``ffi/``; one CPU handler and one CUDA handler each, same target name):

- :func:`moe_align`: sort the ``T*k`` token-expert pairs by local expert into groups padded to
  ``tile_m`` rows (``sorted_ids``, ``tile_expert``, ``pair_to_row``), on the device;
- :func:`grouped_gemm`: bf16 rows x NVFP4 expert weights (W4A16, FP4 decoded in registers), with
  an epilogue that applies the per-expert global scale, an optional per-row scale and the
  activation;
- :func:`moe_finalize`: un-permute and sum each token's ``k`` rows in a fixed order;
- :func:`quant_dequant_rows`: per-token NVFP4 quantization decoded back to bf16 without the
  global scale (mode w4a4's activations; bit-exact with :func:`jax_nvfp4.quantize`);
- :func:`moe_align_quant`: the first and the last in one call for decode batches (mode w4a4's
  first two launches in one);
- :func:`moe_align_gemm`: the first and the second in one call for decode batches (mode w4a16's
  first two launches in one).

Benchmarks also use :func:`device_clock` (the time at which the stream reaches a value).

Every op takes ``impl="ffi"`` (the custom call) or ``impl="jax"`` (its pure-JAX twin, the
reference the tests hold the kernels to). :func:`moe` chains them into the expert part of the
MoE layer, with a ``custom_vjp`` (gradients from the pure-JAX path) and a ``custom_vmap`` rule
(a batch of token sets is folded into one larger token set).

One module per op (``align``, ``gemm``, ``finalize``, ``quant``, ``clock``), with the enums and
limits shared with C++ (``constants``), the kernel orders (``orders``), the extension and its targets
(``extension``), the tiling decisions (``tiling``) and the pipeline (``pipeline``).

Targets are registered lazily, on first use, after ``jax.devices()`` has initialised the
backends (``xla_ffi.md`` section 8).
"""

from .constants import (Activation, GATED_ACTIVATIONS, RowScale, KernelFlag, Pairing, Mode, TILE_MS, K_SPLITS,
                        MAX_SPLIT_TILE_M, PAIRED_MAX_TILE_M, MAX_ALIGN_EXPERTS, ALIGN_ONE_WARP_PAIRS,
                        ALIGN_GRID_MIN_PAIRS, ALIGN_GRID_MAX_SLOTS, CUDA_K_MULTIPLE, CUDA_N_MULTIPLE, ACTIVATIONS,
                        MODES)
from .orders import to_paired, from_paired, CHUNK_K, to_chunk_order, from_chunk_order
from .extension import (TARGET_ALIGN, TARGET_GEMM, TARGET_FINALIZE, TARGET_QUANT, TARGET_ALIGN_QUANT,
                        TARGET_ALIGN_GEMM, TARGET_CLOCK, IMPLS, extension_error, build_info, check_constants,
                        ensure_registered, check_kernel_flags)
from .tiling import (WGMMA_MIN_ROWS, WGMMA_64_ROWS, ROWS96_ITEM_COST, WGMMA_TILE_MS, WS_GEMM2_MIN_K, choose_tile_m,
                     feature_slabs, expected_tiles, choose_k_split, check_k_split, padded_rows,
                     chunk_intermediate_supported, wgmma_tiles, rows96_item_ratio, choose_rows96, choose_tiles)
from .align import moe_align
from .gemm import grouped_gemm, apply_activation, ALIGN_GEMM_TILE_MS, ALIGN_GEMM_MAX_CTAS, moe_align_gemm
from .finalize import moe_finalize
from .quant import ScaleLookup, quant_dequant_rows, moe_align_quant
from .clock import device_clock, clock_ns
from .pipeline import moe_forward, moe

__all__ = [
    "Activation", "GATED_ACTIVATIONS", "RowScale", "KernelFlag", "Pairing", "Mode", "TILE_MS", "K_SPLITS",
    "MAX_SPLIT_TILE_M", "PAIRED_MAX_TILE_M", "MAX_ALIGN_EXPERTS", "ALIGN_ONE_WARP_PAIRS", "ALIGN_GRID_MIN_PAIRS",
    "ALIGN_GRID_MAX_SLOTS", "CUDA_K_MULTIPLE", "CUDA_N_MULTIPLE", "ACTIVATIONS", "MODES", "to_paired",
    "from_paired", "CHUNK_K", "to_chunk_order", "from_chunk_order", "TARGET_ALIGN", "TARGET_GEMM",
    "TARGET_FINALIZE", "TARGET_QUANT", "TARGET_ALIGN_QUANT", "TARGET_ALIGN_GEMM", "TARGET_CLOCK", "IMPLS",
    "extension_error", "build_info", "check_constants", "ensure_registered", "check_kernel_flags", "WGMMA_MIN_ROWS",
    "WGMMA_64_ROWS", "ROWS96_ITEM_COST", "WGMMA_TILE_MS", "WS_GEMM2_MIN_K", "choose_tile_m", "feature_slabs",
    "expected_tiles", "choose_k_split", "check_k_split", "padded_rows", "chunk_intermediate_supported",
    "wgmma_tiles", "rows96_item_ratio", "choose_rows96", "choose_tiles", "moe_align", "grouped_gemm",
    "apply_activation", "ALIGN_GEMM_TILE_MS", "ALIGN_GEMM_MAX_CTAS", "moe_align_gemm", "moe_finalize",
    "ScaleLookup", "quant_dequant_rows", "moe_align_quant", "device_clock", "clock_ns", "moe_forward", "moe",
]
