"""Command line: convert a safetensors MoE checkpoint's routed experts to NVFP4.

Usage::

    python -m jax_nvfp4.convert SRC DST [--ignore PATTERN ...] [--recipe nvfp4|4over6]
                                        [--no-progress] [--overwrite]

See :func:`jax_nvfp4.checkpoint.convert_checkpoint` for the output format. Exit status 0 on
success, 1 on a conversion error (message on stderr, no DST written), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import sys

from .checkpoint import convert_checkpoint
from .quantize import RECIPES


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jax_nvfp4.convert",
        description="Quantize the routed experts of a safetensors MoE checkpoint (bf16/fp16/fp32/FP8, gpt-oss MXFP4) "
                    "to NVFP4 (those of an NVFP4 ModelOpt or compressed-tensors checkpoint are repacked as "
                    "stored); every other tensor is copied unchanged.")
    p.add_argument("src", metavar="SRC", help="checkpoint folder, .safetensors file or .index.json file")
    p.add_argument("dst", metavar="DST", help="output folder (must not exist; written atomically)")
    p.add_argument("--ignore", metavar="PATTERN", action="append", default=[],
                   help="keep MoE modules matching PATTERN in source precision (exact or dotted prefix, "
                        "with or without a leading 'model.', e.g. layers.3.mlp); repeatable")
    p.add_argument("--recipe", choices=RECIPES, default="nvfp4", help="block-scale recipe (default: nvfp4)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        summary = convert_checkpoint(args.src, args.dst, ignore=args.ignore, recipe=args.recipe,
                                     progress=not args.no_progress, overwrite=args.overwrite)
    except (ValueError, OSError) as e:  # CheckpointError and bad arguments; DST exists, SRC missing, disk full
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
