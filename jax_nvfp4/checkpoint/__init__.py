"""Checkpoint conversion: quantize the routed experts of a safetensors MoE checkpoint to NVFP4.

Spec section 4. A Hugging Face-style checkpoint (one ``model.safetensors`` or shards listed in
``model.safetensors.index.json``) is read lazily, one tensor at a time, with plain file reads
(no mmap, so resident memory is what we allocate). Each expert's GEMM1 (gate and up, sharing one
global scale) and GEMM2 (down) are quantized with :func:`jax_nvfp4.quantize` and written
straight into the output file; every other tensor is copied byte for byte. Expert ``input_scale``
tensors of FP8 sources (static FP8 activation scales) are dropped with their weights; NVFP4 sources' (ModelOpt)
are kept.

Output (NVFP4 checkpoint): for each quantized expert, with ``P = {module}.experts.{N}``,

- ``P.gate_up_proj.weight``: uint8 (``U8``) ``[2I, H/2]``, E2M1 codes two a byte (even element in
  the low nibble), rows ``[gate; up]``;
- ``P.gate_up_proj.weight_scale``: float8_e4m3fn (``F8_E4M3``) ``[2I, H/16]``, block decode scales,
  linear layout;
- ``P.gate_up_proj.weight_global_scale``: float32 ``[]``, the global *decode* scale (one per expert,
  shared by gate and up), or ``[2]``, gate's then up's, in modules whose ``moe_modules`` entry has
  ``up_global_scale`` (pre-quantized gate and up; format version 3);
- ``P.down_proj.weight`` ``[H, I/2]``, ``P.down_proj.weight_scale`` ``[H, I/16]``,
  ``P.down_proj.weight_global_scale`` ``[]``: the same for GEMM2;
- ``P.gate_up_proj.bias`` ``[2I]`` (gate entries first) and ``P.down_proj.bias`` ``[H]``: the expert
  biases of a source that has them (gpt-oss), bfloat16 as stored or float32 (format version 2);
- ``P.gate_up_proj.input_scale`` (float32, shaped as its ``weight_global_scale``) and ``P.down_proj.input_scale``
  ``[]``: a pre-quantized source's static activation *decode* scales, in modules whose ``moe_modules`` entry has
  ``input_scales`` (format version 4; loaded as :attr:`~jax_nvfp4.NVFP4Experts.input_scales`, the module's largest).

A non-gated layer stores ``P.up_proj.*`` (``[I, H/2]``) instead of ``P.gate_up_proj.*``. Shards mirror
the source (same file names, an index when the source had one); each file's ``__metadata__`` keeps
the source's entries and adds ``nvfp4_*`` keys; ``nvfp4_config.json`` describes the whole conversion
(format version, recipe, source dtypes, ignore patterns, every MoE module). Other top-level files
(``config.json``, tokenizer files, ...) are copied.

Modules:

- :mod:`.safetensors_io`: safetensors header and tensor reading, the streaming writer;
- :mod:`.naming`: source expert names (Mixtral, Qwen3-MoE, DeepSeek), ignore patterns, output names;
- :mod:`.stacked`: experts stacked in one tensor per projection (gpt-oss, bf16 or MXFP4; Llama 4);
- :mod:`.experts`: finding, grouping and validating a source checkpoint's experts (source dtypes, FP8 scales);
- :mod:`.sources`: source weights to NVFP4 (FP8 dequantization, NaN/Inf checks, quantization; pre-quantized NVFP4
  weights of ModelOpt or compressed-tensors taken as stored);
- :mod:`.conversion`: :func:`convert_checkpoint`, atomic output;
- :mod:`.load`: :func:`load_nvfp4_experts`, :func:`quantize_checkpoint_experts`.

Public API: :func:`convert_checkpoint`, :func:`load_nvfp4_experts`,
:func:`quantize_checkpoint_experts`, :func:`matches_ignore`, :class:`ConversionSummary`.
"""

from .conversion import ConversionSummary, convert_checkpoint
from .experts import DEFAULT_FP8_BLOCK
from .load import load_nvfp4_experts, quantize_checkpoint_experts, read_nvfp4_config
from .naming import (BLOCK_SCALE, CONFIG_NAME, DATA, DOWN, FORMAT_NAME, FORMAT_VERSION, GATE_UP, GLOBAL_SCALE, UP,
                     matches_ignore, output_names)
from .safetensors_io import INDEX_FILE, SINGLE_FILE, CheckpointError, TensorInfo, open_checkpoint, read_header

__all__ = [
    "convert_checkpoint", "load_nvfp4_experts", "quantize_checkpoint_experts", "read_nvfp4_config",
    "matches_ignore", "output_names", "ConversionSummary", "CheckpointError", "TensorInfo", "read_header",
    "open_checkpoint", "FORMAT_NAME", "FORMAT_VERSION", "CONFIG_NAME", "SINGLE_FILE", "INDEX_FILE", "GATE_UP", "UP",
    "DOWN", "DATA", "BLOCK_SCALE", "GLOBAL_SCALE", "DEFAULT_FP8_BLOCK",
]
