"""Where a kernel's warps stall, per SASS instruction, from Nsight Compute's source page.

    ncu -i report.ncu-rep --page source --csv --print-source sass > source.csv
    python3 scripts/ncu_source_top.py source.csv [top]

Per kernel of the export (each kernel once): the stall reasons' shares of all samples, then the
`top` instructions (default 25) by warp-stall samples, each with its share and main reason
(scripts/gpu_ffi.sh ncu stage, NCU_SOURCE).
"""

from __future__ import annotations

import csv
import sys
from collections import Counter

from ncu_summary import _number as _parsed  # (scripts/ is the script's directory on sys.path)

SAMPLES = "Warp Stall Sampling (All Samples)"


def _number(text: str) -> float:
    return _parsed(text) or 0.0


def kernels(path: str):
    """(name, rows) per kernel: a "Kernel Name" row, an "Address" header row, then one row per
    instruction (as dicts)."""
    name, header, rows = "", None, []
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if not row:
                continue
            if row[0] == "Kernel Name":
                if rows:
                    yield name, rows
                name, header, rows = (row[1] if len(row) > 1 else ""), None, []
            elif row[0] == "Address":
                header = row
            elif header is not None and len(row) == len(header):
                rows.append(dict(zip(header, row)))
    if rows:
        yield name, rows


def main() -> None:
    path = sys.argv[1]
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 25
    seen = set()
    for name, rows in kernels(path):
        key = (name, len(rows), rows[0].get("Address"))
        if key in seen:  # the export lists a kernel more than once
            continue
        seen.add(key)
        reasons = [c for c in rows[0] if c.startswith("stall_") and "(Not Issued)" not in c]
        by_reason = Counter()
        for r in rows:
            for c in reasons:
                by_reason[c] += _number(r[c])
        total = sum(by_reason.values()) or 1.0
        print(f"# {name}: {len(rows)} instructions, {total:.0f} stall samples")
        print("  " + ", ".join(f"{c[6:]} {100 * v / total:.1f}%" for c, v in by_reason.most_common(9)))
        for r in sorted(rows, key=lambda r: -_number(r.get(SAMPLES, "")))[:top]:
            main_reason = max(reasons, key=lambda c: _number(r[c]))[6:] if reasons else ""
            print(f"  {100 * _number(r.get(SAMPLES, '')) / total:5.1f}%  {main_reason:14s} {r.get('Source', '').strip()}")


if __name__ == "__main__":
    main()
