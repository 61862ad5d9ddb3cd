"""MoE layer latency per backend and mode, against a bf16 ``jax.lax.ragged_dot`` baseline and the
byte and FLOP floors of the experts actually hit.

Shapes (``jax_nvfp4.arg_specs``): a DeepSeek-V3 EP8 shard (256 experts, top-8, 32 local, H 7168,
I 2048; every token's 8 rows land on the 32 local experts) and Qwen3-30B-A3B (128 experts, top-8,
H 2048, I 768); also gpt-oss-120b (``--shapes gpt_oss_120b``: 128 experts, top-4, H = I = 2880, its
SwiGLU and expert biases; ``--expert-bias`` gives any shape biases). Routing is precomputed (random,
``topk_ids``/``topk_weights``), so the timings are of the expert part: dispatch, GEMM1, activation,
GEMM2, combine.

Floors, for the experts the batch actually hits (averaged over the input sets):
``bytes / 4.3 TB/s`` (NVFP4 data + block scales, or bf16) and ``2 * rows * H * 3I / 790 TFLOP/s``.

    python benchmarks/moe_bench.py [--quick] [--backends xla,ffi] [--modes bf16,w4a16,w4a4]
        [--shapes deepseek_v3_ep8,qwen3_30b_a3b] [--tokens 1,4,16] [--xla-variants all/ragged,all/tiled]
        [--expert-bias] [--static-scales] [--json out.json] [--plot out.png]

``--quick`` runs tiny shapes (a CPU smoke test in seconds). Backends that are not available on
the default device, or do not support a problem, are skipped with a note.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _timing import chained_time, device_clock_available, device_name, median_time  # noqa: E402

import jax_nvfp4 as nv  # noqa: E402
from jax_nvfp4 import arg_specs as specs  # noqa: E402
from jax_nvfp4.backends import base  # noqa: E402
from jax_nvfp4 import ops  # noqa: E402
from jax_nvfp4.backends.ffi import FFIBackend  # noqa: E402
from jax_nvfp4.backends.xla import XLABackend  # noqa: E402

BASELINE = "ragged_dot_bf16"


def ragged_dot_moe(x, w13t, w2t, topk_ids, topk_weights, offset):
    """The plain JAX recipe: sort pairs by expert, ``ragged_dot`` GEMM1, SwiGLU, ``ragged_dot``
    GEMM2, weighted combine. ``w13t [E, H, 2I]`` and ``w2t [E, I, H]`` bf16 (``ragged_dot``'s
    layout); ids outside the local experts are dropped."""
    t, k = topk_ids.shape
    e = w13t.shape[0]
    local = topk_ids.reshape(-1) - offset
    key = jnp.where((local >= 0) & (local < e), local, e)
    order = jnp.argsort(key)
    sizes = jnp.bincount(key, length=e + 1)[:e].astype(jnp.int32)
    h = jax.lax.ragged_dot(x[order // k], w13t, sizes)
    inter = h.shape[1] // 2
    a = (jax.nn.silu(h[:, :inter].astype(jnp.float32)) * h[:, inter:]).astype(jnp.bfloat16)
    y = jax.lax.ragged_dot(a, w2t, sizes).astype(jnp.float32)
    y = y * jnp.where(key[order] < e, topk_weights.reshape(-1)[order], 0.0)[:, None]
    out = jnp.zeros((t * k, y.shape[1]), jnp.float32).at[order].set(y)
    return out.reshape(t, k, -1).sum(1).astype(jnp.bfloat16)


def expanded_flops(shape, rows):
    """FLOPs of XLA's dense expansion of ``ragged_dot`` (every row times every group)."""
    return shape.flops(rows) * shape.local_experts


def floors(shape, rows, hit):
    flop = shape.flops(rows) / specs.H200_BF16_FLOP_PER_S
    return {"floor_nvfp4_bytes_us": 1e6 * shape.weight_bytes(hit, "w4a16") / specs.H200_HBM_BYTES_PER_S,
            "floor_bf16_bytes_us": 1e6 * shape.weight_bytes(hit, "bf16") / specs.H200_HBM_BYTES_PER_S,
            "floor_flops_us": 1e6 * flop}


def ks_label(k_split):
    """A forced K split as its row label: 'S' for both GEMMs, 'S1/S2' for GEMM1's and GEMM2's."""
    return "/".join(map(str, k_split)) if isinstance(k_split, tuple) else str(k_split)


def bench_shape(shape, tokens, modes, backends, args, log, on_tokens=None):
    """The rows of one shape; ``on_tokens(rows_so_far)`` after each token count (partial saves)."""
    key = jax.random.key(args.seed)
    q = specs.random_nvfp4_experts(key, shape)
    ordered = {"rows": q}  # q in each backend's weight order (jax_nvfp4.weight_order), made once

    def nvfp4_for(backend):
        order = nv.weight_order(backend, hidden_size=shape.hidden, intermediate_size=shape.intermediate)
        if order not in ordered:
            ordered[order] = nv.to_blocked_experts(q)
        return ordered[order]

    need_bf16 = "bf16" in modes or not args.no_baseline
    b = specs.to_bf16_experts(q) if need_bf16 else None
    w13t = w2t = None
    if not args.no_baseline:
        w13t, w2t = jnp.swapaxes(b.gate_up, 1, 2), jnp.swapaxes(b.down, 1, 2)
    results = []
    for t in tokens:
        sets, routings = [], []  # routings: one per chained layer (chained_time), the sets' first
        for i in range(max(args.sets, args.chain + 1)):
            kx, kr = jax.random.split(jax.random.fold_in(key, 1000 * t + i))
            routings.append(specs.random_routing(kr, t, shape))
            if i < args.sets:
                sets.append((specs.random_hidden(kx, t, shape), *routings[i]))
        hit = float(np.mean([specs.experts_hit(s[1], shape) for s in sets]))
        rows = t * shape.top_k
        common = dict(shape=shape.name, tokens=t, rows=rows, experts_hit=hit, **floors(shape, rows, hit))

        def skip(name, mode, why):
            results.append(dict(common, backend=name, mode=mode, skipped=why))
            log(f"  {shape.name:16s} T={t:5d} {name:20s} {mode:6s} skipped: {why}")

        def record(name, mode, fn, arg_sets):
            try:
                chained = args.chain and name.split("[")[0] in args.chain_backends
                timing = f"chain{args.chain}/{args.clock}" if chained else "median"
                if timing != "median":  # layers chained in one jit: no per-call dispatch overhead
                    sec = chained_time(fn, arg_sets[0][0], routings, arg_sets[0][3:],
                                       n=args.chain, repeats=args.repeats, clock=args.clock)
                else:
                    sec = median_time(jax.jit(fn), arg_sets, warmup=args.warmup, repeats=args.repeats)
            except Exception as err:  # report and go on: one failing backend must not stop the run
                results.append(dict(common, backend=name, mode=mode, error=f"{type(err).__name__}: {err}"))
                log(f"  {shape.name:16s} T={t:5d} {name:20s} {mode:6s} FAILED {type(err).__name__}")
                return
            floor = max(common["floor_bf16_bytes_us" if mode == "bf16" else "floor_nvfp4_bytes_us"],
                        common["floor_flops_us"])
            order = getattr(getattr(arg_sets[0][-1], "gate_up", None), "order", None)  # NVFP4 experts' byte order
            results.append(dict(common, backend=name, mode=mode, median_us=1e6 * sec, timing=timing,
                                floor_us=floor, fraction_of_floor=floor / (1e6 * sec),
                                **({"weight_order": order} if isinstance(order, str) else {})))
            log(f"  {shape.name:16s} T={t:5d} {name:20s} {mode:6s} {1e6 * sec:10.1f} us"
                f"   (floor {floor:8.1f} us, hit {hit:5.1f} experts)")

        for mode in modes:
            problem = shape.problem(t, mode)
            for name in backends:
                if name not in base.names():
                    why = f"backend {name!r} is not registered (registered: {', '.join(base.names())})"
                else:
                    bk = base.get(name)
                    why = bk.unavailable_reason() or bk.unsupported_reason(problem)
                if why:
                    skip(name, mode, why)
                    continue

                def fn(x, ids, w, ex, name=name, mode=mode):
                    return nv.moe(x, ex, topk_ids=ids, topk_weights=w, mode=mode, backend=name,
                                  activation=shape.activation, local_expert_offset=shape.local_expert_offset)

                record(name, mode, fn, [s + (b if mode == "bf16" else nvfp4_for(name),) for s in sets])

            variants = [(f"xla[{v}]", XLABackend(*v.split("/"))) for v in args.xla_variants]
            if mode != "bf16" and not FFIBackend().unavailable_reason():
                variants += [(f"ffi[flags={f}]", FFIBackend(f)) for f in args.ffi_flags]
                variants += [(f"ffi[ks={ks_label(s)}]", FFIBackend(k_split=s)) for s in args.ffi_k_splits]
                variants += [(f"ffi[tm={m}" + (f",flags={f}]" if f else "]"), FFIBackend(f, tile_m=m))
                             for m, f in args.ffi_tile_ms]
                variants += [(f"ffi[flags={f},ks={ks_label(s)}]", FFIBackend(f, k_split=s))
                             for f, s in args.ffi_configs]
                if args.ffi_rows:  # the default kernels on the checkpoint's rows order
                    variants.append(("ffi[rows]", FFIBackend()))
            for label, impl in variants:  # forced strategies / kernel variants, side by side

                def fn(x, ids, w, ex, impl=impl, problem=problem):
                    return impl(x, ex, ids, w, problem=problem, local_expert_offset=shape.local_expert_offset)

                ex = b if mode == "bf16" else q if label == "ffi[rows]" else nvfp4_for(label.split("[")[0])
                record(label, mode, fn, [s + (ex,) for s in sets])

        if not args.no_baseline:
            tflop = expanded_flops(shape, rows) / 1e12
            if tflop > args.max_expanded_tflop:
                why = (f"XLA expands ragged_dot densely over the {shape.local_experts} groups: "
                       f"{tflop:.0f} TFLOP > --max-expanded-tflop {args.max_expanded_tflop:g}")
                skip(BASELINE, "bf16", why)
            else:
                off = shape.local_expert_offset
                record(BASELINE, "bf16", lambda x, ids, w, a, c: ragged_dot_moe(x, a, c, ids, w, off),
                       [s + (w13t, w2t) for s in sets])
        if on_tokens:
            on_tokens(results)
    return results


def write_json(path, data):
    """Write ``data`` to ``path`` whole or not at all (a temp file renamed over it)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def plot(results, path, log):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no plot")
        return
    shapes = sorted({r["shape"] for r in results})
    fig, axes = plt.subplots(1, len(shapes), figsize=(6.5 * len(shapes), 4.8), squeeze=False)
    for ax, s in zip(axes[0], shapes):
        rs = [r for r in results if r["shape"] == s]
        for series in sorted({(r["backend"], r["mode"]) for r in rs if "median_us" in r}):
            pts = sorted((r["tokens"], r["median_us"]) for r in rs
                         if (r["backend"], r["mode"]) == series and "median_us" in r)
            ax.plot(*zip(*pts), marker="o", label=f"{series[0]} {series[1]}")
        for fk, label in (("floor_nvfp4_bytes_us", "floor: NVFP4 bytes"),
                          ("floor_bf16_bytes_us", "floor: bf16 bytes"), ("floor_flops_us", "floor: FLOPs")):
            pts = sorted({(r["tokens"], r[fk]) for r in rs})
            ax.plot(*zip(*pts), linestyle="--", linewidth=1, label=label)
        ax.set(xscale="log", yscale="log", xlabel="tokens", ylabel="latency (us)", title=s)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    log(f"wrote {path}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny shapes and few repeats (CPU smoke run)")
    p.add_argument("--backends", default="xla,ffi", help="comma-separated MoE backends (default xla,ffi)")
    p.add_argument("--modes", default="bf16,w4a16", help="comma-separated: bf16, w4a16, w4a4")
    p.add_argument("--shapes", default=None, help="comma-separated shape names (see arg_specs)")
    p.add_argument("--tokens", default=None, help="comma-separated token counts")
    p.add_argument("--xla-variants", default="",
                   help="comma-separated forced xla strategies dispatch/gmm, e.g. all/ragged,all/tiled,"
                        "gather/ragged,gather/tiled (to calibrate the automatic choice)")
    p.add_argument("--ffi-flags", default="",
                   help="comma-separated KernelFlag values to time as extra ffi rows 'ffi[flags=N]' (CUDA "
                        "kernel variants, see KernelFlag: 2 no wgmma, 4 two-block wgmma, 8 fused w4a4 quantize, 16 row-tiles-first wgmma grid, 32 one-warp align, 64 PDL launches; combine by adding)")
    p.add_argument("--ffi-k-splits", default="",
                   help="comma-separated k_split values (1, 2, 4; or S1/S2: GEMM1's and GEMM2's) to time as "
                        "extra ffi rows 'ffi[ks=N]': the decode tiles' K split fixed instead of chosen from the "
                        "shape (more CTAs per GEMM)")
    p.add_argument("--ffi-tile-ms", default="",
                   help="comma-separated tile_m values (8, 16, 32, 64) to time as extra ffi rows 'ffi[tm=N]': the "
                        "rows per GEMM tile fixed instead of chosen from the expected rows per expert; N:FLAGS "
                        "with a kernel variant too ('ffi[tm=N,flags=F]', e.g. 64:65536)")
    p.add_argument("--ffi-configs", default="",
                   help="comma-separated FLAGS:KSPLIT pairs to time as extra rows 'ffi[flags=F,ks=S]': a kernel "
                        "variant with the K split fixed too (e.g. 512:1,512:4)")
    p.add_argument("--ffi-rows", action="store_true",
                   help="time an extra row 'ffi[rows]': the experts in the checkpoint's rows order (every other "
                        "row gets them in its backend's jax_nvfp4.weight_order: blocked for ffi on a GPU)")
    p.add_argument("--no-baseline", action="store_true", help=f"skip the {BASELINE} baseline")
    p.add_argument("--expert-bias", action="store_true",
                   help="give every shape's experts biases (gpt-oss's; gpt_oss_120b has them anyway); the "
                        f"{BASELINE} baseline stays a plain SwiGLU layer")
    p.add_argument("--static-scales", action="store_true",
                   help="give every shape's experts static activation scales (NVFP4Experts.input_scales, ModelOpt's): "
                        "its w4a4 rows quantize on them instead of per token")
    p.add_argument("--max-expanded-tflop", type=float, default=100.0,
                   help="skip the baseline when ragged_dot's dense expansion exceeds this many TFLOP")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None,
                   help="timed calls per row (median), or with --chain runs of each chain length (best of)")
    p.add_argument("--sets", type=int, default=3, help="input sets the timing rotates through")
    p.add_argument("--chain", type=int, default=0,
                   help="time N layers chained in one jit (per layer: the chain's time / N, see --clock), which "
                        "removes JAX's per-call dispatch overhead; 0: median of single jitted calls")
    p.add_argument("--clock", choices=("auto", "device", "host"), default="auto",
                   help="what times a --chain: 'device' = two device_clock custom calls around the chain "
                        "(GPU %%globaltimer; no host jitter), 'host' = wall time of 1 and N+1 layers; 'auto' = "
                        "device when the ffi extension is built")
    p.add_argument("--chain-backends", default="ffi",
                   help="comma-separated backends --chain applies to (default ffi: microsecond kernels); the "
                        "others (and the baseline) are timed as single jitted calls, whose dispatch overhead "
                        "is small against their milliseconds and whose compile time a chain would multiply")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write results as JSON here")
    p.add_argument("--plot", default=None, help="write a PNG plot here (needs matplotlib)")
    args = p.parse_args(argv)

    all_shapes = specs.QUICK_SHAPES if args.quick else specs.SHAPES
    names = args.shapes.split(",") if args.shapes else list(all_shapes)
    known = specs.ALL_SHAPES
    unknown = [n for n in names if n not in known]
    if unknown:
        p.error(f"unknown shapes {unknown}; known: {sorted(known)}")
    tokens = ([int(t) for t in args.tokens.split(",")] if args.tokens
              else list(specs.QUICK_TOKENS if args.quick else specs.TOKENS))
    modes = args.modes.split(",")
    bad = [m for m in modes if m not in base.MODES]
    if bad:
        p.error(f"unknown modes {bad}; valid: {base.MODES}")
    backends = [b for b in args.backends.split(",") if b]
    args.xla_variants = [v for v in args.xla_variants.split(",") if v]
    args.chain_backends = set(args.chain_backends.split(","))
    if args.clock == "auto":
        args.clock = "device" if device_clock_available() else "host"
    def values(option, text, convert, expected=""):  # a comma-separated option, each item converted
        try:
            return [convert(v) for v in text.split(",") if v]
        except ValueError as err:
            p.error(f"{option}: {err}{expected}")

    def k_split(text):  # S (both GEMMs) or S1/S2 (GEMM1's, GEMM2's)
        parts = tuple(int(v) for v in text.split("/"))
        return FFIBackend(k_split=parts if len(parts) > 1 else parts[0]).k_split

    def config(c):  # FLAGS:KSPLIT
        f, k = c.split(":")
        return ops.check_kernel_flags(int(f)), k_split(k)

    args.ffi_flags = values("--ffi-flags", args.ffi_flags, lambda f: ops.check_kernel_flags(int(f)))
    args.ffi_k_splits = values("--ffi-k-splits", args.ffi_k_splits, k_split)
    args.ffi_configs = values("--ffi-configs", args.ffi_configs, config, " (expected FLAGS:KSPLIT pairs)")
    def tile_config(c):  # TILE_M or TILE_M:FLAGS
        m, _, f = c.partition(":")
        backend = FFIBackend(ops.check_kernel_flags(int(f or 0)), tile_m=int(m))
        return backend.tile_m, backend.kernel_flags

    args.ffi_tile_ms = values("--ffi-tile-ms", args.ffi_tile_ms, tile_config)
    for v in args.xla_variants:
        d, _, g = v.partition("/")
        if d not in ("gather", "all") or g not in ("ragged", "tiled"):
            p.error(f"--xla-variants entries are dispatch/gmm with dispatch in gather, all and gmm in "
                    f"ragged, tiled; got {v!r}")
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    args.repeats = args.repeats if args.repeats is not None else (3 if args.quick else 20)

    log = lambda s: print(s, flush=True)  # noqa: E731
    log(f"device: {device_name()}  jax {jax.__version__}  registered backends: {', '.join(base.names())}")
    results = []
    head = dict(device=device_name(), jax=jax.__version__, quick=args.quick,
                hbm_bytes_per_s=specs.H200_HBM_BYTES_PER_S, bf16_flop_per_s=specs.H200_BF16_FLOP_PER_S,
                warmup=args.warmup, repeats=args.repeats, sets=args.sets)

    def save_partial(rows):  # a run cut short by a time limit still leaves the rows it finished
        if args.json:
            write_json(args.json, dict(head, complete=False, results=results + rows))

    for n in names:
        shape = known[n]
        if args.expert_bias and not shape.expert_bias:  # a row name of its own: the same shape, with biases
            shape = dataclasses.replace(shape, name=f"{n}+bias", expert_bias=True)
        if args.static_scales:
            shape = dataclasses.replace(shape, name=f"{shape.name}+static", input_scales=True)
        results += bench_shape(shape, tokens, modes, backends, args, log, save_partial)
    out = dict(head, complete=True, results=results)
    if args.json:
        write_json(args.json, out)
        log(f"wrote {args.json}")
    if args.plot:
        plot(results, args.plot, log)
    return out


if __name__ == "__main__":
    main()
