"""Instruction mix of the loops in our CUDA kernels' SASS (static: no GPU needed).

    python3 scripts/sass_loops.py [--so PATH] [--kernel REGEX] [--arch sm_90a] [--check-setmaxnreg]

Runs ``cuobjdump -sass`` (it needs ``nvdisasm`` on PATH) on the built extension and prints, per
kernel whose name matches, each loop (a backward branch) with its instruction count and opcode
mix grouped by the pipe that issues it. Divided by the bytes a loop iteration streams, this is
the issue cost per weight byte: the ceiling a decode kernel hits before HBM does.

With ``--check-setmaxnreg`` it checks instead that each kernel which raises its registers by
``setmaxnreg`` names no register at or above the count it allocates, and exits with status 3 if
one does (H200, 2026-12-03: a budget the CTA's pool could not hold hung the GPU; scripts/gpu_ffi.sh
runs this check before any GPU work).
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import os
import re
import shutil
import subprocess
import sys

# Opcode -> pipe group (Hopper: integer ALU, FMA incl. IMAD, fp16x2, tensor, memory, other).
GROUPS = {
    "alu": {"LOP3", "IADD3", "SHF", "PRMT", "ISETP", "LEA", "SEL", "IABS", "IMNMX", "FSEL", "SGXT", "BMSK", "LOP"},
    "fma": {"IMAD", "FFMA", "FMUL", "FADD", "IMUL"},
    "fp16": {"HMUL2", "HFMA2", "HADD2"},
    "tensor": {"HMMA", "HGMMA", "WARPGROUP"},
    "mem": {"LDG", "LDS", "LDGSTS", "STS", "STG", "LDSM", "LDC", "ULDC", "LDGDEPBAR", "DEPBAR"},
}

_INSTR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_TARGET = re.compile(r"\bBRA\b.*?(0x[0-9a-f]+)")
_REGISTER = re.compile(r"\bR(\d+)\b")  # (not UR: uniform registers)
_ALLOC = re.compile(r"\bUSETMAXREG\.TRY_ALLOC\S*\s+\w+,\s*(0x[0-9a-f]+|\d+)")


def opcode(text: str) -> str:
    """'@!P0 LOP3.LUT R1, ...' -> 'LOP3'."""
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]


def group(op: str) -> str:
    return next((g for g, ops in GROUPS.items() if op in ops), "other")


def functions(sass: str) -> dict[str, list[tuple[int, str]]]:
    """Kernel name -> [(address, instruction text)] from cuobjdump -sass output."""
    out = {}
    for part in re.split(r"\n\s*Function : ", sass)[1:]:
        name, _, body = part.partition("\n")
        ins = [(int(m.group(1), 16), m.group(2)) for m in map(_INSTR.match, body.split("\n")) if m]
        out[name.strip()] = ins
    return out


def loops(ins: list[tuple[int, str]]):
    """(start, end, Counter of opcodes) of each backward branch's body, innermost first."""
    index = {a: i for i, (a, _) in enumerate(ins)}
    found = []
    for i, (a, text) in enumerate(ins):
        m = _TARGET.search(text)
        target = int(m.group(1), 16) if m else a
        if target < a and target in index:  # (not the exit trap's BRA to itself)
            body = ins[index[target]: i + 1]
            found.append((body[0][0], a, collections.Counter(opcode(t) for _, t in body)))
    return sorted(found, key=lambda f: f[1] - f[0])


def setmaxnreg_use(ins: list[tuple[int, str]]) -> tuple[int, int] | None:
    """(highest register named, smallest count allocated by setmaxnreg), or None without an allocation."""
    allocs = [int(m.group(1), 0) for _, t in ins for m in [_ALLOC.search(t)] if m]
    if not allocs:
        return None
    return max((int(r) for _, t in ins for r in _REGISTER.findall(t)), default=-1), min(allocs)


def describe(counts: collections.Counter) -> str:
    groups = collections.Counter()
    for op, n in counts.items():
        groups[group(op)] += n
    top = " ".join(f"{op}={n}" for op, n in counts.most_common(8))
    return " ".join(f"{g}={n}" for g, n in groups.most_common()) + f" | {top}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--so", default=None, help="object or shared library (default: the built jax_nvfp4._ffi)")
    p.add_argument("--kernel", default="W4A16", help="regex on the mangled kernel name")
    p.add_argument("--arch", default="sm_90a")
    p.add_argument("--check-setmaxnreg", action="store_true",
                   help="check the registers of the kernels that raise them by setmaxnreg (exit 3 if over)")
    args = p.parse_args(argv)
    spec = None if args.so else importlib.util.find_spec("jax_nvfp4._ffi")
    so = args.so or (spec.origin if spec else None)
    if so is None:
        p.error("no --so given and the jax_nvfp4._ffi extension is not built")
    # cuobjdump (and the nvdisasm it runs) on PATH, else in the CUDA toolkit next to nvcc.
    tool = shutil.which("cuobjdump") or next(
        (c for c in (os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "cuobjdump"),
                     "/usr/local/cuda/bin/cuobjdump") if os.path.exists(c)), "cuobjdump")
    env = dict(os.environ, PATH=os.path.dirname(tool) + os.pathsep + os.environ.get("PATH", ""))
    try:
        sass = subprocess.run([tool, "-sass", "-arch", args.arch, so], check=True, capture_output=True, text=True,
                              env=env).stdout
    except (OSError, subprocess.CalledProcessError) as err:
        sys.exit(f"cuobjdump -sass failed (is it, and nvdisasm, on PATH?): {err}")
    over = 0
    for name, ins in functions(sass).items():
        if not re.search(args.kernel, name):
            continue
        if args.check_setmaxnreg:
            if (use := setmaxnreg_use(ins)) is not None:
                over += use[0] >= use[1]
                print(f"{name}: highest R{use[0]}, allocates {use[1]}: {'OVER' if use[0] >= use[1] else 'ok'}")
            continue
        print(f"{name}: {len(ins)} instructions")
        for start, end, counts in loops(ins):
            print(f"  loop {start:#06x}-{end:#06x}: {sum(counts.values())} instr: {describe(counts)}")
    if over:
        sys.exit(3)


if __name__ == "__main__":
    main()
