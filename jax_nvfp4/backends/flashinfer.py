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
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib
import importlib.metadata
import importlib.util
import os
import pathlib
import warnings
import weakref
from typing import Any, Callable

import jax
import jax.numpy as jnp

from ..expert_sharding import over_experts
from ..formats import NVFP4Experts
from ..quantize import quantize
from ..routing import shard_ids
from . import base
from .flashinfer_prepare import (KERNEL_ACTIVATIONS, KERNEL_MODES, KERNELS, PreparedWeights, check_prepared,
                                 layout_unsupported_reason, prepare_weights)

# ---------------------------------------------------------------------------------------------
# The pinned FlashInfer release and what we read in it

FLASHINFER_VERSION = "0.7.2.post1"
FLASHINFER_COMMIT = "beabf5004585b03da60e927bbb803acbaa62fe36"
JAX_TVM_FFI_VERSION = "0.1.3"
#: compute capability -> target. sm_107 (Rubin) is left out: not validated.
SUPPORTED_CAPABILITIES = {"10.0": "sm_100a (B200, GB200)", "10.3": "sm_103a (B300, GB300)"}
ENV_UNPINNED = "JAX_NVFP4_FLASHINFER_UNPINNED"  # "1": warn instead of failing on another version
ENV_ALLOW_DOWNLOAD = "JAX_NVFP4_FLASHINFER_ALLOW_DOWNLOAD"  # "1": let FlashInfer download cubins

# flashinfer/tllm_enums.py
ACTIVATION_TYPE = {"Swiglu": 3, "Geglu": 4, "Relu2": 6, "GegluTanh": 8}
ROUTING_METHOD_TYPE = {"Default": 0, "Renormalize": 1, "DeepSeekV3": 2, "Llama4": 3, "RenormalizeNaive": 4,
                       "TopK": 5}
ROUTING_INPUT_MODE = {"FromLogits": 0, "PackedPrecomputed": 1, "UnpackedPrecomputed": 2}
# flashinfer/artifacts.py: the TensorRT-LLM-gen batched-GEMM cubins the trtllm launcher loads, and
# flashinfer/jit/fused_moe.py: the headers its JIT build needs next to them.
TRTLLM_BMM_ARTIFACT = "8ee504560a86b6c72b8c941d3003e8fb1804b1b6/batched_gemm-fdba669-16ba8ed/"
TRTLLM_BMM_HEADERS = (
    "BatchedGemmEnums.h", "BatchedGemmInterface.h", "BatchedGemmOptions.h", "Enums.h",
    "GemmGatedActOptions.h", "GemmOptions.h", "KernelParams.h", "KernelParamsDecl.h", "KernelTraits.h",
    "TmaDescriptor.h", "trtllm/gen/CommonUtils.h", "trtllm/gen/CudaArchDecl.h",
    "trtllm/gen/CudaKernelLauncher.h", "trtllm/gen/DtypeDecl.h", "trtllm/gen/MmaDecl.h",
    "trtllm/gen/SfLayoutDecl.h", "trtllm/gen/SparsityDecl.h")


@dataclasses.dataclass(frozen=True)
class Signature:
    """Parameter names of one FlashInfer entry point at the pinned version, in order."""

    module: str
    params: tuple[str, ...]  # positional-or-keyword, in order
    required: int  # how many leading params have no default
    keyword_only: tuple[str, ...] = ()


#: The entry points this backend targets, read from flashinfer-python==FLASHINFER_VERSION.
#: ``tests/test_flashinfer.py`` checks every call we build against this table (and the table
#: against the wheel's sources when they are available); ``benchmarks/blackwell_check.py`` and the
#: runtime loader check it against the installed package with ``inspect.signature``.
SIGNATURES = {
    "cute_dsl_fused_moe": Signature(
        "flashinfer.fused_moe.cute_dsl.fused_moe",
        ("x", "x_sf", "token_selected_experts", "token_final_scales", "w1_weight", "w1_weight_sf",
         "w1_alpha", "fc2_input_scale", "w2_weight", "w2_weight_sf", "w2_alpha", "num_experts", "top_k",
         "num_local_experts", "local_expert_offset", "output_dtype", "use_fused_finalize", "moe_output",
         "aux_stream", "enable_pdl", "activation_type", "swiglu_alpha", "swiglu_beta", "swiglu_limit",
         "situ_beta", "situ_linear_beta"),
        13,
        ("quant_mode", "per_token_scale", "tactic", "localized_weights", "localized_streams",
         "localized_sm_count", "localized_memset_stream", "localized_allow_nonlocalized",
         "autotune_use_cuda_graph")),
    "trtllm_fp4_block_scale_moe": Signature(
        "flashinfer.fused_moe.core",
        ("routing_logits", "routing_bias", "hidden_states", "hidden_states_scale", "gemm1_weights",
         "gemm1_weights_scale", "gemm1_bias", "gemm1_alpha", "gemm1_beta", "gemm1_clamp_limit",
         "gemm2_weights", "gemm2_weights_scale", "gemm2_bias", "output1_scale_scalar",
         "output1_scale_gate_scalar", "output2_scale_scalar", "num_experts", "top_k", "n_group",
         "topk_group", "intermediate_size", "local_expert_offset", "local_num_experts",
         "routed_scaling_factor", "routing_method_type", "do_finalize", "enable_pdl", "activation_type",
         "per_token_scale", "output", "tune_max_num_tokens", "norm_topk_prob", "routing_replay_out",
         "num_fused_shared_experts", "valid_hidden_size", "valid_intermediate_size",
         "hidden_states_scale_layout"),
        24),
    "trtllm_fp4_block_scale_routed_moe": Signature(
        "flashinfer.fused_moe.core",
        ("topk_ids", "routing_bias", "hidden_states", "hidden_states_scale", "gemm1_weights",
         "gemm1_weights_scale", "gemm1_bias", "gemm1_alpha", "gemm1_beta", "gemm1_clamp_limit",
         "gemm2_weights", "gemm2_weights_scale", "gemm2_bias", "output1_scale_scalar",
         "output1_scale_gate_scalar", "output2_scale_scalar", "num_experts", "top_k", "n_group",
         "topk_group", "intermediate_size", "local_expert_offset", "local_num_experts",
         "routed_scaling_factor", "routing_method_type", "do_finalize", "enable_pdl", "activation_type",
         "per_token_scale", "output", "tune_max_num_tokens", "gemm1_lora_delta", "valid_hidden_size",
         "valid_intermediate_size", "num_fused_shared_experts", "hidden_states_scale_layout"),
        24),
    # The C++ TVM-FFI launcher both Python functions above call
    # (csrc/trtllm_fused_moe_kernel_launcher.cu, TVM_FFI_DLL_EXPORT_TYPED_FUNC), positional only:
    # get_trtllm_moe_sm100_module().moe_op.trtllm_fp4_block_scale_moe.
    "trtllm_fp4_block_scale_moe[C++]": Signature(
        "csrc/trtllm_fused_moe_kernel_launcher.cu",
        ("routing_input_mode", "routing_logits", "topk_ids", "topk_weights", "routing_bias",
         "hidden_states", "hidden_states_scale", "gemm1_weights", "gemm1_weights_scale", "gemm1_bias",
         "gemm1_lora_delta", "gemm1_alpha", "gemm1_beta", "gemm1_clamp_limit", "gemm2_weights",
         "gemm2_weights_scale", "gemm2_bias", "output1_scales_scalar", "output1_scales_gate_scalar",
         "output2_scales_scalar", "per_token_scales", "num_experts", "top_k", "num_fused_shared_experts",
         "n_group", "topk_group", "intermediate_size", "local_expert_offset", "local_num_experts",
         "routed_scaling_factor", "routing_method_type", "do_finalize", "enable_pdl", "act_type", "output",
         "config_index", "norm_topk_prob", "routing_replay_out", "da_routing_metadata",
         "da_body_workspace", "is_da_body_preparation", "valid_hidden_size", "valid_intermediate_size"),
        43),
}
#: C++ parameter types of the launcher, in order (checked against the source by the tests).
TRTLLM_LAUNCHER_TYPES = (
    "int64_t", "Optional<TensorView>", "TensorView", "TensorView", "Optional<TensorView>", "TensorView",
    "Optional<TensorView>", "TensorView", "TensorView", "Optional<TensorView>", "Optional<TensorView>",
    "Optional<TensorView>", "Optional<TensorView>", "Optional<TensorView>", "TensorView", "TensorView",
    "Optional<TensorView>", "Optional<TensorView>", "Optional<TensorView>", "Optional<TensorView>",
    "Optional<TensorView>", "int64_t", "int64_t", "Optional<int64_t>", "Optional<int64_t>",
    "Optional<int64_t>", "int64_t", "int64_t", "int64_t", "Optional<double>", "int64_t", "bool", "bool",
    "int64_t", "TensorView", "Array<int64_t>", "bool", "Optional<TensorView>", "Array<Tensor>",
    "Array<Tensor>", "bool", "Optional<int64_t>", "Optional<int64_t>")

# jax_nvfp4 names -> FlashInfer's
CUTEDSL_ACTIVATION = {
    "swiglu": ("Swiglu", {}),
    "geglu": ("GegluTanh", {}),  # tanh GELU, as jax_nvfp4's geglu
    "relu2": ("Relu2", {}),
    # gpt-oss: gate <= 7, up in [-7, 7], gate * sigmoid(1.702 gate) * (up + 1)
    "swiglu_oai": ("Swiglu", {"swiglu_alpha": 1.702, "swiglu_beta": 1.0, "swiglu_limit": 7.0}),
}
TRTLLM_ACTIVATION = {"swiglu": "Swiglu", "relu2": "Relu2"}  # its Geglu is erf GELU: not ours
TRTLLM_ROUTING = {"softmax_topk": "Default", "renormalize": "Renormalize",
                  "renormalize_naive": "RenormalizeNaive", "deepseek_v3": "DeepSeekV3"}
FC2_INPUT_SCALE = 1.0 / 2688.0  # per-token GEMM2-input quantization: 1 / (448 * 6)
MAX_EXPERTS = 512  # routing kernels (NumNemotronExperts)
MAX_TOP_K = 32  # routing kernels (MaxSupportedTopExperts)
ARG_SPEC = ("ctx.stream", "args", "rets")


# ---------------------------------------------------------------------------------------------
# The XLA custom call: operands and results of each kernel family (names, dtypes, shapes)
#
# Shapes are written in T (tokens), H, I, E (local experts), M1 (GEMM1 rows: 2I or I), k (top_k),
# EG (router logits' experts), W (workspace bytes). The cutedsl path passes E4M3 scales as their uint8
# bytes and views them as float8_e4m3fn in PyTorch (no reliance on fp8 DLPack import); the trtllm
# launcher checks for float8_e4m3fn, which jax-tvm-ffi passes through.

OPERANDS = {
    ("cutedsl", "w4a16"): (
        ("x", "bfloat16", "T,H"), ("topk_ids", "int32", "T,k"), ("topk_weights", "float32", "T,k"),
        ("w1", "uint8", "E,M1,H/2"), ("w1_scales", "uint8", "E,M1,H/16"), ("w1_alpha", "float32", "E"),
        ("w2", "uint8", "E,H,I/2"), ("w2_scales", "uint8", "E,H,I/16"), ("w2_alpha", "float32", "E")),
    ("cutedsl", "w4a4"): (
        ("x_q", "uint8", "T,H/2"), ("x_scales", "uint8", "T,H/16"), ("x_global", "float32", "T"),
        ("topk_ids", "int32", "T,k"), ("topk_weights", "float32", "T,k"),
        ("w1", "uint8", "E,M1,H/2"), ("w1_scales", "uint8", "E,M1,H/16"), ("w1_alpha", "float32", "E"),
        ("w2", "uint8", "E,H,I/2"), ("w2_scales", "uint8", "E,H,I/16"), ("w2_alpha", "float32", "E"),
        ("fc2_input_scale", "float32", "1")),
    ("trtllm", "precomputed"): (
        ("topk_ids", "int32", "T,k"), ("topk_weights", "float32", "T,k"),
        ("x_q", "uint8", "T,H/2"), ("x_scales", "float8_e4m3fn", "T,H/16"), ("x_global", "float32", "T"),
        ("w1", "uint8", "E,M1,H/2"), ("w1_scales", "float8_e4m3fn", "E,M1,H/16"), ("w1_alpha", "float32", "E"),
        ("w2", "uint8", "E,H,I/2"), ("w2_scales", "float8_e4m3fn", "E,H,I/16"), ("w2_alpha", "float32", "E")),
    ("trtllm", "logits"): (
        ("router_logits", "float32|bfloat16", "T,EG"), ("routing_bias", "float32|bfloat16", "EG?"),
        ("x_q", "uint8", "T,H/2"), ("x_scales", "float8_e4m3fn", "T,H/16"), ("x_global", "float32", "T"),
        ("w1", "uint8", "E,M1,H/2"), ("w1_scales", "float8_e4m3fn", "E,M1,H/16"), ("w1_alpha", "float32", "E"),
        ("w2", "uint8", "E,H,I/2"), ("w2_scales", "float8_e4m3fn", "E,H,I/16"), ("w2_alpha", "float32", "E")),
}
RESULTS = {
    "cutedsl": (("out", "bfloat16", "T,H"),),
    "trtllm": (("out", "bfloat16", "T,H"), ("workspace", "uint8", "W")),
    "trtllm-logits": (("out", "bfloat16", "T,H"), ("topk_ids", "int32", "T,k"),
                      ("topk_weights", "bfloat16", "T,k"), ("workspace", "uint8", "W")),
}


def spec_shape(template: str, env: dict) -> tuple[int, ...]:
    """Evaluate a shape template such as ``"E,M1,H/2"`` with sizes ``env``."""
    dims = []
    for term in template.rstrip("?").split(","):
        name, _, div = term.partition("/")
        v = int(name) if name.isdigit() else env[name]
        dims.append(v // int(div) if div else v)
    return tuple(dims)


def check_operands(spec, operands: dict, env: dict) -> None:
    """Raise ValueError unless ``operands`` (name -> array) match ``spec`` exactly (names, order,
    dtypes, shapes). Optional entries (template ending in ``?``) may be absent."""
    names = [n for n, _, s in spec if n in operands or not s.endswith("?")]
    if list(operands) != names:
        raise ValueError(f"flashinfer operands {list(operands)} != {names}")
    for name, dtypes, template in spec:
        if name not in operands:
            continue
        v = operands[name]
        want = spec_shape(template, env)
        if jnp.dtype(v.dtype).name not in dtypes.split("|") or tuple(v.shape) != want:
            raise ValueError(f"flashinfer operand {name}: want {dtypes} {list(want)}, got {v.dtype} "
                             f"{list(v.shape)}")


def trtllm_workspace_bytes(tokens: int, hidden: int, intermediate: int, local_experts: int, top_k: int,
                           num_experts: int, gated: bool = True) -> int:
    """Upper bound of the scratch memory the trtllm launcher allocates (``alloc_tensor``) per call.

    Sized for the largest token tile (256) the FP4 launcher may pick: routing buffers (int32),
    GEMM1 output and scales, activation output and scales, GEMM2 output (bf16) and the batched-GEMM
    workspaces (bounded by one fp32 [padded tokens, max(H, M1)] buffer each), plus 128-byte
    alignment for each of the launcher's allocations. ``benchmarks/blackwell_check.py`` prints the
    measured peak next to this bound.
    """
    tile = 256
    pairs = tokens * top_k
    padded = -(-(pairs + min(pairs, local_experts) * (tile - 1)) // tile) * tile + tile
    ctas = padded // 8 + local_experts + 1
    m1 = (2 if gated else 1) * intermediate
    ints = 4 * (4 * num_experts + 6 * pairs + 2 * padded + 2 * ctas + 1024)
    gemm1 = padded * m1 * 2 + padded * m1 // 8
    act = padded * intermediate * 2 + padded * intermediate // 8 + 4 * padded
    gemm2 = padded * hidden * 2
    bmm = 2 * padded * max(hidden, m1) * 4
    total = ints + gemm1 + act + gemm2 + bmm + 128 * 128
    return -(-total // (1 << 20)) * (1 << 20)


# ---------------------------------------------------------------------------------------------
# Gating: cheap, import-free checks first


def device_info() -> tuple[str, str | None, str]:
    """(platform, compute capability or None, device kind) of the default JAX device."""
    try:
        dev = jax.devices()[0]
    except RuntimeError:
        return "none", None, "no device"
    kind = getattr(dev, "device_kind", dev.platform)
    if dev.platform != "gpu":
        return dev.platform, None, kind
    version = str(getattr(dev.client, "platform_version", "")).lower()
    if "rocm" in version or "hip" in version:
        return "rocm", None, kind
    cc = getattr(dev, "compute_capability", None)
    return "cuda", (str(cc) if cc else None), kind


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


_find_spec = importlib.util.find_spec


def software_unavailable_reason() -> str | None:
    """Whether the optional packages are installed at the pinned versions (no imports)."""
    missing = [mod for mod in ("flashinfer", "jax_tvm_ffi", "tvm_ffi", "torch") if _find_spec(mod) is None]
    if missing:
        return (f"{', '.join(missing)} not installed: install the optional dependencies with "
                f"`pip install 'jax_nvfp4[blackwell]'` (flashinfer-python=={FLASHINFER_VERSION}, "
                f"jax-tvm-ffi=={JAX_TVM_FFI_VERSION}, and a CUDA build of torch)")
    if os.environ.get(ENV_UNPINNED) != "1":
        for dist, want in (("flashinfer-python", FLASHINFER_VERSION), ("jax-tvm-ffi", JAX_TVM_FFI_VERSION)):
            have = _dist_version(dist)
            if have is not None and have != want:
                return (f"{dist} {have} is installed, but the flashinfer backend targets {dist}=={want} "
                        f"(its call signatures were read from that release); install it, or set "
                        f"{ENV_UNPINNED}=1 to try another version")
    return None


# ---------------------------------------------------------------------------------------------
# Offline setup: TensorRT-LLM-gen cubins


def cubin_dir() -> pathlib.Path:
    """Where FlashInfer looks for downloaded artifacts (same order as ``flashinfer.jit.env``):
    ``$FLASHINFER_CUBIN_DIR``, else a ``flashinfer-cubin`` package of the same version, else
    ``$FLASHINFER_WORKSPACE_BASE`` (default ``~``) ``/.cache/flashinfer/cubins``."""
    env = os.environ.get("FLASHINFER_CUBIN_DIR")
    if env:
        return pathlib.Path(env)
    if _dist_version("flashinfer-cubin") == FLASHINFER_VERSION and importlib.util.find_spec("flashinfer_cubin"):
        import flashinfer_cubin  # a data package: cheap

        return pathlib.Path(flashinfer_cubin.get_cubin_dir())
    base = pathlib.Path(os.environ.get("FLASHINFER_WORKSPACE_BASE", pathlib.Path.home().as_posix()))
    return base / ".cache" / "flashinfer" / "cubins"


def missing_trtllm_artifacts(root: pathlib.Path | None = None) -> list[str]:
    """Files the trtllm kernels need that are not on disk ([] when the offline setup is complete).

    Checks the BMM artifact directory of the pinned release: ``checksums.txt``,
    ``include/flashinferMetaInfo.h``, the export headers, and every ``.cubin`` that
    ``checksums.txt`` lists (by name).
    """
    root = cubin_dir() if root is None else pathlib.Path(root)
    bmm = root / TRTLLM_BMM_ARTIFACT
    missing = []
    checksums = bmm / "checksums.txt"
    wanted = ["include/flashinferMetaInfo.h"] + [f"include/trtllmGen_bmm_export/{h}"
                                                 for h in TRTLLM_BMM_HEADERS]
    missing += [str(bmm / w) for w in wanted if not (bmm / w).is_file()]
    if not checksums.is_file():
        return [str(checksums)] + missing
    listed = []
    for line in checksums.read_text().splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].endswith(".cubin"):
            listed.append(parts[1])
    if not listed:
        return missing + [f"{checksums} lists no .cubin files"]
    have = {p.name for p in bmm.rglob("*.cubin")}
    missing += [str(bmm / name) for name in listed if pathlib.PurePosixPath(name).name not in have]
    return missing


def _offline_error(missing: list[str]) -> RuntimeError:
    shown = "\n  ".join(missing[:8]) + (f"\n  ... and {len(missing) - 8} more" if len(missing) > 8 else "")
    return RuntimeError(
        "The trtllm kernels need FlashInfer's TensorRT-LLM-gen cubins and headers, and jax_nvfp4 does not "
        f"let FlashInfer download them at run time. Missing under {cubin_dir()}:\n  {shown}\n"
        f"Fix: on a machine with network access and flashinfer-python=={FLASHINFER_VERSION}, run "
        "`python -m flashinfer download-cubin` (or install flashinfer-cubin of the same version), copy "
        "the cubin directory here and set FLASHINFER_CUBIN_DIR to it. See docs/blackwell.md, 'Offline setup'.")


# ---------------------------------------------------------------------------------------------
# The runtime: FlashInfer, torch and the bridge, loaded lazily (tests substitute a fake)


class TorchRuntime:
    """The real runtime: imports flashinfer/torch/jax-tvm-ffi and checks them against the pins."""

    platform = "gpu"

    def __init__(self):
        if os.environ.get(ENV_ALLOW_DOWNLOAD) != "1":
            os.environ.setdefault("FLASHINFER_NO_DOWNLOAD", "1")  # read by flashinfer at call time
        import jax_tvm_ffi
        import torch
        import tvm_ffi

        import flashinfer

        self.torch, self.tvm_ffi, self.jax_tvm_ffi, self.flashinfer = torch, tvm_ffi, jax_tvm_ffi, flashinfer
        if flashinfer.__version__ != FLASHINFER_VERSION:
            msg = (f"flashinfer {flashinfer.__version__} is installed; the flashinfer backend targets "
                   f"{FLASHINFER_VERSION} (signatures in jax_nvfp4.backends.flashinfer.SIGNATURES)")
            if os.environ.get(ENV_UNPINNED) != "1":
                raise RuntimeError(msg + f"; set {ENV_UNPINNED}=1 to try it anyway")
            warnings.warn(msg, stacklevel=3)
        problems = self.check_api()
        if problems:
            raise RuntimeError("the installed FlashInfer does not match the signatures this backend was "
                               "written for:\n  " + "\n  ".join(problems))
        from flashinfer.cute_dsl.utils import convert_sf_to_mma_layout

        self._mma = convert_sf_to_mma_layout
        self.float8_e4m3fn = torch.float8_e4m3fn
        self._cute = importlib.import_module("flashinfer.fused_moe.cute_dsl.fused_moe").cute_dsl_fused_moe
        self.bfloat16 = torch.bfloat16
        self._trtllm = None

    def check_api(self) -> list[str]:
        """Compare SIGNATURES and the enums with the installed flashinfer (inspect.signature)."""
        import inspect

        from flashinfer import tllm_enums
        from flashinfer.cute_dsl.availability import is_cute_dsl_available
        from flashinfer.fused_moe import core

        if not is_cute_dsl_available():
            return ["FlashInfer reports the CuTe DSL (nvidia-cutlass-dsl) unavailable"]
        cute = importlib.import_module("flashinfer.fused_moe.cute_dsl.fused_moe")

        problems = []
        for name, fn in (("cute_dsl_fused_moe", cute.cute_dsl_fused_moe),
                         ("trtllm_fp4_block_scale_moe", core.trtllm_fp4_block_scale_moe),
                         ("trtllm_fp4_block_scale_routed_moe", core.trtllm_fp4_block_scale_routed_moe)):
            problems += signature_problems(name, inspect.signature(inspect.unwrap(fn)))
        for table, enum in ((ACTIVATION_TYPE, tllm_enums.ActivationType),
                            (ROUTING_METHOD_TYPE, tllm_enums.RoutingMethodType),
                            (ROUTING_INPUT_MODE, tllm_enums.RoutingInputMode)):
            for key, value in table.items():
                if int(getattr(enum, key)) != value:
                    problems.append(f"{enum.__name__}.{key} is {int(getattr(enum, key))}, not {value}")
        return problems

    # tensors and streams
    def as_tensor(self, t):
        return self.torch.from_dlpack(t)

    def stream(self, stream_ptr: int, like):
        stack = contextlib.ExitStack()
        stack.enter_context(self.torch.cuda.device(like.device))
        xla_stream = self.torch.cuda.ExternalStream(stream_ptr, device=like.device)
        stack.enter_context(self.torch.cuda.stream(xla_stream))
        return stack

    # kernels
    def convert_sf_to_mma_layout(self, sf, *, m, k, num_groups, sf_vec_size):
        return self._mma(sf, m=m, k=k, num_groups=num_groups, sf_vec_size=sf_vec_size)

    def cute_dsl_fused_moe(self, **kwargs):
        return self._cute(**kwargs)

    def trtllm_launcher(self) -> Callable:
        """The compiled TVM-FFI function ``trtllm_fp4_block_scale_moe`` (module built or loaded once)."""
        if self._trtllm is None:
            env = importlib.import_module("flashinfer.jit.env")
            missing = missing_trtllm_artifacts(pathlib.Path(str(env.FLASHINFER_CUBIN_DIR)))
            if missing:
                raise _offline_error(missing)
            from flashinfer.fused_moe.core import get_trtllm_moe_sm100_module

            try:
                module = get_trtllm_moe_sm100_module()
            except Exception as err:  # JIT build (nvcc) or AOT load failure
                raise RuntimeError(
                    "could not build or load FlashInfer's TensorRT-LLM-gen MoE module "
                    "(fused_moe_trtllm_sm100): it needs nvcc >= 12.8 for FlashInfer's JIT, or the "
                    f"flashinfer-jit-cache wheel of version {FLASHINFER_VERSION}; see docs/blackwell.md"
                ) from err
            self._trtllm = module.moe_op.trtllm_fp4_block_scale_moe
        return self._trtllm

    # bridge
    def register(self, name: str, fn: Callable, *, allow_cuda_graph: bool, workspace: bool):
        ffi_fn = self.tvm_ffi.convert(fn)
        self.jax_tvm_ffi.register_ffi_target(name, ffi_fn, list(ARG_SPEC), platform=self.platform,
                                             allow_cuda_graph=allow_cuda_graph, pass_owned_tensor=True,
                                             use_last_output_for_alloc_workspace=workspace)
        return ffi_fn


def signature_problems(name: str, sig) -> list[str]:
    """Differences between ``SIGNATURES[name]`` and an ``inspect.Signature``."""
    want = SIGNATURES[name]
    pos = [p.name for p in sig.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    kwo = [p.name for p in sig.parameters.values() if p.kind == p.KEYWORD_ONLY]
    required = sum(1 for p in sig.parameters.values()
                   if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty)
    problems = []
    if tuple(pos) != want.params:
        problems.append(f"{name}: parameters {pos} != {list(want.params)}")
    if tuple(kwo) != want.keyword_only:
        problems.append(f"{name}: keyword-only {kwo} != {list(want.keyword_only)}")
    if required != want.required:
        problems.append(f"{name}: {required} required parameters, expected {want.required}")
    return problems


_RUNTIME: Any = None


def runtime():
    """The loaded runtime (imports flashinfer on first use)."""
    global _RUNTIME
    if _RUNTIME is None:
        _RUNTIME = TorchRuntime()
    return _RUNTIME


def set_runtime(rt) -> Any:
    """Replace the runtime (tests: a fake FlashInfer); returns the previous one."""
    global _RUNTIME
    prev, _RUNTIME = _RUNTIME, rt
    return prev


# ---------------------------------------------------------------------------------------------
# What FlashInfer receives: built from the buffers XLA hands the callback


@dataclasses.dataclass(frozen=True)
class CallConfig:
    """Static description of one registered custom call (everything but the array shapes)."""

    kernel: str  # "cutedsl" | "trtllm"
    mode: str  # "w4a16" | "w4a4"
    activation: str
    routing: str  # "precomputed" | "logits"
    num_experts: int  # the kernel's expert space (ids in [0, num_experts))
    top_k: int
    local_expert_offset: int
    local_num_experts: int
    hidden: int
    intermediate: int
    gated: bool
    routing_method: int = 0
    n_group: int | None = None
    topk_group: int | None = None
    routed_scaling_factor: float | None = None
    deterministic: bool = False
    enable_pdl: bool = True
    cuda_graph: bool = False
    tactic: tuple[int, int] | None = None

    @property
    def operand_spec(self):
        return OPERANDS[(self.kernel, self.mode if self.kernel == "cutedsl" else self.routing)]

    @property
    def result_spec(self):
        if self.kernel == "cutedsl":
            return RESULTS["cutedsl"]
        return RESULTS["trtllm-logits" if self.routing == "logits" else "trtllm"]

    @property
    def m1(self) -> int:
        return (2 if self.gated else 1) * self.intermediate


def cutedsl_kwargs(cfg: CallConfig, t: dict, rt) -> dict:
    """Keyword arguments of ``cute_dsl_fused_moe`` from the named buffers ``t``."""
    act, extra = CUTEDSL_ACTIVATION[cfg.activation]
    e, h, i = cfg.local_num_experts, cfg.hidden, cfg.intermediate
    w4a16 = cfg.mode == "w4a16"
    e4m3 = rt.float8_e4m3fn  # scale bytes arrive as uint8
    kw = dict(
        x=t["x"] if w4a16 else t["x_q"],
        x_sf=None if w4a16 else t["x_scales"].view(e4m3).unsqueeze(-1),  # linear [T, H/16, 1]
        token_selected_experts=t["topk_ids"], token_final_scales=t["topk_weights"],
        w1_weight=t["w1"],
        w1_weight_sf=rt.convert_sf_to_mma_layout(t["w1_scales"].view(e4m3), m=cfg.m1, k=h, num_groups=e,
                                                 sf_vec_size=16),
        w1_alpha=t["w1_alpha"],
        fc2_input_scale=None if w4a16 else t["fc2_input_scale"],
        w2_weight=t["w2"],
        w2_weight_sf=rt.convert_sf_to_mma_layout(t["w2_scales"].view(e4m3), m=h, k=i, num_groups=e,
                                                 sf_vec_size=16),
        w2_alpha=t["w2_alpha"],
        num_experts=cfg.num_experts, top_k=cfg.top_k, num_local_experts=e,
        local_expert_offset=cfg.local_expert_offset, output_dtype=rt.bfloat16,
        use_fused_finalize=not cfg.deterministic, moe_output=t["out"], enable_pdl=cfg.enable_pdl,
        activation_type=ACTIVATION_TYPE[act], quant_mode=cfg.mode,
        per_token_scale=None if w4a16 else t["x_global"])
    kw.update(extra)
    return kw


def trtllm_args(cfg: CallConfig, t: dict) -> dict:
    """Arguments of the trtllm launcher (``SIGNATURES["trtllm_fp4_block_scale_moe[C++]"]`` names),
    as ``trtllm_fp4_block_scale_routed_moe`` / ``trtllm_fp4_block_scale_moe`` pass them."""
    logits = cfg.routing == "logits"
    return dict(
        routing_input_mode=ROUTING_INPUT_MODE["FromLogits" if logits else "UnpackedPrecomputed"],
        routing_logits=t["router_logits"] if logits else None,
        topk_ids=t["topk_ids"], topk_weights=t["topk_weights"],  # outputs when routing from logits
        routing_bias=t.get("routing_bias"),
        hidden_states=t["x_q"], hidden_states_scale=t["x_scales"],
        gemm1_weights=t["w1"], gemm1_weights_scale=t["w1_scales"], gemm1_bias=None, gemm1_lora_delta=None,
        gemm1_alpha=None, gemm1_beta=None, gemm1_clamp_limit=None,
        gemm2_weights=t["w2"], gemm2_weights_scale=t["w2_scales"], gemm2_bias=None,
        # per-token mode: the static activation scales are 1, so these are the weights' decode scales
        output1_scales_scalar=t["w1_alpha"], output1_scales_gate_scalar=t["w1_alpha"],
        output2_scales_scalar=t["w2_alpha"], per_token_scales=t["x_global"],
        num_experts=cfg.num_experts, top_k=cfg.top_k, num_fused_shared_experts=0,
        n_group=cfg.n_group, topk_group=cfg.topk_group, intermediate_size=cfg.intermediate,
        local_expert_offset=cfg.local_expert_offset, local_num_experts=cfg.local_num_experts,
        routed_scaling_factor=cfg.routed_scaling_factor, routing_method_type=cfg.routing_method,
        do_finalize=True, enable_pdl=cfg.enable_pdl,
        act_type=ACTIVATION_TYPE[TRTLLM_ACTIVATION[cfg.activation]],
        output=t["out"], config_index=list(cfg.tactic or (-1, -1)), norm_topk_prob=True,
        routing_replay_out=None, da_routing_metadata=[], da_body_workspace=[], is_da_body_preparation=False,
        valid_hidden_size=None, valid_intermediate_size=None)


class CuteDslCall:
    """The XLA FFI callback of a ``cutedsl`` configuration."""

    def __init__(self, cfg: CallConfig, rt, names: tuple[str, ...]):
        self.cfg, self.rt, self.names = cfg, rt, names

    def __call__(self, stream, *buffers):
        rt = self.rt
        t = {n: rt.as_tensor(b) for n, b in zip(self.names, buffers)}
        with rt.stream(stream, t["out"]):
            rt.cute_dsl_fused_moe(**cutedsl_kwargs(self.cfg, t, rt))


class TrtllmCall:
    """The XLA FFI callback of a ``trtllm`` configuration: XLA's buffers go to the launcher as they
    are (TVM-FFI tensors), so it runs on the stream and allocates from the workspace that jax-tvm-ffi
    installed for this call."""

    def __init__(self, cfg: CallConfig, rt, names: tuple[str, ...]):
        self.cfg, self.rt, self.names = cfg, rt, names
        self.launcher = rt.trtllm_launcher()  # build/load the module at trace time, not in XLA's run

    def __call__(self, stream, *buffers):
        args = trtllm_args(self.cfg, dict(zip(self.names, buffers)))
        self.launcher(*[args[n] for n in SIGNATURES["trtllm_fp4_block_scale_moe[C++]"].params])


_TARGETS: dict = {}


def _target(cfg: CallConfig, names: tuple[str, ...]) -> str:
    rt = runtime()
    key = (cfg, names, getattr(rt, "platform", "gpu"), id(rt))
    if key not in _TARGETS:
        digest = hashlib.sha1(repr(key[:3]).encode()).hexdigest()[:12]
        name = f"jax_nvfp4_flashinfer_{cfg.kernel}_{digest}_{len(_TARGETS)}"
        call = (CuteDslCall if cfg.kernel == "cutedsl" else TrtllmCall)(cfg, rt, names)
        handle = rt.register(name, call, allow_cuda_graph=cfg.kernel == "trtllm" and cfg.cuda_graph,
                             workspace=cfg.kernel == "trtllm")
        _TARGETS[key] = (name, call, handle)  # keep the callback alive
    return _TARGETS[key][0]


def _launch(cfg: CallConfig, operands: dict, env: dict):
    check_operands(cfg.operand_spec, operands, env)
    results = [jax.ShapeDtypeStruct(spec_shape(s, env), jnp.dtype(d)) for _, d, s in cfg.result_spec]
    names = tuple(operands) + tuple(n for n, _, _ in cfg.result_spec if n != "workspace")
    target = _target(cfg, names)
    return jax.ffi.ffi_call(target, results)(*operands.values())


# ---------------------------------------------------------------------------------------------
# JAX side


def _kernel_routing(topk_ids, topk_weights, offset: int, local: int, num_experts: int | None):
    """Ids and weights in the kernels' expert space, and its size.

    With the global expert count known (routing from logits) ids pass through. Otherwise
    ids that cannot be local (negative padding, ids >= offset + local) are mapped to a sentinel
    expert outside the local range, with weight 0, in a space of ``round_up(offset + local + 1, 4)``
    experts (or ``offset + local`` rounded up when expert 0 is foreign and serves as sentinel).
    """
    ids = topk_ids.astype(jnp.int32)
    wts = topk_weights.astype(jnp.float32)
    if num_experts is not None:
        return ids, wts, num_experts
    end = offset + local
    sentinel = 0 if offset > 0 else end
    e_k = -(-(end + (0 if offset > 0 else 1)) // 4) * 4
    bad = (ids < 0) | (ids >= end)
    return jnp.where(bad, sentinel, ids), jnp.where(bad, 0.0, wts), e_k


def kernel_num_experts(offset: int, local: int, num_experts: int | None) -> int:
    """Size of the kernels' expert space (see :func:`_kernel_routing`)."""
    if num_experts is not None:
        return num_experts
    return -(-(offset + local + (0 if offset > 0 else 1)) // 4) * 4


_quantize_tokens = jax.jit(lambda x: quantize(x, per_token=True))


def _scale_bytes(s, kernel):
    return jax.lax.bitcast_convert_type(s, jnp.uint8) if kernel == "cutedsl" else s


def _activation_operands(x, mode, kernel):
    if mode == "w4a16":
        return {"x": x}
    q = _quantize_tokens(x)  # jax_nvfp4's exact quantizer: FlashInfer's reference bytes
    return {"x_q": q.data, "x_scales": _scale_bytes(q.scales, kernel),
            "x_global": q.global_scale.astype(jnp.float32)}


def _weight_operands(w: PreparedWeights):
    return {"w1": w.w1, "w1_scales": _scale_bytes(w.w1_scales, w.kernel), "w1_alpha": w.w1_alpha,
            "w2": w.w2, "w2_scales": _scale_bytes(w.w2_scales, w.kernel), "w2_alpha": w.w2_alpha}


def _env(x, w: PreparedWeights, k: int, **extra) -> dict:
    return dict(T=x.shape[0], H=w.hidden_size, I=w.intermediate_size, E=w.num_experts,
                M1=w.w1.shape[1], k=k, **extra)


def _check_x(x, w: PreparedWeights):
    if jnp.dtype(x.dtype) != jnp.bfloat16 or x.ndim != 2 or x.shape[1] != w.hidden_size:
        raise ValueError(f"x must be bfloat16 [T, H={w.hidden_size}], got {x.dtype} {list(x.shape)}")


def flashinfer_moe(x, weights: PreparedWeights, topk_ids, topk_weights, *, mode: str | None = None,
                   activation: str = "swiglu", local_expert_offset: int = 0, num_experts: int | None = None,
                   deterministic: bool = False, enable_pdl: bool = True, cuda_graph: bool = False,
                   tactic: tuple[int, int] | None = None, workspace_bytes: int | None = None):
    """The expert part of the MoE layer on FlashInfer's kernels (routing given), jit-able.

    Parameters
    ----------
    x : bfloat16 ``[T, H]``
    weights : PreparedWeights (:func:`prepare_flashinfer_weights`)
    topk_ids : int ``[T, k]`` global expert ids (negative: padding); topk_weights : float ``[T, k]``
    mode : ``"w4a16"`` (cutedsl) or ``"w4a4"``; default: the first mode of ``weights.kernel``
    activation : one of ``weights.activations``
    local_expert_offset : int (static)
    num_experts : int, optional (static)
        The global number of experts when every id is known to be in ``[0, num_experts)``.
    deterministic : bool
        cutedsl: a fixed-order finalize (``use_fused_finalize=False``) instead of atomics.
    enable_pdl, cuda_graph, tactic, workspace_bytes
        trtllm: programmatic dependent launch; mark the call CUDA-graph compatible; a fixed
        ``(tile_N, config)`` tactic (default: the launcher's heuristic); the workspace size
        (default :func:`trtllm_workspace_bytes`).

    Returns
    -------
    bfloat16 ``[T, H]``.
    """
    if not isinstance(weights, PreparedWeights):
        raise TypeError("weights must be PreparedWeights (prepare_flashinfer_weights), got "
                        f"{type(weights).__name__}")
    mode = check_prepared(weights, mode, activation)
    _check_x(x, weights)
    t, k = topk_ids.shape
    if t == 0:
        return jnp.zeros(x.shape, jnp.bfloat16)
    e = weights.num_experts
    ids, wts, e_k = _kernel_routing(topk_ids, topk_weights, local_expert_offset, e, num_experts)
    if e_k > MAX_EXPERTS or not 1 <= k <= min(MAX_TOP_K, e_k):
        raise ValueError(f"the kernels route over at most {MAX_EXPERTS} experts with top_k <= {MAX_TOP_K}; "
                         f"this call needs {e_k} experts (offset {local_expert_offset} + {e} local), "
                         f"top_k {k}")
    cfg = CallConfig(kernel=weights.kernel, mode=mode, activation=activation, routing="precomputed",
                     num_experts=e_k, top_k=k, local_expert_offset=local_expert_offset, local_num_experts=e,
                     hidden=weights.hidden_size, intermediate=weights.intermediate_size, gated=weights.gated,
                     deterministic=deterministic, enable_pdl=enable_pdl, cuda_graph=cuda_graph,
                     tactic=None if tactic is None else tuple(tactic))
    acts = _activation_operands(x, mode, weights.kernel)
    routing = {"topk_ids": ids, "topk_weights": wts}
    if weights.kernel == "cutedsl":
        operands = {**acts, **routing, **_weight_operands(weights)}
        if mode == "w4a4":
            operands["fc2_input_scale"] = jnp.full((1,), FC2_INPUT_SCALE, jnp.float32)
        return _launch(cfg, operands, _env(x, weights, k))[0]
    w = workspace_bytes or trtllm_workspace_bytes(t, weights.hidden_size, weights.intermediate_size, e, k, e_k,
                                                  weights.gated)
    operands = {**routing, **acts, **_weight_operands(weights)}
    return _launch(cfg, operands, _env(x, weights, k, W=w))[0]


def routing_unsupported_reason(routing: str, *, num_experts: int, top_k: int, bias, n_group, topk_group,
                               routed_scaling_factor) -> str | None:
    """None if the trtllm launcher can route ``routing`` from logits in-kernel, else why not."""
    if routing not in TRTLLM_ROUTING:
        return f"routing {routing!r} has no in-kernel equivalent (in-kernel: {tuple(TRTLLM_ROUTING)})"
    if not isinstance(routed_scaling_factor, (int, float)) or isinstance(routed_scaling_factor, bool):
        return "routed_scaling_factor must be a Python number for in-kernel routing"
    if num_experts > MAX_EXPERTS or top_k > MAX_TOP_K:
        return f"in-kernel routing handles at most {MAX_EXPERTS} experts and top_k {MAX_TOP_K}"
    if routing != "deepseek_v3":
        if bias is not None or routed_scaling_factor != 1:
            return f"in-kernel {routing!r} routing takes no bias and no routed_scaling_factor"
        return None
    n_group = n_group or 1
    topk_group = topk_group or n_group
    if n_group > 1:
        if n_group > 8 or num_experts // n_group > 32 or topk_group > 4 or num_experts % 4 or top_k > 22:
            return ("in-kernel deepseek_v3 routing needs n_group <= 8, E/n_group <= 32, topk_group <= 4, "
                    "E % 4 == 0 and top_k <= 22")
    return None


def flashinfer_moe_from_logits(x, weights: PreparedWeights, router_logits, *, routing: str, top_k: int,
                               bias=None, n_group: int | None = None, topk_group: int | None = None,
                               routed_scaling_factor: float = 1.0, activation: str = "swiglu",
                               local_expert_offset: int = 0, enable_pdl: bool = True, cuda_graph: bool = False,
                               tactic: tuple[int, int] | None = None, workspace_bytes: int | None = None):
    """MoE with routing computed inside the trtllm launcher (``trtllm_fp4_block_scale_moe``), w4a4.

    Returns ``(out bf16 [T, H], topk_ids int32 [T, k], topk_weights float32 [T, k])``; the routing
    kernel computes its weights in bf16.
    """
    if not isinstance(weights, PreparedWeights) or weights.kernel != "trtllm":
        raise ValueError("routing from logits runs on weights prepared with kernel='trtllm'")
    mode = check_prepared(weights, "w4a4", activation)
    _check_x(x, weights)
    t, eg = router_logits.shape
    why = routing_unsupported_reason(routing, num_experts=eg, top_k=top_k, bias=bias, n_group=n_group,
                                     topk_group=topk_group, routed_scaling_factor=routed_scaling_factor)
    if why:
        raise ValueError(why)
    if t == 0:
        return (jnp.zeros(x.shape, jnp.bfloat16), jnp.zeros((0, top_k), jnp.int32),
                jnp.zeros((0, top_k), jnp.float32))
    ds = routing == "deepseek_v3"
    cfg = CallConfig(kernel="trtllm", mode=mode, activation=activation, routing="logits", num_experts=eg,
                     top_k=top_k, local_expert_offset=local_expert_offset,
                     local_num_experts=weights.num_experts, hidden=weights.hidden_size,
                     intermediate=weights.intermediate_size, gated=weights.gated,
                     routing_method=ROUTING_METHOD_TYPE[TRTLLM_ROUTING[routing]],
                     n_group=(n_group or 1) if ds else None,
                     topk_group=(topk_group or n_group or 1) if ds else None,
                     routed_scaling_factor=float(routed_scaling_factor) if ds else None,
                     enable_pdl=enable_pdl, cuda_graph=cuda_graph,
                     tactic=None if tactic is None else tuple(tactic))
    logits = router_logits if jnp.dtype(router_logits.dtype) in (jnp.float32, jnp.bfloat16) else \
        router_logits.astype(jnp.float32)
    operands = {"router_logits": logits}
    if bias is not None:
        operands["routing_bias"] = bias if jnp.dtype(bias.dtype) in (jnp.float32, jnp.bfloat16) else \
            bias.astype(jnp.float32)
    operands.update(_activation_operands(x, mode, "trtllm"))
    operands.update(_weight_operands(weights))
    w = workspace_bytes or trtllm_workspace_bytes(t, weights.hidden_size, weights.intermediate_size,
                                                  weights.num_experts, top_k, eg, weights.gated)
    out, ids, wts, _ = _launch(cfg, operands, _env(x, weights, top_k, EG=eg, W=w))
    return out, ids, wts.astype(jnp.float32)


# ---------------------------------------------------------------------------------------------
# Weight preparation for unprepared experts (cached per concrete array set)

_PREPARED: dict = {}
_WARNED: set = set()


def prepare_flashinfer_weights(experts: NVFP4Experts, kernel: str = "cutedsl") -> PreparedWeights:
    """Prepare ``experts`` once for ``kernel`` (``"cutedsl"``: w4a16/w4a4; ``"trtllm"``: w4a4).

    Pass the result to ``jax_nvfp4.moe(x, prepared, ..., backend="flashinfer")``. Pure JAX, exact,
    runs on any device (see :mod:`jax_nvfp4.backends.flashinfer_prepare`).
    """
    return _prepare_jit(experts, kernel)


_prepare_jit = jax.jit(prepare_weights, static_argnums=1)


def _prepared_for(experts: NVFP4Experts, kernel: str) -> PreparedWeights:
    leaves = jax.tree_util.tree_leaves(experts)
    if any(isinstance(v, jax.core.Tracer) for v in leaves):
        if ("traced", kernel) not in _WARNED:
            _WARNED.add(("traced", kernel))
            warnings.warn("backend='flashinfer' got NVFP4Experts as traced arguments, so their kernel "
                          "layout is rebuilt on every call; prepare them once with "
                          f"jax_nvfp4.prepare_flashinfer_weights(experts, {kernel!r}) and pass the result",
                          stacklevel=4)
        return prepare_weights(experts, kernel)
    key = (kernel,) + tuple(id(v) for v in leaves)
    hit = _PREPARED.get(key)
    if hit is not None and all(r() is v for r, v in zip(hit[0], leaves)):
        return hit[1]
    prepared = prepare_flashinfer_weights(experts, kernel)
    try:
        refs = [weakref.ref(v) for v in leaves]
    except TypeError:
        return prepared
    _PREPARED[key] = (refs, prepared)
    weakref.finalize(leaves[0], _PREPARED.pop, key, None)
    if ("cached", kernel) not in _WARNED:
        _WARNED.add(("cached", kernel))
        warnings.warn("backend='flashinfer' keeps a copy of the NVFP4Experts in kernel layout while they are "
                      "alive; prepare them once with jax_nvfp4.prepare_flashinfer_weights and drop the "
                      "originals to keep a single copy", stacklevel=4)
    return prepared


# ---------------------------------------------------------------------------------------------
# The backend


class FlashInferBackend:
    """MoE expert backend on FlashInfer's Blackwell NVFP4 kernels (see the module docstring).

    Parameters
    ----------
    kernel : ``"auto"``, ``"cutedsl"`` or ``"trtllm"``
        ``"auto"``: ``trtllm`` for w4a4 with the activations it runs, ``cutedsl`` otherwise
        (w4a16 runs only there). Prepared weights decide for themselves.
    route_in_kernel : bool
        With router logits and weights prepared for ``trtllm``, route inside the launcher for the
        methods it implements (bf16 routing weights; ties may break differently from
        :func:`jax_nvfp4.route`).
    deterministic, enable_pdl, cuda_graph, tactic, workspace_bytes
        See :func:`flashinfer_moe`.
    """

    name = "flashinfer"

    def __init__(self, kernel: str = "auto", *, route_in_kernel: bool = True, deterministic: bool = False,
                 enable_pdl: bool = True, cuda_graph: bool = False, tactic=None, workspace_bytes=None):
        if kernel not in ("auto",) + KERNELS:
            raise ValueError(f"kernel must be one of {('auto',) + KERNELS}, got {kernel!r}")
        self.kernel, self.route_in_kernel = kernel, route_in_kernel
        self.options = dict(deterministic=deterministic, enable_pdl=enable_pdl, cuda_graph=cuda_graph,
                            tactic=tactic, workspace_bytes=workspace_bytes)

    # -- gating
    def unavailable_reason(self) -> str | None:
        platform, cc, kind = device_info()
        if platform != "cuda":
            return (f"FlashInfer's NVFP4 MoE kernels run on NVIDIA Blackwell GPUs (sm_100a/sm_103a); the "
                    f"default JAX device is {kind!r} (platform {platform!r})")
        if cc not in SUPPORTED_CAPABILITIES:
            return (f"FlashInfer's NVFP4 MoE kernels run on compute capability 10.0 (sm_100a: B200, GB200) "
                    f"or 10.3 (sm_103a: B300, GB300); the default GPU {kind!r} has compute capability {cc}")
        return software_unavailable_reason()

    def kernel_for(self, problem: base.MoEProblem) -> str:
        if self.kernel != "auto":
            return self.kernel
        if problem.mode == "w4a4" and problem.activation in KERNEL_ACTIVATIONS["trtllm"] and \
                layout_unsupported_reason("trtllm", problem.hidden, problem.intermediate,
                                          problem.activation != "relu2") is None:
            return "trtllm"
        return "cutedsl"

    def unsupported_reason(self, problem: base.MoEProblem) -> str | None:
        if problem.mode == "bf16":
            return "mode 'bf16' has no FlashInfer NVFP4 kernel (use mode 'w4a16' or 'w4a4')"
        if problem.expert_bias:
            return ("expert biases (gate_up_bias / down_bias) are not passed to FlashInfer's kernels; backends 'ffi' "
                    "and 'xla' run them")
        if problem.up_global_scale:
            return ("experts whose up rows have their own global scale (up_global_scale) are not passed to "
                    "FlashInfer's kernels here (the CuTe DSL kernels take one GEMM1 alpha an expert); backends 'ffi' "
                    "and 'xla' run them")
        if problem.static_input_scales:
            return ("w4a4 on static activation scales (NVFP4Experts.input_scales) is not passed to FlashInfer's "
                    "kernels here (they quantize per token); backends 'ffi' and 'xla' run it")
        kernel = self.kernel_for(problem)
        if problem.mode not in KERNEL_MODES[kernel]:
            return f"kernel {kernel!r} runs modes {KERNEL_MODES[kernel]}, not {problem.mode!r}"
        if problem.activation not in KERNEL_ACTIVATIONS[kernel]:
            return (f"kernel {kernel!r} runs activations {KERNEL_ACTIVATIONS[kernel]}, "
                    f"not {problem.activation!r}")
        why = layout_unsupported_reason(kernel, problem.hidden, problem.intermediate,
                                        problem.activation != "relu2")
        if why:
            return why
        if problem.top_k > MAX_TOP_K:
            return f"the kernels' routing handles top_k <= {MAX_TOP_K}, got {problem.top_k}"
        global_e = getattr(problem, "global_experts", None)
        bound = global_e if global_e is not None else problem.num_experts + 4
        if bound > MAX_EXPERTS:
            return f"the kernels' routing handles at most {MAX_EXPERTS} experts, got {bound}"
        shard_space = kernel_num_experts(0, problem.num_experts, None)  # (__call__'s space for a traced offset)
        if getattr(problem, "traced_offset", False) and problem.top_k > shard_space:
            return (f"with a traced local_expert_offset the kernels route over the {problem.num_experts} local "
                    f"experts and a sentinel ({shard_space}), fewer than top_k={problem.top_k}")
        if problem.tokens * problem.top_k >= 2 ** 31:
            return f"T * k = {problem.tokens * problem.top_k} must be < 2^31"
        return None

    # -- calls
    def _weights(self, experts, problem):
        if isinstance(experts, PreparedWeights):
            return experts
        if not isinstance(experts, NVFP4Experts):
            raise TypeError("backend 'flashinfer' needs NVFP4Experts or PreparedWeights, got "
                            f"{type(experts).__name__}")
        return _prepared_for(experts, self.kernel_for(problem))

    def __call__(self, x, experts, topk_ids, topk_weights, *, problem: base.MoEProblem,
                 local_expert_offset):
        w = self._weights(experts, problem)
        num_experts = getattr(problem, "global_experts", None)
        traced = getattr(problem, "traced_offset", False)
        if traced:
            # A traced offset (shard_map's axis_index): the kernels take an int, so the ids move into this
            # shard's space (other shards' experts fall outside it, to the sentinel) and the offset becomes 0.
            topk_ids, local_expert_offset, num_experts = shard_ids(topk_ids, local_expert_offset), 0, None
        if traced or jax.device_count() == 1:
            return flashinfer_moe(x, w, topk_ids, topk_weights, mode=problem.mode, activation=problem.activation,
                                  local_expert_offset=local_expert_offset, num_experts=num_experts, **self.options)
        # Under plain jit over several devices, with the weights sharded along E and/or x along T: each device runs
        # the kernels on its own experts and tokens (expert_sharding's rule) instead of XLA gathering every expert.
        leaves, treedef = jax.tree_util.tree_flatten(w)
        f = _over_devices(treedef, problem.mode, problem.activation, int(local_expert_offset),
                          tuple(sorted(self.options.items())))
        return f(x, topk_ids, topk_weights, tuple(leaves))

    def moe_from_logits(self, x, experts, router_logits, *, routing, top_k, bias, n_group, topk_group,
                        routed_scaling_factor, problem: base.MoEProblem, local_expert_offset: int):
        """Route in-kernel when that applies (trtllm weights, a method it implements, an int offset); else None."""
        if not self.route_in_kernel or problem.mode != "w4a4" or getattr(problem, "traced_offset", False):
            return None
        if jax.device_count() > 1:  # routed in JAX, the kernels' work can split over the devices (__call__)
            return None
        if isinstance(experts, PreparedWeights):
            if experts.kernel != "trtllm":
                return None
        elif self.kernel_for(problem) != "trtllm":
            return None
        if routing_unsupported_reason(routing, num_experts=router_logits.shape[1], top_k=top_k, bias=bias,
                                      n_group=n_group, topk_group=topk_group,
                                      routed_scaling_factor=routed_scaling_factor):
            return None
        w = self._weights(experts, problem)
        opts = {k: v for k, v in self.options.items() if k != "deterministic"}
        return flashinfer_moe_from_logits(x, w, router_logits, routing=routing, top_k=top_k, bias=bias,
                                          n_group=n_group, topk_group=topk_group,
                                          routed_scaling_factor=routed_scaling_factor,
                                          activation=problem.activation,
                                          local_expert_offset=local_expert_offset, **opts)


@functools.lru_cache(maxsize=None)
def _over_devices(treedef, mode: str, activation: str, offset: int, options: tuple):
    """:func:`flashinfer_moe` at a static ``offset`` as ``f(x, topk_ids, topk_weights, leaves)`` (the
    PreparedWeights' leaves, each ``[E, ...]``) with :mod:`~jax_nvfp4.expert_sharding`'s partitioning rule. Each
    device gets its shard's ids (earlier shards' experts and padding -1, later ones past its ``E_local``) at offset
    0, which the kernels take in the sentinel expert space, as for a traced offset."""

    def forward(x, topk_ids, topk_weights, leaves, offset):
        return flashinfer_moe(x, jax.tree_util.tree_unflatten(treedef, leaves), shard_ids(topk_ids, offset),
                              topk_weights, mode=mode, activation=activation, local_expert_offset=0, num_experts=None,
                              **dict(options))

    return over_experts(forward, offset)


base.register(FlashInferBackend())
