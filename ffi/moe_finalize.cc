// moe_finalize on the CPU: out[t] = sum_j y[pair_to_row[t, j]] in the fixed order j = 0..k-1
// (fp32 accumulation, one bf16 rounding at the end); dropped pairs (row -1) add nothing.
#include <vector>

#include "moe_common.h"
#include "moe_handlers.h"

namespace jax_nvfp4 {
namespace {

ffi::Error MoeFinalizeCpuImpl(ffi::Buffer<ffi::BF16> y, ffi::Buffer<ffi::S32> pair_to_row,
                              ffi::Result<ffi::Buffer<ffi::BF16>> out, int64_t kernel_flags) {
  int64_t T, k, P, H;
  if (auto err = CheckKernelFlags("moe_finalize", kernel_flags); err.failure()) return err;
  if (auto err = CheckFinalize("moe_finalize", y, pair_to_row, *out, 1, &T, &k, &P, &H); err.failure())
    return err;
  const uint16_t* yp = y.typed_data();
  const int32_t* p2r = pair_to_row.typed_data();
  uint16_t* op = out->typed_data();
  std::vector<float> acc(H);
  for (int64_t t = 0; t < T; ++t) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t j = 0; j < k; ++j) {
      const int64_t r = p2r[t * k + j];
      if (r < 0 || r >= P) continue;
      for (int64_t h = 0; h < H; ++h) acc[h] += Bf16ToFloat(yp[r * H + h]);
    }
    for (int64_t h = 0; h < H; ++h) op[t * H + h] = FloatToBf16(acc[h]);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_nvfp4

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxNvfp4MoeFinalizeCpu, jax_nvfp4::MoeFinalizeCpuImpl, jax_nvfp4::sig::MoeFinalize(xla::ffi::Ffi::Bind()));  // out [T, H]
