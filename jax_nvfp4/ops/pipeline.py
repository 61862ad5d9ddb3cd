"""The MoE expert pipeline on the ops: moe_forward (align, GEMM1, quantize, GEMM2, finalize) and
moe, its jit-able form with vmap and vjp rules."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..expert_sharding import over_experts, with_batching, with_expert_grads
from ..formats import NVFP4Experts, require_unstacked
from ..routing import shard_ids
from .constants import (Activation, RowScale, KernelFlag, Pairing, Mode, MAX_SPLIT_TILE_M, PAIRED_MAX_TILE_M,
                        ALIGN_ONE_WARP_PAIRS, ACTIVATIONS, MODES)
from .extension import check_kernel_flags
from .orders import CHUNK_K, to_chunk_order
from .tiling import (WGMMA_TILE_MS, WS_GEMM2_MIN_K, choose_tile_m, feature_slabs, expected_tiles, choose_k_split,
                     check_k_split, padded_rows, chunk_intermediate_supported, choose_tiles,
                     _chunk_intermediate_layout, _ws_gemm1_layout)
from .align import moe_align
from .gemm import grouped_gemm, ALIGN_GEMM_TILE_MS, ALIGN_GEMM_MAX_CTAS, moe_align_gemm
from .finalize import moe_finalize
from .quant import ScaleLookup, quant_dequant_rows, moe_align_quant


def moe_forward(x, experts: NVFP4Experts, topk_ids, topk_weights, *, mode: str = "w4a16",
                activation: str = "swiglu", local_expert_offset=0, impl: str = "ffi", tile_m: int | None = None,
                kernel_flags: int = 0, k_split: int | tuple[int, int] | None = None,
                spread_experts: int | None = None, k_split_decode_only: bool = False):
    """Expert part of the MoE layer through the ops (no custom_vjp/custom_vmap; see :func:`moe`).

    Parameters
    ----------
    x : bfloat16 ``[T, H]``
    experts : NVFP4Experts (``gate_up [E, 2I, H]`` rows ``[gate; up]``, or ``[E, I, H]`` for relu2),
        in the ``"rows"`` order or the blocked one (:func:`~jax_nvfp4.to_blocked_experts`, which the
        CUDA kernels read fastest)
    topk_ids : int32 ``[T, k]`` global expert ids
    topk_weights : float32 ``[T, k]``
    mode : ``"w4a16"`` or ``"w4a4"``
    activation : ``"swiglu"``, ``"geglu"``, ``"relu2"`` or ``"swiglu_oai"``
    local_expert_offset : int or int32 scalar array
        Global id of local expert 0. A traced value (e.g. from ``lax.axis_index`` in ``shard_map``)
        is subtracted from the ids before the align kernel.
    impl : ``"ffi"`` (custom calls) or ``"jax"`` (their pure-JAX twins)
    tile_m : optional override of :func:`choose_tile_m`
    kernel_flags : :class:`KernelFlag` bits (CUDA kernel variants; 0: the default)
    k_split : optional override of :func:`choose_k_split`: 1, 2 or 4 for both GEMMs, or a pair
        (GEMM1's, GEMM2's); one that the tiles cannot take (a split of tiles of more than ``MAX_SPLIT_TILE_M``
        rows) is an error, unless ``k_split_decode_only``: then it applies to decode tiles only
    spread_experts : the experts the ``T * k`` pairs spread over when the tiles are chosen (the global
        experts under expert parallelism, where a shard's experts take ``1 / n`` of the pairs); default
        ``E`` (:func:`moe`: the experts it is given, before any split over devices)

    Returns
    -------
    bfloat16 ``[T, H]``
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {tuple(MODES)} for the ffi kernels, got {mode!r}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {tuple(ACTIVATIONS)}, got {activation!r}")
    if not isinstance(experts, NVFP4Experts):
        raise TypeError(f"the ffi kernels need NVFP4Experts, got {type(experts).__name__}")
    require_unstacked(experts, "moe_forward")
    if experts.valid_sizes is not None:
        raise ValueError(f"moe_forward: these experts are zero-padded to H, I = {experts.gate_up.shape[-1]}, "
                         f"{experts.down.shape[-1]} (valid_sizes {experts.valid_sizes}); pass "
                         "experts.padded_layer() and experts.pad_input(x), as moe does")
    act = ACTIVATIONS[activation]
    gated = act != Activation.RELU2
    if experts.gated != gated:
        raise ValueError(f"activation {activation!r} needs experts with gated={gated}, got gated={experts.gated}")
    x = jnp.asarray(x)
    t, h = x.shape
    k = topk_ids.shape[1]
    e = experts.num_experts
    if t == 0 or k == 0:
        return jnp.zeros((t, h), jnp.bfloat16)
    topk_ids = jnp.asarray(topk_ids).astype(jnp.int32)
    if isinstance(local_expert_offset, (int, np.integer)):
        offset = int(local_expert_offset)
    else:  # traced: the ids into the shard's space here
        topk_ids, offset = shard_ids(topk_ids, local_expert_offset), 0
    if impl == "ffi":
        tile_m, kernel_flags = choose_tiles(t * k, spread_experts or e, experts, kernel_flags, tile_m)
    elif tile_m is None:
        tile_m = choose_tile_m(t * k, e)
    if k_split_decode_only and tile_m > MAX_SPLIT_TILE_M:
        k_split = None  # (larger tiles never split)
    w4a4 = MODES[mode] == Mode.W4A4
    static = w4a4 and experts.input_scales is not None  # static activation scales: each pair's own rows
    # w4a4 decode: the align and the quantize of x in one launch (moe_align_quant), where the align is
    # the one-warp kernel and x is quantized by the kernel.
    align_quant = (w4a4 and impl == "ffi" and t * k <= ALIGN_ONE_WARP_PAIRS and not kernel_flags & (
        KernelFlag.SEPARATE_X_QUANT | KernelFlag.ALIGN_ONE_CTA | KernelFlag.JAX_QUANT))
    w_flat = jnp.asarray(topk_weights, jnp.float32).reshape(t * k)
    common = dict(tile_m=tile_m, top_k=k, impl=impl, kernel_flags=kernel_flags)
    # K splits from the tiles the routing is expected to use (the pairs are taken as all local).
    tiles = expected_tiles(t * k, e, tile_m)
    inter = experts.intermediate_size
    ks = (None, None) if k_split is None else check_k_split(k_split)
    ks1, ks2 = ks if isinstance(ks, tuple) else (ks, ks)
    ks1 = ks1 or choose_k_split(tiles, inter, h, tile_m, gated)
    ks2 = ks2 or choose_k_split(tiles, h, inter, tile_m, gated=False)
    # w4a16 decode on 8-row tiles with a GEMM1 of about one wave of CTAs: the align inside GEMM1's CTAs
    # (moe_align_gemm; one launch fewer).
    gemm1_ctas = padded_rows(t * k, e, tile_m) // tile_m * feature_slabs(inter, ks1)
    align_gemm = (not w4a4 and impl == "ffi" and t * k <= ALIGN_ONE_WARP_PAIRS and tile_m in ALIGN_GEMM_TILE_MS
                  and gemm1_ctas <= ALIGN_GEMM_MAX_CTAS
                  and not kernel_flags & (KernelFlag.SEPARATE_ALIGN | KernelFlag.ALIGN_ONE_CTA))
    if not align_quant and not align_gemm:
        sorted_ids, tile_expert, pair_to_row = moe_align(topk_ids, e, tile_m=tile_m, expert_offset=offset,
                                                         impl=impl, kernel_flags=kernel_flags)
    # The intermediate in the paired order on the mma.sync tiles: GEMM2 then loads its activation
    # pairs as they are (H200, 2026-12-01: decode layers 1-2% faster; wgmma prefill 0.3-1% slower).
    # On 64- and 32-row tiles, the chunk order where the sm_90a wgmma GEMM2s (TMA-fed, warp-specialized) read it.
    # Natural where GEMM2's K (I) has a 64-K tail: its paired loop must stream its weights, and streamed rows
    # with a tail read about 3x their bytes from DRAM (moe_gemm.cu, Launch; H100, 2026-12-06, gpt-oss-120b
    # I = 2880: layers x0.70-0.72 at T = 16-64, x0.90 at 1024, x0.95 at 1).
    natural = bool(kernel_flags & KernelFlag.NATURAL_INTERMEDIATE) or experts.intermediate_size % CHUNK_K != 0
    paired = tile_m <= PAIRED_MAX_TILE_M and not natural
    wgmma = tile_m in WGMMA_TILE_MS and not kernel_flags & KernelFlag.NO_WGMMA and chunk_intermediate_supported()
    chunk = wgmma and _chunk_intermediate_layout(experts, kernel_flags)
    p1, p2 = ((Pairing.CHUNK_OUT, Pairing.CHUNK_A) if chunk else (Pairing.OUT, Pairing.A) if paired
              else (Pairing.NONE, Pairing.NONE))
    # GEMM1 on the warp-specialized kernel (blocked weights): rows gathered from x in the chunk order
    # (one permutation of x's K axis; H200, 2026-12-02: 14-17% faster w4a16 prefill layers).
    ws = wgmma and _ws_gemm1_layout(experts, kernel_flags)
    a1 = Pairing.CHUNK_A if ws else Pairing.NONE
    # GEMM2 on the warp-specialized kernel too: on 64-row tiles (four MMA warpgroups, staged stores: H200, 2026-12-04,
    # prefill layers x0.94-0.95) and on 32-row ones from WS_GEMM2_MIN_K.
    ws2 = (ws and chunk and experts.down.order == "blocked"
           and (tile_m == 64 and not kernel_flags & KernelFlag.TMA_GEMM2 or tile_m == 32 and inter >= WS_GEMM2_MIN_K
                or kernel_flags & KernelFlag.ROWS96))
    common2 = dict(common, kernel_flags=kernel_flags | (KernelFlag.WS_GEMM2 if ws2 else 0))

    up_alpha = experts.up_global_scale
    if MODES[mode] == Mode.W4A16:
        x1 = x.astype(jnp.bfloat16)
        x1 = to_chunk_order(x1) if ws else x1
        if align_gemm:
            h1, sorted_ids, tile_expert, pair_to_row = moe_align_gemm(
                topk_ids, x1, experts.gate_up, tile_m=tile_m, expert_offset=offset, activation=act, k_split=ks1,
                pairing=p1 | a1, kernel_flags=kernel_flags, bias=experts.gate_up_bias, up_alpha=up_alpha,
                impl=impl)
        else:
            h1 = grouped_gemm(x1, experts.gate_up, sorted_ids, tile_expert, activation=act, gather=True, k_split=ks1,
                              pairing=p1 | a1, bias=experts.gate_up_bias, up_alpha=up_alpha, **common)
        y = grouped_gemm(h1, experts.down, sorted_ids, tile_expert, activation=Activation.IDENTITY,
                         row_scale=w_flat, row_scale_mode=RowScale.PAIR, k_split=ks2, pairing=p2, **common2)
    else:  # w4a4: per-token NVFP4 activations, decoded exactly to bf16, scales in the epilogues
        # The quant_dequant_rows kernel (the default: 3-13% faster layers on the H200, 2026-12-01) or
        # the pure-JAX quantizer (JAX_QUANT): the same bytes. Each writes its rows in the chunk order
        # where the next GEMM reads them so (x for the warp-specialized GEMM1, the intermediate for
        # the TMA-fed GEMM2).
        q_impl = "jax" if kernel_flags & KernelFlag.JAX_QUANT else impl
        gemm1 = dict(common)
        # Static scales: x's row once per pair, on its expert's scale (looked up in the quantize launch); GEMM1
        # gathers pair p's row (top_k 1).
        s_in = experts.input_scales if static else None
        gemm1["top_k"] = 1 if static else k
        if align_quant:
            sorted_ids, tile_expert, pair_to_row, xq, x_scale = moe_align_quant(
                topk_ids, x.astype(jnp.bfloat16), e, tile_m=tile_m, expert_offset=offset, chunk_out=ws,
                input_scale=s_in, kernel_flags=kernel_flags)
        elif static:
            xq, x_scale = quant_dequant_rows(
                x.astype(jnp.bfloat16), input_scale=ScaleLookup(s_in, topk_ids.reshape(t * k), offset=offset),
                repeat=k, chunk_out=ws, impl=q_impl, kernel_flags=kernel_flags)
        else:
            xq, x_scale = quant_dequant_rows(x.astype(jnp.bfloat16), chunk_out=ws, impl=q_impl,
                                             kernel_flags=kernel_flags)
        # fp32 intermediate: it is quantized from its unrounded values (spec section 5). Natural or
        # paired (the paired order keeps every 16-value block whole: the same quantization per value).
        h1 = grouped_gemm(xq, experts.gate_up, sorted_ids, tile_expert, activation=act, gather=True,
                          row_scale=x_scale, row_scale_mode=RowScale.TOKEN, out_dtype=jnp.float32, k_split=ks1,
                          pairing=(p1 & ~Pairing.CHUNK_OUT) | a1, bias=experts.gate_up_bias, up_alpha=up_alpha,
                          **gemm1)
        # Rows of unused tiles are never written by the GPU: row_ids makes them zeros. The scales
        # come out times the rows' routing weights: GEMM2's row scales.
        # Static scales: each row on its tile's expert's (rows of no pair, unused tiles' too, have negative ids).
        row_scale = ScaleLookup(s_in, tile_expert, group=tile_m, column=1) if static else None
        aq, rs = quant_dequant_rows(h1, sorted_ids, row_weights=w_flat, input_scale=row_scale, chunk_out=chunk,
                                    impl=q_impl, kernel_flags=kernel_flags)
        y = grouped_gemm(aq, experts.down, sorted_ids, tile_expert, activation=Activation.IDENTITY,
                         row_scale=rs, row_scale_mode=RowScale.ROW, k_split=ks2, pairing=p2, **common2)
    out = moe_finalize(y, pair_to_row, impl=impl, kernel_flags=kernel_flags)
    if experts.down_bias is None:
        return out
    # GEMM2's bias, sum_j w_j * b2[e_j] over the token's local experts, in fp32 after the finalize (one more bf16
    # rounding than backend xla's): w * (s * acc + b2) = w * s * acc + w * b2. The finalize's bf16 rounding is
    # kept by reduce_precision: under jit XLA would drop the twin's bf16 round trip (excess precision) and its
    # outputs would differ from the kernels' in the last bit.
    local = shard_ids(topk_ids, offset)
    ok = (local >= 0) & (local < e)
    b2 = experts.down_bias.astype(jnp.float32)[jnp.clip(local, 0, e - 1)]  # [T, k, H]
    w = jnp.where(ok, jnp.asarray(topk_weights, jnp.float32), 0.0)
    out = lax.reduce_precision(out.astype(jnp.float32), exponent_bits=8, mantissa_bits=7)
    return (out + jnp.sum(w[..., None] * b2, axis=1)).astype(jnp.bfloat16)


@functools.lru_cache(maxsize=None)
def _moe_fn(mode: str, activation: str, offset: int, impl: str, tile_m, kernel_flags: int, k_split, spread_experts,
            k_split_decode_only: bool, treedef):
    """The jit-able MoE for one static configuration, with its vmap and vjp rules.

    The experts travel as their flat leaves (``treedef`` rebuilds them): cotangents of the
    uint8 leaves are float0, which the NVFP4 containers would refuse.
    """

    def at(x, topk_ids, topk_weights, leaves, offset):
        experts = jax.tree_util.tree_unflatten(treedef, leaves)
        return moe_forward(x, experts, topk_ids, topk_weights, mode=mode, activation=activation,
                           local_expert_offset=offset, impl=impl, tile_m=tile_m, kernel_flags=kernel_flags,
                           k_split=k_split, spread_experts=spread_experts, k_split_decode_only=k_split_decode_only)

    # Under jit with sharded experts or tokens the kernels' work is split, not gathered (XLA splits the twin).
    forward = over_experts(at, offset) if impl == "ffi" else functools.partial(at, offset=offset)

    batched = with_batching(forward)  # (per-batch experts: one MoE per batch element)

    def twin(x, topk_ids, topk_weights, leaves, offset):
        # The backward pass differentiates the pure-JAX twin (as backend "xla": in w4a4 the rounding of x onto
        # the NVFP4 grid makes d out / d x zero), split over devices as the forward is.
        return moe_forward(x, jax.tree_util.tree_unflatten(treedef, leaves), topk_ids, topk_weights, mode=mode,
                           activation=activation, local_expert_offset=offset, impl="jax", tile_m=tile_m)

    return with_expert_grads(batched, twin, offset)


def moe(x, experts: NVFP4Experts, topk_ids, topk_weights, *, mode: str = "w4a16", activation: str = "swiglu",
        local_expert_offset=0, impl: str = "ffi", tile_m: int | None = None, kernel_flags: int = 0,
        k_split: int | tuple[int, int] | None = None, spread_experts: int | None = None,
        k_split_decode_only: bool = False):
    """The expert part of the MoE layer on the FFI kernels (see :func:`moe_forward` for arguments).

    Differentiable w.r.t. ``x``, ``topk_weights`` and the experts' float leaves (a ``custom_vjp``
    whose backward pass is the pure-JAX twin) and batchable: ``jax.vmap`` over
    ``x``/``topk_ids``/``topk_weights`` folds the batch into the token axis (one set of kernel
    launches); a batch of expert sets runs sequentially. A traced ``local_expert_offset`` is
    applied to the ids before the custom rules.
    """
    if not isinstance(experts, NVFP4Experts):
        raise TypeError(f"the ffi kernels need NVFP4Experts (mode 'bf16' runs on backend 'xla'), "
                        f"got {type(experts).__name__}")
    require_unstacked(experts, "moe")
    if experts.valid_sizes is not None:  # zero-padded blocked experts: their padded layer, as jax_nvfp4.moe runs it
        return moe(experts.pad_input(jnp.asarray(x)), experts.padded_layer(), topk_ids, topk_weights, mode=mode,
                   activation=activation, local_expert_offset=local_expert_offset, impl=impl, tile_m=tile_m,
                   kernel_flags=kernel_flags, k_split=k_split, spread_experts=spread_experts,
                   k_split_decode_only=k_split_decode_only)[:, :experts.hidden_size]
    if not isinstance(local_expert_offset, (int, np.integer)):
        topk_ids, local_expert_offset = shard_ids(topk_ids, local_expert_offset), 0
    if k_split is not None:
        k_split = check_k_split(k_split)
    leaves, treedef = jax.tree_util.tree_flatten(experts)
    # Tiles for these experts' share of the pairs, also where expert_sharding runs each device on fewer experts.
    spread_experts = spread_experts or experts.num_experts
    fn = _moe_fn(mode, activation, int(local_expert_offset), impl, tile_m, check_kernel_flags(kernel_flags),
                 k_split, spread_experts, bool(k_split_decode_only), treedef)
    return fn(jnp.asarray(x).astype(jnp.bfloat16), jnp.asarray(topk_ids).astype(jnp.int32),
              jnp.asarray(topk_weights, jnp.float32), tuple(leaves))
