"""Timing helpers shared by the benchmarks: warm up, then the median over repeats of a
jitted function, rotating among several input sets so that caches do not flatter us."""

from __future__ import annotations

import statistics
import time

import jax


def median_time(fn, arg_sets, *, warmup: int = 2, repeats: int = 10) -> float:
    """Median seconds of ``fn(*args)`` (already jitted), cycling through ``arg_sets``."""
    for i in range(warmup):
        jax.block_until_ready(fn(*arg_sets[i % len(arg_sets)]))
    times = []
    for i in range(repeats):
        args = arg_sets[i % len(arg_sets)]
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def device_name() -> str:
    d = jax.devices()[0]
    return getattr(d, "device_kind", d.platform)
