"""grouped_gemm (the grouped W4A16 GEMM with the MoE epilogue), its twin, and moe_align_gemm (the
align inside GEMM1's CTAs for decode batches)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..formats import NVFP4Array, dequantize, from_blocked_weights
from .constants import (Activation, GATED_ACTIVATIONS, RowScale, Pairing, K_SPLITS, MAX_SPLIT_TILE_M,
                        ALIGN_ONE_WARP_PAIRS)
from .extension import TARGET_GEMM, TARGET_ALIGN_GEMM, ensure_registered, check_kernel_flags, _check_impl
from .orders import to_paired, from_paired, CHUNK_K, to_chunk_order, from_chunk_order
from .tiling import choose_k_split, padded_rows
from .align import moe_align


def grouped_gemm(a, w: NVFP4Array, sorted_ids, tile_expert, *, tile_m: int,
                 activation: Activation = Activation.IDENTITY, top_k: int = 1, gather: bool = False,
                 row_scale=None, row_scale_mode: RowScale = RowScale.NONE, out_dtype=jnp.bfloat16,
                 k_split: int | None = None, pairing: Pairing = Pairing.NONE, kernel_flags: int = 0,
                 bias=None, up_alpha=None, impl: str = "ffi"):
    """Grouped W4A16 GEMM over tile-padded row groups, with the MoE epilogue.

    For each sorted row ``r`` of a tile owned by expert ``e`` (pair ``p = sorted_ids[r] >= 0``)::

        acc = a[p // top_k if gather else r] @ deq(w[e])^T          (fp32, w decoded exactly)
        v   = acc * (alpha[e] * row_scale[index(r)]) + bias[e]       (index per row_scale_mode;
                                                                      up_alpha[e] for the up half)
        out[r] = out_dtype(act(v[:n], v[n:]) if gated else act(v))

    Padding rows (``p < 0``) of used tiles are 0; rows of unused tiles (``tile_expert < 0``) are
    left unwritten by the CUDA kernel (0 on the CPU and in the twin).

    Parameters
    ----------
    a : bfloat16 ``[rows, K]``
        Token activations (``gather=True``: ``rows = T``) or the sorted intermediate (``[P, K]``).
    w : NVFP4Array ``[E, N, K]`` with ``global_scale [E]``
        Expert weights; gated activations need rows ``[gate; up]`` (N = 2n).
    sorted_ids, tile_expert : int32 ``[P]``, ``[P // tile_m]`` from :func:`moe_align`.
    tile_m : int
    activation : Activation
    top_k : int
        k, to map a pair to its token.
    gather : bool
    row_scale : float32 ``[n]`` or None
    row_scale_mode : RowScale
    out_dtype : bfloat16 (default) or float32
    k_split : 1, 2, 4 or None
        Warps of a CUDA CTA that split K (a tiling choice: the same function, summed in a
        different fixed order); None: :func:`choose_k_split`. Must be 1 for ``tile_m > 16``.
    pairing : :class:`Pairing` bits
        ``A``: ``a``'s K axis is in the paired order (:func:`to_paired`; on the GPU only for a
        non-gated activation with bfloat16 output); ``OUT``: write ``out``'s features in it;
        ``CHUNK_A`` / ``CHUNK_OUT``: the same in the wgmma chunk order (:func:`to_chunk_order`; K or
        the features a multiple of 128; on the GPU ``CHUNK_A`` needs an sm_90a wgmma kernel,
        ``tile_m`` 64 or 32 and not ``NO_WGMMA``: the TMA-fed one (``gather=False``, bfloat16 out) or, on
        blocked weights without ``NO_WARP_SPECIALIZED``, the warp-specialized one (gathered, or with
        ``WS_GEMM2``; bfloat16 or float32 out));
        ``BLOCKED_W``: ``w`` is in the blocked order (:func:`~jax_nvfp4.to_blocked_weights`; set from
        ``w.order``, and an error for a ``w`` in the ``"rows"`` order).
    kernel_flags : :class:`KernelFlag` bits
        CUDA kernel variant (0: the default); ignored by the CPU handler and the twin.
    bias : optional float ``[E, N]`` (rows as ``w``'s: ``[gate; up]`` when gated)
        Added to each feature after the scales, before the activation (gpt-oss's GEMM1 bias), in float32;
        float32 and bfloat16 biases are read as they are, others converted to float32 first.
    up_alpha : optional float32 ``[E]`` (gated only)
        The up rows' global decode scale where it is not ``w.global_scale``
        (:attr:`~jax_nvfp4.NVFP4Experts.up_global_scale`).
    impl : ``"ffi"`` or ``"jax"``

    Returns
    -------
    ``out_dtype`` ``[P, N // 2 if gated else N]``
    """
    _check_impl(impl)
    sorted_ids = jnp.asarray(sorted_ids, jnp.int32)
    tile_expert = jnp.asarray(tile_expert, jnp.int32)
    a, row_scale, activation, row_scale_mode, out_dtype, k_split, pairing, kernel_flags, n_out = _gemm_args(
        "grouped_gemm", a, w, sorted_ids.shape[0], tile_m, activation, row_scale, row_scale_mode, out_dtype, k_split,
        pairing, kernel_flags)
    bias = _gemm_bias("grouped_gemm", bias, w)
    if impl == "jax":
        w_rows = from_blocked_weights(w) if pairing & Pairing.BLOCKED_W else w
        a = from_paired(a) if pairing & Pairing.A else from_chunk_order(a) if pairing & Pairing.CHUNK_A else a
        out = _grouped_gemm_jax(a, w_rows, sorted_ids, tile_expert, tile_m, activation, top_k, gather, row_scale,
                                row_scale_mode, bias, up_alpha).astype(out_dtype)
        return to_paired(out) if pairing & Pairing.OUT else to_chunk_order(out) if pairing & Pairing.CHUNK_OUT else out
    ensure_registered()
    p = sorted_ids.shape[0]
    alpha = _gemm_alpha("grouped_gemm", w, up_alpha, activation)
    return jax.ffi.ffi_call(TARGET_GEMM, jax.ShapeDtypeStruct((p, n_out), out_dtype),
                            vmap_method="sequential")(
        a, w.data, w.scales, alpha, bias, sorted_ids, tile_expert, row_scale,  # scales as float8_e4m3fn: no copy
        activation=np.int64(activation), row_scale_mode=np.int64(row_scale_mode), top_k=np.int64(top_k),
        gather=np.int64(bool(gather)), tile_m=np.int64(tile_m), k_split=np.int64(k_split),
        pairing=np.int64(pairing), kernel_flags=np.int64(kernel_flags))


def _gemm_alpha(op, w, up_alpha, activation):
    """A GEMM's alpha operand: float32 ``[E]``, or ``[2, E]`` (gate rows', up rows') with ``up_alpha``."""
    e = w.shape[0]
    alpha = jnp.asarray(w.global_scale, jnp.float32).reshape(e)
    if up_alpha is None:
        return alpha
    up_alpha = jnp.asarray(up_alpha)
    if activation not in GATED_ACTIVATIONS or up_alpha.shape != (e,) or up_alpha.dtype != jnp.float32:
        raise ValueError(f"{op}: up_alpha must be float32 [E] = [{e}] with a gated activation, got "
                         f"{up_alpha.dtype} {list(up_alpha.shape)} with {Activation(activation).name}")
    return jnp.stack([alpha, up_alpha])


def _gemm_bias(op, bias, w):
    """A GEMM's bias operand: ``[E, N]`` float32 or bfloat16 (the handlers read either as it is: no conversion
    pass per call for a checkpoint's bf16 biases; other floats are converted to float32), or ``[0]`` for none."""
    if bias is None:
        return jnp.zeros((0,), jnp.float32)
    bias = jnp.asarray(bias)
    if bias.shape != w.shape[:2] or not jnp.issubdtype(bias.dtype, jnp.floating):
        raise ValueError(f"{op}: bias must be a float [E, N] = {list(w.shape[:2])} (w's rows), got {bias.dtype} "
                         f"{list(bias.shape)}")
    return bias if bias.dtype in (jnp.float32, jnp.bfloat16) else bias.astype(jnp.float32)


def _gemm_args(op, a, w, p_rows, tile_m, activation, row_scale, row_scale_mode, out_dtype, k_split, pairing,
               kernel_flags):
    """grouped_gemm's arguments (but its row indices; ``p_rows``: P) checked and normalized, for it and
    moe_align_gemm; also returns the output features."""
    activation = Activation(activation)
    row_scale_mode = RowScale(row_scale_mode)
    if row_scale is None:
        if row_scale_mode != RowScale.NONE:
            raise ValueError(f"{op}: row_scale_mode={row_scale_mode.name} needs a row_scale")
        row_scale = jnp.zeros((1,), jnp.float32)
    a = jnp.asarray(a).astype(jnp.bfloat16)
    row_scale = jnp.asarray(row_scale, jnp.float32).reshape(-1)
    e, n, kk = w.shape
    gated = activation in GATED_ACTIVATIONS
    n_out = n // 2 if gated else n
    out_dtype = jnp.dtype(out_dtype)
    if out_dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        raise ValueError(f"{op}: out_dtype must be bfloat16 or float32, got {out_dtype}")
    if a.ndim != 2 or a.shape[1] != kk:
        raise ValueError(f"{op}: a must be [rows, K={kk}], got {a.shape}")
    if k_split is None:
        k_split = choose_k_split(p_rows // tile_m, n_out, kk, tile_m, gated)
    if k_split not in K_SPLITS or (k_split > 1 and tile_m > MAX_SPLIT_TILE_M):
        raise ValueError(f"{op}: k_split must be one of {K_SPLITS} (1 when tile_m > "
                         f"{MAX_SPLIT_TILE_M}), got k_split={k_split} with tile_m={tile_m}")
    kernel_flags = check_kernel_flags(kernel_flags)
    if int(pairing) < 0 or int(pairing) & ~int(sum(Pairing)):
        raise ValueError(f"{op}: pairing must combine the Pairing bits (0..{int(sum(Pairing))}), "
                         f"got {pairing!r}")
    pairing = Pairing(int(pairing))
    if pairing & (Pairing.A | Pairing.OUT) and (kk % 8 or n_out % 8):
        raise ValueError(f"{op}: pairing needs K and the output features to be multiples of 8, "
                         f"got K={kk}, n_out={n_out}")
    if pairing & Pairing.A and pairing & Pairing.CHUNK_A or pairing & Pairing.OUT and pairing & Pairing.CHUNK_OUT:
        raise ValueError(f"{op}: pairing puts an axis in the paired order and the chunk order, got "
                         f"{pairing!r}")
    if pairing & Pairing.CHUNK_A and kk % CHUNK_K or pairing & Pairing.CHUNK_OUT and n_out % CHUNK_K:
        raise ValueError(f"{op}: the chunk order needs K (CHUNK_A) and the output features "
                         f"(CHUNK_OUT) to be multiples of {CHUNK_K}, got K={kk}, n_out={n_out}")
    if w.order == "blocked":  # the GEMM reads the bytes as they are ordered
        pairing |= Pairing.BLOCKED_W
    if pairing & Pairing.BLOCKED_W and w.order != "blocked":
        raise ValueError(f"{op}: pairing BLOCKED_W needs w in the 'blocked' order, got {w.order!r}")
    return a, row_scale, activation, row_scale_mode, out_dtype, k_split, pairing, kernel_flags, n_out


def apply_activation(activation: Activation, gate, up=None):
    """The epilogue activation in fp32 (``ffi/moe_common.h`` ApplyActivation)."""
    if activation == Activation.SWIGLU:
        return gate * jax.nn.sigmoid(gate) * up
    if activation == Activation.GEGLU:
        c = np.float32(0.7978845608028654)
        return 0.5 * gate * (1.0 + jnp.tanh(c * (gate + np.float32(0.044715) * gate * gate * gate))) * up
    if activation == Activation.RELU2:
        return jnp.square(jnp.maximum(gate, 0.0))
    if activation == Activation.SWIGLU_OAI:
        g = jnp.minimum(gate, 7.0)
        u = jnp.clip(up, -7.0, 7.0)
        return g * jax.nn.sigmoid(np.float32(1.702) * g) * (u + 1.0)
    return gate


def _grouped_gemm_jax(a, w, sorted_ids, tile_expert, tile_m, activation, top_k, gather, row_scale,
                      row_scale_mode, bias, up_alpha=None):
    e, n, kk = w.shape
    p = sorted_ids.shape[0]
    r = jnp.arange(p, dtype=jnp.int32)
    pair = sorted_ids
    src = jnp.where(pair >= 0, pair // top_k if gather else r, -1)
    te = jnp.repeat(tile_expert, tile_m, total_repeat_length=p)
    valid = (src >= 0) & (src < a.shape[0]) & (te >= 0) & (te < e)
    rows = jnp.where(valid[:, None], a[jnp.clip(src, 0, a.shape[0] - 1)], 0).astype(jnp.bfloat16)
    # Rows are grouped by ascending expert (moe_align's contract); unused tiles come last.
    group_sizes = jnp.zeros((e + 1,), jnp.int32).at[jnp.where(te >= 0, te, e)].add(1)[:e]
    wdec = dequantize(w, jnp.bfloat16, apply_global_scale=False)  # exact
    acc = lax.ragged_dot(rows, jnp.swapaxes(wdec, 1, 2), group_sizes, preferred_element_type=jnp.float32,
                         precision=lax.Precision.HIGHEST)
    alphas = _gemm_alpha("grouped_gemm", w, up_alpha, activation).reshape(-1, e)[:, jnp.clip(te, 0, e - 1)]
    if row_scale_mode != RowScale.NONE:
        idx = {RowScale.TOKEN: pair // top_k, RowScale.PAIR: pair, RowScale.ROW: r}[row_scale_mode]
        ok = (idx >= 0) & (idx < row_scale.shape[0])
        alphas = alphas * jnp.where(ok, row_scale[jnp.clip(idx, 0, row_scale.shape[0] - 1)], 0.0)
    # [P, 1] scales, or [P, N] with the up rows' own (alphas [2, P])
    scale = alphas[0][:, None] if alphas.shape[0] == 1 else jnp.where(jnp.arange(n) < n // 2, alphas[0][:, None],
                                                                      alphas[1][:, None])
    v = acc * scale
    if bias.size:
        v = v + bias[jnp.clip(te, 0, e - 1)].astype(jnp.float32)
    if activation in GATED_ACTIVATIONS:
        v = apply_activation(activation, v[:, : n // 2], v[:, n // 2:])
    else:
        v = apply_activation(activation, v)
    return jnp.where(valid[:, None], v, 0.0)


ALIGN_GEMM_TILE_MS = (8,)  # moe_align_gemm's tiles (16-row ones would cost their kernels registers)
# moe aligns inside GEMM1 while GEMM1's grid has at most this many CTAs, about one wave: each CTA waits on its
# own align before its first weight load, so that every wave pays it (H200, 2026-12-03: layers with 384-512
# GEMM1 CTAs 2-6% faster than with the align's launch, with 1024-2048 0.6-2.2% slower).
ALIGN_GEMM_MAX_CTAS = 512


def moe_align_gemm(topk_ids, a, w: NVFP4Array, *, tile_m: int, expert_offset: int = 0,
                   activation: Activation = Activation.IDENTITY, row_scale=None,
                   row_scale_mode: RowScale = RowScale.NONE, out_dtype=jnp.bfloat16, k_split: int | None = None,
                   pairing: Pairing = Pairing.NONE, kernel_flags: int = 0, bias=None, up_alpha=None,
                   impl: str = "ffi"):
    """:func:`moe_align`, then :func:`grouped_gemm` of the pairs' tokens (``gather=True``,
    ``top_k = k``), in one call, for decode batches of at most ``ALIGN_ONE_WARP_PAIRS`` token-expert
    pairs on 8-row tiles: on the GPU one launch, each of whose CTAs aligns the pairs in one warp
    for its own row tile (in place of reading ``tile_expert``) while the first also writes the align's
    outputs (moe's GEMM1 without the align's launch before it). The same bytes as the two calls.

    Parameters
    ----------
    topk_ids : int32 ``[T, k]``, ``T * k <= ALIGN_ONE_WARP_PAIRS``; ids as :func:`moe_align`'s
    a : bfloat16 ``[T, K]``
    w : NVFP4Array ``[E, N, K]`` (E: the local experts)
    tile_m : 8
    expert_offset : as :func:`moe_align`
    activation, row_scale, row_scale_mode, out_dtype, k_split, kernel_flags, bias, up_alpha, impl : as
        :func:`grouped_gemm`
    pairing : :class:`Pairing` bits as :func:`grouped_gemm`'s, but ``CHUNK_A`` (a 32- and 64-row tile order)

    Returns
    -------
    ``out`` of :func:`grouped_gemm`, then ``(sorted_ids, tile_expert, pair_to_row)`` of :func:`moe_align`.
    """
    _check_impl(impl)
    topk_ids = jnp.asarray(topk_ids).astype(jnp.int32)
    t, k = topk_ids.shape
    e = w.shape[0]
    if t * k > ALIGN_ONE_WARP_PAIRS:
        raise ValueError(f"moe_align_gemm: topk_ids holds at most {ALIGN_ONE_WARP_PAIRS} pairs (T * k), got "
                         f"{t} x {k}: call moe_align and grouped_gemm")
    if tile_m not in ALIGN_GEMM_TILE_MS:
        raise ValueError(f"moe_align_gemm: tile_m must be one of {ALIGN_GEMM_TILE_MS}, got {tile_m}")
    if int(pairing) & Pairing.CHUNK_A:
        raise ValueError("moe_align_gemm: pairing CHUNK_A is for 32- and 64-row tiles: call grouped_gemm")
    p = padded_rows(t * k, e, tile_m)
    a, row_scale, activation, row_scale_mode, out_dtype, k_split, pairing, kernel_flags, n_out = _gemm_args(
        "moe_align_gemm", a, w, p, tile_m, activation, row_scale, row_scale_mode, out_dtype, k_split, pairing,
        kernel_flags)
    if a.shape[0] != t:
        raise ValueError(f"moe_align_gemm: a must have a row per token, [T={t}, K], got {list(a.shape)}")
    if impl == "jax":
        sorted_ids, tile_expert, pair_to_row = moe_align(topk_ids, e, tile_m=tile_m, expert_offset=expert_offset,
                                                         impl="jax")
        out = grouped_gemm(a, w, sorted_ids, tile_expert, tile_m=tile_m, activation=activation, top_k=k,
                           gather=True, row_scale=row_scale, row_scale_mode=row_scale_mode, out_dtype=out_dtype,
                           k_split=k_split, pairing=pairing, bias=bias, up_alpha=up_alpha, impl="jax")
        return out, sorted_ids, tile_expert, pair_to_row
    ensure_registered()
    alpha = _gemm_alpha("moe_align_gemm", w, up_alpha, activation)
    out = (jax.ShapeDtypeStruct((p, n_out), out_dtype), jax.ShapeDtypeStruct((p,), jnp.int32),
           jax.ShapeDtypeStruct((p // tile_m,), jnp.int32), jax.ShapeDtypeStruct((t, k), jnp.int32))
    return jax.ffi.ffi_call(TARGET_ALIGN_GEMM, out, vmap_method="sequential")(
        topk_ids, a, w.data, w.scales, alpha, _gemm_bias("moe_align_gemm", bias, w), row_scale,
        expert_offset=np.int64(expert_offset),
        activation=np.int64(activation), row_scale_mode=np.int64(row_scale_mode), tile_m=np.int64(tile_m),
        k_split=np.int64(k_split), pairing=np.int64(pairing), kernel_flags=np.int64(kernel_flags))
