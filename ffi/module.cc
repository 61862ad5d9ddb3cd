// The nanobind extension `jax_nvfp4._ffi`: build facts now; XLA FFI handler
// registrations (name -> capsule) are returned by registrations().
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <cstring>

#include "moe_common.h"
#include "moe_handlers.h"
#include "xla/ffi/api/c_api.h"
#ifdef JAX_NVFP4_WITH_CUDA
#include "cuda/probe.h"
#endif

namespace nb = nanobind;

namespace {
nb::capsule Capsule(XLA_FFI_Error* (*fn)(XLA_FFI_CallFrame*)) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

// Checks the in-register E2M1 -> bf16 decodes the CUDA kernels use (of the rows order's code words and of
// the blocked order's, bits permuted) against the E2M1 table, for all 65536 groups of four codes. Returns the
// number of wrong values (0 expected).
int SelfTestDecode() {
  // Every code in every one of the 8 positions (with varying neighbours): bits-as-bf16 must be
  // exactly code * 2^-126, -0.0 included (compared bitwise).
  int bad = 0;
  for (uint32_t v = 0; v < 65536; ++v) {
    const uint32_t q = v | (((v * 0x9E37u) ^ (v >> 3)) & 0xFFFFu) << 16;
    uint32_t w[2][4];  // the rows order's word, and the blocked order's (its bits permuted)
    jax_nvfp4::DecodeE2M1x8(q, w[0]);
    jax_nvfp4::DecodeE2M1x8Blocked(jax_nvfp4::BlockedCodeBits(q), w[1]);
    bad += jax_nvfp4::NaturalCodeBits(jax_nvfp4::BlockedCodeBits(q)) != q;
    for (int i = 0; i < 16; ++i) {
      const uint16_t got = uint16_t(w[i / 8][i % 4] >> (16 * (i % 8 / 4)));
      const float want = std::ldexp(jax_nvfp4::E2M1ToFloat((q >> (4 * (i % 8))) & 0xF), -jax_nvfp4::kDecodeExp);
      const float v32 = jax_nvfp4::Bf16ToFloat(got);
      if (std::memcmp(&v32, &want, 4) != 0) ++bad;
    }
  }
  return bad;
}
}  // namespace

NB_MODULE(_ffi, m) {
  m.doc() = "jax_nvfp4 XLA FFI extension";

  m.def("build_info", []() {
    nb::dict info;
    info["xla_ffi_api_version"] = nb::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
    info["jax_version"] = JAX_NVFP4_JAX_VERSION;
#ifdef JAX_NVFP4_WITH_CUDA
    info["cuda"] = true;
    info["cuda_version"] = JAX_NVFP4_CUDA_VERSION;
    info["cudart_version"] = jax_nvfp4::CudaRuntimeVersion();
    nb::list archs;
    std::string s = JAX_NVFP4_CUDA_ARCHS;
    for (size_t start = 0, end; (end = s.find(',', start)) != std::string::npos; start = end + 1) {
      archs.append(s.substr(start, end - start));
    }
    info["cuda_archs"] = archs;
#else
    info["cuda"] = false;
    info["cuda_version"] = nb::none();
    info["cudart_version"] = nb::none();
    info["cuda_archs"] = nb::list();
#endif
    return info;
  }, "Facts about this build: XLA FFI API version, CUDA version and compiled architectures.");

  m.def("cuda_arch_probe", []() -> int {
#ifdef JAX_NVFP4_WITH_CUDA
    std::string error;
    int arch = jax_nvfp4::RunArchProbe(&error);
    if (arch < 0) throw std::runtime_error("CUDA arch probe failed: " + error);
    return arch;
#else
    throw std::runtime_error("jax_nvfp4 was built without CUDA (nvcc was not found at build time)");
#endif
  }, "Run a one-thread kernel on the current GPU; return the __CUDA_ARCH__ that ran.");

  m.def("registrations", []() {
    // target name -> {platform -> handler capsule}; "CUDA" entries only in CUDA builds.
    nb::dict regs;
    auto add = [&](const char* name, XLA_FFI_Error* (*cpu)(XLA_FFI_CallFrame*),
                   XLA_FFI_Error* (*cuda)(XLA_FFI_CallFrame*)) {
      nb::dict platforms;
      platforms["cpu"] = Capsule(cpu);
      if (cuda) platforms["CUDA"] = Capsule(cuda);
      regs[name] = platforms;
    };
#ifdef JAX_NVFP4_WITH_CUDA
    add("jax_nvfp4_moe_align", JaxNvfp4MoeAlignCpu, JaxNvfp4MoeAlignCuda);
    add("jax_nvfp4_grouped_gemm", JaxNvfp4GroupedGemmCpu, JaxNvfp4GroupedGemmCuda);
    add("jax_nvfp4_moe_finalize", JaxNvfp4MoeFinalizeCpu, JaxNvfp4MoeFinalizeCuda);
    add("jax_nvfp4_quant_dequant_rows", JaxNvfp4QuantDequantRowsCpu, JaxNvfp4QuantDequantRowsCuda);
    add("jax_nvfp4_moe_align_quant", JaxNvfp4MoeAlignQuantCpu, JaxNvfp4MoeAlignQuantCuda);
    add("jax_nvfp4_moe_align_gemm", JaxNvfp4MoeAlignGemmCpu, JaxNvfp4MoeAlignGemmCuda);
    add("jax_nvfp4_device_clock", JaxNvfp4DeviceClockCpu, JaxNvfp4DeviceClockCuda);
#else
    add("jax_nvfp4_moe_align", JaxNvfp4MoeAlignCpu, nullptr);
    add("jax_nvfp4_grouped_gemm", JaxNvfp4GroupedGemmCpu, nullptr);
    add("jax_nvfp4_moe_finalize", JaxNvfp4MoeFinalizeCpu, nullptr);
    add("jax_nvfp4_quant_dequant_rows", JaxNvfp4QuantDequantRowsCpu, nullptr);
    add("jax_nvfp4_moe_align_quant", JaxNvfp4MoeAlignQuantCpu, nullptr);
    add("jax_nvfp4_moe_align_gemm", JaxNvfp4MoeAlignGemmCpu, nullptr);
    add("jax_nvfp4_device_clock", JaxNvfp4DeviceClockCpu, nullptr);
#endif
    return regs;
  }, "XLA FFI handlers of this build: target name -> {platform ('cpu', 'CUDA') -> PyCapsule}.");

  m.def("constants", []() {
    using namespace jax_nvfp4;
    nb::dict c;
    nb::dict act, rs, mode, kf;
    act["identity"] = int64_t(Activation::kIdentity);
    act["swiglu"] = int64_t(Activation::kSwiglu);
    act["geglu"] = int64_t(Activation::kGeglu);
    act["relu2"] = int64_t(Activation::kRelu2);
    act["swiglu_oai"] = int64_t(Activation::kSwigluOai);
    rs["none"] = int64_t(RowScale::kNone);
    rs["token"] = int64_t(RowScale::kToken);
    rs["pair"] = int64_t(RowScale::kPair);
    rs["row"] = int64_t(RowScale::kRow);
    mode["bf16"] = int64_t(Mode::kBf16);
    mode["w4a16"] = int64_t(Mode::kW4A16);
    mode["w4a4"] = int64_t(Mode::kW4A4);
    c["Activation"] = act;
    c["RowScale"] = rs;
    c["Mode"] = mode;
    kf["no_wgmma"] = int64_t(KernelFlag::kNoWgmma);
    kf["wgmma_two_blocks"] = int64_t(KernelFlag::kWgmmaTwoBlocks);
    kf["jax_quant"] = int64_t(KernelFlag::kJaxQuant);
    kf["row_tiles_first"] = int64_t(KernelFlag::kRowTilesFirst);
    kf["pdl"] = int64_t(KernelFlag::kPdl);
    kf["natural_intermediate"] = int64_t(KernelFlag::kNaturalIntermediate);
    kf["plain_weight_loads"] = int64_t(KernelFlag::kPlainWeightLoads);
    kf["no_warp_specialized"] = int64_t(KernelFlag::kNoWarpSpecialized);
    kf["ws_gemm2"] = int64_t(KernelFlag::kWsGemm2);
    kf["no_persistent"] = int64_t(KernelFlag::kNoPersistent);
    kf["tma_persistent"] = int64_t(KernelFlag::kTmaPersistent);
    kf["align_one_cta"] = int64_t(KernelFlag::kAlignOneCta);
    kf["separate_x_quant"] = int64_t(KernelFlag::kSeparateXQuant);
    kf["ws_three_groups"] = int64_t(KernelFlag::kWsThreeGroups);
    kf["ws_two_blocks"] = int64_t(KernelFlag::kWsTwoBlocks);
    kf["separate_align"] = int64_t(KernelFlag::kSeparateAlign);
    kf["quant_narrow_rows"] = int64_t(KernelFlag::kQuantNarrowRows);
    kf["activations_in_loop"] = int64_t(KernelFlag::kActivationsInLoop);
    kf["tma_gemm2"] = int64_t(KernelFlag::kTmaGemm2);
    kf["rows96"] = int64_t(KernelFlag::kRows96);
    kf["no_rows96"] = int64_t(KernelFlag::kNoRows96);
    c["KernelFlag"] = kf;
    nb::dict pairing;
    pairing["none"] = int64_t(Pairing::kNone);
    pairing["a"] = int64_t(Pairing::kA);
    pairing["out"] = int64_t(Pairing::kOut);
    pairing["blocked_w"] = int64_t(Pairing::kBlockedW);
    pairing["chunk_a"] = int64_t(Pairing::kChunkA);
    pairing["chunk_out"] = int64_t(Pairing::kChunkOut);
    c["Pairing"] = pairing;
    nb::list tiles;
    for (int t : kTileMs) tiles.append(t);
    c["tile_ms"] = tiles;
    nb::list splits;
    for (int s : kKSplits) splits.append(s);
    c["k_splits"] = splits;
    c["max_split_tile_m"] = kMaxSplitTileM;
    c["max_align_experts"] = kMaxAlignExperts;
    c["align_one_warp_pairs"] = kAlignOneWarpPairs;
    c["align_grid_min_pairs"] = kAlignGridMinPairs;
    c["align_grid_max_slots"] = kAlignGridMaxSlots;
    c["cuda_k_multiple"] = kCudaKMultiple;
    c["cuda_n_multiple"] = kCudaNMultiple;
    c["all_kernel_flags"] = kAllKernelFlags;
    nb::list bits;
    for (int b : kBlockedBitPos) bits.append(b);
    c["blocked_bit_pos"] = bits;
    return c;
  }, "Enum values and tiling limits shared with the kernels (jax_nvfp4._ffi_ops checks its mirror).");

  m.def("_selftest_decode", &SelfTestDecode,
        "Host check of the GPU kernels' E2M1 -> bf16 decode (every code in all 8 positions); returns #wrong.");
}
