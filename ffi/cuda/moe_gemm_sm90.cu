// grouped_gemm for 64- and 128-row tiles (prefill) on sm_90a: the same function as moe_gemm.cu,
// on warpgroup MMAs (wgmma) instead of mma.sync.
//
// - A CTA is two warpgroups (8 warps) and owns one BN-row tile of one expert (BN = tile_m, 64 or
//   128 tokens: the wgmma's N). Each warpgroup multiplies 64-row weight blocks (the wgmma's M):
//   BN = 64: gated, the gate and the up rows of 64 features (128 features per CTA); otherwise one
//   block of 64 features (KernelFlag kWgmmaTwoBlocks: two; slower on the H200, 2026-12-01).
//   BN = 128 (twice the tokens per decoded weight; the accumulators of two blocks would not fit):
//   one block per warpgroup; gated, each warp's 16 rows are the gate rows (g) and the up rows
//   (g + 8) of 8 features, so a thread holds both halves of its outputs (32 features per
//   warpgroup, 64 per CTA); otherwise 64 features per warpgroup.
// - Weights (A) come from registers, as in the mma.sync kernel: each warp loads its 16 rows
//   with 16-byte loads one 128-K chunk ahead and decodes FP4 -> bf16 in registers (the
//   wgmma A-register fragment of a warp is the m16n8k16 A fragment). K is permuted the same
//   way: thread t's code word pp (actual k0..k7 at kc + span*t + 8pp, span = chunk / 4) gives
//   steps 2pp and 2pp + 1 their logical pairs {2t, 2t+1}, {2t+8, 2t+9} = {k0, k4}, {k1, k5}
//   and {k2, k6}, {k3, k7}.
// - Activations (B) are staged in shared memory, BN rows x 128 K per chunk, double
//   buffered, in the wgmma K-major 128-byte-swizzle layout *with the same permutation*: each
//   thread loads 16 bytes (8 actual k) of its rows and stores their four 4-byte k pairs at
//   their logical positions (conflict-free 4-byte stores). So the checkpoint layout needs no repack.
// - A warpgroup decodes the next piece's A words (two 16-K steps) while the previous
//   piece's wgmmas run (two register sets, wait_group 1); one __syncthreads per chunk hands
//   over the activation buffers.
// - The epilogue (global and row scales, activation, bf16/fp32 store) is the shared one.
// Only built for sm_90a (wgmma does not exist on sm_100); elsewhere LaunchWgmmaGemm returns
// false and the mma.sync kernel runs.
#include <atomic>

#include "cuda/cuda_util.h"
#include "cuda/gemm_common.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define JAX_NVFP4_WGMMA 1
#endif

namespace jax_nvfp4 {
namespace {

constexpr int kWgWarps = 8;                    // two warpgroups
constexpr int kWgThreadsPerCta = kWgWarps * 32;
// Shared memory of a BN-row tile: a panel is BN rows x 64 K bf16 (128-byte swizzle), a 128-K
// chunk two panels, double buffered, +1 KB to align to 1024.
template <int BN>
constexpr int PanelBytes() { return BN * 128; }
template <int BN>
constexpr int SmemBytes() { return 2 * 2 * PanelBytes<BN>() + 1024; }

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
__device__ __forceinline__ void Wgmma64x64(float (&d)[8][4], const uint32_t (&a)[4], uint64_t desc) {
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

// d[64 features x 128 rows] += a x B, as Wgmma64x64.
__device__ __forceinline__ void Wgmma64x128(float (&d)[16][4], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "{%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]),
        "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]),
        "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
        "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]),
        "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]),
        "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]),
        "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]),
        "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]),
        "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]),
        "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
__device__ __forceinline__ void Wgmma(float (&d)[8][4], const uint32_t (&a)[4], uint64_t desc) { Wgmma64x64(d, a, desc); }
__device__ __forceinline__ void Wgmma(float (&d)[16][4], const uint32_t (&a)[4], uint64_t desc) { Wgmma64x128(d, a, desc); }

// This thread's share of the activation chunk for one of its rows n (8 * warp + g, and + 64 in
// 128-row tiles) of the tile: span t, pieces pp < CH / 32 (16 bytes each).
struct ActivationRegs {
  uint4 v[4];

  __device__ __forceinline__ void Load(const uint16_t* row, int64_t kc, int ch, int t) {
#pragma unroll
    for (int pp = 0; pp < 4; ++pp) {
      if (pp < ch / 32)
        v[pp] = row ? __ldg(reinterpret_cast<const uint4*>(row + kc + (ch / 4) * t + 8 * pp))
                    : make_uint4(0, 0, 0, 0);
    }
  }

  // Piece pp's k pairs i = 0..3 ({x0, x4}, {x1, x5}, {x2, x6}, {x3, x7}: PairActivations) go
  // to logical k L = 32pp + 2t + 8i: panel L / 64, 16-byte chunk (L % 64) / 8 swizzled with the
  // row (^ n % 8), byte 4t inside it.
  template <int BN>
  __device__ __forceinline__ void Store(uint8_t* buf, int ch, int n, int t, bool paired) const {
#pragma unroll
    for (int pp = 0; pp < 4; ++pp) {
      if (pp < ch / 32) {
        uint32_t w[4] = {v[pp].x, v[pp].y, v[pp].z, v[pp].w};  // a paired piece as it is
        if (!paired) PairActivations(v[pp], w);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int c = 4 * pp + i;  // logical 16-byte chunk index within the 128-K chunk
          uint8_t* dst = buf + (c >> 3) * PanelBytes<BN>() + n * 128 + (((c & 7) ^ (n & 7)) << 4) + 4 * t;
          *reinterpret_cast<uint32_t*>(dst) = w[i];
        }
      }
    }
  }
};

// One chunk (CH = 128 or the 64 tail) of MMAs from registers w and the staged buffer at
// `buf` (shared address). A piece (one code word per row) is two 16-K steps; its decoded A
// words are double buffered across pieces, so piece pp + 1 decodes while pp multiplies.
// Ends with every wgmma of the chunk complete.
template <int CH, int NF, int BN>
__device__ __forceinline__ void ChunkMma(const WeightRegs<CH, NF>& w, uint32_t buf, float (&acc)[NF][BN / 8][4]) {
  constexpr int kPieces = CH / 32;
  uint32_t scale[NF][2][2];
  w.BlockScales(scale);
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
      for (int h = 0; h < 2; ++h) DecodeScaled(w.q[j][h][pp], scale[j][h][pp / 2], a[b][j][h]);
    WgmmaFence();
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int s = 2 * pp + half;  // 16-K step
      const uint64_t desc = SmemDesc(buf + (s >> 2) * PanelBytes<BN>() + (s & 3) * 32);
#pragma unroll
      for (int j = 0; j < NF; ++j) {
        uint32_t frag[4];
        AFragment(a[b][j], half, frag);
        Wgmma(acc[j], frag, desc);
      }
    }
    WgmmaCommit();
  }
  WgmmaWait<0>();
  Hold(a[0]);
  Hold(a[1]);
}
#endif  // JAX_NVFP4_WGMMA

// The layout of a CTA's output features. BN = 64: 64 per warpgroup and weight block (gated: a
// gate and an up block of the same 64 features; otherwise NB blocks of 64). BN = 128 (NB = 1):
// one 64-row block per warpgroup, gated as gate/up rows of 32 features (GU).
template <bool GATED, int NB, int BN>
struct WgmmaTiling {
  static_assert(BN == 64 || (BN == 128 && NB == 1), "128-row tiles: one weight block per warpgroup");
  static constexpr bool kGateUp = GATED && BN == 128;
  static constexpr int kBlocks = GATED ? (kGateUp ? 1 : 2) : NB;  // weight blocks per warpgroup
  static constexpr int kWarpFeatures = kGateUp ? 8 : 16;         // features of a warp per block
  static constexpr int kWgFeatures = kGateUp ? 32 : GATED ? 64 : 64 * NB;
  static constexpr int kCtaFeatures = 2 * kWgFeatures;
};

template <bool GATED, int NB, int BN, typename OutT>
__global__ void __launch_bounds__(kWgThreadsPerCta, 1) W4A16WgmmaKernel(const GemmParams p) {
#ifdef JAX_NVFP4_WGMMA
  using Tiling = WgmmaTiling<GATED, NB, BN>;
  constexpr int NF = Tiling::kBlocks;
  constexpr bool GU = Tiling::kGateUp;
  constexpr int kChunkBytes = 2 * PanelBytes<BN>();
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = SmemU32(smem_raw);
  uint8_t* smem = smem_raw + (((raw + 1023) & ~1023u) - raw);  // 1024-aligned (swizzle atoms)
  const uint32_t smem_addr = SmemU32(smem);

  GridDependencyWait();
  // slabs_first (the default): a 1-D grid where consecutive CTAs take the slabs of one row tile
  // (a wave shares its activation tiles in L2, and an expert's weights across its row tiles).
  // Otherwise (kRowTilesFirst, or a grid too large for 1-D): x = row tile, y = feature slab (a
  // wave of CTAs shares a slab of several experts' weights).
  int64_t tile = blockIdx.x, slab = blockIdx.y;
  if (p.slabs_first) {
    const int64_t slabs = CeilDiv<int64_t>(p.n_out, Tiling::kCtaFeatures);
    tile = blockIdx.x / slabs;
    slab = blockIdx.x % slabs;
  }
  const int32_t e = TileExpert(p, tile, BN);
  if (e < 0 || e >= p.E) return;  // unused tile (uniform over the CTA)
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int wg = warp >> 2, wq = warp & 3;
  // Features of block j of this warp: gated: feat[0] (gate rows feat, up rows n_out + feat;
  // GU: gate rows g, up rows g + 8); else feat[j] = base + 64j.
  const int64_t base = slab * Tiling::kCtaFeatures + wg * Tiling::kWgFeatures + wq * Tiling::kWarpFeatures;
  int64_t feat[NF];
  bool active[NF];  // blocks past n_out take part in the warpgroup MMAs (any in-bounds rows), not the stores
  const int64_t K = p.K;
  const uint8_t* wrow[NF][2];
  const uint8_t* srow[NF][2];
#pragma unroll
  for (int j = 0; j < NF; ++j) {
    feat[j] = GATED ? base : base + 64 * j;
    active[j] = feat[j] < p.n_out;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t f = GU ? feat[j] + g + (h ? p.n_out : 0)
                           : feat[j] + g + 8 * h + (GATED && j == 1 ? p.n_out : 0);
      const int64_t row = int64_t(e) * p.N + (active[j] ? f : 0);
      wrow[j][h] = p.w + row * (K / 2);
      srow[j][h] = p.ws + row * (K / 16);
    }
  }
  constexpr int R = BN / 64;  // activation rows per thread: n = 8 * warp + g + 64 r
  const uint16_t* xrow[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int64_t src = SourceRow(p, tile * BN + 8 * warp + g + 64 * r);
    xrow[r] = src >= 0 ? p.a + src * K : nullptr;
  }
  const bool paired = p.pairing & int32_t(Pairing::kA);

  float acc[NF][BN / 8][4];
#pragma unroll
  for (int j = 0; j < NF; ++j)
#pragma unroll
    for (int m = 0; m < BN / 8; ++m)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[j][m][i] = 0.0f;

  const int64_t full = K / 128;
  const bool tail = K % 128 != 0;
  const int64_t chunks = full + (tail ? 1 : 0);
  ActivationRegs x[R];
  auto stage = [&](uint8_t* buf, int ch) {  // this thread's activation pieces -> buf
#pragma unroll
    for (int r = 0; r < R; ++r) x[r].template Store<BN>(buf, ch, 8 * warp + g + 64 * r, t, paired);
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // generic stores -> wgmma reads
  };
#pragma unroll
  for (int r = 0; r < R; ++r) x[r].Load(xrow[r], 0, full ? 128 : 64, t);
  stage(smem, full ? 128 : 64);
  WeightRegs<128, NF> cur;
  if (full) cur.Load(wrow, srow, 0, t);
  __syncthreads();

  for (int64_t c = 0; c < full; ++c) {
    const int64_t kc = c * 128;
    const bool more = c + 1 < chunks, wmore = c + 1 < full;
    const int next_ch = wmore ? 128 : 64;
    if (more) {
#pragma unroll
      for (int r = 0; r < R; ++r) x[r].Load(xrow[r], kc + 128, next_ch, t);
    }
    WeightRegs<128, NF> next;
    if (wmore) next.Load(wrow, srow, kc + 128, t);
    ChunkMma<128, NF, BN>(cur, smem_addr + uint32_t(c & 1) * kChunkBytes, acc);
    // The other buffer was last read by chunk c - 1, complete before the last barrier.
    if (more) stage(smem + (~c & 1) * kChunkBytes, next_ch);
    __syncthreads();
    if (wmore) cur = next;
  }
  if (tail) {
    WeightRegs<64, NF> w;
    w.Load(wrow, srow, full * 128, t);
    ChunkMma<64, NF, BN>(w, smem_addr + uint32_t(full & 1) * kChunkBytes, acc);
  }
  Hold(acc);
  if constexpr (GATED) {
    if (active[0]) Epilogue<BN / 8, NF, true, OutT, GU>(p, e, tile, feat[0], acc);
  } else {
#pragma unroll
    for (int j = 0; j < NF; ++j)
      if (active[j])
        Epilogue<BN / 8, 1, false, OutT>(p, e, tile, feat[j],
                                         reinterpret_cast<const float(&)[1][BN / 8][4]>(acc[j]));
  }
#endif
}

template <bool GATED, int NB, int BN, typename OutT>
void Launch(GemmParams p, bool slabs_first, bool pdl, cudaStream_t stream) {
  const auto kernel = W4A16WgmmaKernel<GATED, NB, BN, OutT>;
  constexpr int smem = SmemBytes<BN>();
  // Above 48 KB the kernel must opt in (a function attribute, not a stream operation: allowed
  // while XLA captures a CUDA graph; set at every launch, as the device may differ).
  if (smem > 48 * 1024 && cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess)
    return;  // the error stays for LaunchError
  const int64_t tiles = p.P / BN, slabs = CeilDiv<int64_t>(p.n_out, WgmmaTiling<GATED, NB, BN>::kCtaFeatures);
  p.slabs_first = slabs_first && tiles * slabs <= 0x7FFFFFFF;  // else the 2-D grid (x up to 2^31 - 1)
  const dim3 grid = p.slabs_first ? dim3(unsigned(tiles * slabs)) : dim3(unsigned(tiles), unsigned(slabs));
  LaunchKernel(kernel, grid, kWgThreadsPerCta, smem, stream, pdl, p);
}

template <bool GATED, int NB, int BN>
void LaunchOut(const GemmParams& p, bool f32_out, bool slabs_first, bool pdl, cudaStream_t stream) {
  f32_out ? Launch<GATED, NB, BN, float>(p, slabs_first, pdl, stream)
          : Launch<GATED, NB, BN, uint16_t>(p, slabs_first, pdl, stream);
}

// Compute capability major of the current device, cached per device (no stream operation,
// so it is safe while XLA captures a CUDA graph).
int DeviceMajor() {
  static std::atomic<int> cache[64];
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return 0;
  int v = cache[dev].load(std::memory_order_relaxed);
  if (v == 0) {
    if (cudaDeviceGetAttribute(&v, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) return 0;
    cache[dev].store(v, std::memory_order_relaxed);
  }
  return v;
}

}  // namespace

bool LaunchWgmmaGemm(const GemmParams& p, bool gated, bool f32_out, int64_t kernel_flags, cudaStream_t stream) {
#ifdef JAX_NVFP4_HAS_SM90A
  if (DeviceMajor() != 9 || (p.tile_m != 64 && p.tile_m != 128) || p.P % p.tile_m != 0) return false;
  const bool two_blocks = kernel_flags & int64_t(KernelFlag::kWgmmaTwoBlocks);
  const bool sf = !(kernel_flags & int64_t(KernelFlag::kRowTilesFirst)), pdl = kernel_flags & int64_t(KernelFlag::kPdl);
  if (p.tile_m == 128) {  // kWgmmaTwoBlocks does not apply (the accumulators would not fit)
    gated ? LaunchOut<true, 1, 128>(p, f32_out, sf, pdl, stream) : LaunchOut<false, 1, 128>(p, f32_out, sf, pdl, stream);
  } else if (gated) {
    LaunchOut<true, 2, 64>(p, f32_out, sf, pdl, stream);
  } else {
    two_blocks ? LaunchOut<false, 2, 64>(p, f32_out, sf, pdl, stream) : LaunchOut<false, 1, 64>(p, f32_out, sf, pdl, stream);
  }
  return true;
#else
  (void)p, (void)gated, (void)f32_out, (void)kernel_flags, (void)stream, (void)DeviceMajor;
  return false;
#endif
}

}  // namespace jax_nvfp4
