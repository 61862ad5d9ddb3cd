"""Checkpoint conversion: quantize the routed experts of a safetensors MoE checkpoint to NVFP4.

Spec section 4. A Hugging Face-style checkpoint (one ``model.safetensors`` or shards listed in
``model.safetensors.index.json``) is read lazily, one tensor at a time, with plain file reads
(no mmap, so resident memory is what we allocate). Each expert's GEMM1 (gate and up, sharing one
global scale) and GEMM2 (down) are quantized with :func:`jax_nvfp4.quantize` and written
straight into the output file; every other tensor is copied byte for byte.

Recognized expert names (``L`` layer, ``N`` expert)::

    Mixtral:              model.layers.L.block_sparse_moe.experts.N.{w1,w3,w2}.weight  (gate, up, down)
    Qwen3-MoE, DeepSeek:  model.layers.L.mlp.experts.N.{gate,up,down}_proj.weight

The *MoE module* is the part before ``.experts`` (``model.layers.L.mlp``). A layer with up and down
but no gate is a non-gated (ReLU²) expert stack.

Source dtypes: bfloat16, float16, float32 are quantized as they are; float8_e4m3fn needs a scale
``weight_scale_inv`` (or ``weight_scale``) next to the weight, either per tensor (one element) or
per 128x128 block (``[ceil(out/128), ceil(in/128)]``; the block size is read from
``config.json``'s ``quantization_config.weight_block_size`` when present). FP8 weights are
dequantized as ``fp32(w) * scale``, rounded to bfloat16, then quantized (spec section 4).
Expert ``input_scale`` tensors (static FP8 activation scales) are dropped with their weights.

Output (NVFP4 checkpoint): for each quantized expert, with ``P = {module}.experts.{N}``,

- ``P.gate_up_proj.weight``: uint8 (``U8``) ``[2I, H/2]``, E2M1 codes two a byte (even element in
  the low nibble), rows ``[gate; up]``;
- ``P.gate_up_proj.weight_scale``: float8_e4m3fn (``F8_E4M3``) ``[2I, H/16]``, block decode scales,
  linear layout;
- ``P.gate_up_proj.weight_global_scale``: float32 ``[]``, the global *decode* scale (one per expert,
  shared by gate and up);
- ``P.down_proj.weight`` ``[H, I/2]``, ``P.down_proj.weight_scale`` ``[H, I/16]``,
  ``P.down_proj.weight_global_scale`` ``[]``: the same for GEMM2.

A non-gated layer stores ``P.up_proj.*`` (``[I, H/2]``) instead of ``P.gate_up_proj.*``. Shards mirror
the source (same file names, an index when the source had one); each file's ``__metadata__`` keeps
the source's entries and adds ``nvfp4_*`` keys; ``nvfp4_config.json`` describes the whole conversion
(format version, recipe, source dtypes, ignore patterns, every MoE module). Other top-level files
(``config.json``, tokenizer files, ...) are copied.

Public API: :func:`convert_checkpoint`, :func:`load_nvfp4_experts`,
:func:`quantize_checkpoint_experts`, :func:`matches_ignore`, :class:`ConversionSummary`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import shutil
import struct
import tempfile
import time
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from .formats import BLOCK, NVFP4Experts
from .quantize import RECIPES, quantize

FORMAT_NAME = "jax_nvfp4"
FORMAT_VERSION = 1
CONFIG_NAME = "nvfp4_config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
GATE_UP, UP, DOWN = "gate_up_proj", "up_proj", "down_proj"  # output projection names
DATA, BLOCK_SCALE, GLOBAL_SCALE = "weight", "weight_scale", "weight_global_scale"  # output params
DEFAULT_FP8_BLOCK = (128, 128)

# safetensors dtype string -> numpy dtype (ml_dtypes for the types numpy lacks)
_NP_DTYPES = {
    "BOOL": np.dtype(np.bool_), "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16), "I16": np.dtype(np.int16), "U32": np.dtype(np.uint32),
    "I32": np.dtype(np.int32), "U64": np.dtype(np.uint64), "I64": np.dtype(np.int64),
    "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16), "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
_ST_DTYPES = {v: k for k, v in _NP_DTYPES.items()}
_BY_NAME = {v.name: v for v in _NP_DTYPES.values()}  # "bfloat16" -> dtype
_QUANTIZABLE = ("BF16", "F16", "F32")  # quantized as stored
_FP8 = "F8_E4M3"  # dequantized with its scale, rounded to bf16, then quantized
_SCALE_DTYPES = ("F32", "BF16", "F16")
_COPY_CHUNK = 16 << 20  # bytes per read/write when copying a tensor unchanged
_MAX_HEADER = 100 << 20  # safetensors' own limit

_EXPERT_RE = re.compile(
    r"^(?P<module>.+)\.experts\.(?P<expert>\d+)\."
    r"(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)\."
    r"(?P<param>weight|weight_scale_inv|weight_scale|input_scale)$")
_ROLE = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
_WEIGHT_EXTS = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".npz")


class CheckpointError(ValueError):
    """A source checkpoint cannot be converted (the message names the tensor)."""


# --------------------------------------------------------------------------------------------
# safetensors reading (lazy, one tensor at a time)
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives in a safetensors file.

    Attributes
    ----------
    name : str
    path : Path of its file
    dtype : safetensors dtype string (``"BF16"``, ``"F8_E4M3"``, ...)
    shape : tuple[int, ...]
    start, end : absolute byte offsets of its data in the file
    """

    name: str
    path: Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def read_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse a safetensors header: ``({name: TensorInfo}, __metadata__)``; validates offsets."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        n = struct.unpack("<Q", raw)[0]
        if n > _MAX_HEADER or 8 + n > size:
            raise CheckpointError(f"{path}: not a safetensors file (header size {n}, file size {size})")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
    meta = header.pop("__metadata__", None) or {}
    data_start, data_len = 8 + n, size - 8 - n
    tensors = {}
    for name, h in header.items():
        try:
            dtype, shape, (b, e) = h["dtype"], tuple(int(d) for d in h["shape"]), h["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry {h!r}") from None
        np_dt = _NP_DTYPES.get(dtype)
        if not 0 <= b <= e <= data_len or (np_dt is not None and e - b != math.prod(shape) * np_dt.itemsize):
            raise CheckpointError(
                f"{path}: tensor {name!r} ({dtype} {list(shape)}) has inconsistent data_offsets [{b}, {e}]")
        tensors[name] = TensorInfo(name, path, dtype, shape, data_start + b, data_start + e)
    return tensors, meta


class _Reader:
    """Reads tensors of one or more safetensors files on demand; keeps one handle per file."""

    def __init__(self):
        self._files: dict[Path, object] = {}

    def _handle(self, path: Path):
        if path not in self._files:
            self._files[path] = open(path, "rb", buffering=0)  # unbuffered: readinto fills our buffer
        return self._files[path]

    def read_bytes_into(self, path: Path, offset: int, buf: memoryview) -> None:
        f = self._handle(path)
        f.seek(offset)
        got = 0
        while got < len(buf):
            n = f.readinto(buf[got:])
            if not n:
                raise CheckpointError(f"{path}: unexpected end of file at byte {offset + got}")
            got += n

    def read_into(self, info: TensorInfo, out: np.ndarray) -> np.ndarray:
        """Read ``info`` into the C-contiguous array ``out`` (same dtype and size)."""
        if not out.flags.c_contiguous:
            raise AssertionError(f"buffer for {info.name} must be C-contiguous")
        if out.dtype != _NP_DTYPES[info.dtype] or out.size != math.prod(info.shape):
            raise AssertionError(f"buffer {out.dtype}{out.shape} does not fit {info.name}")
        self.read_bytes_into(info.path, info.start, memoryview(out.reshape(-1).view(np.uint8)))
        return out

    def read(self, info: TensorInfo) -> np.ndarray:
        if info.dtype not in _NP_DTYPES:
            raise CheckpointError(f"tensor {info.name!r}: unsupported dtype {info.dtype}")
        return self.read_into(info, np.empty(info.shape, _NP_DTYPES[info.dtype]))

    def close(self):
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@dataclasses.dataclass
class _Checkpoint:
    """The safetensors files of a checkpoint and every tensor in them."""

    root: Path  # folder holding the files
    files: list[Path]
    tensors: dict[str, TensorInfo]
    metadata: dict[Path, dict[str, str]]
    index: dict | None  # the parsed index file, when sharded

    @property
    def total_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.files)


def _checkpoint_files(src: Path) -> tuple[Path, list[Path], dict | None]:
    """Locate the safetensors files of ``src`` (a folder, a ``.safetensors`` file or an index)."""
    if src.is_file():
        if src.name.endswith(".index.json"):
            index_path = src
        elif src.suffix == ".safetensors":
            return src.parent, [src], None
        else:
            raise CheckpointError(f"{src}: expected a folder, a .safetensors file or a .index.json file")
    elif src.is_dir():
        index_path = src / INDEX_FILE
        if not index_path.exists():
            if (src / SINGLE_FILE).exists():
                return src, [src / SINGLE_FILE], None
            found = sorted(src.glob("*.safetensors"))
            if len(found) != 1:
                raise CheckpointError(
                    f"{src}: no {INDEX_FILE} or {SINGLE_FILE}, and {len(found)} *.safetensors files "
                    "(expected exactly one)")
            return src, found, None
    else:
        raise FileNotFoundError(f"checkpoint not found: {src}")
    try:
        index = json.loads(index_path.read_text())
        weight_map = index["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index_path}: not a safetensors index ({e!r})") from None
    root = index_path.parent
    names = list(dict.fromkeys(weight_map.values()))  # shard order of first appearance
    missing = [n for n in names if not (root / n).is_file()]
    if missing:
        raise CheckpointError(f"{index_path}: shard files missing: {missing}")
    return root, [root / n for n in names], index


def open_checkpoint(src) -> _Checkpoint:
    """Read the headers of every file of a checkpoint (no tensor data is read)."""
    root, files, index = _checkpoint_files(Path(src))
    tensors, metadata = {}, {}
    for path in files:
        t, metadata[path] = read_header(path)
        for name in t:
            if name in tensors:
                raise CheckpointError(f"tensor {name!r} appears in both {tensors[name].path.name} and {path.name}")
        tensors.update(t)
    if index is not None:
        for name, fname in index["weight_map"].items():
            if name not in tensors or tensors[name].path.name != fname:
                raise CheckpointError(f"{INDEX_FILE}: tensor {name!r} is not in shard {fname}")
    return _Checkpoint(root, files, tensors, metadata, index)


# --------------------------------------------------------------------------------------------
# safetensors writing (header first, then tensor bytes as they are produced)
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _OutTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


def _itemsize(dtype: str) -> int:
    dt = _NP_DTYPES.get(dtype)
    return dt.itemsize if dt is not None else 1


class _StreamingWriter:
    """Writes one safetensors file whose tensor list is known before any data.

    The header is written first; each tensor is then written at its offset as soon as it exists,
    in any order. Layout as the safetensors library lays it out: header padded with spaces to a
    multiple of 8 bytes, tensors contiguous, sorted by dtype size (largest first) then name, so
    every tensor is aligned to its element size.
    """

    def __init__(self, path: Path, tensors: Sequence[_OutTensor], metadata: dict[str, str]):
        self.path = path
        self._entries = {t.name: t for t in tensors}
        if len(self._entries) != len(tensors):
            raise CheckpointError(f"{path.name}: duplicate output tensor names")
        header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
        self._offset: dict[str, int] = {}
        pos = 0
        for t in sorted(tensors, key=lambda t: (-_itemsize(t.dtype), t.name)):
            header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [pos, pos + t.nbytes]}
            self._offset[t.name] = pos
            pos += t.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._data_start = 8 + len(raw)
        self._f = open(path, "wb")
        self._f.write(struct.pack("<Q", len(raw)) + raw)
        self._f.truncate(self._data_start + pos)  # full size now; tensors fill it in any order
        self._pending = set(self._entries)

    def _seek(self, name: str) -> _OutTensor:
        if name not in self._pending:
            raise AssertionError(f"{self.path.name}: {name!r} not declared or already written")
        self._pending.discard(name)
        self._f.seek(self._data_start + self._offset[name])
        return self._entries[name]

    def write(self, name: str, arr: np.ndarray) -> None:
        """Write a whole tensor; its dtype and shape must be the declared ones."""
        t = self._seek(name)
        arr = np.asarray(arr, order="C")  # (ascontiguousarray would make a 0-d array 1-d)
        if _ST_DTYPES.get(arr.dtype) != t.dtype or tuple(arr.shape) != t.shape:
            raise AssertionError(f"{name}: wrote {arr.dtype}{arr.shape}, declared {t.dtype}{t.shape}")
        self._f.write(memoryview(arr.reshape(-1).view(np.uint8)))

    def copy(self, name: str, reader: _Reader, src: TensorInfo) -> None:
        """Copy a source tensor's bytes unchanged, in chunks (never the whole tensor in memory)."""
        self._seek(name)
        buf = bytearray(min(_COPY_CHUNK, src.nbytes))
        for off in range(0, src.nbytes, len(buf) or 1):
            view = memoryview(buf)[: min(len(buf), src.nbytes - off)]
            reader.read_bytes_into(src.path, src.start + off, view)
            self._f.write(view)

    def close(self) -> None:
        if self._pending:
            raise AssertionError(f"{self.path.name}: tensors never written: {sorted(self._pending)[:5]}")
        self._f.flush()
        os.fsync(self._f.fileno())  # durable before the folder is renamed into place
        self._f.close()

    def abort(self) -> None:
        self._f.close()


# --------------------------------------------------------------------------------------------
# Planning: find experts, validate, decide what is quantized and what is copied
# --------------------------------------------------------------------------------------------

def _strip_model(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name


def matches_ignore(name: str, pattern: str) -> bool:
    """Whether ignore ``pattern`` selects tensor or module ``name``.

    A pattern matches the name exactly or as a dotted prefix (``layers.3.mlp`` matches
    ``layers.3.mlp.experts.0.gate_proj.weight`` but not ``layers.3.mlp2...``), with or without a
    leading ``model.`` on either side.
    """
    n, p = _strip_model(name), _strip_model(pattern.strip().strip("."))
    return bool(p) and (n == p or n.startswith(p + "."))


@dataclasses.dataclass
class _Weight:
    """One source projection (gate, up or down) of one expert."""

    info: TensorInfo
    scale: TensorInfo | None = None  # FP8 dequantization scale
    input_scale: TensorInfo | None = None  # FP8 activation scale (dropped)
    block: tuple[int, int] | None = None  # FP8 scale block (rows, cols); None: one scale per tensor

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def tensors(self) -> list[TensorInfo]:
        return [t for t in (self.info, self.scale, self.input_scale) if t is not None]


@dataclasses.dataclass
class _Layer:
    """An MoE module's routed experts: ``experts[e][role]`` with role gate / up / down."""

    module: str
    experts: list[dict[str, _Weight]]
    ignored: bool = False
    gated: bool = True
    hidden: int = 0
    inter: int = 0
    source_dtype: str = ""
    fp8_scaling: str | None = None  # "per-tensor" or "block AxB" for FP8 sources

    @property
    def num_experts(self) -> int:
        return len(self.experts)

    @property
    def quant_dtype(self):
        """Dtype of the values handed to the quantizer (FP8 sources are rounded to bf16 first)."""
        return np.dtype(ml_dtypes.bfloat16) if self.source_dtype == _FP8 else _NP_DTYPES[self.source_dtype]

    def gemm1(self, e: int) -> list[_Weight]:
        """The source weights stacked as GEMM1 rows: [gate, up] or [up]."""
        ex = self.experts[e]
        return [ex["gate"], ex["up"]] if self.gated else [ex["up"]]

    def info(self) -> dict:
        d = dict(num_experts=self.num_experts, quantized=not self.ignored,
                 source_dtype=_dtype_label(self.source_dtype) if self.source_dtype else None)
        if not self.ignored:
            d.update(gated=self.gated, hidden_size=self.hidden, intermediate_size=self.inter,
                     quantized_dtype=self.quant_dtype.name)
            if self.fp8_scaling:
                d["fp8_scaling"] = self.fp8_scaling
        return d


def _dtype_label(dtype: str) -> str:
    return _NP_DTYPES[dtype].name if dtype in _NP_DTYPES else dtype


def _find_layers(tensors: dict[str, TensorInfo]) -> dict[str, _Layer]:
    """Group expert tensors by MoE module and expert index."""
    raw: dict[str, dict[int, dict[str, dict[str, TensorInfo]]]] = {}
    for name in tensors:
        m = _EXPERT_RE.match(name)
        if not m:
            continue
        role, param = _ROLE[m["proj"]], m["param"]
        slot = raw.setdefault(m["module"], {}).setdefault(int(m["expert"]), {}).setdefault(role, {})
        if param in slot:
            raise CheckpointError(f"tensor {name!r}: expert {role} {param} given twice "
                                  f"(also as {slot[param].name!r}); mixed naming conventions?")
        slot[param] = tensors[name]
    layers = {}
    for module, by_index in raw.items():
        experts = []
        for e in range(max(by_index) + 1):
            if e not in by_index:
                raise CheckpointError(f"MoE module {module!r}: expert {e} is missing "
                                      f"(found experts {sorted(by_index)[:8]}...; indices must be 0..E-1)")
            experts.append({role: _make_weight(params, module, e, role) for role, params in by_index[e].items()})
        layers[module] = _Layer(module, experts)
    return layers


def _make_weight(params: dict[str, TensorInfo], module: str, e: int, role: str) -> _Weight:
    if "weight" not in params:
        other = next(iter(params.values())).name
        raise CheckpointError(f"tensor {other!r} has no weight tensor next to it ({module}, expert {e}, {role})")
    if "weight_scale_inv" in params and "weight_scale" in params:
        raise CheckpointError(f"tensor {params['weight'].name!r} has both weight_scale_inv and weight_scale")
    scale = params.get("weight_scale_inv", params.get("weight_scale"))
    return _Weight(params["weight"], scale, params.get("input_scale"))


def _layer_ignored(layer: _Layer, ignore: Sequence[str]) -> bool:
    """All-or-nothing per MoE module: the experts of a module share one stacked weight."""
    names = [t.name for ex in layer.experts for w in ex.values() for t in w.tensors]
    hits = [any(matches_ignore(n, p) for p in ignore) for n in names]
    if any(hits) and not all(hits):
        kept = names[hits.index(False)]
        raise CheckpointError(
            f"the ignore patterns select only part of MoE module {layer.module!r} (e.g. not {kept!r}); "
            f"ignore whole MoE modules (e.g. {_strip_model(layer.module)!r})")
    return all(hits)


def _validate_layer(layer: _Layer, fp8_block: tuple[int, int]) -> None:
    """Check partners, shapes, dtypes and FP8 scales; fills gated/hidden/inter/source_dtype."""
    has_gate = ["gate" in ex for ex in layer.experts]
    layer.gated = any(has_gate)
    for e, ex in enumerate(layer.experts):
        present = next(iter(ex.values())).name
        for role in ("gate", "up", "down") if layer.gated else ("up", "down"):
            if role not in ex:
                raise CheckpointError(f"tensor {present!r}: its {role} partner is missing "
                                      f"(MoE module {layer.module!r}, expert {e})")
    first = layer.experts[0]["up"]  # defines I, H and the dtype every expert must share
    if len(first.info.shape) != 2:
        raise CheckpointError(f"tensor {first.name!r}: expected a 2-D weight, got shape {list(first.info.shape)}")
    layer.inter, layer.hidden = first.info.shape
    layer.source_dtype = first.info.dtype
    want = {"gate": (layer.inter, layer.hidden), "up": (layer.inter, layer.hidden), "down": (layer.hidden, layer.inter)}
    for e, ex in enumerate(layer.experts):
        for role, w in ex.items():
            t = w.info
            if t.shape != want[role]:
                raise CheckpointError(
                    f"tensor {t.name!r}: shape {list(t.shape)} differs from {list(want[role])} expected from "
                    f"{first.name!r} (experts of MoE module {layer.module!r} must have equal shapes, "
                    "gate/up [I, H], down [H, I])")
            if t.dtype not in _QUANTIZABLE and t.dtype != _FP8:
                raise CheckpointError(f"tensor {t.name!r}: unsupported dtype {t.dtype} for an expert weight "
                                      f"(supported: {', '.join(_QUANTIZABLE + (_FP8,))})")
            if t.dtype != layer.source_dtype:
                raise CheckpointError(f"tensor {t.name!r}: dtype {t.dtype} differs from {layer.source_dtype} "
                                      f"of {first.name!r} (one dtype per MoE module)")
            if t.shape[1] % BLOCK:
                raise CheckpointError(f"tensor {t.name!r}: in-dim K={t.shape[1]} (shape {list(t.shape)}) "
                                      f"is not a multiple of {BLOCK}")
            scaling = _validate_scale(w, fp8_block)
            if scaling:
                layer.fp8_scaling = scaling


def _validate_scale(w: _Weight, fp8_block: tuple[int, int]) -> str | None:
    """FP8 weights need a per-tensor or block scale; others must not have one. Returns the scaling."""
    t, s = w.info, w.scale
    if t.dtype != _FP8:
        if s is not None:
            raise CheckpointError(f"tensor {s.name!r}: a dequantization scale for a {t.dtype} weight "
                                  f"({t.name!r}); only {_FP8} weights are scaled")
        return None
    if s is None:
        raise CheckpointError(f"tensor {t.name!r}: {_FP8} weight without its scale "
                              f"(expected {t.name}_scale_inv or {t.name[:-len('weight')]}weight_scale)")
    if s.dtype not in _SCALE_DTYPES:
        raise CheckpointError(f"tensor {s.name!r}: unsupported scale dtype {s.dtype} (supported: {_SCALE_DTYPES})")
    if math.prod(s.shape) == 1:
        return "per-tensor"
    bo, bi = fp8_block
    want = (-(-t.shape[0] // bo), -(-t.shape[1] // bi))
    if s.shape != want:
        raise CheckpointError(f"tensor {s.name!r}: scale shape {list(s.shape)} is neither one element nor the "
                              f"{bo}x{bi} block grid {list(want)} of {t.name!r} {list(t.shape)}")
    w.block = (bo, bi)
    return f"block {bo}x{bi}"


def _fp8_block_size(root: Path) -> tuple[int, int]:
    """``quantization_config.weight_block_size`` from ``config.json``, else 128x128."""
    try:
        qc = json.loads((root / "config.json").read_text()).get("quantization_config") or {}
        bs = qc.get("weight_block_size")
        if bs and len(bs) == 2:
            return int(bs[0]), int(bs[1])
    except (OSError, ValueError, AttributeError):
        pass
    return DEFAULT_FP8_BLOCK


def _plan_layers(ckpt: _Checkpoint, ignore: Sequence[str]) -> dict[str, _Layer]:
    """Find, classify (ignored or not) and validate every MoE module; raises before any output."""
    layers = _find_layers(ckpt.tensors)
    block = _fp8_block_size(ckpt.root)
    for layer in layers.values():
        layer.ignored = _layer_ignored(layer, ignore)
        if layer.ignored:
            layer.source_dtype = layer.experts[0].get("up", next(iter(layer.experts[0].values()))).info.dtype
        else:
            _validate_layer(layer, block)
    for p in ignore:
        if not any(matches_ignore(t.name, p) for ly in layers.values() if ly.ignored
                   for ex in ly.experts for w in ex.values() for t in w.tensors):
            warnings.warn(f"ignore pattern {p!r} matches no routed-expert tensor", stacklevel=3)
    return layers


def output_names(module: str, e: int, gated: bool) -> dict[str, dict[str, str]]:
    """Output tensor names of expert ``e``: ``{"gate_up"|"down": {"data"|"scales"|"global_scale": name}}``."""
    p = f"{module}.experts.{e}"
    g1 = GATE_UP if gated else UP
    return {key: {"data": f"{p}.{proj}.{DATA}", "scales": f"{p}.{proj}.{BLOCK_SCALE}",
                  "global_scale": f"{p}.{proj}.{GLOBAL_SCALE}"}
            for key, proj in (("gate_up", g1), ("down", DOWN))}


def _quantized_specs(names: dict[str, str], rows: int, k: int) -> list[_OutTensor]:
    return [_OutTensor(names["data"], "U8", (rows, k // 2), rows * k // 2),
            _OutTensor(names["scales"], "F8_E4M3", (rows, k // BLOCK), rows * k // BLOCK),
            _OutTensor(names["global_scale"], "F32", (), 4)]


# --------------------------------------------------------------------------------------------
# Quantizing one expert tensor
# --------------------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("recipe",))
def _quantize_tensor(x, recipe: str):
    """x ``[N, K]`` -> (data uint8 ``[N, K/2]``, scales e4m3 ``[N, K/16]``, global f32 ``[]``, all finite)."""
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)))  # one global scale for all rows (gate and up share it)
    q = quantize(x, recipe=recipe, global_amax=amax)
    return q.data, q.scales, q.global_scale, jnp.all(jnp.isfinite(x))


def _dequantize_fp8_into(reader: _Reader, w: _Weight, out: np.ndarray) -> None:
    """``out [N, K] bf16 = bf16(fp32(w) * scale)`` per block, a block-row at a time (bounded temporaries)."""
    w8 = reader.read(w.info)
    s = reader.read(w.scale).astype(np.float32)
    n, k = w8.shape
    if w.block is None:
        s0 = s.reshape(())
        step = max(1, (4 << 20) // max(1, k))  # ~16 MB of fp32 temporaries
        for r in range(0, n, step):
            out[r:r + step] = (w8[r:r + step].astype(np.float32) * s0).astype(ml_dtypes.bfloat16)
        return
    bo, bi = w.block
    for i, r in enumerate(range(0, n, bo)):
        srow = np.repeat(s[i], bi)[:k]  # this block-row's scales, one per column
        out[r:r + bo] = (w8[r:r + bo].astype(np.float32) * srow).astype(ml_dtypes.bfloat16)


def _load_rows(reader: _Reader, weights: Sequence[_Weight], dtype) -> np.ndarray:
    """Read the weights stacked along rows into one buffer ``[sum N, K]`` of ``dtype`` (no extra copy)."""
    k = weights[0].info.shape[1]
    out = np.empty((sum(w.info.shape[0] for w in weights), k), dtype)
    r = 0
    for w in weights:
        n = w.info.shape[0]
        if w.info.dtype == _FP8:
            _dequantize_fp8_into(reader, w, out[r:r + n])
        else:
            reader.read_into(w.info, out[r:r + n])
        r += n
    return out


def _check_finite(x: np.ndarray, weights: Sequence[_Weight]) -> None:
    r = 0
    for w in weights:
        n = w.info.shape[0]
        part = x[r:r + n].astype(np.float32)
        if not np.isfinite(part).all():
            bad = np.argwhere(~np.isfinite(part))[0]
            what = " after FP8 dequantization" if w.info.dtype == _FP8 else ""
            raise CheckpointError(f"tensor {w.name!r}: non-finite value {part[tuple(bad)]} at {bad.tolist()}"
                                  f"{what}; refusing to quantize NaN/Inf weights")
        r += n


def _quantize_weights(reader: _Reader, weights: Sequence[_Weight], dtype, recipe: str):
    """Quantize the row-stack of ``weights`` with one global scale.

    Returns
    -------
    (data uint8 ``[N, K/2]``, scales float8_e4m3fn ``[N, K/16]``, global_scale float32 ``[]``) as numpy.
    """
    x = _load_rows(reader, weights, dtype)
    data, scales, gs, finite = _quantize_tensor(x, recipe)
    if not bool(finite):
        _check_finite(x, weights)
    del x
    return np.asarray(data), np.asarray(scales), np.asarray(gs)


# --------------------------------------------------------------------------------------------
# Conversion
# --------------------------------------------------------------------------------------------

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


@dataclasses.dataclass
class _Unit:
    """One piece of output work: copy a tensor, or quantize an expert's GEMM1 or GEMM2."""

    anchor: TensorInfo  # decides the output shard and the processing order
    outputs: list[_OutTensor]
    copy: TensorInfo | None = None
    layer: _Layer | None = None
    expert: int = 0
    gemm: str = ""  # "gate_up" or "down"

    @property
    def source_bytes(self) -> int:
        if self.copy is not None:
            return self.copy.nbytes
        ws = self.layer.gemm1(self.expert) if self.gemm == "gate_up" else [self.layer.experts[self.expert]["down"]]
        return sum(t.nbytes for w in ws for t in w.tensors)


def _plan_units(ckpt: _Checkpoint, layers: dict[str, _Layer]) -> tuple[list[_Unit], list[str]]:
    """Every output tensor, grouped in units; also the names of dropped source tensors."""
    consumed, dropped, units = set(), [], []
    for layer in layers.values():
        if layer.ignored:
            continue
        for e in range(layer.num_experts):
            names = output_names(layer.module, e, layer.gated)
            g1 = layer.gemm1(e)
            down = layer.experts[e]["down"]
            units.append(_Unit(g1[0].info, _quantized_specs(names["gate_up"], len(g1) * layer.inter, layer.hidden),
                               layer=layer, expert=e, gemm="gate_up"))
            units.append(_Unit(down.info, _quantized_specs(names["down"], layer.hidden, layer.inter),
                               layer=layer, expert=e, gemm="down"))
            for w in g1 + [down]:
                consumed.update(t.name for t in w.tensors)
                if w.input_scale is not None:
                    dropped.append(w.input_scale.name)
    for name, t in ckpt.tensors.items():
        if name not in consumed:
            units.append(_Unit(t, [_OutTensor(name, t.dtype, t.shape, t.nbytes)], copy=t))
    units.sort(key=lambda u: (ckpt.files.index(u.anchor.path), u.anchor.start))  # sequential reads
    seen = set()
    for u in units:
        for o in u.outputs:
            if o.name in seen:
                raise CheckpointError(f"output tensor {o.name!r} would be written twice (it already exists "
                                      "in the source under that name)")
            seen.add(o.name)
    return units, sorted(dropped)


def _run_unit(u: _Unit, writer: _StreamingWriter, reader: _Reader, recipe: str) -> None:
    if u.copy is not None:
        writer.copy(u.copy.name, reader, u.copy)
        return
    ws = u.layer.gemm1(u.expert) if u.gemm == "gate_up" else [u.layer.experts[u.expert]["down"]]
    parts = _quantize_weights(reader, ws, u.layer.quant_dtype, recipe)
    for spec, arr in zip(u.outputs, parts):
        writer.write(spec.name, arr)


def _nvfp4_config(layers, ignore, recipe, dropped) -> dict:
    quantized = [ly for ly in layers.values() if not ly.ignored]
    src = sorted({_dtype_label(ly.source_dtype) for ly in quantized})
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "quant_algo": "NVFP4",
        "recipe": recipe,
        "group_size": BLOCK,
        "source_dtype": src[0] if len(src) == 1 else src,
        "gemm1_row_order": ["gate", "up"],
        "tensor_names": {
            "gemm1_gated": GATE_UP, "gemm1_not_gated": UP, "gemm2": DOWN,
            "data": DATA + " (uint8, two E2M1 codes a byte, even element in the low nibble)",
            "block_scale": BLOCK_SCALE + " (float8_e4m3fn, one per 16 elements, linear layout)",
            "global_scale": GLOBAL_SCALE + " (float32 scalar, the global DECODE scale)",
        },
        "ignore": list(ignore),
        "ignored_modules": sorted(ly.module for ly in layers.values() if ly.ignored),
        "dropped_tensors": dropped,
        "moe_modules": {m: ly.info() for m, ly in sorted(layers.items())},
        "producer": f"{FORMAT_NAME} {_version()}",
    }


def _version() -> str:
    from . import __version__
    return __version__


def _file_metadata(src_meta: dict[str, str], cfg: dict) -> dict[str, str]:
    meta = {str(k): str(v) for k, v in src_meta.items()}
    meta.update(nvfp4_format=FORMAT_NAME, nvfp4_format_version=str(FORMAT_VERSION), nvfp4_recipe=cfg["recipe"],
                nvfp4_source_dtype=json.dumps(cfg["source_dtype"]), nvfp4_group_size=str(BLOCK))
    return meta


def _copy_side_files(root: Path, dst: Path, skip: Iterable[Path]) -> None:
    """Copy small top-level files (config.json, tokenizer, ...) but no weight files or the index."""
    skip = {p.resolve() for p in skip}
    for p in sorted(root.iterdir()):
        if (p.is_file() and p.resolve() not in skip and not p.name.endswith(".index.json")
                and p.suffix not in _WEIGHT_EXTS and p.name != CONFIG_NAME):
            shutil.copy2(p, dst / p.name)


def _write_checkpoint(ckpt, layers, units, dropped, tmp: Path, ignore, recipe, progress) -> dict:
    from tqdm.auto import tqdm

    cfg = _nvfp4_config(layers, ignore, recipe, dropped)
    by_file: dict[Path, list[_Unit]] = {p: [] for p in ckpt.files}
    for u in units:
        by_file[u.anchor.path].append(u)
    weight_map = {}
    bar = tqdm(total=sum(u.source_bytes for u in units), unit="B", unit_scale=True, desc="nvfp4 convert",
               disable=not progress, dynamic_ncols=True)
    with _Reader() as reader, bar:
        for src_path, file_units in by_file.items():
            out_path = tmp / src_path.name
            specs = [o for u in file_units for o in u.outputs]
            writer = _StreamingWriter(out_path, specs, _file_metadata(ckpt.metadata[src_path], cfg))
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
    return cfg


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _publish(tmp: Path, dst: Path, overwrite: bool) -> None:
    """Rename the finished temporary folder to ``dst`` (replacing it only with ``overwrite``)."""
    if not dst.exists():
        os.replace(tmp, dst)
        return
    if not overwrite:
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
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")
    ignore = [ignore] if isinstance(ignore, str) else list(ignore)
    dst = Path(dst).absolute()
    if dst.exists() and not overwrite:
        raise FileExistsError(f"output already exists: {dst}")
    ckpt = open_checkpoint(src)
    if dst.resolve() == ckpt.root.resolve():
        raise ValueError(f"dst must differ from the source folder: {dst}")
    layers = _plan_layers(ckpt, ignore)
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


# --------------------------------------------------------------------------------------------
# Loading into JAX
# --------------------------------------------------------------------------------------------

class _Stack:
    """Host buffers for one MoE module's stacked NVFP4 experts, filled expert by expert."""

    def __init__(self, layer_e: int, rows1: int, hidden: int, inter: int):
        def parts(rows, k):
            return [np.empty((layer_e, rows, k // 2), np.uint8),
                    np.empty((layer_e, rows, k // BLOCK), ml_dtypes.float8_e4m3fn),
                    np.empty((layer_e,), np.float32)]
        self.gate_up = parts(rows1, hidden)
        self.down = parts(hidden, inter)

    def experts(self, gated: bool, dtype) -> NVFP4Experts:
        return NVFP4Experts.from_parts(*(jnp.asarray(a) for a in self.gate_up + self.down), gated=gated, dtype=dtype)


def quantize_checkpoint_experts(src, *, ignore: Sequence[str] = (), recipe: str = "nvfp4",
                                progress: bool = False) -> dict[str, NVFP4Experts]:
    """Quantize a source checkpoint's routed experts while loading them (nothing is written).

    Streams one expert tensor at a time: host memory holds the quantized experts plus one source
    expert tensor. Same rules and errors as :func:`convert_checkpoint`; the result equals
    ``load_nvfp4_experts(convert_checkpoint(src, dst, ...).dst)``.

    Returns
    -------
    dict mapping MoE module name (e.g. ``"model.layers.0.mlp"``) to NVFP4Experts with gate_up
    ``[E, 2I, H]`` (or ``[E, I, H]`` not gated) and down ``[E, H, I]``, global scales ``[E]``.
    Ignored modules are absent.
    """
    from tqdm.auto import tqdm

    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")
    ignore = [ignore] if isinstance(ignore, str) else list(ignore)
    ckpt = open_checkpoint(src)
    layers = [ly for ly in _plan_layers(ckpt, ignore).values() if not ly.ignored]
    total = sum(t.nbytes for ly in layers for ex in ly.experts for w in ex.values() for t in w.tensors)
    out = {}
    with _Reader() as reader, tqdm(total=total, unit="B", unit_scale=True, desc="nvfp4 quantize",
                                   disable=not progress, dynamic_ncols=True) as bar:
        for ly in layers:
            stack = _Stack(ly.num_experts, (2 if ly.gated else 1) * ly.inter, ly.hidden, ly.inter)
            for e in range(ly.num_experts):
                for bufs, ws in ((stack.gate_up, ly.gemm1(e)), (stack.down, [ly.experts[e]["down"]])):
                    for buf, part in zip(bufs, _quantize_weights(reader, ws, ly.quant_dtype, recipe)):
                        buf[e] = part
                    bar.update(sum(t.nbytes for w in ws for t in w.tensors))
            out[ly.module] = stack.experts(ly.gated, ly.quant_dtype)
    return out


def read_nvfp4_config(path) -> dict:
    """The ``nvfp4_config.json`` of an NVFP4 checkpoint folder (or of the folder of a file in it)."""
    path = Path(path)
    root = path if path.is_dir() else path.parent
    cfg_path = root / CONFIG_NAME
    if not cfg_path.is_file():
        raise CheckpointError(f"{root} is not an NVFP4 checkpoint written by jax_nvfp4 (no {CONFIG_NAME}); "
                              "to quantize a source checkpoint while loading, pass quantize_source=True")
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("format") != FORMAT_NAME or cfg.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{cfg_path}: format {cfg.get('format')!r} version {cfg.get('format_version')!r} "
                              f"is not {FORMAT_NAME!r} version {FORMAT_VERSION}")
    return cfg


def load_nvfp4_experts(path, *, quantize_source: bool = False, ignore: Sequence[str] = (), recipe: str = "nvfp4",
                       progress: bool = False) -> dict[str, NVFP4Experts]:
    """Load the NVFP4 experts of a checkpoint, stacked per MoE module.

    Parameters
    ----------
    path : an NVFP4 checkpoint written by :func:`convert_checkpoint` (folder or one of its files),
        or, with ``quantize_source=True``, a source (bf16 / fp16 / fp32 / FP8) checkpoint.
    quantize_source : quantize the source's experts while loading (:func:`quantize_checkpoint_experts`);
        ``ignore``, ``recipe`` and ``progress`` apply only then.

    Returns
    -------
    dict mapping MoE module name (e.g. ``"model.layers.0.mlp"``) to NVFP4Experts: gate_up data uint8
    ``[E, 2I, H/2]`` (rows [gate; up]; ``[E, I, H/2]`` not gated), scales float8_e4m3fn
    ``[E, 2I, H/16]``, global_scale float32 ``[E]``; down ``[E, H, I/2]`` / ``[E, H, I/16]`` / ``[E]``.
    Modules kept in source precision (ignored) are absent.
    """
    if quantize_source:
        return quantize_checkpoint_experts(path, ignore=ignore, recipe=recipe, progress=progress)
    cfg = read_nvfp4_config(path)
    path = Path(path)
    ckpt = open_checkpoint(path if path.is_dir() else path.parent)  # all shards, whichever file was named
    out = {}
    with _Reader() as reader:
        for module, m in cfg["moe_modules"].items():
            if not m["quantized"]:
                continue
            gated, n, h, i = m["gated"], m["num_experts"], m["hidden_size"], m["intermediate_size"]
            stack = _Stack(n, (2 if gated else 1) * i, h, i)
            for e in range(n):
                names = output_names(module, e, gated)
                for bufs, key in ((stack.gate_up, "gate_up"), (stack.down, "down")):
                    for buf, part in zip(bufs, ("data", "scales", "global_scale")):
                        # buf[e, ...] is a view also for the 1-D global scales (buf[e] would be a copy)
                        _read_expected(ckpt, reader, names[key][part], buf[e, ...])
            out[module] = stack.experts(gated, _BY_NAME[m["quantized_dtype"]])
    return out


def _read_expected(ckpt: _Checkpoint, reader: _Reader, name: str, out: np.ndarray) -> None:
    info = ckpt.tensors.get(name)
    if info is None:
        raise CheckpointError(f"NVFP4 checkpoint {ckpt.root}: tensor {name!r} is missing")
    if _NP_DTYPES.get(info.dtype) != out.dtype or info.shape != out.shape:
        raise CheckpointError(f"tensor {name!r}: {info.dtype} {list(info.shape)}, expected "
                              f"{_ST_DTYPES[out.dtype]} {list(out.shape)}")
    reader.read_into(info, out)
