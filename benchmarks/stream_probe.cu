// HBM bandwidth of the decode GEMMs' weight access pattern, without the math: does the layout of
// the NVFP4 codes (not bytes in flight) cap the decode kernels at 1.4-2.6 TB/s (Nsight Compute,
// BENCHMARKS.md session 11)?
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/stream_probe benchmarks/stream_probe.cu && /tmp/stream_probe
//
// Each case streams the codes ([E, N, K/2] bytes) of the experts one MoE GEMM touches, with the
// grid, warp work split, registers-in-flight scheme and CTAs per SM of ffi/cuda/moe_gemm.cu's
// decode kernels (4 warps; a warp owns 16 features: 16 rows, or 32 for gate + up; k_split warps
// split K; lane (g, t) loads 16 bytes of rows g and g + 8 per 128-K chunk), and only XORs what it
// loads. Variants:
// - layout 0: row-major, as the checkpoint (a warp's load touches 8 rows x 64 bytes);
//   layout 1: 16-row fragments blocked by 128-K chunk (a fragment's chunk is 1 KB contiguous, so a
//   warp's load is 512 contiguous bytes and a warp streams one contiguous range per fragment);
// - hint: the streaming loads of the kernels (L1::no_allocate, L2::256B prefetch) or plain __ldg;
// - ahead: chunks in flight per warp beyond the one being consumed (the kernels use 1);
// - blocked, plain, ahead 1 with lane 0 asking the L2 for its fragments' next 4 or 8 chunks by
//   cp.async.bulk.prefetch.L2 (H200, 2026-12-04: 13-20% slower than without, as were the GEMMs
//   with them: BENCHMARKS.md session 32).
// Every case rotates over 8 disjoint expert sets (together above the H200's 60 MB L2) and reports the median of
// 20 timed launches; "copy" is a contiguous 16-byte-per-lane read of the same bytes at full
// occupancy, the ceiling. The shared memory that limits the CTAs per SM leaves ~28 KB of L1
// (the real kernels have ~200 KB; they read their activations through it). Nothing here is used
// by the library.
//
// Then the layer reads: the weight bytes (codes and block scales, both GEMMs) of the experts a decode
// row of issue 5's table hits, read once with no math at several grids: a floor under any kernel's
// layer time at that row, to set the 10x-ragged_dot target against (benchmarks/targets.py).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#define CHECK(x)                                                                   \
  do {                                                                             \
    cudaError_t err_ = (x);                                                        \
    if (err_ != cudaSuccess) {                                                     \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(err_)); \
      std::exit(1);                                                                \
    }                                                                              \
  } while (0)

struct Shape {
  const char* name;
  int experts;  // experts hit (one 8-row tile each)
  int n;        // weight rows per expert (gate + up for gated)
  int k;        // K (row bytes k / 2)
  bool gated;
  int k_split;
  int ctas_per_sm;  // the decode kernel's occupancy (registers), enforced with shared memory
};

struct Args {
  const uint8_t* w;
  int64_t row_bytes, n, n_out;
  int first_expert, slabs, k_split;
  uint32_t* sink;
};

template <bool HINT>
__device__ __forceinline__ uint4 Load16(const uint8_t* p) {
  if constexpr (HINT) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
  } else {
    return __ldg(reinterpret_cast<const uint4*>(p));
  }
}

// Byte offset of (row, chunk c, lane part t) within an expert's codes.
template <int LAYOUT>
__device__ __forceinline__ int64_t Offset(int64_t row, int64_t c, int t, int64_t row_bytes) {
  if constexpr (LAYOUT == 0) return row * row_bytes + c * 64 + 16 * t;
  const int64_t chunks = row_bytes / 64;
  return (((row / 16) * chunks + c) * 16 + row % 16) * 64 + 16 * t;
}

// Asks the L2 for `bytes` at p through the copy engine (sm_90 cp.async.bulk.prefetch.L2).
__device__ __forceinline__ void BulkPrefetchL2(const void* p, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}

// PF (blocked layout): lane 0 keeps the next PF chunks of each of its fragments asked of the L2.
template <int LAYOUT, bool HINT, int NF, int AHEAD, int PF = 0>
__global__ void __launch_bounds__(128) Stream(const Args a) {
  constexpr int D = AHEAD + 1;  // register buffers, rotated by unrolling
  extern __shared__ uint8_t occupancy_limiter[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int ns_count = 4 / a.k_split, ns = warp % ns_count, kw = warp / ns_count;
  const int64_t e = a.first_expert + blockIdx.x;
  const int64_t feat0 = (int64_t(blockIdx.y) * ns_count + ns) * 16;
  const uint8_t* base = a.w + e * a.n * a.row_bytes;
  const int64_t chunks = a.row_bytes / 64, c0 = chunks * kw / a.k_split, c1 = chunks * (kw + 1) / a.k_split;
  uint4 buf[D][NF][2];
  uint32_t acc = 0;
  auto load = [&](uint4 (&b)[NF][2], int64_t c) {
#pragma unroll
    for (int j = 0; j < NF; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        b[j][h] = Load16<HINT>(base + Offset<LAYOUT>(feat0 + g + 8 * h + j * a.n_out, c, t, a.row_bytes));
  };
  const auto prefetch = [&](int64_t c, int64_t n) {  // chunks [c, c + n), clipped to the span
    if constexpr (PF > 0 && LAYOUT == 1) {
      n = c + n < c1 ? n : c1 - c;
      if (lane != 0 || n <= 0) return;
#pragma unroll
      for (int j = 0; j < NF; ++j)
        BulkPrefetchL2(base + Offset<LAYOUT>(feat0 + j * a.n_out, c, 0, a.row_bytes), uint32_t(n * 1024));
    }
  };
  prefetch(c0 + AHEAD, PF);
#pragma unroll
  for (int s = 0; s < AHEAD; ++s)
    if (c0 + s < c1) load(buf[s], c0 + s);
  for (int64_t c = c0; c < c1; c += D) {
#pragma unroll
    for (int s = 0; s < D; ++s) {
      if (c + s < c1) {
        if (c + s + AHEAD < c1) load(buf[(s + AHEAD) % D], c + s + AHEAD);
        prefetch(c + s + AHEAD + PF, 1);
#pragma unroll
        for (int j = 0; j < NF; ++j)
#pragma unroll
          for (int h = 0; h < 2; ++h) acc ^= buf[s][j][h].x ^ buf[s][j][h].y ^ buf[s][j][h].z ^ buf[s][j][h].w;
      }
    }
  }
  if (acc == 0x9E3779B9u) a.sink[0] = acc + occupancy_limiter[0];  // (never true: keeps the loads)
}

__global__ void Copy(const uint4* w, int64_t n16, uint32_t* sink) {
  uint32_t acc = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n16; i += int64_t(gridDim.x) * blockDim.x) {
    const uint4 v = __ldg(w + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9E3779B9u) sink[0] = acc;
}

template <typename F>
float MedianUs(F&& launch, int sets) {
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  for (int i = 0; i < sets; ++i) launch(i);  // warm-up
  std::vector<float> us;
  for (int r = 0; r < 20; ++r) {
    CHECK(cudaEventRecord(start));
    launch(r % sets);
    CHECK(cudaEventRecord(stop));
    CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, start, stop));
    us.push_back(ms * 1000);
  }
  CHECK(cudaGetLastError());
  std::sort(us.begin(), us.end());
  CHECK(cudaEventDestroy(start));
  CHECK(cudaEventDestroy(stop));
  return us[us.size() / 2];
}

template <int LAYOUT, bool HINT, int NF, int AHEAD, int PF = 0>
float RunCase(const Shape& s, const uint8_t* w, uint32_t* sink, int sets, size_t smem) {
  auto kernel = Stream<LAYOUT, HINT, NF, AHEAD, PF>;
  CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared));
  int per_sm = 0;
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, 128, smem));
  if (per_sm != s.ctas_per_sm) std::printf("  (%s: %d CTAs per SM, not %d)\n", s.name, per_sm, s.ctas_per_sm);
  const int n_out = s.gated ? s.n / 2 : s.n;
  Args a{w, s.k / 2, s.n, s.gated ? n_out : 0, 0, n_out / (16 * 4 / s.k_split), s.k_split, sink};
  const dim3 grid(s.experts, a.slabs);
  return MedianUs([&](int set) {
    a.first_expert = set * s.experts;
    kernel<<<grid, 128, smem>>>(a);
  }, sets);
}

template <int LAYOUT, bool HINT, int NF>
void RunAhead(const Shape& s, const uint8_t* w, uint32_t* sink, int sets, size_t smem, double bytes) {
  const float t1 = RunCase<LAYOUT, HINT, NF, 1>(s, w, sink, sets, smem);
  const float t2 = RunCase<LAYOUT, HINT, NF, 2>(s, w, sink, sets, smem);
  const float t3 = RunCase<LAYOUT, HINT, NF, 3>(s, w, sink, sets, smem);
  std::printf("  %-28s layout %d hint %d | ahead 1: %7.1f us %5.2f TB/s | ahead 2: %7.1f us %5.2f TB/s | ahead 3: %7.1f us %5.2f TB/s\n",
              s.name, LAYOUT, int(HINT), t1, bytes / t1 * 1e-6, t2, bytes / t2 * 1e-6, t3, bytes / t3 * 1e-6);
}

template <int NF>
void RunShape(const Shape& s, const uint8_t* w, uint32_t* sink, int sets, int sms) {
  const double bytes = double(s.experts) * s.n * (s.k / 2);
  const size_t smem = size_t(228 * 1024 / s.ctas_per_sm - 1024 - 1024);  // at most ctas_per_sm per SM
  const int64_t n16 = int64_t(bytes) / 16;
  const float tc = MedianUs([&](int set) {
    Copy<<<sms * 16, 128>>>(reinterpret_cast<const uint4*>(w) + set * n16, n16, sink);
  }, sets);
  std::printf("%s: %d experts x %d rows x K %d (%.1f MB), k_split %d, %d CTAs of the decode grid, %d per SM; "
              "copy %.1f us %.2f TB/s\n",
              s.name, s.experts, s.n, s.k, bytes * 1e-6, s.k_split, s.experts * (s.gated ? s.n / 2 : s.n) / (64 / s.k_split),
              s.ctas_per_sm, tc, bytes / tc * 1e-6);
  RunAhead<0, true, NF>(s, w, sink, sets, smem, bytes);
  RunAhead<0, false, NF>(s, w, sink, sets, smem, bytes);
  RunAhead<1, true, NF>(s, w, sink, sets, smem, bytes);
  RunAhead<1, false, NF>(s, w, sink, sets, smem, bytes);
  const float p4 = RunCase<1, false, NF, 1, 4>(s, w, sink, sets, smem);
  const float p8 = RunCase<1, false, NF, 1, 8>(s, w, sink, sets, smem);
  std::printf("  %-28s layout 1 hint 0 | ahead 1 + bulk L2 prefetch 4 chunks: %7.1f us %5.2f TB/s | 8 chunks: %7.1f us %5.2f TB/s\n",
              s.name, p4, bytes / p4 * 1e-6, p8, bytes / p8 * 1e-6);
}

// A grid-stride read of n16 16-byte words, U loads in flight a thread.
template <int U, bool HINT>
__global__ void __launch_bounds__(256) ReadAll(const uint4* w, int64_t n16, uint32_t* sink) {
  uint32_t acc = 0;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  for (; i + (U - 1) * stride < n16; i += U * stride) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = Load16<HINT>(reinterpret_cast<const uint8_t*>(w + i + u * stride));
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < n16; i += stride) {
    const uint4 v = __ldg(w + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9E3779B9u) sink[0] = acc;
}

struct LayerRow {
  const char* name;
  int experts;                // experts hit (the benchmark's mean, rounded)
  int64_t weights_per_expert;  // GEMM1 rows x H + H x I
};

// Each row's bytes (0.5625 a weight: codes + E4M3 scales) read by ReadAll at 2-8 CTAs an SM, 1-4 loads in
// flight a thread, over disjoint copies that together exceed the L2 threefold (two for DeepSeek-V3's rows, eight for
// gpt-oss's GEMM2); the median of 20 launches per grid.
void RunLayerReads(int sms) {
  const LayerRow rows[] = {
      {"deepseek-v3 T=4", 21, (2 * 2048 + 2048) * 7168LL},
      {"deepseek-v3 T=16", 31, (2 * 2048 + 2048) * 7168LL},
      {"deepseek-v3 T=64", 32, (2 * 2048 + 2048) * 7168LL},
      {"qwen3 T=16", 84, (2 * 768 + 768) * 2048LL},
      // gpt-oss-120b T=1 (H = I = 2944 zero-padded blocked, 4 experts): the layer, and each GEMM's bytes alone.
      {"gpt-oss T=1", 4, 3 * 2944LL * 2944},
      {"gpt-oss T=1 GEMM1", 4, 2 * 2944LL * 2944},
      {"gpt-oss T=1 GEMM2", 4, 2944LL * 2944},
  };
  int l2 = 0;
  CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, 0));
  const auto n16_of = [](const LayerRow& r) { return r.experts * r.weights_per_expert * 9 / 16 / 16; };
  const auto sets_of = [&](int64_t n16) { return int(std::max<int64_t>(2, (3LL * l2 + n16 * 16 - 1) / (n16 * 16))); };
  int64_t most = 0;
  for (const LayerRow& r : rows) most = std::max(most, n16_of(r) * sets_of(n16_of(r)));
  uint4* w = nullptr;
  uint32_t* sink = nullptr;
  CHECK(cudaMalloc(&w, size_t(most) * 16));
  CHECK(cudaMalloc(&sink, 64));
  CHECK(cudaMemset(w, 0x5A, size_t(most) * 16));
  struct Grid { int per_sm, u; bool hint; };
  const Grid grids[] = {{2, 1, false}, {4, 1, false}, {8, 1, false}, {2, 2, false}, {4, 2, false},
                        {8, 2, false}, {2, 4, false}, {4, 4, false}, {4, 2, true}, {8, 2, true}};
  for (const LayerRow& r : rows) {
    const int64_t n16 = n16_of(r);
    const int sets = sets_of(n16);
    std::printf("layer read, %s: %d experts, %.1f MB, %d copies\n", r.name, r.experts, n16 * 16e-6, sets);
    float best = 1e30f;
    for (const Grid& g : grids) {
      auto kernel = g.u == 1 ? (g.hint ? ReadAll<1, true> : ReadAll<1, false>)
                  : g.u == 2 ? (g.hint ? ReadAll<2, true> : ReadAll<2, false>)
                             : (g.hint ? ReadAll<4, true> : ReadAll<4, false>);
      const float us = MedianUs([&](int set) { kernel<<<sms * g.per_sm, 256>>>(w + set * n16, n16, sink); }, sets);
      best = std::min(best, us);
      std::printf("  %d CTAs of 256 an SM, %d loads in flight%s: %7.1f us %5.2f TB/s\n", g.per_sm, g.u,
                  g.hint ? ", streaming hints" : "", us, n16 * 16 / us * 1e-6);
    }
    std::printf("  best: %.1f us, %.2f TB/s\n", best, n16 * 16 / best * 1e-6);
  }
  CHECK(cudaFree(w));
  CHECK(cudaFree(sink));
}

int main() {
  // The GEMMs of the benchmark's decode rows (moe_bench.py shapes; k_split and occupancy as the
  // library chooses them on the H200 since 2026-12-01's refit: blocked gated 8-row kernels 116-122
  // registers -> 4 CTAs per SM, non-gated 64 -> 8; Qwen3 T=4 GEMM1 also at the splits it gave up).
  const Shape shapes[] = {
      {"qwen3 T=4 GEMM1", 30, 1536, 2048, true, 1, 4},
      {"qwen3 T=4 GEMM1 ks2", 30, 1536, 2048, true, 2, 4},
      {"qwen3 T=4 GEMM1 ks4", 30, 1536, 2048, true, 4, 4},
      {"qwen3 T=4 GEMM2", 30, 2048, 768, false, 1, 8},
      {"deepseek-v3 T=1 GEMM1", 8, 4096, 7168, true, 4, 4},
      {"deepseek-v3 T=1 GEMM2", 8, 7168, 2048, false, 2, 8},
      {"gpt-oss-120b T=1 GEMM1", 4, 2 * 2944, 2944, true, 2, 4},
      {"gpt-oss-120b T=1 GEMM2", 4, 2944, 2944, false, 2, 8},
      {"gpt-oss-120b T=1 GEMM2 ks4", 4, 2944, 2944, false, 4, 8},
  };
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  constexpr int kSets = 8;  // disjoint expert sets rotated over, > the L2 together
  size_t most = 0;
  for (const Shape& s : shapes) most = std::max(most, size_t(s.experts) * s.n * (s.k / 2));
  uint8_t* w = nullptr;
  uint32_t* sink = nullptr;
  CHECK(cudaMalloc(&w, most * kSets));
  CHECK(cudaMalloc(&sink, 64));
  CHECK(cudaMemset(w, 0x5A, most * kSets));
  for (const Shape& s : shapes) s.gated ? RunShape<2>(s, w, sink, kSets, sms) : RunShape<1>(s, w, sink, kSets, sms);
  CHECK(cudaFree(w));
  CHECK(cudaFree(sink));
  RunLayerReads(sms);
  return 0;
}
