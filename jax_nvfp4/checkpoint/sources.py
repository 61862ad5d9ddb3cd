"""Source expert weights to NVFP4: read, FP8-dequantized, checked finite, quantized.

bfloat16, float16 and float32 weights reach the quantizer as stored. FP8 (float8_e4m3fn) weights
are dequantized as ``fp32(w) * scale`` and rounded to bfloat16 first (spec section 4), so an FP8
checkpoint quantizes exactly as its bf16 dequantization would; MXFP4 (gpt-oss) likewise. Stacked
experts (:mod:`.stacked`) are transposed and their gate rows put first on the way.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from ..formats import BLOCK
from ..quantize import RECIPES, quantize
from .experts import FP8, MXFP4, ExpertWeight
from .safetensors_io import CheckpointError, TensorReader
from .stacked import read_stacked_bias, read_stacked_rows


def check_recipe(recipe: str) -> None:
    """Raise ValueError unless ``recipe`` is one of :data:`jax_nvfp4.RECIPES`."""
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")


def quantized_parts(rows: int, k: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """safetensors dtype and shape of each part of a quantized ``[rows, k]`` weight, in the order
    :func:`quantize_weights` returns them: ``{"data" | "scales" | "global_scale": (dtype, shape)}``."""
    return {"data": ("U8", (rows, k // 2)), "scales": ("F8_E4M3", (rows, k // BLOCK)), "global_scale": ("F32", ())}


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
        if w.info.dtype == FP8:
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
    (data uint8 ``[N, K/2]``, scales float8_e4m3fn ``[N, K/16]``, global_scale float32 ``[]``) as numpy.
    """
    x = _load_rows(reader, weights, dtype)
    data, scales, gs, finite = _quantize_tensor(x, recipe)
    if not bool(finite):  # name the culprit on the host only when the jitted check fails
        _check_finite(x, weights)
    del x
    return np.asarray(data), np.asarray(scales), np.asarray(gs)


def expert_outputs(reader: TensorReader, weights: Sequence[ExpertWeight], dtype, recipe: str, bias_dtype=None):
    """:func:`quantize_weights` of ``weights``, then, with ``bias_dtype``, their bias ``[N]`` as that dtype (a
    stacked-expert weight's, gate entries first)."""
    parts = quantize_weights(reader, weights, dtype, recipe)
    if bias_dtype is None:
        return parts
    w = weights[0]
    b = read_stacked_bias(reader, w, bias_dtype)
    if not np.isfinite(b.astype(np.float32)).all():
        raise CheckpointError(f"tensor {w.bias.name!r} (expert {w.expert}): non-finite bias values")
    return parts + (b,)


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
