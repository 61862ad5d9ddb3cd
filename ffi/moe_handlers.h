// XLA FFI handler symbols of the MoE ops, one per op and platform (module.cc exports them).
#pragma once

#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jax_nvfp4 {
// One signature per op, shared by the CPU handler and the CUDA handler (which binds its
// stream first): `Sig(ffi::Ffi::Bind())` or `Sig(ffi::Ffi::Bind().Ctx<PlatformStream<...>>())`.
namespace sig {
namespace ffi = xla::ffi;

template <typename B>
auto MoeAlign(B b) {
  return std::move(b)
      .template Arg<ffi::Buffer<ffi::S32>>()  // topk_ids [T, k] global ids
      .template Ret<ffi::Buffer<ffi::S32>>()  // sorted_ids [P]
      .template Ret<ffi::Buffer<ffi::S32>>()  // tile_expert [P / tile_m]
      .template Ret<ffi::Buffer<ffi::S32>>()  // pair_to_row [T, k]
      .template Ret<ffi::Buffer<ffi::S32>>()  // workspace [AlignWorkspaceSize(T k)] (the GPU grid's counts)
      .template Attr<int64_t>("num_experts")  // local experts E
      .template Attr<int64_t>("expert_offset")  // first local global id
      .template Attr<int64_t>("tile_m")  // group padding
      .template Attr<int64_t>("kernel_flags");  // KernelFlag bits (GPU kernel variants; 0: default)
}

template <typename B>
auto GroupedGemm(B b) {
  return std::move(b)
      .template Arg<ffi::Buffer<ffi::BF16>>()  // a [rows, K]
      .template Arg<ffi::Buffer<ffi::U8>>()  // w_data [E, N, K/2] E2M1 pairs
      .template Arg<ffi::AnyBuffer>()  // w_scales [E, N, K/16] float8_e4m3fn (or its bits as uint8)
      .template Arg<ffi::Buffer<ffi::F32>>()  // alpha [E] global decode scale ([2, E] gated: gate rows', up rows')
      .template Arg<ffi::AnyBuffer>()  // bias [E, N] f32 or bf16, added after alpha * row scale (or [0]: none)
      .template Arg<ffi::Buffer<ffi::S32>>()  // sorted_ids [P]
      .template Arg<ffi::Buffer<ffi::S32>>()  // tile_expert [P / tile_m]
      .template Arg<ffi::Buffer<ffi::F32>>()  // row_scale [n]
      .template Ret<ffi::AnyBuffer>()  // out [P, n_out] bf16 or f32
      .template Attr<int64_t>("activation")  // Activation enum
      .template Attr<int64_t>("row_scale_mode")  // RowScale enum
      .template Attr<int64_t>("top_k")  // k (pair -> token)
      .template Attr<int64_t>("gather")  // 1: a row = token of the pair
      .template Attr<int64_t>("tile_m")  // rows per tile
      .template Attr<int64_t>("k_split")  // warps splitting K (GPU decode tiling; 1, 2 or 4)
      .template Attr<int64_t>("pairing")  // Pairing bits: a's K / out's features paired, w blocked
      .template Attr<int64_t>("kernel_flags");  // KernelFlag bits (GPU kernel variants; 0: default)
}

// moe_align, then GEMM1 (grouped_gemm gathering the pairs' tokens) in one call (decode: at most
// kAlignOneWarpPairs pairs, 8-row tiles).
template <typename B>
auto MoeAlignGemm(B b) {
  return std::move(b)
      .template Arg<ffi::Buffer<ffi::S32>>()  // topk_ids [T, k] global ids
      .template Arg<ffi::Buffer<ffi::BF16>>()  // a [T, K]
      .template Arg<ffi::Buffer<ffi::U8>>()  // w_data [E, N, K/2] E2M1 pairs
      .template Arg<ffi::AnyBuffer>()  // w_scales [E, N, K/16] float8_e4m3fn (or its bits as uint8)
      .template Arg<ffi::Buffer<ffi::F32>>()  // alpha [E] global decode scale ([2, E] gated: gate rows', up rows')
      .template Arg<ffi::AnyBuffer>()  // bias [E, N] (or [0]: none), as GroupedGemm's
      .template Arg<ffi::Buffer<ffi::F32>>()  // row_scale [n]
      .template Ret<ffi::AnyBuffer>()  // out [P, n_out] bf16 or f32
      .template Ret<ffi::Buffer<ffi::S32>>()  // sorted_ids [P]
      .template Ret<ffi::Buffer<ffi::S32>>()  // tile_expert [P / tile_m]
      .template Ret<ffi::Buffer<ffi::S32>>()  // pair_to_row [T, k]
      .template Attr<int64_t>("expert_offset")  // first local global id (E local experts: w's)
      .template Attr<int64_t>("activation")  // Activation enum
      .template Attr<int64_t>("row_scale_mode")  // RowScale enum
      .template Attr<int64_t>("tile_m")  // rows per tile, group padding
      .template Attr<int64_t>("k_split")  // warps splitting K (GPU decode tiling; 1, 2 or 4)
      .template Attr<int64_t>("pairing")  // Pairing bits: out's features paired, w blocked
      .template Attr<int64_t>("kernel_flags");  // KernelFlag bits (GPU kernel variants; 0: default)
}

// moe_align and quant_dequant_rows of x in one call (decode: at most kAlignOneWarpPairs pairs).
template <typename B>
auto MoeAlignQuant(B b) {
  return std::move(b)
      .template Arg<ffi::Buffer<ffi::S32>>()  // topk_ids [T, k] global ids
      .template Arg<ffi::Buffer<ffi::BF16>>()  // x [T, K]
      .template Arg<ffi::Buffer<ffi::F32>>()  // input_scale [E, c] static scales (column 0) or [0] (per token)
      .template Ret<ffi::Buffer<ffi::S32>>()  // sorted_ids [P]
      .template Ret<ffi::Buffer<ffi::S32>>()  // tile_expert [P / tile_m]
      .template Ret<ffi::Buffer<ffi::S32>>()  // pair_to_row [T, k]
      .template Ret<ffi::Buffer<ffi::BF16>>()  // xq [T, K] ([T * k, K] static) decoded values without the row scale
      .template Ret<ffi::Buffer<ffi::F32>>()  // x_scale [T] ([T * k] static) per-row global decode scale
      .template Attr<int64_t>("num_experts")  // local experts E
      .template Attr<int64_t>("expert_offset")  // first local global id
      .template Attr<int64_t>("tile_m")  // group padding
      .template Attr<bool>("chunk_out")  // xq's rows in the wgmma chunk order
      .template Attr<int64_t>("kernel_flags");  // KernelFlag bits (GPU launch variants; 0: default)
}

template <typename B>
auto MoeFinalize(B b) {
  return std::move(b)
      .template Arg<ffi::Buffer<ffi::BF16>>()  // y [P, H] GEMM2 rows
      .template Arg<ffi::Buffer<ffi::S32>>()  // pair_to_row [T, k]
      .template Ret<ffi::Buffer<ffi::BF16>>()  // out [T, H]
      .template Attr<int64_t>("kernel_flags");  // KernelFlag bits (GPU launch variants; 0: default)
}

template <typename B>
auto QuantDequantRows(B b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()  // x [R, K] bf16 or f32
      .template Arg<ffi::Buffer<ffi::S32>>()  // row_ids [R] (< 0: unused row) or [0]
      .template Arg<ffi::Buffer<ffi::F32>>()  // row_weights [n] (scale[r] *= row_weights[row_ids[r]], 0 past n) or [0]
      .template Arg<ffi::Buffer<ffi::F32>>()  // input_scale [R * repeat] (static decode scale per out row), a table
                                               // [n, c] (with scale_ids) or [0] (per token)
      .template Arg<ffi::Buffer<ffi::S32>>()  // scale_ids [R * repeat / scale_group] or [0] (quant::StaticScales)
      .template Ret<ffi::Buffer<ffi::BF16>>()  // out [R * repeat, K] e2m1 * block scale (row r: x's row r / repeat)
      .template Ret<ffi::Buffer<ffi::F32>>()  // scale [R * repeat] per-row global decode scale
      .template Attr<bool>("chunk_out")  // out's K axis in the wgmma chunk order (ChunkPos)
      .template Attr<int64_t>("repeat")  // out rows per row of x (>= 1)
      .template Attr<int64_t>("scale_group")  // out rows per scale id
      .template Attr<int64_t>("scale_offset")  // subtracted from each scale id (the first local expert)
      .template Attr<int64_t>("scale_column")  // the table's column
      .template Attr<int64_t>("kernel_flags");  // KernelFlag bits (GPU launch variants; 0: default)
}

// Benchmark clock: passes x through (aliased) and records the time at which the stream reached
// it, so that a chain of layers can be timed between two such points without host jitter.
template <typename B>
auto DeviceClock(B b) {
  return std::move(b)
      .template Arg<ffi::AnyBuffer>()  // x, any shape and type
      .template Ret<ffi::AnyBuffer>()  // x, the same buffer (input_output_aliases)
      .template Ret<ffi::Buffer<ffi::U32>>();  // [2] nanoseconds, low and high 32-bit words
}
}  // namespace sig
}  // namespace jax_nvfp4

// CPU (plain C++ loops, fp32 accumulation): always built.
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxNvfp4MoeAlignCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxNvfp4GroupedGemmCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxNvfp4MoeFinalizeCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxNvfp4QuantDequantRowsCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxNvfp4MoeAlignQuantCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxNvfp4MoeAlignGemmCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxNvfp4DeviceClockCpu);

#ifdef JAX_NVFP4_WITH_CUDA
// CUDA (sm_90a / sm_100a), CUDA-graph compatible.
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxNvfp4MoeAlignCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxNvfp4GroupedGemmCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxNvfp4MoeFinalizeCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxNvfp4QuantDequantRowsCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxNvfp4MoeAlignQuantCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxNvfp4MoeAlignGemmCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxNvfp4DeviceClockCuda);
#endif
