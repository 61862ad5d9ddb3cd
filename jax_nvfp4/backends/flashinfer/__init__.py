"""The ``flashinfer`` MoE backend: FlashInfer's Blackwell NVFP4 MoE kernels inside ``jax.jit``.

On sm_100a/sm_103a GPUs (B200/GB200, B300/GB300) ``jax_nvfp4.moe(..., backend="flashinfer")``
runs the NVFP4 MoE kernels that SGLang and vLLM serve with, as XLA FFI custom calls:

- ``"cutedsl"``: ``flashinfer.cute_dsl_fused_moe`` (the functional form of ``CuteDslMoEWrapper``),
  ``quant_mode="w4a16"`` (bf16 activations, weight-only alphas) and ``"w4a4"`` (activations
  quantized per token);
- ``"trtllm"``: the TensorRT-LLM-gen launcher behind ``trtllm_fp4_block_scale_routed_moe``
  (precomputed routing) and ``trtllm_fp4_block_scale_moe`` (routing from logits, in-kernel), w4a4
  with per-token activation scales.

The bridge is `jax-tvm-ffi <https://github.com/NVIDIA/jax-tvm-ffi>`_: each static configuration
registers one Python callable as an XLA FFI target (``arg_spec ["ctx.stream", "args", "rets"]``).
XLA hands it its CUDA stream and non-owning views of the buffers. ``trtllm`` calls FlashInfer's
compiled TVM-FFI launcher with those views directly (no PyTorch on the call path): it launches on
XLA's stream and its scratch allocations land in an explicit workspace output. ``cutedsl`` wraps
the views as PyTorch tensors on an ``ExternalStream`` over XLA's stream and calls FlashInfer's
Python entry point (its kernels are CuTe DSL kernels launched from Python). Why, and what that
means for CUDA graphs and memory: ``docs/blackwell.md``.

Nothing here imports ``flashinfer`` (or torch) until a kernel is traced on a supported GPU; the
gating in :meth:`FlashInferBackend.unavailable_reason` is cheap and import-free.

Modules: :mod:`.contract` (the pinned release, its signatures and enums, the custom calls' operands),
:mod:`.gating` (device and software checks, offline cubins), :mod:`.bridge` (the runtime and the XLA
custom calls), :mod:`.calls` (the JAX-side functions), :mod:`.backend` (the registered backend). Their names are re-exported here; to substitute one (a test's fake
device or launch), set it on the module that reads it (``gating.device_info``, ``bridge._launch``).
"""

from .contract import (ACTIVATION_TYPE, ARG_SPEC, CUTEDSL_ACTIVATION, ENV_ALLOW_DOWNLOAD, ENV_UNPINNED, FC2_INPUT_SCALE,
                       FLASHINFER_COMMIT, FLASHINFER_VERSION, JAX_TVM_FFI_VERSION, MAX_EXPERTS, MAX_TOP_K, OPERANDS,
                       RESULTS, ROUTING_INPUT_MODE, ROUTING_METHOD_TYPE, SIGNATURES, SUPPORTED_CAPABILITIES,
                       TRTLLM_ACTIVATION, TRTLLM_BMM_ARTIFACT, TRTLLM_BMM_HEADERS, TRTLLM_LAUNCHER_TYPES,
                       TRTLLM_ROUTING, Signature, check_operands, spec_shape, trtllm_workspace_bytes)
from .gating import cubin_dir, device_info, missing_trtllm_artifacts, software_unavailable_reason
from .bridge import (CallConfig, CuteDslCall, TorchRuntime, TrtllmCall, cutedsl_kwargs, runtime, set_runtime,
                     signature_problems, trtllm_args)
from .calls import (flashinfer_moe, flashinfer_moe_from_logits, kernel_num_experts, prepare_flashinfer_weights,
                    routing_unsupported_reason)
from .backend import FlashInferBackend  # (registers the backend)
