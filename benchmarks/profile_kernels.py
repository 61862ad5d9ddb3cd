"""Run one MoE layer a few times, for a kernel profiler (Nsight Compute) to attach to.

    ncu --kernel-name regex:"Moe|W4A16|Quant" --launch-skip 4 --launch-count 4 --csv \\
        python benchmarks/profile_kernels.py --shape deepseek_v3_ep8 --tokens 1

The first call compiles and warms up (its kernels are the ones to skip); each later call
launches the layer's kernels once (w4a16: align, GEMM1, GEMM2, finalize; w4a4 with
``--kernel-flags 8``: two quant_dequant_rows launches more).

``--timeline N`` needs no profiler: it traces N single calls with ``jax.profiler`` and prints the
device timeline of the median one, every kernel (XLA's glue too) with its duration and the gap
before it.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax

import jax_nvfp4 as nv
from jax_nvfp4 import arg_specs as specs
from jax_nvfp4.backends.ffi import FFIBackend

sys.path.insert(0, os.path.dirname(__file__))
from _timing import kernel_timeline, span_us  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="deepseek_v3_ep8", choices=sorted(specs.ALL_SHAPES))
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--mode", default="w4a16", choices=("w4a16", "w4a4"))
    p.add_argument("--backend", default="ffi")
    p.add_argument("--calls", type=int, default=3, help="calls after the warm-up call")
    p.add_argument("--timeline", type=int, default=0, metavar="N",
                   help="trace N single calls (jax.profiler) and print the median one's kernel timeline")
    p.add_argument("--kernel-flags", type=int, default=0,
                   help="KernelFlag bits of the ffi backend (as moe_bench.py --ffi-flags)")
    p.add_argument("--tile-m", type=int, default=None, help="rows per GEMM tile of the ffi backend (as --ffi-tile-ms)")
    p.add_argument("--order", default="auto", choices=("auto", "rows", "blocked"),
                   help="byte order of the experts (auto: jax_nvfp4.weight_order of the backend, as users get)")
    args = p.parse_args(argv)
    shape = specs.ALL_SHAPES[args.shape]
    key = jax.random.key(0)
    experts = specs.random_nvfp4_experts(key, shape)
    order = args.order if args.order != "auto" else nv.weight_order(
        args.backend, hidden_size=shape.hidden, intermediate_size=shape.intermediate)
    if order == "blocked":
        experts = nv.to_blocked_experts(experts)
    kx, kr = jax.random.split(jax.random.fold_in(key, args.tokens))
    x = specs.random_hidden(kx, args.tokens, shape)
    ids, w = specs.random_routing(kr, args.tokens, shape)
    if args.kernel_flags or args.tile_m:  # a kernel variant: the backend object, as moe_bench.py times it
        if args.backend != "ffi":
            p.error("--kernel-flags and --tile-m need --backend ffi")
        impl = FFIBackend(args.kernel_flags, tile_m=args.tile_m)
        problem = shape.problem(args.tokens, args.mode)
        f = jax.jit(lambda x, i, w, ex: impl(x, ex, i, w, problem=problem,
                                             local_expert_offset=shape.local_expert_offset))
    else:
        f = jax.jit(lambda x, i, w, ex: nv.moe(x, ex, topk_ids=i, topk_weights=w, mode=args.mode,
                                               backend=args.backend, activation=shape.activation,
                                               local_expert_offset=shape.local_expert_offset))
    for _ in range(1 + args.calls):
        jax.block_until_ready(f(x, ids, w, experts))
    flags = f"[flags={args.kernel_flags}]" if args.kernel_flags else ""
    flags += f"[tm={args.tile_m}]" if args.tile_m else ""
    print(f"ran {args.shape} T={args.tokens} {args.mode} on {args.backend}{flags}, {experts.gate_up.order} weights: "
          f"{1 + args.calls} calls")
    if args.timeline:
        events = kernel_timeline(f, (x, ids, w, experts), traces=args.timeline)
        print(f"timeline ({jax.devices()[0].platform}, median span of {args.timeline} traced calls):")
        print(f"  {'start_us':>9s} {'dur_us':>8s} {'gap_us':>7s}  kernel (XLA op)")
        for r in events:
            print(f"  {r['start_us']:9.1f} {r['dur_us']:8.1f} {r['gap_us']:7.1f}  {r['name'][:60]} ({r['op']})")
        busy, gaps = sum(r["dur_us"] for r in events), sum(r["gap_us"] for r in events)
        print(f"  {len(events)} kernels: busy {busy:.1f} us, gaps {gaps:.1f} us, span {span_us(events):.1f} us")


if __name__ == "__main__":
    main()
