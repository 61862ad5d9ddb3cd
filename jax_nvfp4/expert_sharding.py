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

The rule is Shardy's (jax's default partitioner; ``jax.export`` cannot serialize it). On one device, inside
``shard_map`` and under the GSPMD partitioner the function runs as it is. Each device's kernels choose their tiles
from its own share of the tokens, as they would in ``shard_map``. On Explicit mesh axes the output is typed with
``x``'s split of T.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
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


def _sharding_rule(ranks: tuple[int, ...]):
    """Shardy's rule: T passes through from x, ids and weights to the output; E (every leaf's first dimension) is
    reduced over; the rest must stay whole."""
    leaves = [["e"] + [f"l{i}d{j}" for j in range(1, r)] for i, r in enumerate(ranks)]
    operands = ["t h", "t k", "t k"] + [" ".join(f) for f in leaves]
    whole = ("h", "k") + tuple(f for fs in leaves for f in fs[1:])
    return ", ".join(operands) + " -> t h", whole


def over_experts(forward, offset: int):
    """``forward(x, topk_ids, topk_weights, leaves, offset)`` (x ``[T, H]``, ids and weights ``[T, k]``, ``leaves``
    the experts' flat leaves, each ``[E, ...]``, ``offset`` the static global id of expert 0) as
    ``f(x, topk_ids, topk_weights, leaves)`` at ``offset``, partitioned over experts and tokens (module docstring)."""

    def partition(mesh, arg_shapes, result_shape):
        x, _, _, leaves = arg_shapes
        ep, tok, scatter = plan(mesh, x, leaves)
        e_local = leaves[0].shape[0] // math.prod(mesh.shape[a] for a in ep)
        rows = NamedSharding(mesh, P(tok or None, None))
        in_shardings = (rows, rows, rows,
                        tuple(NamedSharding(mesh, P(ep or None, *(None,) * (len(v.shape) - 1))) for v in leaves))
        summed = tuple(a for a in ep if a not in scatter)

        # Each device's function sees every mesh axis as manual, as in shard_map (under jax.set_mesh, an
        # ambient mesh of Explicit axes would leave sharding annotations in it that nothing lowers).
        manual = jax.sharding.AbstractMesh(tuple(mesh.shape.values()), tuple(mesh.shape),
                                           axis_types=(AxisType.Manual,) * len(mesh.shape))

        def shard(x, topk_ids, topk_weights, leaves):
            with jax.sharding.use_abstract_mesh(manual):
                if not ep:
                    return forward(x, topk_ids, topk_weights, leaves, offset)
                first = offset + jax.lax.axis_index(ep) * e_local  # this device's expert 0
                out = forward(x, shard_ids(topk_ids, first), topk_weights, leaves, 0)
                y = out.astype(jnp.float32)
                y = jax.lax.psum(y, summed) if summed else y
                y = jax.lax.psum_scatter(y, scatter, scatter_dimension=0, tiled=True) if scatter else y
                return y.astype(out.dtype)

        return mesh, shard, NamedSharding(mesh, P(tok + scatter or None, None)), in_shardings

    @functools.lru_cache(maxsize=None)
    def for_ranks(ranks):
        @custom_partitioning
        def f(x, topk_ids, topk_weights, leaves):
            # The unsplit function (its shapes and types; the partition replaces it) on operands typed whole: the
            # pure-JAX forward indexes E, which XLA refuses to trace on an Explicit axis.
            out = forward(*jax.tree_util.tree_map(_typed_whole, (x, topk_ids, topk_weights, leaves)), offset)
            # On Explicit axes the output's type is the kernels' (replicated): give it x's split of T, which the
            # partition keeps, lest the typed replicated output gather every device's rows.
            aval = jax.typeof(x)
            t_axes = _lead_axes(aval)
            return jax.sharding.reshard(out, NamedSharding(aval.sharding.mesh, P(t_axes, None))) if t_axes else out

        rule, whole = _sharding_rule(ranks)
        f.def_partition(partition, sharding_rule=rule, reduction_factors=("e",), need_replication_factors=whole)
        return f

    def f(x, topk_ids, topk_weights, leaves):
        args = (x, topk_ids, topk_weights, tuple(leaves))
        at = lambda *a: forward(*a, offset)  # noqa: E731
        # A custom partitioning may not hold constants, and its rule is Shardy's: a forward whose trace has some
        # (e.g. the pure-JAX quantizer's tables, KernelFlag.JAX_QUANT), or the GSPMD partitioner
        # (jax_use_shardy_partitioner off), runs unsplit, as it would without this module.
        if (jax.device_count() == 1 or _in_shard_map() or not jax.config.jax_use_shardy_partitioner
                or jax.make_jaxpr(lambda *a: at(*jax.tree_util.tree_map(_typed_whole, a)))(*args).consts):
            return at(*args)
        return for_ranks(tuple(v.ndim for v in leaves))(*args)

    return f
