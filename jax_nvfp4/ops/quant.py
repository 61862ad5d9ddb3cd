"""Mode w4a4's activation quantizer: quant_dequant_rows (per token, or static scales looked up per
row by a ScaleLookup) and moe_align_quant (the align and the quantize of x in one launch)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from .. import _exact
from ..formats import dequantize
from ..quantize import quant_dequant_static, quantize
from .constants import TILE_MS, ALIGN_ONE_WARP_PAIRS
from .extension import TARGET_QUANT, TARGET_ALIGN_QUANT, ensure_registered, check_kernel_flags, _check_impl
from .orders import CHUNK_K, to_chunk_order
from .tiling import padded_rows
from .align import moe_align


def _check_scale_offset(what: str, offset: int, n: int) -> None:
    """A lookup's offset into a table of n rows: ids clamp to [offset, offset + n - 1], which must fit int32 (the
    twin's arithmetic; the handlers' CheckScaleOffset)."""
    if not 0 <= offset <= 2 ** 31 - n:
        raise ValueError(f"{what} must be in [0, 2^31 - n] (n = {n} table rows), got {offset}")


@functools.partial(jax.tree_util.register_dataclass, data_fields=["table", "ids"],
                   meta_fields=["group", "offset", "column"])
@dataclasses.dataclass(frozen=True)
class ScaleLookup:
    """Static decode scales looked up per row inside :func:`quant_dequant_rows`' call (no gather of its own):
    out row ``r`` takes ``table[clip(ids[r // group], offset, offset + n - 1) - offset, column]``, e.g. each pair's
    expert's scale (``ids`` the pairs' global expert ids, ``offset`` the first local one) or each row tile's
    (``ids = tile_expert``, ``group = tile_m``). A pytree whose ints are static (it may cross a ``jit``).

    table : float32 ``[n >= 1, c]``, e.g. :attr:`~jax_nvfp4.NVFP4Experts.input_scales` ``[E, 2]``
    ids : int ``[R // group]``
    group : int >= 1; offset : int in ``[0, 2^31 - n]``; column : int in ``[0, c)``
    """
    table: jax.Array
    ids: jax.Array
    group: int = 1
    offset: int = 0
    column: int = 0

    def checked(self, r: int) -> ScaleLookup:
        """This lookup with int32 ids, for ``r`` rows; a ValueError names what is wrong."""
        table, ids = jnp.asarray(self.table), jnp.asarray(self.ids)
        if table.ndim != 2 or table.shape[0] < 1 or table.dtype != jnp.float32:
            raise ValueError(f"ScaleLookup.table must be float32 [n >= 1, c], got {table.dtype}{list(table.shape)}")
        for name in ("group", "offset", "column"):
            if not isinstance(getattr(self, name), (int, np.integer)) or isinstance(getattr(self, name), bool):
                raise ValueError(f"ScaleLookup.{name} must be a Python int, got {getattr(self, name)!r}")
        if not 0 <= self.column < table.shape[1]:
            raise ValueError(f"ScaleLookup.column must be in [0, {table.shape[1]}), got {self.column}")
        _check_scale_offset("ScaleLookup.offset", self.offset, table.shape[0])
        if (self.group < 1 or ids.ndim != 1 or ids.shape[0] * self.group != r
                or not jnp.issubdtype(ids.dtype, jnp.integer)):
            raise ValueError(f"ScaleLookup.ids must be integer [R / group] = [{r} / {self.group}] with group >= 1, got "
                             f"{ids.dtype}{list(ids.shape)}")
        return ScaleLookup(table, ids.astype(jnp.int32), int(self.group), int(self.offset), int(self.column))

    def per_row(self) -> jax.Array:
        """float32 ``[R]``: each row's scale (the pure-JAX lookup)."""
        ids = jnp.clip(jnp.repeat(self.ids, self.group), self.offset, self.offset + self.table.shape[0] - 1)
        return self.table[ids - self.offset, self.column]


def quant_dequant_rows(x, row_ids=None, *, row_weights=None, input_scale=None, repeat: int = 1,
                       chunk_out: bool = False, impl: str = "ffi", kernel_flags: int = 0):
    """Per-token NVFP4 quantization of each row, decoded back without its global scale.

    ``out = e2m1 * block_scale`` of ``quantize(x, per_token=True)``, which has at most 6
    significant bits and so is exact in bfloat16: the rows the W4A16 GEMMs consume in mode
    ``w4a4``, with ``scale`` (the per-row global decode scale, times ``row_weights`` when given)
    applied in their epilogues. Bit-exact with the pure-JAX twin (``impl="jax"``) on both platforms.

    Parameters
    ----------
    x : bfloat16 or float32 ``[X, K]``, K a multiple of 16; ``R = X * repeat`` rows come out
    row_ids : optional int32 ``[R]``
        Rows with a negative id are unused (e.g. the padding rows of the sorted layout): their
        output is zero and their scale 0, whatever ``x`` holds there.
    row_weights : optional float32 ``[n]`` (with ``row_ids``)
        Each used row's scale is multiplied by ``row_weights[row_ids[r]]`` (0 where the id is
        ``>= n``): mode w4a4's GEMM2 row scale, routing weight times decode scale, in the same launch.
    input_scale : optional float32 ``[R]``, or a :class:`ScaleLookup`
        A static decode scale per row (:attr:`~jax_nvfp4.NVFP4Experts.input_scales`) in place of the row's own:
        :func:`~jax_nvfp4.quantize.quant_dequant_static`, the row's scale this one (no abs-max pass). A
        :class:`ScaleLookup` gives each row's from a table, looked up in the same launch.
    repeat : int >= 1
        Output rows per row of x: row ``r`` quantizes x's row ``r // repeat`` (``jnp.repeat(x, repeat, 0)``, not
        materialized), e.g. a token's row once per routed pair, each on its expert's ``input_scale``.
    chunk_out : bool
        Write each output row in the wgmma chunk order (:func:`to_chunk_order`; K a multiple of
        128), which the sm_90a kernels read as it is. The scales are the same.
    impl : ``"ffi"`` or ``"jax"``
    kernel_flags : :class:`KernelFlag` bits (``PDL``, ``QUANT_NARROW_ROWS``; the result is the same)

    Returns
    -------
    (bfloat16 ``[R, K]``, float32 ``[R]``)
    """
    _check_impl(impl)
    kernel_flags = check_kernel_flags(kernel_flags)
    x = jnp.asarray(x)
    if x.ndim != 2 or x.shape[1] % 16:
        raise ValueError(f"x must be [R, K] with K a multiple of 16, got shape {x.shape}")
    if x.dtype not in (jnp.bfloat16, jnp.float32):
        raise TypeError(f"x must be bfloat16 or float32, got {x.dtype}")
    if not isinstance(repeat, (int, np.integer)) or isinstance(repeat, bool) or not 1 <= repeat <= 2 ** 31:
        raise ValueError(f"repeat must be a Python int in [1, 2^31], got {repeat!r}")
    repeat = int(repeat)
    r = x.shape[0] * repeat
    if row_ids is not None:
        row_ids = jnp.asarray(row_ids)
        if row_ids.shape != (r,) or not jnp.issubdtype(row_ids.dtype, jnp.integer):
            raise ValueError(f"row_ids must be integer [R] = [{r}], got {row_ids.dtype}{list(row_ids.shape)}")
        row_ids = row_ids.astype(jnp.int32)
    if row_weights is not None:
        row_weights = jnp.asarray(row_weights)
        if row_ids is None or row_weights.ndim != 1 or not row_weights.size or row_weights.dtype != jnp.float32:
            raise ValueError(f"row_weights must be float32 [n], n >= 1, and come with row_ids; got "
                             f"{row_weights.dtype}{list(row_weights.shape)}"
                             f"{' without row_ids' if row_ids is None else ''}")
    lookup = None
    if isinstance(input_scale, ScaleLookup):
        lookup = input_scale.checked(r)
        input_scale = lookup.per_row() if impl == "jax" else None
    elif input_scale is not None:
        input_scale = jnp.asarray(input_scale)
        if input_scale.shape != (r,) or input_scale.dtype != jnp.float32:
            raise ValueError(f"input_scale must be float32 [R] = [{r}], got "
                             f"{input_scale.dtype}{list(input_scale.shape)}")
    chunk_out = bool(chunk_out)
    if chunk_out and x.shape[1] % CHUNK_K:
        raise ValueError(f"chunk_out needs K = x.shape[1] to be a multiple of {CHUNK_K}, got {x.shape[1]}")
    if impl == "jax":
        x = jnp.repeat(x, repeat, axis=0) if repeat > 1 else x
        if row_ids is not None:
            x = jnp.where(row_ids[:, None] >= 0, x, jnp.zeros((), x.dtype))
        if input_scale is None:
            q = quantize(x, per_token=True)
            out, scale = dequantize(q, jnp.bfloat16, apply_global_scale=False), q.global_scale
        else:
            out, scale = quant_dequant_static(x, input_scale)
            if row_ids is not None:  # unused rows: scale 0, as an all-zero row's per token
                scale = jnp.where(row_ids >= 0, scale, 0.0)
        if row_weights is not None:  # row_weights[id] * scale, as the kernels multiply (0 past the end), its
            # subnormal products kept as they keep them (XLA:CPU's multiply flushes them to zero)
            n = row_weights.shape[0]
            used = (row_ids >= 0) & (row_ids < n)
            scale = jnp.where(used, _exact.mul_rn_differentiable(row_weights[jnp.clip(row_ids, 0, n - 1)], scale), 0.0)
        return (to_chunk_order(out) if chunk_out else out), scale
    ensure_registered()
    ids = jnp.zeros((0,), jnp.int32) if row_ids is None else row_ids
    weights = jnp.zeros((0,), jnp.float32) if row_weights is None else row_weights
    if lookup is None:  # a scale a row ([R]) or none ([0]), no ids
        lookup = ScaleLookup(jnp.zeros((0,), jnp.float32) if input_scale is None else input_scale,
                             jnp.zeros((0,), jnp.int32))
    return jax.ffi.ffi_call(TARGET_QUANT, (jax.ShapeDtypeStruct((r, x.shape[1]), jnp.bfloat16),
                                           jax.ShapeDtypeStruct((r,), jnp.float32)), vmap_method="sequential")(
        x, ids, weights, lookup.table, lookup.ids, chunk_out=chunk_out, repeat=np.int64(repeat),
        scale_group=np.int64(lookup.group), scale_offset=np.int64(lookup.offset), scale_column=np.int64(lookup.column),
        kernel_flags=np.int64(kernel_flags))


def moe_align_quant(topk_ids, x, num_experts: int, *, tile_m: int, expert_offset: int = 0, chunk_out: bool = False,
                    input_scale=None, impl: str = "ffi", kernel_flags: int = 0):
    """:func:`moe_align` and :func:`quant_dequant_rows` of ``x`` in one call, for decode batches of at
    most ``ALIGN_ONE_WARP_PAIRS`` token-expert pairs: on the GPU one launch, whose first CTA aligns
    (one warp) while the others quantize the rows of x (mode w4a4's first two kernels, which do not
    depend on each other). The same bytes as the two calls.

    Parameters
    ----------
    topk_ids : int32 ``[T, k]``, ``T * k <= ALIGN_ONE_WARP_PAIRS``
    x : bfloat16 ``[T, K]``, K a multiple of 16
    num_experts, tile_m, expert_offset : as :func:`moe_align`
    chunk_out : as :func:`quant_dequant_rows`
    input_scale : optional float32 ``[E, c]`` (:attr:`~jax_nvfp4.NVFP4Experts.input_scales`)
        Static scales: x's row once per pair, on its expert's scale in column 0 (``quant_dequant_rows(x,
        input_scale=ScaleLookup(input_scale, topk_ids.reshape(-1), offset=expert_offset), repeat=k)``).
    impl : ``"ffi"`` or ``"jax"``
    kernel_flags : :class:`KernelFlag` bits (``PDL``, ``QUANT_NARROW_ROWS``; the result is the same)

    Returns
    -------
    ``(sorted_ids, tile_expert, pair_to_row)`` of :func:`moe_align`, then ``(xq, x_scale)`` of
    :func:`quant_dequant_rows`: bfloat16 ``[T, K]``, float32 ``[T]`` (static scales: ``[T * k, K]``, ``[T * k]``).
    """
    _check_impl(impl)
    kernel_flags = check_kernel_flags(kernel_flags)
    topk_ids = jnp.asarray(topk_ids).astype(jnp.int32)
    x = jnp.asarray(x)
    t, k = topk_ids.shape
    if t * k > ALIGN_ONE_WARP_PAIRS:
        raise ValueError(f"moe_align_quant: topk_ids holds at most {ALIGN_ONE_WARP_PAIRS} pairs (T * k), got "
                         f"{t} x {k}: call moe_align and quant_dequant_rows")
    if x.dtype != jnp.bfloat16 or x.ndim != 2 or x.shape[0] != t:
        raise ValueError(f"moe_align_quant: x must be bfloat16 [T={t}, K], got {x.dtype}{list(x.shape)}")
    lookup, repeat = None, 1
    if input_scale is not None:
        input_scale = jnp.asarray(input_scale)
        if input_scale.dtype != jnp.float32 or input_scale.ndim != 2 or input_scale.shape[0] != num_experts or \
                not input_scale.shape[1]:
            raise ValueError(f"moe_align_quant: input_scale must be float32 [E, c >= 1] = [{num_experts}, c], got "
                             f"{input_scale.dtype}{list(input_scale.shape)}")
        if k < 1:
            raise ValueError("moe_align_quant: static scales (input_scale) need k >= 1 (topk_ids [T, k])")
        _check_scale_offset("moe_align_quant: with static scales, expert_offset", expert_offset, num_experts)
        lookup, repeat = ScaleLookup(input_scale, topk_ids.reshape(t * k), offset=expert_offset).checked(t * k), k
    if impl == "jax":
        return (*moe_align(topk_ids, num_experts, tile_m=tile_m, expert_offset=expert_offset, impl="jax"),
                *quant_dequant_rows(x, input_scale=lookup, repeat=repeat, chunk_out=chunk_out, impl="jax"))
    if tile_m not in TILE_MS:
        raise ValueError(f"tile_m must be one of {TILE_MS}, got {tile_m}")
    if x.shape[1] % 16 or (chunk_out and x.shape[1] % CHUNK_K):
        raise ValueError(f"moe_align_quant: K = x.shape[1] must be a multiple of 16 ({CHUNK_K} with chunk_out), got "
                         f"{x.shape[1]}")
    ensure_registered()
    p = padded_rows(t * k, num_experts, tile_m)
    out = (jax.ShapeDtypeStruct((p,), jnp.int32), jax.ShapeDtypeStruct((p // tile_m,), jnp.int32),
           jax.ShapeDtypeStruct((t, k), jnp.int32), jax.ShapeDtypeStruct((t * repeat, x.shape[1]), jnp.bfloat16),
           jax.ShapeDtypeStruct((t * repeat,), jnp.float32))
    s_in = jnp.zeros((0,), jnp.float32) if lookup is None else lookup.table
    return jax.ffi.ffi_call(TARGET_ALIGN_QUANT, out, vmap_method="sequential")(
        topk_ids, x, s_in, num_experts=np.int64(num_experts), expert_offset=np.int64(expert_offset),
        tile_m=np.int64(tile_m), chunk_out=bool(chunk_out), kernel_flags=np.int64(kernel_flags))
