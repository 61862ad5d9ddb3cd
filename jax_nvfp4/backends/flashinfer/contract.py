"""What the pinned FlashInfer release is and what the bridge passes it: versions, signatures, enums,
and the custom calls' operands and results."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp




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
