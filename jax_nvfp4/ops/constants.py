"""Enums and limits shared with the C++ handlers (``ffi/moe_common.h``; checked against the
compiled extension by :func:`~jax_nvfp4.ops.extension.check_constants`)."""

from __future__ import annotations

import enum



class Activation(enum.IntEnum):
    """GEMM epilogue activation; values shared with ``ffi/moe_common.h``."""

    IDENTITY = 0
    SWIGLU = 1
    GEGLU = 2
    RELU2 = 3
    SWIGLU_OAI = 4


GATED_ACTIVATIONS = (Activation.SWIGLU, Activation.GEGLU, Activation.SWIGLU_OAI)  # gate and up rows per feature


class RowScale(enum.IntEnum):
    """Where a GEMM reads its per-row fp32 scale for sorted row ``r`` holding pair ``p``."""

    NONE = 0  # no row scale
    TOKEN = 1  # row_scale[p // k]: w4a4 GEMM1, the token's activation decode scale
    PAIR = 2  # row_scale[p]: w4a16 GEMM2, the routing weight (topk_weights.ravel())
    ROW = 3  # row_scale[r]: w4a4 GEMM2, routing weight * intermediate decode scale


class KernelFlag(enum.IntFlag):
    """CUDA grouped-GEMM variants (bits; values shared with ``ffi/moe_common.h``). Every variant
    computes the same function; the flags let one benchmark run compare them. 0: the default
    (for the GEMM loops, the winners of the H200 A/B of 2026-12-01; each flag names the other
    choice, so that A/B can be run again)."""

    NO_WGMMA = 2  # 64- and 32-row tiles: the mma.sync kernel instead of the sm_90a wgmma kernels
    WGMMA_TWO_BLOCKS = 4  # wgmma, non-gated: two 64-feature blocks per warpgroup instead of one
    JAX_QUANT = 8  # w4a4: per-token quantization in pure JAX, not by the quant_dequant_rows kernel
    ROW_TILES_FIRST = 16  # wgmma: consecutive CTAs take one feature slab's row tiles, not one row tile's slabs
    # 32: ALIGN_ONE_WARP (moe_align with <= ALIGN_ONE_WARP_PAIRS pairs in one warp) opt-in until 2026-12-02, then
    # the default
    PDL = 64  # every kernel launched with programmatic dependent launch (its start overlaps the previous kernel)
    NATURAL_INTERMEDIATE = 128  # moe: the intermediate in the natural order (default: paired on the mma.sync 8-32-row
    # tiles, the chunk order on the wgmma kernels' 32- and 64-row ones where I % 128 == 0 and the GPU is sm_90)
    # 256: PAIRED_INPUT (GEMM1's input paired by a transpose of x) until 2026-12-01, removed: no gain on the H200
    PLAIN_WEIGHT_LOADS = 512  # decode tiles: never the streaming hints (the default where K per warp >= 768)
    NO_WARP_SPECIALIZED = 32768  # 64-row tiles with blocked weights (sm_90): GEMM1 on the staged wgmma kernel
    # (x in the natural order; 32-row tiles: on the mma.sync kernel), not the warp-specialized one (a producer
    # warpgroup stages weights and gathered rows for three MMA warpgroups, four on 32-row tiles; H200: 14-17% faster
    # w4a16 prefill layers, 1.33-1.45x faster w4a4 ones)
    WS_GEMM2 = 65536  # GEMM2 too (chunk-ordered a, not gathered) on the warp-specialized kernel, not the TMA-fed one
    # (64-row tiles: four MMA warpgroups of one 64-feature block and stores staged as the TMA-fed kernel's, H200
    # 2026-12-04: prefill layers x0.94-0.95; with WS_TWO_BLOCKS three of two blocks, unstaged, as before: 1.02-1.22x
    # slower, sessions 17-19; moe sets it on 64-row tiles, and on 32-row ones where I >= WS_GEMM2_MIN_K)
    NO_PERSISTENT = 131072  # the warp-specialized kernel with a CTA per work item, not on a persistent grid (a CTA
    # per SM walks the work items, its ring running on across them: prefill layers up to 1.8% faster, at most 0.6%
    # slower on the H200)
    TMA_PERSISTENT = 262144  # the TMA-fed wgmma kernel (moe's GEMM2) on a persistent grid (as many CTAs as
    # fit at once walk the work items; the next item's copies and first weight loads overlap the last one's epilogue),
    # not a CTA per item (prefill layers x0.996-1.033 on the H200, 2026-12-02: the items split unevenly; x1.029-1.065
    # with the staged epilogue, session 21; x0.993-1.012 with its chunk counter uniform again, session 22)
    ALIGN_ONE_CTA = 524288  # moe_align in one 512-thread CTA at any size, not in one warp up to
    # ALIGN_ONE_WARP_PAIRS pairs (H200, 2026-12-02: Qwen3 T=1 layers 6% faster) nor on up to 64 CTAs from 2048 pairs
    # on (counts, then offsets and ranks: two kernels; as three, with a one-CTA offsets kernel, Qwen3 T=4096 layers
    # were 4% faster)
    SEPARATE_X_QUANT = 4194304  # w4a4 decode (at most ALIGN_ONE_WARP_PAIRS pairs): x quantized by its own launch after
    # the align's, not by moe_align_quant's CTAs beside the align's (fused: Qwen3 w4a4 T=1 layers x0.919 on the H200)
    WS_THREE_GROUPS = 8388608  # 32-row gated tiles (moe's GEMM1 at WGMMA_MIN_ROWS to WGMMA_64_ROWS - 1 rows an
    # expert) on the warp-specialized kernel with three MMA warpgroups (192 features a work item), not four (256;
    # H200, 2026-12-03: four give DeepSeek-V3 layers x0.90-0.91 at T = 48-64, x0.98 at 96, Qwen3 x0.96-1.00 at
    # T = 128-384, fewer items on 132 SMs: 256 for DeepSeek-V3 T = 64, two a CTA, where three made 352)
    WS_TWO_BLOCKS = 16777216  # 32-row non-gated bf16-out tiles on the warp-specialized kernel (moe's GEMM2 with
    # WS_GEMM2, set from I >= WS_GEMM2_MIN_K): three MMA warpgroups of two 64-feature blocks (384 features a work
    # item, six stages), not four of one (256, eight stages; H200, 2026-12-03: DeepSeek-V3 layers x0.97 at T = 48-64)
    SEPARATE_ALIGN = 33554432  # w4a16 decode (at most ALIGN_ONE_WARP_PAIRS pairs, 8-row tiles): moe_align in its own
    # launch before GEMM1, not in every GEMM1 CTA (moe_align_gemm)
    QUANT_NARROW_ROWS = 134217728  # quant_dequant_rows (and moe_align_quant's x) at any R as before 2026-12-03: rows
    # under 128 blocks on a warp, longer ones on 128 threads; not, up to 2048 rows, a CTA a row of 128 threads, 512
    # over 128 blocks (H200, 2026-12-03: Qwen3 w4a4 layers x0.93-0.99 at T = 1-64 with a CTA a row of 128)
    ACTIVATIONS_IN_LOOP = 2147483648  # gated 8-row decode tiles (GEMM1): a chunk's activations loaded as its pieces
    # are multiplied, not with its weights a chunk ahead where a warp spans >= 512 K (H200, 2026-12-04: layers
    # x0.92-0.99 ahead, x0.96-0.99 at 512-1024 K a warp since the bit-permuted decode; ahead on GEMM2, in shared
    # memory or by L1 prefetches: lost)
    TMA_GEMM2 = 4294967296  # moe's GEMM2 on 64-row tiles on the TMA-fed kernel, as before 2026-12-04 (not WS_GEMM2)
    ROWS96 = 8589934592  # moe's GEMM1 (gated) and GEMM2 on the warp-specialized kernels, on 32- and 64-row tiles
    # (on 32-row tiles, 9-24 rows an expert, GEMM2 moves to the warp-specialized kernel at any I): work items of up
    # to 96 rows of an expert's group (m64n96 wgmmas; a group's last item 32, 64 or 96 rows), not a tile each, so
    # that a decoded weight chunk feeds up to 96 rows; GEMM1's gate and up rows on pairs of warpgroups. moe's
    # default, on 32-row tiles, where its items cost less than 64-row tiles (choose_rows96). Ignored where those
    # kernels do not run
    NO_ROWS96 = 17179869184  # moe without ROWS96 where choose_rows96 would take it (a tile per work item, as
    # before 2026-12-05); a moe policy, no kernel reads it
    # 68719476736: DEEP_DECODE for one A/B on 2026-12-07 (session 62): 8-row decode tiles on blocked weights keeping two
    # 128-K chunks of weights in flight a warp, not one; removed: layers x1.03-1.35 slower on the H100 (GEMM1's
    # registers), x0.98-1.06 with GEMM2's alone (gpt-oss, DeepSeek-V3 EP8, Qwen3-30B-A3B at T = 1-16)
    # 34359738368: SORTED_STATIC_X for one A/B on 2026-12-07 (session 60): w4a4 on static scales past decode with x
    # quantized into GEMM1's sorted rows (each on its tile's expert's scale, unused rows not written; GEMM1 reading
    # them ungathered) instead of a row per pair that GEMM1 gathers; removed: layers 1.00-1.08x slower on the H100
    # (DeepSeek-V3 EP8 and Qwen3-30B-A3B, T = 64-4096; branch sorted-static-x)
    # 536870912 / 1073741824: BULK_PREFETCH / BULK_PREFETCH_FAR (decode tiles on blocked weights asking the L2 for
    # their next 4 / 8 chunks by bulk prefetches) for one A/B on 2026-12-04, removed: layers up to 1.28x slower
    # on the H200 (branch bulk-prefetch)
    # 268435456: SEPARATE_FINALIZE for one A/B on 2026-12-03 (session 31), when moe_gemm_finalize (w4a16 decode on
    # moe_align_gemm) summed each feature slab in GEMM2's last CTA of the slab, counted by an atomic per CTA: removed,
    # layers 1.00-1.10x slower on the H200 than with the finalize's own launch (branch gemm2-finalize)
    # 1048576 / 2097152: PREFETCH_NEXT / PREFETCH_NEXT_LATE (GEMM1's decode CTAs warming their experts' GEMM2
    # weights into L2) for one A/B on 2026-12-03, removed: up to 13% slower decode layers on the H200
    # 1024 / 2048: L2_PREFETCH / SPLIT_GATE_UP (decode tiles) for one A/B on 2026-12-01, removed: slower on the H200
    # 4096 / 8192: WGMMA_FOUR_GROUPS (four-warpgroup one-block wgmma CTAs) / TMA_GEMM1 (GEMM1 on the TMA-fed
    # wgmma kernel after an XLA gather into the chunk order) for A/Bs on 2026-12-02, removed: slower on the H200
    # 67108864: the w4a4 decode intermediate quantized by GEMM2's CTAs as they load it (RowScale QUANT_ROW) for one
    # A/B on 2026-12-03, removed: layers 1.06-1.50x slower on the H200 than the quantize launch (every CTA of a row
    # tile quantizes whole rows)
    # 16384: WGMMA_TILE_PAIRS (the TMA-fed GEMM2 on pairs of one expert's tiles, m64n128) for one A/B on
    # 2026-12-02, removed: 1.25-1.42x slower layers on the H200 (one CTA per SM)


class Pairing(enum.IntFlag):
    """grouped_gemm's ``pairing`` bits (values shared with ``ffi/moe_common.h``): which operands
    hold a kernel order instead of the natural one."""

    NONE = 0
    A = 1  # a's K axis in the paired order (to_paired; the CUDA kernels skip their activation byte permutes)
    OUT = 2  # out's feature axis in the paired order
    BLOCKED_W = 4  # w's codes and scales in the blocked order (jax_nvfp4.to_blocked_weights)
    CHUNK_A = 8  # a's K axis in the wgmma chunk order (to_chunk_order; on the GPU the sm_90a wgmma kernels)
    CHUNK_OUT = 16  # out's feature axis in the wgmma chunk order


class Mode(enum.IntEnum):
    """MoE modes (spec section 5)."""

    BF16 = 0
    W4A16 = 1
    W4A4 = 2


TILE_MS = (8, 16, 32, 64)
K_SPLITS = (1, 2, 4)  # warps of a GEMM CTA that split K (GPU tiling; the result is the same function)
MAX_SPLIT_TILE_M = 16  # K splitting is for decode-sized tiles
PAIRED_MAX_TILE_M = 32  # moe's intermediate is paired on tiles up to this size (KernelFlag.NATURAL_INTERMEDIATE)
MAX_ALIGN_EXPERTS = 512  # local experts the GPU align kernel handles (one CTA, shared memory)
ALIGN_ONE_WARP_PAIRS = 32  # pairs up to which the CUDA align runs in one warp (unless KernelFlag.ALIGN_ONE_CTA)
ALIGN_GRID_MIN_PAIRS = 2048  # pairs from which it runs on a grid of CTAs, whose counts go through a workspace
ALIGN_GRID_MAX_SLOTS = 8192  # of that many int32 (CTAs x experts)
CUDA_K_MULTIPLE = 64  # the CUDA GEMM's K chunk: H and I must be multiples of it on the GPU
CUDA_N_MULTIPLE = 16  # output features per MMA fragment


ACTIVATIONS = {"swiglu": Activation.SWIGLU, "geglu": Activation.GEGLU, "relu2": Activation.RELU2,
               "swiglu_oai": Activation.SWIGLU_OAI}
MODES = {"w4a16": Mode.W4A16, "w4a4": Mode.W4A4}
