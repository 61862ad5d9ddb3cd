"""Routed experts stacked in one tensor per projection (gpt-oss, Llama 4), as Hugging Face stores them.

Recognized names (``M`` the MoE module, e.g. ``model.layers.0.mlp``)::

    M.experts.gate_up_proj  [E, H, 2I]   M.experts.down_proj  [E, I, H]   (bf16 / fp16 / fp32; x @ w)
    M.experts.gate_up_proj_blocks [E, 2I, H/32, 16] + _scales [E, 2I, H/32]                  (MXFP4, gpt-oss)
    M.experts.down_proj_blocks    [E, H, I/32, 16]  + _scales [E, H, I/32]
    M.experts.gate_up_proj_bias   [E, 2I]            M.experts.down_proj_bias [E, H]          (optional)
    M.experts.gate_up_proj U8 [E, H/2, 2I] + _weight_scale F8_E4M3 [E, H/16, 2I] + _weight_scale_2 F32 [] or [E]
    M.experts.down_proj    U8 [E, I/2, H]  + _weight_scale [E, I/16, H] + _weight_scale_2      (NVFP4, ModelOpt)

The gate and up columns of ``gate_up_proj`` (and of its bias) alternate in gpt-oss and are halves
``[gate | up]`` in Llama 4; ``config.json``'s ``model_type`` says which, and anything else is refused
rather than guessed. MXFP4 blocks hold E2M1 codes two a byte (even element in the low nibble) with one
E8M0 scale (``2^(s - 127)``, 255 = NaN) per 32 elements; they are dequantized to bf16, as Transformers
does, then quantized to NVFP4 like any bf16 weight. NVFP4 experts as ModelOpt exports stacked ones (packed along
the input dimension, then transposed back to ``x @ w``; one global decode scale per projection, or one per
expert; ``_input_scale``, once or per expert, the static activation scale) are taken as stored.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import ml_dtypes
import numpy as np

from ..formats import BLOCK, E2M1_TABLE
from .experts import _QUANTIZABLE, MXFP4, NVFP4, ExpertWeight, MoELayer, validate_nvfp4_scales
from .safetensors_io import CheckpointError, TensorInfo

_STACKED_RE = re.compile(r"^(?P<module>.+)\.experts\.(?P<proj>gate_up_proj|down_proj)"
                         r"(?P<part>|_blocks|_scales|_bias|_weight_scale|_weight_scale_2|_input_scale)$")
MX_BLOCK = 32  # elements per E8M0 scale
GATE_UP_ORDER = {"gpt_oss": "interleaved", "llama4": "halves", "llama4_text": "halves"}  # by config model_type


def _model_type(root: Path) -> str | None:
    try:
        cfg = json.loads((root / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return cfg.get("model_type") if isinstance(cfg, dict) else None


def _expert_slice(t: TensorInfo, e: int) -> TensorInfo:
    """Expert ``e``'s part of a stacked ``[E, ...]`` tensor (contiguous bytes)."""
    per = t.nbytes // t.shape[0]
    return dataclasses.replace(t, shape=t.shape[1:], start=t.start + e * per, end=t.start + (e + 1) * per)


def _expect(t: TensorInfo | None, shape: tuple[int, ...], dtypes: tuple[str, ...], what: str) -> None:
    if t is None:
        return
    if t.shape != shape:
        raise CheckpointError(f"tensor {t.name!r}: shape {list(t.shape)}, expected {list(shape)} ({what})")
    if t.dtype not in dtypes:
        raise CheckpointError(f"tensor {t.name!r}: dtype {t.dtype}, expected one of {', '.join(dtypes)} ({what})")


def _proj_weights(module: str, proj: str, parts: dict[str, TensorInfo], order: str) -> tuple[list, tuple, str]:
    """One projection's per-expert weights, its logical ``(E, N, K)`` and source dtype."""
    name = f"{module}.experts.{proj}"
    if "_weight_scale_2" in parts:
        return _nvfp4_weights(module, proj, parts, order)
    plain, blocks, scales = parts.get(""), parts.get("_blocks"), parts.get("_scales")
    if (plain is None) == (blocks is None):
        raise CheckpointError(f"MoE module {module!r}: expected either {name} or {name}_blocks "
                              f"(MXFP4) for the stacked experts, found {sorted(name + p for p in parts)}")
    if blocks is not None:
        if scales is None:
            raise CheckpointError(f"tensor {blocks.name!r}: MXFP4 blocks without {name}_scales")
        if len(blocks.shape) != 4 or blocks.shape[3] != MX_BLOCK // 2:
            raise CheckpointError(f"tensor {blocks.name!r}: shape {list(blocks.shape)}, expected MXFP4 blocks "
                                  f"[E, N, K/{MX_BLOCK}, {MX_BLOCK // 2}]")
        _expect(blocks, blocks.shape, (MXFP4,), "MXFP4 blocks")
        _expect(scales, blocks.shape[:3], (MXFP4,), "MXFP4 E8M0 scales, one per block")
        (e, n, g, _), dtype = blocks.shape, MXFP4
        k = g * MX_BLOCK
    else:
        if scales is not None:
            raise CheckpointError(f"tensor {scales.name!r}: MXFP4 scales without {name}_blocks")
        if len(plain.shape) != 3:
            raise CheckpointError(f"tensor {plain.name!r}: shape {list(plain.shape)}, expected stacked experts "
                                  "[E, K, N] (used as x @ w)")
        _expect(plain, plain.shape, _QUANTIZABLE, "a stacked expert weight")
        (e, k, n), dtype = plain.shape, plain.dtype
    _expect(parts.get("_bias"), (e, n), ("BF16", "F16", "F32"), "one bias per expert and output feature")
    weights = [ExpertWeight(_expert_slice(blocks if plain is None else plain, x),
                            scale=None if scales is None else _expert_slice(scales, x), expert=x,
                            transposed=plain is not None, interleaved=proj == "gate_up_proj" and order == "interleaved",
                            bias=None if "_bias" not in parts else _expert_slice(parts["_bias"], x))
               for x in range(e)]
    return weights, (e, n, k), dtype


def _per_expert(t: TensorInfo | None, e: int, x: int) -> TensorInfo | None:
    """Expert ``x``'s entry of a scale stored once (one element) or once per expert (``[E]``)."""
    if t is None or math.prod(t.shape) == 1:
        return t
    if tuple(t.shape) != (e,):
        raise CheckpointError(f"tensor {t.name!r}: shape {list(t.shape)}, expected one scale or one per expert [{e}]")
    return _expert_slice(t, x)


def _nvfp4_weights(module: str, proj: str, parts: dict[str, TensorInfo], order: str) -> tuple[list, tuple, str]:
    """:func:`_proj_weights` of NVFP4 stacked experts (ModelOpt): codes ``[E, K/2, N]``, scales ``[E, K/16, N]``."""
    name = f"{module}.experts.{proj}"
    codes = parts.get("")
    if codes is None or len(codes.shape) != 3 or codes.dtype != "U8":
        got = "missing" if codes is None else f"{codes.dtype} {list(codes.shape)}"
        raise CheckpointError(f"tensor {name!r}: {got}, expected NVFP4 codes U8 [E, K/2, N] next to "
                              f"{name}_weight_scale_2")
    e, k, n = codes.shape[0], codes.shape[1] * 2, codes.shape[2]
    scales = parts.get("_weight_scale")
    _expect(parts.get("_bias"), (e, n), ("BF16", "F16", "F32"), "one bias per expert and output feature")
    weights = []
    for x in range(e):
        w = ExpertWeight(_expert_slice(codes, x), scale=None if scales is None else _expert_slice(scales, x),
                         input_scale=_per_expert(parts.get("_input_scale"), e, x), expert=x, transposed=True,
                         interleaved=proj == "gate_up_proj" and order == "interleaved",
                         bias=None if "_bias" not in parts else _expert_slice(parts["_bias"], x),
                         global_scale=_per_expert(parts["_weight_scale_2"], e, x))
        validate_nvfp4_scales(w)
        weights.append(w)
    return weights, (e, n, k), NVFP4


def find_stacked_layers(tensors: dict[str, TensorInfo], root: Path) -> dict[str, MoELayer]:
    """Every MoE module with stacked experts, validated (shapes, dtypes, the gate/up order)."""
    raw: dict[str, dict[str, dict[str, TensorInfo]]] = {}
    for name, t in tensors.items():
        m = _STACKED_RE.match(name)
        if m:
            raw.setdefault(m["module"], {}).setdefault(m["proj"], {})[m["part"]] = t
    if not raw:
        return {}
    model_type = _model_type(root)
    order = GATE_UP_ORDER.get(model_type)
    layers = {}
    for module, projs in raw.items():
        for proj in ("gate_up_proj", "down_proj"):
            if proj not in projs:
                other = next(iter(next(iter(projs.values())).values())).name
                raise CheckpointError(f"tensor {other!r}: its partner {module}.experts.{proj} is missing")
        if order is None:
            raise CheckpointError(
                f"MoE module {module!r} stacks its experts in {module}.experts.gate_up_proj, whose gate/up column "
                f"order is known only for config.json model_type {sorted(GATE_UP_ORDER)}, got {model_type!r}")
        gu, (e, n1, h), dt1 = _proj_weights(module, "gate_up_proj", projs["gate_up_proj"], order)
        dn, (e2, h2, i), dt2 = _proj_weights(module, "down_proj", projs["down_proj"], order)
        if (e2, h2, n1) != (e, h, 2 * i):
            raise CheckpointError(f"MoE module {module!r}: gate_up_proj holds {e} experts of [2I, H] = [{n1}, {h}] "
                                  f"but down_proj {e2} of [H, I] = [{h2}, {i}]")
        if dt1 != dt2:
            raise CheckpointError(f"MoE module {module!r}: gate_up_proj is {dt1} but down_proj {dt2} "
                                  "(one dtype per MoE module)")
        if h % BLOCK or i % BLOCK:
            raise CheckpointError(f"MoE module {module!r}: H={h} and I={i} must be multiples of {BLOCK}")
        layers[module] = MoELayer(module, [{"gate_up": a, "down": b} for a, b in zip(gu, dn)], gated=True,
                                  hidden=h, inter=i, source_dtype=dt1)
    return layers


def read_stacked_rows(reader, w: ExpertWeight, out: np.ndarray) -> None:
    """``out [N, K]`` = the expert's weight in our layout: dequantized (MXFP4), transposed, gate rows first."""
    x = _dequantize_mxfp4(reader, w) if w.info.dtype == MXFP4 else reader.read(w.info)
    x = x.T if w.transposed else x
    if w.interleaved:
        n = x.shape[0] // 2
        out[:n], out[n:] = x[0::2], x[1::2]
    else:
        out[...] = x


def read_stacked_bias(reader, w: ExpertWeight, dtype) -> np.ndarray:
    """The expert's bias ``[N]`` as ``dtype``, gate entries first."""
    b = reader.read(w.bias).astype(dtype)
    return np.concatenate([b[0::2], b[1::2]]) if w.interleaved else b


def _dequantize_mxfp4(reader, w: ExpertWeight) -> np.ndarray:
    """bf16 ``[N, K]`` of MXFP4 blocks ``[N, K/32, 16]`` and E8M0 scales ``[N, K/32]`` (exact in fp32)."""
    blocks, s = reader.read(w.info), reader.read(w.scale)
    n, g, _ = blocks.shape
    out = np.empty((n, g * MX_BLOCK), ml_dtypes.bfloat16)
    step = max(1, (1 << 20) // (g * MX_BLOCK))  # ~4 MB of fp32 temporaries
    for r in range(0, n, step):
        b = blocks[r:r + step]
        codes = np.stack([b & 15, b >> 4], axis=-1)  # even element in the low nibble
        e8 = s[r:r + step].astype(np.int32)
        scale = np.where(e8 == 255, np.float32(np.nan), np.ldexp(np.float32(1), np.minimum(e8, 254) - 127))
        out[r:r + step] = (E2M1_TABLE[codes].reshape(len(b), g, MX_BLOCK) * scale[..., None]).reshape(len(b), -1)
    return out
