"""Online NVFP4 quantization throughput (``quantize_experts``) vs a device copy of the same bytes.

Shapes: DeepSeek-V3-sized expert stacks, gate_up ``[32, 4096, 7168]`` and down ``[32, 7168, 2048]``
bf16. Reported in GB/s of input read; the copy baseline (``-x``: one read + one write of the
same bytes) is measured in the same run. Goal: quantization >= 40% of the copy's rate.

    python benchmarks/quantize.py [--quick | --shape E,N,K] [--repeats R] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, __import__("os").path.dirname(__file__))
from _timing import device_name, median_time  # noqa: E402

import jax_nvfp4 as nv  # noqa: E402

SHAPES = {"gate_up [32, 4096, 7168]": (32, 4096, 7168), "down [32, 7168, 2048]": (32, 7168, 2048)}
QUICK_SHAPES = {"gate_up [4, 256, 512]": (4, 256, 512), "down [4, 512, 128]": (4, 512, 128)}


def bench(shape, recipe: str, n_inputs: int = 2, repeats: int = 10):
    keys = jax.random.split(jax.random.key(0), n_inputs)
    xs = [(jax.random.normal(k, shape, jnp.bfloat16),) for k in keys]
    nbytes = xs[0][0].size * 2
    # Per-expert quantization of one stack: the work quantize_experts does for one tensor.
    amax_fn = lambda x: jnp.max(jnp.abs(x.astype(jnp.float32)), axis=(1, 2))
    quant = jax.jit(lambda x: nv.quantize(x, global_amax=amax_fn(x), recipe=recipe))
    copy = jax.jit(lambda x: -x)
    t_q = median_time(quant, xs, repeats=repeats)
    t_c = median_time(copy, xs, repeats=repeats)
    return dict(shape=list(shape), recipe=recipe, input_bytes=nbytes, quantize_s=t_q, copy_s=t_c,
                quantize_gbps=nbytes / t_q / 1e9, copy_gbps=nbytes / t_c / 1e9, ratio=t_c / t_q)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run)")
    p.add_argument("--recipes", default="nvfp4,4over6")
    p.add_argument("--shape", help="one expert stack E,N,K instead (e.g. 8,1024,2048 for a CPU run)")
    p.add_argument("--repeats", type=int, help="timed calls per figure (default 3 with --quick, else 10)")
    p.add_argument("--json", help="write results here")
    args = p.parse_args(argv)
    shapes = QUICK_SHAPES if args.quick else SHAPES
    if args.shape:
        shape = tuple(int(v) for v in args.shape.split(","))
        if len(shape) != 3 or shape[2] % 16:
            p.error(f"--shape must be E,N,K with K a multiple of 16, got {args.shape!r}")
        shapes = {f"[{args.shape}]": shape}
    repeats = args.repeats or (3 if args.quick else 10)
    rows = []
    print(f"device: {device_name()}  jax {jax.__version__}")
    print(f"{'tensor':28s} {'recipe':7s} {'quantize GB/s':>14s} {'copy GB/s':>10s} {'ratio':>6s}")
    for name, shape in shapes.items():
        for recipe in args.recipes.split(","):
            r = bench(shape, recipe, repeats=repeats)
            r["tensor"] = name
            rows.append(r)
            print(f"{name:28s} {recipe:7s} {r['quantize_gbps']:14.1f} {r['copy_gbps']:10.1f} {r['ratio']:6.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=device_name(), jax=jax.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
