// Helpers shared by the CUDA handlers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <string>

#include "moe_common.h"

namespace jax_nvfp4 {

// Turns a failed launch into an ffi::Error (never an exception across the FFI boundary).
inline ffi::Error LaunchError(const char* op) {
  const cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("jax_nvfp4 ") + op + ": CUDA launch failed: " +
                              cudaGetErrorString(err));
}

template <typename T>
constexpr T CeilDiv(T a, T b) {
  return (a + b - 1) / b;
}

// bf16 pairs in a 32-bit word (first element in the low half) <-> float.
__device__ __forceinline__ float Bf16Lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float Bf16Hi(uint32_t w) { return __uint_as_float(w & 0xFFFF0000u); }
__device__ __forceinline__ uint32_t PackBf16x2(float lo, float hi) {
  const uint32_t l = __bfloat16_as_ushort(__float2bfloat16_rn(lo));
  const uint32_t h = __bfloat16_as_ushort(__float2bfloat16_rn(hi));
  return l | (h << 16);
}

}  // namespace jax_nvfp4
