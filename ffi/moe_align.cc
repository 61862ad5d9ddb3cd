// moe_align on the CPU: sort token-expert pairs by local expert into tile-padded groups.
//
// Output contract (identical on the GPU, and what the pure-JAX twin computes):
//   group e occupies sorted rows [off[e], off[e] + pad(count[e])), off = exclusive sum of the
//   tile-padded counts in expert order; inside a group, pairs keep their order (p = t*k + j
//   ascending); sorted_ids[r] = p, or -1 for padding rows and unused rows at the end;
//   tile_expert[i] = the expert of tile i, or -1 past the last group;
//   pair_to_row[p] = r, or -1 for dropped pairs (id < 0 or outside the local expert slice).
#include <algorithm>
#include <vector>

#include "moe_common.h"
#include "moe_handlers.h"

namespace jax_nvfp4 {
namespace {

ffi::Error MoeAlignCpuImpl(ffi::Buffer<ffi::S32> topk_ids, ffi::Result<ffi::Buffer<ffi::S32>> sorted_ids,
                           ffi::Result<ffi::Buffer<ffi::S32>> tile_expert,
                           ffi::Result<ffi::Buffer<ffi::S32>> pair_to_row, int64_t num_experts,
                           int64_t expert_offset, int64_t tile_m, int64_t kernel_flags) {
  int64_t n, P;
  if (auto err = CheckAlign("moe_align", topk_ids, num_experts, tile_m, *sorted_ids, *tile_expert,
                            *pair_to_row, int64_t(1) << 30, kernel_flags, &n, &P);
      err.failure())
    return err;
  const int32_t* ids = topk_ids.typed_data();
  int32_t* sid = sorted_ids->typed_data();
  int32_t* te = tile_expert->typed_data();
  int32_t* p2r = pair_to_row->typed_data();

  std::vector<int64_t> count(num_experts, 0), cursor(num_experts);
  for (int64_t p = 0; p < n; ++p) {
    int32_t e = LocalExpert(ids[p], expert_offset, num_experts);
    if (e >= 0) ++count[e];
  }
  int64_t total = 0;
  std::fill(te, te + P / tile_m, -1);
  for (int64_t e = 0; e < num_experts; ++e) {
    cursor[e] = total;
    const int64_t padded = (count[e] + tile_m - 1) / tile_m * tile_m;
    for (int64_t r = total; r < total + padded; r += tile_m) te[r / tile_m] = int32_t(e);
    total += padded;
  }
  std::fill(sid, sid + P, -1);
  for (int64_t p = 0; p < n; ++p) {
    int32_t e = LocalExpert(ids[p], expert_offset, num_experts);
    if (e < 0) {
      p2r[p] = -1;
      continue;
    }
    const int64_t r = cursor[e]++;
    sid[r] = int32_t(p);
    p2r[p] = int32_t(r);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_nvfp4

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxNvfp4MoeAlignCpu, jax_nvfp4::MoeAlignCpuImpl, jax_nvfp4::sig::MoeAlign(xla::ffi::Ffi::Bind()));               // group padding
