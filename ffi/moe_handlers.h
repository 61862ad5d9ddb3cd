// XLA FFI handler symbols of the MoE ops, one per op and platform (module.cc exports them).
#pragma once

#include "xla/ffi/api/ffi.h"

// CPU (plain C++ loops, fp32 accumulation): always built.
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxNvfp4MoeAlignCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxNvfp4GroupedGemmCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxNvfp4MoeFinalizeCpu);

#ifdef JAX_NVFP4_WITH_CUDA
// CUDA (sm_90a / sm_100a), CUDA-graph compatible.
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxNvfp4MoeAlignCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxNvfp4GroupedGemmCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxNvfp4MoeFinalizeCuda);
#endif
