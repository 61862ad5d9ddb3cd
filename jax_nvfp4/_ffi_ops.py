"""XLA FFI custom calls of the NVFP4 MoE, their pure-JAX twins, and the MoE pipeline built on them.

Six ops (C++ in ``ffi/``; one CPU handler and one CUDA handler each, same target name):

- :func:`moe_align`: sort the ``T*k`` token-expert pairs by local expert into groups padded to
  ``tile_m`` rows (``sorted_ids``, ``tile_expert``, ``pair_to_row``), on the device;
- :func:`grouped_gemm`: bf16 rows x NVFP4 expert weights (W4A16, FP4 decoded in registers), with
  an epilogue that applies the per-expert global scale, an optional per-row scale and the
  activation;
- :func:`moe_finalize`: un-permute and sum each token's ``k`` rows in a fixed order;
- :func:`quant_dequant_rows`: per-token NVFP4 quantization decoded back to bf16 without the
  global scale (mode w4a4's activations; bit-exact with :func:`jax_nvfp4.quantize`);
- :func:`moe_align_quant`: the first and the last in one call for decode batches (mode w4a4's
  first two launches in one);
- :func:`moe_align_gemm`: the first and the second in one call for decode batches (mode w4a16's
  first two launches in one).

Benchmarks also use :func:`device_clock` (the time at which the stream reaches a value).

Every op takes ``impl="ffi"`` (the custom call) or ``impl="jax"`` (its pure-JAX twin, the
reference the tests hold the kernels to). :func:`moe` chains them into the expert part of the
MoE layer, with a ``custom_vjp`` (gradients from the pure-JAX path) and a ``custom_vmap`` rule
(a batch of token sets is folded into one larger token set).

Targets are registered lazily, on first use, after ``jax.devices()`` has initialised the
backends (``xla_ffi.md`` section 8).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _exact
from .expert_sharding import over_experts, with_batching, with_expert_grads
from .formats import (BLOCKED_BIT_POS, NVFP4Array, NVFP4Experts, dequantize, from_blocked_weights,
                      require_unstacked)
from .quantize import quant_dequant_static, quantize
from .routing import shard_ids

try:
    from . import _ffi
    _FFI_IMPORT_ERROR = None
except ImportError as e:  # built without the extension (e.g. a pure-Python install)
    _ffi = None
    _FFI_IMPORT_ERROR = f"{type(e).__name__}: {e}"


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

TARGET_ALIGN = "jax_nvfp4_moe_align"
TARGET_GEMM = "jax_nvfp4_grouped_gemm"
TARGET_FINALIZE = "jax_nvfp4_moe_finalize"
TARGET_QUANT = "jax_nvfp4_quant_dequant_rows"
TARGET_ALIGN_QUANT = "jax_nvfp4_moe_align_quant"
TARGET_ALIGN_GEMM = "jax_nvfp4_moe_align_gemm"
TARGET_CLOCK = "jax_nvfp4_device_clock"
IMPLS = ("ffi", "jax")

_lock = threading.Lock()
_registered = False


def extension_error() -> str | None:
    """None if the compiled extension imports, else why not."""
    return _FFI_IMPORT_ERROR


def build_info() -> dict:
    """Facts about the compiled extension (CUDA version and architectures); {} if not built."""
    return dict(_ffi.build_info()) if _ffi is not None else {}


def check_constants() -> None:
    """Raise if the Python enums and limits disagree with the compiled extension."""
    c = _ffi.constants()
    for cls in (Activation, RowScale, Mode, KernelFlag, Pairing):
        want = {name.lower(): int(m) for name, m in cls.__members__.items()}  # (with flags' NONE = 0)
        if dict(c[cls.__name__]) != want:
            raise RuntimeError(f"{cls.__name__} differs between Python {want} and C++ {dict(c[cls.__name__])}")
    if c["all_kernel_flags"] != int(sum(KernelFlag)):  # the handlers' mask of valid bits
        raise RuntimeError(f"the C++ kernel-flag mask {c['all_kernel_flags']} is not the sum of KernelFlag")
    if tuple(c["blocked_bit_pos"]) != BLOCKED_BIT_POS:  # the blocked code words' bit layout
        raise RuntimeError(f"the blocked order's bit positions differ: C++ {tuple(c['blocked_bit_pos'])}, "
                           f"Python {BLOCKED_BIT_POS}")
    if "align_grid_max_slots" not in c:  # an extension built from older sources
        raise RuntimeError("jax_nvfp4._ffi predates the Python package (no align workspace constants): reinstall it")
    got = (tuple(c["tile_ms"]), tuple(c["k_splits"]), c["max_split_tile_m"], c["max_align_experts"],
           c["align_one_warp_pairs"], c["align_grid_min_pairs"], c["align_grid_max_slots"], c["cuda_k_multiple"],
           c["cuda_n_multiple"])
    if got != (TILE_MS, K_SPLITS, MAX_SPLIT_TILE_M, MAX_ALIGN_EXPERTS, ALIGN_ONE_WARP_PAIRS, ALIGN_GRID_MIN_PAIRS,
               ALIGN_GRID_MAX_SLOTS, CUDA_K_MULTIPLE, CUDA_N_MULTIPLE):
        raise RuntimeError(f"tiling constants differ between Python and C++: {got}")


def ensure_registered() -> None:
    """Register the FFI targets for ``cpu`` (and ``CUDA`` in CUDA builds), once per process."""
    global _registered
    if _registered:
        return
    with _lock:
        if _registered:
            return
        if _ffi is None:
            raise RuntimeError(f"jax_nvfp4's FFI extension is not built ({_FFI_IMPORT_ERROR}); "
                               "install with `pip install --no-build-isolation -e .`")
        check_constants()
        jax.devices()  # initialise the backends before registering (deferred registration order)
        for name, platforms in _ffi.registrations().items():
            for platform, capsule in platforms.items():
                jax.ffi.register_ffi_target(name, capsule, platform=platform)
        _registered = True


# ---- static tiling decisions ---------------------------------------------------------------

# Mean rows per expert from which tiles on the sm_90a wgmma kernels (GEMM1 warp-specialized: weights
# staged through a shared-memory ring, so many bytes in flight) beat 16-row mma.sync tiles: 32-row
# tiles (m64n32 wgmmas) from WGMMA_MIN_ROWS, 64-row ones from WGMMA_64_ROWS. (H200, 2026-12-03, before
# the 32-row wgmma tiles, 64-row ones against 16-row ones, blocked weights: DeepSeek-V3 EP8 12 rows
# x1.054, 16 rows x0.828, 24 x0.612, 32 x0.504; Qwen3 16 rows x0.808, 32 x0.512; BENCHMARKS.md session 24.)
# Elsewhere (:func:`wgmma_tiles`) 64-row tiles wait for 32 rows, and 32-row ones are not chosen.
WGMMA_MIN_ROWS = 9
WGMMA_64_ROWS = 25
# ROWS96 against 64-row tiles is a matter of work items: on the H200 an item of up to 96 rows (32-row groups) took
# about ROWS96_ITEM_COST times a 64-row tile's (fitted on the A/Bs of sessions 41-42: DeepSeek-V3 EP8 and
# Qwen3-30B-A3B, 64-2048 rows an expert, 1.29-1.42), so moe takes ROWS96 where an expert's expected items cost
# less (choose_rows96).
ROWS96_ITEM_COST = 1.35
WGMMA_TILE_MS = (32, 64)  # the tiles of the wgmma kernels (32 rows: chunk-ordered activations only)
# On 32-row tiles, GEMM2 (K = I) runs on the warp-specialized kernel too (as WS_GEMM2) from this K on: its
# six-stage weight ring keeps more bytes in flight than the TMA-fed kernel's one chunk of weights in registers
# (H200, 2026-12-03: DeepSeek-V3 EP8, I = 2048, T = 48-96 layers x0.913-0.919; Qwen3-30B-A3B, I = 768,
# T = 192-384 x1.004-1.030: six chunks an item fill the ring too briefly).
WS_GEMM2_MIN_K = 1536


def choose_tile_m(n_pairs: int, num_experts: int, wgmma: bool = False) -> int:
    """Rows per GEMM tile from the rows per expert, ``N ~ Poisson(n_pairs / E)``.

    Prefill (a mean above 32 rows, or from ``WGMMA_64_ROWS`` with ``wgmma``: the GPUs run the tiles on
    the sm_90a warp-specialized GEMM1, :func:`wgmma_tiles`): 64-row tiles; with ``wgmma``, 32-row
    tiles from ``WGMMA_MIN_ROWS`` (the same kernels' m64n32 form). Decode: 8-row tiles while
    they hold the mean plus two standard deviations (about 98% of the experts in one tile), else
    16-row tiles: an expert that needs a second tile has its weights decoded twice, and the kernels
    skip a tile's empty 8-row blocks. On the H200 (2026-12-01, ``BENCHMARKS.md``) 16-row tiles made
    DeepSeek-V3 layers with 8-32 rows per expert 4-14% faster and tied at Qwen3's 8; 32-row tiles
    lost to 16-row ones at 4-32 rows (2026-12-02: 4-30% at 12-32, also when they skip their last
    two empty blocks: two CTAs per SM against three).
    """
    lam = n_pairs / max(num_experts, 1)
    if lam > 32 or (wgmma and lam >= WGMMA_64_ROWS):
        return TILE_MS[-1]
    if wgmma and lam >= WGMMA_MIN_ROWS:
        return 32
    return 8 if lam + 2 * math.sqrt(lam) <= 8 else 16


# A GEMM CTA has 4 warps; with k_split s they cover 16 * 4 / s output features.
_CTA_WARPS, _WARP_FEATURES = 4, 16
_TARGET_CTAS = 1024  # ~8 CTAs per SM on 132 SMs: enough weight bytes in flight to cover HBM latency
_SPLIT_K = 2048  # K a warp keeps when its GEMM has CTAs enough for the SMs (16 chunks of 128)
_FEW_CTAS = 264  # fewer than ~2 CTAs per SM of the H200: split down to _MIN_SPLIT_K
_MIN_SPLIT_K = 256  # each warp keeps at least two 128-K chunks


def feature_slabs(n_out: int, k_split: int) -> int:
    """CTAs a decode GEMM launches per row tile: its 4 warps cover 16 * 4 / k_split output features."""
    return -(-n_out // (_WARP_FEATURES * _CTA_WARPS // k_split))


def _tiles_an_expert(lam: float, tile_m: int) -> float:
    """``E[ceil(N / tile_m)] = sum_j P(N > j * tile_m)`` for an expert's rows ``N ~ Poisson(lam)``, lam > 0."""
    top = lam + 12 * math.sqrt(lam) + 12  # P(N > top) is negligible
    total, cdf = 0.0, 0.0
    for i in range(int(top) + 1):
        cdf += math.exp(i * math.log(lam) - lam - math.lgamma(i + 1))  # P(N <= i)
        if i % tile_m == 0:
            total += max(1.0 - cdf, 0.0)
    return total


def expected_tiles(n_pairs: int, num_experts: int, tile_m: int) -> float:
    """Row tiles that ``n_pairs`` pairs routed uniformly over ``num_experts`` experts fill on
    average: ``E * sum_j P(N > j * tile_m)`` for an expert's rows ``N ~ Poisson(n_pairs / E)``,
    capped by the grid's ``P // tile_m`` tiles (the unused ones exit at once)."""
    e = max(int(num_experts), 1)
    if n_pairs <= 0 or e == 1:
        return float(-(-max(n_pairs, 0) // tile_m))
    return min(e * _tiles_an_expert(n_pairs / e, tile_m), float(padded_rows(n_pairs, e, tile_m) // tile_m))


def choose_k_split(tiles: float, n_out: int, k: int, tile_m: int) -> int:
    """Warps per CTA that split K: the smallest split giving about ``_TARGET_CTAS`` CTAs, while
    each warp keeps ``_SPLIT_K`` of K (``_MIN_SPLIT_K`` while the GEMM has fewer than
    ``_FEW_CTAS`` CTAs).

    ``tiles``: the row tiles in use, e.g. :func:`expected_tiles` (``moe``), or ``P // tile_m``,
    their upper bound (``grouped_gemm`` alone). Fitted on the H200 (2026-12-01, blocked weights,
    every GEMM1 / GEMM2 split pair at T = 1-64, BENCHMARKS.md): a split costs each CTA its partial
    sums' reduction and the whole activation row, which a short K share does not earn back
    (Qwen3-30B-A3B, K = 2048 / 768: 14-15% faster layers at T = 2 and 4 without the splits the
    CTA target asked for), unless the SMs would idle (Qwen3 at T = 1: 93 GEMM1 CTAs unsplit).
    Large tiles (prefill) have CTAs enough and never split.
    """
    if tile_m > MAX_SPLIT_TILE_M:
        return 1
    best = 1
    for s in K_SPLITS[1:]:
        ctas = tiles * feature_slabs(n_out, best)
        if ctas >= _TARGET_CTAS or k // s < (_SPLIT_K if ctas >= _FEW_CTAS else _MIN_SPLIT_K):
            break
        best = s
    return best


def check_k_split(k_split) -> int | tuple[int, int]:
    """``k_split`` of :func:`moe` as given (one of ``K_SPLITS``, or a pair: GEMM1's, GEMM2's)."""
    pair = isinstance(k_split, (tuple, list)) and len(k_split) == 2
    if not all(isinstance(s, (int, np.integer)) and s in K_SPLITS for s in (k_split if pair else (k_split,))):
        raise ValueError(f"k_split must be None, one of {K_SPLITS} or a pair of them (GEMM1, GEMM2), "
                         f"got {k_split!r}")
    return tuple(int(s) for s in k_split) if pair else int(k_split)


def padded_rows(n_pairs: int, num_experts: int, tile_m: int) -> int:
    """Static bound P on the tile-padded sorted rows: every non-empty group wastes < tile_m rows."""
    p = n_pairs + min(num_experts, n_pairs) * (tile_m - 1)
    return -(-p // tile_m) * tile_m


def _check_kernel_flags(flags) -> int:
    flags = int(flags)
    if flags < 0 or flags & ~int(sum(KernelFlag)):
        raise ValueError(f"kernel_flags must combine KernelFlag bits {[f.name for f in KernelFlag]} "
                         f"(mask {int(sum(KernelFlag))}), got {flags}")
    return flags


def _check_impl(impl):
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


# ---- moe_align -----------------------------------------------------------------------------

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
    kernel_flags = _check_kernel_flags(kernel_flags)
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


# ---- grouped_gemm --------------------------------------------------------------------------

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
        Added to each feature after the scales, before the activation (gpt-oss's GEMM1 bias).
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
    """A GEMM's bias operand: float32 ``[E, N]``, or ``[0]`` for none (what the handlers take)."""
    if bias is None:
        return jnp.zeros((0,), jnp.float32)
    bias = jnp.asarray(bias)
    if bias.shape != w.shape[:2] or not jnp.issubdtype(bias.dtype, jnp.floating):
        raise ValueError(f"{op}: bias must be a float [E, N] = {list(w.shape[:2])} (w's rows), got {bias.dtype} "
                         f"{list(bias.shape)}")
    return bias.astype(jnp.float32)


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
        k_split = choose_k_split(p_rows // tile_m, n_out, kk, tile_m)
    if k_split not in K_SPLITS or (k_split > 1 and tile_m > MAX_SPLIT_TILE_M):
        raise ValueError(f"{op}: k_split must be one of {K_SPLITS} (1 when tile_m > "
                         f"{MAX_SPLIT_TILE_M}), got k_split={k_split} with tile_m={tile_m}")
    kernel_flags = _check_kernel_flags(kernel_flags)
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
        v = v + bias[jnp.clip(te, 0, e - 1)]
    if activation in GATED_ACTIVATIONS:
        v = apply_activation(activation, v[:, : n // 2], v[:, n // 2:])
    else:
        v = apply_activation(activation, v)
    return jnp.where(valid[:, None], v, 0.0)


# ---- moe_finalize --------------------------------------------------------------------------

def moe_finalize(y, pair_to_row, *, impl: str = "ffi", kernel_flags: int = 0):
    """``out[t] = bf16(sum_j y[pair_to_row[t, j]])``, j = 0..k-1 in order, fp32 accumulation.

    Parameters
    ----------
    y : bfloat16 ``[P, H]`` (GEMM2 rows, already scaled by the routing weights)
    pair_to_row : int32 ``[T, k]`` (-1: the pair adds nothing)
    impl : ``"ffi"`` or ``"jax"``
    kernel_flags : :class:`KernelFlag` bits (``PDL``; the result is the same)

    Returns
    -------
    bfloat16 ``[T, H]``
    """
    _check_impl(impl)
    kernel_flags = _check_kernel_flags(kernel_flags)
    y = jnp.asarray(y).astype(jnp.bfloat16)
    pair_to_row = jnp.asarray(pair_to_row, jnp.int32)
    t, k = pair_to_row.shape
    if impl == "jax":
        p = y.shape[0]
        acc = jnp.zeros((t, y.shape[1]), jnp.float32)
        for j in range(k):  # fixed order, as the kernels
            r = pair_to_row[:, j]
            ok = (r >= 0) & (r < p)
            acc = jnp.where(ok[:, None], acc + y[jnp.clip(r, 0, max(p - 1, 0))].astype(jnp.float32), acc)
        return acc.astype(jnp.bfloat16)
    ensure_registered()
    return jax.ffi.ffi_call(TARGET_FINALIZE, jax.ShapeDtypeStruct((t, y.shape[1]), jnp.bfloat16),
                            vmap_method="sequential")(y, pair_to_row, kernel_flags=np.int64(kernel_flags))


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
        if not 0 <= self.offset <= 2 ** 31 - table.shape[0]:  # (offset + n - 1 fits int32: the twin's arithmetic)
            raise ValueError(f"ScaleLookup.offset must be in [0, 2^31 - n] (n = {table.shape[0]}), got {self.offset}")
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
    kernel_flags = _check_kernel_flags(kernel_flags)
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
    kernel_flags = _check_kernel_flags(kernel_flags)
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
        if not 0 <= expert_offset <= 2 ** 31 - num_experts:
            raise ValueError(f"moe_align_quant: static scales need expert_offset in [0, 2^31 - E], got {expert_offset}")
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


def device_clock(x):
    """``(x, ns)``: ``x`` unchanged and the time at which the device reached it.

    A benchmark helper: ``ns`` (uint32 ``[2]``, nanoseconds as low and high words; see
    :func:`clock_ns`) is taken by a custom call that runs once everything ``x`` depends on has run
    (the GPU's ``%globaltimer`` after the earlier kernels on the stream; the CPU's steady clock).
    Two clocks around a chain of layers time the chain on the device, without host jitter or
    dispatch overhead. ``x`` passes through aliased, so later work must use the returned ``x``.
    """
    ensure_registered()
    x = jnp.asarray(x)
    return jax.ffi.ffi_call(TARGET_CLOCK, (jax.ShapeDtypeStruct(x.shape, x.dtype),
                                           jax.ShapeDtypeStruct((2,), jnp.uint32)),
                            input_output_aliases={0: 0}, vmap_method="sequential")(x)


def clock_ns(ns) -> int:
    """The nanoseconds of a :func:`device_clock` reading (host side)."""
    lo, hi = (int(v) for v in np.asarray(ns, np.uint32))
    return lo | (hi << 32)


# ---- the MoE expert pipeline ---------------------------------------------------------------

ACTIVATIONS = {"swiglu": Activation.SWIGLU, "geglu": Activation.GEGLU, "relu2": Activation.RELU2,
               "swiglu_oai": Activation.SWIGLU_OAI}
MODES = {"w4a16": Mode.W4A16, "w4a4": Mode.W4A4}


@functools.cache
def _cuda_devices():
    try:
        return jax.local_devices(backend="cuda")
    except RuntimeError:  # no CUDA backend
        return None


def _sm90a_gpus(gpus) -> bool:
    return ("sm_90a" in build_info().get("cuda_archs", ())
            and all(getattr(d, "compute_capability", "") == "9.0" for d in gpus))


def chunk_intermediate_supported() -> bool:
    """Whether every local device of this process can run a GEMM2 on a chunk-ordered intermediate:
    the CPU handler always; CUDA devices only on sm_90 with an sm_90a build (the TMA-fed wgmma
    kernel). Decided when moe is traced: an executable exported here and run on another GPU
    generation fails with the handler's error (trace it there, or pass NATURAL_INTERMEDIATE)."""
    gpus = _cuda_devices()
    return gpus is None or _sm90a_gpus(gpus)


def wgmma_tiles(experts: NVFP4Experts, kernel_flags: int = 0) -> bool:
    """Whether moe runs the 32- and 64-row tiles of ``experts`` on the sm_90a wgmma kernels here, GEMM1
    on the warp-specialized one and GEMM2 on a chunk-ordered intermediate: CUDA devices, all sm_90, an
    sm_90a build, blocked gate/up weights, H and I multiples of 128, and none of ``NO_WGMMA``,
    ``NO_WARP_SPECIALIZED``, ``NATURAL_INTERMEDIATE``. :func:`choose_tile_m` then takes 32-row tiles
    from ``WGMMA_MIN_ROWS`` rows per expert on and 64-row ones from ``WGMMA_64_ROWS`` (the measured
    case; elsewhere 64-row tiles from 33, and no 32-row ones: GEMM2 would run them on mma.sync)."""
    gpus = _cuda_devices()
    return (bool(gpus) and _sm90a_gpus(gpus) and _ws_gemm1_layout(experts, kernel_flags)
            and _chunk_intermediate_layout(experts, kernel_flags))


def rows96_item_ratio(rows_per_expert: float) -> float:
    """ROWS96's work items over the 64-row tiles' for an expert of ``N ~ Poisson(rows_per_expert)`` rows, in
    expectation: ``ceil(ceil(N / 32) / 3) = ceil(N / 96)`` items of up to 96 rows over its 32-row groups against
    ``ceil(N / 64)`` tiles (1 where neither has any). It swings with the padding: 0.68 at 64 rows (one item,
    where half the experts take two tiles), 0.81 at 128, 0.67 at 256, towards 2/3."""
    if rows_per_expert <= 0:
        return 1.0
    return _tiles_an_expert(rows_per_expert, 96) / _tiles_an_expert(rows_per_expert, 64)


def choose_rows96(n_pairs: int, num_experts: int, experts: NVFP4Experts, kernel_flags: int = 0) -> bool:
    """Whether moe adds ROWS96 to ``kernel_flags`` and takes 32-row tiles: where ROWS96's items, at
    ``ROWS96_ITEM_COST`` 64-row tiles each, cost less than the 64-row tiles (:func:`rows96_item_ratio` of
    ``n_pairs / num_experts`` rows an expert), on :func:`wgmma_tiles`, with gated blocked experts (both GEMMs
    on ROWS96's items), unless ``NO_ROWS96`` or ``ROWS96`` is given. On the H200 (BENCHMARKS.md sessions
    41-42, w4a16, against 64-row tiles): Qwen3-30B-A3B x0.881 at 64 rows an expert, x1.065 at 128 (left off),
    x0.926 at 256; DeepSeek-V3 EP8 x0.959 at 256, x0.95-0.98 from 512 (w4a4 alike)."""
    return (not kernel_flags & (KernelFlag.NO_ROWS96 | KernelFlag.ROWS96) and experts.gated
            and experts.down.order == "blocked" and wgmma_tiles(experts, kernel_flags)
            and ROWS96_ITEM_COST * rows96_item_ratio(n_pairs / max(num_experts, 1)) < 1)


def choose_tiles(n_pairs: int, num_experts: int, experts: NVFP4Experts, kernel_flags: int = 0,
                 tile_m: int | None = None) -> tuple[int, int]:
    """moe's rows per tile and ROWS96 choice for ``n_pairs`` token-expert pairs over ``num_experts``: ``(tile_m,
    kernel_flags)``; where :func:`choose_rows96`, ROWS96 added and 32-row tiles (unless ``tile_m`` is given),
    else :func:`choose_tile_m`'s tiles."""
    if choose_rows96(n_pairs, num_experts, experts, kernel_flags):
        return tile_m or 32, kernel_flags | KernelFlag.ROWS96
    return tile_m or choose_tile_m(n_pairs, num_experts, wgmma_tiles(experts, kernel_flags)), kernel_flags


def _chunk_intermediate_layout(experts: NVFP4Experts, kernel_flags: int) -> bool:
    """Whether moe's intermediate of ``experts`` takes the chunk order on wgmma tiles: I a multiple of 128 and
    no NATURAL_INTERMEDIATE."""
    return experts.intermediate_size % CHUNK_K == 0 and not kernel_flags & KernelFlag.NATURAL_INTERMEDIATE


def _ws_gemm1_layout(experts: NVFP4Experts, kernel_flags: int) -> bool:
    """Whether moe's 32- and 64-row GEMM1 of ``experts`` goes to the warp-specialized kernel where the wgmma
    kernels run: blocked gate/up weights, H a multiple of 128, neither NO_WGMMA nor NO_WARP_SPECIALIZED."""
    return (experts.gate_up.order == "blocked" and experts.gate_up.shape[-1] % CHUNK_K == 0
            and not kernel_flags & (KernelFlag.NO_WGMMA | KernelFlag.NO_WARP_SPECIALIZED))


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
    ks1 = ks1 or choose_k_split(tiles, inter, h, tile_m)
    ks2 = ks2 or choose_k_split(tiles, h, inter, tile_m)
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
    fn = _moe_fn(mode, activation, int(local_expert_offset), impl, tile_m, _check_kernel_flags(kernel_flags),
                 k_split, spread_experts, bool(k_split_decode_only), treedef)
    return fn(jnp.asarray(x).astype(jnp.bfloat16), jnp.asarray(topk_ids).astype(jnp.int32),
              jnp.asarray(topk_weights, jnp.float32), tuple(leaves))
