"""Online NVFP4 quantization in pure JAX, bit-exact with FlashInfer's reference (spec section 2).

Every step is the spec's fp32 round-to-nearest-even arithmetic. The rounding steps that XLA:GPU
would otherwise change (division, the E4M3 round trip, FMA contraction) go through
:mod:`jax_nvfp4._exact`, so the bytes are the same on the CPU, the GPU and under ``jax.jit``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from . import _exact as ex
from .formats import BLOCK, E2M1_TABLE, NVFP4Array, NVFP4Experts, _check_expert_shapes, dequantize, pack_codes

RECIPES = ("nvfp4", "4over6")
FP4_MAX = 6.0
E4M3_MAX = 448.0
_ENC_NUM = np.float32(E4M3_MAX * FP4_MAX)  # 2688
_SIXTH = np.float32(1.0 / 6.0)  # fp32(1/6), as the reference rounds it
_SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def global_encode_scale(amax):
    """``enc = min(fp32(2688 / amax), FLT_MAX)``, 1 where that is 0 (amax = inf)."""
    enc = jnp.minimum(ex.div_rn(_ENC_NUM, amax), ex.F32_MAX)
    return jnp.where(enc == 0, jnp.float32(1), enc)


def _e2m1_codes(v):
    """E2M1 round-to-nearest-even of fp32 ``v`` (already scaled); sign bit = (v < 0)."""
    a = jnp.minimum(jnp.abs(v), FP4_MAX)
    idx = ((a > 0.25).astype(jnp.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75)
           + (a > 2.5) + (a >= 3.5) + (a > 5.0))
    return idx.astype(jnp.uint8) | (ex.sign_bit(v).astype(jnp.uint8) << 3)


def _scale_elements(xb, e):
    """``fp32(x * e)`` per element. XLA:CPU flushes subnormals, so there the product is
    computed in integers; elsewhere (XLA:GPU keeps subnormals) one hardware multiply."""
    return jax.lax.platform_dependent(
        xb, e, cpu=lambda x, e: ex.mul_rn(x, e[..., None]), default=lambda x, e: x * e[..., None])


def _encode_block(xb, sf, dec):
    """Steps 3-5 for one candidate block scale ``sf`` (unrounded fp32, ``[..., nb]``).

    Returns (E4M3 scale bits ``[..., nb]``, the scale as fp32, codes ``[..., nb, 16]``).
    """
    s_bits = ex.f32_to_e4m3_bits(jnp.clip(sf, -E4M3_MAX, E4M3_MAX))
    s8 = ex.e4m3_bits_to_f32(s_bits)
    e = jnp.minimum(ex.div_rn(1.0, ex.mul_rn(s8, dec)), ex.F32_MAX)
    # Materialize the per-block results: otherwise XLA fuses this integer-heavy chain into the
    # per-element consumer and recomputes it 16 times (5x slower on the CPU).
    e, s_bits, s8 = jax.lax.optimization_barrier((e, s_bits, s8))
    codes = _e2m1_codes(_scale_elements(xb, e))
    return s_bits, s8, codes


def _block_sq_error(xb, codes, s8, dec, amax_row, per_token):
    """4over6 error ``sum_i (q_i * s8 * dec - x_i)^2``, fp32, term by term in order.

    Per token the dequantized term is ``((q_i * s8) * A_t) / 2688`` instead. Fenced hardware
    operations, except where XLA:CPU would flush a subnormal operand or result (block errors
    under about 1e-19): there the whole error is recomputed in integers.
    """
    def error(xb, codes, s8, dec, amax_row, *, exact):
        zero = ex.opaque_zero()
        mul = ex.mul_rn if exact else lambda a, b: ex.mul_fenced(a, b, zero)
        add = ex.add_rn if exact else lambda a, b: ex.fence(a + b, zero)
        sub = ex.sub_rn if exact else lambda a, b: ex.fence(a - b, zero)
        q = jnp.asarray(E2M1_TABLE)[codes.astype(jnp.int32)]
        qs = q * s8[..., None]  # exact: <= 6 significant bits, >= 2^-10 or 0
        if per_token:
            mag = ex.div_rn(mul(jnp.abs(qs), amax_row[..., None]), _ENC_NUM)
            deq = jnp.where(qs < 0, -mag, mag)
        else:
            deq = mul(qs, dec[..., None])
        d = sub(deq, xb)
        sq = mul(d, d)
        err = sq[..., 0]
        for i in range(1, BLOCK):
            err = add(err, sq[..., i])
        return err, (qs, deq, d)

    def on_cpu(*args):
        err, (qs, deq, d) = error(*args, exact=False)
        # The hardware path computes what IEEE does when all its operands and results are normal or 0: x holds
        # no subnormal, a nonzero deq is >= 2^-100 (then d = deq - x is normal or 0) and a nonzero d is
        # >= 2^-62 (d^2 >= 2^-124; sums of non-negative normals are normal). Bit tests: XLA:CPU flushes.
        mag = lambda v: ex.bits(v) & 0x7FFFFFFF
        risky = (jnp.any(ex.is_subnormal(args[0]))
                 | jnp.any((qs != 0) & (mag(deq) < ex.bits(np.float32(2.0**-100))))
                 | jnp.any(~ex.is_zero(d) & (mag(d) < ex.bits(np.float32(2.0**-62)))))
        return jax.lax.cond(risky, lambda: error(*args, exact=True)[0], lambda: err)

    return jax.lax.platform_dependent(xb, codes, s8, dec, amax_row, cpu=on_cpu,
                                      default=lambda *args: error(*args, exact=False)[0])


def _check_input(x, name="x"):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    if jnp.dtype(x.dtype) not in _SUPPORTED_DTYPES:
        raise TypeError(f"{name} must be bfloat16, float16 or float32, got {x.dtype}")
    if x.ndim < 1 or x.shape[-1] % BLOCK != 0:
        raise ValueError(f"{name}: the last dimension K must be a multiple of {BLOCK}, got shape {x.shape}")


def _quantize(x, amax, *, recipe: str, per_token: bool, enc=None):
    """Quantize ``x [..., K]`` with global amax ``amax`` (shape a prefix of ``x.shape[:-1]``), or with the given
    global encode scale ``enc`` in its place (``amax`` None, ``per_token`` False).

    Returns ``(NVFP4Array, pick4)``; ``pick4`` ``[..., K/16]`` marks the 4over6 blocks that kept
    the 1.5x scale (None for ``"nvfp4"``).
    """
    pick4 = None
    xf = x.astype(jnp.float32)
    lead = x.shape[:-1]
    nb = x.shape[-1] // BLOCK
    xb = xf.reshape(lead + (nb, BLOCK))
    if enc is None:
        amax = jnp.asarray(amax, jnp.float32)
        a_row = amax.reshape(amax.shape + (1,) * (len(lead) - amax.ndim + 1))  # broadcasts over [..., nb]
        enc = global_encode_scale(a_row)
    else:
        amax = jnp.asarray(enc, jnp.float32)  # (only its shape is used below)
        enc = a_row = amax.reshape(amax.shape + (1,) * (len(lead) - amax.ndim + 1))
    dec = ex.div_rn(1.0, enc)
    vmax = ex.abs_max(xb, axis=-1)  # [..., nb]
    if recipe == "nvfp4":
        sf = ex.mul_rn(vmax, ex.mul_rn(enc, _SIXTH))
        s_bits, _, codes = _encode_block(xb, jnp.minimum(sf, E4M3_MAX), dec)
    elif recipe == "4over6":
        sf6 = jnp.where(ex.is_zero(vmax), jnp.float32(0), ex.mul_rn(ex.div_rn(vmax, FP4_MAX), enc))
        sf4 = ex.mul_rn(sf6, np.float32(1.5))
        cands = [_encode_block(xb, sf, dec) for sf in (sf4, sf6)]
        (b4, s4, c4), (b6, s6, c6) = cands
        err4 = _block_sq_error(xb, c4, s4, dec, a_row, per_token)
        err6 = _block_sq_error(xb, c6, s6, dec, a_row, per_token)
        pick4 = ex.less_nonneg(err4, err6)
        s_bits = jnp.where(pick4, b4, b6)
        codes = jnp.where(pick4[..., None], c4, c6)
    else:
        raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")

    scales = jax.lax.bitcast_convert_type(s_bits, jnp.float8_e4m3fn)
    data = pack_codes(codes.reshape(lead + (nb * BLOCK,)))
    gs = dec.reshape(amax.shape)
    if per_token:
        gs = jnp.where(ex.is_zero(amax), jnp.float32(0), gs)
    return NVFP4Array(data, scales, gs, jnp.dtype(x.dtype)), pick4


def quantize(x, *, per_token: bool = False, recipe: str = "nvfp4", global_amax=None,
             global_encode_scale=None) -> NVFP4Array:
    """Quantize to NVFP4 exactly as FlashInfer's reference quantizer does.

    Parameters
    ----------
    x : bfloat16 / float16 / float32 ``[..., K]``, K a multiple of 16
    per_token : bool
        False: one global scale for the whole tensor (weights; ``global_scale`` shape ``[]``).
        True: one per row (activations; ``global_scale`` shape ``x.shape[:-1]``; a zero row
        stores 0).
    recipe : ``"nvfp4"`` or ``"4over6"``
        ``"4over6"`` tries block scales ``vmax/6`` and ``vmax/4`` and keeps the one with lower
        squared error (spec section 2a).
    global_amax : optional float32 array
        Overrides the computed amax, e.g. to share one scale across gate and up or across
        devices. Its shape must be a prefix of ``x.shape[:-1]`` (``[]`` per tensor, ``[E]`` per
        expert, ``x.shape[:-1]`` per row); the stored ``global_scale`` has that shape.
    global_encode_scale : optional float32 array, finite and > 0
        The global encode scale itself (``enc`` of spec section 2; FlashInfer's ``fp4_quantize(x, global_scale)``
        takes this one), e.g. a static activation scale's ``1 / input_scale``, in place of one computed from an
        amax; shaped as ``global_amax``, and not with it. The stored ``global_scale`` is ``fp32(1 / enc)``;
        values beyond ``448 * 6 / enc`` saturate (block scales clamp to 448, elements to 6). ``per_token`` is
        then ignored (the shape says which rows share a scale), and 4over6's block errors are the per-tensor
        ones, ``(q_i * s8) * dec``.

    Returns
    -------
    NVFP4Array of logical shape ``x.shape``.

    Notes
    -----
    Jit-able on every backend (all shape logic is static; ``per_token`` and ``recipe`` are Python values). Non-finite
    inputs are not rejected here (that would need a host sync); as in the reference, a NaN makes its tensor's (per
    token: its row's) global scale NaN and every block scale there the NaN byte 0x7F, so all of it decodes to NaN
    (the codes are unspecified), and an infinity is an amax like any other. :func:`quantize_experts` and the
    checkpoint converter refuse NaN/Inf weights instead.

    Bit-exact on the GPU and the CPU over the whole float range, subnormals included. On the CPU, which flushes
    subnormals, ``"4over6"`` recomputes the tensor's block errors in integers (about 2x slower) when a value they
    depend on would be subnormal: tensors or rows of amax under about 1e-16, or an element under about 1e-19 in
    magnitude (nonzero) anywhere in the tensor.
    """
    _check_input(x)
    if isinstance(per_token, jax.core.Tracer):
        raise TypeError("per_token must be a Python bool, not a traced value: make it static under jax.jit "
                        "(static_argnames=('per_token',))")
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")
    if global_encode_scale is not None:
        if global_amax is not None:
            raise ValueError("quantize: give global_amax or global_encode_scale, not both")
        enc = jnp.asarray(global_encode_scale, jnp.float32)
        if tuple(enc.shape) != tuple(x.shape[: enc.ndim]) or enc.ndim > x.ndim - 1:
            raise ValueError(
                f"global_encode_scale shape {enc.shape} must be a prefix of x.shape[:-1] = {x.shape[:-1]}")
        if not isinstance(enc, jax.core.Tracer) and not bool(jnp.all(jnp.isfinite(enc) & (enc > 0))):
            raise ValueError(f"global_encode_scale must be finite and > 0, got {np.asarray(enc).ravel()[:4]}")
        return _quantize(x, None, recipe=recipe, per_token=False, enc=enc)[0]
    if global_amax is not None:
        amax = jnp.asarray(global_amax, jnp.float32)
        if tuple(amax.shape) != tuple(x.shape[: amax.ndim]) or amax.ndim > x.ndim - 1:
            raise ValueError(
                f"global_amax shape {amax.shape} must be a prefix of x.shape[:-1] = {x.shape[:-1]}")
        if not isinstance(amax, jax.core.Tracer) and not bool(jnp.all(amax >= 0)):  # (NaN too)
            bad = np.asarray(amax).ravel()[~(np.asarray(amax).ravel() >= 0)][0]
            raise ValueError(f"global_amax must be >= 0 (a max of |x|), got {bad}")
    elif per_token:
        amax = ex.abs_max(x.astype(jnp.float32), axis=-1)
    else:
        amax = ex.abs_max(x.astype(jnp.float32))
    return _quantize(x, amax, recipe=recipe, per_token=per_token)[0]


def quant_dequant_static(x, input_scale):
    """Mode w4a4's rows on a static activation scale: ``x [R, K]`` quantized per row with the global encode scale
    ``min(fp32(1 / input_scale[r]), FLT_MAX)`` (:func:`quantize`'s ``global_encode_scale``; the serving stacks'
    ``1 / input_scale``, kept finite as the per-token one is, for scales under 2^-128) and decoded back without
    it, exactly in bfloat16 (at most 6 significant bits), as :func:`~jax_nvfp4.ops.quant_dequant_rows` does
    per token.

    Returns (bfloat16 ``[R, K]``, ``input_scale`` float32 ``[R]``): the GEMMs' row decode scale is the input scale
    itself (vLLM's and SGLang's ``g1_alphas = input_scale * weight_scale_2``), not ``fp32(1 / enc)``.
    """
    s = jnp.asarray(input_scale, jnp.float32)
    # The scales' derivative flows through the row scale only (the rounding onto the grid is piecewise constant).
    enc = jax.lax.stop_gradient(ex.div_rn(np.float32(1.0), s))
    # (on the bits: XLA:CPU's minimum flushes a subnormal encode scale, that of s over about 8.5e37, to 0)
    enc = jnp.where(ex.bits(enc) == ex.bits(jnp.float32(jnp.inf)), jnp.float32(ex.F32_MAX), enc)
    q = _quantize(x, None, recipe="nvfp4", per_token=False, enc=enc)[0]
    return dequantize(q, jnp.bfloat16, apply_global_scale=False), s


def non_finite_experts(amax_or_scale) -> list:
    """Indices (ints, or tuples over stacked axes) of the experts whose amax or global scale is NaN or Inf."""
    bad = np.argwhere(~np.isfinite(np.asarray(amax_or_scale, np.float32)))
    return [int(i[0]) if len(i) == 1 else tuple(int(v) for v in i) for i in bad]


def _finite_weights(amax, name: str):
    """Weights must be finite (spec section 2): the amax of each expert ``[..., E]``, concrete, is checked here (a NaN
    or Inf anywhere in an expert makes it non-finite); traced, a non-finite one becomes NaN (its global scale NaN)."""
    if isinstance(amax, jax.core.Tracer):
        return jnp.where(jnp.isfinite(amax), amax, jnp.float32(jnp.nan))
    bad = non_finite_experts(amax)
    if bad:
        raise ValueError(f"{name} holds NaN or Inf in expert(s) {bad[:8]}{' ...' if len(bad) > 8 else ''}: "
                         "NVFP4 weights must be finite")
    return amax


def quantize_experts(gate_up, down, *, recipe: str = "nvfp4", gated: bool = True, gate_up_bias=None,
                     down_bias=None) -> NVFP4Experts:
    """Quantize a stack of MoE experts (spec section 4).

    Parameters
    ----------
    gate_up : ``[E, 2I, H]`` with rows ``[gate; up]`` (``gated=True``), or ``up [E, I, H]``
        (``gated=False``, ReLU²). One global scale per expert from
        ``max(max|gate_e|, max|up_e|)``: gate and up share it.
    down : ``[E, H, I]``; its own global scale per expert.
    recipe : ``"nvfp4"`` or ``"4over6"``
    gated : bool
    gate_up_bias, down_bias : optional float ``[E, 2I]`` / ``[E, H]``
        Expert biases (gpt-oss), carried unquantized (:class:`~jax_nvfp4.NVFP4Experts`).

    Both may be stacked over the same leading axes (``[L, E, 2I, H]`` and ``[L, E, H, I]``: L layers), each set
    quantized as alone (bitwise).

    Returns
    -------
    NVFP4Experts with ``global_scale`` of shape ``[E]`` (stacked: ``[L, E]``) on both tensors.

    Raises
    ------
    ValueError
        Called on concrete arrays, where a tensor holds NaN or Inf (naming it and the experts). Under ``jax.jit`` or
        ``jax.vmap`` (traced arrays) such an expert's global scale is NaN instead, so every output it touches is
        NaN, not silently wrong (:func:`jax_nvfp4.nn.quantize_moe` checks for that after quantizing).
    """
    _check_input(gate_up, "gate_up")
    _check_input(down, "down")
    _check_expert_shapes(tuple(gate_up.shape), tuple(down.shape), gated, "quantize_experts")
    amax_gu = _finite_weights(ex.abs_max(gate_up.astype(jnp.float32), axis=(-2, -1)), "gate_up")
    amax_dn = _finite_weights(ex.abs_max(down.astype(jnp.float32), axis=(-2, -1)), "down")
    return NVFP4Experts(
        _quantize(gate_up, amax_gu, recipe=recipe, per_token=False)[0],
        _quantize(down, amax_dn, recipe=recipe, per_token=False)[0],
        gated, gate_up_bias, down_bias)
