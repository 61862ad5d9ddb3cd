"""Issue 5's targets, evaluated on one ``moe_bench.py --json`` run (the table BENCHMARKS.md records).

    python3 benchmarks/targets.py out/moe_ffi.json

Per shape and token count, from the run's own rows (``ffi`` in w4a16 and w4a4, ``ragged_dot_bf16``):

- decode (1-64 tokens): the ffi w4a16 layer within ``1.5 x`` its NVFP4 byte floor ``+ 10 us``, and at one token
  under the bf16 byte floor;
- prefill (4096 tokens): at least 400 TFLOP/s of routed-expert work;
- every token count: at least 10x faster than ``ragged_dot`` in bf16. Where that fails, ``10x needs`` is the rate at
  which a layer would have to read its NVFP4 weight bytes to meet it (above the run's HBM rate, 4.3 TB/s: under
  the byte floor, no kernel can);
- w4a4 within 1.3x of w4a16.

Prints a markdown table, then each target not met (a row that failed or was skipped counts as not met). The
floors use the run's ``hbm_bytes_per_s`` and ``bf16_flop_per_s``.
"""

from __future__ import annotations

import argparse
import json

BASELINE = "ragged_dot_bf16"  # (moe_bench.BASELINE; not imported: that module imports jax)
DECODE_MAX_TOKENS = 64
PREFILL_TOKENS = 4096
PREFILL_TFLOPS = 400.0
RAGGED_SPEEDUP = 10.0
W4A4_MAX_RATIO = 1.3


def decode_target_us(floor_nvfp4_us: float) -> float:
    """The decode target: 1.5 x the NVFP4 byte floor + 10 us."""
    return 1.5 * floor_nvfp4_us + 10.0


_KINDS = {("ffi", "w4a16"): "w4a16", ("ffi", "w4a4"): "w4a4", (BASELINE, "bf16"): "ragged"}


def _rows(results):
    """(shape, tokens) -> {"row": common fields, "w4a16"/"w4a4"/"ragged": median us, "failed": [kind: why]}."""
    out = {}
    for r in results:
        kind = _KINDS.get((r.get("backend"), r.get("mode")))
        if kind:
            entry = out.setdefault((r["shape"], r["tokens"]), {"row": r, "failed": []})
            if "median_us" in r:
                entry[kind] = r["median_us"]
            else:  # an error or a skip: its target cannot count as met
                entry["failed"].append(f"{kind} {r.get('error') or r.get('skipped') or 'not timed'}")
    return out


def evaluate(run: dict) -> tuple[list[str], list[str]]:
    """(markdown table lines, one line per target not met) for a moe_bench JSON run."""
    hbm, flop_rate = run["hbm_bytes_per_s"], run["bf16_flop_per_s"]
    fmt = lambda v, spec=".1f": "" if v is None else format(v, spec)  # noqa: E731
    lines = ["| shape | T | hit | NVFP4 floor (us) | ffi w4a16 (us) | target (us) | met | w4a4 (us) | w4a4 / w4a16 "
             "| ragged_dot bf16 (us) | ragged / ffi | 10x needs (TB/s) | TFLOP/s |",
             "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    unmet = []
    for (shape, t), e in sorted(_rows(run["results"]).items()):
        r, us = e["row"], e.get("w4a16")
        floor = r["floor_nvfp4_bytes_us"]
        where = f"{shape} T={t}"
        unmet += [f"{where}: {why}" for why in e["failed"]]
        target, misses, tflops = "", [], None  # this row's decode / prefill target, and what misses it
        if us is not None and t <= DECODE_MAX_TOKENS:
            target = fmt(decode_target_us(floor))
            if t == 1 and us >= r["floor_bf16_bytes_us"]:
                misses.append(f"{where}: {us:.1f} us, not under the bf16 byte floor {r['floor_bf16_bytes_us']:.1f}")
            if us > decode_target_us(floor):
                misses.append(f"{where}: {us:.1f} us over the decode target {target}")
        if us is not None:
            tflops = r["floor_flops_us"] * flop_rate / us / 1e12
            if t == PREFILL_TOKENS:
                target = f"{PREFILL_TFLOPS:.0f} TFLOP/s"
                if tflops < PREFILL_TFLOPS:
                    misses.append(f"{where}: {tflops:.0f} TFLOP/s under {PREFILL_TFLOPS:.0f}")
        met = ("no" if misses else "yes") if target else ""
        unmet += misses
        speedup = needs = None
        if us is not None and e.get("ragged") is not None:
            speedup = e["ragged"] / us
            if speedup < RAGGED_SPEEDUP:
                budget = e["ragged"] / RAGGED_SPEEDUP
                needs = floor * hbm / budget / 1e12  # the NVFP4 weight bytes over a tenth of ragged_dot's time
                why = "under the NVFP4 byte floor" if budget < floor else f"the weights read at {needs:.2f} TB/s"
                unmet.append(f"{where}: {speedup:.1f}x ragged_dot; 10x is {budget:.1f} us ({why})")
        ratio = None
        if us is not None and e.get("w4a4") is not None:
            ratio = e["w4a4"] / us
            if ratio > W4A4_MAX_RATIO:
                unmet.append(f"{where}: w4a4 {ratio:.2f}x of w4a16")
        lines.append(
            f"| {shape} | {t} | {r['experts_hit']:.1f} | {floor:.1f} | {fmt(us)} | {target} | {met} | "
            f"{fmt(e.get('w4a4'))} | {fmt(ratio, '.2f')} | {fmt(e.get('ragged'))} | {fmt(speedup)} | "
            f"{fmt(needs, '.2f')} | {fmt(tflops, '.0f') if t >= 256 else ''} |")
    return lines, unmet


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", help="moe_bench.py --json output")
    args = p.parse_args(argv)
    with open(args.json) as f:
        run = json.load(f)
    lines, unmet = evaluate(run)
    print(f"device: {run.get('device')}  jax {run.get('jax')}  complete: {run.get('complete')}")
    print("\n".join(lines))
    print(f"targets not met: {len(unmet)}" + "".join(f"\n  {u}" for u in unmet))
    return unmet


if __name__ == "__main__":
    main()
