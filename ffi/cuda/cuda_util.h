// Helpers shared by the CUDA handlers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <string>
#include <utility>

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

// Programmatic dependent launch (KernelFlag::kPdl): a kernel launched with `pdl` may start while
// the previous kernel on the stream finishes; it must call GridDependencyWait() before it reads
// anything an earlier kernel wrote (every kernel of ours does so first thing). Without PDL the
// wait returns at once.
__device__ __forceinline__ void GridDependencyWait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// kernel<<<grid, block, smem, stream>>>(args...), or with the PDL launch attribute when `pdl`.
// Errors surface through cudaGetLastError (LaunchError).
template <typename... Params, typename... Args>
void LaunchKernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, bool pdl,
                  Args&&... args) {
  if (!pdl) {
    kernel<<<grid, block, smem, stream>>>(std::forward<Args>(args)...);
    return;
  }
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
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
