"""moe_align: the token-expert pairs sorted by local expert into tile-padded groups, and its twin."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .constants import TILE_MS, ALIGN_GRID_MIN_PAIRS, ALIGN_GRID_MAX_SLOTS
from .extension import TARGET_ALIGN, ensure_registered, check_kernel_flags, _check_impl
from .tiling import padded_rows


def moe_align(topk_ids, num_experts: int, *, tile_m: int, expert_offset: int = 0, impl: str = "ffi",
              kernel_flags: int = 0):
    """Sort token-expert pairs by local expert into groups padded to ``tile_m`` rows.

    Parameters
    ----------
    topk_ids : int32 ``[T, k]``
        Global expert ids; negative ids and ids outside
        ``[expert_offset, expert_offset + num_experts)`` are dropped.
    num_experts : int
        Local experts E.
    tile_m : int
        Group padding (one of :data:`TILE_MS`).
    expert_offset : int
        Global id of local expert 0 (expert parallelism).
    impl : ``"ffi"`` or ``"jax"``
    kernel_flags : :class:`KernelFlag` bits (``ALIGN_ONE_CTA``: the CUDA one-CTA kernel at every
        size, not one warp for small batches nor several CTAs for large ones; the result is the same)

    Returns
    -------
    sorted_ids : int32 ``[P]``, ``P = padded_rows(T*k, E, tile_m)``
        Pair ``p = t*k + j`` at each sorted row, -1 for padding. Expert e's group starts at the
        sum of the padded sizes of experts ``< e``; inside a group pairs keep ascending ``p``.
    tile_expert : int32 ``[P // tile_m]``
        Local expert of each tile, -1 for tiles past the last group.
    pair_to_row : int32 ``[T, k]``
        Sorted row of each pair, -1 if dropped.
    """
    _check_impl(impl)
    kernel_flags = check_kernel_flags(kernel_flags)
    if tile_m not in TILE_MS:
        raise ValueError(f"tile_m must be one of {TILE_MS}, got {tile_m}")
    topk_ids = jnp.asarray(topk_ids).astype(jnp.int32)
    t, k = topk_ids.shape
    p = padded_rows(t * k, num_experts, tile_m)
    if impl == "jax":
        return _moe_align_jax(topk_ids, num_experts, tile_m, expert_offset, p)
    ensure_registered()
    # The fourth output is the CUDA grid align's scratch (its CTAs' counts; partly written, never by the CPU handler),
    # dropped here.
    workspace = ALIGN_GRID_MAX_SLOTS if t * k >= ALIGN_GRID_MIN_PAIRS else 0
    out = (jax.ShapeDtypeStruct((p,), jnp.int32), jax.ShapeDtypeStruct((p // tile_m,), jnp.int32),
           jax.ShapeDtypeStruct((t, k), jnp.int32), jax.ShapeDtypeStruct((workspace,), jnp.int32))
    return jax.ffi.ffi_call(TARGET_ALIGN, out, vmap_method="sequential")(
        topk_ids, num_experts=np.int64(num_experts), expert_offset=np.int64(expert_offset),
        tile_m=np.int64(tile_m), kernel_flags=np.int64(kernel_flags))[:3]


def _moe_align_jax(topk_ids, num_experts, tile_m, expert_offset, p):
    t, k = topk_ids.shape
    n = t * k
    ids = topk_ids.reshape(n)
    e = ids - jnp.int32(expert_offset)
    valid = (ids >= 0) & (e >= 0) & (e < num_experts)
    e = jnp.where(valid, e, num_experts)  # dropped pairs sort last
    counts = jnp.zeros((num_experts + 1,), jnp.int32).at[e].add(1)
    padded = (counts[:num_experts] + tile_m - 1) // tile_m * tile_m
    off = jnp.cumsum(padded) - padded
    total = jnp.sum(padded)
    order = jnp.argsort(e, stable=True)
    pos = jnp.zeros((n,), jnp.int32).at[order].set(jnp.arange(n, dtype=jnp.int32))
    start = jnp.cumsum(counts) - counts  # first position of each expert in `order`
    row = jnp.concatenate([off, jnp.zeros((1,), jnp.int32)])[e] + pos - start[e]
    pair_to_row = jnp.where(valid, row, -1)
    sorted_ids = jnp.full((p,), -1, jnp.int32).at[jnp.where(valid, row, p)].set(
        jnp.arange(n, dtype=jnp.int32), mode="drop")
    tile_start = jnp.arange(p // tile_m, dtype=jnp.int32) * tile_m
    owner = jnp.searchsorted(off, tile_start, side="right").astype(jnp.int32) - 1
    tile_expert = jnp.where(tile_start < total, owner, -1)
    return sorted_ids, tile_expert, pair_to_row.reshape(t, k)
