"""The kernel orders of an operand's last axis: the paired order (mma.sync operands) and the wgmma
chunk order, with their inverses."""

from __future__ import annotations

import jax.numpy as jnp


def _transpose_groups_of_8(v, rows: int):
    """Each group of 8 along the last axis read as a ``rows x (8 // rows)`` matrix, transposed."""
    return jnp.swapaxes(v.reshape(v.shape[:-1] + (v.shape[-1] // 8, rows, 8 // rows)), -1, -2).reshape(v.shape)


def to_paired(v):
    """The last axis in the paired order: within each group of 8, ``[x0, x4, x1, x5, x2, x6, x3, x7]``
    (the k pairs of the GPU GEMM's MMA operands, so one 16-byte load holds them as they are)."""
    return _transpose_groups_of_8(v, 2)


def from_paired(v):
    """Inverse of :func:`to_paired`."""
    return _transpose_groups_of_8(v, 4)


CHUNK_K = 128  # the chunk order permutes groups of this many


def to_chunk_order(v):
    """The last axis in the wgmma chunk order (``ffi/moe_common.h`` ChunkPos): within each group of
    128, natural ``k = 32t + 8p + 4c + i`` (``t, p, i < 4``, ``c < 2``) moves to ``32p + 8i + 2t + c``,
    where the sm_90a wgmma kernel's MMA steps read it, so that a 128-K chunk is its B tile as it is."""
    g = v.reshape(v.shape[:-1] + (v.shape[-1] // CHUNK_K, 4, 4, 2, 4))  # [..., groups, t, p, c, i]
    return jnp.moveaxis(g, (-4, -3, -2, -1), (-2, -4, -1, -3)).reshape(v.shape)  # -> [..., p, i, t, c]


def from_chunk_order(v):
    """Inverse of :func:`to_chunk_order`."""
    g = v.reshape(v.shape[:-1] + (v.shape[-1] // CHUNK_K, 4, 4, 4, 2))  # [..., groups, p, i, t, c]
    return jnp.moveaxis(g, (-4, -3, -2, -1), (-3, -1, -4, -2)).reshape(v.shape)  # -> [..., t, p, c, i]
