"""The ``ffi`` MoE backend: the XLA FFI kernels of ``ffi/`` (CUDA on sm_90a/sm_100a, C++ on the CPU).

Runs modes ``w4a16`` and ``w4a4`` (w4a4 quantizes the activations, per token or on the experts' static
``input_scales``, with the ``quant_dequant_rows`` kernel and feeds their exact bf16 decode to the same W4A16
kernels, with the row scales in the epilogues).
Mode ``bf16`` has no kernel here: ``backend="auto"`` falls back to ``xla`` for it.
"""

from __future__ import annotations

from .. import ops
from ..formats import padded_sizes
from . import base

# The most zero padding (a fraction of the weight bytes) the blocked order may add for its whole 128-K chunks
# (H100, 2026-12-06: gpt-oss, H = I = 2880 -> 2944, 4.5% more bytes, BENCHMARKS.md); rows beyond it.
MAX_PADDING = 0.125


def _gpu_arch(dev) -> str | None:
    """Arch-specific target of a CUDA device, e.g. 'sm_90a' for compute capability 9.0."""
    cc = getattr(dev, "compute_capability", None)
    if not cc:
        return None
    major, _, minor = str(cc).partition(".")
    return f"sm_{major}{minor or '0'}a"


class FFIBackend(base.Options):
    """MoE expert backend on the jax_nvfp4 XLA FFI kernels (see :mod:`jax_nvfp4.ops`).

    ``kernel_flags`` (:class:`jax_nvfp4.ops.KernelFlag` bits) picks CUDA kernel variants,
    ``k_split`` (1, 2 or 4, or a pair of them: GEMM1's, GEMM2's) fixes the warps that split K in
    decode tiles (tiles of at most ``MAX_SPLIT_TILE_M`` rows; larger tiles never split) and
    ``tile_m`` (one of ``TILE_MS``) fixes the rows per GEMM tile, for benchmarks that compare them;
    the registered instance uses the defaults (0, :func:`jax_nvfp4.ops.choose_k_split` and
    :func:`jax_nvfp4.ops.choose_tile_m`).
    """

    name = "ffi"

    def __init__(self, kernel_flags: int = 0, k_split: int | tuple[int, int] | None = None,
                 tile_m: int | None = None):
        self.kernel_flags = ops.check_kernel_flags(kernel_flags)
        if k_split is not None:
            k_split = ops.check_k_split(k_split)
        if tile_m is not None and tile_m not in ops.TILE_MS:
            raise ValueError(f"tile_m must be None or one of {ops.TILE_MS}, got {tile_m!r}")
        self.k_split, self.tile_m = k_split, tile_m

    def batch_invariant(self) -> FFIBackend:
        """This backend with the decode tiles' K split fixed to 1 (``moe(batch_invariant=True)``): each output
        element is then summed over K in one order whatever the tile size, the kernel (mma.sync or wgmma) or
        ROWS96's items, which the batch picks; the align, finalize and w4a4 quantize do not depend on it."""
        return FFIBackend(self.kernel_flags, k_split=1, tile_m=self.tile_m)

    def unavailable_reason(self) -> str | None:
        dev = base.default_device()
        platform = base.platform(dev)
        if platform not in ("cpu", "cuda"):
            return f"no ffi kernels for the default device's platform {platform!r} (CPU and CUDA only)"
        arch, cc = (_gpu_arch(dev), getattr(dev, "compute_capability", "?")) if platform == "cuda" else (None, None)
        if arch is not None and int(str(cc).partition(".")[0]) < 9:
            return (f"the default GPU ({dev.device_kind}, compute capability {cc}) needs {arch}, but the ffi "
                    "kernels run on sm_90a (Hopper) and newer")
        # What follows a rebuild fixes: InstallProblem, so that backend="auto" warns where it passes over them.
        if ops.extension_error() is not None:
            return base.InstallProblem(f"the jax_nvfp4._ffi extension is not built ({ops.extension_error()}); "
                                       "build it with `pip install --no-build-isolation -e .`")
        if platform == "cpu":
            return None
        info = ops.build_info()
        if not info.get("cuda"):
            return base.InstallProblem("jax_nvfp4 was built without CUDA (nvcc was not found at build time): "
                                       "reinstall with nvcc on PATH to run the ffi backend on the GPU")
        archs = tuple(info.get("cuda_archs", ()))
        if arch not in archs:
            why = (f"the default GPU ({dev.device_kind}, compute capability {cc}) needs {arch}, but the ffi kernels "
                   f"are built for {', '.join(archs) or 'no architecture'}")
            if arch not in ("sm_90a", "sm_100a"):  # (CMake's default archs, which CI compiles)
                return why
            return base.InstallProblem(
                f"{why}: reinstall with --config-settings=cmake.define.JAX_NVFP4_CUDA_ARCHS=\"{arch[3:]}\"")
        return None

    def weight_order(self, hidden: int, intermediate: int) -> str:
        """The blocked order on CUDA (H200, 2026-12-01: decode layers 7-13% faster, prefill layers
        4-6% faster than on rows), where its zero padding of H and I to multiples of 128 (to_blocked_experts)
        adds at most MAX_PADDING of the weight bytes; the CPU handler reads both orders at one speed."""
        if base.default_platform() != "cuda":
            return "rows"
        hp, ip = padded_sizes(hidden, intermediate)
        return "blocked" if hp * ip <= (1 + MAX_PADDING) * hidden * intermediate else "rows"

    def unsupported_reason(self, problem: base.MoEProblem) -> str | None:
        if problem.mode not in ops.MODES:
            return (f"mode {problem.mode!r} has no ffi kernel (the kernels decode NVFP4 weights); "
                    "backend 'xla' runs it")
        if problem.activation not in ops.ACTIVATIONS:
            return f"activation {problem.activation!r} is not one of {tuple(ops.ACTIVATIONS)}"
        h, i = problem.hidden, problem.intermediate
        if h % 16 or i % 16:
            return f"H and I must be multiples of 16 (NVFP4 blocks), got H={h}, I={i}"
        if problem.tokens * problem.top_k >= 2**31:
            return f"T * k = {problem.tokens * problem.top_k} must be < 2^31"
        if base.default_platform() == "cuda":
            m = ops.CUDA_K_MULTIPLE
            if h % m or i % m:
                return (f"the CUDA kernels need H and I to be multiples of {m} (their K chunk), "
                        f"got H={h}, I={i}")
            if problem.num_experts > ops.MAX_ALIGN_EXPERTS:
                return (f"the CUDA align kernel handles at most {ops.MAX_ALIGN_EXPERTS} local experts, "
                        f"got {problem.num_experts}")
        return None

    def __call__(self, x, experts, topk_ids, topk_weights, *, problem: base.MoEProblem,
                 local_expert_offset):
        # Tiles from the expected rows per expert: T*k spread over the global experts when routing over them is
        # known (expert parallelism), else the local ones. Chosen where the kernels are traced, from the rows of
        # one device's tokens (under jit with tokens sharded along T, expert_sharding splits them).
        return ops.moe(x, experts, topk_ids, topk_weights, mode=problem.mode, activation=problem.activation,
                       local_expert_offset=local_expert_offset, tile_m=self.tile_m, kernel_flags=self.kernel_flags,
                       k_split=self.k_split, k_split_decode_only=True,
                       spread_experts=getattr(problem, "global_experts", None) or problem.num_experts)


base.register(FFIBackend())
