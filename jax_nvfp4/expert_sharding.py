"""How the expert computation splits over devices under plain ``jax.jit`` (Shardy partitioning).

XLA cannot split a custom call: without a rule it gathers every operand of the ffi kernels onto every device, so
each device would hold and read all the experts. It gathers the pure-JAX backend's experts too (its grouped matmul
indexes E; on Explicit mesh axes it refuses to trace). :func:`over_experts` gives the expert computation (of the ffi
kernels and of backend ``xla``) a ``custom_partitioning`` rule instead:

- experts sharded along E over some mesh axes run as expert parallelism: each device runs its own experts (global
  ids from the axis index) and the outputs are summed over those axes in float32 (``psum``), then rounded to the
  output dtype, as ``jax_nvfp4.nn.MoE(expert_axis=...)`` does in ``shard_map``;
- tokens sharded along T over other axes run as data parallelism: each device its own tokens; tokens sharded
  over expert axes too are gathered over those, and the outputs' sum is scattered back to them (reduce-scatter);
- every other dimension is replicated (the partitioner gathers it if it was sharded).

:func:`with_expert_grads` (its rule :func:`expert_vjp`) gives the backward pass the same split (:func:`over_experts_vjp`): each
device differentiates the pure-JAX function on its own experts and tokens; dx and the routing weights' cotangent are
summed over the expert axes, the experts' cotangents over the token axes (they stay split along E).

The rule is Shardy's (jax's default partitioner; ``jax.export`` cannot serialize it). On one device, inside
``shard_map`` and under the GSPMD partitioner the function runs as it is. Each device's kernels choose their tiles
from its own share of the tokens, as they would in ``shard_map``. On Explicit mesh axes the output is typed with
``x``'s split of T.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from .routing import shard_ids


def axis_names(entry) -> tuple[str, ...]:
    """Mesh axis names from a PartitionSpec entry or an axis argument: None, one name or a sequence of them."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _lead_axes(arg) -> tuple[str, ...]:
    """The mesh axes that split ``arg``'s first dimension (none unless its sharding is a NamedSharding)."""
    sharding = getattr(arg, "sharding", None)
    if not isinstance(sharding, NamedSharding) or not len(sharding.spec):
        return ()
    return axis_names(sharding.spec[0])


def _in_shard_map() -> bool:
    """Inside ``shard_map`` (any manual axis), where the caller has split the work already: axes it leaves
    automatic see the kernels as one replicated op, as without this module."""
    return any(t == AxisType.Manual for t in jax.sharding.get_abstract_mesh().axis_types)


def _typed_whole(v):
    """``v`` resharded whole where its type names Explicit mesh axes (else ``v`` itself)."""
    sharding = jax.typeof(v).sharding
    if any(axis_names(e) for e in getattr(sharding, "spec", ())):
        return jax.sharding.reshard(v, NamedSharding(sharding.mesh, P()))
    return v


def fold_token_sets(fn, axis_size: int, in_batched, x, topk_ids, topk_weights, leaves):
    """``fn(x, topk_ids, topk_weights, leaves)`` over a batch of ``axis_size`` token sets sharing the experts (a
    ``custom_vmap`` rule; ``in_batched`` its flags): as one set of ``axis_size * T`` tokens, one call that splits
    like any other. (On Explicit axes the fold cannot merge an unsplit batch with a split T.)"""
    t = x.shape[1] if in_batched[0] else x.shape[0]

    def fold(v, b):
        v = v if b else jnp.broadcast_to(v, (axis_size,) + v.shape)
        return v.reshape((axis_size * v.shape[1],) + v.shape[2:])
    out = fn(*(fold(v, b) for v, b in zip((x, topk_ids, topk_weights), in_batched)), leaves)
    return out.reshape((axis_size, t) + out.shape[1:])  # (t, not -1: an empty batch has no size to divide)


def map_batch(fn, axis_size: int, in_batched, args):
    """``fn(*args)`` over a batch of ``axis_size``, one element after the other (``lax.map``; a ``custom_vmap`` rule,
    ``in_batched`` its flags): an argument with any batched leaf is mapped, its other leaves broadcast; the others
    are passed whole."""
    mapped = [any(jax.tree_util.tree_leaves(b)) for b in in_batched]
    xs = [jax.tree_util.tree_map(lambda v, vb: v if vb else jnp.broadcast_to(v, (axis_size,) + jnp.shape(v)), a, b)
          for a, b, m in zip(args, in_batched, mapped) if m]

    def one(elements):
        it = iter(elements)
        return fn(*(next(it) if m else a for a, m in zip(args, mapped)))
    return jax.lax.map(one, xs)


def with_batching(fn):
    """``fn(x, topk_ids, topk_weights, leaves)`` as a ``custom_vmap`` function: a batch of token sets sharing the
    experts runs as one set (:func:`fold_token_sets`), a batch of expert sets (e.g. stacked layers) one set after
    the other (:func:`map_batch`), each call as ``fn`` runs alone (split over devices where ``fn`` is). Not ``fn``
    batched as it is: on Explicit mesh axes jax cannot sort a batch's tokens split over devices, and it batches
    ``ragged_dot`` only where the routing is batched with the tokens."""
    batched = jax.custom_batching.custom_vmap(fn)

    @batched.def_vmap
    def _vmap(axis_size, in_batched, x, topk_ids, topk_weights, leaves):
        if any(in_batched[3]):
            return map_batch(batched, axis_size, in_batched, (x, topk_ids, topk_weights, leaves)), True
        return fold_token_sets(batched, axis_size, in_batched, x, topk_ids, topk_weights, leaves), True
    return batched


def plan(mesh, x, leaves) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """``(expert_axes, token_axes, scatter_axes)``: the axes that split the experts' E (those of ``leaves[0]``, the
    GEMM1 codes), and those that split ``x``'s T, apart (token axes) or also split E (scatter axes: a device's rows
    meet every device's experts there, so x is gathered over them and the outputs' sum scattered back); each empty
    unless it divides its dimension."""
    size = lambda axes: math.prod(mesh.shape[a] for a in axes)  # noqa: E731
    ep = _lead_axes(leaves[0])
    if leaves[0].shape[0] % size(ep):
        ep = ()
    t_axes = _lead_axes(x)
    if x.shape[0] % size(t_axes):
        t_axes = ()
    return ep, tuple(a for a in t_axes if a not in ep), tuple(a for a in t_axes if a in ep)


def _sharding_rule(ranks: tuple[int, ...], grads: tuple[int, ...] | None = None):
    """Shardy's rule: T passes through from x, ids and weights to the output; E (every leaf's first dimension) is
    reduced over; the rest must stay whole. With ``grads`` (the leaves differentiated) the backward's: the
    cotangent ``t h`` joins the operands, and the results are dx, d weights and those leaves' cotangents."""
    leaves = [["e"] + [f"l{i}d{j}" for j in range(1, r)] for i, r in enumerate(ranks)]
    operands = ["t h", "t k", "t k"] + [" ".join(f) for f in leaves]
    whole = ("h", "k") + tuple(f for fs in leaves for f in fs[1:])
    if grads is None:
        return ", ".join(operands) + " -> t h", whole
    return ", ".join(operands + ["t h"]) + " -> " + ", ".join(["t h", "t k"] + [operands[3 + i] for i in grads]), whole


def _summed(v, axes, scatter=()):
    """``v`` summed over the mesh ``axes`` in float32 (``psum``), and over the ``scatter`` axes with each device
    keeping its rows (``psum_scatter`` along dimension 0), then rounded to its dtype."""
    y = v.astype(jnp.float32)
    y = jax.lax.psum(y, axes) if axes else y
    y = jax.lax.psum_scatter(y, scatter, scatter_dimension=0, tiled=True) if scatter else y
    return y.astype(v.dtype)


def _manual(mesh):
    """``mesh`` with every axis manual, as in ``shard_map``: each device's function runs under it (under
    ``jax.set_mesh``, an ambient mesh of Explicit axes would leave sharding annotations in it that nothing
    lowers)."""
    return jax.sharding.AbstractMesh(tuple(mesh.shape.values()), tuple(mesh.shape),
                                     axis_types=(AxisType.Manual,) * len(mesh.shape))


def _whole_call(fn, args):
    """``fn(*args)`` on ``args`` typed whole: on Explicit mesh axes inside a ``shard_map`` over the mesh with every
    operand and result replicated (jax does not type ``ragged_dot`` nor its transpose on Explicit axes, even
    replicated ones). The unsplit function, for its shapes and types (the partition replaces it)."""
    args = jax.tree_util.tree_map(_typed_whole, args)
    meshes = (getattr(jax.typeof(v).sharding, "mesh", None) for v in jax.tree_util.tree_leaves(args))
    mesh = next((m for m in meshes if m is not None and AxisType.Explicit in tuple(m.axis_types)), None)
    if mesh is None:
        return fn(*args)
    return jax.shard_map(fn, mesh=mesh, in_specs=P(), out_specs=P())(*args)


def _typed_whole_call(fn, args):
    """``fn(*args)`` on ``args`` typed whole (see :func:`_whole_call`, which also takes ``fn`` into a ``shard_map``:
    the forward's unsplit body does without it, its output keeping the types it had)."""
    return fn(*jax.tree_util.tree_map(_typed_whole, args))


def _runs_unsplit(fn, args, whole) -> bool:
    """Whether ``fn(*args)`` runs as it is: on one device, inside ``shard_map``, under the GSPMD partitioner
    (``jax_use_shardy_partitioner`` off; the rule is Shardy's), or where its trace by ``whole`` (as the custom
    partitioning's body calls it) holds constants (a custom partitioning refuses them, e.g. the pure-JAX quantizer's
    tables, KernelFlag.JAX_QUANT)."""
    return bool(jax.device_count() == 1 or _in_shard_map() or not jax.config.jax_use_shardy_partitioner
                or jax.make_jaxpr(lambda *a: whole(fn, a))(*args).consts)


def _typed_like(v, like):
    """On Explicit axes, ``v`` (typed whole) given ``like``'s split of its first dimension (else ``v``)."""
    aval = jax.typeof(like)
    axes = _lead_axes(aval)
    return jax.sharding.reshard(v, NamedSharding(aval.sharding.mesh, P(axes, *(None,) * (v.ndim - 1)))) if axes else v


class _Split(NamedTuple):
    """How a partition splits the work on ``mesh`` (see :func:`plan`): its axes, a device's experts, and the
    shardings of the rows (split along the token axes), of the output rows (also along the scatter axes) and of
    the leaves (along the expert axes)."""
    ep: tuple[str, ...]
    tok: tuple[str, ...]
    scatter: tuple[str, ...]
    summed: tuple[str, ...]  # expert axes the outputs are summed over (psum; the scatter axes by psum_scatter)
    e_local: int
    rows: NamedSharding
    out_rows: NamedSharding
    experts: tuple[NamedSharding, ...]


def _split(mesh, x, leaves) -> _Split:
    ep, tok, scatter = plan(mesh, x, leaves)
    return _Split(ep, tok, scatter, tuple(a for a in ep if a not in scatter),
                  leaves[0].shape[0] // math.prod(mesh.shape[a] for a in ep),
                  NamedSharding(mesh, P(tok or None, None)), NamedSharding(mesh, P(tok + scatter or None, None)),
                  tuple(NamedSharding(mesh, P(ep or None, *(None,) * (len(v.shape) - 1))) for v in leaves))


def _on_device(fn, split: _Split, offset: int, x, topk_ids, *rest):
    """``fn(x, topk_ids, *rest, offset)`` on this device's experts: with expert axes, the ids of its shard (its expert
    0's global id from the axis index) at offset 0."""
    if split.ep:
        topk_ids, offset = shard_ids(topk_ids, offset + jax.lax.axis_index(split.ep) * split.e_local), 0
    return fn(x, topk_ids, *rest, offset)


def _call(fn, offset: int, for_ranks, whole, args):
    """``fn(*args, offset)``, through the custom partitioning ``for_ranks(leaf ranks)`` unless it runs unsplit."""
    at = lambda *a: fn(*a, offset)  # noqa: E731
    if _runs_unsplit(at, args, whole):
        return at(*args)
    return for_ranks(tuple(v.ndim for v in args[3]))(*args)


def over_experts(forward, offset: int):
    """``forward(x, topk_ids, topk_weights, leaves, offset)`` (x ``[T, H]``, ids and weights ``[T, k]``, ``leaves``
    the experts' flat leaves, each ``[E, ...]``, ``offset`` the static global id of expert 0) as
    ``f(x, topk_ids, topk_weights, leaves)`` at ``offset``, partitioned over experts and tokens (module docstring)."""

    def partition(mesh, arg_shapes, result_shape):
        x, _, _, leaves = arg_shapes
        sp = _split(mesh, x, leaves)

        def shard(*args):
            with jax.sharding.use_abstract_mesh(_manual(mesh)):
                return _summed(_on_device(forward, sp, offset, *args), sp.summed, sp.scatter)

        return mesh, shard, sp.out_rows, (sp.rows, sp.rows, sp.rows, sp.experts)

    @functools.lru_cache(maxsize=None)
    def for_ranks(ranks):
        @custom_partitioning
        def f(x, topk_ids, topk_weights, leaves):
            # The unsplit function (its shapes and types; the partition replaces it) on operands typed whole: the
            # pure-JAX forward indexes E, which XLA refuses to trace on an Explicit axis. On Explicit axes the
            # output's type is the kernels' (replicated): give it x's split of T, which the partition keeps, lest
            # the typed replicated output gather every device's rows.
            return _typed_like(_typed_whole_call(lambda *a: forward(*a, offset), (x, topk_ids, topk_weights, leaves)),
                               x)

        rule, whole = _sharding_rule(ranks)
        f.def_partition(partition, sharding_rule=rule, reduction_factors=("e",), need_replication_factors=whole)
        return f

    return lambda x, topk_ids, topk_weights, leaves: _call(forward, offset, for_ranks, _typed_whole_call,
                                                           (x, topk_ids, topk_weights, tuple(leaves)))


def over_experts_vjp(backward, offset: int, grads: tuple[int, ...]):
    """The backward pass of :func:`over_experts`'s function, partitioned alike: ``backward(x, topk_ids,
    topk_weights, leaves, ct, offset)`` (``ct`` the output's cotangent ``[T, H]``) returns ``(dx, d topk_weights,
    d leaves)``, the last for the leaves numbered in ``grads`` (float leaves: a partition cannot return float0).
    As ``f(x, topk_ids, topk_weights, leaves, ct)`` at ``offset``: each device differentiates its own experts on
    its own tokens; dx and d weights are summed over the expert axes (in float32, scattered back to their rows where
    the tokens were gathered), the leaves' cotangents over the token axes, and stay split along E (no expert
    gathered, on Auto and on Explicit axes)."""

    def partition(mesh, arg_shapes, result_shape):
        x, _, _, leaves, _ = arg_shapes
        sp = _split(mesh, x, leaves)

        def shard(*args):
            with jax.sharding.use_abstract_mesh(_manual(mesh)):
                dx, dw, dleaves = _on_device(backward, sp, offset, *args)
                return (_summed(dx, sp.summed, sp.scatter), _summed(dw, sp.summed, sp.scatter),
                        tuple(_summed(v, sp.tok) for v in dleaves))

        return (mesh, shard, (sp.out_rows, sp.out_rows, tuple(sp.experts[i] for i in grads)),
                (sp.rows, sp.rows, sp.rows, sp.experts, sp.rows))

    @functools.lru_cache(maxsize=None)
    def for_ranks(ranks):
        @custom_partitioning
        def f(x, topk_ids, topk_weights, leaves, ct):
            # As over_experts' unsplit function: on operands typed whole (in a shard_map on Explicit axes: the
            # pure-JAX backward transposes ragged_dot), the results typed as their primals.
            dx, dw, dleaves = _whole_call(lambda *a: backward(*a, offset), (x, topk_ids, topk_weights, leaves, ct))
            return (_typed_like(dx, x), _typed_like(dw, topk_weights),
                    tuple(_typed_like(v, leaves[i]) for v, i in zip(dleaves, grads)))

        rule, whole = _sharding_rule(ranks, grads)
        f.def_partition(partition, sharding_rule=rule, need_replication_factors=whole)
        return f

    return lambda x, topk_ids, topk_weights, leaves, ct: _call(backward, offset, for_ranks, _whole_call,
                                                               (x, topk_ids, topk_weights, tuple(leaves), ct))


def expert_vjp(forward, offset: int):
    """A ``custom_vjp`` backward rule ``bwd(residuals, ct)`` for ``forward(x, topk_ids, topk_weights, leaves,
    offset)`` at ``offset`` (``residuals`` its operands): the cotangents of x, the ids (float0), the weights and
    every leaf (float0 for integer leaves), from ``jax.vjp`` of ``forward``, partitioned by
    :func:`over_experts_vjp` under plain ``jit``; under ``jax.vmap`` one batch element after the other, each split
    (per-example gradients cannot fold into one token set)."""

    def backward(x, topk_ids, topk_weights, leaves, ct, offset, grads):
        def of(x, topk_weights, floats):
            full = list(leaves)
            for i, v in zip(grads, floats):
                full[i] = v
            return forward(x, topk_ids, topk_weights, tuple(full), offset)
        out, vjp = jax.vjp(of, x, topk_weights, tuple(leaves[i] for i in grads))
        return vjp(ct.astype(out.dtype))

    @functools.lru_cache(maxsize=None)
    def for_grads(grads):
        plain = functools.partial(backward, grads=grads)
        split = jax.custom_batching.custom_vmap(over_experts_vjp(plain, offset, grads))

        @split.def_vmap
        def _vmap(axis_size, in_batched, *args):
            # One batch element after the other, each split as above (a fold into one token set would sum the
            # elements' expert cotangents).
            out = map_batch(split, axis_size, in_batched, args)
            return out, jax.tree_util.tree_map(lambda _: True, out)
        return with_reference_jvp(split, lambda *a: plain(*a, offset))

    def bwd(residuals, ct):
        x, topk_ids, topk_weights, leaves = residuals
        grads = tuple(i for i, v in enumerate(leaves) if jnp.issubdtype(v.dtype, jnp.inexact))
        dx, dw, dfloats = for_grads(grads)(x, topk_ids, topk_weights, tuple(leaves), ct)
        dleaves = [np.zeros(v.shape, jax.dtypes.float0) for v in leaves]
        for i, v in zip(grads, dfloats):
            dleaves[i] = v
        return dx, np.zeros(topk_ids.shape, jax.dtypes.float0), dw, tuple(dleaves)

    return bwd


def with_expert_grads(primal, reference, offset: int):
    """``primal(x, topk_ids, topk_weights, leaves)`` as a ``custom_vjp`` function whose gradients are those of
    ``reference(x, topk_ids, topk_weights, leaves, offset)`` at ``offset`` (:func:`expert_vjp`: split over devices
    as the forward is). Reverse mode, also of a higher order or under ``jax.jvp`` (Hessian-vector products): those
    differentiate the rules, whose calls take their JVPs from ``reference`` (a kernel has none)."""
    differentiable = with_reference_jvp(primal, lambda *a: reference(*a, offset))
    f = jax.custom_vjp(primal)
    f.defvjp(lambda *args: (differentiable(*args), args), expert_vjp(reference, offset))
    return f


def with_reference_jvp(f, reference):
    """``f`` (kernels, ``custom_vmap`` or ``custom_partitioning``: none differentiable) with ``reference``'s JVP, the
    same function in pure JAX; a derivative of a derivative differentiates the first one's rules through it."""
    g = jax.custom_jvp(f)
    g.defjvp(lambda primals, tangents: (f(*primals), jax.jvp(reference, primals, tangents)[1]))
    return g
