// device_clock on the GPU: one thread writes %globaltimer (ns) once the stream reaches it, i.e.
// after every earlier kernel on the stream has finished (launched without PDL on purpose).
#include "cuda/cuda_util.h"
#include "moe_handlers.h"

namespace jax_nvfp4 {
namespace {

__global__ void DeviceClockKernel(uint32_t* ns) {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  StoreClockNs(t, ns);
}

ffi::Error DeviceClockCudaImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> x_out,
                               ffi::Result<ffi::Buffer<ffi::U32>> ns) {
  if (auto err = CheckDeviceClock(x, *x_out, *ns); err.failure()) return err;
  DeviceClockKernel<<<1, 1, 0, stream>>>(ns->typed_data());
  return LaunchError("device_clock");
}

}  // namespace
}  // namespace jax_nvfp4

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxNvfp4DeviceClockCuda, jax_nvfp4::DeviceClockCudaImpl,
                              jax_nvfp4::sig::DeviceClock(xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
                              {xla::ffi::Traits::kCmdBufferCompatible});
