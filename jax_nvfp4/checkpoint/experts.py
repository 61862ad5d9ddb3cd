"""The routed experts of a source checkpoint: found by name, grouped per MoE module, validated.

:func:`plan_layers` finds every MoE module, decides which are ignored (kept in source precision)
and checks the others completely (partners, shapes, dtypes, FP8 scales) before any output is
written, so that a bad checkpoint fails fast and leaves nothing behind.

Source dtypes: bfloat16, float16, float32 are quantized as they are; float8_e4m3fn needs a scale
``weight_scale_inv`` (or ``weight_scale``) next to the weight, either per tensor (one element) or
per 128x128 block (``[ceil(out/128), ceil(in/128)]``; the block size is read from
``config.json``'s ``quantization_config.weight_block_size`` when present). NVFP4 weights as NVIDIA
ModelOpt exports them (uint8 E2M1 codes ``[out, in/2]``, even element in the low nibble, with float8_e4m3fn
``weight_scale [out, in/16]`` and a float32 global decode scale ``weight_scale_2``), or as compressed-tensors
(llm-compressor) writes them (``weight_packed``, ``weight_scale``, and ``weight_global_scale``: the global *encode*
scale, whose reciprocal decodes) are taken as stored, not quantized again (:mod:`.sources`). Experts stacked in one
tensor per projection (gpt-oss, Llama 4) are found by :mod:`.stacked`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import warnings
from collections.abc import Sequence
from pathlib import Path

import ml_dtypes
import numpy as np

from ..formats import BLOCK
from .naming import matches_ignore, parse_expert_name, strip_model
from .safetensors_io import NP_DTYPES, Checkpoint, CheckpointError, TensorInfo, dtype_name

DEFAULT_FP8_BLOCK = (128, 128)
FP8 = "F8_E4M3"  # dequantized with its scale, rounded to bf16, then quantized
MXFP4 = "U8"  # gpt-oss: E2M1 codes in [N, K/32, 16] blocks with E8M0 scales [N, K/32]; dequantized to bf16
NVFP4 = "NVFP4"  # a module's source kind for NVFP4 weights (U8 codes, E4M3 block and F32 global scales)
_QUANTIZABLE = ("BF16", "F16", "F32")  # quantized as stored
_SCALE_DTYPES = ("F32", "BF16", "F16")


@dataclasses.dataclass
class ExpertWeight:
    """One source projection (gate, up or down) of one expert."""

    info: TensorInfo
    scale: TensorInfo | None = None  # FP8 dequantization scale, MXFP4's E8M0 scales, or NVFP4's E4M3 block scales
    input_scale: TensorInfo | None = None  # FP8 (dropped) or NVFP4 static activation scale
    block: tuple[int, int] | None = None  # FP8 scale block (rows, cols); None: one scale per tensor
    # Experts stacked in one source tensor (gpt-oss, Llama 4): info, scale and bias are this expert's slices.
    expert: int | None = None
    transposed: bool = False  # the source holds [K, N] (used as x @ w): its columns are our rows
    interleaved: bool = False  # fused GEMM1 rows alternate gate, up (gpt-oss); else [gate; up] halves
    bias: TensorInfo | None = None  # the expert's bias [N] (kept unquantized)
    global_scale: TensorInfo | None = None  # NVFP4 weights: the F32 global decode scale (ModelOpt's weight_scale_2)
    encode_global: bool = False  # global_scale is the encode scale (compressed-tensors' weight_global_scale): 1 / it

    @property
    def nvfp4(self) -> bool:
        """Whether this is an NVFP4 weight (codes, block scales ``scale`` and ``global_scale``), taken as stored."""
        return self.global_scale is not None

    @property
    def kind(self) -> str:
        """The source kind: the safetensors dtype, or :data:`NVFP4`."""
        return NVFP4 if self.nvfp4 else self.info.dtype

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def label(self) -> str:
        """The name for messages: the tensor, and the expert of a stacked one."""
        return self.name if self.expert is None else f"{self.name} (expert {self.expert})"

    @property
    def shape(self) -> tuple[int, int]:
        """``(N, K)``: rows (output features) by input features, whatever the source's layout."""
        s = self.info.shape
        if self.nvfp4:  # codes packed along K: [N, K/2], or [K/2, N] stacked as x @ w (ModelOpt's bmm experts)
            return (s[1], s[0] * 2) if self.transposed else (s[0], s[1] * 2)
        if self.info.dtype == MXFP4 and len(s) == 3:
            return s[0], s[1] * s[2] * 2
        return (s[1], s[0]) if self.transposed else s

    @property
    def tensors(self) -> list[TensorInfo]:
        return [t for t in (self.info, self.scale, self.global_scale, self.input_scale, self.bias) if t is not None]

    @property
    def nbytes(self) -> int:
        """Source bytes of the weight and its scales."""
        return sum(t.nbytes for t in self.tensors)


@dataclasses.dataclass
class MoELayer:
    """An MoE module's routed experts: ``experts[e][role]`` with role gate / up / down."""

    module: str
    experts: list[dict[str, ExpertWeight]]
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
        """Dtype of the values handed to the quantizer (FP8 and MXFP4 sources are rounded to bf16 first), and the
        dtype NVFP4 sources record (bf16)."""
        if self.source_dtype in (FP8, MXFP4, NVFP4):
            return np.dtype(ml_dtypes.bfloat16)
        return NP_DTYPES[self.source_dtype]

    @property
    def source_name(self) -> str | None:
        """The source dtype as ``nvfp4_config.json`` names it (``"bfloat16"``, ``"float8_e4m3fn"``, ``"mxfp4"``,
        ``"nvfp4"``)."""
        if not self.source_dtype:
            return None
        return {MXFP4: "mxfp4", NVFP4: "nvfp4"}.get(self.source_dtype) or dtype_name(self.source_dtype)

    @property
    def bias_dtype(self):
        """Dtype of the expert biases (bfloat16 kept, others float32), or None without biases."""
        b = next((w.bias for w in self.experts[0].values() if w.bias is not None), None) if self.experts else None
        return None if b is None else np.dtype(ml_dtypes.bfloat16 if b.dtype == "BF16" else np.float32)

    def gemm1(self, e: int) -> list[ExpertWeight]:
        """The source weights stacked as GEMM1 rows: [gate, up], [up], or one fused gate_up."""
        ex = self.experts[e]
        if "gate_up" in ex:
            return [ex["gate_up"]]
        return [ex["gate"], ex["up"]] if self.gated else [ex["up"]]

    @property
    def up_global_scale(self) -> bool:
        """Whether GEMM1's gate and up come pre-quantized apart (NVFP4, each its own global scale, kept both: the
        quantized gate_up's global scale is ``[2]``, gate's then up's)."""
        return self.source_dtype == NVFP4 and self.gated and bool(self.experts) and "gate_up" not in self.experts[0]

    @functools.cached_property  # (asked for each expert's GEMMs)
    def input_scales(self) -> bool:
        """Whether the experts come pre-quantized with static activation scales, every projection its own (NVFP4
        ``input_scale``: kept as :attr:`~jax_nvfp4.NVFP4Experts.input_scales`; FP8 ones, and NVFP4 ones some
        projection lacks, are dropped)."""
        return (self.source_dtype == NVFP4 and bool(self.experts)
                and all(w.input_scale is not None for ex in self.experts for w in ex.values()))

    def weights(self, e: int, gemm: str) -> list[ExpertWeight]:
        """The source weights of expert ``e``'s ``gemm`` (``"gate_up"`` or ``"down"``), stacked along rows."""
        return self.gemm1(e) if gemm == "gate_up" else [self.experts[e]["down"]]

    def tensors(self) -> list[TensorInfo]:
        """Every source tensor of the module (weights and scales of all experts)."""
        return [t for ex in self.experts for w in ex.values() for t in w.tensors]

    def info(self) -> dict:
        """The module's entry in ``nvfp4_config.json``'s ``moe_modules``."""
        d = dict(num_experts=self.num_experts, quantized=not self.ignored, source_dtype=self.source_name)
        if not self.ignored:
            d.update(gated=self.gated, hidden_size=self.hidden, intermediate_size=self.inter,
                     quantized_dtype=self.quant_dtype.name)
            if self.fp8_scaling:
                d["fp8_scaling"] = self.fp8_scaling
            if self.bias_dtype is not None:
                d["bias_dtype"] = self.bias_dtype.name
            if self.up_global_scale:
                d["up_global_scale"] = True
            if self.input_scales:
                d["input_scales"] = True
        return d


def _find_layers(tensors: dict[str, TensorInfo]) -> dict[str, MoELayer]:
    """Group expert tensors by MoE module and expert index."""
    raw: dict[str, dict[int, dict[str, dict[str, TensorInfo]]]] = {}
    for name in tensors:
        n = parse_expert_name(name)
        if n is None:
            continue
        slot = raw.setdefault(n.module, {}).setdefault(n.expert, {}).setdefault(n.role, {})
        if n.param in slot:
            raise CheckpointError(f"tensor {name!r}: expert {n.role} {n.param} given twice "
                                  f"(also as {slot[n.param].name!r}); mixed naming conventions?")
        slot[n.param] = tensors[name]
    layers = {}
    for module, by_index in raw.items():
        experts = []
        for e in range(max(by_index) + 1):
            if e not in by_index:
                raise CheckpointError(f"MoE module {module!r}: expert {e} is missing "
                                      f"(found experts {sorted(by_index)[:8]}...; indices must be 0..E-1)")
            experts.append({role: _make_weight(params, module, e, role) for role, params in by_index[e].items()})
        layers[module] = MoELayer(module, experts)
    return layers


def weight_from_params(params: dict[str, TensorInfo]) -> ExpertWeight:
    """One projection's :class:`ExpertWeight` from its tensors by parameter name: compressed-tensors' NVFP4
    ``weight_packed`` (its ``weight_scale``, ``weight_global_scale``, ``input_global_scale``), else ``weight`` with
    ``weight_scale_inv`` or ``weight_scale``, ``input_scale`` and (NVFP4, ModelOpt) ``weight_scale_2``."""
    if "weight_packed" in params:  # (any other layout is named in _validate_layer)
        return ExpertWeight(params["weight_packed"], params.get("weight_scale"), params.get("input_global_scale"),
                            global_scale=params.get("weight_global_scale"), encode_global=True)
    scale = params.get("weight_scale_inv", params.get("weight_scale"))
    return ExpertWeight(params["weight"], scale, params.get("input_scale"), global_scale=params.get("weight_scale_2"))


def _make_weight(params: dict[str, TensorInfo], module: str, e: int, role: str) -> ExpertWeight:
    if "weight_packed" not in params and "weight" not in params:
        other = next(iter(params.values())).name
        raise CheckpointError(f"tensor {other!r} has no weight tensor next to it ({module}, expert {e}, {role})")
    if "weight_packed" not in params and "weight_scale_inv" in params and "weight_scale" in params:
        raise CheckpointError(f"tensor {params['weight'].name!r} has both weight_scale_inv and weight_scale")
    return weight_from_params(params)


def _layer_ignored(layer: MoELayer, ignore: Sequence[str]) -> bool:
    """All-or-nothing per MoE module: the experts of a module share one stacked weight."""
    names = [t.name for t in layer.tensors()]
    hits = [any(matches_ignore(n, p) for p in ignore) for n in names]
    if any(hits) and not all(hits):
        kept = names[hits.index(False)]
        raise CheckpointError(
            f"the ignore patterns select only part of MoE module {layer.module!r} (e.g. not {kept!r}); "
            f"ignore whole MoE modules (e.g. {strip_model(layer.module)!r})")
    return all(hits)


def _validate_layer(layer: MoELayer, fp8_block: tuple[int, int]) -> None:
    """Check partners, shapes, dtypes and FP8 scales; fills gated/hidden/inter/source_dtype."""
    layer.gated = any("gate" in ex for ex in layer.experts)
    for e, ex in enumerate(layer.experts):
        present = next(iter(ex.values())).name
        for role in ("gate", "up", "down") if layer.gated else ("up", "down"):
            if role not in ex:
                raise CheckpointError(f"tensor {present!r}: its {role} partner is missing "
                                      f"(MoE module {layer.module!r}, expert {e})")
    first = layer.experts[0]["up"]  # defines I, H and the dtype every expert must share
    if len(first.info.shape) != 2:
        raise CheckpointError(f"tensor {first.name!r}: expected a 2-D weight, got shape {list(first.info.shape)}")
    layer.inter, layer.hidden = first.shape
    layer.source_dtype = first.kind
    want = {"gate": (layer.inter, layer.hidden), "up": (layer.inter, layer.hidden), "down": (layer.hidden, layer.inter)}
    for e, ex in enumerate(layer.experts):
        for role, w in ex.items():
            t = w.info
            if w.kind not in _QUANTIZABLE + (FP8, NVFP4):
                raise CheckpointError(f"tensor {t.name!r}: unsupported dtype {t.dtype} for an expert weight "
                                      f"(supported: {', '.join(_QUANTIZABLE + (FP8,))}, and U8 NVFP4 codes with "
                                      "weight_scale and weight_scale_2, or weight_packed with weight_scale and "
                                      "weight_global_scale)")
            if w.kind != layer.source_dtype:
                raise CheckpointError(f"tensor {t.name!r}: dtype {w.kind} differs from {layer.source_dtype} "
                                      f"of {first.name!r} (one dtype per MoE module)")
            if len(t.shape) != 2 or w.shape != want[role]:
                packed = " (NVFP4: [N, K/2] bytes)" if w.nvfp4 else ""
                raise CheckpointError(
                    f"tensor {t.name!r}: shape {list(t.shape)}{packed} differs from {list(want[role])} expected from "
                    f"{first.name!r} (experts of MoE module {layer.module!r} must have equal shapes, "
                    "gate/up [I, H], down [H, I])")
            if w.shape[1] % BLOCK:
                raise CheckpointError(f"tensor {t.name!r}: in-dim K={w.shape[1]} (shape {list(t.shape)}) "
                                      f"is not a multiple of {BLOCK}")
            scaling = _validate_scale(w, fp8_block)
            if scaling:
                layer.fp8_scaling = scaling


def _validate_scale(w: ExpertWeight, fp8_block: tuple[int, int]) -> str | None:
    """FP8 weights need a per-tensor or block scale, NVFP4 ones block and global scales; others must not have one.
    Returns the FP8 scaling."""
    t, s = w.info, w.scale
    if w.nvfp4:
        validate_nvfp4_scales(w)
        return None
    if t.dtype != FP8:
        if s is not None:
            raise CheckpointError(f"tensor {s.name!r}: a dequantization scale for a {t.dtype} weight "
                                  f"({t.name!r}); only {FP8} weights are scaled")
        return None
    if s is None:
        raise CheckpointError(f"tensor {t.name!r}: {FP8} weight without its scale "
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


def validate_nvfp4_scales(w: ExpertWeight) -> None:
    """An NVFP4 weight's codes are U8 with float8_e4m3fn block scales [N, K/16] and one F32 global scale."""
    t, s, g = w.info, w.scale, w.global_scale
    if t.dtype != "U8":
        raise CheckpointError(f"tensor {t.name!r}: dtype {t.dtype} next to {g.name!r}; NVFP4 codes are U8")
    n, k = w.shape
    want = (k // BLOCK, n) if w.transposed else (n, k // BLOCK)
    if s is None or s.dtype != FP8 or tuple(s.shape) != want:
        got = "missing" if s is None else f"{s.dtype} {list(s.shape)}"
        raise CheckpointError(f"tensor {t.name!r}: NVFP4 block scales (weight_scale) {got}, expected {FP8} "
                              f"{list(want)} (linear layout)")
    if g.dtype != "F32" or math.prod(g.shape) != 1:
        raise CheckpointError(f"tensor {g.name!r}: {g.dtype} {list(g.shape)}, expected one F32 global decode scale")


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


def plan_layers(ckpt: Checkpoint, ignore: Sequence[str]) -> dict[str, MoELayer]:
    """Find, classify (ignored or not) and validate every MoE module; raises before any output."""
    from .stacked import find_stacked_layers  # (stacked.py builds this module's classes)

    layers = _find_layers(ckpt.tensors)
    stacked = find_stacked_layers(ckpt.tensors, ckpt.root)  # validated as found
    for module in stacked.keys() & layers.keys():
        raise CheckpointError(f"MoE module {module!r} holds both per-expert tensors ({module}.experts.N.*) and "
                              f"stacked ones ({module}.experts.gate_up_proj*)")
    block = _fp8_block_size(ckpt.root)
    for layer in layers.values():
        layer.ignored = _layer_ignored(layer, ignore)
        if layer.ignored:
            layer.source_dtype = layer.experts[0].get("up", next(iter(layer.experts[0].values()))).info.dtype
        else:
            _validate_layer(layer, block)
    for layer in stacked.values():
        layer.ignored = _layer_ignored(layer, ignore)
    layers.update(stacked)
    for p in ignore:
        if not any(matches_ignore(t.name, p) for ly in layers.values() if ly.ignored for t in ly.tensors()):
            # stacklevel: the caller of convert_checkpoint / quantize_checkpoint_experts
            warnings.warn(f"ignore pattern {p!r} matches no routed-expert tensor", stacklevel=3)
    return layers
