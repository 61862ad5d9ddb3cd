"""device_clock: a benchmark's on-device timestamps."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .extension import TARGET_CLOCK, ensure_registered


def device_clock(x):
    """``(x, ns)``: ``x`` unchanged and the time at which the device reached it.

    A benchmark helper: ``ns`` (uint32 ``[2]``, nanoseconds as low and high words; see
    :func:`clock_ns`) is taken by a custom call that runs once everything ``x`` depends on has run
    (the GPU's ``%globaltimer`` after the earlier kernels on the stream; the CPU's steady clock).
    Two clocks around a chain of layers time the chain on the device, without host jitter or
    dispatch overhead. ``x`` passes through aliased, so later work must use the returned ``x``.
    """
    ensure_registered()
    x = jnp.asarray(x)
    return jax.ffi.ffi_call(TARGET_CLOCK, (jax.ShapeDtypeStruct(x.shape, x.dtype),
                                           jax.ShapeDtypeStruct((2,), jnp.uint32)),
                            input_output_aliases={0: 0}, vmap_method="sequential")(x)


def clock_ns(ns) -> int:
    """The nanoseconds of a :func:`device_clock` reading (host side)."""
    lo, hi = (int(v) for v in np.asarray(ns, np.uint32))
    return lo | (hi << 32)
