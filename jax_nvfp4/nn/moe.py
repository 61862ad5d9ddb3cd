"""Flax NNX Mixture-of-Experts: the :class:`MoE` module and its expert storage.

An :class:`MoE` holds a router and a stack of experts, either in bf16 (:class:`BF16ExpertWeights`,
trainable ``nnx.Param``) or in NVFP4 (:class:`NVFP4ExpertWeights`, packed codes and scales held as
:class:`QuantizedWeight`, which is not an ``nnx.Param``: optimizers and ``nnx.grad`` over ``Param``
leave it alone). The expert computation is :func:`jax_nvfp4.moe`. Quantizing a live model's blocks
and loading NVFP4 experts into them: :mod:`jax_nvfp4.nn.quantization`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from ..backends.base import MODES, check as check_backend  # (backend names or instances)
from ..expert_sharding import axis_names
from ..formats import BIAS_FIELDS, BF16Experts, NVFP4Array, NVFP4Experts
from ..moe import moe
from ..routing import ROUTING_METHODS, check_route_args, static_int
from .. import activations

_EPS = 1e-20  # as in jax_nvfp4.routing
_ORDER_TAGS = {"rows": "", "blocked": "_blocked2"}  # NVFP4ExpertWeights' variable names per byte order
# ("2": the blocked code words' bits are permuted since 2026-12-04.) The first blocked layout's names: a state
# saved in it is refused, not misread.
_OLD_TAGS = ("_blocked",)


class QuantizedWeight(nnx.Variable):
    """Storage of NVFP4 expert weights (packed E2M1 codes, E4M3 block scales, global scales).

    A separate Variable type, not ``nnx.Param``: quantized weights are not trained, and filters such
    as ``nnx.state(model, nnx.Param)`` or ``nnx.grad`` (which differentiates ``Param``) skip them.
    """


def _normal(key, shape, fan_in: int, dtype):
    """Normal(0, 1/fan_in) in ``dtype`` (keeps activations O(1) through the layer)."""
    return (jax.random.normal(key, shape, jnp.float32) * fan_in ** -0.5).astype(dtype)


class _ExpertBiases:
    @property
    def has_bias(self) -> bool:
        """Whether the experts hold biases (also on an abstract model, ``nnx.eval_shape``)."""
        return any(getattr(self, n, None) is not None for n in BIAS_FIELDS)

    def biases(self) -> dict:
        """The expert biases held, as arrays by field name (``gate_up_bias``, ``down_bias``); empty without."""
        return {n: getattr(self, n)[...] for n in BIAS_FIELDS if getattr(self, n, None) is not None}


class BF16ExpertWeights(_ExpertBiases, nnx.Module):
    """Unquantized expert stack (trainable).

    Parameters
    ----------
    gate_up : ``[E, 2I, H]`` (rows ``[gate; up]``), or ``[E, I, H]`` with ``gated=False``
    down : ``[E, H, I]``
    gated : bool
    gate_up_bias, down_bias : optional ``[E, 2I]`` (``[E, I]`` not gated) and ``[E, H]``: expert biases
        (gpt-oss), as in :class:`~jax_nvfp4.BF16Experts`

    Attributes
    ----------
    gate_up, down : nnx.Param holding the arrays as given (bf16 usually; float32 master weights
        are cast to bf16 for the MoE).
    gate_up_bias, down_bias : nnx.Param, or None without biases (used as stored: the backend adds them in
        float32)
    """

    def __init__(self, gate_up, down, *, gated: bool = True, gate_up_bias=None, down_bias=None):
        BF16Experts(gate_up, down, gated, gate_up_bias, down_bias)  # validates the shapes
        self.gate_up = nnx.Param(gate_up)
        self.down = nnx.Param(down)
        self.gate_up_bias, self.down_bias = (None if b is None else nnx.Param(b) for b in (gate_up_bias, down_bias))
        self.gated = gated

    @classmethod
    def random(cls, num_experts: int, hidden_size: int, intermediate_size: int, *, gated: bool = True,
               bias: bool = False, param_dtype=jnp.bfloat16, rngs: nnx.Rngs) -> "BF16ExpertWeights":
        """Random experts, normal with variance ``1/fan_in``; with ``bias``, zero expert biases."""
        rows = (2 if gated else 1) * intermediate_size
        biases = ((jnp.zeros((num_experts, rows), param_dtype), jnp.zeros((num_experts, hidden_size), param_dtype))
                  if bias else (None, None))
        return cls(_normal(rngs.params(), (num_experts, rows, hidden_size), hidden_size, param_dtype),
                   _normal(rngs.params(), (num_experts, hidden_size, intermediate_size), intermediate_size,
                           param_dtype), gated=gated, gate_up_bias=biases[0], down_bias=biases[1])

    def experts(self) -> BF16Experts:
        """The weights as :class:`~jax_nvfp4.BF16Experts` (cast to bf16), for :func:`jax_nvfp4.moe`."""
        return BF16Experts(self.gate_up[...].astype(jnp.bfloat16), self.down[...].astype(jnp.bfloat16),
                           self.gated, **self.biases())


class NVFP4ExpertWeights(_ExpertBiases, nnx.Module):
    """NVFP4 expert stack (not trainable): the parts of :class:`~jax_nvfp4.NVFP4Experts` as Variables.

    Parameters
    ----------
    experts : :class:`~jax_nvfp4.NVFP4Experts`
        ``gate_up`` ``[E, 2I, H]`` (or ``[E, I, H]`` not gated) and ``down`` ``[E, H, I]`` with
        per-expert global scales ``[E]``.

    Attributes
    ----------
    gate_up_data : QuantizedWeight uint8 ``[E, 2I, H/2]``
    gate_up_scales : QuantizedWeight float8_e4m3fn ``[E, 2I, H/16]``
    gate_up_global_scale : QuantizedWeight float32 ``[E]``
    down_data, down_scales, down_global_scale : the same for ``[E, H, I]``
    gate_up_bias, down_bias : QuantizedWeight (the experts' biases, as given: not quantized), or None
    up_global_scale : QuantizedWeight float32 ``[E]``, the up rows' own global scales
        (:attr:`~jax_nvfp4.NVFP4Experts.up_global_scale`), or None
    input_scales : QuantizedWeight float32 ``[E, 2]``, static activation scales for w4a4
        (:attr:`~jax_nvfp4.NVFP4Experts.input_scales`), or None
    gated : bool; dtype : the source dtype recorded by the quantizer; order : the byte order of
        the data and scales (:attr:`jax_nvfp4.NVFP4Array.order`); valid_sizes : the experts' (static)

    In the blocked order the data and scales are named ``gate_up_data_blocked2``,
    ``gate_up_scales_blocked2``, ... so that the order is part of the state's structure: a state saved
    in one order never loads silently into a model holding the other (nor one saved in the blocked order
    of versions before 2026-12-04, ``..._blocked``, whose code words hold their bits otherwise).
    """

    def __init__(self, experts: NVFP4Experts):
        if not isinstance(experts, NVFP4Experts):
            raise TypeError(f"experts must be NVFP4Experts, got {type(experts).__name__}")
        self.order = experts.gate_up.order
        tag = _ORDER_TAGS[self.order]
        for name, w in (("gate_up", experts.gate_up), ("down", experts.down)):
            setattr(self, f"{name}_data{tag}", QuantizedWeight(w.data))
            setattr(self, f"{name}_scales{tag}", QuantizedWeight(w.scales))
            setattr(self, f"{name}_global_scale", QuantizedWeight(w.global_scale))
        for name in BIAS_FIELDS:
            b = getattr(experts, name)
            setattr(self, name, None if b is None else QuantizedWeight(b))
        up = experts.up_global_scale
        self.up_global_scale = None if up is None else QuantizedWeight(up)
        s = experts.input_scales
        self.input_scales = None if s is None else QuantizedWeight(s)
        self.gated = experts.gated
        self.dtype = jnp.dtype(experts.gate_up.dtype)
        self.valid_sizes = experts.valid_sizes

    def experts(self) -> NVFP4Experts:
        """The weights as :class:`~jax_nvfp4.NVFP4Experts`, for :func:`jax_nvfp4.moe`."""
        tag = _ORDER_TAGS[self.order]
        others = [t for o, t in _ORDER_TAGS.items() if o != self.order] + list(_OLD_TAGS)
        stale = [t for t in others if hasattr(self, f"gate_up_data{t}")]  # e.g. nnx.update with another order
        if stale:
            raise ValueError(f"these NVFP4 experts are in the {self.order!r} order but also hold variables of "
                             f"another one ('gate_up_data{stale[0]}', ...): a state saved in the other byte "
                             "order (or in the blocked order of jax_nvfp4 before 2026-12-04, '_blocked') was "
                             "merged into them; load it into a model quantized with the same order "
                             "(jax_nvfp4.nn.quantize_moe(..., order=...)), or re-quantize a state of the old "
                             "blocked order from its source weights")

        def part(name):
            return NVFP4Array(getattr(self, f"{name}_data{tag}")[...], getattr(self, f"{name}_scales{tag}")[...],
                              getattr(self, f"{name}_global_scale")[...], self.dtype, self.order)
        up, s = self.up_global_scale, self.input_scales
        return NVFP4Experts(part("gate_up"), part("down"), self.gated, **self.biases(),
                            valid_sizes=self.valid_sizes, up_global_scale=None if up is None else up[...],
                            input_scales=None if s is None else s[...])


def check_choice(value, choices, name):
    if value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")


def check_expert_axis(num_experts: int, expert_axis, mesh, token_axis=None):
    if not isinstance(mesh, jax.sharding.Mesh):
        raise ValueError(f"expert_axis={expert_axis!r} needs mesh, a jax.sharding.Mesh, got {mesh!r}")
    if expert_axis not in mesh.shape:
        raise ValueError(f"expert_axis={expert_axis!r} is not an axis of the mesh {tuple(mesh.shape)}")
    if num_experts % mesh.shape[expert_axis]:
        raise ValueError(f"num_experts={num_experts} must be a multiple of the {mesh.shape[expert_axis]} devices "
                         f"of mesh axis {expert_axis!r}")
    if any(a not in mesh.shape or a == expert_axis for a in axis_names(token_axis)):
        raise ValueError(f"token_axis={token_axis!r} must name axes of the mesh other than expert_axis "
                         f"{expert_axis!r}; the mesh has {tuple(mesh.shape)}")


class MoE(nnx.Module):
    """Routed Mixture-of-Experts block: a linear router and a stack of experts (spec section 5).

    Parameters
    ----------
    hidden_size, intermediate_size : int
        H and the per-expert intermediate size I (multiples of 16 to be quantizable).
    num_experts, top_k : int
    routing : str
        A :data:`jax_nvfp4.ROUTING_METHODS` name, e.g. ``"renormalize_naive"`` for Qwen3-MoE
        (softmax, top-k, renormalize), ``"softmax_topk"`` (no renormalization), ``"deepseek_v3"``.
    activation : str
        ``"swiglu"`` (default), ``"geglu"``, ``"relu2"`` (not gated) or ``"swiglu_oai"``.
    mode : str, optional
        ``"bf16"``, ``"w4a16"`` or ``"w4a4"``; None runs bf16 experts in ``bf16`` and NVFP4 experts in
        ``w4a16``. :func:`quantize_moe` sets it.
    backend : str or backend instance
        :func:`jax_nvfp4.moe` backend, ``"auto"`` by default (an instance carries its own options, e.g.
        ``FFIBackend(k_split=1)``).
    batch_invariant : bool
        :func:`jax_nvfp4.moe`'s ``batch_invariant``: the experts' output independent of the batch (ffi
        backend, NVFP4 experts).
    router_bias : bool
        Add a learned per-expert router bias ``[E]`` (required by ``deepseek_v3``, where it affects
        selection only).
    expert_bias : bool
        Give the experts biases (gpt-oss): ``gate_up_bias [E, 2I]`` added to GEMM1's output before the
        activation, ``down_bias [E, H]`` to GEMM2's before the routing weight (zeros at first). Backends
        ``xla`` and ``ffi`` run them (not ``flashinfer``).
    n_group, topk_group, routed_scaling_factor
        Routing parameters (see :func:`jax_nvfp4.route`).
    expert_axis : str, optional
        Expert parallelism: the name of an axis of ``mesh`` along which the experts are sharded
        (``E % mesh.shape[expert_axis] == 0``). The experts then run in ``jax.shard_map`` over ``mesh``,
        each device on its own experts (global ids from ``lax.axis_index``), and their outputs are summed
        (``psum`` in float32; each device's output is rounded to bf16 first, so the sum may differ from the
        unsharded layer in its last bits); ``x``, the router and the output are replicated over the mesh,
        but for ``token_axis``. Without it, under ``jit`` with the experts sharded by a ``NamedSharding``,
        the forward pass splits the same way by a partitioning rule (:mod:`jax_nvfp4.expert_sharding`: the
        ffi kernels and backend ``xla``, NVFP4 or bf16 experts), and so do its gradients (reverse mode).
        :func:`~jax_nvfp4.nn.expert_parallel` sets it on every block of a model and places the experts
        along the axis.
    mesh : jax.sharding.Mesh, optional
        The mesh of ``expert_axis`` (required with it).
    token_axis : str or tuple of str, optional
        With ``expert_axis``: mesh axes (not ``expert_axis``) along which the tokens are split, data
        parallel: each device runs its tokens (``x``'s flattened leading axes, in order) on its experts, and
        the sum runs over ``expert_axis`` only.
    param_dtype : dtype of the router and bf16 expert parameters (bfloat16)
    rngs : nnx.Rngs

    Attributes
    ----------
    router : nnx.Linear ``H -> E`` (kernel ``[H, E]``, no bias); logits are computed in float32
    router_bias : nnx.Param float32 ``[E]`` or None
    experts : :class:`BF16ExpertWeights` or :class:`NVFP4ExpertWeights`
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, *,
                 routing: str = "softmax_topk", activation: str = "swiglu", mode: str | None = None,
                 backend="auto", batch_invariant: bool = False, router_bias: bool = False,
                 expert_bias: bool = False,
                 n_group: int | None = None, topk_group: int | None = None, routed_scaling_factor: float = 1.0,
                 expert_axis: str | None = None, mesh: jax.sharding.Mesh | None = None,
                 token_axis: str | tuple[str, ...] | None = None,
                 param_dtype=jnp.bfloat16, rngs: nnx.Rngs):
        check_choice(routing, ROUTING_METHODS, "routing")
        activations.check(activation)
        if mode is not None:
            check_choice(mode, MODES, "mode")
        check_backend(backend)
        top_k = static_int(top_k, "top_k")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
        if routing == "deepseek_v3" and not router_bias:
            raise ValueError("routing 'deepseek_v3' needs router_bias=True (the score correction bias)")
        # The rest of what moe() would refuse at the first call (llama4's k = 1, deepseek_v3's groups).
        check_route_args((1, num_experts), jnp.float32, routing, top_k=top_k, n_group=n_group, topk_group=topk_group,
                         bias=jax.ShapeDtypeStruct((num_experts,), jnp.float32) if router_bias else None)
        if expert_axis is not None:
            check_expert_axis(num_experts, expert_axis, mesh, token_axis)
        elif token_axis is not None:
            raise ValueError("token_axis applies with expert_axis (expert parallelism); without it the block "
                             "runs under jit as any other layer")
        self.expert_axis, self.mesh, self.token_axis = expert_axis, mesh, token_axis
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_experts, self.top_k = num_experts, top_k
        self.routing, self.activation, self.mode, self.backend = routing, activation, mode, backend
        self.batch_invariant = batch_invariant
        self.n_group, self.topk_group = n_group, topk_group
        self.routed_scaling_factor = routed_scaling_factor
        self.router = nnx.Linear(hidden_size, num_experts, use_bias=False, dtype=param_dtype,
                                 param_dtype=param_dtype, preferred_element_type=jnp.float32, rngs=rngs)
        self.router_bias = nnx.Param(jnp.zeros((num_experts,), jnp.float32)) if router_bias else None
        self.experts = BF16ExpertWeights.random(num_experts, hidden_size, intermediate_size,
                                                gated=activations.is_gated(activation), bias=expert_bias,
                                                param_dtype=param_dtype, rngs=rngs)

    @property
    def quantized(self) -> bool:
        """Whether the experts are NVFP4."""
        return isinstance(self.experts, NVFP4ExpertWeights)

    def router_logits(self, x):
        """float32 ``[T, E]`` router logits of bf16 ``x [T, H]`` (bf16 operands, fp32 accumulation)."""
        return self.router(x)

    def __call__(self, x, *, topk_ids=None, return_routing: bool = False):
        """Apply the block.

        Parameters
        ----------
        x : float ``[..., H]`` (computed in bfloat16)
        topk_ids : optional int32 ``[..., k]``
            Replay this expert selection (e.g. recorded by a rollout with ``return_routing=True``)
            instead of routing ``x``. The combine weights are recomputed from this block's router
            logits for the given ids (:func:`replay_weights`), so gradients still reach the router,
            as in rollout routing replay for RL. ``k`` must be the block's ``top_k``; ids outside
            ``[0, num_experts)`` (negative ones, say) are padding.
        return_routing : bool
            Also return ``(topk_ids int32 [..., k], topk_weights float32 [..., k])``.

        Returns
        -------
        ``[..., H]`` in ``x.dtype``, or ``(out, (topk_ids, topk_weights))``.
        """
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"x.shape[-1]={x.shape[-1]} does not match hidden_size={self.hidden_size}")
        lead = x.shape[:-1]
        xt = x.reshape(-1, self.hidden_size).astype(jnp.bfloat16)
        experts = self.experts.experts()
        mode = self.mode
        if mode is not None and mode != "bf16" and not self.quantized:
            raise ValueError(f"MoE mode={mode!r} needs NVFP4 experts but this block holds bf16 ones; "
                             "quantize them with jax_nvfp4.nn.quantize_moe(model)")
        bias = None if self.router_bias is None else self.router_bias[...]
        logits = self.router_logits(xt)
        common = dict(activation=self.activation, mode=mode, backend=self.backend,
                      batch_invariant=self.batch_invariant)
        if topk_ids is None:
            def layer(xt, experts, logits, bias, offset=0):
                return moe(xt, experts, router_logits=logits, routing=self.routing, top_k=self.top_k, bias=bias,
                           n_group=self.n_group, topk_group=self.topk_group,
                           routed_scaling_factor=self.routed_scaling_factor, return_routing=True,
                           local_expert_offset=offset, **common)
            out, (ids, w) = self._over_experts(layer, xt, experts, (logits,), (bias,))
        else:
            if topk_ids.shape != lead + (self.top_k,):
                raise ValueError(f"topk_ids must have shape {lead + (self.top_k,)} (x's leading axes, then the "
                                 f"block's top_k), got {tuple(topk_ids.shape)}")
            if not jnp.issubdtype(topk_ids.dtype, jnp.integer):
                raise TypeError(f"topk_ids must be integer expert ids, got {topk_ids.dtype}")
            ids = topk_ids.reshape(-1, topk_ids.shape[-1]).astype(jnp.int32)
            w = replay_weights(logits, ids, self.routing, bias=bias,
                               routed_scaling_factor=self.routed_scaling_factor)

            def layer(xt, experts, ids, w, offset=0):
                return moe(xt, experts, topk_ids=ids, topk_weights=w, local_expert_offset=offset, **common), None
            out, _ = self._over_experts(layer, xt, experts, (ids, w), ())
        out = out.reshape(x.shape).astype(x.dtype)
        if return_routing:
            k = ids.shape[-1]
            return out, (ids.reshape(lead + (k,)), w.reshape(lead + (k,)))
        return out

    def _over_experts(self, layer, xt, experts, per_token, shared):
        """``layer(xt, experts, *per_token, *shared, offset) -> (out bf16 [T, H], rest)`` on all the experts,
        or with ``expert_axis`` in ``jax.shard_map`` on each device's experts, the outputs summed over the
        axis in float32; ``xt``, ``per_token`` (``[T, ...]``) and ``rest`` split along ``token_axis`` when set,
        ``shared`` replicated."""
        if self.expert_axis is None:
            return layer(xt, experts, *per_token, *shared)
        axis, spec = self.expert_axis, jax.sharding.PartitionSpec
        tok = spec(self.token_axis) if self.token_axis else spec()
        splits = math.prod(self.mesh.shape[a] for a in axis_names(self.token_axis))
        if xt.shape[0] % splits:
            raise ValueError(f"the {xt.shape[0]} tokens do not split evenly over mesh axes {self.token_axis!r} "
                             f"({splits} devices)")

        def local(xt, experts, *args):  # this device's E / n experts, global ids from the axis index
            out, rest = layer(xt, experts, *args, jax.lax.axis_index(axis) * experts.num_experts)
            return jax.lax.psum(out.astype(jnp.float32), axis), rest

        f = jax.shard_map(local, mesh=self.mesh, in_specs=(tok, spec(axis)) + (tok,) * len(per_token)
                          + (spec(),) * len(shared), out_specs=tok)
        return f(xt, experts, *per_token, *shared)  # (float32: rounded once, to x's dtype)


def replay_weights(router_logits, topk_ids, routing: str, *, bias=None, routed_scaling_factor=1.0):
    """Combine weights of a given expert selection, as ``routing`` would weight it.

    Parameters
    ----------
    router_logits : float ``[T, E]`` (cast to float32)
    topk_ids : int32 ``[T, k]``; ids outside ``[0, E)`` (negative ones, say) are padding (weight 0, left out of
        normalizations)
    routing : a :data:`jax_nvfp4.ROUTING_METHODS` name
    bias : optional ``[E]``, added to the logits (for ``deepseek_v3`` it only ever affected selection,
        so it is not used here)
    routed_scaling_factor : float

    Returns
    -------
    float32 ``[T, k]``: for the ids :func:`jax_nvfp4.route` selects, exactly its weights.
    """
    check_choice(routing, ROUTING_METHODS, "routing")
    # Jitted as route is: eagerly, op by op, XLA:CPU's sigmoid can differ from the compiled one in the last bit.
    return _replay_weights(router_logits, topk_ids, None if routing == "deepseek_v3" else bias,
                           jnp.asarray(routed_scaling_factor, jnp.float32), routing=routing)


@functools.partial(jax.jit, static_argnames=("routing",))
def _replay_weights(router_logits, topk_ids, bias, routed_scaling_factor, *, routing):
    l = router_logits.astype(jnp.float32)
    if bias is not None:
        l = l + bias.astype(jnp.float32)
    valid = (topk_ids >= 0) & (topk_ids < l.shape[-1])
    idx = jnp.where(valid, topk_ids, 0)
    k = topk_ids.shape[-1]

    def pick(v):
        return jnp.where(valid, jnp.take_along_axis(v, idx, axis=-1), 0.0)

    if routing in ("softmax_topk", "renormalize_naive"):
        w = pick(jax.nn.softmax(l, axis=-1))
        if routing == "renormalize_naive":
            w = w / (w.sum(-1, keepdims=True) + _EPS)
    elif routing == "renormalize":
        w = jax.nn.softmax(jnp.where(valid, pick(l), -jnp.inf), axis=-1)
        w = jnp.where(valid, w, 0.0)
    elif routing == "topk_uniform":
        w = jnp.where(valid, jnp.float32(1.0 / k), 0.0)
    elif routing == "llama4":
        w = pick(jax.nn.sigmoid(l))
    else:  # deepseek_v3
        w = pick(jax.nn.sigmoid(l))
        w = w / (w.sum(-1, keepdims=True) + _EPS)
    return (w * routed_scaling_factor).astype(jnp.float32)
