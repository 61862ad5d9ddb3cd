// Pieces shared by the CUDA grouped GEMM kernels (moe_gemm.cu: mma.sync, any sm_90+/sm_100;
// moe_gemm_sm90.cu: wgmma, sm_90a prefill tiles): parameters, the weight-register chunk with
// its 16-byte loads, the E2M1/E4M3 decode helpers, row mapping and the fused epilogue.
#pragma once

#include <string>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "cuda/align_one_warp.cuh"
#include "moe_common.h"

namespace jax_nvfp4 {

constexpr int kWarpFeatures = 16;  // one m16 fragment of weight rows per warp
static_assert(kBlockRows == kWarpFeatures, "a blocked weight fragment is one warp's rows");

struct GemmParams {
  const uint16_t* a;          // [a_rows, K] bf16
  const uint8_t* w;           // [E, N, K/2] E2M1 pairs (rows, or blocked: Pairing::kBlockedW)
  const uint8_t* ws;          // [E, N, K/16] E4M3 bits (likewise)
  const float* alpha;         // [E]
  const float* alpha_up;      // [E]: a gated GEMM's up rows' (alpha itself, or alpha's second half: UpAlpha)
  BiasRef bias;               // [E, N] added after alpha * row scale (GEMM1's rows [gate; up]), or none
  const int32_t* sorted_ids;  // [P]
  const int32_t* tile_expert; // [P / tile_m]
  const float* row_scale;     // [row_scale_n]
  void* out;                  // [P, n_out] bf16 or fp32
  int64_t a_rows, K, N, n_out, E, P, row_scale_n;
  int32_t top_k, gather, activation, row_scale_mode;
  int32_t slabs_first;  // wgmma kernel: 1-D grid walking a row tile's feature slabs first
  int32_t pairing;      // Pairing bits (a's K / out's features paired, w blocked)
  int32_t tile_m;       // rows a tile (the align's group padding)
  AlignArgs align;      // align.ids set: the mma.sync kernel aligns in each CTA (moe_align_gemm), which
                        // then reads its tile's expert and rows from there, not tile_expert / sorted_ids
};

__device__ __forceinline__ uint32_t SmemU32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// a * b for bf16x2 (as fma with -0 so that it also assembles for sm_80-class PTX).
__device__ __forceinline__ uint32_t MulBf16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
  return d;
}

// Two E4M3 block-scale bytes (low 16 bits of `two`) -> {s0, s0} and {s1, s1} as bf16x2, each
// times 2^kScaleExp (exact: E4M3 has 3 mantissa bits and fits bf16's range after the shift;
// 0 stays 0, NaN stays NaN). The hardware converts E4M3 pairs to f16 pairs (sm_89+).
__device__ __forceinline__ void BlockScalesBf16x2(uint32_t two, uint32_t& s0, uint32_t& s1) {
  uint32_t h2;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(static_cast<unsigned short>(two & 0xFFFFu)));
  const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h2));
  constexpr float kShift = 0x1p118f;
  static_assert(kScaleExp == 118, "kShift is 2^kScaleExp");
  const __nv_bfloat162 b = __floats2bfloat162_rn(f.x * kShift, f.y * kShift);
  const uint32_t bits = *reinterpret_cast<const uint32_t*>(&b);
  s0 = __byte_perm(bits, 0, 0x1010);
  s1 = __byte_perm(bits, 0, 0x3232);
}

// The B-operand words of one 16-byte activation piece (8 actual k: x0..x7), in the order the
// decoded weight words pair them ({c0, c4}, {c1, c5}, {c2, c6}, {c3, c7}: DecodeE2M1x8). A piece
// stored in the paired order (PairedPos) already is these words.
__device__ __forceinline__ void PairActivations(const uint4& x, uint32_t (&b)[4]) {
  b[0] = __byte_perm(x.x, x.z, 0x5410);
  b[1] = __byte_perm(x.x, x.z, 0x7632);
  b[2] = __byte_perm(x.y, x.w, 0x5410);
  b[3] = __byte_perm(x.y, x.w, 0x7632);
}

// One 32-bit word of codes (8 k) of a weight row -> the four bf16x2 A words, times the
// block scale {s, s} (bf16 products, exact). BW: a word of the blocked order (its bits permuted).
template <bool BW>
__device__ __forceinline__ void DecodeScaled(uint32_t q, uint32_t s, uint32_t (&a)[4]) {
  if constexpr (BW)
    DecodeE2M1x8Blocked(q, a);
  else
    DecodeE2M1x8(q, a);
#pragma unroll
  for (int i = 0; i < 4; ++i) a[i] = MulBf16x2(a[i], s);
}

// 16 bytes / 2 bytes of weights through the read-only path. STREAM: not kept in L1 (weights are
// read once; L1 keeps the activations) and the L2 fetches the 256 aligned bytes around them (the
// row's next chunks), so more bytes are in flight per register than the loads themselves hold.
template <bool STREAM>
__device__ __forceinline__ uint4 LoadWeights16(const uint8_t* ptr) {
  if constexpr (STREAM) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(ptr));
    return v;
  } else {
    return __ldg(reinterpret_cast<const uint4*>(ptr));
  }
}
template <bool STREAM>
__device__ __forceinline__ uint32_t LoadScales2(const uint8_t* ptr) {
  unsigned short v;
  if constexpr (STREAM) {
    asm("ld.global.nc.L1::no_allocate.L2::256B.u16 %0, [%1];" : "=h"(v) : "l"(ptr));
  } else {
    v = __ldg(reinterpret_cast<const unsigned short*>(ptr));
  }
  return v;
}

// Where row n of expert e starts (codes w, scales s), as WeightRegs::Load reads it: the row's first
// bytes, or with BLOCKED (Pairing::kBlockedW) the row's bytes of its first 128-K block.
template <bool BLOCKED>
__device__ __forceinline__ void WeightRow(const GemmParams& p, int32_t e, int64_t n, const uint8_t*& w,
                                          const uint8_t*& s) {
  const int64_t K = p.K;
  if constexpr (BLOCKED) {
    w = p.w + int64_t(e) * p.N * (K / 2) + BlockedOffset(n, 0, K, kBlockCodeBytes);
    s = p.ws + int64_t(e) * p.N * (K / 16) + BlockedOffset(n, 0, K, kBlockScaleBytes);
  } else {
    w = p.w + (int64_t(e) * p.N + n) * (K / 2);
    s = p.ws + (int64_t(e) * p.N + n) * (K / 16);
  }
}

// One chunk of CH = 128 (or 64 for the K tail) along K for this thread's weight rows:
// CH/8 bytes of codes and CH/64 scale bytes per row.
template <int CH, int NF>
struct WeightRegs {
  uint32_t q[NF][2][4];
  uint32_t s[NF][2];  // scale bytes: byte 0 for the first 16 K of the thread's span, byte 1 next

  __device__ __forceinline__ void SetCodes(int j, int h, const uint4& v) {
    q[j][h][0] = v.x;
    q[j][h][1] = v.y;
    q[j][h][2] = v.z;
    q[j][h][3] = v.w;
  }

  // BLOCKED: wrow / srow point at the row's bytes of its first 128-K block in the blocked order
  // (Pairing::kBlockedW: a block of 16 rows x 128 K is 1 KB of codes and 128 bytes of scales), and
  // kc is a multiple of 128.
  template <bool STREAM = false, bool BLOCKED = false>
  __device__ __forceinline__ void Load(const uint8_t* const (&wrow)[NF][2], const uint8_t* const (&srow)[NF][2],
                                       int64_t kc, int t) {
    static_assert(!BLOCKED || CH == 128, "the blocked order has no 64-K tail chunks");
    static_assert(kBlockRows * kBlockCodeBytes == 8 * kBlockK && kBlockRows * kBlockScaleBytes == kBlockK,
                  "a block is 8 * 128 code bytes and 128 scale bytes (code_at, scale_at)");
    const int64_t code_at = BLOCKED ? kc * 8 : kc / 2;  // (kc / 128 blocks of 1 KB / 128 bytes)
    const int64_t scale_at = BLOCKED ? kc : kc / 16;
#pragma unroll
    for (int j = 0; j < NF; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if constexpr (CH == 128) {
          SetCodes(j, h, LoadWeights16<STREAM>(wrow[j][h] + code_at + 16 * t));
          s[j][h] = LoadScales2<STREAM>(srow[j][h] + scale_at + 2 * t);
        } else {
          const uint2 v = __ldg(reinterpret_cast<const uint2*>(wrow[j][h] + kc / 2 + 8 * t));
          SetCodes(j, h, make_uint4(v.x, v.y, 0, 0));
          s[j][h] = __ldg(srow[j][h] + kc / 16 + t);
        }
      }
    }
  }

  // scale[j][h][b]: block b of the thread's span of row (j, h) as {s, s} bf16x2 (BlockScalesBf16x2).
  __device__ __forceinline__ void BlockScales(uint32_t (&scale)[NF][2][2]) const {
#pragma unroll
    for (int j = 0; j < NF; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) BlockScalesBf16x2(s[j][h], scale[j][h][0], scale[j][h][1]);
  }
};

// The A fragment (m16n8k16, and a warp's share of the wgmma A) of step `half` of a piece, from
// the decoded words of rows g (rows[0]) and g + 8 (rows[1]): {g lo, g+8 lo, g hi, g+8 hi}.
__device__ __forceinline__ void AFragment(const uint32_t (&rows)[2][4], int half, uint32_t (&a)[4]) {
  a[0] = rows[0][2 * half];
  a[1] = rows[1][2 * half];
  a[2] = rows[0][2 * half + 1];
  a[3] = rows[1][2 * half + 1];
}

// pair / top_k in 32 bits (no 64-bit division routine): exact for pair >= 0 and top_k in
// [1, 2^31 - 1] (the handlers' check); callers use it only for pair >= 0.
__device__ __forceinline__ int64_t PairToken(const GemmParams& p, int32_t pair) {
  return int64_t(uint32_t(pair) / uint32_t(p.top_k));
}

// RowScaled's row_scale index for mode kToken / kPair / kRow, of sorted row r holding `pair` of `token`.
__device__ __forceinline__ int64_t RowScaleIndex(int64_t mode, int64_t pair, int64_t token, int64_t r) {
  return mode == int64_t(RowScale::kToken) ? token : mode == int64_t(RowScale::kPair) ? pair : r;
}

// Source row of a for sorted row r holding `pair` (sorted_ids[r]), or -1 (padding / out of range).
// DIV32: pair / top_k by PairToken (the wgmma kernels, and the batched Epilogue). The mma.sync
// kernels keep the 64-bit division elsewhere: with it and the batched epilogue loads everywhere,
// their code changed and DeepSeek-V3 layers at T=64/128 ran 2-3% slower on the H200 (BENCHMARKS.md
// session 19).
template <bool DIV32 = false>
__device__ __forceinline__ int64_t SourceRow(const GemmParams& p, int32_t pair, int64_t r) {
  if (pair < 0) return -1;
  const int64_t src = p.gather ? (DIV32 ? PairToken(p, pair) : int64_t(pair) / p.top_k) : r;
  return src < p.a_rows ? src : -1;
}
template <bool DIV32 = false>
__device__ __forceinline__ int64_t SourceRow(const GemmParams& p, int64_t r) {
  return SourceRow<DIV32>(p, p.sorted_ids[r], r);
}

__device__ __forceinline__ void Store(uint16_t* out, int64_t i, float v) {
  out[i] = __bfloat16_as_ushort(__float2bfloat16_rn(v));
}
__device__ __forceinline__ void Store(float* out, int64_t i, float v) { out[i] = v; }

// Expert e's row of GemmParams::bias (none without one).
__device__ __forceinline__ BiasRef ExpertBias(const GemmParams& p, int32_t e) { return p.bias.Row(e, p.N); }
// The biases of output feature n of an expert's bias row b: {gate row n, up row n_out + n (gated)}; 0 without.
__device__ __forceinline__ float2 FeatureBias(BiasRef b, int64_t n_out, int64_t n, bool gated) {
  return b ? make_float2(b[n], gated ? b[n_out + n] : 0.0f) : make_float2(0.0f, 0.0f);
}

// Epilogue of both kernels: thread (g, t) of a warp holds, for its 16 features feat0..+15,
// acc[j][m][2h + c] = feature feat0 + g + 8h of weight block j (gate / up), sorted row
// tile * 8FM + 8m + 2t + c (the m16n8 C layout, and the wgmma m64nN D layout per warp), whose pair is
// rows[8m + 2t + c] (the tile's sorted_ids, in global or shared memory).
// ACT: the activation, or -1 for p.activation (read per value). BATCHED: see kBatched.
template <int FM, int NF, bool GATED, typename OutT, int ACT, bool BATCHED = (FM >= 8)>
__device__ __forceinline__ void EpilogueAct(const GemmParams& p, int32_t e, int64_t tile, const int32_t* rows,
                                            int64_t feat0, const float (&acc)[NF][FM][4]) {
  constexpr int BM = FM * 8;
  const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
  const float alpha = p.alpha[e] * kDecodeBias;  // the 2^-8 left in the decoded weights
  const float alpha_up = GATED ? p.alpha_up[e] * kDecodeBias : 0.0f;
  const BiasRef bias = ExpertBias(p, e);
  const float2 fb[2] = {FeatureBias(bias, p.n_out, feat0 + g, GATED),
                        FeatureBias(bias, p.n_out, feat0 + g + 8, GATED)};
  // This thread's two output columns, once (a PairingPos per store was 3-4% of a GEMM's instructions).
  const int64_t col[2] = {PairingPos(p.pairing, Pairing::kOut, feat0 + g),
                          PairingPos(p.pairing, Pairing::kOut, feat0 + g + 8)};
  // 64-row tiles and the wgmma kernels' 32-row ones (and the mma.sync kernel's 64-row fallback) issue the loads of
  // the thread's 2FM rows (SourceRow, RowScaled) before any use or store: a store may alias them, and
  // each row's loads behind its own branch had waited in turn (H200: prefill layers 1.4-12% faster).
  // The 8-32-row decode tiles keep the loads in the store loop, as SourceRow keeps their division:
  // see there.
  constexpr bool kBatched = BATCHED;
  bool valid[FM][2];
  float rs[FM][2];  // row_scale's factor (1 without one), batched
  if constexpr (kBatched) {
    int32_t pair[FM][2];
#pragma unroll
    for (int m = 0; m < FM; ++m)
#pragma unroll
      for (int c = 0; c < 2; ++c) pair[m][c] = rows[8 * m + 2 * t + c];
#pragma unroll
    for (int m = 0; m < FM; ++m) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int64_t r = tile * BM + 8 * m + 2 * t + c;
        valid[m][c] = SourceRow<true>(p, pair[m][c], r) >= 0;
        const bool by_token = p.row_scale_mode == int32_t(RowScale::kToken);  // top_k checked in [1, 2^31 - 1] then
        const int64_t idx = RowScaleIndex(p.row_scale_mode, pair[m][c], by_token ? PairToken(p, pair[m][c]) : 0, r);
        rs[m][c] = p.row_scale_mode == int32_t(RowScale::kNone) ? 1.0f
                   : valid[m][c] && idx < p.row_scale_n     ? p.row_scale[idx]
                                                            : 0.0f;
      }
    }
  }
#pragma unroll
  for (int m = 0; m < FM; ++m) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int64_t r = tile * BM + 8 * m + 2 * t + c;
      const int32_t pair = kBatched ? 0 : rows[8 * m + 2 * t + c];
      if constexpr (!kBatched) valid[m][c] = SourceRow(p, pair, r) >= 0;
      // (RowScaled of 1 is the row's factor itself: alpha * it as RowScaled(alpha) computes it)
      const float f = kBatched ? rs[m][c]
                      : valid[m][c] ? RowScaled(1.0f, p.row_scale_mode, p.row_scale, p.row_scale_n, pair, p.top_k, r)
                                    : 1.0f;
      const float scale = alpha * f, up_scale = alpha_up * f;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int i = 2 * h + c;
        float v = 0.0f;
        if (valid[m][c]) {
          const float gate = acc[0][m][i] * scale + fb[h].x;
          const float up = GATED ? acc[NF - 1][m][i] * up_scale + fb[h].y : 0.0f;
          v = ApplyActivation(ACT >= 0 ? ACT : p.activation, gate, up);
        }
        Store(static_cast<OutT*>(p.out), r * p.n_out + col[h], v);
      }
    }
  }
}

template <int FM, int NF, bool GATED, typename OutT, bool BATCHED = (FM >= 8)>
__device__ __forceinline__ void Epilogue(const GemmParams& p, int32_t e, int64_t tile, const int32_t* rows,
                                         int64_t feat0, const float (&acc)[NF][FM][4]) {
  // Batched tiles (64 rows, and the wgmma kernels' 32) pick their activation once (the handlers pair
  // gated activations with gated kernels), not per value (H200 ncu, Qwen3 T=4096: GEMM2 503 -> 414 us,
  // GEMM1 582 -> 555; 2026-12-02). The decode tiles keep the switch per value, as their SASS was
  // measured (see kBatched).
  using A = Activation;
  constexpr bool B = BATCHED;
  if constexpr (!B) {
    EpilogueAct<FM, NF, GATED, OutT, -1, B>(p, e, tile, rows, feat0, acc);
  } else if constexpr (GATED) {
    if (p.activation == int32_t(A::kGeglu)) EpilogueAct<FM, NF, GATED, OutT, int(A::kGeglu), B>(p, e, tile, rows, feat0, acc);
    else if (p.activation == int32_t(A::kSwigluOai))
      EpilogueAct<FM, NF, GATED, OutT, int(A::kSwigluOai), B>(p, e, tile, rows, feat0, acc);
    else EpilogueAct<FM, NF, GATED, OutT, int(A::kSwiglu), B>(p, e, tile, rows, feat0, acc);
  } else {
    if (p.activation == int32_t(A::kRelu2)) EpilogueAct<FM, NF, GATED, OutT, int(A::kRelu2), B>(p, e, tile, rows, feat0, acc);
    else EpilogueAct<FM, NF, GATED, OutT, int(A::kIdentity), B>(p, e, tile, rows, feat0, acc);
  }
}

// The warp-specialized wgmma kernel (W4A16WgmmaWs) applies: chunk-ordered `a`, gathered (or not, with
// KernelFlag::kWsGemm2), and blocked weights, unless kNoWarpSpecialized; the handler's checks and
// LaunchWgmmaGemm's choice.
inline bool WarpSpecializedGemm(int64_t kernel_flags, int64_t pairing, bool gather) {
  return !(kernel_flags & int64_t(KernelFlag::kNoWarpSpecialized)) &&
         (gather || (kernel_flags & int64_t(KernelFlag::kWsGemm2))) && (pairing & int64_t(Pairing::kChunkA)) &&
         (pairing & int64_t(Pairing::kBlockedW));
}

// The sm_90a wgmma kernels (moe_gemm_sm90.cu) for 64-row tiles, and for 32-row ones with chunk-ordered
// `a`, with the variants of `kernel_flags` (kWgmmaTwoBlocks, kRowTilesFirst); Pairing::kChunkA runs the
// warp-specialized one where WarpSpecializedGemm says so (bf16 or fp32 out), else the TMA-fed one,
// and the caller must only ask for bf16-out, ungathered calls of the latter. Returns false when this
// build, device or tile_m cannot run them (the caller then launches the mma.sync kernel, or fails a
// kChunkA call); true once launched, or with `*error` set when the launch could not be prepared.
bool LaunchWgmmaGemm(const GemmParams& p, int64_t tile_m, bool gated, bool f32_out, int64_t kernel_flags,
                     cudaStream_t stream, std::string* error);

}  // namespace jax_nvfp4
