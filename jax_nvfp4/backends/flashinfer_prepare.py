"""Weight preparation for FlashInfer's Blackwell NVFP4 MoE kernels, in pure JAX.

:func:`prepare_weights` turns :class:`~jax_nvfp4.NVFP4Experts` (canonical layout: GEMM1 rows
``[gate; up]``, linear block scales) into the layout one FlashInfer kernel family consumes, once
per model. The result, :class:`PreparedWeights`, is a pytree: keep it on the device, pass it to
``jax_nvfp4.moe(..., backend="flashinfer")`` (or close over it) instead of the ``NVFP4Experts``.

Every step moves bytes; nothing is requantized, so the preparation is exact and invertible
(:func:`restore_experts`). The layouts (spec section 3, ``docs/blackwell.md``):

``"cutedsl"`` (``CuteDslMoEWrapper`` / ``cute_dsl_fused_moe``)
    GEMM1 rows ``[up; gate]`` interleaved in 64-row groups ``[up0:64, gate0:64, up64:128, ...]``
    (gated activations; ReLU² keeps its rows); GEMM2 rows unchanged. Block scales 128x4-swizzled
    per expert: the bytes are the physical storage of FlashInfer's 6-D MMA scale view
    ``(32, 4, M/128, 4, K/64, E)`` (``convert_sf_to_mma_layout``), which the bridge builds
    over them without copying.
``"trtllm"`` (``trtllm_fp4_block_scale_moe`` / ``..._routed_moe``, TensorRT-LLM-gen)
    GEMM1 rows ``[up; gate]`` permuted by ``R[S]`` (gated reorder, then the 128-row epilogue
    shuffle; ReLU²: ``S`` only); GEMM2 rows by ``S``. Scales take the same row permutation,
    then the 128x4 swizzle per expert (``block_scale_interleave``), stored ``[E, M, K/16]``.

Both keep the per-expert global decode scales as the kernels' ``alpha`` (weight-only alphas:
the activations' static global scales are 1 in W4A16 and in per-token W4A4).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import layouts
from ..formats import BLOCK, NVFP4Array, NVFP4Experts, _fields_repr, from_blocked_experts, require_unstacked

KERNELS = ("cutedsl", "trtllm")
#: Modes and activations each kernel family runs (``jax_nvfp4`` names).
KERNEL_MODES = {"cutedsl": ("w4a16", "w4a4"), "trtllm": ("w4a4",)}
KERNEL_ACTIVATIONS = {"cutedsl": ("swiglu", "geglu", "relu2", "swiglu_oai"), "trtllm": ("swiglu", "relu2")}
CUTEDSL_GROUP = 64  # rows per up/gate interleave group
TILE_M = 128  # rows per swizzle tile / epilogue tile


def _is_array(v) -> bool:
    return hasattr(v, "shape") and hasattr(v, "dtype")


def layout_unsupported_reason(kernel: str, hidden: int, intermediate: int, gated: bool) -> str | None:
    """None if ``kernel``'s weight layout can be built for these sizes, else why not.

    Both layouts tile rows by 128 and K-blocks by 4 with no padding: H % 128 == 0, and the GEMM1
    rows (2I gated, I for ReLU²) % 128 == 0 with I % 64 == 0 (GEMM2's K-blocks). The kernels'
    own tile checks may refuse further shapes at launch.
    """
    if kernel not in KERNELS:
        return f"kernel must be one of {KERNELS}, got {kernel!r}"
    rows1 = (2 if gated else 1) * intermediate
    if hidden % TILE_M:
        return f"the {kernel} layout needs H % 128 == 0, got H={hidden}"
    if rows1 % TILE_M or intermediate % 64:
        need = "I % 64 == 0" if gated else "I % 128 == 0 (ReLU² has I GEMM1 rows)"
        return f"the {kernel} layout needs {need}, got I={intermediate}"
    return None


def gemm1_row_order(kernel: str, rows: int, gated: bool) -> np.ndarray:
    """Row order (``w_kernel = w_canonical[order]``) of GEMM1 weights with canonical rows
    ``[gate; up]`` (gated) or ``[up]`` (ReLU²)."""
    if not gated:
        return (layouts.trtllm_epilogue_shuffle(rows) if kernel == "trtllm" else np.arange(rows))
    up_gate = layouts.gate_up_to_up_gate(rows)  # canonical -> FlashInfer's [up; gate]
    kernel_rows = (layouts.trtllm_gemm1_rows(rows) if kernel == "trtllm"
                   else layouts.cutedsl_gemm1_rows(rows, CUTEDSL_GROUP))
    return up_gate[kernel_rows]


def gemm2_row_order(kernel: str, rows: int) -> np.ndarray:
    """Row order of GEMM2 (down) weights ``[E, H, I]``: ``S`` for trtllm, identity for cutedsl."""
    return layouts.trtllm_gemm2_rows(rows) if kernel == "trtllm" else np.arange(rows)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, repr=False)
class PreparedWeights:
    """NVFP4 expert weights in one FlashInfer kernel family's layout (a pytree).

    Attributes
    ----------
    w1 : uint8 ``[E, M1, H/2]``
        GEMM1 E2M1 codes in the kernel's row order (``M1 = 2I`` gated, ``I`` for ReLU²).
    w1_scales : float8_e4m3fn ``[E, M1, H/16]``
        GEMM1 block scales, rows permuted like ``w1``, then 128x4-swizzled per expert (the
        array's bytes are in swizzled order; the shape only records the sizes).
    w1_alpha : float32 ``[E]``
        GEMM1 per-expert global decode scale (the kernels' ``w1_alpha`` /
        ``output1_scale_scalar`` and ``output1_scale_gate_scalar``).
    w2, w2_scales, w2_alpha
        The same for GEMM2 ``[E, H, I]``.
    kernel : ``"cutedsl"`` or ``"trtllm"`` (static)
    gated : bool (static)
    weight_only : bool (static)
        Prepared from experts with static activation scales (:attr:`~jax_nvfp4.NVFP4Experts.input_scales`), which
        these kernels' w4a4 does not take here: only mode ``w4a16`` runs them.
    """

    w1: Any
    w1_scales: Any
    w1_alpha: Any
    w2: Any
    w2_scales: Any
    w2_alpha: Any
    kernel: str = dataclasses.field(default="cutedsl", metadata=dict(static=True))
    gated: bool = dataclasses.field(default=True, metadata=dict(static=True))
    weight_only: bool = dataclasses.field(default=False, metadata=dict(static=True))

    def __repr__(self):  # shapes, not bytes, as NVFP4Experts'
        return _fields_repr(self)

    def __post_init__(self):
        if self.kernel not in KERNELS:
            raise ValueError(f"PreparedWeights.kernel must be one of {KERNELS}, got {self.kernel!r}")
        parts = (self.w1, self.w1_scales, self.w1_alpha, self.w2, self.w2_scales, self.w2_alpha)
        if not all(_is_array(p) for p in parts):
            return  # pytree placeholders
        e, m1, h2 = self.w1.shape
        _, h, i2 = self.w2.shape
        want = {
            "w1": ((e, m1, h2), jnp.uint8), "w1_scales": ((e, m1, h2 * 2 // BLOCK), jnp.float8_e4m3fn),
            "w1_alpha": ((e,), jnp.float32), "w2": ((e, h, i2), jnp.uint8),
            "w2_scales": ((e, h, i2 * 2 // BLOCK), jnp.float8_e4m3fn), "w2_alpha": ((e,), jnp.float32)}
        for name, (shape, dtype) in want.items():
            v = getattr(self, name)
            if tuple(v.shape) != shape or jnp.dtype(v.dtype) != jnp.dtype(dtype):
                raise ValueError(f"PreparedWeights.{name} must be {jnp.dtype(dtype).name} {list(shape)}, "
                                 f"got {v.dtype} {list(v.shape)}")
        if h != 2 * h2 or m1 != (2 if self.gated else 1) * i2 * 2:
            raise ValueError(f"PreparedWeights: w1 {list(self.w1.shape)} and w2 {list(self.w2.shape)} do not "
                             f"match [E, {'2I' if self.gated else 'I'}, H/2] and [E, H, I/2]")

    @property
    def num_experts(self) -> int:
        return self.w1.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.w2.shape[1]

    @property
    def intermediate_size(self) -> int:
        return self.w2.shape[2] * 2

    @property
    def modes(self) -> tuple[str, ...]:
        """The ``mode`` values these weights can run."""
        return tuple(m for m in KERNEL_MODES[self.kernel] if m == "w4a16" or not self.weight_only)

    @property
    def activations(self) -> tuple[str, ...]:
        """The activations the kernel family runs (gated ones need ``gated=True``)."""
        return tuple(a for a in KERNEL_ACTIVATIONS[self.kernel] if (a == "relu2") != self.gated)


def prepare_weights(experts: NVFP4Experts, kernel: str = "cutedsl") -> PreparedWeights:
    """Lay ``experts`` out for FlashInfer kernel family ``kernel`` (jit-able; exact).

    Parameters
    ----------
    experts : NVFP4Experts
        Canonical experts (GEMM1 rows ``[gate; up]``, linear scales, global scales ``[E]``).
    kernel : ``"cutedsl"`` (modes w4a16 and w4a4) or ``"trtllm"`` (mode w4a4)

    Returns
    -------
    PreparedWeights
    """
    if not isinstance(experts, NVFP4Experts):
        hint = " (load_nvfp4_experts returns one per MoE module: pass experts[module])" if isinstance(
            experts, dict) else ""
        raise TypeError(f"prepare_flashinfer_weights needs NVFP4Experts, got {type(experts).__name__}{hint}")
    require_unstacked(experts, "prepare_flashinfer_weights")
    if experts.has_bias:
        raise ValueError("prepare_flashinfer_weights: experts with biases (gate_up_bias / down_bias) do not run on "
                         "FlashInfer's kernels here (jax_nvfp4 does not pass biases to them); run them on backends "
                         "'ffi' or 'xla'")
    if experts.up_global_scale is not None:
        raise ValueError("prepare_flashinfer_weights: experts whose up rows have their own global scale "
                         "(up_global_scale) do not run on FlashInfer's kernels here (one GEMM1 alpha an expert); "
                         "run them on backends 'ffi' or 'xla'")
    weight_only = experts.input_scales is not None  # (w4a16 does not use them)
    if weight_only and "w4a16" not in KERNEL_MODES[kernel]:
        raise ValueError(f"prepare_flashinfer_weights: experts with static activation scales (input_scales) run "
                         f"w4a4 on backends 'ffi' or 'xla' only (FlashInfer's kernels quantize activations per token "
                         f"here), and kernel {kernel!r} runs w4a4 alone; prepare them for 'cutedsl' (w4a16)")
    if experts.gate_up.order == "blocked":  # FlashInfer's layouts start from the rows order
        experts = from_blocked_experts(experts)
    why = layout_unsupported_reason(kernel, experts.hidden_size, experts.intermediate_size, experts.gated)
    if why:
        raise ValueError(why)
    gu, dn = experts.gate_up, experts.down
    e, m1, h = gu.shape
    _, _, i = dn.shape
    r1 = gemm1_row_order(kernel, m1, experts.gated)
    r2 = gemm2_row_order(kernel, h)

    def rows(a, order):
        return jnp.take(jnp.asarray(a), jnp.asarray(order, jnp.int32), axis=1)

    def scales(s, order):
        s = rows(s, order)
        return layouts.swizzle_scales(s).reshape(s.shape)  # no padding: M % 128, K/16 % 4

    return PreparedWeights(
        w1=rows(gu.data, r1), w1_scales=scales(gu.scales, r1),
        w1_alpha=jnp.asarray(gu.global_scale, jnp.float32),
        w2=rows(dn.data, r2), w2_scales=scales(dn.scales, r2),
        w2_alpha=jnp.asarray(dn.global_scale, jnp.float32),
        kernel=kernel, gated=experts.gated, weight_only=weight_only)


def restore_experts(prepared: PreparedWeights, dtype=jnp.bfloat16) -> NVFP4Experts:
    """Inverse of :func:`prepare_weights` (for checks and debugging)."""
    e, m1, h2 = prepared.w1.shape
    h = prepared.hidden_size
    inv1 = np.argsort(gemm1_row_order(prepared.kernel, m1, prepared.gated))
    inv2 = np.argsort(gemm2_row_order(prepared.kernel, h))

    def rows(a, inv):
        return jnp.take(jnp.asarray(a), jnp.asarray(inv, jnp.int32), axis=1)

    def scales(s, inv):
        _, m, kb = s.shape
        return rows(layouts.unswizzle_scales(jnp.asarray(s).reshape(e, m * kb), m, kb), inv)

    return NVFP4Experts(
        NVFP4Array(rows(prepared.w1, inv1), scales(prepared.w1_scales, inv1), prepared.w1_alpha,
                   jnp.dtype(dtype)),
        NVFP4Array(rows(prepared.w2, inv2), scales(prepared.w2_scales, inv2), prepared.w2_alpha,
                   jnp.dtype(dtype)),
        prepared.gated)


def check_prepared(prepared: PreparedWeights, mode: str | None, activation: str) -> str:
    """Resolve ``mode`` (None: the kernel's first mode) for ``prepared``; raise ValueError if the
    weights' kernel family cannot run ``mode``/``activation``."""
    mode = prepared.modes[0] if mode is None else mode
    if mode not in prepared.modes and prepared.weight_only:
        raise ValueError(f"these weights were prepared from experts with static activation scales (input_scales), "
                         f"which FlashInfer's {mode!r} does not take here: run mode 'w4a16', or run the NVFP4Experts "
                         "on backends 'ffi' or 'xla'")
    if mode not in prepared.modes:
        raise ValueError(f"weights prepared for kernel {prepared.kernel!r} run modes {prepared.modes}, "
                         f"not {mode!r}; prepare them with kernel="
                         f"{'cutedsl' if mode == 'w4a16' else 'trtllm'!r} (or pass the NVFP4Experts)")
    if activation not in KERNEL_ACTIVATIONS[prepared.kernel]:
        raise ValueError(f"kernel {prepared.kernel!r} does not run activation {activation!r} "
                         f"(it runs {KERNEL_ACTIVATIONS[prepared.kernel]}); prepare with kernel='cutedsl'")
    return mode
