"""Loading NVFP4 experts into JAX: from a converted checkpoint, a pre-quantized one (NVIDIA ModelOpt,
compressed-tensors: bytes as stored), or quantized from a source one."""

from __future__ import annotations

import json
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from ..formats import NVFP4Experts
from .experts import NVFP4, plan_layers
from .naming import CONFIG_NAME, FORMAT_NAME, GEMMS, READABLE_VERSIONS, ignore_patterns, output_names
from .safetensors_io import (NP_DTYPES, ST_DTYPES, Checkpoint, CheckpointError, TensorReader, checkpoint_folder,
                             open_checkpoint)
from .sources import check_recipe, expert_outputs, quantized_parts, source_progress

_DTYPE_BY_NAME = {dt.name: dt for dt in NP_DTYPES.values()}  # "bfloat16" -> dtype


class _Stack:
    """Host buffers for one MoE module's stacked NVFP4 experts, filled expert by expert.

    ``parts[gemm][part]`` (gemm ``"gate_up"`` or ``"down"``): ``"data"`` ``[E, rows, K/2]``,
    ``"scales"`` ``[E, rows, K/16]``, ``"global_scale"`` ``[E]`` (``up_scale``: gate_up's ``[E, 2]``, gate's and
    up's), with ``bias_dtype`` ``"bias"`` ``[E, rows]``, and with ``input_scale`` ``"input_scale"`` shaped as
    ``"global_scale"``.
    """

    def __init__(self, num_experts: int, gated: bool, hidden: int, inter: int, bias_dtype=None,
                 up_scale: bool = False, input_scale: bool = False):
        def buffers(rows, k, up_scale=False):
            return {part: np.empty((num_experts, *shape), NP_DTYPES[dtype]) for part, (dtype, shape)
                    in quantized_parts(rows, k, up_scale, bias_dtype, input_scale).items()}
        self.parts = {"gate_up": buffers((2 if gated else 1) * inter, hidden, up_scale),
                      "down": buffers(hidden, inter)}

    def experts(self, gated: bool, dtype) -> NVFP4Experts:
        quantized = {gemm: [self.parts[gemm][p] for p in ("data", "scales", "global_scale")] for gemm in GEMMS}
        up = None
        g = quantized["gate_up"][2]
        if g.ndim == 2:  # gate's and up's: the up rows keep their own only where some differ
            quantized["gate_up"][2], up = g[:, 0], (None if np.array_equal(g[:, 0], g[:, 1]) else g[:, 1])
        biases = {f"{gemm}_bias": jnp.asarray(self.parts[gemm]["bias"]) for gemm in GEMMS if "bias" in self.parts[gemm]}
        inputs = None
        if "input_scale" in self.parts["down"]:
            # One scale a GEMM for every expert, the module's largest (gate and up alike), as vLLM's and SGLang's
            # FlashInfer backends take ModelOpt's: every shard of the experts then quantizes as the whole layer.
            layer = [self.parts[gemm]["input_scale"].max() for gemm in GEMMS]
            inputs = np.broadcast_to(np.array(layer, np.float32), (len(g), 2))
        return NVFP4Experts.from_parts(*quantized["gate_up"], *quantized["down"], gated=gated, dtype=dtype,
                                       up_global_scale=up, input_scales=inputs, **biases)


def quantize_checkpoint_experts(src, *, ignore: Sequence[str] = (), recipe: str = "nvfp4",
                                progress: bool = False) -> dict[str, NVFP4Experts]:
    """Quantize a source checkpoint's routed experts while loading them (nothing is written).

    Streams one expert tensor at a time: host memory holds the quantized experts plus one source
    expert tensor. NVFP4 experts (ModelOpt, compressed-tensors) are taken as stored. Same rules and errors as
    :func:`convert_checkpoint`; the result equals
    ``load_nvfp4_experts(convert_checkpoint(src, dst, ...).dst)``.

    Returns
    -------
    dict mapping MoE module name (e.g. ``"model.layers.0.mlp"``) to NVFP4Experts with gate_up
    ``[E, 2I, H]`` (or ``[E, I, H]`` not gated) and down ``[E, H, I]``, global scales ``[E]`` (and
    ``up_global_scale [E]`` where a pre-quantized source's gate and up scales differ; ``input_scales [E, 2]`` where it
    has static activation scales, as :func:`load_nvfp4_experts`), and the
    source's expert biases when it has them (gpt-oss: ``gate_up_bias [E, 2I]``, ``down_bias [E, H]``,
    bfloat16 as stored or float32). Ignored modules are absent.
    """
    check_recipe(recipe)
    ignore = ignore_patterns(ignore)
    ckpt = open_checkpoint(src)
    return _stacked_experts(ckpt, [ly for ly in plan_layers(ckpt, ignore).values() if not ly.ignored], recipe,
                            progress)


def stored_nvfp4_layers(ckpt: Checkpoint) -> list:
    """The MoE modules whose experts a checkpoint stores as NVFP4 (ModelOpt, compressed-tensors), validated."""
    return [ly for ly in plan_layers(ckpt, ()).values() if ly.source_dtype == NVFP4]


def load_stored_nvfp4(ckpt: Checkpoint, layers, progress: bool = False) -> dict[str, NVFP4Experts]:
    """The experts of ``layers`` (from :func:`stored_nvfp4_layers`) stacked per module, their bytes as stored."""
    return _stacked_experts(ckpt, layers, "nvfp4", progress)


def _stacked_experts(ckpt: Checkpoint, layers, recipe: str, progress: bool) -> dict[str, NVFP4Experts]:
    """The experts of ``layers`` stacked per module: quantized, or NVFP4 ones as stored."""
    total = sum(t.nbytes for ly in layers for t in ly.tensors())
    out = {}
    with TensorReader() as reader, source_progress(total, "nvfp4 quantize", progress) as bar:
        for ly in layers:
            stack = _Stack(ly.num_experts, ly.gated, ly.hidden, ly.inter, ly.bias_dtype, ly.up_global_scale,
                           ly.input_scales)
            for e in range(ly.num_experts):
                for gemm in GEMMS:
                    ws = ly.weights(e, gemm)
                    parts = expert_outputs(reader, ws, ly.quant_dtype, recipe, ly.bias_dtype, ly.input_scales)
                    for buf, part in zip(stack.parts[gemm].values(), parts, strict=True):
                        buf[e] = part
                    bar.update(sum(w.nbytes for w in ws))
            out[ly.module] = stack.experts(ly.gated, ly.quant_dtype)
    return out


def read_nvfp4_config(path) -> dict:
    """The ``nvfp4_config.json`` of an NVFP4 checkpoint folder (or of the folder of a file in it)."""
    root = checkpoint_folder(path)
    cfg_path = root / CONFIG_NAME
    if not cfg_path.is_file():
        raise CheckpointError(f"{root} is not an NVFP4 checkpoint written by jax_nvfp4 (no {CONFIG_NAME}); "
                              "to quantize a source checkpoint while loading, pass quantize_source=True")
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("format") != FORMAT_NAME or cfg.get("format_version") not in READABLE_VERSIONS:
        raise CheckpointError(f"{cfg_path}: format {cfg.get('format')!r} version {cfg.get('format_version')!r} "
                              f"is not {FORMAT_NAME!r} version {' or '.join(map(str, READABLE_VERSIONS))}"
                              f"{' (written by a newer jax_nvfp4?)' if cfg.get('format') == FORMAT_NAME else ''}")
    return cfg


def load_nvfp4_experts(path, *, quantize_source: bool = False, ignore: Sequence[str] = (), recipe: str = "nvfp4",
                       progress: bool = False) -> dict[str, NVFP4Experts]:
    """Load the NVFP4 experts of a checkpoint, stacked per MoE module.

    Parameters
    ----------
    path : an NVFP4 checkpoint (folder or one of its files) written by :func:`convert_checkpoint`, by NVIDIA
        ModelOpt (its experts' ``weight`` / ``weight_scale`` / ``weight_scale_2`` taken as stored; gate's and
        up's global scales both kept, see :func:`~jax_nvfp4.checkpoint.sources.nvfp4_parts`) or by compressed-tensors
        (``weight_packed`` / ``weight_scale`` / ``weight_global_scale``, its reciprocal the decode scale), or, with
        ``quantize_source=True``, a source (bf16 / fp16 / fp32 / FP8) checkpoint.
    quantize_source : quantize the source's experts while loading (:func:`quantize_checkpoint_experts`);
        ``ignore``, ``recipe`` and ``progress`` apply only then.

    Returns
    -------
    dict mapping MoE module name (e.g. ``"model.layers.0.mlp"``) to NVFP4Experts: gate_up data uint8
    ``[E, 2I, H/2]`` (rows [gate; up]; ``[E, I, H/2]`` not gated), scales float8_e4m3fn
    ``[E, 2I, H/16]``, global_scale float32 ``[E]`` (and ``up_global_scale [E]`` where a pre-quantized checkpoint's
    gate and up scales differ); down ``[E, H, I/2]`` / ``[E, H, I/16]`` / ``[E]``;
    expert biases ``gate_up_bias [E, 2I]`` / ``down_bias [E, H]`` where the checkpoint has them; static activation
    scales ``input_scales [E, 2]`` where a pre-quantized checkpoint gives every projection one (ModelOpt's
    ``input_scale``): every expert gets the module's largest for GEMM1 (over gate and up) and for GEMM2, as vLLM's and
    SGLang's FlashInfer backends use them (mode ``w4a4`` then quantizes on them).
    Modules kept in source precision (ignored) are absent.
    """
    if quantize_source:
        return quantize_checkpoint_experts(path, ignore=ignore, recipe=recipe, progress=progress)
    root = checkpoint_folder(path)
    if not (root / CONFIG_NAME).is_file():
        ckpt = open_checkpoint(root)
        stored = stored_nvfp4_layers(ckpt)
        if stored:
            return load_stored_nvfp4(ckpt, stored, progress)
    cfg = read_nvfp4_config(path)  # (raises: neither format)
    ckpt = open_checkpoint(root)  # all shards, whichever file was named
    out = {}
    with TensorReader() as reader:
        for module, m in cfg["moe_modules"].items():
            if not m["quantized"]:
                continue
            gated, n, bias_dtype = m["gated"], m["num_experts"], m.get("bias_dtype")
            bias_dtype = None if bias_dtype is None else _DTYPE_BY_NAME[bias_dtype]
            inputs = m.get("input_scales", False)
            stack = _Stack(n, gated, m["hidden_size"], m["intermediate_size"], bias_dtype,
                           m.get("up_global_scale", False), inputs)
            for e in range(n):
                names = output_names(module, e, gated, bias=bias_dtype is not None, input_scale=inputs)
                for gemm in GEMMS:
                    for part, buf in stack.parts[gemm].items():
                        # buf[e, ...] is a view also for the 1-D global scales (buf[e] would be a copy)
                        _read_expected(ckpt, reader, names[gemm][part], buf[e, ...])
            out[module] = stack.experts(gated, _DTYPE_BY_NAME[m["quantized_dtype"]])
    return out


def _read_expected(ckpt: Checkpoint, reader: TensorReader, name: str, out: np.ndarray) -> None:
    info = ckpt.tensors.get(name)
    if info is None:
        raise CheckpointError(f"NVFP4 checkpoint {ckpt.root}: tensor {name!r} is missing")
    if NP_DTYPES.get(info.dtype) != out.dtype or info.shape != out.shape:
        raise CheckpointError(f"tensor {name!r}: {info.dtype} {list(info.shape)}, expected "
                              f"{ST_DTYPES[out.dtype]} {list(out.shape)}")
    reader.read_into(info, out)
