"""Static tiling decisions: rows per tile, K splits, the wgmma and ROWS96 choices (fitted on the
H200; BENCHMARKS.md), and what the local GPUs can run."""

from __future__ import annotations

import functools
import math

import jax
import numpy as np

from ..formats import NVFP4Experts
from .constants import KernelFlag, TILE_MS, K_SPLITS, MAX_SPLIT_TILE_M
from .extension import build_info
from .orders import CHUNK_K


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
_FEW_CTAS = 264  # fewer than ~2 CTAs per SM of the H200: split down to _MIN_SPLIT_K (gated tiles)
# Non-gated decode tiles (GEMM2, relu2's GEMM1) hold one weight fragment a warp: half the registers (62 against 128:
# 8 CTAs an SM fit, not 4), so they split down to _MIN_SPLIT_K until twice the CTAs. (H100, 2026-12-07, session 62,
# this rule against the one before, one run: gpt-oss-120b / -20b w4a16 T = 1 (GEMM2 split 4, not 2) x0.965 / x0.970,
# T = 2 (2, not 1) x0.918 / x0.906, w4a4 (120b) x0.976 / x0.920; Qwen3-30B-A3B T = 2 (2, not 1) x0.977, w4a4
# x0.987; no other choice of issue 5's shapes moves. BENCHMARKS.md.)
_FEW_CTAS_ONE_FRAGMENT = 2 * _FEW_CTAS
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


def choose_k_split(tiles: float, n_out: int, k: int, tile_m: int, gated: bool = True) -> int:
    """Warps per CTA that split K: the smallest split giving about ``_TARGET_CTAS`` CTAs, while
    each warp keeps ``_SPLIT_K`` of K (``_MIN_SPLIT_K`` while the GEMM has fewer than
    ``_FEW_CTAS`` CTAs, or ``_FEW_CTAS_ONE_FRAGMENT`` when not ``gated``: twice as many fit an SM).

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
    best, few = 1, _FEW_CTAS if gated else _FEW_CTAS_ONE_FRAGMENT
    for s in K_SPLITS[1:]:
        ctas = tiles * feature_slabs(n_out, best)
        if ctas >= _TARGET_CTAS or k // s < (_SPLIT_K if ctas >= few else _MIN_SPLIT_K):
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
