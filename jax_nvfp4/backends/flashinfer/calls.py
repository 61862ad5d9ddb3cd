"""The JAX side: flashinfer_moe (precomputed routing), flashinfer_moe_from_logits (in-kernel
routing), and the weight preparation of unprepared experts (cached per concrete array set)."""

from __future__ import annotations

import warnings
import weakref

import jax
import jax.numpy as jnp

from ...formats import NVFP4Experts
from ...quantize import quantize
from ..flashinfer_prepare import PreparedWeights, check_prepared, prepare_weights
from . import bridge
from .bridge import CallConfig
from .contract import (FC2_INPUT_SCALE, MAX_EXPERTS, MAX_TOP_K, ROUTING_METHOD_TYPE, TRTLLM_ROUTING,
                       trtllm_workspace_bytes)



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
        return bridge._launch(cfg, operands, _env(x, weights, k))[0]
    w = workspace_bytes or trtllm_workspace_bytes(t, weights.hidden_size, weights.intermediate_size, e, k, e_k,
                                                  weights.gated)
    operands = {**routing, **acts, **_weight_operands(weights)}
    return bridge._launch(cfg, operands, _env(x, weights, k, W=w))[0]


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
    out, ids, wts, _ = bridge._launch(cfg, operands, _env(x, weights, top_k, EG=eg, W=w))
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
