// moe_align for small batches in one warp (AlignOneWarp), for moe_align's kernel and
// moe_align_quant's (quant_rows.cu), which runs it in the first CTA of the x quantize's launch.
#pragma once

#include "cuda/cuda_util.h"
#include "moe_common.h"

namespace jax_nvfp4 {

// Small batches (n <= 32 pairs, e.g. decode with T * k <= 32): warp 0 holds one pair per lane and
// does everything with warp collectives (no block scan, one barrier): groups from
// __match_any_sync, a group's first row from the padded sizes of the lower experts present.
// Same contract and bytes as MoeAlignKernel. The other warps of the kAlignSmallThreads-thread
// CTA only help fill sorted_ids.
constexpr int kAlignSmallThreads = 128;
static_assert(kAlignOneWarpPairs == 32, "one pair per lane");

struct AlignArgs {
  const int32_t* ids;  // topk_ids, n of them
  int32_t n, tile_m;
  int64_t num_experts, offset, P;
  int32_t *sorted_ids, *tile_expert, *pair_to_row;
};

__device__ __forceinline__ void AlignOneWarp(const AlignArgs& a) {
  __shared__ int32_t s_start[32], s_expert[32];  // per lane: its group's first row and expert (leaders), else -1
  __shared__ int32_t s_total;
  const int tid = threadIdx.x, lane = tid & 31;
  for (int64_t r = tid; r < a.P; r += kAlignSmallThreads) a.sorted_ids[r] = -1;
  int32_t e = -2, row = 0;  // warp 0: this lane's pair's expert (-1 dropped, -2 no pair) and row
  if (tid < 32) {
    e = lane < a.n ? LocalExpert(a.ids[lane], a.offset, a.num_experts) : -2;
    const unsigned same = __match_any_sync(0xFFFFFFFFu, e);
    const unsigned lower = same & ((1u << lane) - 1u);
    const bool leader = e >= 0 && lower == 0;
    const int32_t padded = leader ? int32_t((__popc(same) + a.tile_m - 1) / a.tile_m * a.tile_m) : 0;
    int32_t start = 0, total = 0;  // rows of the present groups of lower experts; of all groups
    for (int j = 0; j < 32; ++j) {
      const int32_t ej = __shfl_sync(0xFFFFFFFFu, e, j), pj = __shfl_sync(0xFFFFFFFFu, padded, j);
      start += (pj > 0 && ej < e) ? pj : 0;
      total += pj;
    }
    row = start + __popc(lower);
    s_start[lane] = leader ? start : -1;
    s_expert[lane] = leader ? e : -1;
    if (lane == 0) s_total = total;
  }
  __syncthreads();  // the -1 fill and the group table are complete
  if (e >= 0) {
    a.sorted_ids[row] = lane;
    a.pair_to_row[lane] = row;
  } else if (e == -1) {
    a.pair_to_row[lane] = -1;
  }
  // Tile owners: the present expert with the largest first row at or before the tile.
  const int64_t tiles = a.P / a.tile_m;
  for (int64_t i = tid; i < tiles; i += kAlignSmallThreads) {
    const int64_t row0 = i * a.tile_m;
    int32_t owner = -1, best = -1;
    if (row0 < s_total) {
      for (int j = 0; j < 32; ++j) {
        if (s_expert[j] >= 0 && s_start[j] <= row0 && s_start[j] > best) {
          best = s_start[j];
          owner = s_expert[j];
        }
      }
    }
    a.tile_expert[i] = owner;
  }
}

}  // namespace jax_nvfp4
