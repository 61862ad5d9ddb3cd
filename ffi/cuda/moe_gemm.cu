// grouped_gemm on the GPU: bf16 rows x NVFP4 expert weights (W4A16), tensor cores, for the
// tile-padded row groups that moe_align produced. Same function as ffi/moe_gemm.cc.
//
// Structure (chosen so that decode streams weights from all SMs and prefill reuses them):
// - "Swap AB": the weights are the MMA's A operand (16 output features per m16n8k16) and the
//   tokens its B operand (8 tokens per fragment), so a decode tile is 8 rows, not 16 or 64.
// - Grid = (token tiles, feature slabs): a CTA of 4 warps owns one tile of tile_m sorted rows
//   of one expert and 16 * (4 / KS) output features (a gated GEMM1 loads the matching gate
//   rows and up rows, so the activation is fused in the epilogue). The KS warps that share
//   16 features split K between them (KS = 1, 2 or 4; "k_split") and add their partial sums
//   through shared memory in a fixed order. At decode (one 8-row tile per expert hit) K
//   splitting multiplies the CTAs, so that enough weight bytes are in flight on every SM.
// - Weights go straight from global memory into registers with 16-byte loads (each thread
//   reads 32 consecutive K of a row: 16 bytes of codes + 2 scale bytes), prefetched one
//   128-K chunk ahead (gated 8-row tiles, GEMM1, load that chunk's activations with it: MainLoop's XR);
//   no shared memory, no bf16 weights in memory. With the checkpoint's
//   row-major codes a warp's load touches 8 rows x 64 bytes; weights repacked into the blocked
//   order (Pairing::kBlockedW, BlockedOffset: 16 rows x 128 K contiguous) make it 512
//   contiguous bytes (7-13% faster decode layers on the H200; jax_nvfp4.weight_order makes
//   it the ffi default on CUDA). Warps then split K in 128-K units, so the
//   bits equal row-major weights' where K / k_split is a multiple of 128.
// - The MMA's K order is permuted so that the 16-byte load *is* the fragment: a 32-bit word
//   of 8 codes (actual k0..k7 of thread t's span) feeds two MMA steps, whose logical k pairs
//   {2t, 2t+1} and {2t+8, 2t+9} are actual {k0, k4}, {k1, k5} and then {k2, k6}, {k3, k7}.
//   The activations (B) are paired the same way (two byte permutes per pair of registers), so
//   the dot product is unchanged and no repacking of the checkpoint layout is needed.
// - Decode in registers, ~2 integer ops per value on rows (DecodeE2M1x8: one multiply places a code's
//   bits for two values), 1 on blocked weights (DecodeE2M1x8Blocked: their code words' bits are permuted
//   for rotates and masks), times the block's E4M3 scale as bf16x2 (exact: e2m1 * e4m3 has <= 6
//   significant bits; the scale carries a power-of-two bias). The global scale and the row
//   scale are applied to the fp32 accumulators in the epilogue.
// - Every tile edge is guarded: tiles with expert -1 exit, padding rows (sorted_ids -1) read
//   no activations and store zeros, rows are bounds-checked against a's row count.
// - Deterministic: fixed K order per output element, no atomics. The split across warps
//   depends on k_split (chosen from the problem shape), so results are bitwise reproducible
//   for a given configuration but not across k_split values.
#include <type_traits>

#include "cuda/cuda_util.h"
#include "cuda/gemm_common.cuh"
#include "moe_handlers.h"

namespace jax_nvfp4 {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;

__device__ __forceinline__ void Mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The 16 bytes of activations (8 k) at k of each of the thread's rows (zeros where it has none).
// Padding rows once read row 0 of a instead (no predicate; 11-18% fewer loop instructions on
// 16-row tiles), but DeepSeek-V3 decode layers were 3-13% slower with it on the H200 (2026-12-01;
// cause not established: BENCHMARKS.md, session 8).
template <int FMU, int FM>
__device__ __forceinline__ void LoadPiece(const uint16_t* const (&arow)[FM], int64_t k, uint4 (&x)[FM]) {
#pragma unroll
  for (int m = 0; m < FMU; ++m)
    x[m] = arow[m] ? __ldg(reinterpret_cast<const uint4*>(arow[m] + k)) : make_uint4(0, 0, 0, 0);
}

// Piece p of a chunk (one 32-bit word of codes per weight row, the activations x = 8 k) feeds
// two MMA steps per weight fragment and row block. PA: the activations are stored paired
// (Pairing::kA), so the 16 bytes already are the B words. Only the first FMU of the tile's FM
// row blocks are multiplied (the others hold no row: UsedBlocks).
template <int CH, int NF, int FMU, int FM, bool PA, bool BW>
__device__ __forceinline__ void ComputePiece(const WeightRegs<CH, NF>& w, const uint32_t (&scale)[NF][2][2], int p,
                                             const uint4 (&x)[FM], float (&acc)[NF][FM][4]) {
  uint32_t b[FM][4];
#pragma unroll
  for (int m = 0; m < FMU; ++m) {
    if constexpr (PA) {
      b[m][0] = x[m].x, b[m][1] = x[m].y, b[m][2] = x[m].z, b[m][3] = x[m].w;
    } else {
      PairActivations(x[m], b[m]);
    }
  }
  uint32_t wd[NF][2][4];  // decoded words of rows g and g + 8
#pragma unroll
  for (int j = 0; j < NF; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) DecodeScaled<BW>(w.q[j][h][p], scale[j][h][p / 2], wd[j][h]);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
#pragma unroll
    for (int m = 0; m < FMU; ++m) {
#pragma unroll
      for (int j = 0; j < NF; ++j) {
        uint32_t a[4];
        AFragment(wd[j], half, a);
        Mma16816(acc[j][m], a, b[m][2 * half], b[m][2 * half + 1]);
      }
    }
  }
}

// Multiply one chunk: thread t's span is K [kc + t*CH/4, kc + (t+1)*CH/4), CH/32 pieces.
template <int CH, int NF, int FMU, int FM, bool PA, bool BW>
__device__ __forceinline__ void ComputeChunk(const WeightRegs<CH, NF>& w, const uint16_t* const (&arow)[FM],
                                             int64_t kc, int t, float (&acc)[NF][FM][4]) {
  constexpr int kSpan = CH / 4;
  uint32_t scale[NF][2][2];
  w.BlockScales(scale);
#pragma unroll
  for (int p = 0; p < kSpan / 8; ++p) {
    uint4 x[FM];
    LoadPiece<FMU, FM>(arow, kc + kSpan * t + 8 * p, x);
    ComputePiece<CH, NF, FMU, FM, PA, BW>(w, scale, p, x, acc);
  }
}

// The activations of a 128-K chunk for the thread's rows (its 4 pieces), loaded a chunk ahead like the weights
// (MainLoop's XR).
template <int FMU, int FM>
struct ActRegs {
  uint4 x[4][FM];
  __device__ __forceinline__ void Load(const uint16_t* const (&arow)[FM], int64_t kc, int t) {
#pragma unroll
    for (int p = 0; p < 4; ++p) LoadPiece<FMU, FM>(arow, kc + 32 * t + 8 * p, x[p]);
  }
};

// ComputeChunk on activations loaded ahead.
template <int NF, int FMU, int FM, bool PA, bool BW>
__device__ __forceinline__ void ComputeChunkX(const WeightRegs<128, NF>& w, const ActRegs<FMU, FM>& xa,
                                              float (&acc)[NF][FM][4]) {
  uint32_t scale[NF][2][2];
  w.BlockScales(scale);
#pragma unroll
  for (int p = 0; p < 4; ++p) ComputePiece<128, NF, FMU, FM, PA, BW>(w, scale, p, xa.x[p], acc);
}

// The 64-K tail at kc when kc < k1 ((k1 - k0) % 128 == 64), loaded straight into registers.
template <int FMU, int FM, int NF, bool PA>
__device__ __forceinline__ void TailChunk(const uint8_t* const (&wrow)[NF][2], const uint8_t* const (&srow)[NF][2],
                                          const uint16_t* const (&arow)[FM], int64_t kc, int64_t k1, int t,
                                          float (&acc)[NF][FM][4]) {
  if (kc < k1) {
    WeightRegs<64, NF> tail;
    tail.Load(wrow, srow, kc, t);
    ComputeChunk<64, NF, FMU, FM, PA, false>(tail, arow, kc, t, acc);  // (rows: blocked K has no tail)
  }
}

// acc += this warp's rows x a over K [k0, k1) (multiples of 64; of 128 with blocked weights, BW):
// 128-K chunks, the next chunk's weights in flight in registers while one multiplies, then a 64-K
// tail (none with blocked weights). The two buffers rotate
// by unrolling (chunk c lives in buf[c % 2]), so no register copy waits on a load: 121-128
// registers instead of 124-162 with a copy (H200, 2026-12-01: 4% faster on 16-row tiles, where
// it beat the cp.async ring). Two or three chunks in flight (three or four buffers) were 4-14%
// slower in 8 of 12 rows of the same A/B and 3-5% faster in 2 (fewer CTAs fit per SM). Two chunks in flight on
// 8-row tiles only (a flag for one H100 A/B, 2026-12-07, session 62), for gpt-oss's grids of under a wave (368
// CTAs): layers x1.03-1.35 slower with GEMM1's (its registers), x0.98-1.06 with GEMM2's alone; a stream of the same
// weight bytes without the math is no faster with more chunks in flight (benchmarks/stream_probe.cu).
// XR: the next chunk's activations are loaded with its weights, into registers, instead of as each piece is
// multiplied (whose loads, L1 misses that wait on the L2, were a third of the gated decode tiles' stall samples
// on the H200: Nsight Compute, Qwen3-30B-A3B T = 4; Launch chooses it).
template <int FMU, int FM, int NF, bool PA, bool STREAM, bool BW, bool XR = false>
__device__ __forceinline__ void MainLoop(const uint8_t* const (&wrow)[NF][2], const uint8_t* const (&srow)[NF][2],
                                         const uint16_t* const (&arow)[FM], int64_t k0, int64_t k1, int t,
                                         float (&acc)[NF][FM][4]) {
  constexpr int D = 2;
  const int64_t chunks = (k1 - k0) / 128;
  WeightRegs<128, NF> buf[D];
  ActRegs<FMU, FM> xbuf[XR ? D : 1];
  if (chunks > 0) {
    buf[0].template Load<STREAM, BW>(wrow, srow, k0, t);
    if constexpr (XR) xbuf[0].Load(arow, k0, t);
  }
  for (int64_t c0 = 0; c0 < chunks; c0 += D) {
#pragma unroll
    for (int s = 0; s < D; ++s) {
      const int64_t c = c0 + s;
      if (c < chunks) {
        if (c + 1 < chunks) {
          buf[(s + 1) % D].template Load<STREAM, BW>(wrow, srow, k0 + 128 * (c + 1), t);
          if constexpr (XR) xbuf[(s + 1) % D].Load(arow, k0 + 128 * (c + 1), t);
        }
        if constexpr (XR)
          ComputeChunkX<NF, FMU, FM, PA, BW>(buf[s], xbuf[s], acc);
        else
          ComputeChunk<128, NF, FMU, FM, PA, BW>(buf[s], arow, k0 + 128 * c, t, acc);
      }
    }
  }
  if constexpr (!BW) TailChunk<FMU, FM, NF, PA>(wrow, srow, arow, k0 + 128 * chunks, k1, t, acc);
}

// The tile's 8-row blocks up to its last one with a row (warp-uniform). moe_align leaves an
// expert's padding at the end of its last tile, so a 16-row tile whose second block is all
// padding runs as an 8-row one (RunUsedBlocks): 16-row tiles then cost the experts with <= 8 rows
// (or 17-24) little more than 8-row ones, and the busier experts need no second tile.
template <int FM>
__device__ __forceinline__ int UsedBlocks(const uint16_t* const (&arow)[FM]) {
  int used = 0;
#pragma unroll
  for (int m = 0; m < FM; ++m)
    if (__any_sync(0xffffffffu, arow[m] != nullptr)) used = m + 1;
  return used;
}

// Runs loop(Int<FMU>) over the tile's used row blocks: none (no loads, the epilogue stores
// zeros), one of a 16-row tile, or all. (32-row tiles run all four: one instance per count made
// their gated kernel take 255 registers instead of 176.)
template <int N>
using Int = std::integral_constant<int, N>;
template <int FM, typename Loop>
__device__ __forceinline__ void RunUsedBlocks(int used, Loop&& loop) {
  if (used == 0) return;
  if constexpr (FM == 2) {
    if (used == 1) return loop(Int<1>{});
  }
  loop(Int<FM>{});
}

// LOOP: how decode tiles (FM <= 2) stream weights; larger tiles always use MainLoop without
// streaming hints. kStreamLoop: MainLoop whose weight loads skip L1 and prefetch 256 bytes into
// L2; kRegisterLoop: the same with plain loads (Launch picks one from the K per warp).
// Weights through a shared-memory ring lost to registers on the H200 (2026-12-01) in three forms,
// each bitwise equal to registers, and were removed: a per-thread cp.async ring (3-13% slower),
// per-row 1-D bulk copies (1.4-1.8x: a bulk copy takes a warp-uniform address, so 32 lanes'
// copies serialize) and 2-D tensor copies, one box per 16 rows and 256 K with an mbarrier per
// stage (0.7-20% slower; commit 15d2b7c, BENCHMARKS.md session 11).
// kXAhead (a bit over the others): MainLoop's XR, on gated 8-row tiles from kXAheadMinSpan. The activations a
// chunk ahead elsewhere lost on the H200 (2026-12-04, BENCHMARKS.md session 33): in registers on the non-gated
// tiles (moe's GEMM2: 64 -> 87-93 registers, layers x0.98-1.05), copied into shared memory by cp.async
// (x0.95-1.02 on either GEMM), or asked of L1 by prefetches (x1.00-1.10).
enum DecodeLoop : int { kRegisterLoop = 0, kStreamLoop = 2, kXAhead = 4 };
constexpr int64_t kStreamMinSpan = 768;  // K per warp from which decode tiles stream (Launch)
// K per warp from which gated 8-row tiles load activations a chunk ahead (kXAhead; H200, 2026-12-04: layers
// x0.92-0.99 where warps span 2048-7168 K, BENCHMARKS.md session 33; from 2048 until session 36, when spans of
// 512-1024 K turned from x1.00-1.02 to x0.96-0.99: with the bit-permuted decode's 16 registers fewer, ptxas
// no longer issued a chunk's activation loads ahead of its first MMA in the loop without kXAhead, but each
// piece's just before its own; Qwen3-30B-A3B T = 1, 512 K a warp, 17.8 -> 17.1 us)
constexpr int64_t kXAheadMinSpan = 512;

// No minimum of CTAs an SM: five for the gated 8-row tiles (at most 102 registers, 48-64 bytes spilled)
// made decode layers 1.07-1.18x slower on the H200 (2026-12-04, BENCHMARKS.md session 32).
template <int FM, int KS, int LOOP, bool GATED, typename OutT, bool PA, bool BW>
__global__ void __launch_bounds__(kThreads) W4A16GroupedGemmKernel(const GemmParams p) {
  constexpr int BM = FM * 8;
  constexpr int NF = GATED ? 2 : 1;  // weight fragments per warp: [gate, up] or [h]
  constexpr int NS = kWarps / KS;    // warps along N; KS warps share each 16 features
  constexpr int kAcc = NF * FM * 4;  // fp32 accumulators per thread
  constexpr bool kStream = (LOOP & ~kXAhead) == kStreamLoop && FM <= 2;
  constexpr bool kXR = (LOOP & kXAhead) && FM <= 2;
  __shared__ float partial[KS > 1 ? (KS - 1) * NS * kAcc * 32 : 1];
  __shared__ int32_t aligned_rows[FM == 1 ? BM : 1];
  GridDependencyWait();
  const int64_t tile = blockIdx.x;
  // The tile's expert and sorted ids: moe_align's outputs, or (moe_align_gemm) aligned here, where the
  // load of the ids replaces that of tile_expert (the first CTA also writes the align's outputs). The
  // rows' pointer is chosen again where used, from the parameter (one held across the main loop cost
  // registers). 8-row tiles only (the handler's limit): 16-row instances with it took up to 32 more.
  constexpr bool kCanAlign = FM == 1;
  const auto tile_rows = [&]() -> const int32_t* {
    return kCanAlign && p.align.ids ? aligned_rows : p.sorted_ids + tile * BM;
  };
  const int32_t e = kCanAlign && p.align.ids
                        ? AlignTile(p.align, tile, BM, blockIdx.x == 0 && blockIdx.y == 0, aligned_rows)
                        : p.tile_expert[tile];
  if (e < 0 || e >= p.E) return;  // unused tile (uniform over the CTA)
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int ns = warp % NS, kw = warp / NS;
  const int64_t feat0 = (int64_t(blockIdx.y) * NS + ns) * kWarpFeatures;
  const bool active = feat0 < p.n_out;  // the last slab may be partly past n_out
  const int64_t K = p.K;

  float acc[NF][FM][4];
#pragma unroll
  for (int j = 0; j < NF; ++j)
#pragma unroll
    for (int m = 0; m < FM; ++m)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[j][m][i] = 0.0f;

  if (active) {
    const uint8_t* wrow[NF][2];
    const uint8_t* srow[NF][2];
#pragma unroll
    for (int j = 0; j < NF; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t n = feat0 + g + 8 * h + (j == 1 ? p.n_out : 0);
        WeightRow<BW>(p, e, n, wrow[j][h], srow[j][h]);
      }
    const uint16_t* arow[FM];
#pragma unroll
    for (int m = 0; m < FM; ++m) {
      const int64_t src = SourceRow(p, tile_rows()[8 * m + g], tile * BM + 8 * m + g);
      arow[m] = src >= 0 ? p.a + src * K : nullptr;
    }
    // This warp's share of K, in 64-K units (128 with blocked weights; a warp may get none when K
    // is small).
    constexpr int64_t kUnit = BW ? kBlockK : 64;
    const int64_t units = K / kUnit;
    const int64_t k0 = kUnit * (units * kw / KS), k1 = kUnit * (units * (kw + 1) / KS);
    RunUsedBlocks<FM>(UsedBlocks(arow), [&](auto fmu) {
      constexpr int FMU = decltype(fmu)::value;
      MainLoop<FMU, FM, NF, PA, kStream, BW, kXR>(wrow, srow, arow, k0, k1, t, acc);
    });
  }

  if constexpr (KS > 1) {  // warps kw > 0 hand their sums to warp kw = 0, added in kw order
    if (kw > 0 && active) {
      float* dst = partial + ((kw - 1) * NS + ns) * kAcc * 32 + lane;
#pragma unroll
      for (int j = 0; j < NF; ++j)
#pragma unroll
        for (int m = 0; m < FM; ++m)
#pragma unroll
          for (int i = 0; i < 4; ++i) dst[((j * FM + m) * 4 + i) * 32] = acc[j][m][i];
    }
    __syncthreads();
    if (kw > 0) return;
    if (active) {
#pragma unroll
      for (int w = 1; w < KS; ++w) {
        const float* src = partial + ((w - 1) * NS + ns) * kAcc * 32 + lane;
#pragma unroll
        for (int j = 0; j < NF; ++j)
#pragma unroll
          for (int m = 0; m < FM; ++m)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[j][m][i] += src[((j * FM + m) * 4 + i) * 32];
      }
    }
  }
  if (!active) return;

  Epilogue<FM, NF, GATED, OutT>(p, e, tile, tile_rows(), feat0, acc);
}

// Instances, each for row-major and blocked weights: k_split 1, 2, 4 and every DecodeLoop for 8-
// and 16-row tiles (decode; paired activations: the streaming loop only); k_split 1 and the
// register loop for 32 and 64 rows (CheckGemm).
template <int KS, int LOOP, bool GATED, typename OutT, bool PA, bool BW>
void LaunchSplit(const GemmParams& p, int64_t tile_m, int64_t slabs, bool pdl, cudaStream_t stream) {
  const dim3 grid(unsigned(p.P / tile_m), unsigned(slabs));
  switch (tile_m) {
    case 8:
      LaunchKernel(W4A16GroupedGemmKernel<1, KS, LOOP, GATED, OutT, PA, BW>, grid, kThreads, 0, stream, pdl, p);
      break;
    case 16:
      LaunchKernel(W4A16GroupedGemmKernel<2, KS, (LOOP & ~kXAhead), GATED, OutT, PA, BW>, grid, kThreads, 0, stream,
                   pdl, p);
      break;
    case 32:
      LaunchKernel(W4A16GroupedGemmKernel<4, 1, kRegisterLoop, GATED, OutT, PA, BW>, grid, kThreads, 0, stream, pdl, p);
      break;
    default:
      LaunchKernel(W4A16GroupedGemmKernel<8, 1, kRegisterLoop, GATED, OutT, PA, BW>, grid, kThreads, 0, stream, pdl, p);
      break;
  }
}

template <int LOOP, bool GATED, typename OutT, bool PA, bool BW>
void LaunchLoop(const GemmParams& p, int64_t tile_m, int64_t k_split, int64_t slabs, bool pdl,
                cudaStream_t stream) {
  switch (k_split) {
    case 2: LaunchSplit<2, LOOP, GATED, OutT, PA, BW>(p, tile_m, slabs, pdl, stream); break;
    case 4: LaunchSplit<4, LOOP, GATED, OutT, PA, BW>(p, tile_m, slabs, pdl, stream); break;
    default: LaunchSplit<1, LOOP, GATED, OutT, PA, BW>(p, tile_m, slabs, pdl, stream); break;
  }
}

// BW: w in the blocked order (Pairing::kBlockedW), with the same choice of loads as rows.
template <bool GATED, typename OutT, bool PA, bool BW>
void Launch(const GemmParams& p, int64_t tile_m, int64_t k_split, int64_t slabs, int64_t flags,
            cudaStream_t stream) {
  const bool pdl = flags & int64_t(KernelFlag::kPdl);
  // Decode tiles: register prefetch, with streaming cache hints where each warp's share of K is at
  // least kStreamMinSpan (H200 A/B, 2026-12-01: the hints made DeepSeek-V3 decode layers 5-22%
  // faster and Qwen3 T = 16, 64 9-11%, but Qwen3 T = 1 8% slower, whose warps span 384-512 K: the
  // 256-byte prefetch then mostly fetches other warps' bytes). kPlainWeightLoads: plain loads
  // everywhere (but for paired activations). Larger tiles ignore it; both give the same bits. (L2
  // prefetches 8-11 chunks ahead and gate / up rows in separate warps, 70-96 registers, were 2-76%
  // and up to 17% slower on the H200, 2026-12-01: removed; so were lane 0's bulk L2 prefetches of each
  // fragment's next 4-12 chunks, up to 1.28x slower on 2026-12-04; shared-memory rings: DecodeLoop.)
  // Rows with a 64-K tail (K % 128 == 64, gpt-oss's 2880) load plainly too: with the hints their layers
  // read 3.3x their weight bytes from DRAM (Nsight Compute, H100, 2026-12-06) and took 1.12-1.58x as long
  // (T = 16-1024); K = 2816 / 2944 rows, no tail, stayed 1.12-1.27x faster with them.
  const bool tail = !BW && p.K % kBlockK != 0;
  const bool plain =
      !PA && ((flags & int64_t(KernelFlag::kPlainWeightLoads)) || p.K / k_split < kStreamMinSpan || tail);
  constexpr int R = kRegisterLoop, S = kStreamLoop;
  if constexpr (GATED) {  // activations a chunk ahead: 8-row tiles where a warp's K span is >= kXAheadMinSpan
    if (tile_m == 8 && p.K / k_split >= kXAheadMinSpan && !(flags & int64_t(KernelFlag::kActivationsInLoop)))
      return plain ? LaunchLoop<R | kXAhead, GATED, OutT, PA, BW>(p, tile_m, k_split, slabs, pdl, stream)
                   : LaunchLoop<S | kXAhead, GATED, OutT, PA, BW>(p, tile_m, k_split, slabs, pdl, stream);
  }
  if (plain) return LaunchLoop<R, GATED, OutT, PA, BW>(p, tile_m, k_split, slabs, pdl, stream);
  LaunchLoop<S, GATED, OutT, PA, BW>(p, tile_m, k_split, slabs, pdl, stream);
}

template <bool BW>
void LaunchFor(const GemmParams& p, bool gated, bool f32_out, bool a_paired, int64_t tile_m, int64_t k_split,
               int64_t slabs, int64_t f, cudaStream_t stream) {
  if (gated) {
    f32_out ? Launch<true, float, false, BW>(p, tile_m, k_split, slabs, f, stream)
            : Launch<true, uint16_t, false, BW>(p, tile_m, k_split, slabs, f, stream);
  } else if (a_paired) {
    Launch<false, uint16_t, true, BW>(p, tile_m, k_split, slabs, f, stream);
  } else {
    f32_out ? Launch<false, float, false, BW>(p, tile_m, k_split, slabs, f, stream)
            : Launch<false, uint16_t, false, BW>(p, tile_m, k_split, slabs, f, stream);
  }
}

// grouped_gemm's launch after its checks (d); `align` (moe_align_gemm; validated by CheckAlignGemm):
// the mma.sync kernel aligns in every CTA, sorted_ids / tile_expert being the align's outputs.
ffi::Error GroupedGemmCuda(cudaStream_t stream, const GemmDims& d, ffi::Buffer<ffi::BF16> a,
                           ffi::Buffer<ffi::U8> w_data, ffi::AnyBuffer w_scales, ffi::Buffer<ffi::F32> alpha,
                           BiasRef bias, ffi::Buffer<ffi::S32> sorted_ids, ffi::Buffer<ffi::S32> tile_expert,
                           ffi::Buffer<ffi::F32> row_scale, ffi::Result<ffi::AnyBuffer> out, int64_t activation,
                           int64_t row_scale_mode, int64_t top_k, int64_t gather, int64_t tile_m, int64_t k_split,
                           int64_t pairing, int64_t kernel_flags, const AlignArgs* align) {
  const char* op = align ? "moe_align_gemm" : "grouped_gemm";
  const bool f32_out = out->element_type() == ffi::DataType::F32;
  const bool gated = IsGated(activation);
  const bool a_paired = pairing & int64_t(Pairing::kA);
  // Paired activations are moe's GEMM2 input (only that combination has mma.sync instances;
  // gated ones, for a paired GEMM1 input, gave no gain on the H200, 2026-12-01).
  if (a_paired && (gated || f32_out))
    return Invalid(op, "paired activations (pairing & 1) need a non-gated activation and bfloat16 output on the GPU");
  // Chunk-ordered activations are moe's GEMM input on 64- and 32-row tiles (GEMM2's intermediate, and GEMM1's
  // x on blocked weights): only the sm_90a wgmma kernels read them, the warp-specialized one
  // (WarpSpecializedGemm: blocked weights, gathered or with kWsGemm2 not; bf16 or fp32 out) and the
  // TMA-fed one (not gathered, bf16 out).
  const bool a_chunk = pairing & int64_t(Pairing::kChunkA);
  const bool ws = WarpSpecializedGemm(kernel_flags, pairing, gather);
  if (a_chunk && (((f32_out || gather) && !ws) || (tile_m != 64 && tile_m != 32) ||
                  (kernel_flags & int64_t(KernelFlag::kNoWgmma))))
    return Invalid(op, "chunk-ordered activations (pairing & 8) need an sm_90a wgmma kernel on the GPU: tile_m = 64 "
                       "or 32, no NO_WGMMA flag, and bfloat16 output with gather = False, unless on the "
                       "warp-specialized kernel (blocked weights, gathered or WS_GEMM2, no NO_WARP_SPECIALIZED)");
  if (a_chunk && (d.P > 0x7FFFFFFF || d.a_rows > 0xFFFFFFFFll))  // the tensor copies' coordinates
    return Invalid(op, "chunk-ordered activations (pairing & 8) need fewer than 2^31 sorted rows and 2^32 rows of a");
  if (d.tiles == 0 || d.n_out == 0) return ffi::Error::Success();  // (moe_align_gemm: P = 0, nothing to write)
  if (d.a_rows == 0) {  // every row is padding: zeros, without a launch
    const size_t bytes = size_t(d.P) * size_t(d.n_out) * ffi::ByteWidth(out->element_type());
    cudaError_t err = cudaMemsetAsync(out->untyped_data(), 0, bytes, stream);
    if (align && err == cudaSuccess)  // (no token: the align's outputs are all -1, all bytes 0xFF)
      err = cudaMemsetAsync(align->sorted_ids, 0xFF, size_t(d.P) * sizeof(int32_t), stream);
    if (align && err == cudaSuccess)
      err = cudaMemsetAsync(align->tile_expert, 0xFF, size_t(d.tiles) * sizeof(int32_t), stream);
    if (err != cudaSuccess)
      return ffi::Error::Internal(std::string("jax_nvfp4 ") + op + ": filling the outputs failed: " +
                                  cudaGetErrorString(err));
    return ffi::Error::Success();
  }
  const int64_t slabs = CeilDiv<int64_t>(d.n_out, kWarpFeatures * (kWarps / k_split));
  if (d.tiles > 0x7FFFFFFF || slabs > 65535)
    return Invalid(op, "too many row tiles or output features for the grid");
  GemmParams p{};
  p.a = a.typed_data();
  p.w = w_data.typed_data();
  p.ws = static_cast<const uint8_t*>(w_scales.untyped_data());
  p.alpha = alpha.typed_data();
  p.alpha_up = UpAlpha(d, p.alpha);
  p.bias = bias;
  p.sorted_ids = sorted_ids.typed_data();
  p.tile_expert = tile_expert.typed_data();
  p.row_scale = row_scale.typed_data();
  p.out = out->untyped_data();
  p.a_rows = d.a_rows;
  p.K = d.K;
  p.N = d.N;
  p.n_out = d.n_out;
  p.E = d.E;
  p.P = d.P;
  p.row_scale_n = d.row_scale_n;
  p.top_k = int32_t(top_k);
  p.gather = int32_t(gather != 0);
  p.activation = int32_t(activation);
  p.row_scale_mode = int32_t(row_scale_mode);
  p.pairing = int32_t(pairing);
  p.tile_m = int32_t(tile_m);
  if (align) p.align = *align;
  const bool blocked = pairing & int64_t(Pairing::kBlockedW);
  std::string error;
  if (!align && !(kernel_flags & int64_t(KernelFlag::kNoWgmma)) &&  // sm_90a: 64-row tiles, 32-row ones on chunk-ordered a
      LaunchWgmmaGemm(p, tile_m, gated, f32_out, kernel_flags, stream, &error))
    return error.empty() ? LaunchError(op) : ffi::Error::Internal(std::string("jax_nvfp4 ") + op + ": " + error);
  if (a_chunk)
    return Invalid(op, "chunk-ordered activations (pairing & 8) need an sm_90 GPU and a build with sm_90a "
                       "(JAX_NVFP4_CUDA_ARCHS)");
  blocked ? LaunchFor<true>(p, gated, f32_out, a_paired, tile_m, k_split, slabs, kernel_flags, stream)
          : LaunchFor<false>(p, gated, f32_out, a_paired, tile_m, k_split, slabs, kernel_flags, stream);
  return LaunchError(op);
}

ffi::Error GroupedGemmCudaImpl(cudaStream_t stream, ffi::Buffer<ffi::BF16> a, ffi::Buffer<ffi::U8> w_data,
                               ffi::AnyBuffer w_scales, ffi::Buffer<ffi::F32> alpha, ffi::AnyBuffer bias,
                               ffi::Buffer<ffi::S32> sorted_ids, ffi::Buffer<ffi::S32> tile_expert,
                               ffi::Buffer<ffi::F32> row_scale, ffi::Result<ffi::AnyBuffer> out,
                               int64_t activation, int64_t row_scale_mode, int64_t top_k, int64_t gather,
                               int64_t tile_m, int64_t k_split, int64_t pairing, int64_t kernel_flags) {
  GemmDims d;
  if (auto err = CheckGemm("grouped_gemm", a, w_data, w_scales, alpha, sorted_ids, tile_expert, row_scale,
                           *out, activation, row_scale_mode, top_k, gather, tile_m, k_split, pairing,
                           kernel_flags, kCudaKMultiple, kCudaNMultiple, &d);
      err.failure())
    return err;
  if (auto err = CheckBias("grouped_gemm", bias, d); err.failure()) return err;
  return GroupedGemmCuda(stream, d, a, w_data, w_scales, alpha, BiasData(bias), sorted_ids, tile_expert, row_scale,
                         out, activation, row_scale_mode, top_k, gather, tile_m, k_split, pairing, kernel_flags,
                         nullptr);
}

// moe_align_gemm: GEMM1's CTAs each align the (at most 32) pairs in one warp for their own tile, and
// the first one writes the align's outputs for GEMM2 and the finalize: one launch fewer at decode.
ffi::Error MoeAlignGemmCudaImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> topk_ids, ffi::Buffer<ffi::BF16> a,
                                ffi::Buffer<ffi::U8> w_data, ffi::AnyBuffer w_scales, ffi::Buffer<ffi::F32> alpha,
                                ffi::AnyBuffer bias, ffi::Buffer<ffi::F32> row_scale,
                                ffi::Result<ffi::AnyBuffer> out,
                                ffi::Result<ffi::Buffer<ffi::S32>> sorted_ids,
                                ffi::Result<ffi::Buffer<ffi::S32>> tile_expert,
                                ffi::Result<ffi::Buffer<ffi::S32>> pair_to_row, int64_t expert_offset,
                                int64_t activation, int64_t row_scale_mode, int64_t tile_m, int64_t k_split,
                                int64_t pairing, int64_t kernel_flags) {
  int64_t n;
  GemmDims d;
  if (auto err = CheckAlignGemm("moe_align_gemm", topk_ids, a, w_data, w_scales, alpha, row_scale, *out,
                                *sorted_ids, *tile_expert, *pair_to_row, activation, row_scale_mode, tile_m, k_split,
                                pairing, kernel_flags, kMaxAlignExperts, kCudaKMultiple, kCudaNMultiple, &n, &d);
      err.failure())
    return err;
  if (auto err = CheckBias("moe_align_gemm", bias, d); err.failure()) return err;
  const AlignArgs al{topk_ids.typed_data(), int32_t(n), int32_t(tile_m), d.E, expert_offset, d.P,
                     sorted_ids->typed_data(), tile_expert->typed_data(), pair_to_row->typed_data()};
  return GroupedGemmCuda(stream, d, a, w_data, w_scales, alpha, BiasData(bias), *sorted_ids, *tile_expert, row_scale,
                         out, activation, row_scale_mode, topk_ids.dimensions()[1], 1, tile_m, k_split, pairing,
                         kernel_flags, &al);
}

}  // namespace
}  // namespace jax_nvfp4

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxNvfp4MoeAlignGemmCuda, jax_nvfp4::MoeAlignGemmCudaImpl,
                              jax_nvfp4::sig::MoeAlignGemm(
                                  xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxNvfp4GroupedGemmCuda, jax_nvfp4::GroupedGemmCudaImpl,
                              jax_nvfp4::sig::GroupedGemm(xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
                              {xla::ffi::Traits::kCmdBufferCompatible});
