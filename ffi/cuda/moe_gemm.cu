// grouped_gemm on the GPU: bf16 rows x NVFP4 expert weights (W4A16), tensor cores, for the
// tile-padded row groups that moe_align produced. Same function as ffi/moe_gemm.cc.
//
// Structure (chosen so that decode streams weights from all SMs and prefill reuses them):
// - "Swap AB": the weights are the MMA's A operand (16 output features per m16n8k16) and the
//   tokens its B operand (8 tokens per fragment), so a decode tile is 8 rows, not 16 or 64.
// - Grid = (token tiles, 64-feature slabs): every CTA of 4 warps owns 64 output features (a
//   gated GEMM1 loads the matching 64 gate rows and 64 up rows, so the activation is fused
//   in the epilogue) for one tile of tile_m sorted rows of one expert. At decode each expert
//   has one 8-row tile and the N dimension alone gives N/64 CTAs per expert.
// - Weights go straight from global memory into registers with 16-byte loads (each thread
//   reads 32 consecutive K of a row: 16 bytes of codes + 2 scale bytes), prefetched one
//   128-K chunk ahead; no shared memory, no bf16 weights in memory.
// - The MMA's K order is permuted so that the 16-byte load *is* the fragment: in step s of
//   a chunk, thread t's logical k {2t, 2t+1, 2t+8, 2t+9} are actual k kc + 32t + 4s + {0..3}.
//   The activations (B) are read with the same permutation (8 contiguous bytes per step), so
//   the dot product is unchanged and no repacking of the checkpoint layout is needed.
// - Decode in registers: 4 E2M1 codes -> 2 bf16x2 by byte permutes (DecodeE2M1x4), times the
//   block's E4M3 scale as bf16x2 (exact: e2m1 * e4m3 has <= 6 significant bits). The global
//   scale and the row scale are applied to the fp32 accumulators in the epilogue.
// - Every tile edge is guarded: tiles with expert -1 exit, padding rows (sorted_ids -1) read
//   no activations and store zeros, rows are bounds-checked against a's row count.
// - Deterministic: fixed K order per output element, no atomics, no split-K.
#include <cuda_bf16.h>

#include "cuda/cuda_util.h"
#include "moe_common.h"
#include "moe_handlers.h"

namespace jax_nvfp4 {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kWarpFeatures = 16;                      // one m16 fragment of weight rows per warp
constexpr int kCtaFeatures = kWarps * kWarpFeatures;   // 64 output features per CTA

struct GemmParams {
  const uint16_t* a;          // [a_rows, K] bf16
  const uint8_t* w;           // [E, N, K/2] E2M1 pairs
  const uint8_t* ws;          // [E, N, K/16] E4M3 bits
  const float* alpha;         // [E]
  const int32_t* sorted_ids;  // [P]
  const int32_t* tile_expert; // [P / tile_m]
  const float* row_scale;     // [row_scale_n]
  void* out;                  // [P, n_out] bf16 or fp32
  int64_t a_rows, K, N, n_out, E, P, row_scale_n;
  int32_t top_k, gather, activation, row_scale_mode;
};

__device__ __forceinline__ void Mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// a * b for bf16x2 (as fma with -0 so that it also assembles for sm_80-class PTX).
__device__ __forceinline__ uint32_t MulBf16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
  return d;
}

// E4M3 byte -> {s, s} as bf16x2 (exact: E4M3 has 3 mantissa bits).
__device__ __forceinline__ uint32_t ScaleBf16x2(uint32_t byte) {
  const uint32_t hi = __float_as_uint(E4M3ToFloat(uint8_t(byte))) >> 16;
  return hi | (hi << 16);
}

// One chunk of CH = 128 (or 64 for the K tail) along K for this thread's weight rows:
// CH/8 bytes of codes and CH/64 scale bytes per row.
template <int CH, int NF>
struct WeightRegs {
  uint32_t q[NF][2][4];
  uint32_t s[NF][2];  // scale bytes: byte 0 for the first 16 K of the thread's span, byte 1 next

  __device__ __forceinline__ void Load(const uint8_t* const (&wrow)[NF][2], const uint8_t* const (&srow)[NF][2],
                                       int64_t kc, int t) {
#pragma unroll
    for (int j = 0; j < NF; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if constexpr (CH == 128) {
          const uint4 v = __ldg(reinterpret_cast<const uint4*>(wrow[j][h] + kc / 2 + 16 * t));
          q[j][h][0] = v.x;
          q[j][h][1] = v.y;
          q[j][h][2] = v.z;
          q[j][h][3] = v.w;
          s[j][h] = __ldg(reinterpret_cast<const unsigned short*>(srow[j][h] + kc / 16 + 2 * t));
        } else {
          const uint2 v = __ldg(reinterpret_cast<const uint2*>(wrow[j][h] + kc / 2 + 8 * t));
          q[j][h][0] = v.x;
          q[j][h][1] = v.y;
          q[j][h][2] = 0;
          q[j][h][3] = 0;
          s[j][h] = __ldg(srow[j][h] + kc / 16 + t);
        }
      }
    }
  }
};

// Multiply one chunk: thread t's span is K [kc + t*CH/4, kc + (t+1)*CH/4); piece p (16 bytes of
// activations = 8 K) feeds two MMA steps.
template <int CH, int NF, int FM>
__device__ __forceinline__ void ComputeChunk(const WeightRegs<CH, NF>& w, const uint16_t* const (&arow)[FM],
                                             int64_t kc, int t, float (&acc)[NF][FM][4]) {
  constexpr int kSpan = CH / 4;
  constexpr int kPieces = kSpan / 8;
  uint32_t scale[NF][2][2];
#pragma unroll
  for (int j = 0; j < NF; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      scale[j][h][0] = ScaleBf16x2(w.s[j][h] & 0xFF);
      scale[j][h][1] = ScaleBf16x2((w.s[j][h] >> 8) & 0xFF);
    }
#pragma unroll
  for (int p = 0; p < kPieces; ++p) {
    uint4 x[FM];
#pragma unroll
    for (int m = 0; m < FM; ++m) {
      x[m] = arow[m] ? __ldg(reinterpret_cast<const uint4*>(arow[m] + kc + kSpan * t + 8 * p))
                     : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      uint32_t a[NF][4];
#pragma unroll
      for (int j = 0; j < NF; ++j) {
        uint32_t lo, hi;
        DecodeE2M1x4((w.q[j][0][p] >> (16 * half)) & 0xFFFFu, &lo, &hi);  // row g
        a[j][0] = MulBf16x2(lo, scale[j][0][p / 2]);
        a[j][2] = MulBf16x2(hi, scale[j][0][p / 2]);
        DecodeE2M1x4((w.q[j][1][p] >> (16 * half)) & 0xFFFFu, &lo, &hi);  // row g + 8
        a[j][1] = MulBf16x2(lo, scale[j][1][p / 2]);
        a[j][3] = MulBf16x2(hi, scale[j][1][p / 2]);
      }
#pragma unroll
      for (int m = 0; m < FM; ++m) {
        const uint32_t b0 = half ? x[m].z : x[m].x;
        const uint32_t b1 = half ? x[m].w : x[m].y;
#pragma unroll
        for (int j = 0; j < NF; ++j) Mma16816(acc[j][m], a[j], b0, b1);
      }
    }
  }
}

// Source row of a for sorted row r, or -1 (padding / out of range).
__device__ __forceinline__ int64_t SourceRow(const GemmParams& p, int64_t r) {
  const int32_t pair = p.sorted_ids[r];
  if (pair < 0) return -1;
  const int64_t src = p.gather ? int64_t(pair) / p.top_k : r;
  return src < p.a_rows ? src : -1;
}

__device__ __forceinline__ void Store(uint16_t* out, int64_t i, float v) {
  out[i] = __bfloat16_as_ushort(__float2bfloat16_rn(v));
}
__device__ __forceinline__ void Store(float* out, int64_t i, float v) { out[i] = v; }

template <int FM, bool GATED, typename OutT>
__global__ void __launch_bounds__(kThreads) W4A16GroupedGemmKernel(const GemmParams p) {
  constexpr int BM = FM * 8;
  constexpr int NF = GATED ? 2 : 1;  // weight fragments per warp: [gate, up] or [h]
  const int64_t tile = blockIdx.x;
  const int32_t e = p.tile_expert[tile];
  if (e < 0 || e >= p.E) return;  // unused tile
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int64_t feat0 = int64_t(blockIdx.y) * kCtaFeatures + warp * kWarpFeatures;
  if (feat0 >= p.n_out) return;  // no __syncthreads in this kernel: warps may leave early
  const int64_t K = p.K;

  const uint8_t* wrow[NF][2];
  const uint8_t* srow[NF][2];
#pragma unroll
  for (int j = 0; j < NF; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t row = int64_t(e) * p.N + feat0 + g + 8 * h + (j == 1 ? p.n_out : 0);
      wrow[j][h] = p.w + row * (K / 2);
      srow[j][h] = p.ws + row * (K / 16);
    }
  const uint16_t* arow[FM];
#pragma unroll
  for (int m = 0; m < FM; ++m) {
    const int64_t src = SourceRow(p, tile * BM + 8 * m + g);
    arow[m] = src >= 0 ? p.a + src * K : nullptr;
  }

  float acc[NF][FM][4];
#pragma unroll
  for (int j = 0; j < NF; ++j)
#pragma unroll
    for (int m = 0; m < FM; ++m)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[j][m][i] = 0.0f;

  // Main loop: 128-K chunks, the next chunk's weights in flight while this one multiplies.
  int64_t kc = 0;
  if (K >= 128) {
    WeightRegs<128, NF> cur;
    cur.Load(wrow, srow, 0, t);
    for (; kc + 128 <= K; kc += 128) {
      WeightRegs<128, NF> next;
      const bool more = kc + 256 <= K;
      if (more) next.Load(wrow, srow, kc + 128, t);
      ComputeChunk<128, NF, FM>(cur, arow, kc, t, acc);
      if (more) cur = next;
    }
  }
  if (kc < K) {  // K % 128 == 64
    WeightRegs<64, NF> tail;
    tail.Load(wrow, srow, kc, t);
    ComputeChunk<64, NF, FM>(tail, arow, kc, t, acc);
  }

  // Epilogue: thread holds features feat0 + g + 8h for sorted rows tile*BM + 8m + 2t + c.
  const float alpha = p.alpha[e];
#pragma unroll
  for (int m = 0; m < FM; ++m) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int64_t r = tile * BM + 8 * m + 2 * t + c;
      const bool valid = SourceRow(p, r) >= 0;
      float scale = alpha;
      if (valid && p.row_scale_mode != int32_t(RowScale::kNone)) {
        const int64_t pair = p.sorted_ids[r];
        const int64_t idx = p.row_scale_mode == int32_t(RowScale::kToken)  ? pair / p.top_k
                            : p.row_scale_mode == int32_t(RowScale::kPair) ? pair
                                                                           : r;
        scale *= idx < p.row_scale_n ? p.row_scale[idx] : 0.0f;
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int i = 2 * h + c;
        float v = 0.0f;
        if (valid) {
          const float gate = acc[0][m][i] * scale;
          const float up = GATED ? acc[NF - 1][m][i] * scale : 0.0f;
          v = ApplyActivation(p.activation, gate, up);
        }
        Store(static_cast<OutT*>(p.out), r * p.n_out + feat0 + g + 8 * h, v);
      }
    }
  }
}

template <bool GATED, typename OutT>
void Launch(const GemmParams& p, int64_t tile_m, dim3 grid, cudaStream_t stream) {
  switch (tile_m) {
    case 8: W4A16GroupedGemmKernel<1, GATED, OutT><<<grid, kThreads, 0, stream>>>(p); break;
    case 16: W4A16GroupedGemmKernel<2, GATED, OutT><<<grid, kThreads, 0, stream>>>(p); break;
    case 32: W4A16GroupedGemmKernel<4, GATED, OutT><<<grid, kThreads, 0, stream>>>(p); break;
    default: W4A16GroupedGemmKernel<8, GATED, OutT><<<grid, kThreads, 0, stream>>>(p); break;
  }
}

ffi::Error GroupedGemmCudaImpl(cudaStream_t stream, ffi::Buffer<ffi::BF16> a, ffi::Buffer<ffi::U8> w_data,
                               ffi::Buffer<ffi::U8> w_scales, ffi::Buffer<ffi::F32> alpha,
                               ffi::Buffer<ffi::S32> sorted_ids, ffi::Buffer<ffi::S32> tile_expert,
                               ffi::Buffer<ffi::F32> row_scale, ffi::Result<ffi::AnyBuffer> out,
                               int64_t activation, int64_t row_scale_mode, int64_t top_k, int64_t gather,
                               int64_t tile_m) {
  GemmDims d;
  if (auto err = CheckGemm("grouped_gemm", a, w_data, w_scales, alpha, sorted_ids, tile_expert, row_scale,
                           *out, activation, row_scale_mode, top_k, gather, tile_m, kCudaKMultiple,
                           kCudaNMultiple, &d);
      err.failure())
    return err;
  if (d.tiles == 0 || d.n_out == 0) return ffi::Error::Success();
  const int64_t slabs = CeilDiv<int64_t>(d.n_out, kCtaFeatures);
  if (d.tiles > 0x7FFFFFFF || slabs > 65535)
    return Invalid("grouped_gemm", "too many row tiles or output features for the grid");
  GemmParams p;
  p.a = a.typed_data();
  p.w = w_data.typed_data();
  p.ws = w_scales.typed_data();
  p.alpha = alpha.typed_data();
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
  const dim3 grid(unsigned(d.tiles), unsigned(slabs));
  const bool f32_out = out->element_type() == ffi::DataType::F32;
  if (IsGated(activation)) {
    f32_out ? Launch<true, float>(p, tile_m, grid, stream) : Launch<true, uint16_t>(p, tile_m, grid, stream);
  } else {
    f32_out ? Launch<false, float>(p, tile_m, grid, stream) : Launch<false, uint16_t>(p, tile_m, grid, stream);
  }
  return LaunchError("grouped_gemm");
}

}  // namespace
}  // namespace jax_nvfp4

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxNvfp4GroupedGemmCuda, jax_nvfp4::GroupedGemmCudaImpl,
                              jax_nvfp4::sig::GroupedGemm(xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
                              {xla::ffi::Traits::kCmdBufferCompatible});
