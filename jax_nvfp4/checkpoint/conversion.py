"""Checkpoint conversion: :func:`convert_checkpoint` and what it writes.

The conversion is planned in full before any output (every expert validated, every output tensor
declared), then streamed shard by shard into a temporary folder next to the destination, which is
renamed into place only when complete.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path

from ..formats import BLOCK
from .experts import MoELayer, plan_layers
from .naming import (BIAS, BLOCK_SCALE, CONFIG_NAME, DATA, DOWN, FORMAT_NAME, FORMAT_VERSION, GATE_UP, GEMMS,
                     GLOBAL_SCALE, INPUT_SCALE, UP, ignore_patterns, output_names)
from .safetensors_io import (INDEX_FILE, Checkpoint, CheckpointError, OutTensor, StreamingWriter,
                             TensorInfo, TensorReader, itemsize, open_checkpoint)
from .sources import check_recipe, expert_outputs, quantized_parts, source_progress

# top-level files that hold weights: never copied as side files (the safetensors ones are rewritten)
_WEIGHT_EXTS = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".npz")


@dataclasses.dataclass(frozen=True)
class ConversionSummary:
    """What :func:`convert_checkpoint` did.

    Attributes
    ----------
    dst : Path of the written checkpoint
    experts_converted : number of experts quantized
    layers_converted, layers_ignored : MoE modules quantized / kept in source precision
    tensors_copied : tensors copied unchanged
    bytes_in, bytes_out : total size of the source / output safetensors files
    seconds : wall time
    """

    dst: Path
    experts_converted: int
    layers_converted: int
    layers_ignored: int
    tensors_copied: int
    bytes_in: int
    bytes_out: int
    seconds: float

    def __str__(self) -> str:
        ratio = self.bytes_in / self.bytes_out if self.bytes_out else float("nan")
        return (f"converted {self.experts_converted} experts in {self.layers_converted} MoE layers "
                f"({self.layers_ignored} ignored), copied {self.tensors_copied} tensors\n"
                f"{_fmt_bytes(self.bytes_in)} -> {_fmt_bytes(self.bytes_out)} ({ratio:.2f}x smaller) "
                f"in {self.seconds:.1f} s -> {self.dst}")


def _fmt_bytes(n: float) -> str:
    units = ("B", "KB", "MB", "GB", "TB")
    i = 0
    while n >= 1000 and i < len(units) - 1:
        n, i = n / 1000, i + 1
    return f"{n:.0f} B" if i == 0 else f"{n:.2f} {units[i]}"


# --------------------------------------------------------------------------------------------
# Planning: what is quantized, what is copied, in which order
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass
class _Unit:
    """One piece of output work: copy a tensor, or quantize an expert's GEMM1 or GEMM2."""

    anchor: TensorInfo  # decides the output shard and the processing order
    outputs: list[OutTensor]
    copy: TensorInfo | None = None
    layer: MoELayer | None = None
    expert: int = 0
    gemm: str = ""  # "gate_up" or "down"

    @property
    def weights(self):
        """The source weights quantized by this unit."""
        return self.layer.weights(self.expert, self.gemm)

    @property
    def source_bytes(self) -> int:
        return self.copy.nbytes if self.copy is not None else sum(w.nbytes for w in self.weights)


def _quantized_specs(names: dict[str, str], rows: int, k: int, bias_dtype, up_scale: bool,
                     input_scale: bool) -> list[OutTensor]:
    """The outputs of one quantized weight, in :func:`expert_outputs`'s order."""
    parts = quantized_parts(rows, k, up_scale, bias_dtype, input_scale)
    return [OutTensor(names[part], dtype, shape, math.prod(shape) * itemsize(dtype))
            for part, (dtype, shape) in parts.items()]


def _plan_units(ckpt: Checkpoint, layers: dict[str, MoELayer]) -> tuple[list[_Unit], list[str]]:
    """Every output tensor, grouped in units; also the names of dropped source tensors."""
    consumed, dropped, units = set(), [], []
    for layer in layers.values():
        if layer.ignored:
            continue
        for e in range(layer.num_experts):
            names = output_names(layer.module, e, layer.gated, bias=layer.bias_dtype is not None,
                                 input_scale=layer.input_scales)
            for gemm in GEMMS:
                ws = layer.weights(e, gemm)
                rows, k = sum(w.shape[0] for w in ws), ws[0].shape[1]
                specs = _quantized_specs(names[gemm], rows, k, layer.bias_dtype,
                                         gemm == "gate_up" and layer.up_global_scale, layer.input_scales)
                units.append(_Unit(ws[0].info, specs, layer=layer, expert=e, gemm=gemm))
                for w in ws:
                    consumed.update(t.name for t in w.tensors)
                    # A static FP8 activation scale (w4a4 here scales activations per token or on NVFP4's own).
                    if w.input_scale is not None and not layer.input_scales:
                        dropped.append(w.input_scale.name)
    for name, t in ckpt.tensors.items():
        if name not in consumed:
            units.append(_Unit(t, [OutTensor(name, t.dtype, t.shape, t.nbytes)], copy=t))
    units.sort(key=lambda u: (ckpt.files.index(u.anchor.path), u.anchor.start))  # sequential reads
    seen = set()
    for u in units:
        for o in u.outputs:
            if o.name in seen:
                raise CheckpointError(f"output tensor {o.name!r} would be written twice (it already exists "
                                      "in the source under that name)")
            seen.add(o.name)
    return units, sorted(set(dropped))  # (a stacked projection's one input scale serves every expert)


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------

def _run_unit(u: _Unit, writer: StreamingWriter, reader: TensorReader, recipe: str) -> None:
    if u.copy is not None:
        writer.copy(u.copy.name, reader, u.copy)
        return
    parts = expert_outputs(reader, u.weights, u.layer.quant_dtype, recipe, u.layer.bias_dtype, u.layer.input_scales)
    for spec, arr in zip(u.outputs, parts, strict=True):
        writer.write(spec.name, arr)


def _nvfp4_config(layers, ignore, recipe, dropped) -> dict:
    quantized = [ly for ly in layers.values() if not ly.ignored]
    src = sorted({ly.source_name for ly in quantized})
    return {
        "format": FORMAT_NAME,
        # 3 only where needed: readers refuse newer versions than theirs, and version 2's read all the rest
        "format_version": (FORMAT_VERSION if any(ly.input_scales for ly in quantized)
                           else 3 if any(ly.up_global_scale for ly in quantized) else 2),
        "quant_algo": "NVFP4",
        "recipe": recipe,
        "group_size": BLOCK,
        "source_dtype": src[0] if len(src) == 1 else src,
        "gemm1_row_order": ["gate", "up"],
        "tensor_names": {
            "gemm1_gated": GATE_UP, "gemm1_not_gated": UP, "gemm2": DOWN,
            "data": DATA + " (uint8, two E2M1 codes a byte, even element in the low nibble)",
            "block_scale": BLOCK_SCALE + " (float8_e4m3fn, one per 16 elements, linear layout)",
            "global_scale": GLOBAL_SCALE + " (float32 scalar, the global DECODE scale; [2], gate's then up's, in "
                            "GEMM1 of modules whose moe_modules entry has up_global_scale)",
            "bias": BIAS + " (the expert's bias [N], gate entries first, where moe_modules gives a bias_dtype)",
            "input_scale": INPUT_SCALE + " (float32, the pre-quantized source's static activation DECODE scale; [2], "
                           "gate's then up's, where GEMM1's global scale is; where moe_modules has input_scales)",
        },
        "ignore": list(ignore),
        "ignored_modules": sorted(ly.module for ly in layers.values() if ly.ignored),
        "dropped_tensors": dropped,
        "moe_modules": {m: ly.info() for m, ly in sorted(layers.items())},
        "producer": f"{FORMAT_NAME} {_version()}",
    }


def _version() -> str:
    from .. import __version__  # here, not at the top: the package imports this module before setting it
    return __version__


def _file_metadata(src_meta: dict[str, str], cfg: dict) -> dict[str, str]:
    meta = {str(k): str(v) for k, v in src_meta.items()}
    meta.update(nvfp4_format=FORMAT_NAME, nvfp4_format_version=str(cfg["format_version"]), nvfp4_recipe=cfg["recipe"],
                nvfp4_source_dtype=json.dumps(cfg["source_dtype"]), nvfp4_group_size=str(BLOCK))
    return meta


def _copy_side_files(root: Path, dst: Path, skip: Iterable[Path]) -> None:
    """Copy small top-level files (config.json, tokenizer, ...) but no weight files or the index."""
    skip = {p.resolve() for p in skip}
    for p in sorted(root.iterdir()):
        if (p.is_file() and p.resolve() not in skip and not p.name.endswith(".index.json")
                and p.suffix not in _WEIGHT_EXTS and p.name != CONFIG_NAME):
            shutil.copy2(p, dst / p.name)


def _write_checkpoint(ckpt, layers, units, dropped, tmp: Path, ignore, recipe, progress) -> None:
    """Write the whole output checkpoint into the folder ``tmp``."""
    cfg = _nvfp4_config(layers, ignore, recipe, dropped)
    by_file: dict[Path, list[_Unit]] = {p: [] for p in ckpt.files}
    for u in units:
        by_file[u.anchor.path].append(u)
    weight_map = {}
    bar = source_progress(sum(u.source_bytes for u in units), "nvfp4 convert", progress)
    with TensorReader() as reader, bar:
        for src_path, file_units in by_file.items():
            out_path = tmp / src_path.name
            specs = [o for u in file_units for o in u.outputs]
            writer = StreamingWriter(out_path, specs, _file_metadata(ckpt.metadata[src_path], cfg))
            try:
                for u in file_units:
                    _run_unit(u, writer, reader, recipe)
                    bar.update(u.source_bytes)
                writer.close()
            except BaseException:
                writer.abort()
                raise
            weight_map.update((o.name, out_path.name) for o in specs)
    if ckpt.index is not None:
        meta = dict(ckpt.index.get("metadata") or {})
        meta["total_size"] = sum(o.nbytes for u in units for o in u.outputs)
        (tmp / INDEX_FILE).write_text(json.dumps({"metadata": meta, "weight_map": dict(sorted(weight_map.items()))},
                                                 indent=2) + "\n")
    (tmp / CONFIG_NAME).write_text(json.dumps(cfg, indent=2) + "\n")
    _copy_side_files(ckpt.root, tmp, ckpt.files)


# --------------------------------------------------------------------------------------------
# Atomic output
# --------------------------------------------------------------------------------------------

def _umask() -> int:
    mask = os.umask(0)  # the only way to read the umask is to set it
    os.umask(mask)
    return mask


def _publish(tmp: Path, dst: Path, overwrite: bool) -> None:
    """Rename the finished temporary folder to ``dst`` (replacing it only with ``overwrite``)."""
    if not dst.exists():
        os.replace(tmp, dst)
        return
    if not overwrite:  # dst appeared while we were converting
        raise FileExistsError(f"output already exists: {dst}")
    old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".old", dir=dst.parent))
    os.replace(dst, old / "x")
    os.replace(tmp, dst)
    shutil.rmtree(old, ignore_errors=True)


def convert_checkpoint(src, dst, *, ignore: Sequence[str] = (), recipe: str = "nvfp4", progress: bool = True,
                       overwrite: bool = False) -> ConversionSummary:
    """Convert a safetensors MoE checkpoint to NVFP4 experts, streaming one expert tensor at a time.

    Parameters
    ----------
    src : path
        A checkpoint folder (``model.safetensors.index.json`` or ``model.safetensors``), a
        ``.safetensors`` file or an index file.
    dst : path
        Output folder; must not exist unless ``overwrite``. Written to a temporary folder next to it
        and renamed when complete: a failed or interrupted conversion leaves no ``dst`` (after an
        exception the temporary folder is removed too; only a hard kill can leave a hidden
        ``.{dst}.*.tmp`` folder).
    ignore : module-name patterns whose MoE layers stay in source precision (see :func:`matches_ignore`)
    recipe : ``"nvfp4"`` or ``"4over6"``
    progress : show a tqdm progress bar
    overwrite : replace an existing ``dst``

    Returns
    -------
    ConversionSummary

    Raises
    ------
    CheckpointError (a ValueError)
        Bad input, naming the tensor: NaN/Inf weights, a missing gate/up/down partner, experts of
        unequal shapes, K not a multiple of 16, an unsupported dtype, a missing FP8 scale.
    """
    t0 = time.perf_counter()
    check_recipe(recipe)
    ignore = ignore_patterns(ignore)
    dst = Path(dst).absolute()
    if dst.exists() and not overwrite:
        raise FileExistsError(f"output already exists: {dst} (overwrite=True, or --overwrite on the command line, "
                              "replaces it)")
    ckpt = open_checkpoint(src)
    if dst.resolve() == ckpt.root.resolve():
        raise ValueError(f"dst must differ from the source folder: {dst}")
    layers = plan_layers(ckpt, ignore)
    if not layers:
        warnings.warn(f"{src}: no routed-expert tensors found; every tensor is copied unchanged", stacklevel=2)
    units, dropped = _plan_units(ckpt, layers)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent))
    try:
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it 0700; dst gets the mode mkdir would give
        _write_checkpoint(ckpt, layers, units, dropped, tmp, ignore, recipe, progress)
        bytes_out = sum(p.stat().st_size for p in tmp.glob("*.safetensors"))
        _publish(tmp, dst, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    done = [ly for ly in layers.values() if not ly.ignored]
    return ConversionSummary(
        dst=dst, experts_converted=sum(ly.num_experts for ly in done), layers_converted=len(done),
        layers_ignored=len(layers) - len(done), tensors_copied=sum(u.copy is not None for u in units),
        bytes_in=ckpt.total_bytes, bytes_out=bytes_out, seconds=time.perf_counter() - t0)
