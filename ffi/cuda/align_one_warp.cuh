// moe_align for small batches in one warp (AlignOneWarp), for moe_align's kernel and
// moe_align_quant's (quant_rows.cu), which runs it in the first CTA of the x quantize's launch;
// and its pieces for moe_align_gemm's GEMM1 (moe_gemm.cu), whose CTAs each align for their own tile
// (AlignTile) while the first one also writes the align's outputs.
#pragma once

#include "cuda/cuda_util.h"
#include "moe_common.h"

namespace jax_nvfp4 {

// Small batches (n <= 32 pairs, e.g. decode with T * k <= 32): warp 0 holds one pair per lane and
// does everything with warp collectives (no block scan, one barrier): groups from
// __match_any_sync, a group's first row from the padded sizes of the lower experts present.
// Same contract and bytes as MoeAlignKernel. The other warps of the CTA only help fill sorted_ids.
constexpr int kAlignSmallThreads = 128;
static_assert(kAlignOneWarpPairs == 32, "one pair per lane");

struct AlignArgs {
  const int32_t* ids;  // topk_ids, n of them
  int32_t n, tile_m;
  int64_t num_experts, offset, P;
  int32_t *sorted_ids, *tile_expert, *pair_to_row;
};

// The groups of the experts present: per lane of warp 0, its group's first row and expert (leaders),
// else -1; the rows of all groups.
struct AlignTable {
  int32_t start[32], expert[32], total;
};

// Warp 0: fills s (visible after a barrier) and returns this lane's expert (x: -1 dropped, -2 no
// pair) and sorted row (y).
__device__ __forceinline__ int2 AlignGroups(const AlignArgs& a, AlignTable& s) {
  const int lane = threadIdx.x & 31;
  const int32_t e = lane < a.n ? LocalExpert(a.ids[lane], a.offset, a.num_experts) : -2;
  const unsigned same = __match_any_sync(0xFFFFFFFFu, e);
  const unsigned lower = same & ((1u << lane) - 1u);
  const bool leader = e >= 0 && lower == 0;
  const int32_t padded = leader ? int32_t((__popc(same) + a.tile_m - 1) / a.tile_m * a.tile_m) : 0;
  int32_t start = 0, total = 0;  // rows of the present groups of lower experts; of all groups
  for (int j = 0; j < a.n; ++j) {  // (lanes from n on hold no pair)
    const int32_t ej = __shfl_sync(0xFFFFFFFFu, e, j), pj = __shfl_sync(0xFFFFFFFFu, padded, j);
    start += (pj > 0 && ej < e) ? pj : 0;
    total += pj;
  }
  s.start[lane] = leader ? start : -1;
  s.expert[lane] = leader ? e : -1;
  if (lane == 0) s.total = total;
  return make_int2(e, start + __popc(lower));
}

// The owner of the tile at sorted row row0: the present expert with the largest first row at or
// before it (-1 past the last group); n: the pairs (leaders are lanes below it).
__device__ __forceinline__ int32_t TileOwner(const AlignTable& s, int n, int64_t row0) {
  int32_t owner = -1, best = -1;
  if (row0 < s.total) {
    for (int j = 0; j < n; ++j) {
      if (s.expert[j] >= 0 && s.start[j] <= row0 && s.start[j] > best) {
        best = s.start[j];
        owner = s.expert[j];
      }
    }
  }
  return owner;
}

// After the -1 fill of sorted_ids, AlignGroups and a barrier: the rest of the outputs (er: this
// thread's AlignGroups result, (-2, 0) outside warp 0).
__device__ __forceinline__ void AlignWrite(const AlignArgs& a, const AlignTable& s, int2 er) {
  const int lane = threadIdx.x & 31;
  if (er.x >= 0) {
    a.sorted_ids[er.y] = lane;
    a.pair_to_row[lane] = er.y;
  } else if (er.x == -1) {
    a.pair_to_row[lane] = -1;
  }
  const int64_t tiles = a.P / a.tile_m;
  for (int64_t i = threadIdx.x; i < tiles; i += blockDim.x) a.tile_expert[i] = TileOwner(s, a.n, i * a.tile_m);
}

__device__ __forceinline__ void AlignOneWarp(const AlignArgs& a) {
  __shared__ AlignTable s;
  for (int64_t r = threadIdx.x; r < a.P; r += blockDim.x) a.sorted_ids[r] = -1;
  const int2 er = threadIdx.x < 32 ? AlignGroups(a, s) : make_int2(-2, 0);
  __syncthreads();  // the -1 fill and the group table are complete
  AlignWrite(a, s, er);
}

// In a GEMM CTA (any size >= 32 threads, all of them calling): the expert of row tile `tile` of bm
// rows, and its bm sorted ids in rows[] (shared memory); the `writer` CTA also writes the align's
// outputs, which later kernels read. Ends with a barrier.
__device__ __forceinline__ int32_t AlignTile(const AlignArgs& a, int64_t tile, int bm, bool writer, int32_t* rows) {
  __shared__ AlignTable s;
  if (writer)
    for (int64_t r = threadIdx.x; r < a.P; r += blockDim.x) a.sorted_ids[r] = -1;
  if (threadIdx.x < bm) rows[threadIdx.x] = -1;
  const int2 er = threadIdx.x < 32 ? AlignGroups(a, s) : make_int2(-2, 0);
  __syncthreads();
  const int64_t r = er.y - tile * bm;
  if (er.x >= 0 && r >= 0 && r < bm) rows[r] = int32_t(threadIdx.x);  // threadIdx.x < 32: the pair
  if (writer) AlignWrite(a, s, er);
  __syncthreads();
  return TileOwner(s, a.n, tile * bm);
}

}  // namespace jax_nvfp4
