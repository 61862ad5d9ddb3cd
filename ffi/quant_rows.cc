// quant_dequant_rows on the CPU: each row of x quantized to NVFP4 with its own global scale
// (per token) and decoded back without that scale (e2m1 * E4M3 block scale, exact in bf16),
// which is what the W4A16 GEMMs consume in mode w4a4; with chunk_out, each row's values are written in
// the wgmma chunk order (ChunkPos), where the sm_90a kernels read it; with row_weights, each used row's
// scale is times its weight (quant::WeightedScale); with input_scale, each row on a given static decode scale
// (quant::RowScalesFromInputScale; one a row, or looked up by scale_ids in a table: quant::StaticScales); with
// repeat, each row of x gives that many rows. Arithmetic in nvfp4_quant.h.
#include <algorithm>

#if defined(__SSE__) || defined(__x86_64__)
#include <xmmintrin.h>
#endif

#include "moe_common.h"
#include "moe_handlers.h"
#include "nvfp4_quant.h"

namespace jax_nvfp4 {
namespace {

// The recipe keeps subnormals; XLA:CPU may run its thread with flush-to-zero or
// denormals-are-zero set. Clear them for this handler and restore them afterwards.
class IeeeSubnormals {
 public:
  IeeeSubnormals() {
#if defined(__SSE__) || defined(__x86_64__)
    saved_ = _mm_getcsr();
    _mm_setcsr(saved_ & ~0x8040u);  // FTZ (bit 15), DAZ (bit 6)
#elif defined(__aarch64__)
    __asm__ volatile("mrs %0, fpcr" : "=r"(saved_));
    const uint64_t v = saved_ & ~(uint64_t(1) << 24);  // FZ
    __asm__ volatile("msr fpcr, %0" : : "r"(v));
#endif
  }
  ~IeeeSubnormals() {
#if defined(__SSE__) || defined(__x86_64__)
    _mm_setcsr(saved_);
#elif defined(__aarch64__)
    __asm__ volatile("msr fpcr, %0" : : "r"(saved_));
#endif
  }

 private:
#if defined(__aarch64__)
  uint64_t saved_ = 0;
#else
  unsigned saved_ = 0;
#endif
};

template <typename T>
float Load(const T* p, int64_t i);
template <>
float Load<uint16_t>(const uint16_t* p, int64_t i) {
  return Bf16ToFloat(p[i]);
}
template <>
float Load<float>(const float* p, int64_t i) {
  return p[i];
}

// The largest |x| of a row, as bits (per-token scales).
template <typename T>
uint32_t RowAmax(const T* xr, int64_t K) {
  uint32_t amax = 0;
  for (int64_t i = 0; i < K; ++i) amax = std::max(amax, quant::AbsBits(Load(xr, i)));
  return amax;
}

template <typename T>
void QuantRows(const T* x, const int32_t* row_ids, const float* row_weights, int64_t n_weights,
               const quant::StaticScales& s_in, int64_t repeat, int64_t R, int64_t K, bool chunk_out, uint16_t* out,
               float* scale) {
  for (int64_t r = 0; r < R; ++r) {
    const T* xr = x + r / repeat * K;
    uint16_t* orow = out + r * K;
    if (row_ids && row_ids[r] < 0) {  // unused row: zeros, scale 0 (as an all-zero row)
      std::fill(orow, orow + K, uint16_t(0));
      scale[r] = 0.0f;
      continue;
    }
    const quant::RowScales rs = s_in.table ? quant::RowScalesFromInputScale(quant::StaticScaleOf(s_in, r))
                                           : quant::RowScalesFromAmax(RowAmax(xr, K));
    scale[r] = quant::WeightedScale(rs.stored, row_weights, n_weights, row_ids ? row_ids[r] : 0);
    for (int64_t b = 0; b < K; b += 16) {
      uint32_t vmax = 0;
      for (int i = 0; i < 16; ++i) vmax = std::max(vmax, quant::AbsBits(Load(xr, b + i)));
      const quant::BlockScale bs = quant::BlockScaleFromVmax(vmax, rs);
      for (int i = 0; i < 16; ++i)
        orow[chunk_out ? ChunkPos(b + i) : b + i] = FloatToBf16(quant::QuantDequant(Load(xr, b + i), bs));
    }
  }
}

ffi::Error QuantDequantRowsCpuImpl(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> row_ids,
                                   ffi::Buffer<ffi::F32> row_weights, ffi::Buffer<ffi::F32> input_scale,
                                   ffi::Buffer<ffi::S32> scale_ids, ffi::Result<ffi::Buffer<ffi::BF16>> out,
                                   ffi::Result<ffi::Buffer<ffi::F32>> scale, bool chunk_out, int64_t repeat,
                                   int64_t scale_group, int64_t scale_offset, int64_t scale_column,
                                   int64_t kernel_flags) {
  int64_t R, K;
  quant::StaticScales s_in;
  if (auto err = CheckKernelFlags("quant_dequant_rows", kernel_flags); err.failure()) return err;
  if (auto err = CheckQuantRows("quant_dequant_rows", x, row_ids, row_weights, input_scale, scale_ids, *out, *scale,
                                chunk_out, repeat, scale_group, scale_offset, scale_column, &R, &K, &s_in);
      err.failure())
    return err;
  const int32_t* ids = row_ids.dimensions()[0] ? row_ids.typed_data() : nullptr;
  const int64_t n_weights = row_weights.dimensions()[0];
  const float* weights = n_weights ? row_weights.typed_data() : nullptr;
  IeeeSubnormals ieee;
  if (x.element_type() == ffi::DataType::BF16) {
    QuantRows(reinterpret_cast<const uint16_t*>(x.untyped_data()), ids, weights, n_weights, s_in, repeat, R, K,
              chunk_out, out->typed_data(), scale->typed_data());
  } else {
    QuantRows(reinterpret_cast<const float*>(x.untyped_data()), ids, weights, n_weights, s_in, repeat, R, K,
              chunk_out, out->typed_data(), scale->typed_data());
  }
  return ffi::Error::Success();
}

ffi::Error MoeAlignQuantCpuImpl(ffi::Buffer<ffi::S32> topk_ids, ffi::Buffer<ffi::BF16> x,
                                ffi::Buffer<ffi::F32> input_scale, ffi::Result<ffi::Buffer<ffi::S32>> sorted_ids,
                                ffi::Result<ffi::Buffer<ffi::S32>> tile_expert,
                                ffi::Result<ffi::Buffer<ffi::S32>> pair_to_row, ffi::Result<ffi::Buffer<ffi::BF16>> xq,
                                ffi::Result<ffi::Buffer<ffi::F32>> x_scale, int64_t num_experts, int64_t expert_offset,
                                int64_t tile_m, bool chunk_out, int64_t kernel_flags) {
  int64_t n, P, K, repeat;
  quant::StaticScales s_in;
  if (auto err = CheckAlignQuant("moe_align_quant", topk_ids, x, input_scale, num_experts, expert_offset, tile_m,
                                 *sorted_ids, *tile_expert, *pair_to_row, *xq, *x_scale, chunk_out, int64_t(1) << 30,
                                 kernel_flags, &n, &P, &K, &repeat, &s_in);
      err.failure())
    return err;
  AlignPairsCpu(topk_ids.typed_data(), n, num_experts, expert_offset, tile_m, P, sorted_ids->typed_data(),
                tile_expert->typed_data(), pair_to_row->typed_data());
  IeeeSubnormals ieee;
  QuantRows(reinterpret_cast<const uint16_t*>(x.untyped_data()), nullptr, nullptr, 0, s_in, repeat,
            topk_ids.dimensions()[0] * repeat, K, chunk_out, xq->typed_data(), x_scale->typed_data());
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_nvfp4

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxNvfp4MoeAlignQuantCpu, jax_nvfp4::MoeAlignQuantCpuImpl,
                              jax_nvfp4::sig::MoeAlignQuant(xla::ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxNvfp4QuantDequantRowsCpu, jax_nvfp4::QuantDequantRowsCpuImpl,
                              jax_nvfp4::sig::QuantDequantRows(xla::ffi::Ffi::Bind()));
