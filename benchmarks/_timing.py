"""Timing helpers shared by the benchmarks: warm up, then the median over repeats of a
jitted function, rotating among several input sets so that caches do not flatter us."""

from __future__ import annotations

import functools
import glob
import os
import statistics
import tempfile
import time
import warnings

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


def device_clock_available() -> bool:
    """Whether :func:`chained_time` can use ``clock="device"`` (the ffi extension is built)."""
    from jax_nvfp4 import ops
    return ops.extension_error() is None


def _layers(fn, m, s, x, routing, rest):
    for i in range(m):
        # Each layer takes the experts through its own barrier, as a model's layers take their own experts: work
        # that reads only them (a bias's dtype conversion, 2 us of a gpt-oss decode layer until d6f3bcc) then runs
        # in every layer instead of once for the chain (XLA merges equal work on equal inputs), and no fusion
        # spans two layers (one layer's last glue with the next one's first).
        x, layer_rest = jax.lax.optimization_barrier((x, rest))
        x = fn(x, *routing[i % s], *layer_rest)
    return x


def clocked_chain(fn, n: int, s: int):
    """jit of ``(x, routing_sets, *rest) -> (x', t0, t1)``: n chained layers between two
    :func:`jax_nvfp4.ops.device_clock` readings (see :func:`chained_time`)."""
    from jax_nvfp4 import ops

    @jax.jit
    def timed(x, routing, *rest):
        x, t0 = ops.device_clock(x)
        # Work that does not depend on x (e.g. every layer's align, which reads only the
        # routing) could otherwise be scheduled before the first reading: all inputs pass a
        # barrier that comes after it.
        x, routing, rest = jax.lax.optimization_barrier((x, routing, rest))
        x, t1 = ops.device_clock(_layers(fn, n, s, x, routing, rest))
        return x, t0, t1

    return timed


def chained_time(fn, x, routing_sets, rest, *, n: int = 20, repeats: int = 3, clock: str = "host") -> float:
    """Seconds per call of a layer ``fn(x, ids, w, *rest) -> x'`` (same shape and dtype as ``x``),
    chained n times in one jit, so that JAX's per-call dispatch overhead does not count. The chain
    is unrolled (straight-line code, as a model's layers): an XLA while loop would add a host
    round trip per step. Every layer reads ``rest`` (the experts) through its own optimization barrier, so that
    work on the experts alone is not merged across the chain. Step i uses routing set i, so that layers hit different experts (small
    weight sets do not stay in L2 across steps) and, as in a model, no two layers share their
    routing: XLA would merge such layers' routing-only work (common subexpression elimination of
    the MoE's align custom call: 3 aligns for 20 layers with 3 sets, before 2026-12-02). Hence
    ``len(routing_sets) >= n`` (n + 1 with the host clock, which also times n + 1 layers).

    ``clock="device"``: two :func:`jax_nvfp4.ops.device_clock` readings around the n layers
    (on the GPU its ``%globaltimer``), the best of ``repeats`` runs of (t_end - t_start) / n; no host
    time enters. ``clock="host"``: wall time of 1 and n+1 chained layers, (t(n+1) - t(1)) / n, each
    the best of ``repeats`` (host jitter of the short runs enters; retried longer if it swamps them).
    """
    if clock not in ("host", "device"):
        raise ValueError(f"clock must be 'host' or 'device', got {clock!r}")
    s = len(routing_sets)
    if s < n + (clock == "host"):
        raise ValueError(f"routing_sets must hold a routing per layer (n = {n}, clock {clock!r}), got {s}: "
                         "layers sharing a routing would share their align (XLA merges equal custom calls)")
    if clock == "device":
        from jax_nvfp4 import ops
        timed = clocked_chain(fn, n, s)

        def span_ns():
            _, t0, t1 = jax.block_until_ready(timed(x, routing_sets, *rest))
            return ops.clock_ns(t1) - ops.clock_ns(t0)

        span_ns()  # compile, warm up
        return min(span_ns() for _ in range(repeats)) * 1e-9 / n

    @functools.partial(jax.jit, static_argnums=0)
    def run(m, x, routing, *rest):
        return _layers(fn, m, s, x, routing, rest)

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


def _trace_events(fn, args) -> list[dict]:
    """The device work of one ``fn(*args)`` call, from a ``jax.profiler`` trace of that call alone:
    [{name, op, start_us, dur_us}] sorted by start. On a GPU these are the kernels on the device's
    streams (XLA fusions and our custom calls' kernels alike); on the CPU, XLA's thunks."""
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            jax.block_until_ready(fn(*args))
        path = next(glob.iglob(os.path.join(d, "**", "*.xplane.pb"), recursive=True))
        data = jax.profiler.ProfileData.from_file(path)
        device = [p for p in data.planes if p.name.startswith("/device:")]
        events = []
        with warnings.catch_warnings():  # (jaxlib's stats type warns about its own __module__)
            warnings.simplefilter("ignore", DeprecationWarning)
            for plane in device[:1] or [p for p in data.planes if p.name == "/host:CPU"]:  # (one device)
                lines = list(plane.lines)
                # GPU: the stream lines (derived lines such as "XLA Ops", if any, repeat them).
                for line in [ln for ln in lines if device and "stream" in ln.name.lower()] or lines:
                    for e in line.events:
                        stats = dict(e.stats)
                        if not device and "hlo_op" not in stats:
                            continue  # host: only the executed XLA ops
                        events.append(dict(name=e.name, op=str(stats.get("hlo_op", "")),
                                           start_us=e.start_ns / 1e3, dur_us=e.duration_ns / 1e3))
    events.sort(key=lambda r: r["start_us"])
    t0 = events[0]["start_us"] if events else 0.0
    prev_end = t0
    for r in events:
        r["gap_us"] = max(0.0, r["start_us"] - prev_end)
        prev_end = max(prev_end, r["start_us"] + r["dur_us"])
        r["start_us"] -= t0
    return events


def span_us(events: list[dict]) -> float:
    """Microseconds from the first kernel's start to the last one's end (events of :func:`_trace_events`)."""
    return max((r["start_us"] + r["dur_us"] for r in events), default=0.0)


def kernel_timeline(fn, args, *, traces: int = 3) -> list[dict]:
    """Per-kernel device timeline of one call of ``fn`` (already warmed up): ``traces`` calls, each
    traced alone, and the one with the median span returned (see :func:`_trace_events`). The
    gaps between kernels are launch latency and dependency waits: what fusing or PDL can save."""
    runs = [_trace_events(fn, args) for _ in range(traces)]
    return sorted(runs, key=span_us)[traces // 2]
