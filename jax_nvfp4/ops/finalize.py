"""moe_finalize: each token's k rows summed in a fixed order, and its twin."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .extension import TARGET_FINALIZE, ensure_registered, check_kernel_flags, _check_impl


def moe_finalize(y, pair_to_row, *, impl: str = "ffi", kernel_flags: int = 0):
    """``out[t] = bf16(sum_j y[pair_to_row[t, j]])``, j = 0..k-1 in order, fp32 accumulation.

    Parameters
    ----------
    y : bfloat16 ``[P, H]`` (GEMM2 rows, already scaled by the routing weights)
    pair_to_row : int32 ``[T, k]`` (-1: the pair adds nothing)
    impl : ``"ffi"`` or ``"jax"``
    kernel_flags : :class:`KernelFlag` bits (``PDL``; the result is the same)

    Returns
    -------
    bfloat16 ``[T, H]``
    """
    _check_impl(impl)
    kernel_flags = check_kernel_flags(kernel_flags)
    y = jnp.asarray(y).astype(jnp.bfloat16)
    pair_to_row = jnp.asarray(pair_to_row, jnp.int32)
    t, k = pair_to_row.shape
    if impl == "jax":
        p = y.shape[0]
        acc = jnp.zeros((t, y.shape[1]), jnp.float32)
        for j in range(k):  # fixed order, as the kernels
            r = pair_to_row[:, j]
            ok = (r >= 0) & (r < p)
            acc = jnp.where(ok[:, None], acc + y[jnp.clip(r, 0, max(p - 1, 0))].astype(jnp.float32), acc)
        return acc.astype(jnp.bfloat16)
    ensure_registered()
    return jax.ffi.ffi_call(TARGET_FINALIZE, jax.ShapeDtypeStruct((t, y.shape[1]), jnp.bfloat16),
                            vmap_method="sequential")(y, pair_to_row, kernel_flags=np.int64(kernel_flags))
