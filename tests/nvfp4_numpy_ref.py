"""An independent numpy transcription of spec section 2 (IEEE float32 arithmetic on the host,
no flushing of subnormals), used as an oracle for property tests of the JAX quantizer."""

import ml_dtypes
import numpy as np

F32 = np.float32
FLT_MAX = np.finfo(np.float32).max


def _e2m1_idx(a):
    thresholds = [(0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False)]
    idx = np.zeros(a.shape, np.uint8)
    for t, inclusive in thresholds:
        idx += (a >= t) if inclusive else (a > t)
    return idx


def _encode(xb, sf, dec):
    """Steps 3-5 for block scales sf [rows, nb] -> (e4m3 bits, their fp32 values, codes [rows, nb, 16])."""
    s_bits = np.minimum(sf, F32(448)).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    s8 = s_bits.view(ml_dtypes.float8_e4m3fn).astype(F32)
    e = np.minimum(F32(1) / (s8 * dec[:, None]).astype(F32), FLT_MAX).astype(F32)
    v = np.clip((xb * e[..., None]).astype(F32), -6, 6)
    return s_bits, s8, _e2m1_idx(np.abs(v)) | ((v < 0).astype(np.uint8) << 3)


def _sq_error(xb, codes, s8, dec, amax, per_token):
    """Section 2a: sum_i (q_i * s8 * dec - x_i)^2, fp32, term by term in order (per token
    ((q_i * s8) * A_t) / 2688)."""
    q = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], F32)[codes]
    qs = (q * s8[..., None]).astype(F32)
    if per_token:
        deq = ((qs * amax[:, None, None]).astype(F32) / F32(2688)).astype(F32)
    else:
        deq = (qs * dec[:, None, None]).astype(F32)
    sq = ((deq - xb).astype(F32) ** 2).astype(F32)
    err = sq[..., 0]
    for i in range(1, 16):
        err = (err + sq[..., i]).astype(F32)
    return err


def quantize_ref(x, per_token=False, recipe="nvfp4", enc=None):
    """x: float32 [rows, K] -> (packed uint8, e4m3 bits uint8, global decode float32); ``enc``: a given global
    encode scale (scalar, or one per row with ``per_token``) in place of the amax's."""
    x = np.asarray(x, F32)
    rows, k = x.shape
    with np.errstate(divide="ignore", over="ignore", invalid="ignore", under="ignore"):
        amax = np.max(np.abs(x), axis=1) if per_token else np.full(rows, np.max(np.abs(x)), F32)
        given = enc is not None
        if given:
            enc = np.broadcast_to(np.asarray(enc, F32), (rows,)).astype(F32)
        else:
            enc = np.minimum(F32(2688) / amax.astype(F32), FLT_MAX).astype(F32)
            enc = np.where(enc == 0, F32(1), enc).astype(F32)
        dec = (F32(1) / enc).astype(F32)
        xb = x.reshape(rows, k // 16, 16)
        vmax = np.max(np.abs(xb), axis=2)
        if recipe == "nvfp4":
            s_bits, _, codes = _encode(xb, (vmax * (enc * F32(1 / 6))[:, None]).astype(F32), dec)
        else:  # section 2a
            sf6 = np.where(vmax == 0, F32(0), ((vmax / F32(6)).astype(F32) * enc[:, None]).astype(F32))
            (b4, s4, c4), (b6, s6, c6) = (_encode(xb, sf, dec) for sf in ((sf6 * F32(1.5)).astype(F32), sf6))
            per_row = per_token and not given  # (a given scale: the per-tensor error terms)
            pick4 = _sq_error(xb, c4, s4, dec, amax, per_row) < _sq_error(xb, c6, s6, dec, amax, per_row)
            s_bits, codes = np.where(pick4, b4, b6), np.where(pick4[..., None], c4, c6)
    codes = codes.reshape(rows, k)
    data = codes[:, 0::2] | (codes[:, 1::2] << 4)
    gs = dec if per_token and given else np.where(amax == 0, F32(0), dec) if per_token else dec[:1].reshape(())
    return data, s_bits, gs.astype(F32)
