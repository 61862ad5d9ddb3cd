#pragma once
#include <string>

namespace jax_nvfp4 {
// CUDART_VERSION the kernels were compiled with.
int CudaRuntimeVersion();
// Launches a one-thread kernel on the current device and returns the __CUDA_ARCH__ of
// the machine code that ran (e.g. 900), or -1 with `error` set.
int RunArchProbe(std::string* error);
}  // namespace jax_nvfp4
