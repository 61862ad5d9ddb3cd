// quant_dequant_rows on the GPU (see quant_rows.cc for the contract; arithmetic in
// nvfp4_quant.h, shared with the CPU handler). ROW_THREADS threads own one row: pass 1 reduces the
// row's abs-max, pass 2 reloads each 16-element block (from L1/L2), quantizes and writes its 16
// decoded bf16 values with two 16-byte stores, or, in the chunk order (CHUNK), as eight pairs of
// values that sit side by side there. One launch, no atomics, no workspace.
#include "cuda/cuda_util.h"
#include "moe_common.h"
#include "moe_handlers.h"
#include "nvfp4_quant.h"

namespace jax_nvfp4 {
namespace {

constexpr int kQuantThreads = 128;

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

template <typename T, int ROW_THREADS, bool CHUNK>
__global__ void __launch_bounds__(kQuantThreads)
    QuantDequantRowsKernel(const T* __restrict__ x, const int32_t* __restrict__ row_ids, int64_t R, int64_t K,
                           uint16_t* __restrict__ out, float* __restrict__ scale) {
  GridDependencyWait();
  static_assert(ROW_THREADS == 32 || ROW_THREADS == kQuantThreads, "a row is one warp or the whole CTA");
  constexpr int kWarpsPerRow = ROW_THREADS / 32;
  __shared__ uint32_t warp_amax[kWarpsPerRow];
  const int lane = threadIdx.x % ROW_THREADS;
  const int64_t r = int64_t(blockIdx.x) * (kQuantThreads / ROW_THREADS) + threadIdx.x / ROW_THREADS;
  if (r >= R) return;  // uniform over the row's threads (a CTA-wide row always has r < R)
  const int64_t nb = K / 16;
  uint4* orow = reinterpret_cast<uint4*>(out + r * K);
  if (row_ids != nullptr && row_ids[r] < 0) {  // unused row: zeros and scale 0
    for (int64_t b = lane; b < nb; b += ROW_THREADS) orow[2 * b] = orow[2 * b + 1] = make_uint4(0, 0, 0, 0);
    if (lane == 0) scale[r] = 0.0f;
    return;
  }
  const T* xr = x + r * K;
  uint32_t amax = 0;
  for (int64_t b = lane; b < nb; b += ROW_THREADS) {
    float v[16];
    LoadBlock(xr + 16 * b, v);
#pragma unroll
    for (int i = 0; i < 16; ++i) amax = max(amax, quant::AbsBits(v[i]));
  }
  amax = __reduce_max_sync(0xFFFFFFFFu, amax);
  if constexpr (kWarpsPerRow > 1) {
    if (threadIdx.x % 32 == 0) warp_amax[threadIdx.x / 32] = amax;
    __syncthreads();
#pragma unroll
    for (int w = 0; w < kWarpsPerRow; ++w) amax = max(amax, warp_amax[w]);
  }
  const quant::RowScales rs = quant::RowScalesFromAmax(amax);
  if (lane == 0) scale[r] = rs.stored;
  for (int64_t b = lane; b < nb; b += ROW_THREADS) {
    float v[16];
    LoadBlock(xr + 16 * b, v);
    uint32_t vmax = 0;
#pragma unroll
    for (int i = 0; i < 16; ++i) vmax = max(vmax, quant::AbsBits(v[i]));
    const quant::BlockScale bs = quant::BlockScaleFromVmax(vmax, rs);
    float d[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) d[i] = quant::QuantDequant(v[i], bs);
    if constexpr (CHUNK) {
      // Natural 16b + i and 16b + i + 4 (i = 8h + q, q < 4) are neighbours in the chunk order.
      uint32_t* o32 = reinterpret_cast<uint32_t*>(out + r * K);
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int q = 0; q < 4; ++q) o32[ChunkPos(16 * b + 8 * h + q) / 2] = PackBf16x2(d[8 * h + q], d[8 * h + q + 4]);
    } else {
      uint32_t w[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) w[i] = PackBf16x2(d[2 * i], d[2 * i + 1]);
      orow[2 * b] = make_uint4(w[0], w[1], w[2], w[3]);
      orow[2 * b + 1] = make_uint4(w[4], w[5], w[6], w[7]);
    }
  }
}

template <typename T, bool CHUNK>
void Launch(const T* x, const int32_t* row_ids, int64_t R, int64_t K, uint16_t* out, float* scale, bool pdl,
            cudaStream_t stream) {
  if (K / 16 >= kQuantThreads) {  // long rows: a CTA per row
    LaunchKernel(QuantDequantRowsKernel<T, kQuantThreads, CHUNK>, unsigned(R), kQuantThreads, 0, stream, pdl, x,
                 row_ids, R, K, out, scale);
  } else {  // short rows: a warp per row
    const int64_t rows_per_cta = kQuantThreads / 32;
    LaunchKernel(QuantDequantRowsKernel<T, 32, CHUNK>, unsigned(CeilDiv(R, rows_per_cta)), kQuantThreads, 0, stream,
                 pdl, x, row_ids, R, K, out, scale);
  }
}

template <typename T>
void Launch(const T* x, const int32_t* row_ids, int64_t R, int64_t K, bool chunk_out, uint16_t* out, float* scale,
            bool pdl, cudaStream_t stream) {
  chunk_out ? Launch<T, true>(x, row_ids, R, K, out, scale, pdl, stream)
            : Launch<T, false>(x, row_ids, R, K, out, scale, pdl, stream);
}

ffi::Error QuantDequantRowsCudaImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> row_ids,
                                    ffi::Result<ffi::Buffer<ffi::BF16>> out,
                                    ffi::Result<ffi::Buffer<ffi::F32>> scale, bool chunk_out, int64_t kernel_flags) {
  int64_t R, K;
  if (auto err = CheckKernelFlags("quant_dequant_rows", kernel_flags); err.failure()) return err;
  if (auto err = CheckQuantRows("quant_dequant_rows", x, row_ids, *out, *scale, chunk_out, &R, &K); err.failure())
    return err;
  if (R == 0) return ffi::Error::Success();
  if (R > 0x7FFFFFFF) return Invalid("quant_dequant_rows", "R = x.shape[0] must be < 2^31");
  const int32_t* ids = row_ids.dimensions()[0] ? row_ids.typed_data() : nullptr;
  const bool pdl = kernel_flags & int64_t(KernelFlag::kPdl);
  if (x.element_type() == ffi::DataType::BF16) {
    Launch(reinterpret_cast<const uint16_t*>(x.untyped_data()), ids, R, K, chunk_out, out->typed_data(),
           scale->typed_data(), pdl, stream);
  } else {
    Launch(reinterpret_cast<const float*>(x.untyped_data()), ids, R, K, chunk_out, out->typed_data(),
           scale->typed_data(), pdl, stream);
  }
  return LaunchError("quant_dequant_rows");
}

}  // namespace
}  // namespace jax_nvfp4

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxNvfp4QuantDequantRowsCuda, jax_nvfp4::QuantDequantRowsCudaImpl,
                              jax_nvfp4::sig::QuantDequantRows(
                                  xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
                              {xla::ffi::Traits::kCmdBufferCompatible});
