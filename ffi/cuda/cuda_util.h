// Helpers shared by the CUDA handlers.
#pragma once

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

}  // namespace jax_nvfp4
