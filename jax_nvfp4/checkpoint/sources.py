"""Source expert weights to NVFP4: read, FP8-dequantized, checked finite, quantized.

bfloat16, float16 and float32 weights reach the quantizer as stored. FP8 (float8_e4m3fn) weights
are dequantized as ``fp32(w) * scale`` and rounded to bfloat16 first (spec section 4), so an FP8
checkpoint quantizes exactly as its bf16 dequantization would; MXFP4 (gpt-oss) likewise. NVFP4 weights
(ModelOpt) are not quantized again: their bytes are taken as stored (:func:`nvfp4_parts`). Stacked experts
(:mod:`.stacked`) are transposed and their gate rows put first on the way.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import warnings
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from ..formats import BLOCK, E2M1_TABLE
from ..quantize import RECIPES, quantize
from .experts import FP8, MXFP4, ExpertWeight, validate_nvfp4_scales, weight_from_params
from .safetensors_io import ST_DTYPES, CheckpointError, TensorReader
from .stacked import read_stacked_bias, read_stacked_rows


def check_recipe(recipe: str) -> None:
    """Raise ValueError unless ``recipe`` is one of :data:`jax_nvfp4.RECIPES`."""
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")


def quantized_parts(rows: int, k: int, up_scale: bool = False, bias_dtype=None,
                    input_scale: bool = False) -> dict[str, tuple[str, tuple[int, ...]]]:
    """safetensors dtype and shape of each part of a quantized ``[rows, k]`` weight, in the order
    :func:`expert_outputs` returns them: ``{"data" | "scales" | "global_scale" [| "bias" | "input_scale"]: (dtype,
    shape)}``; ``up_scale``: GEMM1 of pre-quantized gate and up, a global (and input) scale each (``[2]``);
    ``bias_dtype``: the bias ``[rows]`` as that numpy dtype; ``input_scale``: the static activation decode scale."""
    parts = {"data": ("U8", (rows, k // 2)), "scales": ("F8_E4M3", (rows, k // BLOCK)),
             "global_scale": ("F32", (2,) if up_scale else ())}
    if bias_dtype is not None:
        parts["bias"] = (ST_DTYPES[np.dtype(bias_dtype)], (rows,))
    if input_scale:
        parts["input_scale"] = ("F32", (2,) if up_scale else ())
    return parts


def source_progress(total: int, desc: str, enabled: bool):
    """A tqdm bar over ``total`` source bytes (disabled unless ``enabled``)."""
    from tqdm.auto import tqdm  # lazily: importing jax_nvfp4 should not import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=not enabled, dynamic_ncols=True)


@functools.partial(jax.jit, static_argnames=("recipe",))
def _quantize_tensor(x, recipe: str):
    """x ``[N, K]`` -> (data uint8 ``[N, K/2]``, scales e4m3 ``[N, K/16]``, global f32 ``[]``, all finite)."""
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)))  # one global scale for all rows (gate and up share it)
    q = quantize(x, recipe=recipe, global_amax=amax)
    return q.data, q.scales, q.global_scale, jnp.all(jnp.isfinite(x))


def _dequantize_fp8_into(reader: TensorReader, w: ExpertWeight, out: np.ndarray) -> None:
    """``out [N, K] bf16 = bf16(fp32(w) * scale)``, a few rows at a time (bounded fp32 temporaries)."""
    w8 = reader.read(w.info)
    s = reader.read(w.scale).astype(np.float32)
    n, k = w8.shape
    if w.block is None:
        step = max(1, (4 << 20) // max(1, k))  # ~16 MB of fp32 temporaries
        row_scales = itertools.repeat(s.reshape(()))
    else:
        step, bi = w.block  # one block-row at a time, its scales repeated to one per column
        row_scales = (np.repeat(s_row, bi)[:k] for s_row in s)
    for r, scale in zip(range(0, n, step), row_scales):
        out[r:r + step] = (w8[r:r + step].astype(np.float32) * scale).astype(ml_dtypes.bfloat16)


def read_nvfp4(reader: TensorReader, w: ExpertWeight):
    """An NVFP4 weight as stored, in our layout: (codes uint8 ``[N, K/2]``, block scales float8_e4m3fn ``[N, K/16]``,
    global decode scale float32 ``[]``: compressed-tensors' ``1 / weight_global_scale`` in fp32, as vLLM takes it);
    stacked experts transposed, gpt-oss's gate rows put first.

    A NaN block scale (the byte an exporter writes for a block of amax 0, as 0 / 0) is set to 0 where the block's
    codes are all zero, which it then decodes to exactly, with a warning; anywhere else it, or a global scale that
    is not finite and >= 0, is an error naming the tensor.
    """
    data, scales = reader.read(w.info), reader.read(w.scale)
    if w.transposed:  # stacked as x @ w: [K/2, N] codes, [K/16, N] scales
        data, scales = np.ascontiguousarray(data.T), np.ascontiguousarray(scales.T)
    if w.interleaved:  # gpt-oss: rows alternate gate, up
        data, scales = (np.concatenate([a[0::2], a[1::2]]) for a in (data, scales))
    g = np.float32(reader.read(w.global_scale).reshape(()))
    if w.encode_global:  # compressed-tensors stores the encode scale 2688 / amax; its reciprocal decodes
        if not (np.isfinite(g) and g > 0):
            raise CheckpointError(f"tensor {w.global_scale.name!r}: global encode scale {g}, expected finite and > 0")
        g = np.float32(1) / g
    if not (np.isfinite(g) and g >= 0):
        raise CheckpointError(f"tensor {w.global_scale.name!r}: global scale {g}, expected finite and >= 0")
    nan = np.isnan(scales.astype(np.float32))
    if nan.any():
        n, blocks = scales.shape
        zero = ~(data.reshape(n, blocks, BLOCK // 2) & 0x77).any(axis=-1)  # every code +-0 (sign bits 0x88 aside)
        if (nan & ~zero).any():
            r, b = np.argwhere(nan & ~zero)[0]
            raise CheckpointError(f"tensor {w.scale.name!r}: NaN block scale at [{r}, {b}] over nonzero codes of "
                                  f"{w.name!r}; refusing NaN weights")
        scales = np.where(nan, np.zeros((), scales.dtype), scales)
        warnings.warn(f"tensor {w.scale.name!r}: {int(nan.sum())} NaN block scales of all-zero blocks set to 0",
                      stacklevel=2)
    return data, scales, g


def nvfp4_parts(reader: TensorReader, weights: Sequence[ExpertWeight]):
    """The row-stack of NVFP4 ``weights`` (``[gate, up]``, or one weight) as stored.

    Returns
    -------
    (data uint8 ``[N, K/2]``, scales float8_e4m3fn ``[N, K/16]``, global_scale float32) as numpy; the global
    scale is ``[]`` for one weight, ``[2]`` (gate's, up's) for gate and up: exporters quantize them apart
    (ModelOpt 0.45 gave different scales to most pairs, vLLM issue 54974), and both are kept exactly
    (:attr:`~jax_nvfp4.NVFP4Experts.up_global_scale`).
    """
    parts = [read_nvfp4(reader, w) for w in weights]
    if len(parts) not in (1, 2):
        raise ValueError(f"nvfp4_parts: one weight or [gate, up], got {len(parts)}")
    g = np.array([g for _, _, g in parts], np.float32).reshape(() if len(parts) == 1 else (2,))
    return np.concatenate([d for d, _, _ in parts]), np.concatenate([s for _, s, _ in parts]), g


def _dequantize_nvfp4_into(reader: TensorReader, w: ExpertWeight, out: np.ndarray) -> None:
    """``out [N, K] = dtype(e2m1 * fp32(block scale) * global scale)`` (fp32 products), a few rows at a time
    (bounded fp32 temporaries)."""
    data, scales, g = read_nvfp4(reader, w)
    n, k = out.shape
    step = max(1, (1 << 20) // k)  # ~4 MB of fp32 temporaries
    for r in range(0, n, step):
        d = data[r:r + step]
        codes = np.stack([d & 0xF, d >> 4], axis=-1).reshape(len(d), -1, BLOCK)
        v = E2M1_TABLE[codes] * scales[r:r + step].astype(np.float32)[..., None] * g
        out[r:r + step] = v.reshape(len(d), k).astype(out.dtype)


def nvfp4_weight(tensors: dict, name: str) -> ExpertWeight | None:
    """The NVFP4 weight ``P.weight`` (``name``) of a checkpoint's ``tensors``, validated, or None for any other:
    ModelOpt's ``P.weight`` U8 codes next to ``P.weight_scale`` and ``P.weight_scale_2`` (``P.input_scale`` kept as
    its activation scale), or compressed-tensors' ``P.weight_packed``, ``P.weight_scale``, ``P.weight_global_scale``
    (``P.input_global_scale``)."""
    prefix = name[: -len("weight")] if name.endswith("weight") else None
    if prefix is None:
        return None
    if name in tensors and prefix + "weight_scale_2" in tensors:
        params = ("weight", "weight_scale", "weight_scale_2", "input_scale")
    elif prefix + "weight_packed" in tensors and prefix + "weight_global_scale" in tensors:
        params = ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale")
    else:
        return None
    w = weight_from_params({p: tensors[prefix + p] for p in params if prefix + p in tensors})
    validate_nvfp4_scales(w)
    return w


def dequantize_nvfp4(reader: TensorReader, w: ExpertWeight, dtype) -> np.ndarray:
    """An NVFP4 weight ``[N, K]`` as ``dtype``: each value ``(e2m1 * fp32(block scale)) * global scale`` in fp32 (the
    first product exact: one rounding, as :func:`jax_nvfp4.dequantize`)."""
    out = np.empty(w.shape, dtype)
    _dequantize_nvfp4_into(reader, w, out)
    return out


def _row_blocks(weights: Sequence[ExpertWeight]) -> Iterator[tuple[ExpertWeight, slice]]:
    """Each weight with its rows in the row-stack of ``weights``."""
    r = 0
    for w in weights:
        n = w.shape[0]
        yield w, slice(r, r + n)
        r += n


def _load_rows(reader: TensorReader, weights: Sequence[ExpertWeight], dtype) -> np.ndarray:
    """Read the weights stacked along rows into one buffer ``[sum N, K]`` of ``dtype`` (no extra copy)."""
    k = weights[0].shape[1]
    out = np.empty((sum(w.shape[0] for w in weights), k), dtype)
    for w, rows in _row_blocks(weights):
        if w.nvfp4:
            _dequantize_nvfp4_into(reader, w, out[rows])
        elif w.info.dtype == FP8:
            _dequantize_fp8_into(reader, w, out[rows])
        elif w.expert is not None:
            read_stacked_rows(reader, w, out[rows])
        else:
            reader.read_into(w.info, out[rows])
    return out


def _check_finite(x: np.ndarray, weights: Sequence[ExpertWeight]) -> None:
    """Raise naming the first weight of the row-stack ``x`` with a NaN or Inf."""
    for w, rows in _row_blocks(weights):
        part = x[rows].astype(np.float32)
        if not np.isfinite(part).all():
            bad = np.argwhere(~np.isfinite(part))[0]
            what = {FP8: " after FP8 dequantization", MXFP4: " after MXFP4 dequantization"}.get(w.info.dtype, "")
            raise CheckpointError(f"tensor {w.label!r}: non-finite value {part[tuple(bad)]} at {bad.tolist()}"
                                  f"{what}; refusing to quantize NaN/Inf weights")


def quantize_weights(reader: TensorReader, weights: Sequence[ExpertWeight], dtype, recipe: str):
    """Quantize the row-stack of ``weights`` with one global scale.

    Returns
    -------
    (data uint8 ``[N, K/2]``, scales float8_e4m3fn ``[N, K/16]``, global_scale float32 ``[]``) as numpy. NVFP4
    weights are not quantized again: :func:`nvfp4_parts` (pre-quantized gate and up: global scales ``[2]``).
    """
    if weights[0].nvfp4:
        return nvfp4_parts(reader, weights)
    x = _load_rows(reader, weights, dtype)
    data, scales, gs, finite = _quantize_tensor(x, recipe)
    if not bool(finite):  # name the culprit on the host only when the jitted check fails
        _check_finite(x, weights)
    del x
    return np.asarray(data), np.asarray(scales), np.asarray(gs)


def expert_outputs(reader: TensorReader, weights: Sequence[ExpertWeight], dtype, recipe: str, bias_dtype=None,
                   input_scale: bool = False):
    """:func:`quantize_weights` of ``weights``, then, with ``bias_dtype``, their bias ``[N]`` as that dtype (a
    stacked-expert weight's, gate entries first), then, with ``input_scale``, their static activation decode scales
    (:func:`read_input_scales`)."""
    parts = quantize_weights(reader, weights, dtype, recipe)
    if bias_dtype is not None:
        w = weights[0]
        b = read_stacked_bias(reader, w, bias_dtype)
        if not np.isfinite(b.astype(np.float32)).all():
            raise CheckpointError(f"tensor {w.bias.name!r} (expert {w.expert}): non-finite bias values")
        parts = parts + (b,)
    return parts + (read_input_scales(reader, weights),) if input_scale else parts


def read_input_scales(reader: TensorReader, weights: Sequence[ExpertWeight]) -> np.ndarray:
    """The static activation *decode* scales of NVFP4 ``weights`` (``[]`` for one, ``[2]`` for gate and up): ModelOpt's
    ``input_scale`` (amax / 2688) as stored, compressed-tensors' ``1 / input_global_scale`` (an encode scale) in fp32
    (w4a4 then encodes with ``fp32(1 / that)``, in rare cases one ulp from the stored encode scale); each finite and
    > 0, else an error naming the tensor."""
    out = []
    for w in weights:
        s = np.float32(reader.read(w.input_scale).reshape(()))
        if not (np.isfinite(s) and s > 0):
            raise CheckpointError(f"tensor {w.input_scale.name!r}: activation scale {s}, expected finite and > 0")
        out.append(np.float32(1) / s if w.encode_global else s)
    return np.array(out, np.float32).reshape(() if len(out) == 1 else (len(out),))


def read_source_experts(ckpt, reader: TensorReader, module: str, dtype):
    """The source experts of one MoE module of a checkpoint, unquantized, in our layout (what a model with bf16
    experts loads): per-expert tensors or stacked ones (gpt-oss, Llama 4), bf16/fp16/fp32, FP8 (dequantized
    with its scales) or MXFP4 (decoded), as ``dtype``.

    Returns
    -------
    (gate_up ``[E, 2I, H]`` rows ``[gate; up]`` (``[E, I, H]`` not gated), down ``[E, H, I]``, biases: a dict
    ``gate_up_bias [E, 2I]`` / ``down_bias [E, H]`` where the module has them, else empty), numpy.
    """
    from .experts import plan_layers  # (experts.py imports this module's readers through stacked.py)

    own = {n: t for n, t in ckpt.tensors.items() if n.startswith(module + ".experts.")}
    layer = plan_layers(dataclasses.replace(ckpt, tensors=own), ()).get(module)
    if layer is None:
        raise CheckpointError(f"checkpoint {ckpt.root}: no routed-expert tensors of MoE module {module!r} "
                              f"({module}.experts.*)")
    e = layer.num_experts
    gate_up = np.empty((e, (2 if layer.gated else 1) * layer.inter, layer.hidden), dtype)
    down = np.empty((e, layer.hidden, layer.inter), dtype)
    biases = {}
    if layer.bias_dtype is not None:
        biases = dict(gate_up_bias=np.empty(gate_up.shape[:2], layer.bias_dtype),
                      down_bias=np.empty(down.shape[:2], layer.bias_dtype))
    for n in range(e):
        for name, out, ws in (("gate_up", gate_up, layer.gemm1(n)), ("down", down, layer.weights(n, "down"))):
            out[n] = _load_rows(reader, ws, dtype)
            if biases:
                biases[f"{name}_bias"][n] = read_stacked_bias(reader, ws[0], layer.bias_dtype)
    return gate_up, down, biases
