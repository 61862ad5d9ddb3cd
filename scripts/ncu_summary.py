"""One line per kernel from Nsight Compute's ``--csv --print-units base`` output (scripts/gpu_ffi.sh ncu).

    python3 scripts/ncu_summary.py ncu.csv [label]

Keeps the figures that say what bounds a kernel (time, DRAM rate, occupancy, issue activity, pipe
use, stall reasons; the full CSV stays in $OUT/ncu.csv) and adds the DRAM read rate in TB/s.
"""

from __future__ import annotations

import csv
import sys
from collections import OrderedDict

# Metric name (section display name or raw ncu metric) -> short label, in print order.
SHOWN = OrderedDict([
    ("gpu__time_duration.sum", "ns"),
    ("dram__bytes_read.sum", "dram_B"),
    ("DRAM Throughput", "dram%"),
    ("Compute (SM) Throughput", "sm%"),
    ("L1/TEX Hit Rate", "l1_hit%"),
    ("L2 Hit Rate", "l2_hit%"),
    ("L1/TEX Cache Throughput", "l1%"),
    ("L2 Cache Throughput", "l2%"),
    ("Grid Size", "grid"),
    ("Registers Per Thread", "regs"),
    ("Waves Per SM", "waves"),
    ("Theoretical Occupancy", "occ_theo%"),
    ("Achieved Occupancy", "occ%"),
    ("Block Limit Registers", "lim_regs"),
    ("Block Limit Shared Mem", "lim_smem"),
    ("Issued Warp Per Scheduler", "issue/clk"),
    ("No Eligible", "no_elig%"),
    ("Eligible Warps Per Scheduler", "elig_warps"),
    ("Warp Cycles Per Issued Instruction", "cyc/inst"),
    ("smsp__inst_executed.sum", "inst"),
    ("sm__inst_executed_pipe_tensor.sum", "tensor_inst"),
    ("sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active", "alu%"),
    ("sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active", "fma%"),
    ("sm__inst_executed_pipe_fmaheavy.avg.pct_of_peak_sustained_active", "fmaheavy%"),
    ("sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active", "hmma%"),
    ("smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio", "st_long"),
    ("smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio", "st_short"),
    ("smsp__average_warps_issue_stalled_wait_per_issue_active.ratio", "st_wait"),
    ("smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio", "st_math"),
    ("smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio", "st_lg"),
    ("smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio", "st_bar"),
    ("smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio", "st_notsel"),
])


def _number(v: str) -> float | None:
    try:
        return float(v.replace(",", ""))
    except ValueError:
        return None


def short_name(name: str, width: int = 44) -> str:
    """'void jax_nvfp4::(anonymous namespace)::K<1, 4, 2, true, unsigned short>(GemmParams)' ->
    'K<1,4,2,true,u16>' (template arguments kept: they name the kernel variant)."""
    name = name.replace("(anonymous namespace)::", "").replace("jax_nvfp4::", "").removeprefix("void ")
    if name.endswith(")"):  # drop the parameter list: the last top-level (...)
        depth = 0
        for i in range(len(name) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(name[i], 0)
            if depth == 0:
                name = name[:i]
                break
    name = name.replace(", ", ",").replace("unsigned short", "u16")
    return name if len(name) <= width else name[: width - 3] + "..."


def kernels(lines) -> "OrderedDict[tuple[str, str], dict[str, str]]":
    """(ID, short kernel name) -> {metric name: value} from ncu's CSV lines (others are skipped)."""
    rows = list(csv.reader(line for line in lines if line.startswith('"')))
    out: OrderedDict = OrderedDict()
    if not rows:
        return out
    head = rows[0]
    for r in rows[1:]:
        d = dict(zip(head, r))
        out.setdefault((d.get("ID", "?"), short_name(d.get("Kernel Name", "?"))), {})[d.get("Metric Name", "?")] = \
            d.get("Metric Value", "")
    return out


def summary_lines(lines, label: str = "") -> list[str]:
    ks = kernels(lines)
    if not ks:
        return [f"{label} no ncu rows"]
    out = []
    for (_, name), m in ks.items():
        parts = [f"{short}={m[key]}" for key, short in SHOWN.items() if key in m]
        ns, nbytes = _number(m.get("gpu__time_duration.sum", "")), _number(m.get("dram__bytes_read.sum", ""))
        if ns and nbytes is not None:
            parts.insert(2, f"TB/s={nbytes / ns / 1e3:.2f}")
        out.append(f"{label:>22s} {name:44s} " + " ".join(parts))
    return out


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as f:
        print("\n".join(summary_lines(f, argv[1] if len(argv) > 1 else "")))


if __name__ == "__main__":
    main()
