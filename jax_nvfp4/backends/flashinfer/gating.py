"""Whether the backend can run here: the device and the software, cheap and import-free; the
TensorRT-LLM-gen cubins an offline machine needs."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import pathlib

from ..base import InstallProblem, default_device, platform
from .contract import (ENV_UNPINNED, FLASHINFER_VERSION, JAX_TVM_FFI_VERSION, TRTLLM_BMM_ARTIFACT,
                       TRTLLM_BMM_HEADERS)


def device_info() -> tuple[str, str | None, str]:
    """(platform, compute capability or None, device kind) of the default JAX device
    (:func:`jax_nvfp4.backends.base.default_device`)."""
    dev = default_device()
    if dev is None:
        return "none", None, "no device"
    kind, name = getattr(dev, "device_kind", dev.platform), platform(dev)
    cc = getattr(dev, "compute_capability", None) if name == "cuda" else None
    return name, (str(cc) if cc else None), kind


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


_find_spec = importlib.util.find_spec


def software_unavailable_reason() -> str | None:
    """Whether the optional packages are installed at the pinned versions (no imports)."""
    missing = [mod for mod in ("flashinfer", "jax_tvm_ffi", "tvm_ffi", "torch") if _find_spec(mod) is None]
    if missing:
        return InstallProblem(f"{', '.join(missing)} not installed: install the optional dependencies with "
                              f"`pip install 'jax_nvfp4[blackwell]'` (flashinfer-python=={FLASHINFER_VERSION}, "
                              f"jax-tvm-ffi=={JAX_TVM_FFI_VERSION}, and a CUDA build of torch)")
    if os.environ.get(ENV_UNPINNED) != "1":
        for dist, want in (("flashinfer-python", FLASHINFER_VERSION), ("jax-tvm-ffi", JAX_TVM_FFI_VERSION)):
            have = _dist_version(dist)
            if have is not None and have != want:
                return InstallProblem(f"{dist} {have} is installed, but the flashinfer backend targets "
                                      f"{dist}=={want} (its call signatures were read from that release); install "
                                      f"it, or set {ENV_UNPINNED}=1 to try another version")
    return None


# ---------------------------------------------------------------------------------------------
# Offline setup: TensorRT-LLM-gen cubins


def cubin_dir() -> pathlib.Path:
    """Where FlashInfer looks for downloaded artifacts (same order as ``flashinfer.jit.env``):
    ``$FLASHINFER_CUBIN_DIR``, else a ``flashinfer-cubin`` package of the same version, else
    ``$FLASHINFER_WORKSPACE_BASE`` (default ``~``) ``/.cache/flashinfer/cubins``."""
    env = os.environ.get("FLASHINFER_CUBIN_DIR")
    if env:
        return pathlib.Path(env)
    if _dist_version("flashinfer-cubin") == FLASHINFER_VERSION and importlib.util.find_spec("flashinfer_cubin"):
        import flashinfer_cubin  # a data package: cheap

        return pathlib.Path(flashinfer_cubin.get_cubin_dir())
    base = pathlib.Path(os.environ.get("FLASHINFER_WORKSPACE_BASE", pathlib.Path.home().as_posix()))
    return base / ".cache" / "flashinfer" / "cubins"


def missing_trtllm_artifacts(root: pathlib.Path | None = None) -> list[str]:
    """Files the trtllm kernels need that are not on disk ([] when the offline setup is complete).

    Checks the BMM artifact directory of the pinned release: ``checksums.txt``,
    ``include/flashinferMetaInfo.h``, the export headers, and every ``.cubin`` that
    ``checksums.txt`` lists (by name).
    """
    root = cubin_dir() if root is None else pathlib.Path(root)
    bmm = root / TRTLLM_BMM_ARTIFACT
    missing = []
    checksums = bmm / "checksums.txt"
    wanted = ["include/flashinferMetaInfo.h"] + [f"include/trtllmGen_bmm_export/{h}"
                                                 for h in TRTLLM_BMM_HEADERS]
    missing += [str(bmm / w) for w in wanted if not (bmm / w).is_file()]
    if not checksums.is_file():
        return [str(checksums)] + missing
    listed = []
    for line in checksums.read_text().splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].endswith(".cubin"):
            listed.append(parts[1])
    if not listed:
        return missing + [f"{checksums} lists no .cubin files"]
    have = {p.name for p in bmm.rglob("*.cubin")}
    missing += [str(bmm / name) for name in listed if pathlib.PurePosixPath(name).name not in have]
    return missing


def _offline_error(missing: list[str]) -> RuntimeError:
    shown = "\n  ".join(missing[:8]) + (f"\n  ... and {len(missing) - 8} more" if len(missing) > 8 else "")
    return RuntimeError(
        "The trtllm kernels need FlashInfer's TensorRT-LLM-gen cubins and headers, and jax_nvfp4 does not "
        f"let FlashInfer download them at run time. Missing under {cubin_dir()}:\n  {shown}\n"
        f"Fix: on a machine with network access and flashinfer-python=={FLASHINFER_VERSION}, run "
        "`python -m flashinfer download-cubin` (or install flashinfer-cubin of the same version), copy "
        "the cubin directory here and set FLASHINFER_CUBIN_DIR to it. See docs/blackwell.md, 'Offline setup'.")
