"""Correctly rounded float32 arithmetic that no compiler can rewrite.

XLA:GPU is not IEEE-faithful by default (spec section 7): f32 division is approximate,
`f32 -> f8 -> f32` round trips are dropped as "excess precision", `a * b + c` is contracted
into an FMA and `x * (1 / y)` may become `x / y`. The NVFP4 recipe is defined by exact
round-to-nearest-even steps, so every rounding step whose result we depend on is computed
here with integer operations (exact on every backend) or fenced so that it stays the
plain IEEE operation it is written as.

All functions take and return float32 arrays (or uint32/uint8 bit patterns) and are
elementwise, so they fuse into the surrounding computation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

F32_MAX = float(jnp.finfo(jnp.float32).max)
_U32 = jnp.uint32


def bits(x):
    """float32 -> its uint32 bit pattern."""
    return lax.bitcast_convert_type(x.astype(jnp.float32), _U32)


def from_bits(u):
    """uint32 bit pattern -> float32."""
    return lax.bitcast_convert_type(u.astype(_U32), jnp.float32)


def _u(v):
    return jnp.asarray(v, _U32)


def opaque_zero():
    """A uint32 zero that the compiler cannot see is zero (it crosses an optimization barrier)."""
    return lax.optimization_barrier(jnp.zeros((), _U32))


def fence(x, zero=None):
    """Identity on float32 values that stops algebraic rewrites and FMA contraction across it.

    The value takes a detour through an integer OR with an opaque zero: XLA and LLVM can
    neither fold a multiply into a following add (no FMA) nor reassociate through it.
    """
    zero = opaque_zero() if zero is None else zero
    return from_bits(bits(x) | zero)


def _unpack(x):
    """Positive finite float32 -> (mantissa in [2^23, 2^24), exponent) with x = m * 2^e.

    Zero maps to (0, -149); subnormals are normalized.
    """
    b = bits(x)
    e_field = (b >> 23) & _u(0xFF)
    frac = b & _u(0x7FFFFF)
    normal = e_field > 0
    m = jnp.where(normal, frac | _u(0x800000), frac)
    e = jnp.where(normal, e_field.astype(jnp.int32) - 150, jnp.int32(-149))
    # Normalize subnormals so that the top bit is bit 23.
    shift = jnp.where(normal | (m == 0), 0, lax.clz(m).astype(jnp.int32) - 8)
    m = lax.shift_left(m, shift.astype(_U32))
    e = e - shift
    return m, e


def _round_pack(m, e, sticky):
    """Round m * 2^e (m: uint32 with at least 25 significant bits, plus `sticky` for any
    nonzero bits below m) to the nearest float32, ties to even; subnormals and overflow
    to +inf included. Returns float32 (non-negative)."""
    msb = 31 - lax.clz(m).astype(jnp.int32)  # m > 0 assumed; callers mask m == 0
    exp_unb = msb + e  # value in [2^exp_unb, 2^(exp_unb+1))
    lsb_exp = jnp.maximum(exp_unb, -126) - 23  # weight of the result's last mantissa bit
    shift = lsb_exp - e  # >= 2 for our callers (m has >= 25 bits)
    sh = jnp.clip(shift, 1, 31).astype(_U32)
    wide = shift >= 32  # nothing of m is kept; m itself is the remainder
    keep = jnp.where(wide, _u(0), m >> sh)
    rem = jnp.where(wide, m, m & ((_u(1) << sh) - _u(1)))
    half = jnp.where(wide, _u(1 << 31), _u(1) << (sh - _u(1)))
    round_up = (rem > half) | ((rem == half) & (sticky | ((keep & _u(1)) == _u(1))))
    round_up &= shift <= 32  # below half of the smallest subnormal: rounds to zero
    keep = keep + round_up.astype(_U32)
    # Normal: biased field (exp_unb + 126) plus the hidden bit in keep adds the final 1; a
    # rounding carry into bit 24 moves into the exponent by itself. Subnormal: field 0.
    field = jnp.where(exp_unb >= -126, exp_unb + 126, 0).astype(_U32)
    overflow = exp_unb + 127 >= 255
    out = jnp.where(overflow, _u(0x7F800000), (field << 23) + keep)
    out = jnp.minimum(out, _u(0x7F800000))
    return from_bits(out)


def div_rn(a, b):
    """Correctly rounded a / b for non-negative float32 a, b.

    b == 0 gives +inf (0 / 0 gives +inf too: callers never need NaN there); b == +inf
    gives 0, a == +inf gives +inf (inf / inf: NaN); a NaN operand gives NaN. Long division on the
    24-bit mantissas in uint32 chunks of 8 bits.
    """
    a = jnp.asarray(a, jnp.float32)
    b = jnp.asarray(b, jnp.float32)
    a, b = jnp.broadcast_arrays(a, b)
    ma, ea = _unpack(a)
    mb, eb = _unpack(b)
    mb_safe = jnp.where(mb == 0, _u(1 << 23), mb)
    r = ma
    q = jnp.zeros_like(ma)
    for chunk in (8, 8, 8, 2):  # 26 quotient bits after the leading one(s)
        r = r << chunk
        d = r // mb_safe
        r = r - d * mb_safe
        q = (q << chunk) | d
    sticky = r != 0
    out = _round_pack(jnp.maximum(q, _u(1)), ea - eb - 26, sticky)
    out = jnp.where(ma == 0, jnp.float32(0), out)
    out = jnp.where(mb == 0, jnp.float32(jnp.inf), out)
    out = jnp.where(jnp.isinf(b), jnp.float32(0), out)
    out = jnp.where(jnp.isinf(a), jnp.where(jnp.isinf(b), jnp.float32(jnp.nan), jnp.float32(jnp.inf)), out)
    return jnp.where(jnp.isnan(a) | jnp.isnan(b), jnp.float32(jnp.nan), out)


def mul_rn(a, b):
    """Correctly rounded a * b for finite float32 a, b (any sign; NaN propagates), in integers.

    Exact on backends that flush subnormals (XLA:CPU does): a 24x24-bit mantissa product
    from 12-bit limbs, then one rounding. Overflow gives +-inf.
    """
    a = jnp.asarray(a, jnp.float32)
    b = jnp.asarray(b, jnp.float32)
    a, b = jnp.broadcast_arrays(a, b)
    sign = (bits(a) ^ bits(b)) & _u(0x80000000)
    ma, ea = _unpack(from_bits(bits(a) & _u(0x7FFFFFFF)))
    mb, eb = _unpack(from_bits(bits(b) & _u(0x7FFFFFFF)))
    ah, al = ma >> 12, ma & _u(0xFFF)
    bh, bl = mb >> 12, mb & _u(0xFFF)
    hh, hl, ll = ah * bh, ah * bl + al * bh, al * bl  # P = hh*2^24 + hl*2^12 + ll < 2^48
    low = ((hl & _u(0xF)) << 12) + ll  # the part of P below 2^16 (plus a carry)
    hi = (hh << 8) + (hl >> 4) + (low >> 16)  # floor(P / 2^16) < 2^32, >= 2^30
    mag = bits(_round_pack(jnp.maximum(hi, _u(1)), ea + eb + 16, (low & _u(0xFFFF)) != 0))
    mag = jnp.where((ma == 0) | (mb == 0), _u(0), mag)
    return jnp.where(jnp.isnan(a) | jnp.isnan(b), jnp.float32(jnp.nan), from_bits(mag | sign))


def _add_bits(ba, bb):
    """Correctly rounded sum of the float32 values with bit patterns ``ba``, ``bb`` (finite, any sign)."""
    sign_mask = _u(0x80000000)
    swap = (bb & _u(0x7FFFFFFF)) > (ba & _u(0x7FFFFFFF))  # bit order is magnitude order
    big, small = jnp.where(swap, bb, ba), jnp.where(swap, ba, bb)
    mb, eb = _unpack(from_bits(big & _u(0x7FFFFFFF)))
    ms, es = _unpack(from_bits(small & _u(0x7FFFFFFF)))
    mb, ms = mb << 6, ms << 6  # 6 guard bits: m < 2^30
    d = jnp.maximum(eb - es, 0)  # < 0 only when small is 0 (its e is -149)
    sh = jnp.minimum(d, 31).astype(_U32)
    aligned = jnp.where(d >= 32, _u(0), ms >> sh)
    lost = jnp.where(d >= 32, ms, ms & ((_u(1) << sh) - _u(1))) != 0  # small's bits below big's grid
    same = ((ba ^ bb) & sign_mask) == 0
    # Subtraction: the exact difference lies in (t, t + 1) when bits were lost, so t is floor and
    # `lost` the sticky bit. Then d > 6 and t keeps >= 29 bits; otherwise t is exact and is normalized.
    t = jnp.where(same, mb + aligned, mb - aligned - lost.astype(_U32))
    norm = jnp.where(lost | (t == 0), 0, lax.clz(t).astype(jnp.int32) - 1)
    mag = bits(_round_pack(jnp.maximum(lax.shift_left(t, norm.astype(_U32)), _u(1)), eb - 6 - norm, lost))
    mag = jnp.where(t == 0, _u(0), mag)
    sign = jnp.where(same | (t != 0), big & sign_mask, _u(0))  # x - x is +0; -0 + -0 is -0
    return from_bits(mag | sign)


def add_rn(a, b):
    """Correctly rounded a + b for float32 a, b (any sign), in integers where both are finite (XLA:CPU flushes
    subnormal sums and operands); an infinity or NaN takes the hardware add, which needs no subnormals."""
    a, b = jnp.broadcast_arrays(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32))
    return jnp.where(jnp.isfinite(a) & jnp.isfinite(b), _add_bits(bits(a), bits(b)), a + b)


def sub_rn(a, b):
    """Correctly rounded a - b, as :func:`add_rn` (b's sign flipped in its bits, exact for subnormals)."""
    a, b = jnp.broadcast_arrays(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32))
    return jnp.where(jnp.isfinite(a) & jnp.isfinite(b), _add_bits(bits(a), bits(b) ^ _u(0x80000000)), a - b)


@jax.custom_jvp
def mul_rn_differentiable(a, b):
    """:func:`mul_rn` with the product's derivative (``da * b + a * db``), for values that gradients flow
    through (mode w4a4's routing weight times an activation decode scale)."""
    return mul_rn(a, b)


@mul_rn_differentiable.defjvp
def _mul_rn_jvp(primals, tangents):
    (a, b), (da, db) = primals, tangents
    return mul_rn_differentiable(a, b), da * b + a * db


def mul_fenced(a, b, zero=None):
    """a * b as one hardware IEEE multiply, fenced against contraction and reassociation.

    Cheaper than :func:`mul_rn`; exact wherever the backend keeps subnormals (XLA:GPU does).
    """
    return fence(jnp.asarray(a, jnp.float32) * jnp.asarray(b, jnp.float32), zero)


def abs_max(x, axis=None):
    """max |x| over ``axis`` as an integer max of the bit patterns (exact even where the
    backend treats subnormal inputs as zero); NaN wins, as in a float max; 0 over nothing."""
    m = jnp.max(bits(x) & _u(0x7FFFFFFF), axis=axis, initial=0)
    return from_bits(m)


def _opaque_bits(x):
    """x's bit pattern, which LLVM cannot see is a float's: it turns ``bits(x) & 0x7FFFFFFF == 0`` into a float
    compare with 0, which XLA:CPU's denormals-are-zero makes true for subnormals (seen under jit, 2026-12-05)."""
    return bits(x) | opaque_zero()


def is_zero(x):
    """x == 0 by bit pattern (a subnormal is not zero even under denormals-are-zero)."""
    return (_opaque_bits(x) & _u(0x7FFFFFFF)) == 0


def is_subnormal(x):
    """x is a nonzero float32 below 2^-126 in magnitude, by bit pattern."""
    b = _opaque_bits(x) & _u(0x7FFFFFFF)
    return (b != 0) & (b < _u(0x00800000))


def less_nonneg(a, b):
    """a < b for float32 a, b >= 0 (or NaN: false), by bit pattern (a float compare treats subnormals as 0 under
    denormals-are-zero)."""
    return (_opaque_bits(a) < _opaque_bits(b)) & ~jnp.isnan(a) & ~jnp.isnan(b)


def sign_bit(x):
    """x < 0 by bit pattern, -0.0 excluded (exact for negative subnormals too)."""
    b = _opaque_bits(x)
    return ((b >> 31) == _u(1)) & ((b & _u(0x7FFFFFFF)) != 0)


def f32_to_e4m3_bits(x):
    """Round float32 to float8_e4m3fn, ties to even, subnormals down to 2^-9 included.

    |x| must be <= 448 (callers clamp: a cast of a larger value is NaN, not saturation).
    NaN maps to 0x7F. Returns uint8 bit patterns. Integer-only, so XLA cannot skip it.
    """
    x = jnp.asarray(x, jnp.float32)
    b = bits(x)
    sign = (b >> 31).astype(jnp.uint8) << 7
    mag = b & _u(0x7FFFFFFF)
    m, e = _unpack(from_bits(mag))  # value = m * 2^e, m in [2^23, 2^24)
    exp_unb = e + 23
    # E4M3: bias 7, 3 mantissa bits, min normal 2^-6, subnormal step 2^-9.
    lsb_exp = jnp.maximum(exp_unb, -6) - 3
    shift = jnp.clip(lsb_exp - e, 1, 31).astype(_U32)
    keep = m >> shift
    rem = m & ((_u(1) << shift) - _u(1))
    half = _u(1) << (shift - _u(1))
    round_up = (rem > half) | ((rem == half) & ((keep & _u(1)) == _u(1)))
    keep = keep + round_up.astype(_U32)
    field = jnp.where(exp_unb >= -6, exp_unb + 6, 0).astype(_U32)
    code = (field << 3) + keep
    code = jnp.where((mag == 0) | (lsb_exp - e >= 32), _u(0), code)
    code = jnp.minimum(code, _u(0x7E)).astype(jnp.uint8)  # inputs are clamped to 448 anyway
    out = code | sign
    return jnp.where(jnp.isnan(x), jnp.uint8(0x7F), out)


def e4m3_bits_to_f32(u8):
    """float8_e4m3fn bit patterns (uint8) -> exact float32 values."""
    return lax.bitcast_convert_type(u8.astype(jnp.uint8), jnp.float8_e4m3fn).astype(jnp.float32)


__all__ = [
    "F32_MAX", "bits", "from_bits", "opaque_zero", "fence", "div_rn", "mul_rn", "add_rn", "sub_rn", "mul_fenced",
    "abs_max", "is_zero", "is_subnormal", "less_nonneg", "sign_bit", "f32_to_e4m3_bits", "e4m3_bits_to_f32",
]
