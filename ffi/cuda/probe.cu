// Build and runtime facts for the CUDA part of the extension: which architecture's
// machine code the driver actually runs on this GPU (proves the sm_90a/sm_100a build).
#include <cuda_runtime.h>

#include "cuda/probe.h"

namespace jax_nvfp4 {
namespace {
__global__ void ArchProbeKernel(int* out) {
#ifdef __CUDA_ARCH__
  *out = __CUDA_ARCH__;
#endif
}
}  // namespace

int CudaRuntimeVersion() { return CUDART_VERSION; }

int RunArchProbe(std::string* error) {
  int* d_out = nullptr;
  int h_out = -1;
  cudaError_t err = cudaMalloc(&d_out, sizeof(int));
  if (err == cudaSuccess) {
    ArchProbeKernel<<<1, 1>>>(d_out);
    err = cudaGetLastError();
    if (err == cudaSuccess) err = cudaMemcpy(&h_out, d_out, sizeof(int), cudaMemcpyDeviceToHost);
    cudaFree(d_out);
  }
  if (err != cudaSuccess) {
    *error = cudaGetErrorString(err);
    return -1;
  }
  return h_out;
}
}  // namespace jax_nvfp4
