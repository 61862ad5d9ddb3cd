// Shared by the CPU (ffi/*.cc) and CUDA (ffi/cuda/*.cu) MoE handlers: the enums that
// Python mirrors (jax_nvfp4/_ffi_ops.py), the activation math, the E2M1/E4M3 decode,
// and the shape checks, so both platforms accept and reject exactly the same calls.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__CUDACC__)
#define NVFP4_HD __host__ __device__ __forceinline__
#else
#define NVFP4_HD inline
#endif

namespace jax_nvfp4 {
namespace ffi = xla::ffi;

// ---- enums shared with Python (IntEnum with the same values) ----------------------------
enum class Activation : int64_t {
  kIdentity = 0,   // GEMM2: no activation
  kSwiglu = 1,     // silu(gate) * up
  kGeglu = 2,      // gelu_tanh(gate) * up
  kRelu2 = 3,      // relu(h)^2, not gated
  kSwigluOai = 4,  // gpt-oss: clamp, gate * sigmoid(1.702 gate) * (up + 1)
};
// Which index a GEMM's per-row fp32 scale (routing weight, w4a4 token scale) is read at,
// for sorted row r holding token-expert pair p = sorted_ids[r].
enum class RowScale : int64_t {
  kNone = 0,   // no row scale
  kToken = 1,  // row_scale[p / top_k]  (GEMM1 in w4a4: the token's activation scale)
  kPair = 2,   // row_scale[p]          (GEMM2 in w4a16: the routing weight, topk_weights.ravel())
  kRow = 3,    // row_scale[r]          (GEMM2 in w4a4: routing weight * intermediate scale)
};
// Kernel variants of the CUDA grouped GEMM (bit flags; 0 = the default choice). The result is
// the same function; they exist so that one benchmark run can compare variants side by side.
// The defaults are the winners of the H200 A/B of 2026-12-01 (BENCHMARKS.md); each flag names
// the alternative, so the same A/B can be run again.
enum class KernelFlag : int64_t {
  // 1: kRingDecodeLoop (decode weights through a shared-memory ring: cp.async, then tensor copies)
  // until 2026-12-01, removed: slower than registers on the H200 (moe_gemm.cu, DecodeLoop).
  kNoWgmma = 2,          // 64- and 32-row tiles: the mma.sync kernel instead of the sm_90a wgmma kernels
  kWgmmaTwoBlocks = 4,   // wgmma, non-gated: two 64-feature blocks per warpgroup instead of one
  kJaxQuant = 8,         // w4a4: per-token quantization in pure JAX instead of the quant_dequant_rows
                         // kernel (the GEMMs ignore it)
  kRowTilesFirst = 16,   // wgmma: consecutive CTAs take one feature slab's row tiles (L2 reuse of
                         // weights) instead of one row tile's slabs (L2 reuse of activations)
  // 32: kAlignOneWarp (moe_align with <= 32 pairs in one warp) opt-in until 2026-12-02, then the default
  // (kAlignOneCta names the alternative).
  kPdl = 64,             // every kernel launched with programmatic dependent launch (overlaps launches)
  kNaturalIntermediate = 128,  // moe: the GEMM1 -> GEMM2 intermediate in the natural order; the
                               // default on mma.sync tiles (8-32 rows) is the paired order, on wgmma
                               // tiles the chunk order (Pairing)
  // 256: kPairedInput (GEMM1's input paired) until 2026-12-01, removed: no gain on the H200.
  kPlainWeightLoads = 512,     // decode tiles (register loop): plain read-only weight loads everywhere,
                               // not the streaming hints (skip L1, prefetch 256 bytes into L2) where
                               // a warp's K span is >= 768
  // 1024 / 2048: kL2Prefetch / kSplitGateUp (decode tiles) for one H200 A/B on 2026-12-01, removed:
  // 2-76% and up to 17% slower.
  // 4096 / 8192: kWgmmaFourGroups (four warpgroups per one-block wgmma CTA) / kTmaGemm1 (GEMM1 on the
  // TMA-fed wgmma kernel, its rows gathered into the chunk order by XLA first) for H200 A/Bs on
  // 2026-12-02, removed: 6-12% / 4-12% slower prefill layers.
  kNoWarpSpecialized = 32768,  // 64-row tiles with blocked weights: GEMM1 on the staged wgmma kernel
                               // instead of the warp-specialized one (a producer warpgroup stages weights
                               // and gathered rows; H200, 2026-12-02: 14-17% faster w4a16 prefill layers,
                               // 1.33-1.45x faster w4a4 ones; 32-row tiles: the mma.sync kernel)
  kWsGemm2 = 65536,            // moe's GEMM2 (chunk-ordered `a`, not gathered) on the warp-specialized
                               // kernel too, instead of the TMA-fed one (64-row tiles: four MMA warpgroups of
                               // one block, staged stores: prefill layers x0.94-0.95, H200 2026-12-04; as three
                               // of two blocks, unstaged: 1.02-1.22x slower, sessions 17-19; as two groups of two MMA
                               // warpgroups, each with its own ring and 128-feature items, staged stores:
                               // 1.01-1.06x slower, session 30; moe sets it on 64-row tiles, and on 32-row
                               // tiles where I >= 1536: 8-9% faster decode layers, 2026-12-03)
  kNoPersistent = 131072,      // the warp-specialized kernel with a CTA per work item instead of a persistent
                               // grid (a CTA per SM walks the work items, its ring running on across them:
                               // prefill layers up to 1.8% faster, at most 0.6% slower on the H200, 2026-12-02)
  kTmaPersistent = 262144,     // the TMA-fed wgmma kernel (moe's GEMM2) on a persistent grid: as many CTAs as
                               // fit at once walk the work items, the next item's copies and first weight loads
                               // overlapping the last one's epilogue, instead of a CTA per item (H200, 2026-12-02:
                               // prefill layers x0.996-1.033, geomean x1.015; 38.7 items a CTA split unevenly;
                               // with the staged epilogue, session 21: x1.029-1.065, its loop 15% longer; with
                               // the chunk counter back on the uniform datapath, session 22: x0.993-1.012)
  kAlignOneCta = 524288,       // moe_align in one 512-thread CTA at any size, not in one warp up to 32 pairs
                               // (H200, 2026-12-02: Qwen3 T=1 layers 6% faster) nor on up to 64 CTAs from 2048
                               // pairs on (counts, then offsets and ranks: two kernels; as three, with a one-CTA
                               // offsets kernel, Qwen3 T=4096 layers were 4% faster, 957.6 -> 919.6 us: one
                               // CTA took 51 us for its 32768 pairs)
  kSeparateXQuant = 4194304,   // w4a4 decode (at most kAlignOneWarpPairs pairs): x quantized by its own launch
                               // after moe_align's, not by moe_align_quant's CTAs beside the align's (H200,
                               // 2026-12-03: fused, Qwen3 w4a4 T=1 / 4 layers x0.919 / x0.947, DeepSeek-V3 x0.975 / x0.988)
  kWsThreeGroups = 8388608,    // 32-row gated tiles (moe's GEMM1 at 9-24 rows an expert) on the warp-specialized
                               // kernel with three MMA warpgroups (192 features a work item) instead of four (256;
                               // H200, 2026-12-03: four give DeepSeek-V3 layers x0.90-0.91 at T = 48-64)
  kWsTwoBlocks = 16777216,     // 32-row non-gated bf16-out tiles, and 64-row ungathered ones, on the
                               // warp-specialized kernel (moe's GEMM2 with kWsGemm2) on three MMA warpgroups
                               // of two 64-feature blocks (384 features a work item, six stages) instead of
                               // four of one (256, eight stages; H200, 2026-12-03: DeepSeek-V3 layers
                               // x0.971-0.973 at T = 48-64, x0.987 at 96)
  kSeparateAlign = 33554432,   // w4a16 decode (at most kAlignOneWarpPairs pairs, 8-row tiles): moe_align in its own
                               // launch before GEMM1, not in every GEMM1 CTA (moe_align_gemm)
  kQuantNarrowRows = 134217728,  // quant_dequant_rows (and moe_align_quant's x) at any R as before 2026-12-03: rows
                                 // under 128 blocks on a warp, longer ones on 128 threads; not, up to 2048 rows, a
                                 // CTA a row of 128 threads, 512 over 128 blocks (quant_rows.cu; H200, 2026-12-03:
                                 // Qwen3 w4a4 layers x0.93-0.99 at T = 1-64 with a CTA a row of 128)
  kActivationsInLoop = 2147483648ll,  // gated 8-row decode tiles: a chunk's activations loaded as its pieces are
                                     // multiplied, not with its weights a chunk ahead where a warp spans >= 512 K
                                     // (H200, 2026-12-04: layers x0.92-0.99 ahead at 2048-7168 K, x0.96-0.99 at
                                     // 512-1024 K since the bit-permuted decode; moe_gemm.cu, kXAheadMinSpan)
  kTmaGemm2 = 4294967296ll,  // moe's GEMM2 on 64-row tiles on the TMA-fed kernel, not on the warp-specialized
                             // one (kWsGemm2: prefill layers x0.94-0.95 there, H200 2026-12-04); a moe policy:
                             // the GEMM kernels read it only in kAllKernelFlags)
  kRows96 = 8589934592ll,  // moe's GEMM2 (warp-specialized, staged stores) and gathered gated GEMM1 on 32- and
                           // 64-row tiles: work items of up to 96 rows of one expert's group (m64n96 wgmmas; a
                           // group's last item 32, 64 or 96 rows), not one tile each: a decoded weight chunk feeds up
                           // to 96 rows. GEMM1's warpgroups then pair up: one multiplies the gate rows, one the up
                           // rows of the same 64 features, and each stores half the rows from the other's sums.
                           // moe's default on 32-row tiles where its items cost less than 64-row tiles (choose_rows96,
                           // H200 2026-12-05: layers x0.71-0.98 there)
  kNoRows96 = 17179869184ll,  // moe without kRows96 where it would take it: a moe policy, no kernel reads it
  // 68719476736: kDeepDecode (8-row decode tiles on blocked weights with two 128-K chunks in flight a warp) for one
  // H100 A/B on 2026-12-07 (session 62), removed: layers x1.03-1.35 slower (moe_gemm.cu, MainLoop).
  // 536870912 / 1073741824: kBulkPrefetch / kBulkPrefetchFar (the mma.sync decode tiles on blocked weights, lane 0
  // of each warp keeping its fragments' next 4 / 8 chunks asked of the L2 by cp.async.bulk.prefetch.L2) for one H200
  // A/B on 2026-12-04 (session 32), removed: layers 1.00-1.28x slower (a stream of the same loads without the math,
  // benchmarks/stream_probe.cu, 1.13-1.20x slower with them; BENCHMARKS.md session 32).
  // 268435456: kSeparateFinalize for one H200 A/B on 2026-12-03 (session 31), when moe's w4a16 decode on
  // moe_align_gemm summed each of GEMM2's feature slabs in the slab's last CTA (moe_gemm_finalize: every CTA
  // counted itself by an atomic, the counters zeroed by moe_align_gemm), removed: layers 1.00-1.10x slower than
  // with the finalize's own launch at T = 1-4 (Qwen3-30B-A3B 1.04-1.10x, DeepSeek-V3 1.00-1.09x: the count's barrier
  // and round trip lengthen every short decode CTA; BENCHMARKS.md session 31).
  // 1048576 / 2097152: kPrefetchNext / kPrefetchNextLate (moe's GEMM1 decode CTAs warming their experts'
  // GEMM2 weights into L2 by bulk prefetches, before / after their main loop) for one H200 A/B on 2026-12-03,
  // removed: 4-13% / up to 12% slower decode layers (the prefetches take HBM bandwidth from GEMM1's loads).
  // 67108864: the w4a4 decode intermediate quantized by GEMM2's CTAs as they load it (RowScale kQuantRow = 4: each
  // 8-row CTA quantized its tile's whole fp32 rows into shared memory) for one H200 A/B on 2026-12-03, removed:
  // layers 1.06-1.50x slower than quant_dequant_rows' launch (every CTA of a row tile reads and quantizes whole rows:
  // DeepSeek-V3 T = 1, 64 KB a CTA; BENCHMARKS.md session 28).
  // 16384: kWgmmaTilePairs (the TMA-fed GEMM2 on pairs of one expert's 64-row tiles, m64n128 wgmmas,
  // one CTA per SM) for one H200 A/B on 2026-12-02, removed: 1.25-1.42x slower layers (dabc4ef).
};
constexpr int64_t kAllKernelFlags = 198148830 + 2147483648ll + 4294967296ll + 8589934592ll + 17179869184ll;
// grouped_gemm's `pairing` bits: which operands hold a kernel order instead of the natural one.
// kA / kOut: a's K axis / out's feature axis in the paired order (PairedPos). moe's intermediate
// uses it on mma.sync tiles (but with KernelFlag kNaturalIntermediate): GEMM1 writes it paired,
// GEMM2 reads it paired and skips its activation byte permutes. kChunkA / kChunkOut: the same axes
// in the wgmma chunk order (ChunkPos), moe's intermediate on 64- and 32-row wgmma tiles: a 128-K chunk of
// GEMM2's input is then its wgmma B tile as it is, which the tensor memory accelerator copies
// (moe_gemm_sm90.cu). kBlockedW: w_data and w_scales in the blocked order (BlockedOffset; same
// shapes, each expert's bytes permuted), so that a GPU warp's weight loads read contiguous bytes.
enum class Pairing : int64_t { kNone = 0, kA = 1, kOut = 2, kBlockedW = 4, kChunkA = 8, kChunkOut = 16 };
constexpr int64_t kAllPairing = 31;
constexpr int64_t kChunkK = 128;  // the chunk order permutes groups of 128
// The blocked weight order: per expert, 16-row fragments x 128-K chunks, each a contiguous block
// of 16 rows x 64 code bytes (and 16 rows x 8 scale bytes), fragments outermost. Needs N % 16 == 0
// and K % 128 == 0.
constexpr int64_t kBlockRows = 16, kBlockK = 128;
constexpr int64_t kBlockCodeBytes = kBlockK / 2, kBlockScaleBytes = kBlockK / 16;  // per row and block
// Byte offset, within one expert's [N, K/2] codes (row_bytes kBlockCodeBytes) or [N, K/16] scales
// (kBlockScaleBytes) in the blocked order, of row n's byte b.
NVFP4_HD int64_t BlockedOffset(int64_t n, int64_t b, int64_t K, int64_t row_bytes) {
  return ((n / kBlockRows * (K / kBlockK) + b / row_bytes) * kBlockRows + n % kBlockRows) * row_bytes + b % row_bytes;
}
constexpr int64_t kAlignOneWarpPairs = 32;
// The CUDA align on a grid of CTAs from kAlignGridMinPairs pairs on; its workspace (moe_align's fourth
// output) holds the CTAs' per-expert counts, CTAs x experts <= kAlignGridMaxSlots.
constexpr int64_t kAlignGridMinPairs = 2048;
constexpr int64_t kAlignGridMaxSlots = 8192;
NVFP4_HD int64_t AlignWorkspaceSize(int64_t n_pairs) { return n_pairs >= kAlignGridMinPairs ? kAlignGridMaxSlots : 0; }
// MoE modes (spec section 5); the kernels themselves are mode-agnostic.
enum class Mode : int64_t { kBf16 = 0, kW4A16 = 1, kW4A4 = 2 };

// Token tile sizes (rows of the sorted, tile-padded layout a GEMM CTA works on).
constexpr int kTileMs[] = {8, 16, 32, 64};
constexpr int kMaxTileM = 64;
static_assert(kTileMs[3] == kMaxTileM, "kMaxTileM is the largest tile");
// Warps of a GEMM CTA that split K (decode: more CTAs streaming weights); 1 for tiles > 16 rows.
constexpr int kKSplits[] = {1, 2, 4};
constexpr int64_t kMaxSplitTileM = 16;
constexpr int kMaxAlignExperts = 512;  // local experts the one-CTA align kernel handles (smem)
// The CUDA GEMM streams K in chunks of 128 (64 for the tail) and tiles output features by 16.
constexpr int64_t kCudaKMultiple = 64;
constexpr int64_t kCudaNMultiple = 16;

NVFP4_HD bool IsGated(int64_t act) {
  return act == int64_t(Activation::kSwiglu) || act == int64_t(Activation::kGeglu) ||
         act == int64_t(Activation::kSwigluOai);
}

// alpha times the per-row scale that `mode` selects for sorted row r holding pair `pair` (0
// past the end of row_scale): the GEMM epilogue's scale on both platforms.
NVFP4_HD float RowScaled(float alpha, int64_t mode, const float* row_scale, int64_t row_scale_n, int64_t pair,
                         int64_t top_k, int64_t r) {
  if (mode == int64_t(RowScale::kNone)) return alpha;
  const int64_t idx = mode == int64_t(RowScale::kToken) ? pair / top_k : mode == int64_t(RowScale::kPair) ? pair : r;
  return alpha * (idx < row_scale_n ? row_scale[idx] : 0.0f);
}

// Position of natural index k in the paired order: within each group of 8, [x0, x4, x1, x5, x2, x6,
// x3, x7], so that one 16-byte load holds the MMA's k pairs as PairActivations would make them.
NVFP4_HD int64_t PairedPos(int64_t k) {
  const int64_t i = k & 7;
  return (k - i) + (i < 4 ? 2 * i : 2 * (i - 4) + 1);
}
// Position of natural index k in the wgmma chunk order: within each group of 128, natural
// k = 32t + 8pp + j (the 8 k of thread t's code word pp in the wgmma kernel, moe_gemm_sm90.cu) sits
// at the logical k its MMA step reads, 32pp + 8(j % 4) + 2t + j / 4.
NVFP4_HD int64_t ChunkPos(int64_t k) {
  const int64_t r = k % kChunkK, t = r / 32, pp = (r / 8) % 4, j = r % 8;
  return (k - r) + 32 * pp + 8 * (j % 4) + 2 * t + j / 4;
}
// Position of index k along `axis` (Pairing::kA: a's K, kOut: out's features) under `pairing`
// (the axis's chunk-order bit is axis << 3).
NVFP4_HD int64_t PairingPos(int64_t pairing, Pairing axis, int64_t k) {
  return pairing & int64_t(axis) ? PairedPos(k) : pairing & (int64_t(axis) << 3) ? ChunkPos(k) : k;
}

NVFP4_HD float Sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// gate, up: fp32 values after the global and row scales. Non-gated activations read `gate`.
NVFP4_HD float ApplyActivation(int64_t act, float gate, float up) {
  switch (act) {
    case int64_t(Activation::kSwiglu):
      return gate * Sigmoid(gate) * up;
    case int64_t(Activation::kGeglu): {
      const float c = 0.7978845608028654f;  // sqrt(2 / pi)
      return 0.5f * gate * (1.0f + tanhf(c * (gate + 0.044715f * gate * gate * gate))) * up;
    }
    case int64_t(Activation::kRelu2): {
      float r = gate > 0.0f ? gate : 0.0f;
      return r * r;
    }
    case int64_t(Activation::kSwigluOai): {
      const float limit = 7.0f, alpha = 1.702f;
      float g = gate < limit ? gate : limit;
      float u = up < -limit ? -limit : (up > limit ? limit : up);
      return g * Sigmoid(alpha * g) * (u + 1.0f);
    }
    default:
      return gate;
  }
}

// ---- NVFP4 decode (host) ------------------------------------------------------------------
inline float E2M1ToFloat(uint8_t code) {
  static const float kTable[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                   -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  return kTable[code & 0xF];
}

// float8_e4m3fn bits -> float (exact; 0x7F/0xFF are NaN, there is no infinity).
NVFP4_HD float E4M3ToFloat(uint8_t b) {
  const int e = (b >> 3) & 0xF, m = b & 0x7;
  float v;
  if (e == 0xF && m == 0x7) {
    v = NAN;
  } else if (e == 0) {
    v = float(m) * (1.0f / 512.0f);  // subnormal: m * 2^-9
  } else {
    v = ldexpf(float(8 + m), e - 10);  // (1 + m/8) * 2^(e-7)
  }
  return (b & 0x80) ? -v : v;
}

// bfloat16 -> float (exact; both platforms), float -> bfloat16 on the host (round to nearest even, NaN kept quiet).
NVFP4_HD float Bf16ToFloat(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}
inline uint16_t FloatToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

// ---- E2M1 -> bfloat16 bit decode (the GPU kernels' in-register decode; host-testable) -------
// An E2M1 code's magnitude bits (e1 e0 m) placed at bfloat16 bits 8..6 (the two lowest exponent
// bits and the top mantissa bit) and its sign at bit 15 read as a bfloat16 of exactly
// code * 2^-126 (code 0.5 is the subnormal 2^-127). The kernels fold the 2^126 into the block
// scale (kScaleBias) and the global scale (kDecodeBias), so the products stay exact.
constexpr int kDecodeExp = 126;  // bits-as-bf16 = value * 2^-126
constexpr int kScaleExp = 118;   // block scales enter the MMA as s * 2^118 (<= 448 * 2^118 < 2^127)
constexpr float kDecodeBias = 256.0f;  // 2^(kDecodeExp - kScaleExp): applied to the fp32 accumulator

// The bits of a bf16x2 word that a decoded code pair fills: sign bit 15 and magnitude bits 8..6, both halves.
constexpr uint32_t kE2M1PairBits = 0x81C081C0u;

// Eight codes in q (code i in bits 4i..4i+3) -> four bf16x2 words of value * 2^-126:
// w[0] = {c0, c4}, w[1] = {c1, c5}, w[2] = {c2, c6}, w[3] = {c3, c7} (first in the low half).
// One multiply places a nibble's magnitude (shift 6) and its sign (shift 12) for both halves
// at once (the shifted copies do not overlap), a mask keeps the wanted bits: 3 ops per pair.
NVFP4_HD void DecodeE2M1x8(uint32_t q, uint32_t (&w)[4]) {
  const uint32_t q2 = q >> 8;
  w[0] = ((q & 0x000F000Fu) * 0x1040u) & kE2M1PairBits;   // c0, c4: << 6 and << 12
  w[1] = ((q & 0x00F000F0u) * 0x0104u) & kE2M1PairBits;   // c1, c5: << 2 and << 8
  w[2] = ((q2 & 0x000F000Fu) * 0x1040u) & kE2M1PairBits;  // c2, c6
  w[3] = ((q2 & 0x00F000F0u) * 0x0104u) & kE2M1PairBits;  // c3, c7
}

// The blocked order's code words (Pairing::kBlockedW) permute their 32 bits so that the decode takes 8 ops
// for the 8 codes, not 13 (H200, 2026-12-04: layers x0.91-0.99 at that op count; BENCHMARKS.md session 35):
// {c0, c4}, {c1, c5} and {c2, c6} sit at rotations 0, 3 and 6 of their bf16 positions (kE2M1PairBits),
// read by a rotate and a mask; {c3, c7} in the remaining bits {0, 1, 3, 4, 16, 17, 19, 20}, placed by one
// multiply (shifts 2, 7, 12; the copies do not overlap). kBlockedBitPos[4i + j]: where bit j (m, e0, e1, s)
// of code i goes. formats.py's to_blocked_weights applies the same table (BLOCKED_BIT_POS).
constexpr int kBlockedBitPos[32] = {6,  7,  8,  15, 9,  10, 11, 18, 12, 13, 14, 21, 4,  0,  1,  3,
                                    22, 23, 24, 31, 25, 26, 27, 2,  28, 29, 30, 5,  20, 16, 17, 19};
inline uint32_t BlockedCodeBits(uint32_t q) {  // a natural code word (code i in bits 4i..4i+3) -> blocked
  uint32_t b = 0;
  for (int i = 0; i < 32; ++i) b |= ((q >> i) & 1u) << kBlockedBitPos[i];
  return b;
}
inline uint32_t NaturalCodeBits(uint32_t b) {  // the inverse
  uint32_t q = 0;
  for (int i = 0; i < 32; ++i) q |= ((b >> kBlockedBitPos[i]) & 1u) << i;
  return q;
}
NVFP4_HD uint32_t RotateRight(uint32_t q, int n) {
#ifdef __CUDA_ARCH__
  return __funnelshift_r(q, q, n);
#else
  return (q >> n) | (q << (32 - n));
#endif
}
// DecodeE2M1x8 of NaturalCodeBits(b), from the blocked word b.
NVFP4_HD void DecodeE2M1x8Blocked(uint32_t b, uint32_t (&w)[4]) {
  w[0] = b & kE2M1PairBits;
  w[1] = RotateRight(b, 3) & kE2M1PairBits;
  w[2] = RotateRight(b, 6) & kE2M1PairBits;
  w[3] = ((b & 0x001B001Bu) * 0x1084u) & kE2M1PairBits;
}

// ---- shape checks shared by both platforms --------------------------------------------------
template <typename Dims>
std::string ShapeStr(const Dims& d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

inline ffi::Error Invalid(const char* op, const std::string& msg) {
  return ffi::Error::InvalidArgument(std::string("jax_nvfp4 ") + op + ": " + msg);
}

inline ffi::Error CheckKernelFlags(const char* op, int64_t kernel_flags) {
  if (kernel_flags < 0 || (kernel_flags & ~kAllKernelFlags) != 0)
    return Invalid(op, "kernel_flags must be a combination of the KernelFlag bits (mask " +
                           std::to_string(kAllKernelFlags) + "), got " + std::to_string(kernel_flags));
  return ffi::Error::Success();
}

inline bool ValidTileM(int64_t tile_m) {
  for (int t : kTileMs)
    if (t == tile_m) return true;
  return false;
}

// Problem facts of one grouped GEMM call, validated from the buffers and attributes.
struct GemmDims {
  int64_t a_rows, K, E, N, n_out, P, tiles, row_scale_n;
  bool up_alpha;  // alpha is [2, E]: the up rows' own alphas follow the gate rows'
};

// The alphas of a gated GEMM's up rows: the second half of a [2, E] alpha, else alpha itself.
inline const float* UpAlpha(const GemmDims& d, const float* alpha) { return d.up_alpha ? alpha + d.E : alpha; }

// `platform_k_multiple`: 16 on the CPU, kCudaKMultiple on the GPU (the kernel's K chunk).
template <typename A, typename W, typename WS, typename AL, typename SI, typename TE, typename RS,
          typename O>
ffi::Error CheckGemm(const char* op, const A& a, const W& w, const WS& ws, const AL& alpha,
                     const SI& sorted_ids, const TE& tile_expert, const RS& row_scale, const O& out,
                     int64_t activation, int64_t row_scale_mode, int64_t top_k, int64_t gather,
                     int64_t tile_m, int64_t k_split, int64_t pairing, int64_t kernel_flags,
                     int64_t k_multiple, int64_t n_multiple, GemmDims* d) {
  auto ad = a.dimensions(), wd = w.dimensions(), sd = ws.dimensions(), od = out.dimensions();
  if (ad.size() != 2) return Invalid(op, "a must be 2-D [rows, K], got " + ShapeStr(ad));
  if (wd.size() != 3) return Invalid(op, "w_data must be 3-D [E, N, K/2], got " + ShapeStr(wd));
  d->a_rows = ad[0];
  d->K = ad[1];
  d->E = wd[0];
  d->N = wd[1];
  if (d->K <= 0)  // (the GPU kernels load their first K chunk unconditionally)
    return Invalid(op, "K (a.shape[1]) must be positive, got " + std::to_string(d->K));
  if (wd[2] * 2 != d->K)
    return Invalid(op, "w_data " + ShapeStr(wd) + " does not match K = " + std::to_string(d->K) +
                           " of a " + ShapeStr(ad) + " (needs w_data.shape[2] = K/2)");
  // A mismatch of the operands is named before the platform's own limits (below).
  if (d->K % k_multiple != 0)
    return Invalid(op, "K = " + std::to_string(d->K) + " (a.shape[1]) must be a multiple of " +
                           std::to_string(k_multiple) + " on this platform");
  // float8_e4m3fn as the NVFP4 arrays hold it (no bitcast copy per call), or its bits as uint8.
  if (ws.element_type() != ffi::DataType::F8E4M3FN && ws.element_type() != ffi::DataType::U8)
    return Invalid(op, "w_scales must be float8_e4m3fn (or its bits as uint8), got XLA element type " +
                           std::to_string(int(ws.element_type())));
  if (sd.size() != 3 || sd[0] != d->E || sd[1] != d->N || sd[2] * 16 != d->K)
    return Invalid(op, "w_scales must be [E, N, K/16] = [" + std::to_string(d->E) + ", " +
                           std::to_string(d->N) + ", " + std::to_string(d->K / 16) + "], got " +
                           ShapeStr(sd));
  if (activation < 0 || activation > int64_t(Activation::kSwigluOai))
    return Invalid(op, "unknown activation " + std::to_string(activation));
  const bool gated = IsGated(activation);
  // [E], or [2, E] for a gated activation: the gate rows' alphas, then the up rows' (UpAlpha).
  auto al = alpha.dimensions();
  if (!(al.size() == 1 && al[0] == d->E) && !(gated && al.size() == 2 && al[0] == 2 && al[1] == d->E))
    return Invalid(op, "alpha must be [E] = [" + std::to_string(d->E) + "]" +
                           (gated ? " or [2, E] (gate rows', up rows')" : " ([2, E] only with a gated activation)") +
                           ", got " + ShapeStr(al));
  d->up_alpha = al.size() == 2;
  if (gated && d->N % 2 != 0)
    return Invalid(op, "a gated activation needs an even N (rows [gate; up]), got N = " +
                           std::to_string(d->N));
  d->n_out = gated ? d->N / 2 : d->N;
  if (!ValidTileM(tile_m)) return Invalid(op, "tile_m must be 8, 16, 32 or 64, got " + std::to_string(tile_m));
  if (auto err = CheckKernelFlags(op, kernel_flags); err.failure()) return err;
  if (pairing < 0 || (pairing & ~kAllPairing) != 0)
    return Invalid(op, "pairing must combine the Pairing bits (0..31), got " + std::to_string(pairing));
  if ((pairing & (int64_t(Pairing::kA) | int64_t(Pairing::kOut))) &&
      (d->K % 8 != 0 || d->n_out % 8 != 0))  // the paired order permutes groups of 8
    return Invalid(op, "pairing needs K and the output features to be multiples of 8, got K = " +
                           std::to_string(d->K) + ", " + std::to_string(d->n_out) + " features");
  if ((pairing & int64_t(Pairing::kA) && pairing & int64_t(Pairing::kChunkA)) ||
      (pairing & int64_t(Pairing::kOut) && pairing & int64_t(Pairing::kChunkOut)))
    return Invalid(op, "pairing: an axis is in the paired order (1, 2) or the chunk order (8, 16), not both");
  if ((pairing & int64_t(Pairing::kChunkA) && d->K % kChunkK != 0) ||
      (pairing & int64_t(Pairing::kChunkOut) && d->n_out % kChunkK != 0))
    return Invalid(op, "the chunk order (pairing & 24) needs K (for a) and the output features (for out) to "
                       "be multiples of 128, got K = " + std::to_string(d->K) + ", " +
                       std::to_string(d->n_out) + " features");
  if ((pairing & int64_t(Pairing::kBlockedW)) && (d->K % kBlockK != 0 || d->N % kBlockRows != 0))
    return Invalid(op, "blocked weights (pairing & 4) need K % 128 == 0 and N % 16 == 0, got K = " +
                           std::to_string(d->K) + ", N = " + std::to_string(d->N));
  // (after the layout checks, which hold on every platform)
  if (d->n_out % n_multiple != 0)
    return Invalid(op, "output features " + std::to_string(d->n_out) + " must be a multiple of " +
                           std::to_string(n_multiple) + " on this platform");
  bool split_ok = false;
  for (int s : kKSplits) split_ok |= s == k_split;
  if (!split_ok)
    return Invalid(op, "k_split must be 1, 2 or 4, got " + std::to_string(k_split));
  if (k_split > 1 && tile_m > kMaxSplitTileM)
    return Invalid(op, "k_split > 1 needs tile_m <= " + std::to_string(kMaxSplitTileM) + ", got tile_m = " +
                           std::to_string(tile_m));
  if (sorted_ids.dimensions().size() != 1)
    return Invalid(op, "sorted_ids must be 1-D [P], got " + ShapeStr(sorted_ids.dimensions()));
  d->P = sorted_ids.dimensions()[0];
  if (d->P % tile_m != 0)
    return Invalid(op, "sorted_ids length P = " + std::to_string(d->P) +
                           " must be a multiple of tile_m = " + std::to_string(tile_m));
  d->tiles = d->P / tile_m;
  if (tile_expert.dimensions().size() != 1 || tile_expert.dimensions()[0] != d->tiles)
    return Invalid(op, "tile_expert must be [P / tile_m] = [" + std::to_string(d->tiles) + "], got " +
                           ShapeStr(tile_expert.dimensions()));
  if (row_scale.dimensions().size() != 1)
    return Invalid(op, "row_scale must be 1-D, got " + ShapeStr(row_scale.dimensions()));
  d->row_scale_n = row_scale.dimensions()[0];
  if (row_scale_mode < 0 || row_scale_mode > int64_t(RowScale::kRow))
    return Invalid(op, "unknown row_scale_mode " + std::to_string(row_scale_mode));
  if ((gather || row_scale_mode == int64_t(RowScale::kToken)) && (top_k < 1 || top_k > INT32_MAX))
    return Invalid(op, "top_k must be in [1, 2^31 - 1], got " + std::to_string(top_k));
  if (od.size() != 2 || od[0] != d->P || od[1] != d->n_out)
    return Invalid(op, "output must be [P, n_out] = [" + std::to_string(d->P) + ", " +
                           std::to_string(d->n_out) + "], got " + ShapeStr(od));
  if (out.element_type() != ffi::DataType::BF16 && out.element_type() != ffi::DataType::F32)
    return Invalid(op, "output must be bfloat16 or float32");
  return ffi::Error::Success();
}

// A GEMM's optional bias (gpt-oss's experts): [E, N] (GEMM1's rows [gate; up]), added to the output features after
// alpha * row scale, before the activation; or [0], none. float32, or bfloat16 as checkpoints hold it: read as it
// is, so that a call spends no conversion pass on it (2 us of a 35 us gpt-oss decode layer on the H100).
struct BiasRef {
  const void* data;  // null: no bias
  bool bf16;
  NVFP4_HD explicit operator bool() const { return data != nullptr; }
  // Expert e's row of an [E, n] bias (none stays none).
  NVFP4_HD BiasRef Row(int64_t e, int64_t n) const {
    return {data ? static_cast<const char*>(data) + e * n * (bf16 ? 2 : 4) : nullptr, bf16};
  }
  NVFP4_HD float operator[](int64_t i) const {
    return bf16 ? Bf16ToFloat(static_cast<const uint16_t*>(data)[i]) : static_cast<const float*>(data)[i];
  }
};
inline ffi::Error CheckBias(const char* op, const ffi::AnyBuffer& bias, const GemmDims& d) {
  if (bias.element_type() != ffi::DataType::F32 && bias.element_type() != ffi::DataType::BF16)
    return Invalid(op, "bias must be float32 or bfloat16, got XLA element type " +
                           std::to_string(int(bias.element_type())));
  auto bd = bias.dimensions();
  if ((bd.size() == 1 && bd[0] == 0) || (bd.size() == 2 && bd[0] == d.E && bd[1] == d.N)) return ffi::Error::Success();
  return Invalid(op, "bias must be [E, N] = [" + std::to_string(d.E) + ", " + std::to_string(d.N) +
                         "] (or [0]: none), got " + ShapeStr(bd));
}
inline BiasRef BiasData(const ffi::AnyBuffer& bias) {
  return {bias.element_count() ? bias.untyped_data() : nullptr, bias.element_type() == ffi::DataType::BF16};
}

template <typename I, typename SI, typename TE, typename PR>
ffi::Error CheckAlign(const char* op, const I& topk_ids, int64_t num_experts, int64_t tile_m,
                      const SI& sorted_ids, const TE& tile_expert, const PR& pair_to_row,
                      int64_t max_experts, int64_t kernel_flags, int64_t* n_pairs, int64_t* P) {
  if (auto err = CheckKernelFlags(op, kernel_flags); err.failure()) return err;
  auto id = topk_ids.dimensions();
  if (id.size() != 2) return Invalid(op, "topk_ids must be 2-D [T, k], got " + ShapeStr(id));
  *n_pairs = id[0] * id[1];
  if (*n_pairs >= (int64_t(1) << 31)) return Invalid(op, "T * k must be < 2^31");
  if (num_experts < 1 || num_experts > max_experts)
    return Invalid(op, "num_experts must be in [1, " + std::to_string(max_experts) + "], got " +
                           std::to_string(num_experts));
  if (!ValidTileM(tile_m)) return Invalid(op, "tile_m must be 8, 16, 32 or 64, got " + std::to_string(tile_m));
  if (sorted_ids.dimensions().size() != 1)
    return Invalid(op, "sorted_ids must be 1-D [P], got " + ShapeStr(sorted_ids.dimensions()));
  *P = sorted_ids.dimensions()[0];
  // Every expert's group is padded to a tile: P must hold the worst case.
  const int64_t groups = *n_pairs < num_experts ? *n_pairs : num_experts;
  const int64_t need = *n_pairs + groups * (tile_m - 1);
  if (*P % tile_m != 0 || *P < need)
    return Invalid(op, "sorted_ids length " + std::to_string(*P) + " must be a multiple of tile_m = " +
                           std::to_string(tile_m) + " and at least " + std::to_string(need));
  if (tile_expert.dimensions().size() != 1 || tile_expert.dimensions()[0] != *P / tile_m)
    return Invalid(op, "tile_expert must be [P / tile_m] = [" + std::to_string(*P / tile_m) + "], got " +
                           ShapeStr(tile_expert.dimensions()));
  if (pair_to_row.dimensions().size() != 2 || pair_to_row.dimensions()[0] != id[0] ||
      pair_to_row.dimensions()[1] != id[1])
    return Invalid(op, "pair_to_row must have the shape of topk_ids " + ShapeStr(id) + ", got " +
                           ShapeStr(pair_to_row.dimensions()));
  return ffi::Error::Success();
}

template <typename WS>
ffi::Error CheckAlignWorkspace(const char* op, const WS& workspace, int64_t n_pairs) {
  const int64_t need = AlignWorkspaceSize(n_pairs);
  if (workspace.dimensions().size() != 1 || workspace.dimensions()[0] != need)
    return Invalid(op, "workspace must be int32 [" + std::to_string(need) + "] for " + std::to_string(n_pairs) +
                           " pairs, got " + ShapeStr(workspace.dimensions()));
  return ffi::Error::Success();
}

// moe_align_gemm: moe_align's and grouped_gemm's checks (gathered rows: a holds a row per token; k from
// topk_ids; E from w), and its limits: the pairs of one warp, 8-row tiles, no chunk-ordered a.
template <typename I, typename A, typename W, typename WS, typename AL, typename RS, typename O, typename SI,
          typename TE, typename PR>
ffi::Error CheckAlignGemm(const char* op, const I& topk_ids, const A& a, const W& w, const WS& ws, const AL& alpha,
                          const RS& row_scale, const O& out, const SI& sorted_ids, const TE& tile_expert,
                          const PR& pair_to_row, int64_t activation, int64_t row_scale_mode, int64_t tile_m,
                          int64_t k_split, int64_t pairing, int64_t kernel_flags, int64_t max_experts,
                          int64_t k_multiple, int64_t n_multiple, int64_t* n, GemmDims* d) {
  if (w.dimensions().size() != 3) return Invalid(op, "w_data must be 3-D [E, N, K/2], got " + ShapeStr(w.dimensions()));
  int64_t P;
  if (auto err = CheckAlign(op, topk_ids, w.dimensions()[0], tile_m, sorted_ids, tile_expert, pair_to_row,
                            max_experts, kernel_flags, n, &P);
      err.failure())
    return err;
  if (*n > kAlignOneWarpPairs)
    return Invalid(op, "at most " + std::to_string(kAlignOneWarpPairs) + " token-expert pairs (T * k), got " +
                           std::to_string(*n) + ": call moe_align and grouped_gemm");
  if (tile_m != 8) return Invalid(op, "tile_m must be 8, got " + std::to_string(tile_m));
  if (pairing & int64_t(Pairing::kChunkA))
    return Invalid(op, "chunk-ordered a (pairing & 8) is for 32- and 64-row tiles: call grouped_gemm");
  const int64_t top_k = topk_ids.dimensions()[1];
  if (auto err = CheckGemm(op, a, w, ws, alpha, sorted_ids, tile_expert, row_scale, out, activation, row_scale_mode,
                           top_k < 1 ? 1 : top_k, 1, tile_m, k_split, pairing, kernel_flags, k_multiple,
                           n_multiple, d);
      err.failure())
    return err;
  if (d->n_out == 0) return Invalid(op, "w must have output features (N > 0): the align's outputs come with them");
  if (d->a_rows != topk_ids.dimensions()[0])
    return Invalid(op, "a must have a row per token: [T, K] with T = " + std::to_string(topk_ids.dimensions()[0]) +
                           ", got " + ShapeStr(a.dimensions()));
  return ffi::Error::Success();
}

template <typename Y, typename PR, typename O>
ffi::Error CheckFinalize(const char* op, const Y& y, const PR& pair_to_row, const O& out,
                         int64_t h_multiple, int64_t* T, int64_t* k, int64_t* P, int64_t* H) {
  auto yd = y.dimensions(), pd = pair_to_row.dimensions(), od = out.dimensions();
  if (yd.size() != 2) return Invalid(op, "y must be 2-D [P, H], got " + ShapeStr(yd));
  if (pd.size() != 2) return Invalid(op, "pair_to_row must be 2-D [T, k], got " + ShapeStr(pd));
  *P = yd[0];
  *H = yd[1];
  *T = pd[0];
  *k = pd[1];
  if (*H % h_multiple != 0)
    return Invalid(op, "H = " + std::to_string(*H) + " must be a multiple of " + std::to_string(h_multiple));
  if (od.size() != 2 || od[0] != *T || od[1] != *H)
    return Invalid(op, "output must be [T, H] = [" + std::to_string(*T) + ", " + std::to_string(*H) +
                           "], got " + ShapeStr(od));
  return ffi::Error::Success();
}

// device_clock: x aliased to the first output, the time output [2] (low, high 32-bit words).
inline ffi::Error CheckDeviceClock(const ffi::AnyBuffer& x, const ffi::AnyBuffer& x_out,
                                   const ffi::Buffer<ffi::U32>& ns) {
  if (ns.element_count() != 2) return Invalid("device_clock", "the time output must have 2 elements");
  if (x_out.untyped_data() != x.untyped_data())
    return Invalid("device_clock", "x must be aliased to the first output (input_output_aliases={0: 0})");
  return ffi::Error::Success();
}
NVFP4_HD void StoreClockNs(uint64_t t, uint32_t* ns) {
  ns[0] = uint32_t(t);
  ns[1] = uint32_t(t >> 32);
}

// Local expert index of a global id, or -1 for padding (< 0) and other shards' experts.
NVFP4_HD int32_t LocalExpert(int32_t id, int64_t offset, int64_t num_experts) {
  if (id < 0) return -1;
  const int64_t e = int64_t(id) - offset;
  return (e >= 0 && e < num_experts) ? int32_t(e) : -1;
}

// moe_align on the CPU (its contract: ffi/moe_align.cc), for moe_align and moe_align_quant.
inline void AlignPairsCpu(const int32_t* ids, int64_t n, int64_t num_experts, int64_t expert_offset, int64_t tile_m,
                          int64_t P, int32_t* sid, int32_t* te, int32_t* p2r) {
  std::vector<int64_t> count(num_experts, 0), cursor(num_experts);
  for (int64_t p = 0; p < n; ++p) {
    const int32_t e = LocalExpert(ids[p], expert_offset, num_experts);
    if (e >= 0) ++count[e];
  }
  int64_t total = 0;
  for (int64_t i = 0; i < P / tile_m; ++i) te[i] = -1;
  for (int64_t e = 0; e < num_experts; ++e) {
    cursor[e] = total;
    const int64_t padded = (count[e] + tile_m - 1) / tile_m * tile_m;
    for (int64_t r = total; r < total + padded; r += tile_m) te[r / tile_m] = int32_t(e);
    total += padded;
  }
  for (int64_t r = 0; r < P; ++r) sid[r] = -1;
  for (int64_t p = 0; p < n; ++p) {
    const int32_t e = LocalExpert(ids[p], expert_offset, num_experts);
    if (e < 0) {
      p2r[p] = -1;
      continue;
    }
    const int64_t r = cursor[e]++;
    sid[r] = int32_t(p);
    p2r[p] = int32_t(r);
  }
}

}  // namespace jax_nvfp4
