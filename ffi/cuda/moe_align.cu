// moe_align on the GPU: one CTA sorts the T*k token-expert pairs by local expert into
// tile-padded groups (same contract as ffi/moe_align.cc). Deterministic and stable: each of
// the 16 warps owns a contiguous segment of pairs; per-warp histograms (shared-memory atomics
// only count) give every warp its base row per expert, and ranks inside a 32-pair step come
// from __match_any_sync, so pair p always lands on the same row. Graph-safe: fixed launch,
// no host sync, group sizes never leave the device.
#include <cub/block/block_scan.cuh>

#include <algorithm>

#include "cuda/align_one_warp.cuh"
#include "cuda/cuda_util.h"
#include "moe_common.h"
#include "moe_handlers.h"

namespace jax_nvfp4 {
namespace {

constexpr int kAlignWarps = 16;
constexpr int kAlignThreads = kAlignWarps * 32;
static_assert(kMaxAlignExperts <= kAlignThreads, "one expert per thread in the scan");

// Local experts of pairs i, i + 32, ..., i + 32 (kAlignBatch - 1) (one lane's share of a warp's
// batch), -2 past `end`: all loads are issued before any is used.
constexpr int kAlignBatch = 8;
__device__ __forceinline__ void LoadExperts(const int32_t* __restrict__ ids, int64_t i, int64_t end, int64_t offset,
                                            int64_t num_experts, int32_t (&e)[kAlignBatch]) {
  int32_t id[kAlignBatch];
#pragma unroll
  for (int b = 0; b < kAlignBatch; ++b) id[b] = i + 32 * b < end ? ids[i + 32 * b] : 0;
#pragma unroll
  for (int b = 0; b < kAlignBatch; ++b) e[b] = i + 32 * b < end ? LocalExpert(id[b], offset, num_experts) : -2;
}

// The passes of the block-wide align, shared by the one-CTA kernel and the grid's. A CTA owns the
// pairs [begin, end); its 16 warps own consecutive segments of them. `hist` is [kAlignWarps][E].

// Warp w's count of each expert over its segment into hist[w][e] (zeroed by the caller).
__device__ __forceinline__ void WarpCounts(const int32_t* __restrict__ ids, int64_t wbegin, int64_t wend,
                                           int64_t offset, int64_t num_experts, int32_t* hist, int lane) {
  // Both passes over the warp's pairs load kAlignBatch of them per lane before using any (one load in
  // flight per lane: 54.4 us for 32768 pairs, Qwen3 T=4096; batched: 51.6, ncu on two H200s).
  int32_t eb[kAlignBatch];
  for (int64_t i0 = wbegin; i0 < wend; i0 += 32 * kAlignBatch) {
    LoadExperts(ids, i0 + lane, wend, offset, num_experts, eb);
#pragma unroll
    for (int b = 0; b < kAlignBatch; ++b)
      if (eb[b] >= 0) atomicAdd(&hist[eb[b]], 1);
  }
}

// Thread e < E: hist[.][e] becomes each warp's exclusive prefix inside expert e; returns the CTA's
// count of e (0 for the other threads).
__device__ __forceinline__ int32_t WarpPrefixes(int32_t* hist, int E, int tid) {
  int32_t count = 0;
  if (tid < E) {
    for (int w = 0; w < kAlignWarps; ++w) {
      const int32_t c = hist[w * E + tid];
      hist[w * E + tid] = count;
      count += c;
    }
  }
  return count;
}

using AlignScan = cub::BlockScan<int32_t, kAlignThreads>;

// Thread e < E holds expert e's count: off[e] becomes the first row of its tile-padded group and
// *total (thread 0) the rows of all groups; returns off[e]. The caller syncs before reading them.
__device__ __forceinline__ int32_t GroupOffsets(int32_t count, int32_t tile_m, int E, int tid,
                                                AlignScan::TempStorage& scan_tmp, int32_t* off, int32_t* total) {
  const int32_t padded = (count + tile_m - 1) / tile_m * tile_m;
  int32_t start, all;
  AlignScan(scan_tmp).ExclusiveSum(padded, start, all);
  if (tid < E) off[tid] = start;
  if (tid == 0) *total = all;
  return start;
}

// tile_expert[i] for i = first, first + stride, ...: the last expert whose group (first row off[e])
// starts at or before the tile (binary search), -1 past the used rows.
__device__ __forceinline__ void TileOwners(const int32_t* off, int E, int32_t total, int32_t tile_m, int64_t P,
                                           int64_t first, int64_t stride, int32_t* __restrict__ tile_expert) {
  const int64_t tiles = P / tile_m;
  for (int64_t i = first; i < tiles; i += stride) {
    const int64_t row0 = i * tile_m;
    int32_t owner = -1;
    if (row0 < total) {
      int lo = 0, hi = E - 1;  // off[lo] <= row0 always (off[0] = 0)
      while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (off[mid] <= row0) lo = mid; else hi = mid - 1;
      }
      owner = lo;
    }
    tile_expert[i] = owner;
  }
}

// Stable ranks over warp w's segment, 32 pairs per step in order: pair i of expert e goes to row
// base[e] + hist[w][e] + (its rank among the step's pairs of e); the group's leader advances hist.
__device__ __forceinline__ void WarpRanks(const int32_t* __restrict__ ids, int64_t wbegin, int64_t wend,
                                          int64_t offset, int64_t num_experts, const int32_t* base, int32_t* hist,
                                          int lane, int32_t* __restrict__ sorted_ids,
                                          int32_t* __restrict__ pair_to_row) {
  const unsigned lt_mask = (1u << lane) - 1u;
  int32_t eb[kAlignBatch];
  for (int64_t i00 = wbegin; i00 < wend; i00 += 32 * kAlignBatch) {
    LoadExperts(ids, i00 + lane, wend, offset, num_experts, eb);
#pragma unroll
    for (int b = 0; b < kAlignBatch; ++b) {
      const int64_t i = i00 + 32 * b + lane;
      const int32_t e = eb[b];
      const unsigned same = __match_any_sync(0xFFFFFFFFu, e);
      if (e >= 0) {
        const int32_t row = base[e] + hist[e] + __popc(same & lt_mask);
        sorted_ids[row] = int32_t(i);
        pair_to_row[i] = row;
      } else if (e == -1) {
        pair_to_row[i] = -1;
      }
      __syncwarp();
      if (e >= 0 && (same & lt_mask) == 0) hist[e] += __popc(same);
      __syncwarp();
    }
  }
}

// Warp `warp`'s segment of the CTA's pairs [begin, end).
__device__ __forceinline__ void WarpSegment(int64_t begin, int64_t end, int warp, int64_t* wbegin, int64_t* wend) {
  const int64_t seg = (end - begin + kAlignWarps - 1) / kAlignWarps;
  *wbegin = begin + warp * seg < end ? begin + warp * seg : end;
  *wend = *wbegin + seg < end ? *wbegin + seg : end;
}

__global__ void __launch_bounds__(kAlignThreads)
    MoeAlignKernel(const int32_t* __restrict__ ids, int64_t n, int64_t num_experts, int64_t offset,
                   int32_t tile_m, int64_t P, int32_t* __restrict__ sorted_ids,
                   int32_t* __restrict__ tile_expert, int32_t* __restrict__ pair_to_row) {
  GridDependencyWait();
  __shared__ AlignScan::TempStorage scan_tmp;
  __shared__ int32_t s_total;
  extern __shared__ int32_t smem[];
  const int E = int(num_experts);
  int32_t* hist = smem;                      // [kAlignWarps][E]: counts, then running bases
  int32_t* off = smem + kAlignWarps * E;     // [E]: first row of each group
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;

  for (int i = tid; i < kAlignWarps * E; i += kAlignThreads) hist[i] = 0;
  for (int64_t r = tid; r < P; r += kAlignThreads) sorted_ids[r] = -1;
  __syncthreads();
  int64_t wbegin, wend;
  WarpSegment(0, n, warp, &wbegin, &wend);
  WarpCounts(ids, wbegin, wend, offset, num_experts, hist + warp * E, lane);
  __syncthreads();
  GroupOffsets(WarpPrefixes(hist, E, tid), tile_m, E, tid, scan_tmp, off, &s_total);
  __syncthreads();
  TileOwners(off, E, s_total, tile_m, P, tid, kAlignThreads, tile_expert);
  WarpRanks(ids, wbegin, wend, offset, num_experts, off, hist + warp * E, lane, sorted_ids, pair_to_row);
}

// The grid align (n >= kAlignGridMinPairs, unless KernelFlag::kAlignOneCta): two kernels, so that
// the serial rank steps and the scattered row stores of a large batch spread over many SMs (one CTA
// takes 51 us for 32768 pairs, ncu). CTA g of G owns the pairs [g n / G, (g + 1) n / G) (G E <=
// kAlignGridMaxSlots); `counts` (the call's workspace, [G][E]) carries the CTAs' per-expert counts
// from the first kernel to the second. Same bytes as MoeAlignKernel.
//  1. MoeAlignGridCount: the CTA's count of each expert; sorted_ids filled with -1.
//  2. MoeAlignGridRanks: every CTA reads all the counts, takes the group offsets and its first row
//     of each expert from them, writes its share of the tile owners, then the one-CTA kernel's
//     stable ranks. (Until 2026-12-04 a one-CTA kernel between the two took the offsets and the
//     first rows, through pair_to_row: 12.3 us of Qwen3-30B-A3B T=4096's 22.2 us align, ncu.)
constexpr int64_t kAlignGridMaxCtas = 64;
constexpr int64_t kAlignGridPairsPerCta = 512;
constexpr int kAlignGridSlotsPerThread = int(kAlignGridMaxSlots / kAlignThreads);
static_assert(kAlignGridMaxSlots % kAlignThreads == 0, "a thread's share of the counts, loaded at once");
static_assert(kAlignWarps * kMaxAlignExperts <= kAlignGridMaxSlots, "the counts' shared memory holds hist");

// The first pair of CTA g of `ctas` (ranges of floor(n / ctas) pairs or one more).
__device__ __forceinline__ int64_t CtaBegin(int64_t n, int64_t g, int64_t ctas) { return g * n / ctas; }

__global__ void __launch_bounds__(kAlignThreads)
    MoeAlignGridCount(const int32_t* __restrict__ ids, int64_t n, int64_t num_experts, int64_t offset, int64_t P,
                      int32_t* __restrict__ sorted_ids, int32_t* __restrict__ counts) {
  GridDependencyWait();
  extern __shared__ int32_t smem[];
  const int E = int(num_experts);
  int32_t* hist = smem;  // [kAlignWarps][E]
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  for (int i = tid; i < kAlignWarps * E; i += kAlignThreads) hist[i] = 0;
  for (int64_t r = blockIdx.x * int64_t(kAlignThreads) + tid; r < P; r += int64_t(gridDim.x) * kAlignThreads)
    sorted_ids[r] = -1;
  __syncthreads();
  int64_t wbegin, wend;
  WarpSegment(CtaBegin(n, blockIdx.x, gridDim.x), CtaBegin(n, blockIdx.x + 1, gridDim.x), warp, &wbegin, &wend);
  WarpCounts(ids, wbegin, wend, offset, num_experts, hist + warp * E, lane);
  __syncthreads();
  const int32_t count = WarpPrefixes(hist, E, tid);
  if (tid < E) counts[blockIdx.x * E + tid] = count;
}

__global__ void __launch_bounds__(kAlignThreads)
    MoeAlignGridRanks(const int32_t* __restrict__ ids, int64_t n, int64_t num_experts, int64_t offset,
                      int32_t tile_m, int64_t P, const int32_t* __restrict__ counts, int32_t* __restrict__ sorted_ids,
                      int32_t* __restrict__ tile_expert, int32_t* __restrict__ pair_to_row) {
  GridDependencyWait();
  __shared__ AlignScan::TempStorage scan_tmp;
  __shared__ int32_t s_total;
  __shared__ int32_t off[kMaxAlignExperts];   // first row of each group
  __shared__ int32_t base[kMaxAlignExperts];  // the first row of this CTA's pairs of each expert
  __shared__ int32_t part[2][kAlignThreads];  // per (CTA segment, expert): its count, and this CTA's share
  extern __shared__ int32_t smem[];           // [ctas][E] counts, then [kAlignWarps][E] hist
  const int E = int(num_experts), ctas = int(gridDim.x), me = int(blockIdx.x);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, nslots = ctas * E;
  // All CTAs' counts, a thread's loads in flight together (the old one-CTA kernel reading them a few
  // at a time stalled on them: 7.4 long-scoreboard stalls an issue, ncu).
  int32_t v[kAlignGridSlotsPerThread];
#pragma unroll
  for (int j = 0; j < kAlignGridSlotsPerThread; ++j) {
    const int i = tid + j * kAlignThreads;
    v[j] = i < nslots ? counts[i] : 0;
  }
#pragma unroll
  for (int j = 0; j < kAlignGridSlotsPerThread; ++j)
    if (tid + j * kAlignThreads < nslots) smem[tid + j * kAlignThreads] = v[j];
  __syncthreads();
  // Q threads an expert sum a segment of the CTAs each: the expert's count, and the pairs of CTAs
  // before this one (its first row past the group's start).
  const int Q = min(kAlignThreads / E, ctas);
  if (tid < Q * E) {
    const int e = tid % E, q = tid / E;
    int32_t all = 0, before = 0;
    for (int g = q * ctas / Q; g < (q + 1) * ctas / Q; ++g) {
      const int32_t c = smem[g * E + e];
      all += c;
      before += g < me ? c : 0;
    }
    part[0][tid] = all;
    part[1][tid] = before;
  }
  __syncthreads();
  int32_t count = 0, before = 0;
  if (tid < E) {
    for (int q = 0; q < Q; ++q) {
      count += part[0][q * E + tid];
      before += part[1][q * E + tid];
    }
  }
  const int32_t start = GroupOffsets(count, tile_m, E, tid, scan_tmp, off, &s_total);
  if (tid < E) base[tid] = start + before;
  int32_t* hist = smem;  // [kAlignWarps][E] (the counts are read)
  __syncthreads();
  TileOwners(off, E, s_total, tile_m, P, int64_t(me) * kAlignThreads + tid, int64_t(ctas) * kAlignThreads,
             tile_expert);
  for (int i = tid; i < kAlignWarps * E; i += kAlignThreads) hist[i] = 0;
  int64_t wbegin, wend;
  WarpSegment(CtaBegin(n, me, ctas), CtaBegin(n, me + 1, ctas), warp, &wbegin, &wend);
  __syncthreads();
  WarpCounts(ids, wbegin, wend, offset, num_experts, hist + warp * E, lane);
  __syncthreads();
  WarpPrefixes(hist, E, tid);
  __syncthreads();
  WarpRanks(ids, wbegin, wend, offset, num_experts, base, hist + warp * E, lane, sorted_ids, pair_to_row);
}

__global__ void __launch_bounds__(kAlignSmallThreads) MoeAlignOneWarpKernel(const AlignArgs a) {
  GridDependencyWait();
  AlignOneWarp(a);
}

ffi::Error MoeAlignCudaImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> topk_ids,
                            ffi::Result<ffi::Buffer<ffi::S32>> sorted_ids,
                            ffi::Result<ffi::Buffer<ffi::S32>> tile_expert,
                            ffi::Result<ffi::Buffer<ffi::S32>> pair_to_row, ffi::Result<ffi::Buffer<ffi::S32>> workspace,
                            int64_t num_experts, int64_t expert_offset, int64_t tile_m, int64_t kernel_flags) {
  int64_t n, P;
  if (auto err = CheckAlign("moe_align", topk_ids, num_experts, tile_m, *sorted_ids, *tile_expert,
                            *pair_to_row, kMaxAlignExperts, kernel_flags, &n, &P);
      err.failure())
    return err;
  if (auto err = CheckAlignWorkspace("moe_align", *workspace, n); err.failure()) return err;
  if (P == 0) return ffi::Error::Success();  // empty batch: nothing to write
  const bool pdl = kernel_flags & int64_t(KernelFlag::kPdl);
  const bool one_cta = kernel_flags & int64_t(KernelFlag::kAlignOneCta);
  if (!one_cta && n <= kAlignOneWarpPairs) {
    const AlignArgs a{topk_ids.typed_data(), int32_t(n), int32_t(tile_m), num_experts, expert_offset, P,
                      sorted_ids->typed_data(), tile_expert->typed_data(), pair_to_row->typed_data()};
    LaunchKernel(MoeAlignOneWarpKernel, 1, kAlignSmallThreads, 0, stream, pdl, a);
    return LaunchError("moe_align");
  }
  const size_t smem = sizeof(int32_t) * (kAlignWarps + 1) * num_experts;  // <= 34 KB
  if (!one_cta && n >= kAlignGridMinPairs) {
    const int64_t ctas =
        std::max<int64_t>(1, std::min({kAlignGridMaxCtas, kAlignGridMaxSlots / num_experts, n / kAlignGridPairsPerCta}));
    const int32_t* ids = topk_ids.typed_data();
    int32_t* counts = workspace->typed_data();
    LaunchKernel(MoeAlignGridCount, ctas, kAlignThreads, smem, stream, pdl, ids, n, num_experts, expert_offset, P,
                 sorted_ids->typed_data(), counts);
    const size_t rank_smem = sizeof(int32_t) * std::max<int64_t>(ctas, kAlignWarps) * num_experts;  // <= 32 KB
    LaunchKernel(MoeAlignGridRanks, ctas, kAlignThreads, rank_smem, stream, pdl, ids, n, num_experts, expert_offset,
                 int32_t(tile_m), P, counts, sorted_ids->typed_data(), tile_expert->typed_data(),
                 pair_to_row->typed_data());
    return LaunchError("moe_align");
  }
  LaunchKernel(MoeAlignKernel, 1, kAlignThreads, smem, stream, pdl, topk_ids.typed_data(), n, num_experts,
               expert_offset, int32_t(tile_m), P, sorted_ids->typed_data(), tile_expert->typed_data(),
               pair_to_row->typed_data());
  return LaunchError("moe_align");
}

}  // namespace
}  // namespace jax_nvfp4

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxNvfp4MoeAlignCuda, jax_nvfp4::MoeAlignCudaImpl,
                              jax_nvfp4::sig::MoeAlign(xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
                              {xla::ffi::Traits::kCmdBufferCompatible});
