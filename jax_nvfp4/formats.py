"""The NVFP4 format: containers and exact decoding (spec sections 1 and 4).

An NVFP4 tensor of logical shape ``[..., K]`` (K a multiple of 16) is

- ``data``: uint8 ``[..., K/2]``, E2M1 codes, element 2j in the low nibble, 2j+1 in the high;
- ``scales``: float8_e4m3fn ``[..., K/16]``, one decode scale per 16 consecutive elements;
- ``global_scale``: float32 decode scale whose shape is a prefix of ``shape[:-1]``:
  ``[]`` per tensor, ``[E]`` per expert, ``shape[:-1]`` per token (row).

Value of element i: ``e2m1(code_i) * float(scales[i // 16]) * global_scale``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

BLOCK = 16  # elements per E4M3 block scale
ORDERS = ("rows", "blocked")  # NVFP4Array.order
BLOCK_ROWS, BLOCK_K = 16, 128  # the blocked order's fragment: rows x K
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# code (sign << 3 | idx) -> value, as a 16-entry table
E2M1_TABLE = np.array(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), np.float32)


def _is_array(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _fields_repr(obj, **first) -> str:
    """``Name(k=v, ...)`` of a dataclass with its arrays as ``dtype[shape]`` (a notebook's printout of a large
    model's experts is then a line, not their bytes) and its optional fields left out where None."""
    def short(v):
        if isinstance(v, type) or dataclasses.is_dataclass(v) or not (_is_array(v) or isinstance(v, np.dtype)):
            return repr(v)  # (numpy's scalar types have class-level shape and dtype)
        return v.name if isinstance(v, np.dtype) else f"{np.dtype(v.dtype).name}{list(v.shape)}"
    parts = [f"{k}={v}" for k, v in first.items()]
    parts += [f"{f.name}={short(getattr(obj, f.name))}" for f in dataclasses.fields(obj)
              if not (getattr(obj, f.name) is None and f.default is None)]
    return f"{type(obj).__name__}({', '.join(parts)})"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, repr=False)
class NVFP4Array:
    """An NVFP4-quantized tensor (a pytree: ``data``, ``scales``, ``global_scale`` are leaves).

    Attributes
    ----------
    data : uint8 ``[..., K/2]``
        Packed E2M1 codes, even element in the low nibble.
    scales : float8_e4m3fn ``[..., K/16]``
        Block decode scales, linear (row-major) layout.
    global_scale : float32, shape a prefix of ``shape[:-1]``
        FP32 global decode scale (``[]`` per tensor, ``[E]`` per expert, ``shape[:-1]`` per token).
    dtype : numpy dtype (static)
        Dtype of the logical tensor that was quantized (what :func:`dequantize` returns by default
        is float32; this records the source precision).
    order : ``"rows"`` or ``"blocked"`` (static)
        Byte order of ``data`` and ``scales`` in their last two axes: ``"rows"`` (the format above)
        or the blocked order of :func:`to_blocked_weights` (16-row x 128-K blocks contiguous), which
        the ffi backend's CUDA kernels read fastest. Every reader of NVFP4 experts in
        jax_nvfp4 takes both orders (:func:`dequantize` restores rows).
    """

    data: Any
    scales: Any
    global_scale: Any
    dtype: Any = dataclasses.field(default=jnp.dtype(jnp.bfloat16), metadata=dict(static=True))
    order: str = dataclasses.field(default="rows", metadata=dict(static=True))

    def __post_init__(self):
        if self.order not in ORDERS:
            raise ValueError(f"NVFP4Array.order must be one of {ORDERS}, got {self.order!r}")
        # Pytree unflattening may pass placeholders (None, object()); only check real arrays.
        if not (_is_array(self.data) and _is_array(self.scales) and _is_array(self.global_scale)):
            return
        d, s, g = self.data.shape, self.scales.shape, self.global_scale.shape
        # (The codes' cotangents, jax.grad(..., allow_int=True), are float0.)
        if self.data.dtype not in (jnp.uint8, jax.dtypes.float0):
            raise TypeError(f"NVFP4Array.data must be uint8 (packed E2M1 pairs), got {self.data.dtype}")
        if self.scales.dtype != jnp.float8_e4m3fn:
            raise TypeError(f"NVFP4Array.scales must be float8_e4m3fn, got {self.scales.dtype}")
        if self.global_scale.dtype != jnp.float32:
            raise TypeError(f"NVFP4Array.global_scale must be float32, got {self.global_scale.dtype}")
        if len(d) < 1 or d[:-1] != s[:-1] or d[-1] * 2 != s[-1] * BLOCK:
            raise ValueError(
                f"NVFP4Array shapes disagree: data {d} needs scales {d[:-1] + (d[-1] * 2 // BLOCK,)}, got {s}")
        if tuple(g) != tuple(d[: len(g)]) or len(g) > len(d) - 1:
            raise ValueError(
                f"NVFP4Array.global_scale shape {g} must be a prefix of the row shape {d[:-1]}")
        if self.order == "blocked" and not blockable(self.shape):
            raise ValueError(f"a blocked NVFP4Array needs [..., N, K] with N % {BLOCK_ROWS} == 0 and "
                             f"K % {BLOCK_K} == 0, got {self.shape}")

    def __repr__(self):
        return _fields_repr(self, shape=self.shape) if _is_array(self.data) and self.ndim else _fields_repr(self)

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical shape ``[..., K]``."""
        return tuple(self.data.shape[:-1]) + (self.data.shape[-1] * 2,)

    @property
    def ndim(self) -> int:
        return len(self.data.shape)

    def __getitem__(self, idx) -> "NVFP4Array":
        """Index the leading (row-prefix) axes shared by all three parts, e.g. ``w[e]``."""
        idx = idx if isinstance(idx, tuple) else (idx,)
        n_g = self.global_scale.ndim
        if self.order == "blocked" and len(idx) > self.ndim - 2:  # its bytes of a row are not together
            raise IndexError(f"a blocked NVFP4Array can be indexed only along its leading axes "
                             f"(not N or K), got {len(idx)} indices for shape {self.shape}")
        if len(idx) > n_g:
            raise IndexError(
                f"NVFP4Array can be indexed only along the {n_g} axes its global_scale spans, got {len(idx)}")
        return NVFP4Array(self.data[idx], self.scales[idx], self.global_scale[idx], self.dtype, self.order)


def unpack_codes(data):
    """uint8 ``[..., K/2]`` -> uint8 E2M1 codes ``[..., K]`` (0..15)."""
    lo = data & jnp.uint8(0x0F)
    hi = data >> jnp.uint8(4)
    return jnp.stack([lo, hi], axis=-1).reshape(data.shape[:-1] + (data.shape[-1] * 2,))


def pack_codes(codes):
    """uint8 E2M1 codes ``[..., K]`` -> packed uint8 ``[..., K/2]`` (even element low)."""
    pairs = codes.astype(jnp.uint8).reshape(codes.shape[:-1] + (codes.shape[-1] // 2, 2))
    return pairs[..., 0] | (pairs[..., 1] << jnp.uint8(4))


def e2m1_to_float(codes, dtype=jnp.float32):
    """E2M1 codes -> values (exact in any float dtype): ``E2M1_TABLE[codes]``, built from the code's bits as
    float32 bits, so that the trace holds no constant (a custom partitioning refuses them: expert_sharding)."""
    c = codes.astype(jnp.uint32)
    mag = c & 7  # e1 e0 m: 2^(e - 1) * (1 + m / 2) from e = 1; 0 and 0.5 (subnormal) at e = 0
    normal = ((mag >> 1) + 126) << 23 | (mag & 1) << 22
    bits = jnp.where(mag >= 2, normal, jnp.where(mag == 1, jnp.uint32(126 << 23), jnp.uint32(0))) | (c >> 3) << 31
    return lax.bitcast_convert_type(bits, jnp.float32).astype(dtype)


def _expand_global(g, ndim):
    return jnp.reshape(g, g.shape + (1,) * (ndim - g.ndim))


def dequantize(q: NVFP4Array, dtype=jnp.float32, *, apply_global_scale: bool = True):
    """Decode an :class:`NVFP4Array` to ``dtype``.

    Parameters
    ----------
    q : NVFP4Array of logical shape ``[..., K]``
    dtype : output dtype (default float32)
    apply_global_scale : bool
        If False, return ``e2m1 * block_scale`` only. That product has at most 6 significant
        bits, so it is exact in bfloat16: this is the in-kernel W4A16 decode, with the global
        scale applied afterwards as the per-expert ``alpha``.

    Returns
    -------
    array ``[..., K]`` of ``dtype``.
    """
    if q.order == "blocked":
        q = from_blocked_weights(q)
    vals = e2m1_to_float(unpack_codes(q.data), jnp.float32)
    s = q.scales.astype(jnp.float32)
    vals = (vals.reshape(q.shape[:-1] + (q.shape[-1] // BLOCK, BLOCK)) * s[..., None]).reshape(q.shape)
    if apply_global_scale:
        vals = vals * _expand_global(q.global_scale.astype(jnp.float32), vals.ndim)
    return vals.astype(dtype)


def blockable(shape) -> bool:
    """Whether weights of logical shape ``[..., N, K]`` have a blocked order (N % 16, K % 128 == 0)."""
    return len(shape) >= 2 and shape[-2] % BLOCK_ROWS == 0 and shape[-1] % BLOCK_K == 0


def experts_blockable(hidden_size: int, intermediate_size: int) -> bool:
    """Whether NVFP4 experts of hidden size H and intermediate size I have a blocked order: both
    tensors (``gate_up [E, 2I or I, H]``, ``down [E, H, I]``) :func:`blockable`, i.e. H and I
    multiples of ``BLOCK_K``."""
    return blockable((intermediate_size, hidden_size)) and blockable((hidden_size, intermediate_size))


def _reblock(v, chunks: int, to_blocked: bool):
    """Bytes ``[..., N, C]`` per row <-> per ``[...]``: ``[N/16, K/128, 16, C/chunks]`` (same shape)."""
    *lead, n, c = v.shape
    rows, c = (n // BLOCK_ROWS, BLOCK_ROWS), c // chunks
    src = (*lead, *rows, chunks, c) if to_blocked else (*lead, rows[0], chunks, rows[1], c)
    return jnp.swapaxes(v.reshape(src), -3, -2).reshape(v.shape)


# The blocked order's code words: each little-endian 32-bit word of 8 codes (code i in bits 4i..4i+3, its
# bits m, e0, e1, sign) has bit 4i + j moved to BLOCKED_BIT_POS[4i + j], so that the CUDA kernels decode the
# word in 8 integer ops, not 13 (ffi/moe_common.h kBlockedBitPos, DecodeE2M1x8Blocked).
BLOCKED_BIT_POS = (6, 7, 8, 15, 9, 10, 11, 18, 12, 13, 14, 21, 4, 0, 1, 3,
                   22, 23, 24, 31, 25, 26, 27, 2, 28, 29, 30, 5, 20, 16, 17, 19)


def _permute_code_bits(data, to_blocked: bool):
    """Code bytes ``[..., C]`` (C % 4 == 0) with each 32-bit word's bits moved by BLOCKED_BIT_POS (or back)."""
    b = data.reshape(*data.shape[:-1], -1, 4).astype(jnp.uint32)
    q = b[..., 0] | b[..., 1] << 8 | b[..., 2] << 16 | b[..., 3] << 24
    moves = {}  # shift -> mask of the source bits that move by it
    for src, dst in enumerate(BLOCKED_BIT_POS):
        src, dst = (src, dst) if to_blocked else (dst, src)
        moves[dst - src] = moves.get(dst - src, 0) | 1 << src
    out = jnp.zeros_like(q)
    for shift, mask in moves.items():
        m = q & jnp.uint32(mask)
        out = out | (m << shift if shift >= 0 else m >> -shift)
    return jnp.stack([out >> 8 * i & 0xFF for i in range(4)], -1).astype(jnp.uint8).reshape(data.shape)


def _reordered(w: NVFP4Array, to_blocked: bool, where: str) -> NVFP4Array:
    want = "rows" if to_blocked else "blocked"
    if not isinstance(w, NVFP4Array) or w.order != want:
        raise ValueError(f"{where}: needs an NVFP4Array in the {want!r} order, got "
                         f"{getattr(w, 'order', type(w).__name__)!r}")
    if not blockable(w.shape):
        raise ValueError(f"{where}: the blocked order needs [..., N, K] weights with N % {BLOCK_ROWS} == 0 "
                         f"and K % {BLOCK_K} == 0, got {w.shape}")
    chunks = w.shape[-1] // BLOCK_K
    data = _permute_code_bits(_reblock(w.data, chunks, to_blocked), to_blocked)
    return NVFP4Array(data, _reblock(w.scales, chunks, to_blocked), w.global_scale, w.dtype,
                      "blocked" if to_blocked else "rows")


def to_blocked_weights(w: NVFP4Array) -> NVFP4Array:
    """Weights ``[..., N, K]`` in the blocked order (``order="blocked"``), which the ffi backend's
    CUDA kernels read fastest (2026-12-01, H200: decode layers 7-13% faster than on rows, prefill
    layers 4-6% faster).

    For each leading index (expert), 16-row fragments by 128-K chunks, each one contiguous block of
    16 rows x 64 code bytes (and 16 rows x 8 scale bytes), so that a GPU warp's weight loads read
    contiguous bytes; within each 32-bit word of 8 codes the bits are permuted (``BLOCKED_BIT_POS``) so
    that the kernels decode it in 8 integer ops, not 13. An exact permutation of the bits of ``data`` and
    of the bytes of ``scales``; shapes, dtypes and the global scales are unchanged. Needs ``N % 16 == 0``
    and ``K % 128 == 0`` (:func:`blockable`).
    """
    return _reordered(w, True, "to_blocked_weights")


def from_blocked_weights(w: NVFP4Array) -> NVFP4Array:
    """Inverse of :func:`to_blocked_weights`: the checkpoint's (FlashInfer's) rows order."""
    return _reordered(w, False, "from_blocked_weights")


def padded_sizes(hidden_size: int, intermediate_size: int) -> tuple[int, int]:
    """H and I rounded up to whole ``BLOCK_K`` chunks: the sizes of blocked experts (:func:`to_blocked_experts`)."""
    return tuple(-(-n // BLOCK_K) * BLOCK_K for n in (hidden_size, intermediate_size))


def _fit(v, halves: int, rows: int, cols: int):
    """``v [..., halves * n, c]`` with each of its ``halves`` (gate, up) cut or zero-padded to ``rows`` rows and its
    last axis to ``cols``."""
    *lead, n, c = v.shape
    v = v.reshape(*lead, halves, n // halves, c)[..., :rows, :cols]
    v = jnp.pad(v, [(0, 0)] * (len(lead) + 1) + [(0, rows - v.shape[-2]), (0, cols - v.shape[-1])])
    return v.reshape(*lead, halves * rows, cols)


def _resized(experts: "NVFP4Experts", hidden: int, inter: int) -> dict:
    """The tensors of rows-order ``experts`` zero-padded (or cut back) to hidden size ``hidden`` and intermediate
    ``inter``: gate and up rows each to ``inter``, GEMM1's K and GEMM2's rows to ``hidden``, GEMM2's K to ``inter``,
    the biases alike. Zero codes and zero block scales decode to 0."""
    halves = 2 if experts.gated else 1

    def weight(w, halves, rows, k):
        return NVFP4Array(_fit(w.data, halves, rows, k // 2), _fit(w.scales, halves, rows, k // BLOCK),
                          w.global_scale, w.dtype, w.order)

    def bias(b, halves, n):
        return None if b is None else _fit(b[..., None], halves, n, 1)[..., 0]
    return dict(gate_up=weight(experts.gate_up, halves, inter, hidden), down=weight(experts.down, 1, hidden, inter),
                gate_up_bias=bias(experts.gate_up_bias, halves, inter), down_bias=bias(experts.down_bias, 1, hidden))


def _reordered_experts(experts: "NVFP4Experts", to_blocked: bool) -> "NVFP4Experts":
    fn = "to_blocked_experts" if to_blocked else "from_blocked_experts"
    if not isinstance(experts, NVFP4Experts):
        raise TypeError(f"{fn} needs NVFP4Experts, got {type(experts).__name__}")
    sizes = (experts.hidden_size, experts.intermediate_size)
    pad = to_blocked and experts.gate_up.order == "rows" and not experts_blockable(*sizes)
    if pad:
        experts = dataclasses.replace(experts, **_resized(experts, *padded_sizes(*sizes)))
    out = dataclasses.replace(experts, **{name: _reordered(getattr(experts, name), to_blocked, f"{fn}: {name}")
                                          for name in ("gate_up", "down")}, valid_sizes=None)
    if pad:
        return dataclasses.replace(out, valid_sizes=sizes)
    return out if to_blocked or experts.valid_sizes is None else dataclasses.replace(out, **_resized(out, *sizes))


def to_blocked_experts(experts: "NVFP4Experts") -> "NVFP4Experts":
    """:func:`to_blocked_weights` of both expert tensors, with H and I first zero-padded to multiples of 128
    where they are not (e.g. gpt-oss, H = I = 2880 -> 2944): gate and up rows each to I', K to H', down's
    rows to H' and its K to I', the biases alike. The padded codes and scales are zeros, so the padded
    experts are the same layer: :func:`~jax_nvfp4.moe` runs them on ``x`` zero-padded to H' and keeps the
    first H output features (``valid_sizes`` records H and I; ``hidden_size`` / ``intermediate_size`` stay
    H and I). The padded bytes cost (H' I') / (H I) - 1 more memory and reads (4.5% for 2880), and buy the
    kernels of whole 128-K chunks (H100, 2026-12-06: gpt-oss-120b layers 1.2-2.5x faster than on rows, BENCHMARKS.md
    session 53)."""
    return _reordered_experts(experts, True)


def from_blocked_experts(experts: "NVFP4Experts") -> "NVFP4Experts":
    """:func:`from_blocked_weights` of both expert tensors, without the padding of :func:`to_blocked_experts`."""
    return _reordered_experts(experts, False)


# The optional expert biases (gpt-oss): added to GEMM1's output after its global scale (before the activation) and
# to GEMM2's after its own (before the routing weight), as FlashInfer's TensorRT-LLM and CUTLASS kernels add them.
BIAS_FIELDS = ("gate_up_bias", "down_bias")
# Optional per-expert arrays besides the weights, indexed with them along the stack axes.
_PER_EXPERT_FIELDS = BIAS_FIELDS + ("up_global_scale", "input_scales")


class _ExpertShapes:
    """Sizes shared by the expert containers: E, H and I, and the leading axes of stacked experts (e.g. layers
    ``[L, E, N, K]``, for ``jax.lax.scan`` or ``jax.vmap`` over them)."""

    @property
    def num_experts(self) -> int:
        return self.gate_up.shape[-3]

    @property
    def hidden_size(self) -> int:
        """H (before any zero padding of blocked experts: ``valid_sizes``)."""
        valid = getattr(self, "valid_sizes", None)
        return valid[0] if valid else self.gate_up.shape[-1]

    @property
    def intermediate_size(self) -> int:
        """I (before any zero padding of blocked experts: ``valid_sizes``)."""
        valid = getattr(self, "valid_sizes", None)
        return valid[1] if valid else self.down.shape[-1]

    @property
    def stack_shape(self) -> tuple[int, ...]:
        """The leading axes before ``[E, N, K]``: ``()`` for one set of experts, ``(L,)`` for L layers' stacked."""
        return tuple(self.gate_up.shape[:-3])

    def __repr__(self):
        return _fields_repr(self)

    def __getitem__(self, idx):
        """Index the stack axes (``experts[l]``: layer l's experts), not E, N or K."""
        idx = idx if isinstance(idx, tuple) else (idx,)
        if len(idx) > len(self.stack_shape):
            raise IndexError(f"{type(self).__name__} can be indexed only along its {len(self.stack_shape)} stack "
                             f"axes {self.stack_shape} (before [E, N, K]), got {len(idx)} indices")
        return dataclasses.replace(self, gate_up=self.gate_up[idx], down=self.down[idx],
                                   **{b: getattr(self, b)[idx] for b in _PER_EXPERT_FIELDS
                                      if getattr(self, b, None) is not None})

    @property
    def has_bias(self) -> bool:
        """Whether either GEMM adds an expert bias (``gate_up_bias`` / ``down_bias``)."""
        return any(getattr(self, b) is not None for b in BIAS_FIELDS)

    def _check_biases(self, where: str) -> None:
        stack, e = self.stack_shape, self.num_experts
        for name, n in (("gate_up_bias", self.gate_up.shape[-2]), ("down_bias", self.down.shape[-2])):
            b = getattr(self, name)
            if b is None or not _is_array(b):
                continue
            if tuple(b.shape) != stack + (e, n):
                raise ValueError(f"{where}.{name} must have shape {list(stack + (e, n))} (E and its GEMM's "
                                 f"output features, after the experts' stack axes), got {tuple(b.shape)}")
            if not jnp.issubdtype(b.dtype, jnp.floating):
                raise TypeError(f"{where}.{name} must be a float array (float32, bf16), got {b.dtype}")


def require_unstacked(experts, where: str) -> None:
    """Raise where ``experts`` are stacked (leading axes before ``[E, N, K]``): a MoE layer takes one set."""
    if isinstance(experts, _ExpertShapes) and experts.stack_shape:
        raise ValueError(
            f"{where}: experts must be one set [E, N, K], got experts stacked over leading axes "
            f"{experts.stack_shape} (gate_up {tuple(experts.gate_up.shape)}); pass one of them (experts[i]) or map "
            "over them (jax.lax.scan, or jax.vmap with the experts' in_axes 0)")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, repr=False)
class NVFP4Experts(_ExpertShapes):
    """NVFP4 weights of a stack of MoE experts (a pytree).

    Attributes
    ----------
    gate_up : NVFP4Array ``[E, 2I, H]`` (gated; rows ``[gate; up]``) or ``[E, I, H]`` (not gated)
        GEMM1 weights; ``global_scale`` ``[E]``, one per expert shared by gate and up (the gate rows' alone where
        ``up_global_scale`` is set).
    down : NVFP4Array ``[E, H, I]``
        GEMM2 weights; ``global_scale`` ``[E]``.
    gated : bool (static)
        True for gated activations (SwiGLU, GeGLU, gpt-oss SwiGLU); False for ReLU².
    gate_up_bias : optional float ``[E, 2I]`` (``[E, I]`` not gated), rows ``[gate; up]`` like ``gate_up``
        Added to GEMM1's output after ``alpha1`` and before the activation (gpt-oss); not quantized.
    down_bias : optional float ``[E, H]``
        Added to GEMM2's output after ``alpha2``, before the routing weight multiplies it.
    valid_sizes : None or (H, I) (static)
        Set on blocked experts whose H or I is not a multiple of 128 (:func:`~jax_nvfp4.to_blocked_experts`):
        the tensors (and biases) are zero-padded to ``H'``, ``I'``, the next multiples of 128, and
        ``hidden_size`` / ``intermediate_size`` are H and I.
    up_global_scale : optional float32 ``[E]`` (gated only)
        The global decode scale of ``gate_up``'s up rows where it is not the gate rows' ``gate_up.global_scale``:
        checkpoints that quantized gate and up apart (NVIDIA ModelOpt's per-expert ``weight_scale_2``) keep both
        exactly, ``alpha1`` of the gate half and ``alpha1_up`` of the up half (SGLang's ``g1_alphas_up``). None
        (what :func:`~jax_nvfp4.quantize_experts` gives): one shared scale.
    input_scales : optional float32 ``[E, 2]``, finite and > 0 (checked by :meth:`from_parts`)
        Static activation scales for mode ``w4a4`` (NVIDIA ModelOpt's calibrated ``input_scale``, a global *decode*
        scale, ``amax / 2688``): column 0 for GEMM1's input (x), column 1 for GEMM2's (the intermediate). Where set,
        w4a4 quantizes a token's row for expert ``e`` with the global encode scale ``fp32(1 / input_scales[e, j])``
        (values beyond ``2688 * input_scales[e, j]`` saturate) and scales the GEMM by ``input_scales[e, j]``, as the
        serving stacks run ModelOpt checkpoints on Blackwell (their FlashInfer backends give every expert the
        layer's maximum: :func:`~jax_nvfp4.checkpoint.load_nvfp4_experts` does so); None (the default): scales per
        token, computed at run time. Mode ``w4a16`` ignores them.

    Stacked experts (several layers' sets, ``[L, E, N, K]`` and global scales ``[L, E]``; any leading axes) are
    what ``jax.vmap`` of :func:`~jax_nvfp4.quantize_experts` returns and what ``jax.lax.scan`` over layers takes;
    ``experts[l]`` is layer l's set, and :func:`~jax_nvfp4.moe` takes one set.
    """

    gate_up: NVFP4Array
    down: NVFP4Array
    gated: bool = dataclasses.field(default=True, metadata=dict(static=True))
    gate_up_bias: Any = None
    down_bias: Any = None
    valid_sizes: Any = dataclasses.field(default=None, metadata=dict(static=True))
    up_global_scale: Any = None
    input_scales: Any = None

    def __post_init__(self):
        if self.valid_sizes is not None and (
                not isinstance(self.valid_sizes, tuple) or len(self.valid_sizes) != 2
                or not all(isinstance(n, int) and n > 0 and n % BLOCK == 0 for n in self.valid_sizes)):
            raise ValueError(f"NVFP4Experts.valid_sizes must be None or a tuple (H, I) of positive multiples of "
                             f"{BLOCK}, got {self.valid_sizes!r}")
        # (Only real arrays: pytree maps may leave anything in the leaves, e.g. jax.tree.map(jnp.shape, experts).)
        if all(isinstance(w, NVFP4Array) and _is_array(w.data) for w in (self.gate_up, self.down)):
            _check_expert_shapes(self.gate_up.shape, self.down.shape, self.gated, "NVFP4Experts")
            if self.gate_up.order != self.down.order:
                raise ValueError(f"NVFP4Experts.gate_up and .down must have one byte order, got "
                                 f"{self.gate_up.order!r} and {self.down.order!r}")
            stored = (self.gate_up.shape[-1], self.down.shape[-1])
            if self.valid_sizes is not None and (self.gate_up.order != "blocked"
                                                 or padded_sizes(*self.valid_sizes) != stored
                                                 or self.valid_sizes == stored):
                raise ValueError(f"NVFP4Experts.valid_sizes (H, I) = {self.valid_sizes} is for blocked experts "
                                 f"zero-padded to multiples of {BLOCK_K} (to_blocked_experts), but these are "
                                 f"{self.gate_up.order!r} experts of H = {stored[0]}, I = {stored[1]}")
            for name, w in (("gate_up", self.gate_up), ("down", self.down)):
                if _is_array(w.global_scale) and tuple(w.global_scale.shape) != w.shape[:-2]:
                    raise ValueError(
                        f"NVFP4Experts.{name}.global_scale must have shape [..., E]={w.shape[:-2]}, "
                        f"got {w.global_scale.shape}")
            self._check_biases("NVFP4Experts")
            up = self.up_global_scale
            if up is not None and _is_array(up):
                if not self.gated:
                    raise ValueError("NVFP4Experts.up_global_scale is for gated experts (rows [gate; up]); "
                                     "these are not gated")
                if up.dtype != jnp.float32 or tuple(up.shape) != self.gate_up.shape[:-2]:
                    raise ValueError(f"NVFP4Experts.up_global_scale must be float32 [..., E]="
                                     f"{list(self.gate_up.shape[:-2])}, got {up.dtype} {list(up.shape)}")
            s = self.input_scales
            if s is not None and _is_array(s):
                want = self.gate_up.shape[:-2] + (2,)
                # (values are checked where scales are made, from_parts and the loaders: gradients and tree maps
                # rebuild experts with other values here)
                if s.dtype != jnp.float32 or tuple(s.shape) != want:
                    raise ValueError(f"NVFP4Experts.input_scales must be float32 [..., E, 2]={list(want)} (GEMM1's "
                                     f"and GEMM2's input decode scale per expert), got {s.dtype} {list(s.shape)}")

    def dequantized(self, dtype=jnp.bfloat16) -> "BF16Experts":
        """The experts' values, ``dtype(e2m1 * block scale * global scale)`` (fp32 products), as
        :class:`BF16Experts` (each GEMM1 half with its own global scale; zero-padded experts cut back to their
        ``valid_sizes``)."""
        if self.valid_sizes is not None:
            return from_blocked_experts(self).dequantized(dtype)
        gu = self.gate_up
        if self.up_global_scale is not None:  # a global scale per row: [..., E, 2I]
            rows = jnp.arange(gu.shape[-2]) < gu.shape[-2] // 2
            per_row = jnp.where(rows, gu.global_scale[..., None], self.up_global_scale[..., None])
            gu = NVFP4Array(gu.data, gu.scales, per_row, gu.dtype, gu.order)
        return BF16Experts(dequantize(gu, dtype), dequantize(self.down, dtype), self.gated, self.gate_up_bias,
                           self.down_bias)

    def padded_layer(self) -> "NVFP4Experts":
        """These experts as the layer of their padded sizes (``valid_sizes`` dropped): the one
        :func:`~jax_nvfp4.moe` runs on ``x`` zero-padded to ``gate_up.shape[-1]``."""
        return dataclasses.replace(self, valid_sizes=None)

    def pad_input(self, x):
        """``x [T, H]`` zero-padded to the padded layer's ``[T, H']`` (``gate_up.shape[-1]``)."""
        return jnp.pad(x, ((0, 0), (0, self.gate_up.shape[-1] - x.shape[1])))

    @classmethod
    def from_parts(cls, gate_up_data, gate_up_scales, gate_up_global_scale, down_data, down_scales,
                   down_global_scale, *, gated: bool = True, dtype=jnp.bfloat16, gate_up_bias=None,
                   down_bias=None, up_global_scale=None, input_scales=None) -> "NVFP4Experts":
        """Build from packed arrays (data uint8, scales float8_e4m3fn or their uint8 bits, global [E]), the
        optional biases, the up rows' own global scales (:attr:`up_global_scale`) and static activation scales
        (:attr:`input_scales`)."""
        def scales(s):
            s = jnp.asarray(s)
            return jax.lax.bitcast_convert_type(s, jnp.float8_e4m3fn) if s.dtype == jnp.uint8 else s
        if input_scales is not None and not isinstance(input_scales, jax.core.Tracer):
            v = np.asarray(input_scales, np.float32)
            if not np.all(np.isfinite(v) & (v > 0)):
                raise ValueError(f"NVFP4Experts.input_scales must be finite and > 0, got {v.ravel()[:4]}")
        return cls(
            NVFP4Array(jnp.asarray(gate_up_data), scales(gate_up_scales),
                       jnp.asarray(gate_up_global_scale, jnp.float32), jnp.dtype(dtype)),
            NVFP4Array(jnp.asarray(down_data), scales(down_scales),
                       jnp.asarray(down_global_scale, jnp.float32), jnp.dtype(dtype)),
            gated, gate_up_bias, down_bias,
            up_global_scale=None if up_global_scale is None else jnp.asarray(up_global_scale, jnp.float32),
            input_scales=None if input_scales is None else jnp.asarray(input_scales, jnp.float32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, repr=False)
class BF16Experts(_ExpertShapes):
    """Unquantized expert weights (mode ``"bf16"``), same layout as :class:`NVFP4Experts`.

    Attributes
    ----------
    gate_up : ``[E, 2I, H]`` (rows ``[gate; up]``) or ``[E, I, H]`` when not gated
    down : ``[E, H, I]``
    gated : bool (static)
    gate_up_bias, down_bias : optional float ``[E, 2I]`` / ``[E, H]``, as in :class:`NVFP4Experts`

    Stacked like :class:`NVFP4Experts` (leading axes before ``[E, N, K]``).
    """

    gate_up: Any
    down: Any
    gated: bool = dataclasses.field(default=True, metadata=dict(static=True))
    gate_up_bias: Any = None
    down_bias: Any = None

    def __post_init__(self):
        if _is_array(self.gate_up) and _is_array(self.down):
            _check_expert_shapes(tuple(self.gate_up.shape), tuple(self.down.shape), self.gated, "BF16Experts")
            self._check_biases("BF16Experts")


def _check_expert_shapes(gu, dn, gated, where):
    if len(gu) < 3 or len(gu) != len(dn) or gu[:-3] != dn[:-3]:
        raise ValueError(f"{where}: gate_up and down must be [E, N, K] (3-D), or stacked [..., E, N, K] over the "
                         f"same leading axes, got {gu} and {dn}")
    e, n, h = gu[-3:]
    rows = 2 * dn[-1] if gated else dn[-1]
    if dn[-3] != e or dn[-2] != h or n != rows:
        want = "[E, 2I, H] and [E, H, I]" if gated else "[E, I, H] and [E, H, I]"
        raise ValueError(f"{where}: gate_up {gu} and down {dn} do not match {want} (gated={gated})")
