// moe_finalize on the GPU: out[t] = bf16(sum_j y[pair_to_row[t, j]]) with j = 0..k-1 in order
// (no atomics: one thread owns 8 output features of one token, so results are bitwise
// reproducible). 16-byte loads and stores. Its own launch: summing each feature slab in GEMM2's last CTA of
// the slab (an atomic count per CTA) made decode layers 1.00-1.10x slower on the H200 (2026-12-03, session 31).
#include "cuda/cuda_util.h"
#include "moe_common.h"
#include "moe_handlers.h"

namespace jax_nvfp4 {
namespace {

constexpr int kFinalizeThreads = 128;

__global__ void __launch_bounds__(kFinalizeThreads)
    MoeFinalizeKernel(const uint16_t* __restrict__ y, const int32_t* __restrict__ pair_to_row, int64_t k,
                      int64_t P, int64_t H, uint16_t* __restrict__ out) {
  GridDependencyWait();
  const int64_t t = blockIdx.x;
  const int64_t h = (int64_t(blockIdx.y) * kFinalizeThreads + threadIdx.x) * 8;
  if (h >= H) return;
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  // kBatch rows in flight at a time (not a chain of dependent loads), added in order j.
  constexpr int kBatch = 8;
  for (int64_t j0 = 0; j0 < k; j0 += kBatch) {
    uint4 v[kBatch];
    bool ok[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int64_t r = j0 + i < k ? pair_to_row[t * k + j0 + i] : -1;
      ok[i] = r >= 0 && r < P;
      v[i] = ok[i] ? __ldg(reinterpret_cast<const uint4*>(y + r * H + h)) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      if (!ok[i]) continue;  // a dropped pair adds nothing (not even +0.0)
      const uint32_t w[4] = {v[i].x, v[i].y, v[i].z, v[i].w};
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        acc[2 * q] += Bf16Lo(w[q]);
        acc[2 * q + 1] += Bf16Hi(w[q]);
      }
    }
  }
  uint4 o;
  o.x = PackBf16x2(acc[0], acc[1]);
  o.y = PackBf16x2(acc[2], acc[3]);
  o.z = PackBf16x2(acc[4], acc[5]);
  o.w = PackBf16x2(acc[6], acc[7]);
  *reinterpret_cast<uint4*>(out + t * H + h) = o;
}

ffi::Error MoeFinalizeCudaImpl(cudaStream_t stream, ffi::Buffer<ffi::BF16> y, ffi::Buffer<ffi::S32> pair_to_row,
                               ffi::Result<ffi::Buffer<ffi::BF16>> out, int64_t kernel_flags) {
  int64_t T, k, P, H;
  if (auto err = CheckKernelFlags("moe_finalize", kernel_flags); err.failure()) return err;
  if (auto err = CheckFinalize("moe_finalize", y, pair_to_row, *out, 8, &T, &k, &P, &H); err.failure())
    return err;
  if (T == 0 || H == 0) return ffi::Error::Success();
  const int64_t blocks_h = CeilDiv<int64_t>(H / 8, kFinalizeThreads);
  if (T > 0x7FFFFFFF || blocks_h > 65535) return Invalid("moe_finalize", "T or H too large for the grid");
  LaunchKernel(MoeFinalizeKernel, dim3(unsigned(T), unsigned(blocks_h)), kFinalizeThreads, 0, stream,
               kernel_flags & int64_t(KernelFlag::kPdl), y.typed_data(), pair_to_row.typed_data(), k, P, H,
               out->typed_data());
  return LaunchError("moe_finalize");
}

}  // namespace
}  // namespace jax_nvfp4

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxNvfp4MoeFinalizeCuda, jax_nvfp4::MoeFinalizeCudaImpl,
                              jax_nvfp4::sig::MoeFinalize(xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
                              {xla::ffi::Traits::kCmdBufferCompatible});
