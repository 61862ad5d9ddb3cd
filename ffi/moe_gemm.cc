// grouped_gemm (W4A16) on the CPU: for every sorted row r of a tile owned by expert e,
//   acc[n] = sum_k a[row(r), k] * w_e[n, k]      (w decoded exactly: e2m1 * e4m3 scale; fp32)
//   v = acc * (alpha[e] * row_scale) + bias[e, n]  -> activation (GEMM1) -> bf16
// (a gated GEMM's up rows with their own alphas where alpha is [2, E])
// the same function the CUDA kernel computes, written as plain loops.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <vector>

#include "moe_common.h"
#include "moe_handlers.h"

namespace jax_nvfp4 {
namespace {

// Decode rows [n0, n0 + rows) of expert e's [N, K] weights (without the global scale: exact in
// fp32 and bf16) into dst [rows, K]; `blocked`: w and ws in the blocked order (Pairing::kBlockedW).
void DecodeRows(const uint8_t* w, const uint8_t* ws, int64_t e, int64_t N, int64_t K, int64_t n0, int64_t rows,
                bool blocked, float* dst) {
  static const std::vector<float> kE4M3 = [] {
    std::vector<float> t(256);
    for (int b = 0; b < 256; ++b) t[b] = E4M3ToFloat(uint8_t(b));
    return t;
  }();
  const uint8_t* wd = w + e * N * (K / 2);
  const uint8_t* sd = ws + e * N * (K / 16);
  for (int64_t n = n0; n < n0 + rows; ++n) {
    for (int64_t kb = 0; kb < K / 16; ++kb) {  // 16-K block kb: 8 code bytes, 1 scale byte
      const float s = kE4M3[sd[blocked ? BlockedOffset(n, kb, K, kBlockScaleBytes) : n * (K / 16) + kb]];
      const uint8_t* bytes = wd + (blocked ? BlockedOffset(n, kb * 8, K, kBlockCodeBytes) : n * (K / 2) + kb * 8);
      float* out = dst + (n - n0) * K + kb * 16;
      for (int h = 0; h < 2; ++h) {  // two code words (little-endian), blocked ones with their bits permuted
        uint32_t q = 0;
        for (int i = 0; i < 4; ++i) q |= uint32_t(bytes[4 * h + i]) << (8 * i);
        if (blocked) q = NaturalCodeBits(q);
        for (int i = 0; i < 8; ++i) out[8 * h + i] = E2M1ToFloat((q >> (4 * i)) & 0xF) * s;
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

constexpr int64_t kFeatureBlock = 32;  // output features per work item (decoded weights stay in cache)

struct CpuGemm {
  const GemmDims& d;
  const uint16_t* a;
  const uint8_t *w, *ws;
  const float *alpha, *alpha_up, *rs;  // alpha_up: the up rows' (UpAlpha)
  BiasRef bias;  // [E, N] or none
  const int32_t *sid, *te;
  int64_t activation, row_scale_mode, top_k, gather, tile_m, pairing;
  uint16_t* out_bf16;
  float* out_f32;

  // Output row r, feature n (at its paired position when out is paired).
  void Store(int64_t r, int64_t n, float v) const {
    const int64_t i = r * d.n_out + PairingPos(pairing, Pairing::kOut, n);
    if (out_f32) out_f32[i] = v; else out_bf16[i] = FloatToBf16(v);
  }

  // Work item: one row tile x one block of output features. Every output element is one Dot in a
  // fixed order whatever thread computes it, so the result does not depend on the thread count.
  void Run(int64_t item, std::vector<float>& arows, std::vector<float>& wdec) const {
    const int64_t blocks = (d.n_out + kFeatureBlock - 1) / kFeatureBlock;
    const int64_t tile = item / blocks, n0 = item % blocks * kFeatureBlock;
    const int64_t nb = std::min(kFeatureBlock, d.n_out - n0), K = d.K;
    const bool gated = IsGated(activation);
    const int64_t e = te[tile];
    int64_t used = 0;  // rows of this tile with a pair, gathered into arows
    int64_t src_of[kMaxTileM], row_of[kMaxTileM];
    float scale_of[kMaxTileM], up_scale_of[kMaxTileM];
    for (int64_t r = tile * tile_m; r < (tile + 1) * tile_m; ++r) {
      const int64_t pair = sid[r];
      const int64_t src = gather ? (pair >= 0 ? pair / top_k : -1) : r;
      if (e < 0 || e >= d.E || pair < 0 || src >= d.a_rows) {  // padding: zeros
        for (int64_t n = n0; n < n0 + nb; ++n) Store(r, n, 0.0f);
        continue;
      }
      src_of[used] = src, row_of[used] = r;
      scale_of[used] = RowScaled(alpha[e], row_scale_mode, rs, d.row_scale_n, pair, top_k, r);
      up_scale_of[used] = RowScaled(alpha_up[e], row_scale_mode, rs, d.row_scale_n, pair, top_k, r);
      ++used;
    }
    if (used == 0) return;
    for (int64_t i = 0; i < used; ++i)
      for (int64_t k = 0; k < K; ++k)
        arows[i * K + k] = Bf16ToFloat(a[src_of[i] * K + PairingPos(pairing, Pairing::kA, k)]);
    const bool blocked = pairing & int64_t(Pairing::kBlockedW);
    DecodeRows(w, ws, e, d.N, K, n0, nb, blocked, wdec.data());
    if (gated) DecodeRows(w, ws, e, d.N, K, d.n_out + n0, nb, blocked, wdec.data() + nb * K);
    const BiasRef b = bias.Row(e, d.N);
    for (int64_t n = 0; n < nb; ++n) {
      const float bg = b ? b[n0 + n] : 0.0f, bu = b && gated ? b[d.n_out + n0 + n] : 0.0f;
      for (int64_t i = 0; i < used; ++i) {
        const float g = Dot(&arows[i * K], &wdec[n * K], K) * scale_of[i] + bg;
        const float u = gated ? Dot(&arows[i * K], &wdec[(nb + n) * K], K) * up_scale_of[i] + bu : 0.0f;
        Store(row_of[i], n0 + n, ApplyActivation(activation, g, u));
      }
    }
  }
};

// Work items shared by the handler's thread and the tasks it schedules on XLA's intra-op pool.
// Every thread takes items from one counter, so the handler's thread finishes the work alone if
// no pool thread is free (no deadlock when all pool threads are busy), and waits only for items
// that other threads have taken. A task that starts after the work is done takes nothing and
// touches only this shared state, never the handler's buffers.
struct WorkQueue {
  const CpuGemm* gemm;
  int64_t items;
  std::atomic<int64_t> next{0};
  std::mutex mu;
  std::condition_variable cv;
  int64_t completed = 0;

  void Work() {
    std::vector<float> arows, wdec;
    for (int64_t i; (i = next.fetch_add(1)) < items;) {
      if (arows.empty()) {
        arows.resize(gemm->tile_m * gemm->d.K);
        wdec.resize(2 * kFeatureBlock * gemm->d.K);
      }
      gemm->Run(i, arows, wdec);
      std::lock_guard<std::mutex> lock(mu);
      if (++completed == items) cv.notify_all();
    }
  }
};

ffi::Error GroupedGemmCpuImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> a, ffi::Buffer<ffi::U8> w_data,
                              ffi::AnyBuffer w_scales, ffi::Buffer<ffi::F32> alpha, ffi::AnyBuffer bias,
                              ffi::Buffer<ffi::S32> sorted_ids, ffi::Buffer<ffi::S32> tile_expert,
                              ffi::Buffer<ffi::F32> row_scale, ffi::Result<ffi::AnyBuffer> out,
                              int64_t activation, int64_t row_scale_mode, int64_t top_k, int64_t gather,
                              int64_t tile_m, int64_t k_split, int64_t pairing, int64_t kernel_flags) {
  // k_split and kernel_flags choose GPU kernels; validated here so both platforms accept the same calls.
  GemmDims d;
  if (auto err = CheckGemm("grouped_gemm", a, w_data, w_scales, alpha, sorted_ids, tile_expert, row_scale,
                           *out, activation, row_scale_mode, top_k, gather, tile_m, k_split, pairing, kernel_flags,
                           16, 1, &d);
      err.failure())
    return err;
  if (auto err = CheckBias("grouped_gemm", bias, d); err.failure()) return err;
  // bf16 output (the default), or fp32 (w4a4 quantizes the unrounded intermediate).
  const bool f32_out = out->element_type() == ffi::DataType::F32;
  const CpuGemm g{d, a.typed_data(), w_data.typed_data(), static_cast<const uint8_t*>(w_scales.untyped_data()),
                  alpha.typed_data(), UpAlpha(d, alpha.typed_data()), row_scale.typed_data(), BiasData(bias),
                  sorted_ids.typed_data(), tile_expert.typed_data(), activation, row_scale_mode, top_k, gather, tile_m,
                  pairing,
                  f32_out ? nullptr : static_cast<uint16_t*>(out->untyped_data()),
                  f32_out ? static_cast<float*>(out->untyped_data()) : nullptr};
  const int64_t items = d.tiles * ((d.n_out + kFeatureBlock - 1) / kFeatureBlock);
  if (items == 0) return ffi::Error::Success();
  auto queue = std::make_shared<WorkQueue>();
  queue->gemm = &g;
  queue->items = items;
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), items) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([queue] { queue->Work(); });
  queue->Work();
  std::unique_lock<std::mutex> lock(queue->mu);
  queue->cv.wait(lock, [&] { return queue->completed == items; });
  return ffi::Error::Success();
}

// moe_align, then grouped_gemm of the gathered tokens (the GPU runs both in one launch).
ffi::Error MoeAlignGemmCpuImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> topk_ids, ffi::Buffer<ffi::BF16> a,
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
  if (auto err = CheckAlignGemm("moe_align_gemm", topk_ids, a, w_data, w_scales, alpha, row_scale, *out, *sorted_ids,
                                *tile_expert, *pair_to_row, activation, row_scale_mode, tile_m, k_split, pairing,
                                kernel_flags, int64_t(1) << 30, 16, 1, &n, &d);
      err.failure())
    return err;
  if (auto err = CheckBias("moe_align_gemm", bias, d); err.failure()) return err;
  AlignPairsCpu(topk_ids.typed_data(), n, d.E, expert_offset, tile_m, d.P, sorted_ids->typed_data(),
                tile_expert->typed_data(), pair_to_row->typed_data());
  return GroupedGemmCpuImpl(pool, a, w_data, w_scales, alpha, bias, *sorted_ids, *tile_expert, row_scale, out,
                            activation, row_scale_mode, std::max<int64_t>(topk_ids.dimensions()[1], 1), 1, tile_m,
                            k_split, pairing, kernel_flags);  // (k = 0: no pair, as CheckAlignGemm took it)
}

}  // namespace
}  // namespace jax_nvfp4

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxNvfp4MoeAlignGemmCpu, jax_nvfp4::MoeAlignGemmCpuImpl,
                              jax_nvfp4::sig::MoeAlignGemm(xla::ffi::Ffi::Bind().Ctx<xla::ffi::ThreadPool>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxNvfp4GroupedGemmCpu, jax_nvfp4::GroupedGemmCpuImpl,
                              jax_nvfp4::sig::GroupedGemm(xla::ffi::Ffi::Bind().Ctx<xla::ffi::ThreadPool>()));
