"""The MoE layer: :func:`moe` (public API, argument validation, backend selection).

Semantics are spec section 5: per selected (token t, expert e),
``g = alpha1[e] * (x_t @ w13_e^T)`` (fp32 accumulation), ``a = act(gate, up)``,
``y_t += w_{t,e} * alpha2[e] * (a @ w2_e^T)``; the output is bf16. Experts with biases (gpt-oss) add
``b13[e]`` to ``g`` and ``b2[e]`` to ``alpha2[e] * (a @ w2_e^T)`` before the routing weight; experts whose up rows
have their own global scale (``up_global_scale``, ModelOpt's) scale ``g``'s up half by it instead. The expert
computation is delegated to a backend (:mod:`jax_nvfp4.backends`); ``xla`` (pure JAX) runs everywhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from . import activations
from .backends import base as _base
from .backends import xla as _xla  # noqa: F401  (registers the "xla" backend)
from .backends.base import MODES, MoEProblem
from .backends.flashinfer_prepare import PreparedWeights, check_prepared
from .formats import BF16Experts, NVFP4Experts, require_unstacked
from .routing import ROUTING_METHODS, check_route_args, route, static_int

_FLOATS = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def _is_array(v) -> bool:
    return hasattr(v, "shape") and hasattr(v, "dtype")


def _check_experts(experts, mode, activation):
    if isinstance(experts, PreparedWeights):  # laid out for FlashInfer's kernels
        return check_prepared(experts, mode, activation)
    if not isinstance(experts, (NVFP4Experts, BF16Experts)):
        raise TypeError(f"experts must be NVFP4Experts, BF16Experts or PreparedWeights, got "
                        f"{type(experts).__name__}")
    require_unstacked(experts, "moe")
    if mode is None:
        mode = "bf16" if isinstance(experts, BF16Experts) else "w4a16"
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "bf16" and not isinstance(experts, BF16Experts):
        raise ValueError("mode='bf16' needs BF16Experts, got NVFP4Experts (use mode='w4a16' or 'w4a4')")
    if mode != "bf16" and not isinstance(experts, NVFP4Experts):
        raise ValueError(f"mode={mode!r} needs NVFP4Experts, got BF16Experts (use mode='bf16', or "
                         "quantize them with jax_nvfp4.quantize_experts)")
    if isinstance(experts, BF16Experts):
        for name in ("gate_up", "down"):
            dt = getattr(experts, name).dtype
            if jnp.dtype(dt) != jnp.bfloat16:
                raise TypeError(f"experts.{name} must be bfloat16 in mode 'bf16', got {dt} "
                                "(cast with .astype(jnp.bfloat16))")
    return mode


def weight_order(backend: str | _base.Backend = "auto", *, hidden_size: int, intermediate_size: int) -> str:
    """The byte order (:attr:`NVFP4Array.order <jax_nvfp4.NVFP4Array>`) that ``backend`` reads
    NVFP4 experts of hidden size H and intermediate size I fastest on the default device.

    ``"blocked"`` (:func:`~jax_nvfp4.to_blocked_experts`) when ``backend`` (``"auto"``: the first
    available one) is ``ffi`` on a CUDA GPU and zero-padding H, I to multiples of 128 adds at most 12.5% of the
    weight bytes (none where they are multiples; gpt-oss's 2880: 4.5%); otherwise ``"rows"``.
    Every backend reads both orders as the same weights (the ffi GPU kernels' fp32 sums are bitwise
    equal where each warp's share of K is whole 128-K blocks); put the experts in this order once, when
    they are quantized or loaded (``jax_nvfp4.nn`` does), not on every call (H200, 2026-12-01: on
    blocked experts decode layers run 7-13% faster than on rows, prefill layers of 1024-4096 tokens
    4-6% faster). ``"auto"`` looks at availability only: where the available backend turns a
    problem down (e.g. ffi with more than ``MAX_ALIGN_EXPERTS`` local experts), :func:`moe` falls
    back to one that restores rows per call.
    """
    auto = _base.check(backend) == "auto"
    for b in ([_base.get(n) for n in _base.names()] if auto else [_base.instance(backend)]):
        if b.unavailable_reason() is None:
            order = getattr(b, "weight_order", None)
            return order(hidden_size, intermediate_size) if order else "rows"
    return "rows"


def _check_offset(offset, e_local, e_global):
    if isinstance(offset, (bool, np.bool_)):
        raise TypeError("local_expert_offset must be an int or an int32 scalar, got bool")
    if _is_array(offset) and not isinstance(offset, jax.core.Tracer) and offset.shape == () \
            and jnp.issubdtype(offset.dtype, jnp.integer):
        offset = int(offset)  # a concrete scalar array: its value is checked as an int's (a traced one cannot be)
    if isinstance(offset, (int, np.integer)):
        if offset < 0:
            raise ValueError(f"local_expert_offset must be >= 0, got {offset}")
        if e_global is not None and offset + e_local > e_global:
            raise ValueError(f"local experts [{offset}, {offset + e_local}) exceed the {e_global} experts "
                             f"of router_logits.shape[1]")
        return
    if not _is_array(offset) or offset.shape != () or not jnp.issubdtype(offset.dtype, jnp.integer):
        raise TypeError(f"local_expert_offset must be an int or an integer scalar array, got "
                        f"{getattr(offset, 'dtype', type(offset).__name__)} {getattr(offset, 'shape', '')}")


def moe(x, experts, *, router_logits=None, routing: str = "softmax_topk", top_k: int | None = None,
        topk_ids=None, topk_weights=None, bias=None, n_group: int | None = None,
        topk_group: int | None = None, routed_scaling_factor=1.0, activation: str = "swiglu",
        mode: str | None = None, local_expert_offset=0, backend: str | _base.Backend = "auto",
        return_routing: bool = False, batch_invariant: bool = False):
    """Mixture-of-Experts layer (routed experts only).

    Parameters
    ----------
    x : bfloat16 ``[T, H]``
        Hidden states.
    experts : :class:`~jax_nvfp4.NVFP4Experts` or :class:`~jax_nvfp4.BF16Experts`
        ``E`` local experts: ``gate_up [E, 2I, H]`` (rows ``[gate; up]``; ``[E, I, H]`` with
        ``gated=False`` for ``relu2``) and ``down [E, H, I]``, optionally with biases ``gate_up_bias
        [E, 2I]`` and ``down_bias [E, H]`` (gpt-oss; backends ``xla`` and ``ffi``, not ``flashinfer``); blocked
        experts zero-padded to multiples of 128 (``valid_sizes``) run as their padded layer on ``x`` padded. A
        pytree, so it may be a traced argument of a jitted function. Or experts laid out once for
        FlashInfer's kernels with :func:`~jax_nvfp4.prepare_flashinfer_weights` (they run on
        ``backend="flashinfer"``).
    router_logits : optional float ``[T, E_global]``
        Logits over all global experts; routed with :func:`~jax_nvfp4.route`. Give either these
        or ``topk_ids`` and ``topk_weights``.
    routing : str (static)
        Routing method, one of :data:`~jax_nvfp4.routing.ROUTING_METHODS`.
    top_k : int (static)
        Experts per token; required with ``router_logits`` (``llama4``: 1, the default there).
    topk_ids : optional int ``[T, k]``, with ``topk_weights`` float ``[T, k]``
        Precomputed routing, e.g. recorded with ``return_routing=True`` and replayed. Global
        expert ids; negative ids are padding and contribute nothing, and so do ids outside this call's
        experts (``local_expert_offset`` below: under expert parallelism, other devices' experts; values are
        not checked, which would need a host sync). The weights are used as given (``routed_scaling_factor``
        must then stay 1).
    bias, n_group, topk_group, routed_scaling_factor
        Routing parameters, see :func:`~jax_nvfp4.route` (``n_group``/``topk_group`` static).
    activation : str (static)
        ``"swiglu"``, ``"geglu"`` (tanh GELU), ``"relu2"`` (not gated) or ``"swiglu_oai"``
        (gpt-oss: alpha 1.702, limit 7, ``up + 1``).
    mode : str (static), optional
        ``"bf16"`` (BF16Experts), ``"w4a16"`` or ``"w4a4"`` (NVFP4Experts). Default: ``"bf16"`` for
        BF16Experts, ``"w4a16"`` for NVFP4Experts. ``w4a4`` quantizes ``x`` per token and the
        intermediate per row (spec section 5) and multiplies the exactly decoded values; on experts with static
        activation scales (:attr:`~jax_nvfp4.NVFP4Experts.input_scales`, from ModelOpt checkpoints) it quantizes
        each token's row for expert ``e`` and its intermediate there on ``e``'s scales instead (backends ``ffi``
        and ``xla``).
    local_expert_offset : int (static) or int32 scalar (may be traced)
        Global id of local expert 0 (expert parallelism): only ids in
        ``[local_expert_offset, local_expert_offset + E)`` contribute; summing the outputs of
        all shards gives the full layer. A traced offset (``lax.axis_index(axis) * E`` inside
        ``jax.shard_map``) runs on every backend (``flashinfer`` then routes in JAX, not in its kernel).
    backend : str or backend instance (static)
        ``"auto"`` (best available, see :func:`jax_nvfp4.backends.base.select`), a registered
        name such as ``"xla"``, or a backend instance with options of its own for this call, e.g.
        ``FFIBackend(k_split=1)`` or ``FlashInferBackend(deterministic=True)`` (instances with equal
        options are equal and hash alike: a static jit argument). Backends judge what they can run by
        the default device (``jax.default_device``'s when set, else ``jax.devices()[0]``).
    return_routing : bool (static)
        Also return ``(topk_ids int32 [T, k], topk_weights float32 [T, k])``.
    batch_invariant : bool (static)
        Give each token the same output bytes whatever batch it runs in (e.g. RL, where rollout and
        training compute one sequence's logprobs in batches of different sizes). Runs on the ``ffi``
        backend (modes ``w4a16``/``w4a4``, ``backend`` ``"auto"`` or ``"ffi"``) with the decode tiles'
        K split fixed to 1, so that every output element is summed over K in one order at any batch
        size; slower decode where the split would have been taken. On the H200 (BENCHMARKS.md, session
        41) the default ``ffi`` layer differed in the last bits from 16 tokens a batch on, this one at no
        batch size. Only this layer: the router's matmul and the rest of a model are XLA's.

    Returns
    -------
    bfloat16 ``[T, H]``, or ``(out, (topk_ids, topk_weights))`` with ``return_routing=True``.

    Notes
    -----
    All validation happens at trace time. Under ``jax.jit`` pass ``x``, ``experts``,
    ``router_logits``/``topk_ids``/``topk_weights``/``bias`` as arguments and keep the others
    static (closed over or ``static_argnames``). Works inside ``lax.scan``/``while_loop`` and is
    differentiable with respect to ``x`` and ``router_logits`` in modes ``bf16`` and ``w4a16``
    (and to ``BF16Experts``' weights in ``bf16``; NVFP4 weights are constants, gradients pass straight through
    their exact decode). ``w4a4`` rounds
    ``x`` onto the NVFP4 grid, so its gradient with respect to ``x`` is zero. Backend ``ffi`` differentiates in
    reverse mode to any order, also under forward mode (``jax.jvp`` of ``jax.grad``: Hessian-vector products), not
    in forward mode alone nor a batched second derivative (``jax.hessian``, ``jax.jacrev`` of ``jax.jacrev``: its
    pure-JAX twin's ``lax.ragged_dot`` has a ``jax.vmap`` rule for axis 0 only); ``XLABackend(gmm="tiled")``
    differentiates either way. On backends ``ffi`` and ``xla``,
    ``jax.vmap`` runs a batch of token sets as one set and a batch of expert sets (experts stacked over layers,
    ``[L, E, N, K]``) one after the other.

    Rounding of the combine: ``xla`` sums a token's ``k`` contributions ``w * alpha2 * (a @ w2^T)`` (w4a4:
    ``w * da * alpha2 * ...``) in fp32 and rounds once to bf16 (spec section 5 read literally). ``ffi``'s GEMM2
    writes each contribution as a bf16 row (half the bytes of fp32 rows) and its finalize sums a token's rows in
    fp32 in a fixed order: outputs differ from ``xla``'s in the last bf16 bits (in about a third of the elements
    at ``k = 8``). With a ``down_bias``, ``ffi`` adds a token's ``sum w * b2`` to that bf16 sum in fp32 and rounds
    again; ``xla`` adds each ``b2`` to its row before the routing weight.

    Under ``jax.jit`` with the experts sharded along E (expert parallelism) and ``x`` along T
    (data parallelism) by ``NamedSharding`` objects, backends ``ffi`` and ``xla`` run each device's
    experts on its tokens and sum the outputs over the expert axes, gathering no expert
    (:mod:`jax_nvfp4.expert_sharding`); their gradients split alike (reverse mode only there: no
    ``jax.jvp``). Inside ``jax.shard_map`` pass the shard's ``local_expert_offset`` instead.
    """
    activations.check(activation)
    mode = _check_experts(experts, mode, activation)
    backend_name = _base.check(backend)
    if isinstance(experts, PreparedWeights):
        if backend_name not in ("auto", "flashinfer"):
            raise ValueError(f"experts prepared for FlashInfer's kernels (PreparedWeights) run only on backend "
                             f"'flashinfer', not {backend_name!r}; pass the NVFP4Experts to other backends")
        backend = "flashinfer" if backend_name == "auto" else backend
    if routing not in ROUTING_METHODS:
        raise ValueError(f"routing must be one of {ROUTING_METHODS}, got {routing!r}")
    if experts.gated != activations.is_gated(activation):
        need = "gated [E, 2I, H] ([gate; up])" if activations.is_gated(activation) else "not gated [E, I, H]"
        raise ValueError(f"activation {activation!r} needs {need} experts, got experts.gated={experts.gated}")
    if not _is_array(x):
        raise TypeError(f"x must be an array, got {type(x).__name__}")
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D [T, H], got shape {tuple(x.shape)}")
    if jnp.dtype(x.dtype) != jnp.bfloat16:
        raise TypeError(f"x must be bfloat16, got {x.dtype}")
    t, h = x.shape
    if h != experts.hidden_size:
        raise ValueError(f"x.shape[1]={h} does not match the experts' hidden size H={experts.hidden_size}")
    if getattr(experts, "valid_sizes", None) is not None:
        # Blocked experts zero-padded to whole 128-K chunks (to_blocked_experts): the padded layer on x padded with
        # zeros is the same layer (its extra output features are zeros); the checks below run on it.
        res = moe(experts.pad_input(x), experts.padded_layer(), router_logits=router_logits,
                  routing=routing, top_k=top_k, topk_ids=topk_ids, topk_weights=topk_weights, bias=bias,
                  n_group=n_group, topk_group=topk_group, routed_scaling_factor=routed_scaling_factor,
                  activation=activation, mode=mode, local_expert_offset=local_expert_offset, backend=backend,
                  return_routing=return_routing, batch_invariant=batch_invariant)
        return (res[0][:, :h], res[1]) if return_routing else res[:, :h]

    if top_k is not None:
        top_k = static_int(top_k, "top_k")
    if router_logits is not None:
        if topk_ids is not None or topk_weights is not None:
            raise ValueError("give either router_logits or topk_ids/topk_weights, not both")
        if not _is_array(router_logits):
            raise TypeError(f"router_logits must be an array, got {type(router_logits).__name__}")
        if router_logits.ndim != 2 or router_logits.shape[0] != t:
            raise ValueError(f"router_logits must be [T, E_global] with T={t} (x.shape[0]), "
                             f"got shape {tuple(router_logits.shape)}")
        if top_k is None:
            if routing != "llama4":
                raise ValueError(f"top_k is required for routing {routing!r}")
            top_k = 1
        n_group_r, topk_group_r = check_route_args(router_logits.shape, router_logits.dtype, routing,
                                                   top_k=top_k, bias=bias, n_group=n_group,
                                                   topk_group=topk_group)
        _check_offset(local_expert_offset, experts.num_experts, router_logits.shape[1])
        k, e_global = top_k, router_logits.shape[1]
    else:
        if topk_ids is None or topk_weights is None:
            raise ValueError("give router_logits, or both topk_ids and topk_weights")
        extra = [n for n, v in (("bias", bias), ("n_group", n_group), ("topk_group", topk_group))
                 if v is not None]
        if not (isinstance(routed_scaling_factor, (int, float, np.integer, np.floating))
                and routed_scaling_factor == 1):
            extra.append("routed_scaling_factor")
        if extra:
            raise ValueError(f"{', '.join(extra)}: used only when moe routes router_logits itself; "
                             "precomputed topk_weights are used as given")
        for name, v in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
            if not _is_array(v):
                raise TypeError(f"{name} must be an array, got {type(v).__name__}")
            if v.ndim != 2 or v.shape[0] != t:
                raise ValueError(f"{name} must be [T, k] with T={t} (x.shape[0]), got shape {tuple(v.shape)}")
        if topk_weights.shape != topk_ids.shape:
            raise ValueError(f"topk_weights shape {tuple(topk_weights.shape)} must equal topk_ids shape "
                             f"{tuple(topk_ids.shape)}")
        if not jnp.issubdtype(topk_ids.dtype, jnp.integer):
            raise TypeError(f"topk_ids must be an integer array (int32), got {topk_ids.dtype}")
        if jnp.dtype(topk_weights.dtype) not in _FLOATS:
            raise TypeError(f"topk_weights must be float32 (or bf16/f16), got {topk_weights.dtype}")
        if top_k is not None and top_k != topk_ids.shape[1]:
            raise ValueError(f"top_k={top_k} does not match topk_ids.shape[1]={topk_ids.shape[1]}")
        _check_offset(local_expert_offset, experts.num_experts, None)
        topk_ids = topk_ids.astype(jnp.int32)
        topk_weights = topk_weights.astype(jnp.float32)
        k, e_global = topk_ids.shape[1], None

    problem = MoEProblem(tokens=t, hidden=h, intermediate=experts.intermediate_size,
                         num_experts=experts.num_experts, top_k=k, mode=mode, activation=activation,
                         global_experts=e_global,
                         traced_offset=not isinstance(local_expert_offset, (int, np.integer)),
                         expert_bias=getattr(experts, "has_bias", False),
                         up_global_scale=getattr(experts, "up_global_scale", None) is not None,
                         static_input_scales=mode == "w4a4" and getattr(experts, "input_scales", None) is not None)
    if batch_invariant:
        if mode == "bf16" or backend_name not in ("auto", "ffi"):
            raise ValueError(f"batch_invariant=True runs on backend 'ffi' in mode 'w4a16' or 'w4a4' (its K split "
                             f"fixed to 1), got backend={backend_name!r}, mode={mode!r}")
        backend = "ffi" if backend_name == "auto" else backend
    impl = _base.select(backend, problem)  # (a backend declines a traced offset it cannot run: problem.traced_offset)
    if batch_invariant:
        impl = impl.batch_invariant()
    if router_logits is not None:
        # A backend may route inside its kernel (e.g. FlashInfer's TensorRT-LLM-gen launcher).
        from_logits = getattr(impl, "moe_from_logits", None)
        res = None if from_logits is None else from_logits(
            x, experts, router_logits, routing=routing, top_k=top_k, bias=bias, n_group=n_group_r,
            topk_group=topk_group_r, routed_scaling_factor=routed_scaling_factor, problem=problem,
            local_expert_offset=local_expert_offset)
        if res is not None:
            out, topk_ids, topk_weights = res
            return (out, (topk_ids, topk_weights)) if return_routing else out
        topk_ids, topk_weights = route(router_logits, routing, top_k=top_k, bias=bias, n_group=n_group,
                                       topk_group=topk_group, routed_scaling_factor=routed_scaling_factor)
    out = impl(x, experts, topk_ids, topk_weights, problem=problem,
               local_expert_offset=local_expert_offset)
    return (out, (topk_ids, topk_weights)) if return_routing else out
