// grouped_gemm (W4A16) on the CPU: for every sorted row r of a tile owned by expert e,
//   acc[n] = sum_k a[row(r), k] * w_e[n, k]      (w decoded exactly: e2m1 * e4m3 scale; fp32)
//   v = acc * (alpha[e] * row_scale)               -> activation (GEMM1) -> bf16
// the same function the CUDA kernel computes, written as plain loops.
#include <vector>

#include "moe_common.h"
#include "moe_handlers.h"

namespace jax_nvfp4 {
namespace {

// Decode expert e's [N, K] weights (without the global scale: exact in fp32 and bf16).
void DecodeExpert(const uint8_t* w, const uint8_t* ws, int64_t e, int64_t N, int64_t K, float* dst) {
  static const std::vector<float> kE4M3 = [] {
    std::vector<float> t(256);
    for (int b = 0; b < 256; ++b) t[b] = E4M3ToFloat(uint8_t(b));
    return t;
  }();
  const uint8_t* wd = w + e * N * (K / 2);
  const uint8_t* sd = ws + e * N * (K / 16);
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t kb = 0; kb < K / 16; ++kb) {
      const float s = kE4M3[sd[n * (K / 16) + kb]];
      const uint8_t* bytes = wd + n * (K / 2) + kb * 8;
      float* out = dst + n * K + kb * 16;
      for (int i = 0; i < 8; ++i) {
        out[2 * i] = E2M1ToFloat(bytes[i] & 0xF) * s;
        out[2 * i + 1] = E2M1ToFloat(bytes[i] >> 4) * s;
      }
    }
  }
}

// fp32 dot product with 16 interleaved partial sums (K % 16 == 0): a fixed order, so results
// are reproducible, and one the compiler can vectorize.
float Dot(const float* a, const float* b, int64_t K) {
  float part[16] = {};
  for (int64_t k = 0; k < K; k += 16)
    for (int i = 0; i < 16; ++i) part[i] += a[k + i] * b[k + i];
  float acc = 0.0f;
  for (int i = 0; i < 16; ++i) acc += part[i];
  return acc;
}

ffi::Error GroupedGemmCpuImpl(ffi::Buffer<ffi::BF16> a, ffi::Buffer<ffi::U8> w_data,
                              ffi::Buffer<ffi::U8> w_scales, ffi::Buffer<ffi::F32> alpha,
                              ffi::Buffer<ffi::S32> sorted_ids, ffi::Buffer<ffi::S32> tile_expert,
                              ffi::Buffer<ffi::F32> row_scale, ffi::Result<ffi::AnyBuffer> out,
                              int64_t activation, int64_t row_scale_mode, int64_t top_k, int64_t gather,
                              int64_t tile_m, int64_t k_split, int64_t kernel_flags) {
  // k_split and kernel_flags choose GPU kernels; validated here so both platforms accept the same calls.
  GemmDims d;
  if (auto err = CheckGemm("grouped_gemm", a, w_data, w_scales, alpha, sorted_ids, tile_expert, row_scale,
                           *out, activation, row_scale_mode, top_k, gather, tile_m, k_split, kernel_flags, 16,
                           1, &d);
      err.failure())
    return err;
  const uint16_t* ap = a.typed_data();
  const float* al = alpha.typed_data();
  const int32_t* sid = sorted_ids.typed_data();
  const int32_t* te = tile_expert.typed_data();
  const float* rs = row_scale.typed_data();
  // bf16 output (the default), or fp32 (w4a4 quantizes the unrounded intermediate).
  const bool f32_out = out->element_type() == ffi::DataType::F32;
  uint16_t* op = f32_out ? nullptr : static_cast<uint16_t*>(out->untyped_data());
  float* opf = f32_out ? static_cast<float*>(out->untyped_data()) : nullptr;
  auto store = [&](int64_t i, float v) {
    if (f32_out) opf[i] = v; else op[i] = FloatToBf16(v);
  };
  const bool gated = IsGated(activation);
  const int64_t K = d.K;

  std::vector<float> wdec(d.N * K), arow(K);
  int64_t decoded = -1;
  for (int64_t tile = 0; tile < d.tiles; ++tile) {
    const int64_t e = te[tile];
    for (int64_t r = tile * tile_m; r < (tile + 1) * tile_m; ++r) {
      const int64_t pair = sid[r];
      const int64_t src = gather ? (pair >= 0 ? pair / top_k : -1) : r;
      if (e < 0 || e >= d.E || pair < 0 || src >= d.a_rows) {  // padding: zeros
        for (int64_t n = 0; n < d.n_out; ++n) store(r * d.n_out + n, 0.0f);
        continue;
      }
      if (decoded != e) {
        DecodeExpert(w_data.typed_data(), w_scales.typed_data(), e, d.N, K, wdec.data());
        decoded = e;
      }
      float scale = al[e];
      if (row_scale_mode != int64_t(RowScale::kNone)) {
        const int64_t idx = row_scale_mode == int64_t(RowScale::kToken) ? pair / top_k
                            : row_scale_mode == int64_t(RowScale::kPair) ? pair
                                                                          : r;
        scale *= (idx < d.row_scale_n) ? rs[idx] : 0.0f;
      }
      for (int64_t k = 0; k < K; ++k) arow[k] = Bf16ToFloat(ap[src * K + k]);
      for (int64_t n = 0; n < d.n_out; ++n) {
        const float g = Dot(arow.data(), &wdec[n * K], K) * scale;
        const float u = gated ? Dot(arow.data(), &wdec[(n + d.n_out) * K], K) * scale : 0.0f;
        store(r * d.n_out + n, ApplyActivation(activation, g, u));
      }
    }
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_nvfp4

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxNvfp4GroupedGemmCpu, jax_nvfp4::GroupedGemmCpuImpl, jax_nvfp4::sig::GroupedGemm(xla::ffi::Ffi::Bind()));                // rows per tile
