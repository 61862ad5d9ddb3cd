"""Which MoE configurations are batch-invariant: does a token get the same output bytes whatever
batch it runs in?

RL users compare logprobs of the same sequence computed in batches of different sizes (rollout
vs. training); a kernel whose summation order depends on the batch (tile size, split-K, kernel
choice) gives slightly different numbers. For each configuration this runs the same ``--probes``
tokens alone and as the first rows of batches of T tokens (the other rows random) and reports,
per T, whether the probe rows are bitwise equal to the probes-only run (else the max |diff|).

    python benchmarks/batch_invariance.py --shape deepseek_v3_ep8 --tokens 4,64,1024,4096

Configurations: ``xla`` (the pure-JAX backend), ``ffi`` (default kernels), ``moe(batch_invariant=True)``,
and ffi variants ``ffi[flags=F,k_split=S]`` (``--variants "2:1,0:1"``: KernelFlag bits F, k_split S or ``auto``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_nvfp4 as nv
from jax_nvfp4 import ops
from jax_nvfp4 import arg_specs as specs

sys.path.insert(0, os.path.dirname(__file__))
from _timing import device_name  # noqa: E402


def _parse_variants(text):
    out = []
    for item in filter(None, text.split(",")):
        flags, _, split = item.partition(":")
        split = None if split in ("", "auto") else int(split)
        if split is not None and split not in ops.K_SPLITS:
            raise ValueError(f"k_split must be one of {ops.K_SPLITS} or auto, got {split}")
        out.append((ops.check_kernel_flags(int(flags)), split))
    return out


def configurations(variants, mode):
    """label -> fn(x, ids, w, experts, offset) -> bf16 [T, H]."""
    def ffi(flags, split):
        return lambda x, i, w, ex, off: ops.moe(x, ex, i, w, mode=mode, local_expert_offset=off,
                                                kernel_flags=flags, k_split=split)
    confs = {"xla": lambda x, i, w, ex, off: nv.moe(x, ex, topk_ids=i, topk_weights=w, mode=mode, backend="xla",
                                                    local_expert_offset=off)}
    if ops.extension_error() is None:
        confs["ffi"] = ffi(0, None)
        confs["moe(batch_invariant=True)"] = lambda x, i, w, ex, off: nv.moe(
            x, ex, topk_ids=i, topk_weights=w, mode=mode, local_expert_offset=off, batch_invariant=True)
        for flags, split in variants:
            confs[f"ffi[flags={flags},k_split={split or 'auto'}]"] = ffi(flags, split)
    return confs


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="deepseek_v3_ep8", choices=sorted(specs.ALL_SHAPES))
    p.add_argument("--tokens", default="4,16,64,256,1024,4096", help="batch sizes (each >= --probes)")
    p.add_argument("--probes", type=int, default=4)
    p.add_argument("--mode", default="w4a16", choices=("w4a16", "w4a4"))
    p.add_argument("--variants", default="2:1,0:1,2:auto", help="ffi variants FLAGS:K_SPLIT, comma-separated")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    try:
        variants = _parse_variants(args.variants)
    except ValueError as err:
        p.error(f"--variants: {err}")
    tokens = sorted({int(t) for t in args.tokens.split(",") if t})
    if not tokens or tokens[0] < args.probes:
        p.error(f"--tokens must all be >= --probes ({args.probes})")
    shape = specs.ALL_SHAPES[args.shape]
    key = jax.random.key(0)
    experts = specs.random_nvfp4_experts(key, shape)
    if nv.weight_order("ffi", hidden_size=shape.hidden, intermediate_size=shape.intermediate) == "blocked":
        experts = nv.to_blocked_experts(experts)  # what users of the ffi backend hold on a GPU
    big = tokens[-1]
    x_all = specs.random_hidden(jax.random.fold_in(key, 1), big, shape)
    ids_all, w_all = specs.random_routing(jax.random.fold_in(key, 2), big, shape)
    print(f"device: {device_name()}  shape {shape.name}  mode {args.mode}  probes {args.probes}  "
          f"{experts.gate_up.order} weights")
    rows = []
    for label, fn in configurations(variants, args.mode).items():
        f = jax.jit(lambda x, i, w, ex, fn=fn: fn(x, i, w, ex, shape.local_expert_offset))
        n = args.probes
        alone = np.asarray(f(x_all[:n], ids_all[:n], w_all[:n], experts).astype(jnp.float32))
        line = []
        for t in tokens:
            try:
                got = np.asarray(f(x_all[:t], ids_all[:t], w_all[:t], experts)[:n].astype(jnp.float32))
            except ValueError as err:  # e.g. a k_split that this T's tile size does not allow
                rows.append(dict(shape=shape.name, mode=args.mode, config=label, tokens=t, error=str(err)))
                line.append(f"T={t}: n/a")
                continue
            same = bool(np.array_equal(got.view(np.uint32), alone.view(np.uint32)))
            diff = float(np.max(np.abs(got - alone)))
            rows.append(dict(shape=shape.name, mode=args.mode, config=label, tokens=t, bitwise_equal=same,
                             max_abs_diff=diff))
            line.append(f"T={t}: " + ("same" if same else f"diff {diff:.2e}"))
        print(f"  {label:28s} " + "  ".join(line))
    if args.json:
        tmp = args.json + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(dict(device=device_name(), jax=jax.__version__, results=rows), fh, indent=1)
        os.replace(tmp, args.json)
    return rows


if __name__ == "__main__":
    main()
