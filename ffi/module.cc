// The nanobind extension `jax_nvfp4._ffi`: build facts now; XLA FFI handler
// registrations (name -> capsule) are returned by registrations().
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "xla/ffi/api/c_api.h"
#ifdef JAX_NVFP4_WITH_CUDA
#include "cuda/probe.h"
#endif

namespace nb = nanobind;

NB_MODULE(_ffi, m) {
  m.doc() = "jax_nvfp4 XLA FFI extension";

  m.def("build_info", []() {
    nb::dict info;
    info["xla_ffi_api_version"] = nb::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
    info["jax_version"] = JAX_NVFP4_JAX_VERSION;
#ifdef JAX_NVFP4_WITH_CUDA
    info["cuda"] = true;
    info["cuda_version"] = JAX_NVFP4_CUDA_VERSION;
    info["cudart_version"] = jax_nvfp4::CudaRuntimeVersion();
    nb::list archs;
    std::string s = JAX_NVFP4_CUDA_ARCHS;
    for (size_t start = 0, end; (end = s.find(',', start)) != std::string::npos; start = end + 1) {
      archs.append(s.substr(start, end - start));
    }
    info["cuda_archs"] = archs;
#else
    info["cuda"] = false;
    info["cuda_version"] = nb::none();
    info["cudart_version"] = nb::none();
    info["cuda_archs"] = nb::list();
#endif
    return info;
  }, "Facts about this build: XLA FFI API version, CUDA version and compiled architectures.");

  m.def("cuda_arch_probe", []() -> int {
#ifdef JAX_NVFP4_WITH_CUDA
    std::string error;
    int arch = jax_nvfp4::RunArchProbe(&error);
    if (arch < 0) throw std::runtime_error("CUDA arch probe failed: " + error);
    return arch;
#else
    throw std::runtime_error("jax_nvfp4 was built without CUDA (nvcc was not found at build time)");
#endif
  }, "Run a one-thread kernel on the current GPU; return the __CUDA_ARCH__ that ran.");

  m.def("registrations", []() { return nb::dict(); },
        "XLA FFI handlers of this build: name -> PyCapsule (filled by the FFI ops).");
}
