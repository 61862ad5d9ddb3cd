"""Variant rows of ``moe_bench.py --json`` output against the default ``ffi`` row of the same run.

    python3 benchmarks/ab_summary.py out/ab_decode.json [more.json ...] [--tolerance 0.03]

For every variant (``ffi[flags=N]``, ``ffi[ks=N]``, ``ffi[tm=N]``): its time / the default's time per shape, token
count and mode, and how often it is faster or slower by more than the tolerance. A default should
change only for a variant that wins everywhere it applies and loses nowhere. Then, per row, the
fastest configuration (the material of a per-shape table, e.g. the K split per token count).
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict


def ratios(results: list[dict]) -> dict[str, list[tuple[str, int, str, float]]]:
    """variant -> [(shape, tokens, mode, variant_us / default_us)] over rows both have timed."""
    default = {(r["shape"], r["tokens"], r["mode"]): r["median_us"]
               for r in results if r.get("backend") == "ffi" and "median_us" in r}
    out = defaultdict(list)
    for r in results:
        b = r.get("backend", "")
        key = (r.get("shape"), r.get("tokens"), r.get("mode"))
        if b.startswith("ffi[") and "median_us" in r and default.get(key):
            out[b].append((*key, r["median_us"] / default[key]))
    return dict(out)


def summary_lines(results: list[dict], tolerance: float = 0.03) -> list[str]:
    lines = []
    for variant, rows in sorted(ratios(results).items()):
        rs = [x[3] for x in rows]
        wins = sum(x < 1 - tolerance for x in rs)
        losses = sum(x > 1 + tolerance for x in rs)
        gmean = math.exp(sum(map(math.log, rs)) / len(rs))
        verdict = "WINS EVERYWHERE" if wins == len(rs) else ("no loss" if losses == 0 else "mixed" if wins else "loses")
        lines.append(f"{variant:18s} rows {len(rs):2d}  faster {wins:2d}  slower {losses:2d}  geomean x{gmean:.3f}  "
                     f"[{min(rs):.3f}, {max(rs):.3f}]  {verdict}")
        lines += [f"    {s:16s} T={t:5d} {m:6s} x{x:.3f}" for s, t, m, x in rows]
    return lines or ["no variant rows with a default row to compare"]


def best_lines(results: list[dict], tolerance: float = 0.03) -> list[str]:
    """Per (shape, tokens, mode) with a default row: the fastest row and its time / the default's
    ("default" when no variant beats it by more than the tolerance)."""
    default, best = {}, {}
    for r in results:
        b, us = r.get("backend", ""), r.get("median_us")
        if us is None or not (b == "ffi" or b.startswith("ffi[")):
            continue
        key = (r.get("shape"), r.get("tokens"), r.get("mode"))
        if b == "ffi":
            default[key] = us
        if key not in best or us < best[key][1]:
            best[key] = (b, us)
    lines = []
    for key in sorted(default, key=lambda k: (str(k[0]), k[2] or "", k[1] or 0)):
        b, us = best[key]
        x = us / default[key]
        name, x = (b, x) if x < 1 - tolerance else ("default", 1.0)
        lines.append(f"    {key[0]:16s} T={key[1]:5d} {key[2]:6s} best {name:16s} x{x:.3f}")
    return ["best per row (variant time / default time):"] + lines if lines else []


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", nargs="+")
    p.add_argument("--tolerance", type=float, default=0.03, help="relative change counted as faster/slower")
    args = p.parse_args(argv)
    results = []
    for path in args.json:
        with open(path) as f:
            results += json.load(f)["results"]
    print("\n".join(summary_lines(results, args.tolerance) + best_lines(results, args.tolerance)))


if __name__ == "__main__":
    main()
