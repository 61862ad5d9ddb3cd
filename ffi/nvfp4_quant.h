// Per-token NVFP4 quantization (spec section 2, recipe "nvfp4", one global scale per row), the
// arithmetic shared by the CPU handler (quant_rows.cc) and the CUDA kernel (cuda/quant_rows.cu).
// Every step is an fp32 round-to-nearest-even operation with subnormals kept, exactly as the
// pure-JAX quantizer (jax_nvfp4/quantize.py) computes it, so all three give equal bytes.
#pragma once

#include <cstdint>
#include <cstring>

#include "moe_common.h"

namespace jax_nvfp4 {
namespace quant {

constexpr float kEncNum = 2688.0f;  // 448 (E4M3 max) * 6 (E2M1 max)
constexpr uint32_t kSixthBits = 0x3E2AAAABu;  // fp32(1/6), as the reference rounds it
constexpr float kF32Max = 3.40282346638528859812e+38f;
constexpr float kE4m3Max = 448.0f;

NVFP4_HD uint32_t Bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

NVFP4_HD float FromBits(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// One IEEE rounding each: no FMA contraction, no approximate division.
NVFP4_HD float MulRn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

NVFP4_HD float DivRn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

NVFP4_HD int Clz(uint32_t v) {
#if defined(__CUDA_ARCH__)
  return __clz(int(v));
#else
  return v ? __builtin_clz(v) : 32;
#endif
}

// |x| as bits: the max of these is the float abs-max, with NaN winning over every number.
NVFP4_HD uint32_t AbsBits(float x) { return Bits(x) & 0x7FFFFFFFu; }

// min(v, hi) that keeps NaN (as jnp.minimum; fminf would return hi).
NVFP4_HD float MinKeepNan(float v, float hi) { return v > hi ? hi : v; }

// Round a float (|x| <= 448, or NaN) to float8_e4m3fn bits, ties to even, subnormals included.
NVFP4_HD uint8_t F32ToE4m3Bits(float x) {
  const uint32_t b = Bits(x);
  const uint32_t sign = (b >> 31) << 7;
  const uint32_t mag = b & 0x7FFFFFFFu;
  if (mag > 0x7F800000u) return 0x7F;
  if (mag == 0) return uint8_t(sign);
  const int e_field = int(mag >> 23);
  uint32_t m = e_field ? (mag & 0x7FFFFFu) | 0x800000u : mag;
  int e = e_field ? e_field - 150 : -149;
  if (!e_field) {  // normalize a subnormal so that bit 23 is its top bit
    const int sh = Clz(m) - 8;
    m <<= sh;
    e -= sh;
  }
  const int exp_unb = e + 23;  // x in [2^exp_unb, 2^(exp_unb + 1))
  const int lsb_exp = (exp_unb > -6 ? exp_unb : -6) - 3;  // weight of the last kept bit
  const int shift = lsb_exp - e;  // >= 20
  if (shift >= 32) return uint8_t(sign);
  uint32_t keep = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1);
  keep += (rem > half || (rem == half && (keep & 1u))) ? 1u : 0u;
  const uint32_t field = exp_unb >= -6 ? uint32_t(exp_unb + 6) : 0u;
  uint32_t code = (field << 3) + keep;  // keep holds the implicit bit: +1 on the exponent
  code = code < 0x7Eu ? code : 0x7Eu;
  return uint8_t(code | sign);
}

// The E2M1 value of an already scaled value v: |v| rounded to nearest even on {0, 0.5, 1, 1.5, 2, 3,
// 4, 6} (saturating; NaN: every comparison is false, magnitude 0), negative for negative nonzero v
// (bits above 0x80000000: -0.0 gives +0, a negative NaN -0.0). Selects, not an E2M1 code and its value
// (a table walk with a branch that split the warps): 7 compare-selects an element (2026-12-03).
NVFP4_HD float E2m1Round(float v) {
  const uint32_t b = Bits(v);
  const float a = FromBits(b & 0x7FFFFFFFu);
  float m = a > 0.25f ? 0.5f : 0.0f;
  m = a >= 0.75f ? 1.0f : m;
  m = a > 1.25f ? 1.5f : m;
  m = a >= 1.75f ? 2.0f : m;
  m = a > 2.5f ? 3.0f : m;
  m = a >= 3.5f ? 4.0f : m;
  m = a > 5.0f ? 6.0f : m;
  return FromBits(Bits(m) | (b > 0x80000000u ? 0x80000000u : 0u));
}

// The row's scales from its abs-max (as bits): encode scale `enc` (1 for an infinite amax),
// decode scale `dec` = 1 / enc, and the stored per-row global scale (0 for an all-zero row).
struct RowScales {
  float enc, dec, stored;
};

NVFP4_HD RowScales RowScalesFromAmax(uint32_t amax_bits) {
  float enc = MinKeepNan(DivRn(kEncNum, FromBits(amax_bits)), kF32Max);
  if (enc == 0.0f) enc = 1.0f;
  const float dec = DivRn(1.0f, enc);
  return {enc, dec, amax_bits == 0 ? 0.0f : dec};
}

// A static row's scales (mode w4a4 on NVFP4Experts.input_scales): its decode scale s is given; the encode
// scale is min(fp32(1 / s), FLT_MAX) and the stored scale s itself (quantize.quant_dequant_static).
NVFP4_HD RowScales RowScalesFromInputScale(float s) {
  const float enc = MinKeepNan(DivRn(1.0f, s), kF32Max);
  return {enc, DivRn(1.0f, enc), s};
}

// Where static rows' decode scales come from: one per row (ids == nullptr: table[r]), or a table [n, stride]
// looked up by an id per group of rows, table[clamp(ids[r / group] - offset, 0, n - 1) * stride + column]
// (a pair's expert, a tile's expert), so that the lookup is not an XLA gather launch of its own. The id is
// clamped to [offset, offset + n - 1] before the subtraction (0 <= offset <= 2^31 - n: no overflow anywhere,
// and the pure-JAX twin's int32 arithmetic gives the same).
struct StaticScales {
  const float* table = nullptr;  // nullptr: each row's own abs-max (per token)
  const int32_t* ids = nullptr;
  int64_t n = 0, stride = 1, column = 0, group = 1, offset = 0;
};
NVFP4_HD float StaticScaleOf(const StaticScales& s, int64_t r) {
  if (s.ids == nullptr) return s.table[r];
  const int64_t id = s.ids[r / s.group];
  const int64_t e = (id < s.offset ? s.offset : id > s.offset + s.n - 1 ? s.offset + s.n - 1 : id) - s.offset;
  return s.table[e * s.stride + s.column];
}

// The scale written for used row r: its stored global scale, times row_weights[id] (id = row_ids[r])
// when given, 0 past row_weights' end: mode w4a4's GEMM2 row scale (routing weight x decode scale).
// The rule in two steps, so that a kernel can load the weight early (RowWeightOf) and apply it once the
// row's scale is known (Weighted).
struct RowWeight {
  bool weighted, in_range;  // row_weights given; id < n_weights
  float w;                  // row_weights[id] where in range
};
NVFP4_HD RowWeight RowWeightOf(const float* row_weights, int64_t n_weights, int32_t id) {
  const bool weighted = row_weights != nullptr, in_range = weighted && id < n_weights;
  return {weighted, in_range, in_range ? row_weights[id] : 0.0f};
}
NVFP4_HD float Weighted(float stored, const RowWeight& rw) {
  return !rw.weighted ? stored : rw.in_range ? rw.w * stored : 0.0f;
}
NVFP4_HD float WeightedScale(float stored, const float* row_weights, int64_t n_weights, int32_t id) {
  return Weighted(stored, RowWeightOf(row_weights, n_weights, id));
}

// One block of 16: its E4M3 scale (bits and value) and the element multiplier 1 / (s8 * dec).
struct BlockScale {
  uint8_t bits;
  float s8, mult;
};

NVFP4_HD BlockScale BlockScaleFromVmax(uint32_t vmax_bits, const RowScales& rs) {
  const float sf = MinKeepNan(MulRn(FromBits(vmax_bits), MulRn(rs.enc, FromBits(kSixthBits))), kE4m3Max);
  const uint8_t bits = F32ToE4m3Bits(sf);
  const float s8 = E4M3ToFloat(bits);
  const float mult = MinKeepNan(DivRn(1.0f, MulRn(s8, rs.dec)), kF32Max);
  return {bits, s8, mult};
}

// The decoded value of one element without the global scale: e2m1(x * mult) * s8, exact in bf16.
NVFP4_HD float QuantDequant(float x, const BlockScale& bs) {
  return E2m1Round(MulRn(x, bs.mult)) * bs.s8;
}

}  // namespace quant

// Shapes of quant_dequant_rows (and moe_align_quant's x), checked alike on both platforms:
// x [X, K] (bf16 or f32, K % 16 == 0; K % kChunkK == 0 with chunk_out), out [R, K] bf16 and scale [R] f32
// with R = X * repeat (repeat >= 1: out rows per row of x).
template <typename X, typename O, typename S>
ffi::Error CheckQuantOut(const char* op, const X& x, const O& out, const S& scale, bool chunk_out, int64_t repeat,
                         int64_t* R, int64_t* K) {
  auto xd = x.dimensions();
  if (xd.size() != 2) return Invalid(op, "x must be 2-D [R, K], got " + ShapeStr(xd));
  if (repeat < 1 || repeat > (int64_t(1) << 31) || xd[0] > (int64_t(1) << 40) / repeat)
    return Invalid(op, "repeat must be in [1, 2^31] with x.shape[0] * repeat < 2^40, got " + std::to_string(repeat));
  *R = xd[0] * repeat;
  *K = xd[1];
  if (*K % 16 != 0) return Invalid(op, "K = " + std::to_string(*K) + " (x.shape[1]) must be a multiple of 16");
  if (chunk_out && *K % kChunkK != 0)
    return Invalid(op, "chunk_out needs K = " + std::to_string(*K) + " (x.shape[1]) to be a multiple of " +
                           std::to_string(kChunkK));
  if (x.element_type() != ffi::DataType::BF16 && x.element_type() != ffi::DataType::F32)
    return Invalid(op, "x must be bfloat16 or float32");
  auto od = out.dimensions(), sd = scale.dimensions();
  if (od.size() != 2 || od[0] != *R || od[1] != *K)
    return Invalid(op, "output must be [R, K] = [" + std::to_string(*R) + ", " + std::to_string(*K) +
                           "] (x.shape[0] * repeat, K), got " + ShapeStr(od));
  if (sd.size() != 1 || sd[0] != *R)
    return Invalid(op, "scale output must be [R] = [" + std::to_string(*R) + "], got " + ShapeStr(sd));
  return ffi::Error::Success();
}

// A lookup's offset into a table of n rows: ids clamp to [offset, offset + n - 1], which must fit int32.
inline ffi::Error CheckScaleOffset(const char* op, const char* name, int64_t offset, int64_t n) {
  if (offset < 0 || offset > (int64_t(1) << 31) - n)
    return Invalid(op, std::string(name) + " must be in [0, 2^31 - n] (n = " + std::to_string(n) +
                           " table rows), got " + std::to_string(offset));
  return ffi::Error::Success();
}

// The static scales of R rows: input_scale [R] (a scale a row) or [0] (none: per token) without scale_ids,
// or a table [n >= 1, c] with scale_ids [R / scale_group] (an id a group of scale_group rows) and
// 0 <= scale_column < c; *s gets the pointers (see quant::StaticScales).
template <typename IS, typename SI>
ffi::Error CheckStaticScales(const char* op, const IS& input_scale, const SI& scale_ids, int64_t R, int64_t scale_group,
                             int64_t scale_offset, int64_t scale_column, quant::StaticScales* s) {
  auto sd = input_scale.dimensions(), id = scale_ids.dimensions();
  if (id.size() != 1) return Invalid(op, "scale_ids must be 1-D, got " + ShapeStr(id));
  *s = quant::StaticScales{};
  if (id[0] == 0 && (sd.size() != 2 || R != 0)) {  // (no rows: a table with no ids, nothing looked up)
    if (sd.size() != 1 || (sd[0] != 0 && sd[0] != R))
      return Invalid(op, "input_scale must be [R] = [" + std::to_string(R) + "] (x.shape[0] * repeat) or [0], got " +
                             ShapeStr(sd) + " (a table [n, c] comes with scale_ids)");
    if (sd[0]) s->table = input_scale.typed_data();
    return ffi::Error::Success();
  }
  if (sd.size() != 2 || sd[0] < 1 || scale_column < 0 || scale_column >= sd[1])
    return Invalid(op, "with scale_ids, input_scale must be a table [n >= 1, c] and scale_column in [0, c), got " +
                           ShapeStr(sd) + " and column " + std::to_string(scale_column));
  if (scale_group < 1 || id[0] > R / scale_group || id[0] * scale_group != R)
    return Invalid(op, "scale_ids must be [R / scale_group] = [" + std::to_string(R) + " / " +
                           std::to_string(scale_group) + "], got " + ShapeStr(id));
  if (auto err = CheckScaleOffset(op, "scale_offset", scale_offset, sd[0]); err.failure()) return err;
  *s = {input_scale.typed_data(), scale_ids.typed_data(), sd[0], sd[1], scale_column, scale_group, scale_offset};
  return ffi::Error::Success();
}

// CheckQuantOut, and row_ids [R] or [0] (every row used), row_weights [n] (with row_ids) or [0],
// the static scales (CheckStaticScales).
template <typename X, typename I, typename W, typename IS, typename SI, typename O, typename S>
ffi::Error CheckQuantRows(const char* op, const X& x, const I& row_ids, const W& row_weights, const IS& input_scale,
                          const SI& scale_ids, const O& out, const S& scale, bool chunk_out, int64_t repeat,
                          int64_t scale_group, int64_t scale_offset, int64_t scale_column, int64_t* R, int64_t* K,
                          quant::StaticScales* s) {
  if (auto err = CheckQuantOut(op, x, out, scale, chunk_out, repeat, R, K); err.failure()) return err;
  if (auto err = CheckStaticScales(op, input_scale, scale_ids, *R, scale_group, scale_offset, scale_column, s);
      err.failure())
    return err;
  auto id = row_ids.dimensions();
  if (id.size() != 1 || (id[0] != 0 && id[0] != *R))
    return Invalid(op, "row_ids must be [R] = [" + std::to_string(*R) + "] or [0] (every row used), got " +
                           ShapeStr(id));
  if (row_weights.dimensions().size() != 1 || (row_weights.dimensions()[0] != 0 && id[0] != *R))
    return Invalid(op, "row_weights must be 1-D, and empty unless row_ids is given, got " +
                           ShapeStr(row_weights.dimensions()));
  return ffi::Error::Success();
}
// moe_align_quant: CheckAlign (at most kAlignOneWarpPairs pairs, the decode sizes it is for) and
// CheckQuantOut of x [T, K] (a row per token of topk_ids [T, k]); with static scales (input_scale a table
// [E, c] or [0]), x's row once per pair (xq [T * k, K]) on its expert's scale, column 0 (*s).
template <typename I, typename X, typename IS, typename SI, typename TE, typename PR, typename O, typename S>
ffi::Error CheckAlignQuant(const char* op, const I& topk_ids, const X& x, const IS& input_scale, int64_t num_experts,
                           int64_t expert_offset, int64_t tile_m, const SI& sorted_ids, const TE& tile_expert,
                           const PR& pair_to_row, const O& xq, const S& x_scale, bool chunk_out, int64_t max_experts,
                           int64_t kernel_flags, int64_t* n, int64_t* P, int64_t* K, int64_t* repeat,
                           quant::StaticScales* s) {
  if (auto err = CheckAlign(op, topk_ids, num_experts, tile_m, sorted_ids, tile_expert, pair_to_row, max_experts,
                            kernel_flags, n, P);
      err.failure())
    return err;
  if (*n > kAlignOneWarpPairs)
    return Invalid(op, "at most " + std::to_string(kAlignOneWarpPairs) + " token-expert pairs (T * k), got " +
                           std::to_string(*n) + ": call moe_align and quant_dequant_rows");
  if (x.dimensions().size() != 2 || x.dimensions()[0] != topk_ids.dimensions()[0])
    return Invalid(op, "x must have a row per token: [T, K] with T = " + std::to_string(topk_ids.dimensions()[0]) +
                           ", got " + ShapeStr(x.dimensions()));
  auto sd = input_scale.dimensions();
  const bool table = sd.size() == 2;
  if (!(table && sd[0] == num_experts && sd[1] >= 1) && !(sd.size() == 1 && sd[0] == 0))
    return Invalid(op, "input_scale must be a table [E, c >= 1] = [" + std::to_string(num_experts) +
                           ", c] (static scales) or [0], got " + ShapeStr(sd));
  if (table)
    if (auto err = CheckScaleOffset(op, "with static scales, expert_offset", expert_offset, num_experts); err.failure())
      return err;
  if (table && topk_ids.dimensions()[1] < 1) return Invalid(op, "static scales need k >= 1 (topk_ids [T, k])");
  *repeat = table ? topk_ids.dimensions()[1] : 1;
  *s = table ? quant::StaticScales{input_scale.typed_data(), topk_ids.typed_data(), sd[0], sd[1], 0, 1, expert_offset}
             : quant::StaticScales{};
  int64_t R;
  return CheckQuantOut(op, x, xq, x_scale, chunk_out, *repeat, &R, K);
}

}  // namespace jax_nvfp4
