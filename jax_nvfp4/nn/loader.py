"""Loading Hugging Face safetensors checkpoints (bf16, NVFP4 from the converter, or NVFP4 from NVIDIA ModelOpt) into
the decoders of :mod:`jax_nvfp4.nn`: :func:`load_qwen3_moe` and :func:`load_gpt_oss`.

The model is built abstractly (``nnx.eval_shape``: no random weights are drawn) and filled tensor by
tensor. NVFP4 experts come from :func:`jax_nvfp4.load_nvfp4_experts` (a converted checkpoint) or
:func:`jax_nvfp4.quantize_checkpoint_experts` (a source checkpoint quantized while loading, one expert
tensor at a time); either way no bf16 expert stack is ever materialised. Unquantized experts (a source
checkpoint, or modules the converter's ignore list kept) are stacked on the host one MoE module at a time, from
per-expert tensors (Qwen3) or stacked ones (gpt-oss: bf16, or MXFP4 decoded), FP8 ones dequantized.

A pre-quantized NVFP4 checkpoint (ModelOpt's ``weight`` U8 with ``weight_scale`` and ``weight_scale_2``, or
compressed-tensors' ``weight_packed`` with ``weight_scale`` and ``weight_global_scale``) keeps its experts' bytes as
stored; its other NVFP4 linear layers (attention, dense MLPs: the model runs them in bf16) are dequantized,
``bf16(e2m1 * block scale * global decode scale)``. The experts' static activation scales load as
:attr:`~jax_nvfp4.NVFP4Experts.input_scales` (mode w4a4 quantizes on them); the other layers' go unused.

Name mapping (``L`` layer, ``N`` expert; kernels are stored transposed, ``[in, out]``)::

    model.embed_tokens.weight                      model.embed_tokens.embedding
    model.layers.L.self_attn.{q,k,v,o}_proj.weight model.layers.L.self_attn.{q,k,v,o}_proj.kernel (T)
    model.layers.L.self_attn.{q,k,v,o}_proj.bias   same (gpt-oss)
    model.layers.L.self_attn.{q,k}_norm.weight     same (Qwen3)
    model.layers.L.self_attn.sinks                 same (gpt-oss)
    model.layers.L.{input,post_attention}_layernorm.weight  same
    model.layers.L.mlp.gate.weight                 model.layers.L.mlp.router.kernel (T; Qwen3)
    model.layers.L.mlp.router.{weight,bias}        model.layers.L.mlp.router.kernel (T), .router_bias (gpt-oss)
    model.layers.L.mlp.experts.N.{gate,up}_proj    model.layers.L.mlp.experts.gate_up [E, 2I, H] ([gate; up])
    model.layers.L.mlp.experts.N.down_proj         model.layers.L.mlp.experts.down [E, H, I]
    model.layers.L.mlp.experts.gate_up_proj[_bias] model.layers.L.mlp.experts.gate_up (de-interleaved), biases
    model.layers.L.mlp.experts.down_proj[_bias]    model.layers.L.mlp.experts.down, biases (gpt-oss)
    model.norm.weight                              model.norm.weight
    lm_head.weight                                 lm_head.kernel (T; absent with tied embeddings)
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..checkpoint import (CONFIG_NAME, CheckpointError, load_nvfp4_experts, open_checkpoint,
                          quantize_checkpoint_experts)
from ..checkpoint.load import load_stored_nvfp4, stored_nvfp4_layers
from ..checkpoint.safetensors_io import TensorReader, checkpoint_folder
from ..checkpoint.sources import dequantize_nvfp4, nvfp4_weight, read_source_experts
from .gpt_oss import GptOssConfig, GptOssForCausalLM
from .moe import BF16ExpertWeights, check_choice
from .quantization import QUANTIZED_MODES, WEIGHT_ORDERS, _load_experts, moe_modules
from .qwen3_moe import BF16, Qwen3MoeConfig, Qwen3MoeForCausalLM

_DENSE_DTYPES = ("BF16", "F16", "F32")
# Our module names that Hugging Face names otherwise, by model (the rest are the same).
_RENAMES = {"qwen3_moe": {"router": "gate"}, "gpt_oss": {"router_bias": "router.bias"}}


def _hf_name(path: tuple, renames: dict) -> tuple[str, bool]:
    """(Hugging Face tensor name, whether the array is stored transposed) of a dense parameter."""
    *mod, leaf = (renames.get(str(p), str(p)) for p in path)
    if leaf == "kernel":
        return ".".join(mod + ["weight"]), True
    if leaf == "embedding":
        return ".".join(mod + ["weight"]), False
    return ".".join(mod + [leaf]), False  # weight, bias, sinks, router.bias


def _read_dense(ckpt, reader, name: str, shape: tuple, transpose: bool, dtype) -> tuple[jax.Array, list[str]]:
    """A dense parameter (an NVFP4 one dequantized) and the names of the tensors it was read from."""
    nvfp4 = nvfp4_weight(ckpt.tensors, name)
    info = ckpt.tensors.get(name) if nvfp4 is None else nvfp4.info  # (compressed-tensors: P.weight_packed)
    if info is None:
        raise CheckpointError(f"checkpoint {ckpt.root}: tensor {name!r} is missing")
    want = tuple(shape[::-1]) if transpose else tuple(shape)
    got = nvfp4.shape if nvfp4 is not None else tuple(info.shape)
    if got != want:
        raise CheckpointError(f"tensor {info.name!r}: shape {list(info.shape)}{' (NVFP4 codes)' if nvfp4 else ''}, "
                              f"expected {list(want)} from config.json")
    if nvfp4 is not None:
        a, names = dequantize_nvfp4(reader, nvfp4, np.float32), [t.name for t in nvfp4.tensors]
    elif info.dtype in _DENSE_DTYPES:
        a, names = reader.read(info), [name]
    else:
        raise CheckpointError(f"tensor {name!r}: dtype {info.dtype} is not supported for dense weights "
                              f"(supported: {', '.join(_DENSE_DTYPES)}, and NVFP4 with weight_scale and "
                              "weight_scale_2)")
    return jnp.asarray(a.T if transpose else a).astype(dtype), names


def _source_experts(ckpt, reader, module: str, block, dtype) -> BF16ExpertWeights:
    """A module's source experts as the block's bf16 weights (stacked on the host)."""
    gate_up, down, biases = read_source_experts(ckpt, reader, module, jnp.dtype(dtype))
    want = (block.num_experts, block.hidden_size, block.intermediate_size)
    got = (gate_up.shape[0], down.shape[1], down.shape[2])
    has_bias = block.experts.has_bias
    if got != want or bool(biases) != has_bias:
        raise CheckpointError(f"MoE module {module!r}: source experts (E, H, I) = {got}"
                              f"{' with biases' if biases else ''} do not fit the model's {want}"
                              f"{' with biases' if has_bias else ''} from config.json")
    return BF16ExpertWeights(jnp.asarray(gate_up), jnp.asarray(down), gated=block.experts.gated,
                             **{k: jnp.asarray(v) for k, v in biases.items()})


def _load(model_type: str, make_model, path, *, quantize: bool, ignore, recipe: str, mode: str, order: str,
          param_dtype, progress: bool):
    """Build ``make_model(root)`` abstractly and fill it from the checkpoint folder ``path`` (see
    :func:`load_qwen3_moe`)."""
    check_choice(mode, QUANTIZED_MODES, "mode")
    check_choice(order, WEIGHT_ORDERS, "order")
    root = checkpoint_folder(path)
    ckpt = open_checkpoint(root)
    converted = (root / CONFIG_NAME).is_file()
    stored = [] if converted else stored_nvfp4_layers(ckpt)  # ModelOpt's or compressed-tensors' NVFP4 experts
    if (converted or stored) and quantize:
        what = CONFIG_NAME if converted else "experts stored as NVFP4 (ModelOpt, compressed-tensors)"
        raise ValueError(f"{root} is already an NVFP4 checkpoint ({what}); load it with quantize=False")
    if not quantize and (ignore or recipe != "nvfp4"):
        raise ValueError("ignore and recipe apply only with quantize=True (a converted checkpoint was "
                         "quantized with the converter's own)")
    model = nnx.eval_shape(lambda: make_model(root))

    if converted:
        experts = load_nvfp4_experts(root)
    elif stored:
        experts = load_stored_nvfp4(ckpt, stored)
    elif quantize:
        experts = quantize_checkpoint_experts(root, ignore=ignore, recipe=recipe, progress=progress)
    else:
        experts = {}
    modules = list(experts)
    _load_experts(model, experts, mode, order, strict=True, consume=True)  # one block repacked at a time
    used = {n for n in ckpt.tensors if any(n.startswith(m + ".experts.") for m in modules)}

    with TensorReader() as reader:
        for name, block in moe_modules(model).items():
            if not block.quantized:
                block.experts = _source_experts(ckpt, reader, name, block, param_dtype)
                used.update(n for n in ckpt.tensors if n.startswith(name + ".experts."))
        for vpath, var in nnx.iter_graph(model):
            if not isinstance(var, nnx.Variable) or not isinstance(var.get_value(), jax.ShapeDtypeStruct):
                continue  # already loaded (experts)
            hf, transpose = _hf_name(vpath, _RENAMES[model_type])
            value, names = _read_dense(ckpt, reader, hf, var.shape, transpose, var.get_value().dtype)
            var.set_value(value)
            used.update(names)
    unused = sorted(set(ckpt.tensors) - used)
    kv = [n for n in unused if n.endswith((".k_scale", ".v_scale"))]  # a quantized KV cache's (ModelOpt, FP8)
    if kv:
        warnings.warn(f"{len(kv)} KV-cache scales (e.g. {kv[0]!r}) go unused: the KV cache here is bf16", stacklevel=3)
    unused = sorted(set(unused) - set(kv))
    if unused:
        warnings.warn(f"{len(unused)} checkpoint tensors were not used, e.g. {unused[:3]}", stacklevel=3)
    return model


def _loader(model_type: str, config_cls, model_cls, name: str, sources: str):
    """The public loader of one decoder: :func:`_load` with its config and model classes, and its docstring."""
    def load(path, *, quantize: bool = False, ignore: str | Sequence[str] = (), recipe: str = "nvfp4",
             mode: str = "w4a16", moe_backend: str = "auto", order: str = "auto", param_dtype=BF16,
             progress: bool = False):
        def make(root):
            cfg = config_cls.from_hf(root, moe_backend=moe_backend, param_dtype=param_dtype)
            return model_cls(cfg, rngs=nnx.Rngs(0))
        return _load(model_type, make, path, quantize=quantize, ignore=ignore, recipe=recipe, mode=mode,
                     order=order, param_dtype=param_dtype, progress=progress)

    load.__name__ = load.__qualname__ = f"load_{model_type}"
    load.__doc__ = f"""Load a {name} checkpoint folder (``config.json`` + safetensors) into
    :class:`{model_cls.__name__}`.

    Parameters
    ----------
    path : checkpoint folder: Hugging Face ({sources}), NVFP4 written by
        :func:`jax_nvfp4.convert_checkpoint` (recognized by its ``nvfp4_config.json``), or NVFP4 exported by NVIDIA
        ModelOpt or written by compressed-tensors (experts as stored, other NVFP4 layers dequantized to bf16)
    quantize : bool
        Quantize a source checkpoint's experts to NVFP4 while loading (never holding their bf16
        stack). Not for NVFP4 checkpoints.
    ignore, recipe : with ``quantize``: MoE modules kept in bf16 (converter patterns) and the recipe
    mode : ``"w4a16"`` or ``"w4a4"``: the mode of NVFP4 blocks (bf16 blocks run in ``"bf16"``)
    moe_backend : the :func:`jax_nvfp4.moe` backend of every block
    order : byte order of the NVFP4 experts (``"auto"``: the one ``moe_backend`` reads fastest;
        :func:`jax_nvfp4.nn.load_experts`)
    param_dtype : dtype of the dense and bf16 expert parameters (bfloat16)
    progress : show a progress bar while quantizing

    Returns
    -------
    {model_cls.__name__}

    Raises
    ------
    CheckpointError : a tensor is missing, has the wrong shape or an unsupported dtype (e.g. FP8 dense
        weights), or NVFP4 scales are malformed or NaN over nonzero codes, naming it.
    FileNotFoundError : ``path`` does not exist.
    """
    return load


load_qwen3_moe = _loader("qwen3_moe", Qwen3MoeConfig, Qwen3MoeForCausalLM, "Qwen3-MoE", "bf16/fp16/fp32")
load_gpt_oss = _loader("gpt_oss", GptOssConfig, GptOssForCausalLM, "gpt-oss",
                       "the MXFP4 release, or bf16/fp16/fp32")
