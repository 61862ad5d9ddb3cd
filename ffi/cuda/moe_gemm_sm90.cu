// grouped_gemm for 64-row tiles (prefill) on sm_90a: the same function as moe_gemm.cu, on
// warpgroup MMAs (wgmma) instead of mma.sync; and for 32-row tiles (TOK = 32: m64n32 wgmmas, moe at
// 9-24 rows per expert) on the kernels that read chunk-ordered activations (TMA-fed, warp-specialized).
//
// - A CTA is two warpgroups (8 warps) and owns one 64-row (TMA-fed: or 32-row) tile of one expert; each warpgroup
//   multiplies two 64-row weight blocks: gated, the gate and the up rows of 64 features (128
//   features per CTA); otherwise one block of 64 features (KernelFlag kWgmmaTwoBlocks: two,
//   so that every staged activation chunk feeds as many MMAs; slower on the H200, 2026-12-01;
//   four warpgroups of one block, 2026-12-02: 6-12% slower layers).
// - Weights (A) come from registers, as in the mma.sync kernel: each warp loads its 16 rows
//   with 16-byte loads one 128-K chunk ahead and decodes FP4 -> bf16 in registers (the
//   wgmma A-register fragment of a warp is the m16n8k16 A fragment). K is permuted the same
//   way: thread t's code word pp (actual k0..k7 at kc + span*t + 8pp, span = chunk / 4) gives
//   steps 2pp and 2pp + 1 their logical pairs {2t, 2t+1}, {2t+8, 2t+9} = {k0, k4}, {k1, k5}
//   and {k2, k6}, {k3, k7}. BW: weights in the blocked order (Pairing::kBlockedW: a warp's 16
//   rows of a chunk are 1 KB of contiguous codes; K % 128 == 0, so no tail): 4-6% faster layers
//   than on rows on the H200 (2026-12-01).
// - Activations (B) are staged in shared memory, 64 (or 32) rows x 128 K per chunk, in the wgmma K-major
//   128-byte-swizzle layout *with the same permutation* (the logical k order), two ways:
//   - staged by the MMA warps (W4A16WgmmaStaged): double buffered; each thread loads 16 bytes (8
//     actual k) of one row and stores its four 4-byte k pairs at their logical positions
//     (conflict-free 4-byte stores), so the checkpoint layout needs no repack. One __syncthreads
//     per chunk hands over the buffers. (H200, 2026-12-02: three buffers, so that the wgmmas keep
//     running across that barrier, gained nothing; activations copied by cp.async two chunks
//     ahead into a raw shared-memory ring, so that no register waits on an L2 load, were 4-9%
//     slower.)
//   - copied by the tensor memory accelerator (W4A16WgmmaTma), when `a` is already in the logical
//     order (Pairing::kChunkA, ChunkPos: moe's intermediate, written so by GEMM1's
//     epilogue in w4a16, by quant_dequant_rows in w4a4) and not gathered: one thread issues the two 2-D tensor copies of each chunk
//     into a ring of kStages buffers, two chunks ahead (mbarriers: full when the bytes land,
//     empty when the MMAs that read it are done), so the MMA warps spend almost no instruction
//     and no register on activations.
// - A warpgroup decodes the next piece's A words (two 16-K steps) while the previous
//   piece's wgmmas run (two register sets, wait_group 1).
// - The epilogue (global and row scales, activation, bf16/fp32 store) is the shared one.
// - W4A16WgmmaWs (the default for chunk-ordered `a` gathered with blocked weights: moe's GEMM1 after
//   XLA permutes x into the chunk order; and moe's GEMM2, KernelFlag::kWsGemm2) splits the roles: a producer
//   warpgroup stages weights and rows in shared memory for three MMA warpgroups, four on 32-row gated
//   tiles and on one-block tiles (see there).
// Only built for sm_90a (wgmma does not exist on sm_100); elsewhere LaunchWgmmaGemm returns
// false and the mma.sync kernel runs.
#include <cuda.h>  // CUtensorMap (a type only: the encoder comes from the runtime)
#include <cudaTypedefs.h>

#include <algorithm>
#include <atomic>
#include <string>

#include "cuda/cuda_util.h"
#include "cuda/gemm_common.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define JAX_NVFP4_WGMMA 1
#endif

namespace jax_nvfp4 {
namespace {

// Row tiles: 64 rows (TOK), or 32 on the TMA-fed and the warp-specialized kernels (m64n32 wgmmas:
// at 9-24 rows per expert, moe's choice, a 64-row tile spends most of its MMAs on padding rows).
constexpr int kTokens = 64;                    // tile_m of the staged kernel
constexpr int kWgThreadsPerCta = 8 * 32;       // two warpgroups
template <int TOK>
constexpr int PanelBytes() { return TOK * 128; }  // TOK rows x 64 K bf16: one 128-byte-swizzle panel
template <int TOK>
constexpr int ChunkBytes() { return 2 * PanelBytes<TOK>(); }  // 128 K
constexpr int kPanelBytes = PanelBytes<kTokens>(), kChunkBytes = ChunkBytes<kTokens>();
constexpr int kSmemBytes = 2 * kChunkBytes + 1024;  // double buffer, +1 KB to align to 1024

#ifdef JAX_NVFP4_WGMMA
// Shared-memory matrix descriptor: K-major, 128-byte swizzle, 8-row groups 1024 bytes apart.
__device__ __forceinline__ uint64_t SmemDesc(uint32_t addr) {
  return uint64_t((addr & 0x3FFFF) >> 4) | (uint64_t(16 >> 4) << 16) | (uint64_t(1024 >> 4) << 32) |
         (uint64_t(1) << 62);
}

__device__ __forceinline__ void WgmmaFence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void WgmmaCommit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void WgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keep a register value where it is until here (in flight for an asynchronous wgmma).
__device__ __forceinline__ void Hold(uint32_t& r) { asm volatile("" : "+r"(r)::"memory"); }
__device__ __forceinline__ void Hold(float& r) { asm volatile("" : "+f"(r)::"memory"); }
template <typename T, int N>
__device__ __forceinline__ void Hold(T (&values)[N]) {  // every element of a (nested) array
#pragma unroll
  for (int i = 0; i < N; ++i) Hold(values[i]);
}

// d[64 features x 64 rows] += a (registers) x B (shared memory, descriptor), fp32 accumulate.
__device__ __forceinline__ void Wgmma(float (&d)[8][4], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]),
        "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]),
        "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
        "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]),
        "+f"(d[7][2]), "+f"(d[7][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
// d[64 features x 32 rows] += a x B.
__device__ __forceinline__ void Wgmma(float (&d)[4][4], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
      "{%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]),
        "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}

// d[64 features x 96 rows] += a x B (the 96-row work items of KernelFlag::kRows96).
__device__ __forceinline__ void Wgmma(float (&d)[12][4], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n96k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47}, "
      "{%48, %49, %50, %51}, %52, p, 1, 1, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
        "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
        "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
        "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]),
        "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
        "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]),
        "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]),
        "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]),
        "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]),
        "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}

// This thread's share of the activation chunk: row n = 8 * warp + g of the tile, span t, its
// CH / 32 pieces of 16 bytes.
struct ActivationRegs {
  uint4 v[4];

  __device__ __forceinline__ void Load(const uint16_t* row, int64_t kc, int ch, int t) {
#pragma unroll
    for (int pp = 0; pp < 4; ++pp)
      if (pp < ch / 32)
        v[pp] = row ? __ldg(reinterpret_cast<const uint4*>(row + kc + (ch / 4) * t + 8 * pp)) : make_uint4(0, 0, 0, 0);
  }

  // Piece pp's k pairs i = 0..3 ({x0, x4}, {x1, x5}, {x2, x6}, {x3, x7}: PairActivations) go
  // to logical k L = 32pp + 2t + 8i: panel L / 64, 16-byte chunk (L % 64) / 8 swizzled with the
  // row (^ n % 8), byte 4t inside it.
  __device__ __forceinline__ void Store(uint8_t* buf, int ch, int n, int t, bool paired) const {
#pragma unroll
    for (int pp = 0; pp < 4; ++pp) {
      if (pp < ch / 32) {
        uint32_t w[4] = {v[pp].x, v[pp].y, v[pp].z, v[pp].w};  // a paired piece as it is
        if (!paired) PairActivations(v[pp], w);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int c = 4 * pp + q;  // logical 16-byte chunk index within the 128-K chunk
          uint8_t* dst = buf + (c >> 3) * kPanelBytes + n * 128 + (((c & 7) ^ (n & 7)) << 4) + 4 * t;
          *reinterpret_cast<uint32_t*>(dst) = w[q];
        }
      }
    }
  }
};

// mbarriers in shared memory (W4A16WgmmaTma's ring), by shared address.
__device__ __forceinline__ void MbarInit(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void MbarArrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void MbarExpectBytes(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void MbarWait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\nWAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
// The 2-D tensor copy of the box at (x, y) of `map` into `dst` (the activation map: box {64 K, TOK
// rows} at (k, row), 1024-aligned `dst`, its 128-byte swizzle the wgmma one), completing on `bar`.
__device__ __forceinline__ void TmaLoad2d(uint32_t dst, const CUtensorMap* map, int32_t x, int32_t y, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
      ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(bar)
      : "memory");
}
// Chunk c (128 K) of the TOK rows from row0 of a chunk-ordered `a` into the buffer at `dst`: its two 64-K
// panels, by tensor copies of the activation map (ChunkBytes<TOK>, completing on `bar`).
template <int TOK>
__device__ __forceinline__ void TmaLoadChunk(uint32_t dst, const CUtensorMap* amap, int64_t c, int64_t row0,
                                             uint32_t bar) {
#pragma unroll
  for (int panel = 0; panel < 2; ++panel)
    TmaLoad2d(dst + panel * PanelBytes<TOK>(), amap, int32_t(c * 128 + 64 * panel), int32_t(row0), bar);
}

// One chunk (CH = 128 or the 64 tail) of MMAs from registers w and the staged buffer at
// `buf` (shared address). A piece (one code word per row) is two 16-K steps; its decoded A
// words are double buffered across pieces, so piece pp + 1 decodes while pp multiplies.
// Ends with every wgmma of the chunk complete. (The last two pieces' wgmmas left in flight into the
// next chunk, in the TMA-fed and warp-specialized kernels: layers x0.97-1.08, mostly slower; H200,
// 2026-12-04, BENCHMARKS.md session 34.)
// NN: the rows multiplied (the first NN of the buffer's TOK; a 96-row buffer's items may hold 32 or 64).
template <int CH, int NF, int TOK, bool BW, int NN = TOK>
__device__ __forceinline__ void ChunkMma(const WeightRegs<CH, NF>& w, uint32_t buf, float (&acc)[NF][TOK / 8][4]) {
  constexpr int kPieces = CH / 32;
  uint32_t scale[NF][2][2];
  w.BlockScales(scale);
  // Step s's descriptor is the chunk's plus its byte offset / 16: the address field (14 bits of
  // address / 16) cannot carry, shared memory being under 256 KB (sm_90a SASS, 2026-12-02: 5-9%
  // fewer loop instructions than a descriptor built per step).
  const uint64_t desc0 = SmemDesc(buf);
  uint32_t a[2][NF][2][4];  // [buffer][block][row g, g + 8][decoded word]
#pragma unroll
  for (int pp = 0; pp < kPieces; ++pp) {
    const int b = pp & 1;
    if (pp >= 2) {  // piece pp - 2 (which read a[b]) is complete
      WgmmaWait<1>();
      Hold(a[b]);
    }
#pragma unroll
    for (int j = 0; j < NF; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) DecodeScaled<BW>(w.q[j][h][pp], scale[j][h][pp / 2], a[b][j][h]);
    WgmmaFence();
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int s = 2 * pp + half;  // 16-K step
      const uint64_t desc = desc0 + (((s >> 2) * PanelBytes<TOK>() + (s & 3) * 32) >> 4);
#pragma unroll
      for (int j = 0; j < NF; ++j) {
        uint32_t frag[4];
        AFragment(a[b][j], half, frag);
        Wgmma(reinterpret_cast<float(&)[NN / 8][4]>(acc[j]), frag, desc);
      }
    }
    WgmmaCommit();
  }
  WgmmaWait<0>();
  Hold(a[0]);
  Hold(a[1]);
}
#endif  // JAX_NVFP4_WGMMA

// Output features of a CTA: 64 per warpgroup and feature block; gated GEMM1 pairs a gate and
// an up block of the same 64 features, the others (GEMM2, relu2) take NB blocks of 64.
template <bool GATED, int NB>
constexpr int CtaFeatures() { return GATED ? 128 : 128 * NB; }

// A CTA's row tile and feature slab from its block index (see GemmParams::slabs_first):
// slabs_first (the default), a 1-D grid where consecutive CTAs take the slabs of one row tile (a
// wave shares its activation tiles in L2, and an expert's weights across its row tiles);
// otherwise (kRowTilesFirst, or a grid too large for 1-D) x = row tile, y = feature slab (a wave
// of CTAs shares a slab of several experts' weights).
template <bool GATED, int NB>
__device__ __forceinline__ void TileAndSlab(const GemmParams& p, int64_t& tile, int64_t& slab) {
  tile = blockIdx.x, slab = blockIdx.y;
  if (p.slabs_first) {
    const int64_t slabs = CeilDiv<int64_t>(p.n_out, CtaFeatures<GATED, NB>());
    tile = blockIdx.x / slabs;
    slab = blockIdx.x % slabs;
  }
}

template <bool GATED, int NB>
constexpr int BlocksPerGroup() { return GATED ? 2 : NB; }  // weight blocks per warpgroup: [gate, up] or NB

// This MMA warp's weight rows (warps 0-7 of either kernel), into local arrays of the kernel (as
// members of a struct, the loops of some instances took up to 7% more instructions: sm_90a SASS,
// 2026-12-02). Features of block j: gated, feat[0] (gate rows feat, up rows n_out + feat); else
// feat[j] = base + 64j. Blocks past n_out take part in the warpgroup MMAs (any in-bounds rows), not
// the stores.
template <bool GATED, int NB, bool BW, int NF>
__device__ __forceinline__ void WarpRows(const GemmParams& p, int32_t e, int64_t slab, int warp, int g,
                                         int64_t (&feat)[NF], bool (&active)[NF], const uint8_t* (&wrow)[NF][2],
                                         const uint8_t* (&srow)[NF][2]) {
  const int64_t base = slab * CtaFeatures<GATED, NB>() + (warp >> 2) * (GATED ? 64 : 64 * NB) +
                       (warp & 3) * kWarpFeatures;
#pragma unroll
  for (int j = 0; j < NF; ++j) {
    feat[j] = GATED ? base : base + 64 * j;
    active[j] = feat[j] < p.n_out;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t n = active[j] ? feat[j] + g + 8 * h + (GATED && j == 1 ? p.n_out : 0) : 0;
      WeightRow<BW>(p, e, n, wrow[j][h], srow[j][h]);
    }
  }
}

template <int NF, int FM>
__device__ __forceinline__ void ZeroAcc(float (&acc)[NF][FM][4]) {
#pragma unroll
  for (int j = 0; j < NF; ++j)
#pragma unroll
    for (int m = 0; m < FM; ++m)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[j][m][i] = 0.0f;
}

// (The batched epilogue of 64-row tiles on 32-row ones too: their rows' loads issued together.)
template <bool GATED, int NF, typename OutT, int FM>
__device__ __forceinline__ void StoreTile(const GemmParams& p, int32_t e, int64_t tile, const int64_t (&feat)[NF],
                                          const bool (&active)[NF], float (&acc)[NF][FM][4]) {
  Hold(acc);
  const int32_t* rows = p.sorted_ids + tile * (FM * 8);
  if constexpr (GATED) {
    if (active[0]) Epilogue<FM, NF, true, OutT, true>(p, e, tile, rows, feat[0], acc);
  } else {
#pragma unroll
    for (int j = 0; j < NF; ++j)
      if (active[j])
        Epilogue<FM, 1, false, OutT, true>(p, e, tile, rows, feat[j], reinterpret_cast<const float(&)[1][FM][4]>(acc[j]));
  }
}

// CTAs per SM the register budget must allow: a one-block kernel fits two (<= 128 registers; the
// blocked instance took 138 unbounded, so one CTA per SM and 1.5x slower GEMM2s, H200 2026-12-01).
template <bool GATED, int NB>
constexpr int MinCtas() { return !GATED && NB == 1 ? 2 : 1; }

template <bool GATED, int NB, typename OutT, bool BW>
__global__ void __launch_bounds__(kWgThreadsPerCta, MinCtas<GATED, NB>()) W4A16WgmmaStaged(const GemmParams p) {
#ifdef JAX_NVFP4_WGMMA
  extern __shared__ uint8_t smem_raw[];
  // 1024-aligned (swizzle atoms); computed here, on the shared array itself, the stores to it stay
  // shared-memory stores without generic address arithmetic (through a helper function, the GEMM1
  // loop took 16 more instructions: sm_90a SASS, 2026-12-02).
  const uint32_t raw = SmemU32(smem_raw);
  uint8_t* smem = smem_raw + (((raw + 1023) & ~1023u) - raw);
  const uint32_t smem_addr = SmemU32(smem);

  GridDependencyWait();
  int64_t tile, slab;
  TileAndSlab<GATED, NB>(p, tile, slab);
  const int32_t e = p.tile_expert[tile];
  if (e < 0 || e >= p.E) return;  // unused tile (uniform over the CTA)
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  constexpr int NF = BlocksPerGroup<GATED, NB>();
  int64_t feat[NF];
  bool active[NF];
  const uint8_t* wrow[NF][2];
  const uint8_t* srow[NF][2];
  WarpRows<GATED, NB, BW>(p, e, slab, warp, g, feat, active, wrow, srow);
  const int64_t K = p.K;
  const int n = 8 * warp + g;  // this thread's activation row in the tile
  const int64_t src = SourceRow<true>(p, tile * kTokens + n);
  const uint16_t* xrow = src >= 0 ? p.a + src * K : nullptr;
  const bool paired = p.pairing & int32_t(Pairing::kA);
  float acc[NF][8][4];
  ZeroAcc(acc);

  const int64_t full = K / 128;
  const bool tail = K % 128 != 0;
  const int64_t chunks = full + (tail ? 1 : 0);
  ActivationRegs x;
  x.Load(xrow, 0, full ? 128 : 64, t);
  x.Store(smem, full ? 128 : 64, n, t, paired);
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // generic stores -> wgmma reads
  WeightRegs<128, NF> cur;
  if (full) cur.template Load<false, BW>(wrow, srow, 0, t);
  __syncthreads();

  for (int64_t c = 0; c < full; ++c) {
    const int64_t kc = c * 128;
    const bool more = c + 1 < chunks, wmore = c + 1 < full;
    const int next_ch = wmore ? 128 : 64;
    if (more) x.Load(xrow, kc + 128, next_ch, t);
    WeightRegs<128, NF> next;
    if (wmore) next.template Load<false, BW>(wrow, srow, kc + 128, t);
    ChunkMma<128, NF, kTokens, BW>(cur, smem_addr + uint32_t(c & 1) * kChunkBytes, acc);
    if (more) {  // the other buffer was last read by chunk c - 1, complete before the last barrier
      x.Store(smem + (~c & 1) * kChunkBytes, next_ch, n, t, paired);
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    }
    __syncthreads();
    if (wmore) cur = next;
  }
  if (!BW && tail) {  // (blocked weights have K % 128 == 0)
    WeightRegs<64, NF> w;
    w.Load(wrow, srow, full * 128, t);
    ChunkMma<64, NF, kTokens, false>(w, smem_addr + uint32_t(full & 1) * kChunkBytes, acc);
  }
  StoreTile<GATED, NF, OutT>(p, e, tile, feat, active, acc);
#endif
}

constexpr int kStages = 4;                 // W4A16WgmmaTma's ring of activation chunks
constexpr int kLookahead = kStages - 2;    // chunks copied ahead of the one being multiplied
// W4A16WgmmaTma's shared memory after the ring: the full and empty mbarriers of each stage, the row
// mbarrier (16 bytes, alignment), the tile's rows (sorted_ids, then row_scale factors: TOK each) and
// a warp's staged output (TOK rows x 16 features bf16) per warp; + 1 KB to align the ring.
template <int TOK>
struct TmaSmem {
  static constexpr int kRowBar = kStages * ChunkBytes<TOK>() + 2 * kStages * 8;
  static constexpr int kRowIds = kRowBar + 16, kRowScales = kRowIds + 4 * TOK;
  static constexpr int kStaging = kRowScales + 4 * TOK, kStagingBytes = TOK * kWarpFeatures * 2;
  static constexpr int kBytes = kStaging + 8 * kStagingBytes + 1024;
};

#ifdef JAX_NVFP4_WGMMA
// cp.async of `bytes` (4, 8 or 16) from src, src_bytes of them read and the rest zero (always 16-byte
// and L2 only, as .cg, when bytes is 16).
template <int BYTES>
__device__ __forceinline__ void CpAsync(uint32_t dst, const void* src, uint32_t src_bytes) {
  if constexpr (BYTES == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(dst), "l"(src), "n"(BYTES), "r"(src_bytes)
                 : "memory");
}
__device__ __forceinline__ void CpAsyncArrive(uint32_t bar) {  // one expected arrival, once they land
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

// The TMA-fed kernel's row info of a tile, fetched by one warp while the MMAs run, so that its
// epilogue waits on no global load and reads no parameter but alpha: sorted_ids of the TOK rows from
// row0 (RowIdsCopy, at the item's start) into `rows`, then (RowFactors, before the last chunk) each row's
// validity over them (1 / 0: SourceRow) and its row_scale factor into `factors` (RowScaled's rules: 1
// without a row scale, 0 for rows that are padding, past a_rows or past row_scale_n), completing on
// `bar` (64 arrivals: each lane's, and its copies'). Lane l takes rows RL * l .. RL * l + RL - 1 (RL =
// TOK / 32 rows a lane). Rows from nrows on (a 96-row buffer's item of 32 or 64) are not read and not valid.
template <int TOK>
__device__ __forceinline__ void RowIdsCopy(const GemmParams& p, int64_t row0, uint32_t rows, int nrows = TOK) {
  constexpr int RL = TOK / 32;
  const int lane = threadIdx.x & 31;
  if constexpr (RL == 3) {  // (12 bytes a lane: no such copy)
#pragma unroll
    for (int c = 0; c < RL; ++c) {
      const bool read = RL * lane + c < nrows;
      CpAsync<4>(rows + 4 * (RL * lane + c), read ? p.sorted_ids + row0 + RL * lane + c : p.sorted_ids, read ? 4 : 0);
    }
  } else {
    CpAsync<4 * RL>(rows + 4 * RL * lane, p.sorted_ids + row0 + RL * lane, 4 * RL);
  }
}
template <int TOK>
__device__ __forceinline__ void RowFactors(const GemmParams& p, int64_t row0, uint32_t rows, uint32_t factors,
                                           uint32_t bar, int nrows = TOK) {
  constexpr int RL = TOK / 32;
  static_assert(RL >= 1 && RL <= 3, "32, 64 or 96 rows");
  const int lane = threadIdx.x & 31;
  asm volatile("cp.async.wait_all;\n" ::: "memory");  // this lane's ids
  int32_t pair[RL];
  if constexpr (RL == 2) {
    asm volatile("ld.shared.v2.s32 {%0, %1}, [%2];\n" : "=r"(pair[0]), "=r"(pair[1]) : "r"(rows + 8 * lane));
  } else {
#pragma unroll
    for (int c = 0; c < RL; ++c)
      asm volatile("ld.shared.s32 %0, [%1];\n" : "=r"(pair[c]) : "r"(rows + 4 * (RL * lane + c)));
  }
  int valid[RL];
#pragma unroll
  for (int c = 0; c < RL; ++c) {
    const int32_t pr = pair[c];
    const int64_t r = row0 + RL * lane + c;
    valid[c] = RL * lane + c < nrows && SourceRow<true>(p, pr, r) >= 0;
    const uint32_t dst = factors + 4 * (RL * lane + c);
    if (p.row_scale_mode == int32_t(RowScale::kNone)) {
      asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(dst), "f"(1.0f) : "memory");
    } else {
      const bool by_token = p.row_scale_mode == int32_t(RowScale::kToken);
      const int64_t idx = RowScaleIndex(p.row_scale_mode, pr, by_token && valid[c] ? PairToken(p, pr) : 0, r);
      const bool read = valid[c] && idx < p.row_scale_n;
      CpAsync<4>(dst, read ? static_cast<const void*>(p.row_scale + idx) : p.sorted_ids, read ? 4 : 0);  // 0: none read
    }
  }
  if constexpr (RL == 2) {
    asm volatile("st.shared.v2.s32 [%0], {%1, %2};\n" ::"r"(rows + 8 * lane), "r"(valid[0]), "r"(valid[1]) : "memory");
  } else {
#pragma unroll
    for (int c = 0; c < RL; ++c)
      asm volatile("st.shared.s32 [%0], %1;\n" ::"r"(rows + 4 * (RL * lane + c)), "r"(valid[c]) : "memory");
  }
  MbarArrive(bar);     // (release: the stores above)
  CpAsyncArrive(bar);  // once the factors land
}

// The TMA-fed kernel's epilogue of a warp's 16 features (block j) of a non-gated tile, when the output
// columns are in their natural order and n_out % 16 == 0 (StagedStores): the values, as
// EpilogueAct's, go to the warp's TOK x 32 bytes of shared memory by stmatrix (transposed: a row's 16
// features are 32 contiguous bytes) and then out by 16-byte stores, TOK / 16 a thread instead of TOK / 2
// of 2 bytes.
// Staged rows are 32 bytes; their two 16-byte halves swap in rows 4-7 of every 8 (conflict-free
// stmatrix).
__device__ __forceinline__ uint32_t StagedHalf(int row, int half) {
  return uint32_t(row * 32 + ((half ^ ((row >> 2) & 1)) << 4));
}
template <int ACT, int FM>
__device__ __forceinline__ void StoreStaged(const GemmParams& p, float alpha, BiasRef bias, int64_t row0,
                                            int64_t feat0, const float (&acc)[FM][4], uint32_t rows, uint32_t factors,
                                            uint32_t stage, int nrows = 8 * FM) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const float fb[2] = {FeatureBias(bias, p.n_out, feat0 + g, false).x,
                       FeatureBias(bias, p.n_out, feat0 + g + 8, false).x};
  uint32_t packed[FM][2];  // rows 8m + 2t, +1 of features g + 8h, as bf16x2
#pragma unroll
  for (int m = 0; m < FM; ++m) {
    const int row = 8 * m + 2 * t;
    int2 valid;
    float2 rs;
    asm volatile("ld.shared.v2.s32 {%0, %1}, [%2];\n" : "=r"(valid.x), "=r"(valid.y) : "r"(rows + 4 * row));
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(rs.x), "=f"(rs.y) : "r"(factors + 4 * row));
    const float scale[2] = {alpha * rs.x, alpha * rs.y};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float v[2];
#pragma unroll
      for (int c = 0; c < 2; ++c)
        v[c] = (c ? valid.y : valid.x) ? ApplyActivation(ACT, acc[m][2 * h + c] * scale[c] + fb[h], 0.0f)
                                        : 0.0f;
      asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(packed[m][h]) : "f"(v[1]), "f"(v[0]));
    }
  }
  __syncwarp();  // the stage's last reads (an earlier block) are done
  const int i = lane >> 3, r8 = lane & 7;  // stmatrix: lane gives row r8 of matrix i
#pragma unroll
  for (int q = 0; q < FM / 2; ++q) {  // matrices (m, h) = (2q + i / 2, i % 2)
    const int m = 2 * q + (i >> 1), row = 8 * m + r8;
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(
                     stage + StagedHalf(row, i & 1)),
                 "r"(packed[2 * q][0]), "r"(packed[2 * q][1]), "r"(packed[2 * q + 1][0]), "r"(packed[2 * q + 1][1])
                 : "memory");
  }
  __syncwarp();
#pragma unroll
  for (int k = 0; k < FM / 2; ++k) {  // lanes 2i, 2i + 1: the halves of row 16k + i
    const int row = 16 * k + (lane >> 1), half = lane & 1;
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(stage + StagedHalf(row, half)));
    // (one 16-byte store: as a uint4 assignment it became four 4-byte ones, sm_90a SASS)
    if (row < nrows)  // (rows past an item's end are the next one's)
      asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(
                       static_cast<uint16_t*>(p.out) + (row0 + row) * p.n_out + feat0 + 8 * half),
                   "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                   : "memory");
  }
}

// StoreStaged with moe's non-gated activation (relu2, else the identity), picked once a block.
template <int FM>
__device__ __forceinline__ void StoreStagedAct(const GemmParams& p, float alpha, BiasRef bias, int64_t row0,
                                               int64_t feat0, const float (&acc)[FM][4], uint32_t rows,
                                               uint32_t factors, uint32_t stage, int nrows = 8 * FM) {
  if (p.activation == int32_t(Activation::kRelu2))
    StoreStaged<int(Activation::kRelu2)>(p, alpha, bias, row0, feat0, acc, rows, factors, stage, nrows);
  else
    StoreStaged<int(Activation::kIdentity)>(p, alpha, bias, row0, feat0, acc, rows, factors, stage, nrows);
}
#endif

// Whether the TMA-fed and the warp-specialized kernels stage their stores (StoreStaged): natural output
// columns, whole 16-feature groups (and 32-byte rows).
__host__ __device__ __forceinline__ bool StagedStores(const GemmParams& p) {
  return !(p.pairing & (int32_t(Pairing::kOut) | int32_t(Pairing::kChunkOut))) && p.n_out % 16 == 0;
}

// The first used work item (its tile has an expert of this shard) at or after `item`, walking
// gridDim.x apart; false past the last (LaunchTma checks that items fit in int32). Whole warps call
// it: a vote tells the compiler that the outcome is warp-uniform (see W4A16WgmmaWs). Items take the
// slabs of a row tile in turn (see GemmParams::slabs_first) or, with kRowTilesFirst, the row tiles of a
// slab. (tiles and slabs are recomputed here: kept live across the MMA loop, they had cost moves in it.)
template <bool GATED, int NB, int TOK>
__device__ __forceinline__ bool NextItem(const GemmParams& p, int64_t& item, int32_t& tile, int32_t& slab,
                                         int32_t& e) {
  const int64_t tiles = p.P / TOK, slabs = CeilDiv<int64_t>(p.n_out, CtaFeatures<GATED, NB>());
  for (; item < tiles * slabs; item += gridDim.x) {
    tile = int32_t(p.slabs_first ? item / slabs : item % tiles);
    slab = int32_t(p.slabs_first ? item % slabs : item / tiles);
    e = p.tile_expert[tile];
    if (!__all_sync(~0u, e < 0 || e >= p.E)) return true;
  }
  return false;
}

// K % 128 == 0, `a` in the chunk order and not gathered, bf16 out (LaunchWgmmaGemm's caller checks).
// The CTAs walk the work items (row tile, feature slab) gridDim.x apart: one each (the default), or
// with KernelFlag::kTmaPersistent as many CTAs as fit at once, the ring running on across items
// (chunk sequence number `it`), so that the next item's copies and first weight loads overlap the
// last one's epilogue (1.5% slower layers on the H200, 2026-12-02; 3-6.5% with the staged epilogue,
// x0.993-1.012 since its chunk counter is uniform again, session 22).
// PERSISTENT is a template argument: carried across items, the chunk counter had left the uniform
// datapath and the loop of the one-item kernel took 627 instructions for two chunks, not 549 (sm_90a
// SASS). An item's last chunk is peeled and the loop before it unrolled twice (285 instructions a
// chunk against the plain loop's 292, before the staged epilogue); with a CTA per item, H200 prefill
// layers ran 0.6-2.2% faster than on the plain loop unrolled twice and -0.2-2.1% faster than on it
// as it was (2026-12-02). Non-gated tiles with plain output columns (StagedStores: moe's GEMM2) end
// in StoreStaged: warp 7 fetches the tile's row ids and row-scale factors into shared memory during
// the MMAs (RowIdsCopy, RowFactors), and each warp stages its values for 16-byte stores (H200,
// session 21: prefill layers 5-10% faster, register use 125 -> 108). Thread 0 also issues the
// copies, `ahead` chunks ahead (in this item or the next) into the stage that it - 2 used (it - 3
// with one chunk an item), so it waits only on MMAs that finished a chunk ago (a ninth, copier warp
// would cost registers: a 288-thread CTA gets at most 168 per thread, two of them 96, as three or
// five warps share an SMSP).
template <bool GATED, int NB, typename OutT, bool BW, bool PERSISTENT, int TOK>
__global__ void __launch_bounds__(kWgThreadsPerCta, MinCtas<GATED, NB>()) W4A16WgmmaTma(const GemmParams p,
                                                                       const __grid_constant__ CUtensorMap amap) {
#ifdef JAX_NVFP4_WGMMA
  using L = TmaSmem<TOK>;
  constexpr int kChunk = ChunkBytes<TOK>();
  extern __shared__ uint8_t smem_raw[];
  const uint32_t ring = (SmemU32(smem_raw) + 1023) & ~1023u;  // 1024-aligned (swizzle atoms)
  const uint32_t full_bar = ring + kStages * kChunk, empty_bar = full_bar + 8 * kStages;

  GridDependencyWait();
  const int64_t chunks = p.K / 128, ahead = chunks < kLookahead ? chunks : kLookahead;
  const bool copier = threadIdx.x == 0;
  // Chunk c of row tile `row_tile` as sequence number i, once the MMAs of the chunk its stage held are
  // done (32-bit: a CTA's chunks stay far below 2^32).
  auto copy = [&](uint32_t i, int32_t row_tile, int64_t c) {
    const int s = int(i % kStages);
    const uint32_t round = uint32_t(i / kStages);
    if (round > 0) MbarWait(empty_bar + 8 * s, (round - 1) & 1);
    MbarExpectBytes(full_bar + 8 * s, kChunk);
    TmaLoadChunk<TOK>(ring + s * kChunk, &amap, c, row_tile * TOK, full_bar + 8 * s);
  };
  int64_t item = blockIdx.x;
  int32_t tile, slab, e;
  if (!NextItem<GATED, NB, TOK>(p, item, tile, slab, e)) return;  // (uniform over the CTA)
  if (copier) {
    for (int s = 0; s < kStages; ++s) {
      MbarInit(full_bar + 8 * s, 1);      // the copier's arrival (with the bytes it expects)
      MbarInit(empty_bar + 8 * s, kWgThreadsPerCta);  // every thread, once its wgmmas on the stage are done
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    for (int64_t c = 0; c < ahead; ++c) copy(c, tile, c);
  }
  const uint32_t row_bar = ring + L::kRowBar, row_ids = ring + L::kRowIds, row_scales = ring + L::kRowScales;
  const bool staged = !GATED && StagedStores(p);
  if (copier) MbarInit(row_bar, 64);  // (before the barrier below, with the ring's)
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  constexpr int NF = BlocksPerGroup<GATED, NB>();
  int64_t feat[NF];
  bool active[NF];
  const uint8_t* wrow[NF][2];
  const uint8_t* srow[NF][2];
  WarpRows<GATED, NB, BW>(p, e, slab, warp, g, feat, active, wrow, srow);
  WeightRegs<128, NF> cur;
  cur.template Load<false, BW>(wrow, srow, 0, t);
  uint32_t it = 0;  // chunk sequence number (see `copy`)
  const bool row_warp = staged && warp == 7;  // fetches the row info (not warp 0: its thread 0 copies)
  uint32_t done = 0;  // items done (the row mbarrier's phase)
  for (bool more = true; more; ++done) {
    // Carried across items, the chunk counter would leave the uniform datapath (warp 0's value is
    // every thread's): the persistent loop takes 563 instructions for two chunks, not 627 (sm_90a SASS).
    if (PERSISTENT) it = __shfl_sync(~0u, it, 0);
    if (row_warp) RowIdsCopy<TOK>(p, tile * TOK, row_ids);
    // The next item, known before its copies and weight loads start in this one's last chunks.
    int64_t nitem = item + gridDim.x;
    int32_t ntile = 0, nslab = 0, ne = 0;
    more = PERSISTENT && NextItem<GATED, NB, TOK>(p, nitem, ntile, nslab, ne);
    float acc[NF][TOK / 8][4];
    ZeroAcc(acc);
    // Chunk c: the copy `ahead` chunks on (in this item or the next), then the MMAs (weights in `cur`).
    auto copy_ahead = [&](int64_t c) {
      if (copier && (c + ahead < chunks || more))
        copy(it + ahead, c + ahead < chunks ? tile : ntile, c + ahead < chunks ? c + ahead : c + ahead - chunks);
    };
    auto mma = [&]() {
      const int s = int(it % kStages);
      MbarWait(full_bar + 8 * s, uint32_t(it / kStages) & 1);
      ChunkMma<128, NF, TOK, BW>(cur, ring + s * kChunk, acc);
      MbarArrive(empty_bar + 8 * s);
      ++it;
    };
#pragma unroll 2
    for (int64_t c = 0; c + 1 < chunks; ++c) {
      copy_ahead(c);
      WeightRegs<128, NF> next;
      next.template Load<false, BW>(wrow, srow, (c + 1) * 128, t);
      mma();
      cur = next;
    }
    // The last chunk (peeled, so that the loop above stays as short as before): the next item's rows.
    copy_ahead(chunks - 1);
    WeightRegs<128, NF> next;
    if (more) {  // this item's weight loads are all issued: wrow / srow move on (feat / active after the stores)
      int64_t nfeat[NF];
      bool nactive[NF];
      WarpRows<GATED, NB, BW>(p, ne, nslab, warp, g, nfeat, nactive, wrow, srow);
      next.template Load<false, BW>(wrow, srow, 0, t);
    }
    if (row_warp) RowFactors<TOK>(p, tile * TOK, row_ids, row_scales, row_bar);
    mma();
    if (more) cur = next;
    if (staged) {
      MbarWait(row_bar, done & 1);
      Hold(acc);
      const float alpha = p.alpha[e] * kDecodeBias;
      const uint32_t stage = ring + L::kStaging + warp * L::kStagingBytes;
#pragma unroll
      for (int j = 0; j < NF; ++j)
        if (active[j])
          StoreStagedAct(p, alpha, ExpertBias(p, e), tile * TOK, feat[j], acc[j], row_ids, row_scales, stage);
      if (more) __syncthreads();  // the row info is read before the next item's overwrites it
    } else {
      StoreTile<GATED, NF, OutT>(p, e, tile, feat, active, acc);
    }
    item = nitem, tile = ntile, slab = nslab, e = ne;
    if (more) WarpRows<GATED, NB, BW>(p, e, slab, warp, g, feat, active, wrow, srow);  // (wrow / srow as they are)
  }
#endif
}

// W4A16WgmmaWs: a GEMM on chunk-ordered `a` and blocked weights (moe's GEMM1 on gathered rows, bf16 out,
// or fp32 in w4a4; GEMM2 with KernelFlag::kWsGemm2) with warp-specialized roles. A CTA is NC MMA warpgroups
// and one producer warpgroup, which fills a ring of kWsStages stages per 128-K chunk:
// - the weight blocks of the CTA's rows, by 2-D tensor copies (one thread): per warpgroup two
//   blocks of 64 rows, gated the gate and the up rows of 64 features, otherwise 128 features;
// - the tile's TOK (64 or 32) activation rows: gathered (through sorted_ids, zeros for padding rows),
//   by 16-byte cp.async copies of each producer thread (half or a quarter of a row); otherwise by
//   two tensor copies.
// The MMA warps load their weights from shared memory (no global load in flight), decode and issue
// wgmmas; the roles' register budgets are set apart (setmaxnreg), so three MMA warpgroups (four
// on 32-row tiles) fit where the staged kernel has two. (H200, 2026-12-02: as GEMM1, 14-17% faster prefill layers than
// the staged kernel; as GEMM2 on three MMA warpgroups of two blocks and unstaged stores, 1.02-1.22x slower ones
// than the TMA-fed kernel, whose one-block CTAs fit two to an SM; on 32-row tiles, as GEMM2 of K = 2048, 8-9%
// faster decode layers: the TMA-fed kernel holds one chunk of weights a warp in flight, the ring six stages,
// 2026-12-03. As GEMM2 on 64-row tiles with four MMA warpgroups of one block (a chunk loop of 187 instructions,
// the TMA-fed kernel's 234) and the TMA-fed kernel's staged stores (StoreStaged; the last MMA warp fetches the
// row info): prefill layers x0.94-0.95, session 38.) The grid is
// persistent: a CTA per SM walks the work items, so the ring's fill and the epilogue's stores of one
// item overlap the next (prefill layers up to 1.8% faster, at most 0.6% slower; a warpgroup whose
// rows of the last slab are all past n_out skipping its MMAs gained nothing and was not kept; H200,
// 2026-12-02). (Two MMA warpgroups, six stages: 1.22-1.31x slower layers, H200 2026-12-02. The MMA warps
// reading the next item's expert during this one's MMAs, and its row ids into shared memory at its start,
// instead of each where it is used: x0.993-1.003, no gain, session 30.)
// (Work items of two 64-row tiles of one expert, groups padded to 128 rows: half the FP4 decode per MMA, wgmmas
// over the used 32-row groups only; Qwen3-30B-A3B T = 4096 layers 1.06-1.15x slower on two MMA warpgroups, on four
// (64 accumulators a thread: ptxas serialized their wgmmas), and on three of 96 features; H200 2026-12-04,
// session 37, branch ws-pair-items.)
// NC, the MMA warpgroups: three, or four on 32-row gated tiles (GEMM1 at decode, whose accumulators
// fit 112 registers): 256 features a work item, so that DeepSeek-V3's I = 2048 makes 8 slabs a tile
// (192: 10.7, the last two thirds used) and 64 tokens' 32 tiles 256 items, two a CTA on 132 SMs
// (192: 352 items, the last round on 88 SMs). H200, 2026-12-03: DeepSeek-V3 layers x0.90-0.91 at
// T = 48-64, Qwen3-30B-A3B x0.96-1.00 at T = 128-384 (KernelFlag::kWsThreeGroups keeps three).
// NB: weight copies a stage, 64-row blocks a warpgroup (gated: its gate and up rows; otherwise two
// blocks of 64 features, or one on 32-row bf16-out tiles and 64-row ungathered ones (GEMM2): four MMA warpgroups
// of one block, 256 features an
// item, where GEMM2 at DeepSeek-V3 T = 64 made 608 items of 384 on 132 CTAs, the last slab two thirds used;
// H200 2026-12-03: layers x0.97 at T = 48-64, KernelFlag::kWsTwoBlocks keeps two; two pairs of warpgroups of two
// blocks, one the even 128-K chunks and one the odd, summed through shared memory: 10% fewer loop instructions,
// layers x1.02 slower, session 35).
// KernelFlag::kRows96 (opt-in): TOK = 96 buffers holding work items of 32-96 rows of one expert's group
// (RowItemTables), four MMA warpgroups of one block: GEMM2, and GEMM1 with its gate and up rows on pairs of
// warpgroups (kSplit; the chunk loop 179 instructions for the 96 rows' 8 wgmmas, sm_90a SASS).
template <int NC, int NB = 2>
struct WsShape {
  static constexpr int kThreads = (NC + 1) * 128;
  static constexpr int kCopyFrags = 4 * NC;  // 16-row fragments per weight copy: a 64-row block per warpgroup
  static constexpr int kCopyCodeBytes = kCopyFrags * kBlockRows * kBlockCodeBytes;  // one 128-K block each
  static constexpr int kCopyScaleBytes = kCopyFrags * kBlockRows * kBlockScaleBytes;
  static constexpr int kWeightBytes = NB * (kCopyCodeBytes + kCopyScaleBytes);  // NB copies of each
  // Registers a thread. setmaxnreg moves registers within the CTA's pool, what its launch got:
  // kThreads x kLaunchRegs (ptxas gives these kernels all that __launch_bounds__ allows: 128 / 96);
  // asking for more waits forever (H200, 2026-12-03: four warpgroups of 120 hung). Four warpgroups'
  // accumulators and weights fit 112 (sm_90a SASS: R0-R107, no local memory).
  static constexpr int kLaunchRegs = 65536 / kThreads / 8 * 8;
  static constexpr int kProducerRegs = NC == 3 ? 40 : 32, kConsumerRegs = NC == 3 ? 152 : 112;
  static_assert((NC == 3 || NC == 4) && (NB == 1 || NB == 2), "three or four MMA warpgroups, one or two blocks");
  static_assert(NC * kConsumerRegs + kProducerRegs <= (NC + 1) * kLaunchRegs, "within the CTA's register pool");
};
// A stage: [activations][codes 0, 1][scales 0, 1], and its full and empty mbarriers. 64-row tiles:
// four stages of 43 KB (five, all that fit in 227 KB: 3-6% slower layers; three: 0.6-2.6% slower;
// H200 2026-12-02). 32-row tiles (decode batches, whose weights stream from HBM): six of 35 KB, or
// with four MMA warpgroups five of 44 KB (all that fit), of one block each eight of 26 KB; 64-row tiles of one
// block five of 34 KB and the staged stores' 33 KB.
template <int TOK, int NC, int NB = 2>
struct WsSmem {
  static constexpr int kStageBytes = ChunkBytes<TOK>() + WsShape<NC, NB>::kWeightBytes;
  static constexpr int kStages = TOK == 96 ? 4 : TOK == 64 ? (NB == 1 ? 5 : 4) : NB == 1 ? 8 : NC == 3 ? 6 : 5;
  // 64- and 96-row one-block bf16-out tiles (GEMM2) stage their stores as the TMA-fed kernel does: after the ring's
  // mbarriers, the row mbarrier (16 bytes), the tile's row ids and row-scale factors, a warp's staged output each;
  // 96-row buffers then their item tables (RowItemTables).
  static constexpr bool kStaged = TOK >= 64 && NB == 1;
  static constexpr int kRowBar = kStages * (kStageBytes + 16), kRowIds = kRowBar + 16, kRowScales = kRowIds + 4 * TOK;
  static constexpr int kStaging = kRowScales + 4 * TOK, kStagingBytes = TOK * kWarpFeatures * 2;
  static constexpr int kTables = (kStaged ? kStaging + 4 * NC * kStagingBytes : kRowBar);
  static constexpr int kBytes = kTables + (TOK == 96 ? 4 * (3 * kMaxAlignExperts + 1) : 0) + 1024;
  static_assert(kStageBytes % 1024 == 0, "stages keep the 1024-byte alignment of the swizzled activations");
  static_assert(kBytes <= 227 * 1024, "the shared memory of an H200 CTA");
};

// KernelFlag::kRows96: the warp-specialized kernel's work items of up to 96 rows over the align's groups of 32- or
// 64-row tiles (p.tile_m): expert e's group (cnt[e] tiles from tile first[e]) in items of 96 rows, its last of 32,
// 64 or 96, ioff[e] of them before e's, the total in ioff[kMaxAlignExperts]. One decode of a weight chunk feeds up
// to 96 rows, with no row added to the align's padding. RowItemTables: every thread of the CTA builds them in
// shared memory from tile_expert; returns the items.
__device__ __forceinline__ int32_t RowItemTables(const GemmParams& p, int32_t* cnt, int32_t* first, int32_t* ioff) {
  const int E = int(p.E), tid = threadIdx.x, nt = blockDim.x;
  for (int e = tid; e < E; e += nt) cnt[e] = 0;
  __syncthreads();
  for (int64_t i = tid; i < p.P / p.tile_m; i += nt) {
    const int32_t e = p.tile_expert[i];
    if (e >= 0 && e < p.E) {
      atomicAdd(&cnt[e], 1);
      if (i == 0 || p.tile_expert[i - 1] != e) first[e] = int32_t(i);  // (groups are contiguous)
    }
  }
  __syncthreads();
  if (tid < 32) {  // warp 0: the exclusive sum of the experts' items, kPer experts a lane
    constexpr int kPer = kMaxAlignExperts / 32;
    int32_t n[kPer], sum = 0;
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int e = tid * kPer + j;
      n[j] = e < E ? (cnt[e] * p.tile_m + 95) / 96 : 0;
      sum += n[j];
    }
    int32_t incl = sum;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int32_t v = __shfl_up_sync(~0u, incl, d);
      if (tid >= d) incl += v;
    }
    int32_t run = incl - sum;
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      if (tid * kPer + j < E) ioff[tid * kPer + j] = run;
      run += n[j];
    }
    if (tid == 31) ioff[kMaxAlignExperts] = incl;
  }
  __syncthreads();
  return ioff[kMaxAlignExperts];
}
// Item k (< the total) of the tables: its expert (the last whose items start at or before k), first row and rows.
// (Rows end at P: a tile_expert whose groups are not contiguous, which moe_align never writes, gives wrong rows,
// not accesses out of bounds.)
__device__ __forceinline__ void RowItemAt(const int32_t* cnt, const int32_t* first, const int32_t* ioff, int E,
                                          int tile_m, int64_t P, int32_t k, int32_t& e, int64_t& row0, int& rows) {
  int lo = 0, hi = E - 1;  // ioff[0] = 0 <= k
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (ioff[mid] <= k) lo = mid;
    else hi = mid - 1;
  }
  const int32_t j = k - ioff[lo];
  e = lo;
  row0 = int64_t(first[lo]) * tile_m + 96 * j;
  const int64_t left = P - row0;  // (>= 0 but for a malformed tile_expert)
  rows = min(96, cnt[lo] * tile_m - 96 * j);
  rows = left < rows ? int(left > 0 ? left : 0) : rows;
}

// Output features of a warp-specialized CTA (gated with one block a warpgroup: pairs of gate and up warpgroups).
template <bool GATED, int NC, int NB = 2>
constexpr int WsFeatures() { return (GATED ? (NB == 1 ? 32 : 64) : 64 * NB) * NC; }

// The gated 96-row items' epilogue (kRows96, GEMM1) of a pair of warpgroups: a warp's 16 features of rows 8m..8m+7,
// m < FM / 2 in the gate warpgroup (UP false), the others in the up one, from its own sums (acc) and the other's
// (other[m - m0], handed over in shared memory), with the row info in shared memory (as StoreStaged's), to
// EpilogueAct's values and stores; rows from nrows on (the next item's) are not stored.
template <int ACT, bool UP, typename OutT, int FM>
__device__ __forceinline__ void SplitGatedStores(const GemmParams& p, float2 alpha, BiasRef bias, int64_t row0,
                                                 int64_t feat0, const float (&acc)[FM][4],
                                                 const float (&other)[FM / 2][4], uint32_t rows, uint32_t factors,
                                                 int nrows) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int64_t col[2] = {PairingPos(p.pairing, Pairing::kOut, feat0 + g),
                          PairingPos(p.pairing, Pairing::kOut, feat0 + g + 8)};
  const float2 fb[2] = {FeatureBias(bias, p.n_out, feat0 + g, true),
                        FeatureBias(bias, p.n_out, feat0 + g + 8, true)};
  constexpr int m0 = UP ? FM / 2 : 0;
#pragma unroll
  for (int mm = 0; mm < FM / 2; ++mm) {
    const int m = m0 + mm, row = 8 * m + 2 * t;
    int2 valid;
    float2 rs;
    asm volatile("ld.shared.v2.s32 {%0, %1}, [%2];\n" : "=r"(valid.x), "=r"(valid.y) : "r"(rows + 4 * row));
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(rs.x), "=f"(rs.y) : "r"(factors + 4 * row));
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const float scale = alpha.x * (c ? rs.y : rs.x), up_scale = alpha.y * (c ? rs.y : rs.x);
      if (row + c >= nrows) continue;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int i = 2 * h + c;
        const float gate = UP ? other[mm][i] : acc[m][i], up = UP ? acc[m][i] : other[mm][i];
        const float v =
            (c ? valid.y : valid.x) ? ApplyActivation(ACT, gate * scale + fb[h].x, up * up_scale + fb[h].y) : 0.0f;
        Store(static_cast<OutT*>(p.out), (row0 + row + c) * p.n_out + col[h], v);
      }
    }
  }
}
template <bool UP, typename OutT, int FM>
__device__ __forceinline__ void SplitGatedStoresAct(const GemmParams& p, float2 alpha, BiasRef bias, int64_t row0,
                                                    int64_t feat0, const float (&acc)[FM][4],
                                                    const float (&other)[FM / 2][4], uint32_t rows, uint32_t factors,
                                                    int nrows) {
  using A = Activation;
  if (p.activation == int32_t(A::kGeglu))
    SplitGatedStores<int(A::kGeglu), UP, OutT>(p, alpha, bias, row0, feat0, acc, other, rows, factors, nrows);
  else if (p.activation == int32_t(A::kSwigluOai))
    SplitGatedStores<int(A::kSwigluOai), UP, OutT>(p, alpha, bias, row0, feat0, acc, other, rows, factors, nrows);
  else
    SplitGatedStores<int(A::kSwiglu), UP, OutT>(p, alpha, bias, row0, feat0, acc, other, rows, factors, nrows);
}

template <bool GATED, typename OutT, int TOK, int NC, int NB>
__global__ void __launch_bounds__(WsShape<NC, NB>::kThreads, 1)
    W4A16WgmmaWs(const GemmParams p, const __grid_constant__ CUtensorMap codes,
                 const __grid_constant__ CUtensorMap scales, const __grid_constant__ CUtensorMap amap) {
#ifdef JAX_NVFP4_WGMMA
  // Gated: a gate and an up block a warpgroup, or (kSplit, 96-row items) the gate and the up block of 64 features
  // in a pair of warpgroups, each storing half the rows from the sums the other hands it in shared memory.
  constexpr bool kSplit = GATED && NB == 1;
  static_assert(!GATED || NB == 2 || TOK == 96, "gated: a gate and an up block, or 96-row split pairs");
  using Shape = WsShape<NC, NB>;
  constexpr int kWsStages = WsSmem<TOK, NC, NB>::kStages, kWsStageBytes = WsSmem<TOK, NC, NB>::kStageBytes;
  constexpr int kChunk = ChunkBytes<TOK>();
  extern __shared__ uint8_t smem_raw[];
  const uint32_t ring = (SmemU32(smem_raw) + 1023) & ~1023u;
  const uint32_t full_bar = ring + kWsStages * kWsStageBytes, empty_bar = full_bar + 8 * kWsStages;
  using Smem = WsSmem<TOK, NC, NB>;
  const uint32_t row_bar = ring + Smem::kRowBar, row_ids = ring + Smem::kRowIds, row_scales = ring + Smem::kRowScales;
  constexpr bool kStagedInstance = Smem::kStaged && !GATED && std::is_same_v<OutT, uint16_t>;
  // 96-row buffers (kRows96): items of an expert's 32-96 rows; GEMM2 (not gathered, staged stores) or GEMM1
  // (gathered, kSplit): LaunchChunkA's choice.
  constexpr bool kRows = TOK == 96;
  static_assert(!kRows || kStagedInstance || kSplit, "96-row items: GEMM2's staged kernel, or GEMM1's split pairs");
  const bool staged = kStagedInstance && (kRows || StagedStores(p));

  GridDependencyWait();
  // Work items (row tile, feature slab), slabs first, walked gridDim.x apart: a CTA per SM (the
  // persistent grid) or, with KernelFlag::kNoPersistent, per item. Both roles skip the same unused
  // tiles and count chunks over the CTA's items (`it`), so the ring runs on across items: the
  // producer fills the next item's first stages while the MMA warpgroups store the last one's tile.
  const int64_t slabs = CeilDiv<int64_t>(p.n_out, WsFeatures<GATED, NC, NB>());
  const int64_t chunks = p.K / 128;
  const int wg = threadIdx.x >> 7;
  const bool gather = p.gather;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kWsStages; ++s) {
      // The tensor copies' thread, and with gathered rows each producer thread's cp.async.
      MbarInit(full_bar + 8 * s, gather ? 1 + 128 : 1);
      MbarInit(empty_bar + 8 * s, 128 * NC);
    }
    if (staged || kSplit) MbarInit(row_bar, 64);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  int32_t* tables = reinterpret_cast<int32_t*>(smem_raw + (ring + Smem::kTables - SmemU32(smem_raw)));
  int32_t *cnt = tables, *first = tables + kMaxAlignExperts, *ioff = tables + 2 * kMaxAlignExperts;
  int64_t items = p.P / TOK * slabs;
  if constexpr (kRows) items = int64_t(RowItemTables(p, cnt, first, ioff)) * slabs;
  // Work item `item`'s expert, first row and rows (a row tile, or kRows' item).
  auto item_rows = [&](int64_t item, int32_t& e, int64_t& row0, int& rows) {
    const int64_t tile = item / slabs;
    if constexpr (kRows) {
      RowItemAt(cnt, first, ioff, int(p.E), p.tile_m, p.P, int32_t(tile), e, row0, rows);
    } else {
      e = p.tile_expert[tile];
      row0 = tile * TOK;
      rows = TOK;
    }
  };

  if (wg == NC) {  // the producer warpgroup
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(Shape::kProducerRegs));
    // Row n, 16-byte pieces PPT sub .. PPT sub + PPT - 1 of its 16 in each chunk (a K half, or quarter).
    constexpr int kSubs = 128 / TOK, PPT = 16 / kSubs;
    const int pt = threadIdx.x & 127, n = pt / kSubs, sub = pt % kSubs;
    if (!gather && pt != 0) return;
    int64_t it = 0;
    for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
      const int64_t slab = item % slabs;
      int32_t e;
      int64_t row0;
      int rows;
      item_rows(item, e, row0, rows);
      if (e < 0 || e >= p.E) continue;  // unused tile
      const int64_t src = gather && n < rows ? SourceRow<true>(p, row0 + n) : -1;
      const uint16_t* xrow = p.a + (src >= 0 ? src : 0) * p.K + 8 * PPT * sub;
      const uint32_t x_bytes = src >= 0 ? 16 : 0;
      // The first rows of the CTA's two weight copies in the maps ([E * N / 16] fragments): gated,
      // its gate and its up rows; otherwise two consecutive blocks.
      const int32_t frag0 = int32_t((int64_t(e) * p.N + slab * WsFeatures<GATED, NC, NB>()) / kBlockRows);
      const int32_t frag1 = frag0 + int32_t(GATED ? p.n_out / kBlockRows : Shape::kCopyFrags);
      for (int64_t c = 0; c < chunks; ++c, ++it) {
        const int s = int(it % kWsStages);
        const uint32_t stage = ring + s * kWsStageBytes;
        if (it >= kWsStages) MbarWait(empty_bar + 8 * s, uint32_t(it / kWsStages - 1) & 1);
        if (pt == 0) {
          MbarExpectBytes(full_bar + 8 * s, Shape::kWeightBytes + (gather ? 0 : kChunk));
          const uint32_t w = stage + kChunk, sc = w + NB * Shape::kCopyCodeBytes;
          const int32_t kc = int32_t(c * kBlockRows * kBlockCodeBytes / 4);  // (32-bit words)
          const int32_t ks = int32_t(c * kBlockRows * kBlockScaleBytes / 4);
          if constexpr (kSplit) {  // the gate rows' half copies, then the up rows'
            TmaLoad2d(w, &codes, kc, frag0, full_bar + 8 * s);
            TmaLoad2d(w + Shape::kCopyCodeBytes / 2, &codes, kc, frag1, full_bar + 8 * s);
            TmaLoad2d(sc, &scales, ks, frag0, full_bar + 8 * s);
            TmaLoad2d(sc + Shape::kCopyScaleBytes / 2, &scales, ks, frag1, full_bar + 8 * s);
          } else {
            TmaLoad2d(w, &codes, kc, frag0, full_bar + 8 * s);
            TmaLoad2d(sc, &scales, ks, frag0, full_bar + 8 * s);
          }
          if constexpr (NB == 2) {
            TmaLoad2d(w + Shape::kCopyCodeBytes, &codes, kc, frag1, full_bar + 8 * s);
            TmaLoad2d(sc + Shape::kCopyScaleBytes, &scales, ks, frag1, full_bar + 8 * s);
          }
          if (!gather) TmaLoadChunk<TOK>(stage, &amap, c, row0, full_bar + 8 * s);
        }
        if (gather) {
          // Logical 16-byte piece i (a is in the chunk order) to its swizzled place in panel i / 8 (96-row
          // buffers: a row a thread, threads 96-127 only arrive).
#pragma unroll
          for (int j = 0; j < PPT; ++j) {
            if (TOK == 96 && n >= TOK) break;
            const int i = PPT * sub + j, q = i & 7;
            CpAsync<16>(stage + (i >> 3) * PanelBytes<TOK>() + n * 128 + ((q ^ (n & 7)) << 4), xrow + c * 128 + 8 * j,
                        x_bytes);
          }
          CpAsyncArrive(full_bar + 8 * s);
        }
      }
    }
    if (gather) asm volatile("cp.async.wait_all;\n" ::: "memory");
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(Shape::kConsumerRegs));
  // warp: the CTA's fragment in each weight copy (gated: gate / up rows of the same features).
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  int64_t it = 0;
  uint32_t done = 0;  // items done (the row mbarrier's phase)
  // The staged epilogue's row info (as in W4A16WgmmaTma): the last MMA warp fetches it during the MMAs.
  // (kSplit: warp 3)
  const bool row_warp = (staged && warp == 4 * NC - 1) || (kSplit && warp == 3);
  // This warp's fragment in the stage's weights: kSplit, gate warpgroups 0 / 2 the gate rows' fragments 0-3 / 4-7
  // (the first half copy), up warpgroups 1 / 3 the up rows' (the second).
  const int wfrag = kSplit ? ((warp >> 2) & 1) * 8 + (warp >> 3) * 4 + (warp & 3) : warp;
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const int64_t slab = item % slabs;
    int32_t e;
    int64_t row0;
    int rows;
    item_rows(item, e, row0, rows);
    // Unused tile; a vote, so that the compiler knows the branch is warp-uniform (a plain test
    // added 46 instructions to the loop below: sm_90a SASS, 2026-12-02).
    if (__all_sync(~0u, e < 0 || e >= p.E)) continue;
    if (row_warp) RowIdsCopy<TOK>(p, row0, row_ids, rows);
    const int64_t base = slab * WsFeatures<GATED, NC, NB>() + 16 * (kSplit ? (warp >> 3) * 4 + (warp & 3) : warp);
    int64_t feat[NB];
    bool active[NB];
#pragma unroll
    for (int j = 0; j < NB; ++j) {
      feat[j] = GATED ? base : base + j * 16 * Shape::kCopyFrags;
      active[j] = feat[j] < p.n_out;
    }
    float acc[NB][TOK / 8][4];
    ZeroAcc(acc);
    auto chunk = [&](auto nn) {  // chunk `it` of the ring, MMAs over nn rows
      const int s = int(it % kWsStages);
      const uint32_t stage = ring + s * kWsStageBytes;
      MbarWait(full_bar + 8 * s, uint32_t(it / kWsStages) & 1);
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // cp.async writes -> wgmma reads
      WeightRegs<128, NB> w;
#pragma unroll
      for (int j = 0; j < NB; ++j) {  // weight copy j
        const uint32_t code =
            stage + kChunk + j * Shape::kCopyCodeBytes + uint32_t(wfrag * kBlockRows * kBlockCodeBytes);
        const uint32_t scale = stage + kChunk + NB * Shape::kCopyCodeBytes + j * Shape::kCopyScaleBytes +
                               uint32_t(wfrag * kBlockRows * kBlockScaleBytes);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          uint4 v;
          asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                       : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                       : "r"(code + uint32_t((g + 8 * h) * kBlockCodeBytes + 16 * t)));
          w.SetCodes(j, h, v);
          unsigned short sv;
          asm volatile("ld.shared.u16 %0, [%1];\n"
                       : "=h"(sv)
                       : "r"(scale + uint32_t((g + 8 * h) * kBlockScaleBytes + 2 * t)));
          w.s[j][h] = sv;
        }
      }
      ChunkMma<128, NB, TOK, true, decltype(nn)::value>(w, stage, acc);
      MbarArrive(empty_bar + 8 * s);
      ++it;
    };
    auto mmas = [&](auto nn) {
      for (int64_t c = 0; c + 1 < chunks; ++c) chunk(nn);
      if (row_warp) RowFactors<TOK>(p, row0, row_ids, row_scales, row_bar, rows);  // (peeled: the loop stays as it was)
      chunk(nn);
    };
    if constexpr (kRows) {  // (votes: warp-uniform branches, as above)
      if (__all_sync(~0u, rows == 96)) mmas(std::integral_constant<int, 96>{});
      else if (__all_sync(~0u, rows == 64)) mmas(std::integral_constant<int, 64>{});
      else mmas(std::integral_constant<int, 32>{});
    } else {
      mmas(std::integral_constant<int, TOK>{});
    }
    if constexpr (kSplit) {
      // Each warpgroup of a pair stores half the rows: the gate one (0, 2) rows 0-47, the up one (1, 3) rows
      // 48-95. Each hands the other its sums of the other's rows in the pair's half of the staging area (slot m
      // of a thread: m < 6 the up sums, else the gate sums), reads its own after the pair's named barrier (2 + pair),
      // and all MMA warpgroups meet at barrier 1 before the next item overwrites the slots and the row info.
      // (votes: warp-uniform branches, else the chunk loop's descriptors left the uniform registers: 206
      // instructions, not 187, sm_90a SASS)
      constexpr int FM = TOK / 8;
      const int pair = warp >> 3, twg = threadIdx.x & 127;
      const bool pair0 = __all_sync(~0u, pair == 0), up_wg = __all_sync(~0u, (warp >> 2) & 1);
      const uint32_t slots = ring + Smem::kStaging + uint32_t(pair * 128 * 16 * FM);
      auto slot = [&](int m) { return slots + uint32_t((m * 128 + twg) * 16); };
      Hold(acc);
      float other[FM / 2][4];
      auto hand_over = [&](auto up) {  // (compile-time halves: no dynamic register indexing)
        constexpr bool kUp = decltype(up)::value;
#pragma unroll
        for (int mm = 0; mm < FM / 2; ++mm) {
          const int m = kUp ? mm : FM / 2 + mm;  // the other's rows
          asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(slot(m)), "f"(acc[0][m][0]),
                       "f"(acc[0][m][1]), "f"(acc[0][m][2]), "f"(acc[0][m][3])
                       : "memory");
        }
        // (immediate barrier ids: with a register one, ptxas reserves all 16)
        if (pair0) asm volatile("bar.sync 2, 256;\n" ::: "memory");
        else asm volatile("bar.sync 3, 256;\n" ::: "memory");
#pragma unroll
        for (int mm = 0; mm < FM / 2; ++mm)
          asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                       : "=f"(other[mm][0]), "=f"(other[mm][1]), "=f"(other[mm][2]), "=f"(other[mm][3])
                       : "r"(slot(kUp ? FM / 2 + mm : mm)));
        MbarWait(row_bar, done++ & 1);
        const float2 alpha = make_float2(p.alpha[e] * kDecodeBias, p.alpha_up[e] * kDecodeBias);  // gate, up rows'
        if (active[0])
          SplitGatedStoresAct<kUp, OutT>(p, alpha, ExpertBias(p, e), row0, feat[0], acc[0], other, row_ids,
                                         row_scales, rows);
      };
      if (up_wg) hand_over(std::true_type{});
      else hand_over(std::false_type{});
      asm volatile("bar.sync 1, %0;\n" ::"n"(128 * NC) : "memory");
      continue;
    }
    if constexpr (kStagedInstance) {
      if (staged) {
        MbarWait(row_bar, done++ & 1);
        Hold(acc);
        const float alpha = p.alpha[e] * kDecodeBias;
        const uint32_t out_stage = ring + Smem::kStaging + warp * Smem::kStagingBytes;
        if (active[0])
          StoreStagedAct(p, alpha, ExpertBias(p, e), row0, feat[0], acc[0], row_ids, row_scales, out_stage, rows);
        // The MMA warpgroups only (named barrier 1): the row info is read before the next item's overwrites it.
        asm volatile("bar.sync 1, %0;\n" ::"n"(128 * NC) : "memory");
        continue;
      }
    }
    if constexpr (!kRows) StoreTile<GATED, NB, OutT>(p, e, item / slabs, feat, active, acc);
  }
#endif
}

// The staged kernel's grid (slabs_first: 1-D when it fits).
template <bool GATED, int NB>
dim3 Grid(GemmParams& p, bool slabs_first) {
  const int64_t tiles = p.P / kTokens, slabs = CeilDiv<int64_t>(p.n_out, CtaFeatures<GATED, NB>());
  p.slabs_first = slabs_first && tiles * slabs <= 0x7FFFFFFF;  // else the 2-D grid (x up to 2^31 - 1)
  return p.slabs_first ? dim3(unsigned(tiles * slabs)) : dim3(unsigned(tiles), unsigned(slabs));
}

template <bool GATED, int NB, typename OutT, bool BW>
void Launch(GemmParams p, bool slabs_first, bool pdl, cudaStream_t stream) {
  static_assert(kSmemBytes <= 48 * 1024, "no opt-in attribute needed");
  const dim3 grid = Grid<GATED, NB>(p, slabs_first);
  LaunchKernel(W4A16WgmmaStaged<GATED, NB, OutT, BW>, grid, kWgThreadsPerCta, kSmemBytes, stream, pdl, p);
}

template <bool BW>
void LaunchFor(const GemmParams& p, bool gated, bool f32_out, bool one_block, bool sf, bool pdl,
               cudaStream_t stream) {
  if (gated) f32_out ? Launch<true, 2, float, BW>(p, sf, pdl, stream) : Launch<true, 2, uint16_t, BW>(p, sf, pdl, stream);
  else if (one_block) f32_out ? Launch<false, 1, float, BW>(p, sf, pdl, stream) : Launch<false, 1, uint16_t, BW>(p, sf, pdl, stream);
  else f32_out ? Launch<false, 2, float, BW>(p, sf, pdl, stream) : Launch<false, 2, uint16_t, BW>(p, sf, pdl, stream);
}

// A 2-D tensor map [outer, inner] of `type` elements, rows row_bytes apart, boxes box_inner x
// box_outer; elements past the bounds read as zeros. The encoder is the driver's, found through the
// runtime (no link to libcuda); encoding is host-only work, so it is safe during CUDA-graph capture.
std::string Encode2d(CUtensorMap* map, CUtensorMapDataType type, const void* ptr, uint64_t inner, uint64_t outer,
                     uint64_t row_bytes, uint32_t box_inner, uint32_t box_outer, CUtensorMapSwizzle swizzle) {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
#if CUDART_VERSION >= 12050
    const cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                                             &found);
#else
    const cudaError_t err = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &fn, cudaEnableDefault, &found);
#endif
    if (err != cudaSuccess || found != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();  // not a launch error of a later call
      fn = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  if (!encode) return "the driver has no cuTensorMapEncodeTiled";
  const cuuint64_t dims[2] = {inner, outer}, strides[1] = {row_bytes};
  const cuuint32_t box[2] = {box_inner, box_outer}, elem_strides[2] = {1, 1};
  const CUresult r = encode(map, type, 2, const_cast<void*>(ptr), dims, strides, box, elem_strides,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? "" : "cuTensorMapEncodeTiled failed with CUresult " + std::to_string(int(r));
}

// The tensor map of `a` [a_rows, K] bf16 for the wgmma kernels: boxes of 64 K x `tokens` rows, 128-byte
// swizzle; rows past a_rows read as zeros.
std::string EncodeActivationMap(const GemmParams& p, int tokens, CUtensorMap* map) {
  return Encode2d(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, p.a, uint64_t(p.K), uint64_t(p.a_rows), uint64_t(p.K) * 2,
                  64, uint32_t(tokens), CU_TENSOR_MAP_SWIZZLE_128B);
}

// Over 48 KB of shared memory needs the opt-in, once per kernel and device (a host call, also
// allowed while XLA captures a graph: H200, 2026-12-02).
template <auto Kernel>
std::string OptInSmem(int bytes) {
  static std::atomic<bool> opted_in[64];
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return "no current CUDA device (or over 64)";
  if (!opted_in[dev].load(std::memory_order_acquire)) {
    const cudaError_t attr = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (attr != cudaSuccess) {
      (void)cudaGetLastError();  // not a launch error of a later call
      return std::string("the shared-memory opt-in failed: ") + cudaGetErrorString(attr);
    }
    opted_in[dev].store(true, std::memory_order_release);
  }
  return "";
}

// A positive value for the current device from `query(dev, &v)` (a cudaError_t), cached in `cache`
// per device: no stream operation, so it is safe while XLA captures a CUDA graph. 0 when unknown (a
// failed call's error is cleared, so it is not taken for a launch error of a later call).
template <typename Query>
int CachedPerDevice(std::atomic<int> (&cache)[64], Query query) {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) {
    (void)cudaGetLastError();
    return 0;
  }
  int v = cache[dev].load(std::memory_order_relaxed);
  if (v <= 0) {
    if (query(dev, &v) != cudaSuccess || v <= 0) {
      (void)cudaGetLastError();
      return 0;
    }
    cache[dev].store(v, std::memory_order_relaxed);
  }
  return v;
}

// Compute capability major / SM count of the current device (cached); 0 when unknown.
template <cudaDeviceAttr ATTR>
int CachedDeviceAttribute() {
  static std::atomic<int> cache[64];
  return CachedPerDevice(cache, [](int dev, int* v) { return cudaDeviceGetAttribute(v, ATTR, dev); });
}

// The registers a thread that `Kernel` launches with (cached per device; 0 when unknown).
template <auto Kernel>
int LaunchRegisters() {
  static std::atomic<int> cache[64];
  return CachedPerDevice(cache, [](int, int* v) {
    cudaFuncAttributes attr{};
    const cudaError_t err = cudaFuncGetAttributes(&attr, Kernel);
    *v = attr.numRegs;
    return err;
  });
}

// W4A16WgmmaTma on a 1-D grid: a CTA per work item, or persistent: as many as fit on the device at once
// (occupancy, cached per device), each walking the items gridDim.x apart.
template <bool GATED, int NB, bool BW, bool PERSISTENT, int TOK>
std::string LaunchTma(GemmParams p, bool slabs_first, bool pdl, cudaStream_t stream) {
  constexpr auto kernel = W4A16WgmmaTma<GATED, NB, uint16_t, BW, PERSISTENT, TOK>;
  constexpr int kTmaSmemBytes = TmaSmem<TOK>::kBytes;
  CUtensorMap map;
  if (std::string err = EncodeActivationMap(p, TOK, &map); !err.empty()) return err;
  if (std::string err = OptInSmem<kernel>(kTmaSmemBytes); !err.empty()) return err;
  p.slabs_first = slabs_first;
  const int64_t items = p.P / TOK * CeilDiv<int64_t>(p.n_out, CtaFeatures<GATED, NB>());
  if (items > 0x7FFFFFFF) return "too many row tiles or feature slabs";
  int64_t ctas = items;
  if (PERSISTENT) {
    static std::atomic<int> per_sm[64];  // CTAs of this kernel per SM
    const int n = CachedPerDevice(per_sm, [](int, int* v) {
      return cudaOccupancyMaxActiveBlocksPerMultiprocessor(v, kernel, kWgThreadsPerCta, kTmaSmemBytes);
    });
    if (n == 0) return "the occupancy query of the TMA-fed wgmma kernel failed";
    const int sms = CachedDeviceAttribute<cudaDevAttrMultiProcessorCount>();
    ctas = std::min<int64_t>(ctas, int64_t(n) * std::max(sms, 1));
  }
  LaunchKernel(kernel, dim3(unsigned(ctas)), kWgThreadsPerCta, kTmaSmemBytes, stream, pdl, p, map);
  return "";
}

template <bool BW, bool PERSISTENT, int TOK>
std::string LaunchTmaFor(const GemmParams& p, bool gated, bool one_block, bool sf, bool pdl, cudaStream_t stream) {
  if (gated) return LaunchTma<true, 2, BW, PERSISTENT, TOK>(p, sf, pdl, stream);
  return one_block ? LaunchTma<false, 1, BW, PERSISTENT, TOK>(p, sf, pdl, stream)
                   : LaunchTma<false, 2, BW, PERSISTENT, TOK>(p, sf, pdl, stream);
}

// W4A16WgmmaWs<GATED, OutT, TOK, NC, NB>: the tensor maps of the blocked weights as [E * N / 16 fragments, a
// fragment's blocks] of 32-bit words, boxes of one 128-K block of a copy's fragments; of `a`
// when it is not gathered. persistent: min(work items, SMs) CTAs, each walking the items
// gridDim.x apart (else a CTA per item).
template <bool GATED, typename OutT, int TOK, int NC, int NB = 2>
std::string LaunchWs(GemmParams p, bool persistent, bool pdl, cudaStream_t stream) {
  constexpr auto kernel = W4A16WgmmaWs<GATED, OutT, TOK, NC, NB>;
  using Shape = WsShape<NC, NB>;
  // (gated with one block a warpgroup: half copies of the gate and of the up rows)
  constexpr int kWsSmemBytes = WsSmem<TOK, NC, NB>::kBytes, kFrags = Shape::kCopyFrags / (GATED && NB == 1 ? 2 : 1);
  // (96-row buffers: at most an item per tile, whose count the kernel finds)
  const int64_t frags = p.E * p.N / kBlockRows,
                items = p.P / (TOK == 96 ? p.tile_m : TOK) * CeilDiv<int64_t>(p.n_out, WsFeatures<GATED, NC, NB>());
  if (items > 0x7FFFFFFF || frags > 0x7FFFFFFF) return "too many row tiles or weight rows";
  CUtensorMap codes, scales, amap{};
  const uint64_t code_row = uint64_t(kBlockRows) * (p.K / 2), scale_row = uint64_t(kBlockRows) * (p.K / 16);
  if (std::string err = Encode2d(&codes, CU_TENSOR_MAP_DATA_TYPE_UINT32, p.w, code_row / 4, uint64_t(frags), code_row,
                                 kBlockRows * kBlockCodeBytes / 4, kFrags, CU_TENSOR_MAP_SWIZZLE_NONE);
      !err.empty())
    return err;
  if (std::string err = Encode2d(&scales, CU_TENSOR_MAP_DATA_TYPE_UINT32, p.ws, scale_row / 4, uint64_t(frags),
                                 scale_row, kBlockRows * kBlockScaleBytes / 4, kFrags, CU_TENSOR_MAP_SWIZZLE_NONE);
      !err.empty())
    return err;
  if (!p.gather)
    if (std::string err = EncodeActivationMap(p, TOK, &amap); !err.empty()) return err;
  if (std::string err = OptInSmem<kernel>(kWsSmemBytes); !err.empty()) return err;
  // A kernel launched with fewer registers than WsShape assumes would hang in setmaxnreg: an error instead.
  if (const int regs = LaunchRegisters<kernel>(); regs < Shape::kLaunchRegs)
    return "the warp-specialized kernel launches with " + std::to_string(regs) + " registers a thread (0: unknown), " +
           "fewer than its register budgets assume (" + std::to_string(Shape::kLaunchRegs) + ")";
  const int sms = CachedDeviceAttribute<cudaDevAttrMultiProcessorCount>();
  const int64_t ctas = persistent && sms > 0 ? std::min<int64_t>(items, sms) : items;
  LaunchKernel(kernel, dim3(unsigned(ctas)), Shape::kThreads, kWsSmemBytes, stream, pdl, p, codes, scales, amap);
  return "";
}

// The chunk-ordered-`a` kernels on TOK-row tiles: the warp-specialized one where WarpSpecializedGemm
// says so, else the TMA-fed one (the handler checked: bf16 out, not gathered).
template <int TOK>
std::string LaunchChunkA(const GemmParams& p, bool gated, bool f32_out, int64_t kernel_flags, cudaStream_t stream) {
  const bool pdl = kernel_flags & int64_t(KernelFlag::kPdl);
  if (WarpSpecializedGemm(kernel_flags, p.pairing, p.gather)) {
    const bool persistent = !(kernel_flags & int64_t(KernelFlag::kNoPersistent));
    // kRows96: 96-row buffers over the tiles' groups: gated gathered (moe's GEMM1, bf16 or fp32 out), or
    // non-gated, not gathered, bf16 out with staged stores (its GEMM2).
    if (kernel_flags & int64_t(KernelFlag::kRows96) && p.E <= kMaxAlignExperts) {
      if (gated && p.gather)
        return f32_out ? LaunchWs<true, float, 96, 4, 1>(p, persistent, pdl, stream)
                       : LaunchWs<true, uint16_t, 96, 4, 1>(p, persistent, pdl, stream);
      if (!gated && !f32_out && !p.gather && StagedStores(p))
        return LaunchWs<false, uint16_t, 96, 4, 1>(p, persistent, pdl, stream);
    }
    // fp32 out: mode w4a4's GEMM1, whose intermediate is quantized from unrounded values.
    if constexpr (TOK == 32) {
      if (gated && !(kernel_flags & int64_t(KernelFlag::kWsThreeGroups)))
        return f32_out ? LaunchWs<true, float, 32, 4>(p, persistent, pdl, stream)
                       : LaunchWs<true, uint16_t, 32, 4>(p, persistent, pdl, stream);
      if (!gated && !f32_out && !(kernel_flags & int64_t(KernelFlag::kWsTwoBlocks)))
        return LaunchWs<false, uint16_t, 32, 4, 1>(p, persistent, pdl, stream);
    } else {
      if (!gated && !f32_out && !p.gather && !(kernel_flags & int64_t(KernelFlag::kWsTwoBlocks)))
        return LaunchWs<false, uint16_t, 64, 4, 1>(p, persistent, pdl, stream);
    }
    return gated ? (f32_out ? LaunchWs<true, float, TOK, 3>(p, persistent, pdl, stream)
                            : LaunchWs<true, uint16_t, TOK, 3>(p, persistent, pdl, stream))
                 : (f32_out ? LaunchWs<false, float, TOK, 3>(p, persistent, pdl, stream)
                            : LaunchWs<false, uint16_t, TOK, 3>(p, persistent, pdl, stream));
  }
  const bool one_block = !(kernel_flags & int64_t(KernelFlag::kWgmmaTwoBlocks));
  const bool sf = !(kernel_flags & int64_t(KernelFlag::kRowTilesFirst));
  const bool bw = p.pairing & int32_t(Pairing::kBlockedW), persistent = kernel_flags & int64_t(KernelFlag::kTmaPersistent);
  return bw ? (persistent ? LaunchTmaFor<true, true, TOK>(p, gated, one_block, sf, pdl, stream)
                          : LaunchTmaFor<true, false, TOK>(p, gated, one_block, sf, pdl, stream))
            : (persistent ? LaunchTmaFor<false, true, TOK>(p, gated, one_block, sf, pdl, stream)
                          : LaunchTmaFor<false, false, TOK>(p, gated, one_block, sf, pdl, stream));
}

}  // namespace

bool LaunchWgmmaGemm(const GemmParams& p, int64_t tile_m, bool gated, bool f32_out, int64_t kernel_flags,
                     cudaStream_t stream, std::string* error) {
#ifdef JAX_NVFP4_HAS_SM90A
  const bool chunk_a = p.pairing & int32_t(Pairing::kChunkA);
  if (CachedDeviceAttribute<cudaDevAttrComputeCapabilityMajor>() != 9 || p.P % tile_m != 0 ||
      !(tile_m == 64 || (tile_m == 32 && chunk_a)))
    return false;
  if (chunk_a) {
    *error = tile_m == 64 ? LaunchChunkA<64>(p, gated, f32_out, kernel_flags, stream)
                          : LaunchChunkA<32>(p, gated, f32_out, kernel_flags, stream);
    return true;
  }
  const bool one_block = !(kernel_flags & int64_t(KernelFlag::kWgmmaTwoBlocks));
  const bool sf = !(kernel_flags & int64_t(KernelFlag::kRowTilesFirst)), pdl = kernel_flags & int64_t(KernelFlag::kPdl);
  p.pairing & int32_t(Pairing::kBlockedW) ? LaunchFor<true>(p, gated, f32_out, one_block, sf, pdl, stream)
                                          : LaunchFor<false>(p, gated, f32_out, one_block, sf, pdl, stream);
  return true;
#else
  (void)p, (void)tile_m, (void)gated, (void)f32_out, (void)kernel_flags, (void)stream, (void)error;
  (void)CachedDeviceAttribute<cudaDevAttrComputeCapabilityMajor>, (void)LaunchChunkA<64>, (void)LaunchChunkA<32>;
  return false;
#endif
}

}  // namespace jax_nvfp4
