"""The runtime (FlashInfer, torch and jax-tvm-ffi, loaded lazily; tests substitute a fake) and the
XLA custom calls built from it: what FlashInfer receives from the buffers XLA hands the callback."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import importlib.metadata
import importlib.util
import os
import pathlib
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp

from .contract import (ACTIVATION_TYPE, ARG_SPEC, CUTEDSL_ACTIVATION, ENV_ALLOW_DOWNLOAD, ENV_UNPINNED,
                       FLASHINFER_VERSION, OPERANDS, RESULTS, ROUTING_INPUT_MODE, ROUTING_METHOD_TYPE, SIGNATURES,
                       TRTLLM_ACTIVATION, check_operands, spec_shape)
from .gating import _offline_error, missing_trtllm_artifacts



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
