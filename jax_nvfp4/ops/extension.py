"""The compiled extension (``jax_nvfp4._ffi``): its custom-call targets, their lazy registration
(after ``jax.devices()`` has initialised the backends; ``xla_ffi.md`` section 8) and the checks every op shares."""

from __future__ import annotations

import threading

import jax

from ..formats import BLOCKED_BIT_POS
from .constants import (Activation, RowScale, KernelFlag, Pairing, Mode, TILE_MS, K_SPLITS, MAX_SPLIT_TILE_M,
                        MAX_ALIGN_EXPERTS, ALIGN_ONE_WARP_PAIRS, ALIGN_GRID_MIN_PAIRS, ALIGN_GRID_MAX_SLOTS,
                        CUDA_K_MULTIPLE, CUDA_N_MULTIPLE)


try:
    from .. import _ffi
    _FFI_IMPORT_ERROR = None
except ImportError as e:  # built without the extension (e.g. a pure-Python install)
    _ffi = None
    _FFI_IMPORT_ERROR = f"{type(e).__name__}: {e}"


TARGET_ALIGN = "jax_nvfp4_moe_align"
TARGET_GEMM = "jax_nvfp4_grouped_gemm"
TARGET_FINALIZE = "jax_nvfp4_moe_finalize"
TARGET_QUANT = "jax_nvfp4_quant_dequant_rows"
TARGET_ALIGN_QUANT = "jax_nvfp4_moe_align_quant"
TARGET_ALIGN_GEMM = "jax_nvfp4_moe_align_gemm"
TARGET_CLOCK = "jax_nvfp4_device_clock"
IMPLS = ("ffi", "jax")

_lock = threading.Lock()
_registered = False


def extension_error() -> str | None:
    """None if the compiled extension imports, else why not."""
    return _FFI_IMPORT_ERROR


def build_info() -> dict:
    """Facts about the compiled extension (CUDA version and architectures); {} if not built."""
    return dict(_ffi.build_info()) if _ffi is not None else {}


def check_constants() -> None:
    """Raise if the Python enums and limits disagree with the compiled extension."""
    c = _ffi.constants()
    for cls in (Activation, RowScale, Mode, KernelFlag, Pairing):
        want = {name.lower(): int(m) for name, m in cls.__members__.items()}  # (with flags' NONE = 0)
        if dict(c[cls.__name__]) != want:
            raise RuntimeError(f"{cls.__name__} differs between Python {want} and C++ {dict(c[cls.__name__])}")
    if c["all_kernel_flags"] != int(sum(KernelFlag)):  # the handlers' mask of valid bits
        raise RuntimeError(f"the C++ kernel-flag mask {c['all_kernel_flags']} is not the sum of KernelFlag")
    if tuple(c["blocked_bit_pos"]) != BLOCKED_BIT_POS:  # the blocked code words' bit layout
        raise RuntimeError(f"the blocked order's bit positions differ: C++ {tuple(c['blocked_bit_pos'])}, "
                           f"Python {BLOCKED_BIT_POS}")
    if "align_grid_max_slots" not in c:  # an extension built from older sources
        raise RuntimeError("jax_nvfp4._ffi predates the Python package (no align workspace constants): reinstall it")
    got = (tuple(c["tile_ms"]), tuple(c["k_splits"]), c["max_split_tile_m"], c["max_align_experts"],
           c["align_one_warp_pairs"], c["align_grid_min_pairs"], c["align_grid_max_slots"], c["cuda_k_multiple"],
           c["cuda_n_multiple"])
    if got != (TILE_MS, K_SPLITS, MAX_SPLIT_TILE_M, MAX_ALIGN_EXPERTS, ALIGN_ONE_WARP_PAIRS, ALIGN_GRID_MIN_PAIRS,
               ALIGN_GRID_MAX_SLOTS, CUDA_K_MULTIPLE, CUDA_N_MULTIPLE):
        raise RuntimeError(f"tiling constants differ between Python and C++: {got}")


def ensure_registered() -> None:
    """Register the FFI targets for ``cpu`` (and ``CUDA`` in CUDA builds), once per process."""
    global _registered
    if _registered:
        return
    with _lock:
        if _registered:
            return
        if _ffi is None:
            raise RuntimeError(f"jax_nvfp4's FFI extension is not built ({_FFI_IMPORT_ERROR}); "
                               "install with `pip install --no-build-isolation -e .`")
        check_constants()
        jax.devices()  # initialise the backends before registering (deferred registration order)
        for name, platforms in _ffi.registrations().items():
            for platform, capsule in platforms.items():
                jax.ffi.register_ffi_target(name, capsule, platform=platform)
        _registered = True


def check_kernel_flags(flags) -> int:
    """``flags`` as an int, if it combines :class:`KernelFlag` bits only; else a ValueError naming them."""
    flags = int(flags)
    if flags < 0 or flags & ~int(sum(KernelFlag)):
        raise ValueError(f"kernel_flags must combine KernelFlag bits {[f.name for f in KernelFlag]} "
                         f"(mask {int(sum(KernelFlag))}), got {flags}")
    return flags


def _check_impl(impl):
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
