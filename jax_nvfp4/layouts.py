"""Scale and weight layouts that kernels consume (spec section 3).

Canonical in jax_nvfp4: linear scales, GEMM1 rows ``[gate; up]``. Kernel layouts are exact
rearrangements (rows move, nothing is requantized). Row orders are numpy index arrays with
``rows[new] = old``, applied as ``w[..., rows, :]``.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

SWIZZLE_ROWS = 128  # rows per swizzle tile
SWIZZLE_COLS = 4  # K-blocks per swizzle tile


def _ceil(a, b):
    return -(-a // b) * b


def swizzle_scales(scales):
    """Linear block scales ``[..., M, KB]`` -> the 128x4 swizzled layout ``[..., Mp * KBp]``.

    Rows are padded to a multiple of 128 and K-blocks to a multiple of 4 with zeros; element
    ``(m, k)`` moves to ``(m//128)*(KBp/4)*512 + (k//4)*512 + (m%32)*16 + ((m%128)//32)*4 + k%4``.
    Works on uint8 or float8_e4m3fn scales and keeps the dtype.
    """
    scales = jnp.asarray(scales)
    *lead, m, kb = scales.shape
    mp, kbp = _ceil(m, SWIZZLE_ROWS), _ceil(kb, SWIZZLE_COLS)
    pad = [(0, 0)] * len(lead) + [(0, mp - m), (0, kbp - kb)]
    s = jnp.pad(scales, pad)
    # [.., Mp/128, 4 (m%128//32), 32 (m%32), KBp/4, 4 (k%4)] -> [.., Mp/128, KBp/4, 32, 4, 4]
    s = s.reshape(*lead, mp // 128, 4, 32, kbp // 4, 4)
    n = len(lead)
    s = s.transpose(*range(n), n, n + 3, n + 2, n + 1, n + 4)
    return s.reshape(*lead, mp * kbp)


def unswizzle_scales(swizzled, rows: int, k_blocks: int):
    """Inverse of :func:`swizzle_scales`: ``[..., Mp * KBp]`` -> linear ``[..., rows, k_blocks]``."""
    swizzled = jnp.asarray(swizzled)
    *lead, flat = swizzled.shape
    mp, kbp = _ceil(rows, SWIZZLE_ROWS), _ceil(k_blocks, SWIZZLE_COLS)
    if flat != mp * kbp:
        raise ValueError(
            f"swizzled has {flat} entries per matrix; rows={rows}, k_blocks={k_blocks} need {mp * kbp}")
    n = len(lead)
    s = swizzled.reshape(*lead, mp // 128, kbp // 4, 32, 4, 4)
    s = s.transpose(*range(n), n, n + 3, n + 2, n + 1, n + 4)
    return s.reshape(*lead, mp, kbp)[..., :rows, :k_blocks]


def _check_rows(m, multiple, what):
    if m % multiple:
        raise ValueError(f"{what}: the number of rows must be a multiple of {multiple}, got {m}")


def trtllm_gated_reorder(m: int) -> np.ndarray:
    """TensorRT-LLM-gen gated reorder R of ``[up; gate]`` rows: new 2i = old i, new 2i+1 = old i + m/2."""
    _check_rows(m, 2, "trtllm_gated_reorder")
    half = np.arange(m // 2)
    return np.stack([half, half + m // 2], axis=1).reshape(m)


def trtllm_epilogue_shuffle(m: int) -> np.ndarray:
    """TensorRT-LLM-gen epilogue-tile shuffle S: within each 32-row block, new j = old (j%8)*4 + j//8.

    This is also the whole GEMM2 row permutation.
    """
    _check_rows(m, 32, "trtllm_epilogue_shuffle")
    j = np.arange(32)
    block = (j % 8) * 4 + j // 8
    return (np.arange(m // 32)[:, None] * 32 + block[None, :]).reshape(m)


def trtllm_gemm1_rows(m: int) -> np.ndarray:
    """GEMM1 row order for TensorRT-LLM-gen of ``[up; gate]`` weights with m = 2I rows: ``R[S]``."""
    _check_rows(m, 32, "trtllm_gemm1_rows")
    return trtllm_gated_reorder(m)[trtllm_epilogue_shuffle(m)]


def trtllm_gemm2_rows(m: int) -> np.ndarray:
    """GEMM2 row order for TensorRT-LLM-gen (m = H rows): ``S``."""
    _check_rows(m, 32, "trtllm_gemm2_rows")
    return trtllm_epilogue_shuffle(m)


def cutedsl_gemm1_rows(m: int, group: int = 64) -> np.ndarray:
    """CuTe DSL GEMM1 row order of ``[up; gate]`` weights: ``[up0:64, gate0:64, up64:128, ...]``."""
    _check_rows(m, 2 * group, "cutedsl_gemm1_rows")
    half = m // 2
    g = np.arange(half // group)[:, None] * group + np.arange(group)[None, :]  # [G, 64]
    return np.stack([g, g + half], axis=1).reshape(m)


def gate_up_to_up_gate(m: int) -> np.ndarray:
    """Row order turning jax_nvfp4's canonical ``[gate; up]`` (m = 2I rows) into ``[up; gate]``."""
    _check_rows(m, 2, "gate_up_to_up_gate")
    return np.roll(np.arange(m), -(m // 2))
