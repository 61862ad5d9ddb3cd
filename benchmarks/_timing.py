"""Timing helpers shared by the benchmarks: warm up, then the median over repeats of a
jitted function, rotating among several input sets so that caches do not flatter us."""

from __future__ import annotations

import functools
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


def chained_time(fn, x, routing_sets, rest, *, n: int = 20, repeats: int = 3) -> float:
    """Seconds per call of a layer ``fn(x, ids, w, *rest) -> x'`` (same shape and dtype as ``x``),
    with JAX's per-call dispatch overhead removed: 1 and n+1 layers chained in one jit,
    (t(n+1) - t(1)) / n, each the best of ``repeats``. The chain is unrolled (straight-line
    code, as a model's layers): an XLA while loop would add a host round trip per step. Step i
    uses routing set i % S, so consecutive layers hit different experts and small weight sets do
    not stay in L2 across steps."""
    s = len(routing_sets)

    @functools.partial(jax.jit, static_argnums=0)
    def run(m, x, routing, *rest):
        for i in range(m):
            x = fn(x, *routing[i % s], *rest)
        return x

    def best_of(m, k):
        times = []
        for _ in range(k):
            t0 = time.perf_counter()
            jax.block_until_ready(run(m, x, routing_sets, *rest))
            times.append(time.perf_counter() - t0)
        return min(times)

    for m in (1, n + 1):  # compile both before timing either
        jax.block_until_ready(run(m, x, routing_sets, *rest))
    for attempt in range(3):  # host noise can swamp a short chain of cheap layers: retry longer
        k = repeats * 4**attempt
        diff = best_of(n + 1, k) - best_of(1, k)
        if diff > 0:
            return diff / n
    raise RuntimeError(f"a chain of {n} layers did not resolve above timing noise "
                       f"(t({n + 1}) <= t(1) over {k} repeats); use a longer --chain")
