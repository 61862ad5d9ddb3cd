"""safetensors files: read lazily one tensor at a time, written as a stream.

Reading uses plain file reads, no mmap, so resident memory is what we allocate: :func:`read_header`
and :func:`open_checkpoint` parse headers only, a :class:`TensorReader` reads tensor bytes on demand.
A :class:`StreamingWriter` writes a file's header from its tensor list first, then each tensor's
bytes as soon as they exist, so a converted tensor never waits in memory for the others.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from collections.abc import Sequence
from pathlib import Path

import ml_dtypes
import numpy as np

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# safetensors dtype string -> numpy dtype (ml_dtypes for the types numpy lacks)
NP_DTYPES = {
    "BOOL": np.dtype(np.bool_), "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16), "I16": np.dtype(np.int16), "U32": np.dtype(np.uint32),
    "I32": np.dtype(np.int32), "U64": np.dtype(np.uint64), "I64": np.dtype(np.int64),
    "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16), "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
ST_DTYPES = {v: k for k, v in NP_DTYPES.items()}  # numpy dtype -> safetensors dtype string
_COPY_CHUNK = 16 << 20  # bytes per read/write when copying a tensor unchanged
_MAX_HEADER = 100 << 20  # safetensors' own limit


class CheckpointError(ValueError):
    """A source checkpoint cannot be converted (the message names the tensor)."""


def dtype_name(dtype: str) -> str:
    """numpy's name for a safetensors dtype (``"BF16"`` -> ``"bfloat16"``); unknown dtypes as given."""
    return NP_DTYPES[dtype].name if dtype in NP_DTYPES else dtype


def itemsize(dtype: str) -> int:
    """Bytes per element of a safetensors dtype (1 for dtypes we do not know)."""
    dt = NP_DTYPES.get(dtype)
    return dt.itemsize if dt is not None else 1


# --------------------------------------------------------------------------------------------
# Reading
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
        np_dt = NP_DTYPES.get(dtype)
        if not 0 <= b <= e <= data_len or (np_dt is not None and e - b != math.prod(shape) * np_dt.itemsize):
            raise CheckpointError(
                f"{path}: tensor {name!r} ({dtype} {list(shape)}) has inconsistent data_offsets [{b}, {e}]")
        tensors[name] = TensorInfo(name, path, dtype, shape, data_start + b, data_start + e)
    return tensors, meta


class TensorReader:
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
        if out.dtype != NP_DTYPES[info.dtype] or out.size != math.prod(info.shape):
            raise AssertionError(f"buffer {out.dtype}{out.shape} does not fit {info.name}")
        self.read_bytes_into(info.path, info.start, memoryview(out.reshape(-1).view(np.uint8)))
        return out

    def read(self, info: TensorInfo) -> np.ndarray:
        if info.dtype not in NP_DTYPES:
            raise CheckpointError(f"tensor {info.name!r}: unsupported dtype {info.dtype}")
        return self.read_into(info, np.empty(info.shape, NP_DTYPES[info.dtype]))

    def close(self):
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@dataclasses.dataclass
class Checkpoint:
    """The safetensors files of a checkpoint and every tensor in them."""

    root: Path  # folder holding the files
    files: list[Path]
    tensors: dict[str, TensorInfo]
    metadata: dict[Path, dict[str, str]]
    index: dict | None  # the parsed index file, when sharded

    @property
    def total_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.files)


def checkpoint_folder(path) -> Path:
    """The folder of a checkpoint named by itself or by one of its files; a path that does not exist raises
    (taking its parent would load whatever checkpoint sits there)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    return path if path.is_dir() else path.parent


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


def open_checkpoint(src) -> Checkpoint:
    """Read the headers of every file of a checkpoint (no tensor data is read).

    ``src`` is a folder (``model.safetensors.index.json``, ``model.safetensors`` or a single
    ``*.safetensors``), a ``.safetensors`` file or an index file.
    """
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
    return Checkpoint(root, files, tensors, metadata, index)


# --------------------------------------------------------------------------------------------
# Writing (header first, then tensor bytes as they are produced)
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class OutTensor:
    """A tensor of a file being written, declared before its data exists."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


class StreamingWriter:
    """Writes one safetensors file whose tensor list is known before any data.

    The header is written first; each tensor is then written at its offset as soon as it exists,
    in any order. Layout as the safetensors library lays it out: header padded with spaces to a
    multiple of 8 bytes, tensors contiguous, sorted by dtype size (largest first) then name, so
    every tensor is aligned to its element size.
    """

    def __init__(self, path: Path, tensors: Sequence[OutTensor], metadata: dict[str, str]):
        self.path = path
        self._entries = {t.name: t for t in tensors}
        if len(self._entries) != len(tensors):
            raise CheckpointError(f"{path.name}: duplicate output tensor names")
        header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
        self._offset: dict[str, int] = {}
        pos = 0
        for t in sorted(tensors, key=lambda t: (-itemsize(t.dtype), t.name)):
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

    def _seek(self, name: str) -> OutTensor:
        if name not in self._pending:
            raise AssertionError(f"{self.path.name}: {name!r} not declared or already written")
        self._pending.discard(name)
        self._f.seek(self._data_start + self._offset[name])
        return self._entries[name]

    def write(self, name: str, arr: np.ndarray) -> None:
        """Write a whole tensor; its dtype and shape must be the declared ones."""
        t = self._seek(name)
        arr = np.asarray(arr, order="C")  # (ascontiguousarray would make a 0-d array 1-d)
        if ST_DTYPES.get(arr.dtype) != t.dtype or tuple(arr.shape) != t.shape:
            raise AssertionError(f"{name}: wrote {arr.dtype}{arr.shape}, declared {t.dtype}{t.shape}")
        self._f.write(memoryview(arr.reshape(-1).view(np.uint8)))

    def copy(self, name: str, reader: TensorReader, src: TensorInfo) -> None:
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
