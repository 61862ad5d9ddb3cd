"""Routing cost: ``jax_nvfp4.route`` and its two top-k forms (``lax.top_k``; the stable sort that XLA keeps split
over tokens, ``routing.top_k_sorted``), per call of router logits ``[T, E]`` float32.

Each figure is one jitted scan over 64 different logit sets divided by 64, so that dispatch is not timed; median
of ``--repeats`` such scans.

    python benchmarks/routing.py [--shapes T,E,k ...] [--repeats R] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
from jax import lax

sys.path.insert(0, __import__("os").path.dirname(__file__))
from _timing import device_name, median_time  # noqa: E402

import jax_nvfp4 as nv  # noqa: E402
from jax_nvfp4 import routing  # noqa: E402

# (T, E, k): decode and prefill of Qwen3-30B-A3B (128 experts, k 8) and DeepSeek-V3 (256, k 8).
SHAPES = [(1, 128, 8), (64, 128, 8), (4096, 128, 8), (1, 256, 8), (64, 256, 8), (4096, 256, 8)]
SETS = 64

FORMS = {
    "lax.top_k": lambda l, k: lax.top_k(l, k)[1],
    "top_k_sorted": lambda l, k: routing.top_k_sorted(l, k)[1],
    "route softmax_topk": lambda l, k: nv.route(l, "softmax_topk", top_k=k)[0],
}


def per_call(form, t: int, e: int, k: int, repeats: int) -> float:
    logits = jax.random.normal(jax.random.key(0), (SETS, t, e), jnp.float32)
    fn = FORMS[form]
    scan = jax.jit(lambda ls: lax.scan(lambda c, l: (c + fn(l, k).sum(), None), jnp.int32(0), ls)[0])
    return median_time(scan, [(logits,)], repeats=repeats) / SETS


def _shape(text: str):
    try:
        t, e, k = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected T,E,k (three integers), got {text!r}") from None
    if not (t >= 1 and 1 <= k <= e):
        raise argparse.ArgumentTypeError(f"expected T >= 1 and 1 <= k <= E, got {text!r}")
    return t, e, k


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", type=_shape, default=SHAPES, help="T,E,k triples (default: %s)" % SHAPES)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--json")
    a = p.parse_args(argv)
    rows = []
    print(f"device: {device_name()}, jax {jax.__version__}; us per call")
    print("| T | E | k | " + " | ".join(FORMS) + " |")
    print("| ---: | ---: | ---: |" + " ---: |" * len(FORMS))
    for t, e, k in a.shapes:
        us = {f: per_call(f, t, e, k, a.repeats) * 1e6 for f in FORMS}
        rows.append(dict(T=t, E=e, k=k, us=us))
        print(f"| {t} | {e} | {k} | " + " | ".join(f"{v:.2f}" for v in us.values()) + " |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(device=device_name(), jax=jax.__version__, rows=rows), f, indent=1)
    return rows


if __name__ == "__main__":
    main()
