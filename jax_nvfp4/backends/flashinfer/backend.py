"""The ``flashinfer`` backend: gating, argument checks and the dispatch to :mod:`.calls`."""

from __future__ import annotations

import functools

import jax

from ...expert_sharding import over_experts
from ...formats import NVFP4Experts
from ...routing import shard_ids
from .. import base
from ..flashinfer_prepare import KERNEL_ACTIVATIONS, KERNEL_MODES, KERNELS, PreparedWeights, layout_unsupported_reason
from . import gating
from .contract import MAX_EXPERTS, MAX_TOP_K, SUPPORTED_CAPABILITIES
from .calls import (_prepared_for, flashinfer_moe, flashinfer_moe_from_logits, kernel_num_experts,
                    routing_unsupported_reason)



class FlashInferBackend(base.Options):
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
        self.deterministic, self.enable_pdl, self.cuda_graph = deterministic, enable_pdl, cuda_graph
        self.tactic = None if tactic is None else tuple(tactic)
        self.workspace_bytes = workspace_bytes

    def call_options(self) -> dict:
        """The options :func:`flashinfer_moe` takes."""
        return {k: v for k, v in self.options().items() if k not in ("kernel", "route_in_kernel")}

    # -- gating
    def unavailable_reason(self) -> str | None:
        platform, cc, kind = gating.device_info()
        if platform != "cuda":
            return (f"FlashInfer's NVFP4 MoE kernels run on NVIDIA Blackwell GPUs (sm_100a/sm_103a); the "
                    f"default JAX device is {kind!r} (platform {platform!r})")
        if cc not in SUPPORTED_CAPABILITIES:
            return (f"FlashInfer's NVFP4 MoE kernels run on NVIDIA Blackwell GPUs of compute capability 10.0 "
                    f"(sm_100a: B200, GB200) or 10.3 (sm_103a: B300, GB300); the default GPU {kind!r} has "
                    f"compute capability {cc}")
        return gating.software_unavailable_reason()

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
                                  local_expert_offset=local_expert_offset, num_experts=num_experts,
                                  **self.call_options())
        # Under plain jit over several devices, with the weights sharded along E and/or x along T: each device runs
        # the kernels on its own experts and tokens (expert_sharding's rule) instead of XLA gathering every expert.
        leaves, treedef = jax.tree_util.tree_flatten(w)
        f = _over_devices(treedef, problem.mode, problem.activation, int(local_expert_offset),
                          tuple(sorted(self.call_options().items())))
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
        opts = {k: v for k, v in self.call_options().items() if k != "deterministic"}
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
