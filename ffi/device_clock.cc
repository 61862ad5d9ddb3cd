// device_clock on the CPU: the steady clock when XLA runs the call (after everything x depends on).
#include <chrono>

#include "moe_common.h"
#include "moe_handlers.h"

namespace jax_nvfp4 {
namespace {

ffi::Error DeviceClockCpuImpl(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> x_out,
                              ffi::Result<ffi::Buffer<ffi::U32>> ns) {
  if (auto err = CheckDeviceClock(x, *x_out, *ns); err.failure()) return err;
  StoreClockNs(uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(
                            std::chrono::steady_clock::now().time_since_epoch()).count()),
               ns->typed_data());
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_nvfp4

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxNvfp4DeviceClockCpu, jax_nvfp4::DeviceClockCpuImpl,
                              jax_nvfp4::sig::DeviceClock(xla::ffi::Ffi::Bind()));
