"""MoE routing: router logits -> (top-k expert ids, combine weights), spec section 5.

All arithmetic is float32 on the logits. Selection is ``lax.top_k``'s (on several devices the same bits by a
sort, :func:`top_k_sorted`, which XLA keeps split over tokens): stable, so among equal scores the lower expert
id wins. Every method multiplies the weights by
``routed_scaling_factor``.

Methods (selection; weights), with ``p = softmax(l)``, ``s = sigmoid(l)``:

- ``softmax_topk``: top-k of ``p``; ``p[topk]`` (no renormalization).
- ``renormalize``: top-k of ``l``; ``softmax(l[topk])``.
- ``renormalize_naive``: top-k of ``p``; ``p[topk] / (sum p[topk] + 1e-20)``.
- ``topk_uniform``: top-k of ``l``; ``1/k`` each.
- ``llama4``: argmax (k = 1); ``sigmoid(l[top1])``.
- ``deepseek_v3``: ``b = s + bias``; E is split into ``n_group`` groups scored by the sum of
  their top-2 ``b``; top-k of ``b`` within the ``topk_group`` best groups;
  ``s[topk] / (sum s[topk] + 1e-20)``.

For every method but ``deepseek_v3`` an optional ``bias [E]`` is added to the logits first;
for ``deepseek_v3`` it is required and affects selection only.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

ROUTING_METHODS = ("softmax_topk", "renormalize", "renormalize_naive", "topk_uniform", "llama4",
                   "deepseek_v3")
_EPS = 1e-20
_FLOATS = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def static_int(v, name):
    """``v`` as a Python int: a Python or numpy integer (sizes read from a numpy or JSON config), not a bool or an
    array (a static argument must be known at trace time)."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{name} must be a Python int (a static argument), got {type(v).__name__}")
    return int(v)


def check_route_args(logits_shape, logits_dtype, method, *, top_k, bias=None, n_group=None,
                     topk_group=None):
    """Validate routing arguments at trace time; raise errors that name the argument.

    Returns
    -------
    (n_group, topk_group) resolved for ``deepseek_v3`` (defaults: one group, all kept), else (None, None).
    """
    if method not in ROUTING_METHODS:
        raise ValueError(f"routing method must be one of {ROUTING_METHODS}, got {method!r}")
    if len(logits_shape) != 2:
        raise ValueError(f"router_logits must be 2-D [T, E], got shape {tuple(logits_shape)}")
    if jnp.dtype(logits_dtype) not in _FLOATS:
        raise TypeError(f"router_logits must be bfloat16, float16 or float32, got {logits_dtype}")
    e = logits_shape[1]
    top_k = static_int(top_k, "top_k")
    if not 1 <= top_k <= e:
        raise ValueError(f"top_k must be in [1, E={e}] (E = router_logits.shape[1]), got {top_k}")
    if method == "llama4" and top_k != 1:
        raise ValueError(f"routing 'llama4' selects one expert: top_k must be 1, got {top_k}")
    if bias is not None:
        if not hasattr(bias, "shape") or tuple(bias.shape) != (e,):
            raise ValueError(f"bias must have shape [E]=({e},), got {getattr(bias, 'shape', type(bias))}")
        if jnp.dtype(bias.dtype) not in _FLOATS:
            raise TypeError(f"bias must be bfloat16, float16 or float32, got {bias.dtype}")
    if method != "deepseek_v3":
        if n_group is not None or topk_group is not None:
            raise ValueError(f"n_group/topk_group apply only to routing 'deepseek_v3', not {method!r}")
        return None, None
    if bias is None:
        raise ValueError("routing 'deepseek_v3' needs bias [E] (the expert score correction bias)")
    n_group = 1 if n_group is None else static_int(n_group, "n_group")
    if n_group < 1 or e % n_group:
        raise ValueError(f"n_group must be a positive divisor of E={e}, got {n_group}")
    topk_group = n_group if topk_group is None else static_int(topk_group, "topk_group")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group must be in [1, n_group={n_group}], got {topk_group}")
    size = e // n_group
    if size < 2:
        raise ValueError(f"deepseek_v3 scores a group by its top-2 experts: E/n_group must be >= 2, "
                         f"got E={e}, n_group={n_group}")
    if topk_group * size < top_k:
        raise ValueError(f"top_k={top_k} exceeds the {topk_group * size} experts in the topk_group="
                         f"{topk_group} kept groups of {size}")
    return n_group, topk_group


def top_k_sorted(x, k: int):
    """``lax.top_k(x, k)`` of float32 ``x [..., n]``, bit for bit, by a stable sort along the last axis.

    The same order as ``lax.top_k``'s: IEEE total order (``-0 < +0``, NaNs past the infinities by their sign),
    ties to the lower index. XLA partitions a sort along its other axes, but not jax's ``top_k``: with the tokens
    split over devices, each device would gather every token's logits and select for all of them.

    Returns (values float32 ``[..., k]``, indices int32 ``[..., k]``).
    """
    if x.dtype != jnp.float32:
        raise TypeError(f"top_k_sorted: x must be float32, got {x.dtype}")
    i = lax.bitcast_convert_type(x, jnp.int32)
    key = ~jnp.where(i < 0, i ^ jnp.int32(0x7FFFFFFF), i)  # ascending key = descending total order
    iota = jnp.zeros_like(i) + lax.iota(jnp.int32, x.shape[-1])  # (x's sharding: sort wants its operands' alike)
    _, ids = lax.sort((key, iota), dimension=x.ndim - 1, is_stable=True, num_keys=1)
    ids = ids[..., :k]
    return jnp.take_along_axis(x, ids, axis=-1), ids


def _top_k(x, k: int):
    # On one device nothing is split, and lax.top_k is the faster kernel (benchmarks/routing.py).
    return lax.top_k(x, k) if jax.device_count() == 1 else top_k_sorted(x, k)


def _deepseek_v3(l, bias, top_k, n_group, topk_group):
    t, e = l.shape
    s = jax.nn.sigmoid(l)
    b = s + bias
    size = e // n_group
    top2, _ = _top_k(b.reshape(t, n_group, size), 2)
    group_score = top2.sum(-1)  # [T, n_group]
    _, keep = _top_k(group_score, topk_group)
    # Top-k among the kept groups' experts only, gathered in ascending id order (ties go to the lower id): masking
    # the others with -inf would let them tie with a kept expert whose b is -inf.
    cand = (jnp.sort(keep, axis=-1)[..., None] * size + jnp.arange(size)).reshape(t, topk_group * size)
    _, j = _top_k(jnp.take_along_axis(b, cand, axis=1), top_k)
    ids = jnp.take_along_axis(cand, j, axis=1)
    sel = jnp.take_along_axis(s, ids, axis=1)
    return ids, sel / (sel.sum(-1, keepdims=True) + _EPS)


def route(router_logits, method: str = "softmax_topk", *, top_k: int, bias=None, n_group=None,
          topk_group=None, routed_scaling_factor=1.0):
    """Select experts for each token.

    Parameters
    ----------
    router_logits : bfloat16 / float16 / float32 ``[T, E]``
        Router logits over all (global) experts; cast to float32.
    method : str
        One of :data:`ROUTING_METHODS` (see the module docstring).
    top_k : int (static)
        Experts per token, ``1 <= top_k <= E`` (1 for ``llama4``).
    bias : optional float ``[E]``
        Added to the logits (to ``sigmoid(l)`` for selection only, with ``deepseek_v3``, where it
        is required).
    n_group, topk_group : optional int (static, ``deepseek_v3`` only)
        ``E`` is split into ``n_group`` groups of consecutive experts; the ``topk_group`` groups
        with the highest sum of their top-2 biased scores are kept. Defaults: one group, all kept.
    routed_scaling_factor : float or float32 scalar
        Multiplies the weights.

    Returns
    -------
    topk_ids : int32 ``[T, top_k]``
        Ordered by descending selection score; ties go to the lower expert id.
    topk_weights : float32 ``[T, top_k]``

    Notes
    -----
    Jit-able and differentiable: gradients reach ``router_logits`` (and ``bias`` except for
    ``deepseek_v3``) through the weights; the selection itself is piecewise constant.
    """
    if not hasattr(router_logits, "shape") or not hasattr(router_logits, "dtype"):
        raise TypeError(f"router_logits must be an array, got {type(router_logits).__name__}")
    top_k = static_int(top_k, "top_k")
    n_group, topk_group = check_route_args(router_logits.shape, router_logits.dtype, method,
                                           top_k=top_k, bias=bias, n_group=n_group,
                                           topk_group=topk_group)
    return _route(router_logits, bias, jnp.asarray(routed_scaling_factor, jnp.float32), method=method,
                  top_k=top_k, n_group=n_group, topk_group=topk_group)


@functools.partial(jax.jit, static_argnames=("method", "top_k", "n_group", "topk_group"))
def _route(router_logits, bias, routed_scaling_factor, *, method, top_k, n_group, topk_group):
    l = router_logits.astype(jnp.float32)
    b = None if bias is None else bias.astype(jnp.float32)
    if method == "deepseek_v3":
        ids, w = _deepseek_v3(l, b, top_k, n_group, topk_group)
    else:
        if b is not None:
            l = l + b
        if method in ("softmax_topk", "renormalize_naive"):
            w, ids = _top_k(jax.nn.softmax(l, axis=-1), top_k)
            if method == "renormalize_naive":
                w = w / (w.sum(-1, keepdims=True) + _EPS)
        elif method == "renormalize":
            v, ids = _top_k(l, top_k)
            w = jax.nn.softmax(v, axis=-1)
        elif method == "topk_uniform":
            _, ids = _top_k(l, top_k)
            w = jnp.full(ids.shape, 1.0 / top_k, jnp.float32)
        else:  # llama4
            v, ids = _top_k(l, 1)
            w = jax.nn.sigmoid(v)
    w = w * routed_scaling_factor
    return ids.astype(jnp.int32), w.astype(jnp.float32)


def shard_ids(topk_ids, local_expert_offset):
    """int32 ``[T, k]`` global expert ids -> ids of the shard whose expert 0 is ``local_expert_offset`` (an int32
    scalar, e.g. traced from ``lax.axis_index`` under ``shard_map``): ``id - offset``, and -1 (padding) for
    padding and for the experts of earlier shards; later shards' ids stay past the shard's experts."""
    ids = jnp.asarray(topk_ids).astype(jnp.int32)
    offset = jnp.asarray(local_expert_offset, jnp.int32)
    return jnp.where((ids < 0) | (ids < offset), -1, ids - offset)  # padding stays padding at any offset
