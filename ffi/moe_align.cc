// moe_align on the CPU: sort token-expert pairs by local expert into tile-padded groups.
//
// Output contract (identical on the GPU, and what the pure-JAX twin computes):
//   group e occupies sorted rows [off[e], off[e] + pad(count[e])), off = exclusive sum of the
//   tile-padded counts in expert order; inside a group, pairs keep their order (p = t*k + j
//   ascending); sorted_ids[r] = p, or -1 for padding rows and unused rows at the end;
//   tile_expert[i] = the expert of tile i, or -1 past the last group;
//   pair_to_row[p] = r, or -1 for dropped pairs (id < 0 or outside the local expert slice).
#include "moe_common.h"
#include "moe_handlers.h"

namespace jax_nvfp4 {
namespace {

ffi::Error MoeAlignCpuImpl(ffi::Buffer<ffi::S32> topk_ids, ffi::Result<ffi::Buffer<ffi::S32>> sorted_ids,
                           ffi::Result<ffi::Buffer<ffi::S32>> tile_expert,
                           ffi::Result<ffi::Buffer<ffi::S32>> pair_to_row,
                           ffi::Result<ffi::Buffer<ffi::S32>> workspace, int64_t num_experts, int64_t expert_offset,
                           int64_t tile_m, int64_t kernel_flags) {
  int64_t n, P;
  if (auto err = CheckAlign("moe_align", topk_ids, num_experts, tile_m, *sorted_ids, *tile_expert,
                            *pair_to_row, int64_t(1) << 30, kernel_flags, &n, &P);
      err.failure())
    return err;
  // (The workspace is the GPU grid align's; checked here too, so that both platforms take the same call.)
  if (auto err = CheckAlignWorkspace("moe_align", *workspace, n); err.failure()) return err;
  AlignPairsCpu(topk_ids.typed_data(), n, num_experts, expert_offset, tile_m, P, sorted_ids->typed_data(),
                tile_expert->typed_data(), pair_to_row->typed_data());
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_nvfp4

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxNvfp4MoeAlignCpu, jax_nvfp4::MoeAlignCpuImpl, jax_nvfp4::sig::MoeAlign(xla::ffi::Ffi::Bind()));               // group padding
