// quant_dequant_rows on the GPU (see quant_rows.cc for the contract; arithmetic in
// nvfp4_quant.h, shared with the CPU handler). ROW_THREADS threads own one row and hold its blocks in
// registers (rows over 4 blocks a thread are read twice): pass 1 reduces the row's abs-max, pass 2
// quantizes each 16-element block and writes its 16 decoded bf16 values with two 16-byte stores, or,
// in the chunk order (CHUNK), as eight pairs of values that sit side by side there. One launch, no
// atomics, no workspace. With input_scale (static scales) pass 1 is skipped; with repeat, x's row r / repeat.
#include <type_traits>

#include "cuda/align_one_warp.cuh"
#include "cuda/cuda_util.h"
#include "moe_common.h"
#include "moe_handlers.h"
#include "nvfp4_quant.h"

namespace jax_nvfp4 {
namespace {

constexpr int kQuantThreads = 128;
constexpr int kQuantWideThreads = 512;  // a CTA of decode's long rows (over 128 blocks, see WithQuantLaunch)

// Threads of a CTA whose rows have ROW_THREADS threads each: four warp rows, or one row.
template <int ROW_THREADS>
constexpr int QuantCtaThreads() { return ROW_THREADS < kQuantThreads ? kQuantThreads : ROW_THREADS; }

// 16 consecutive elements (32 or 64 bytes, 16-byte aligned: rows hold a multiple of 16).
__device__ __forceinline__ void LoadBlock(const uint16_t* p, float (&v)[16]) {
  const uint4* q = reinterpret_cast<const uint4*>(p);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const uint4 u = __ldg(q + h);
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[8 * h + 2 * i] = Bf16Lo(w[i]);
      v[8 * h + 2 * i + 1] = Bf16Hi(w[i]);
    }
  }
}

__device__ __forceinline__ void LoadBlock(const float* p, float (&v)[16]) {
  const float4* q = reinterpret_cast<const float4*>(p);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float4 f = __ldg(q + i);
    v[4 * i] = f.x;
    v[4 * i + 1] = f.y;
    v[4 * i + 2] = f.z;
    v[4 * i + 3] = f.w;
  }
}

// Quantizes the 16 values of block b (natural k 16b..16b+15) with the row's scales and stores
// their decoded bf16 values in out's row: two 16-byte stores, or in the chunk order (CHUNK), where
// natural 16b + i and 16b + i + 4 (i = 8h + q, q < 4) are neighbours, eight 4-byte ones.
template <bool CHUNK>
__device__ __forceinline__ void QuantStoreBlock(uint16_t* orow, int64_t b, const float (&v)[16],
                                                const quant::RowScales& rs) {
  uint32_t vmax = 0;
#pragma unroll
  for (int i = 0; i < 16; ++i) vmax = max(vmax, quant::AbsBits(v[i]));
  const quant::BlockScale bs = quant::BlockScaleFromVmax(vmax, rs);
  float d[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) d[i] = quant::QuantDequant(v[i], bs);
  if constexpr (CHUNK) {
    uint32_t* o32 = reinterpret_cast<uint32_t*>(orow);
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int q = 0; q < 4; ++q) o32[ChunkPos(16 * b + 8 * h + q) / 2] = PackBf16x2(d[8 * h + q], d[8 * h + q + 4]);
  } else {
    uint32_t w[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) w[i] = PackBf16x2(d[2 * i], d[2 * i + 1]);
    uint4* o = reinterpret_cast<uint4*>(orow) + 2 * b;
    o[0] = make_uint4(w[0], w[1], w[2], w[3]);
    o[1] = make_uint4(w[4], w[5], w[6], w[7]);
  }
}

// Everything of a call but x (whose type is a template parameter).
struct QuantRowsArgs {
  const int32_t* row_ids;      // [R] or nullptr (every row used)
  const float* row_weights;    // [n_weights] or nullptr (see quant::WeightedScale)
  quant::StaticScales s_in;    // each row's static decode scale, or none (table nullptr: each row's own amax)
  int64_t repeat = 1;          // out rows per row of x: row r quantizes x's row r / repeat
  int64_t n_weights, R, K;
  uint16_t* out;
  float* scale;
};

// HELD > 0: each thread keeps its (at most HELD) blocks of the row in registers, so the row is read
// once, all its loads in flight together; HELD = 0: rows too long for that are read twice (abs-max,
// then quantize; the second read mostly from L1/L2).

// The rows of CTA `block` of the launch (ROW_THREADS threads a row).
template <typename T, int ROW_THREADS, int HELD, bool CHUNK>
__device__ __forceinline__ void QuantRowsOfBlock(const T* __restrict__ x, const QuantRowsArgs& a, int64_t block) {
  static_assert(ROW_THREADS == 32 || ROW_THREADS == kQuantThreads || ROW_THREADS == kQuantWideThreads,
                "a row is one warp or the whole CTA");
  constexpr int kWarpsPerRow = ROW_THREADS / 32;
  __shared__ uint32_t warp_amax[kWarpsPerRow];
  const int lane = threadIdx.x % ROW_THREADS;
  const int64_t r = block * (QuantCtaThreads<ROW_THREADS>() / ROW_THREADS) + threadIdx.x / ROW_THREADS;
  if (r >= a.R) return;  // uniform over the row's threads (a CTA-wide row always has r < R)
  const int64_t nb = a.K / 16;
  uint16_t* orow = a.out + r * a.K;
  const T* xr = x + r / a.repeat * a.K;
  // The row's loads, its id and its routing weight are issued together (x is read for unused rows
  // too, in bounds): behind the id's branch, the loads had waited on it, a second global latency.
  float held[HELD > 0 ? HELD : 1][16];
  if constexpr (HELD > 0) {
#pragma unroll
    for (int i = 0; i < HELD; ++i) {
      const int64_t b = lane + i * ROW_THREADS;
      if (b < nb) {
        LoadBlock(xr + 16 * b, held[i]);
      } else {
#pragma unroll
        for (int j = 0; j < 16; ++j) held[i][j] = 0.0f;
      }
    }
  }
  const int32_t id = a.row_ids != nullptr ? a.row_ids[r] : 0;
  if (id < 0) {  // unused row: zeros and scale 0
    uint4* o = reinterpret_cast<uint4*>(orow);
    for (int64_t b = lane; b < nb; b += ROW_THREADS) o[2 * b] = o[2 * b + 1] = make_uint4(0, 0, 0, 0);
    if (lane == 0) a.scale[r] = 0.0f;
    return;
  }
  const quant::RowWeight rw = quant::RowWeightOf(a.row_weights, a.n_weights, id);  // in flight with the row
  const float s_in = a.s_in.table != nullptr ? quant::StaticScaleOf(a.s_in, r) : 0.0f;
  quant::RowScales rs;
  if (a.s_in.table != nullptr) {  // a static scale: no abs-max pass (the launch's branch, uniform over every CTA)
    rs = quant::RowScalesFromInputScale(s_in);
  } else {
    uint32_t amax = 0;
    if constexpr (HELD > 0) {
#pragma unroll
      for (int i = 0; i < HELD; ++i)
#pragma unroll
        for (int j = 0; j < 16; ++j) amax = max(amax, quant::AbsBits(held[i][j]));
    } else {
      for (int64_t b = lane; b < nb; b += ROW_THREADS) {
        LoadBlock(xr + 16 * b, held[0]);
#pragma unroll
        for (int j = 0; j < 16; ++j) amax = max(amax, quant::AbsBits(held[0][j]));
      }
    }
    amax = __reduce_max_sync(0xFFFFFFFFu, amax);
    if constexpr (kWarpsPerRow > 1) {
      if (threadIdx.x % 32 == 0) warp_amax[threadIdx.x / 32] = amax;
      __syncthreads();
#pragma unroll
      for (int w = 0; w < kWarpsPerRow; ++w) amax = max(amax, warp_amax[w]);
    }
    rs = quant::RowScalesFromAmax(amax);
  }
  if (lane == 0) a.scale[r] = quant::Weighted(rs.stored, rw);
  if constexpr (HELD > 0) {
#pragma unroll
    for (int i = 0; i < HELD; ++i) {
      const int64_t b = lane + i * ROW_THREADS;
      if (b < nb) QuantStoreBlock<CHUNK>(orow, b, held[i], rs);
    }
  } else {
    for (int64_t b = lane; b < nb; b += ROW_THREADS) {
      LoadBlock(xr + 16 * b, held[0]);
      QuantStoreBlock<CHUNK>(orow, b, held[0], rs);
    }
  }
}

template <typename T, int ROW_THREADS, int HELD, bool CHUNK>
__global__ void __launch_bounds__(QuantCtaThreads<ROW_THREADS>()) QuantDequantRowsKernel(const T* __restrict__ x,
                                                                                        const QuantRowsArgs a) {
  GridDependencyWait();
  QuantRowsOfBlock<T, ROW_THREADS, HELD, CHUNK>(x, a, blockIdx.x);
}

// moe_align_quant: CTA 0 aligns the pairs (one warp; its other threads help fill sorted_ids and tile_expert),
// the others quantize x's rows, in one launch (at decode, two launches of a few microseconds each that
// did not depend on each other).
template <typename T, int ROW_THREADS, int HELD, bool CHUNK>
__global__ void __launch_bounds__(QuantCtaThreads<ROW_THREADS>()) AlignQuantKernel(const AlignArgs al,
                                                                                   const T* __restrict__ x,
                                                                                   const QuantRowsArgs a) {
  GridDependencyWait();
  if (blockIdx.x == 0) return AlignOneWarp(al);
  QuantRowsOfBlock<T, ROW_THREADS, HELD, CHUNK>(x, a, blockIdx.x - 1);
}

// Calls launch(kernel) with the quantize kernel's instance for x's rows (ROW_THREADS threads a row)
// holding the fewest of 1, 2, 4 blocks a thread that cover a row of nb blocks (each slot costs 16
// registers: with 4 for every row, prefill layers ran 1-2% slower on the H200, 2026-12-02), or 0 past 4
// (read twice); ALIGN: moe_align_quant's kernel.
template <bool ALIGN, typename T, int ROW_THREADS, int HELD, bool CHUNK>
constexpr auto RowsKernel() {
  if constexpr (ALIGN) return AlignQuantKernel<T, ROW_THREADS, HELD, CHUNK>;
  else return QuantDequantRowsKernel<T, ROW_THREADS, HELD, CHUNK>;
}
template <bool ALIGN, typename T, int ROW_THREADS, bool CHUNK, typename F>
void WithRowsKernel(int64_t K, F&& launch) {
  const int64_t per_thread = CeilDiv<int64_t>(K / 16, ROW_THREADS);
  if constexpr (ROW_THREADS >= kQuantThreads)  // (a warp's rows have at most 4 blocks a lane)
    if (per_thread > 4) return launch(RowsKernel<ALIGN, T, ROW_THREADS, 0, CHUNK>());
  if (per_thread <= 1) return launch(RowsKernel<ALIGN, T, ROW_THREADS, 1, CHUNK>());
  if (per_thread <= 2) return launch(RowsKernel<ALIGN, T, ROW_THREADS, 2, CHUNK>());
  launch(RowsKernel<ALIGN, T, ROW_THREADS, 4, CHUNK>());
}

// Up to this many rows (decode), every row gets a CTA of its own: about one wave of 128-thread CTAs on
// an H200 (132 SMs x 16), all rows in flight at once either way. More threads a row shorten the launch,
// whose time is each thread's chain of dependent steps over its blocks (a warp per SMSP hides no
// latency: ncu, DeepSeek-V3 T=1, 14.7 K instructions at 5.7 cycles each, 10.7 us for one row of 448
// blocks on 128 threads). H200, 2026-12-03: Qwen3-30B-A3B T=1's 8 used rows of 768 on a CTA each, not
// a warp, 4.8 -> 3.0 us, w4a4 layers x0.93-0.99 at T = 1-64. Past it, rows on fewer threads keep more
// rows in flight.
constexpr int64_t kQuantCtaRowsMaxR = 2048;

// Up to kQuantCtaRowsMaxR rows, a CTA a row: 512 threads for rows over 128 blocks, else 128; more rows
// (and any R with narrow, KernelFlag::kQuantNarrowRows: the choice before 2026-12-03) on 128 threads
// a row from 128 blocks on, on a warp below: launch(kernel, CTAs, threads a CTA).
template <bool ALIGN, typename T, typename F>
void WithQuantLaunch(const QuantRowsArgs& a, bool chunk_out, bool narrow, F&& launch) {
  const auto go = [&](auto chunk) {
    constexpr bool kChunk = decltype(chunk)::value;
    const bool few_rows = !narrow && a.R <= kQuantCtaRowsMaxR;
    const auto rows = [&](auto row_threads) {
      constexpr int kRow = decltype(row_threads)::value, kCta = QuantCtaThreads<kRow>();
      WithRowsKernel<ALIGN, T, kRow, kChunk>(
          a.K, [&](auto kernel) { launch(kernel, unsigned(CeilDiv<int64_t>(a.R, kCta / kRow)), kCta); });
    };
    if (few_rows && a.K / 16 > kQuantThreads) rows(std::integral_constant<int, kQuantWideThreads>{});
    else if (few_rows || a.K / 16 >= kQuantThreads) rows(std::integral_constant<int, kQuantThreads>{});
    else rows(std::integral_constant<int, 32>{});
  };
  chunk_out ? go(std::true_type{}) : go(std::false_type{});
}

template <typename T>
void Launch(const T* x, const QuantRowsArgs& a, bool chunk_out, bool narrow, bool pdl, cudaStream_t stream) {
  WithQuantLaunch<false, T>(a, chunk_out, narrow, [&](auto kernel, unsigned ctas, int threads) {
    LaunchKernel(kernel, ctas, threads, 0, stream, pdl, x, a);
  });
}

ffi::Error QuantDequantRowsCudaImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> row_ids,
                                    ffi::Buffer<ffi::F32> row_weights, ffi::Buffer<ffi::F32> input_scale,
                                    ffi::Buffer<ffi::S32> scale_ids, ffi::Result<ffi::Buffer<ffi::BF16>> out,
                                    ffi::Result<ffi::Buffer<ffi::F32>> scale, bool chunk_out, int64_t repeat,
                                    int64_t scale_group, int64_t scale_offset, int64_t scale_column,
                                    int64_t kernel_flags) {
  QuantRowsArgs a{};
  if (auto err = CheckKernelFlags("quant_dequant_rows", kernel_flags); err.failure()) return err;
  if (auto err = CheckQuantRows("quant_dequant_rows", x, row_ids, row_weights, input_scale, scale_ids, *out, *scale,
                                chunk_out, repeat, scale_group, scale_offset, scale_column, &a.R, &a.K, &a.s_in);
      err.failure())
    return err;
  if (a.R == 0) return ffi::Error::Success();
  if (a.R > 0x7FFFFFFF) return Invalid("quant_dequant_rows", "R = x.shape[0] * repeat must be < 2^31");
  a.repeat = repeat;
  a.row_ids = row_ids.dimensions()[0] ? row_ids.typed_data() : nullptr;
  a.n_weights = row_weights.dimensions()[0];
  a.row_weights = a.n_weights ? row_weights.typed_data() : nullptr;
  a.out = out->typed_data();
  a.scale = scale->typed_data();
  const bool pdl = kernel_flags & int64_t(KernelFlag::kPdl);
  const bool narrow = kernel_flags & int64_t(KernelFlag::kQuantNarrowRows);
  if (x.element_type() == ffi::DataType::BF16) {
    Launch(reinterpret_cast<const uint16_t*>(x.untyped_data()), a, chunk_out, narrow, pdl, stream);
  } else {
    Launch(reinterpret_cast<const float*>(x.untyped_data()), a, chunk_out, narrow, pdl, stream);
  }
  return LaunchError("quant_dequant_rows");
}

ffi::Error MoeAlignQuantCudaImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> topk_ids, ffi::Buffer<ffi::BF16> x,
                                 ffi::Buffer<ffi::F32> input_scale,
                                 ffi::Result<ffi::Buffer<ffi::S32>> sorted_ids,
                                 ffi::Result<ffi::Buffer<ffi::S32>> tile_expert,
                                 ffi::Result<ffi::Buffer<ffi::S32>> pair_to_row,
                                 ffi::Result<ffi::Buffer<ffi::BF16>> xq, ffi::Result<ffi::Buffer<ffi::F32>> x_scale,
                                 int64_t num_experts, int64_t expert_offset, int64_t tile_m, bool chunk_out,
                                 int64_t kernel_flags) {
  int64_t n, P, K, repeat;
  QuantRowsArgs a{};
  if (auto err = CheckAlignQuant("moe_align_quant", topk_ids, x, input_scale, num_experts, expert_offset, tile_m,
                                 *sorted_ids, *tile_expert, *pair_to_row, *xq, *x_scale, chunk_out, kMaxAlignExperts,
                                 kernel_flags, &n, &P, &K, &repeat, &a.s_in);
      err.failure())
    return err;
  if (P == 0 && topk_ids.dimensions()[0] == 0) return ffi::Error::Success();  // no pair and no row
  const AlignArgs al{topk_ids.typed_data(), int32_t(n), int32_t(tile_m), num_experts, expert_offset, P,
                     sorted_ids->typed_data(), tile_expert->typed_data(), pair_to_row->typed_data()};
  a.R = topk_ids.dimensions()[0] * repeat;  // (static scales: x's row once per pair)
  a.repeat = repeat;
  a.K = K;
  a.out = xq->typed_data();
  a.scale = x_scale->typed_data();
  const auto* xp = reinterpret_cast<const uint16_t*>(x.untyped_data());
  WithQuantLaunch<true, uint16_t>(a, chunk_out, kernel_flags & int64_t(KernelFlag::kQuantNarrowRows),
                                  [&](auto kernel, unsigned ctas, int threads) {
    LaunchKernel(kernel, ctas + 1, threads, 0, stream, kernel_flags & int64_t(KernelFlag::kPdl), al, xp, a);
  });
  return LaunchError("moe_align_quant");
}

}  // namespace
}  // namespace jax_nvfp4

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxNvfp4MoeAlignQuantCuda, jax_nvfp4::MoeAlignQuantCudaImpl,
                              jax_nvfp4::sig::MoeAlignQuant(
                                  xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxNvfp4QuantDequantRowsCuda, jax_nvfp4::QuantDequantRowsCudaImpl,
                              jax_nvfp4::sig::QuantDequantRows(
                                  xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
                              {xla::ffi::Traits::kCmdBufferCompatible});
