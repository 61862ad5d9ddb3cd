// One 16-element block of per-token NVFP4 quantization on the GPU (nvfp4_quant.h's arithmetic): its
// loads and its quantize-and-store, shared by quant_dequant_rows' kernels (quant_rows.cu) and the decode
// GEMM that quantizes its rows as it loads them (moe_gemm.cu, RowScale::kQuantRow).
#pragma once

#include <cstdint>

#include "cuda/cuda_util.h"
#include "moe_common.h"
#include "nvfp4_quant.h"

namespace jax_nvfp4 {

// 16 consecutive elements (32 or 64 bytes, 16-byte aligned: rows hold a multiple of 16).
__device__ __forceinline__ void LoadBlock(const uint16_t* p, float (&v)[16]) {
  const uint4* q = reinterpret_cast<const uint4*>(p);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const uint4 u = __ldg(q + h);
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[8 * h + 2 * i] = Bf16Lo(w[i]);
      v[8 * h + 2 * i + 1] = Bf16Hi(w[i]);
    }
  }
}

__device__ __forceinline__ void LoadBlock(const float* p, float (&v)[16]) {
  const float4* q = reinterpret_cast<const float4*>(p);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float4 f = __ldg(q + i);
    v[4 * i] = f.x;
    v[4 * i + 1] = f.y;
    v[4 * i + 2] = f.z;
    v[4 * i + 3] = f.w;
  }
}

// Quantizes the 16 values of block b (natural k 16b..16b+15) with the row's scales and stores
// their decoded bf16 values in out's row: two 16-byte stores, or in the chunk order (CHUNK), where
// natural 16b + i and 16b + i + 4 (i = 8h + q, q < 4) are neighbours, eight 4-byte ones.
template <bool CHUNK>
__device__ __forceinline__ void QuantStoreBlock(uint16_t* orow, int64_t b, const float (&v)[16],
                                                const quant::RowScales& rs) {
  uint32_t vmax = 0;
#pragma unroll
  for (int i = 0; i < 16; ++i) vmax = max(vmax, quant::AbsBits(v[i]));
  const quant::BlockScale bs = quant::BlockScaleFromVmax(vmax, rs);
  float d[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) d[i] = quant::QuantDequant(v[i], bs);
  if constexpr (CHUNK) {
    uint32_t* o32 = reinterpret_cast<uint32_t*>(orow);
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int q = 0; q < 4; ++q) o32[ChunkPos(16 * b + 8 * h + q) / 2] = PackBf16x2(d[8 * h + q], d[8 * h + q + 4]);
  } else {
    uint32_t w[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) w[i] = PackBf16x2(d[2 * i], d[2 * i + 1]);
    uint4* o = reinterpret_cast<uint4*>(orow) + 2 * b;
    o[0] = make_uint4(w[0], w[1], w[2], w[3]);
    o[1] = make_uint4(w[4], w[5], w[6], w[7]);
  }
}

}  // namespace jax_nvfp4
