"""Loading a Hugging Face Qwen3-MoE safetensors checkpoint (bf16, or NVFP4 from the converter).

The model is built abstractly (``nnx.eval_shape``: no random weights are drawn) and filled tensor by
tensor. NVFP4 experts come from :func:`jax_nvfp4.load_nvfp4_experts` (a converted checkpoint) or
:func:`jax_nvfp4.quantize_checkpoint_experts` (a bf16 checkpoint quantized while loading, one expert
tensor at a time); either way no bf16 expert stack is ever materialised. bf16 experts (a bf16
checkpoint, or modules the converter's ignore list kept) are stacked on the host one MoE module at
a time.

Name mapping (``L`` layer, ``N`` expert; kernels are stored transposed, ``[in, out]``)::

    model.embed_tokens.weight                      model.embed_tokens.embedding
    model.layers.L.self_attn.{q,k,v,o}_proj.weight model.layers.L.self_attn.{q,k,v,o}_proj.kernel (T)
    model.layers.L.self_attn.{q,k}_norm.weight     same
    model.layers.L.{input,post_attention}_layernorm.weight  same
    model.layers.L.mlp.gate.weight                 model.layers.L.mlp.router.kernel (T)
    model.layers.L.mlp.experts.N.{gate,up}_proj    model.layers.L.mlp.experts.gate_up [E, 2I, H] ([gate; up])
    model.layers.L.mlp.experts.N.down_proj         model.layers.L.mlp.experts.down [E, H, I]
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
from ..checkpoint.safetensors_io import NP_DTYPES, TensorReader, checkpoint_folder
from .moe import BF16ExpertWeights, MoE, check_choice
from .quantization import QUANTIZED_MODES, WEIGHT_ORDERS, _load_experts, moe_modules
from .qwen3_moe import BF16, Qwen3MoeConfig, Qwen3MoeForCausalLM

_DENSE_DTYPES = ("BF16", "F16", "F32")


def _hf_name(path: tuple) -> tuple[str, bool]:
    """(Hugging Face tensor name, whether the array is stored transposed) of a dense parameter."""
    *mod, leaf = (str(p) for p in path)
    mod = ["gate" if m == "router" else m for m in mod]
    if leaf == "kernel":
        return ".".join(mod + ["weight"]), True
    if leaf in ("embedding", "weight"):
        return ".".join(mod + ["weight"]), False
    raise CheckpointError(f"no Hugging Face name for parameter {'.'.join(map(str, path))}")


def _read_dense(ckpt, reader, name: str, shape: tuple, transpose: bool, dtype) -> jax.Array:
    info = ckpt.tensors.get(name)
    if info is None:
        raise CheckpointError(f"checkpoint {ckpt.root}: tensor {name!r} is missing")
    want = tuple(shape[::-1]) if transpose else tuple(shape)
    if tuple(info.shape) != want:
        raise CheckpointError(f"tensor {name!r}: shape {list(info.shape)}, expected {list(want)} from config.json")
    if info.dtype not in _DENSE_DTYPES:
        raise CheckpointError(f"tensor {name!r}: dtype {info.dtype} is not supported for dense weights "
                              f"(supported: {', '.join(_DENSE_DTYPES)})")
    a = reader.read(info)
    return jnp.asarray(a.T if transpose else a).astype(dtype)


def _stack_bf16_experts(ckpt, reader, module: str, block: MoE, dtype) -> BF16ExpertWeights:
    """Stack a module's per-expert gate/up/down tensors into ``[E, 2I, H]`` and ``[E, H, I]`` on the host."""
    e, h, i = block.num_experts, block.hidden_size, block.intermediate_size
    first = ckpt.tensors.get(f"{module}.experts.0.gate_proj.weight")
    if first is None:
        raise CheckpointError(f"checkpoint {ckpt.root}: tensor {module}.experts.0.gate_proj.weight is missing")
    if first.dtype not in _DENSE_DTYPES:
        raise CheckpointError(f"tensor {first.name!r}: dtype {first.dtype} cannot be loaded as bf16 experts "
                              "(convert FP8 checkpoints with jax_nvfp4.convert_checkpoint, or load with "
                              "quantize=True)")
    npdt = NP_DTYPES[first.dtype]
    gate_up = np.empty((e, 2 * i, h), npdt)
    down = np.empty((e, h, i), npdt)
    for n in range(e):
        for proj, out in (("gate_proj", gate_up[n, :i]), ("up_proj", gate_up[n, i:]), ("down_proj", down[n])):
            name = f"{module}.experts.{n}.{proj}.weight"
            info = ckpt.tensors.get(name)
            if info is None:
                raise CheckpointError(f"checkpoint {ckpt.root}: tensor {name!r} is missing")
            if tuple(info.shape) != out.shape or info.dtype != first.dtype:
                raise CheckpointError(f"tensor {name!r}: {info.dtype} {list(info.shape)}, expected "
                                      f"{first.dtype} {list(out.shape)}")
            reader.read_into(info, out)
    return BF16ExpertWeights(jnp.asarray(gate_up).astype(dtype), jnp.asarray(down).astype(dtype))


def load_qwen3_moe(path, *, quantize: bool = False, ignore: str | Sequence[str] = (), recipe: str = "nvfp4",
                   mode: str = "w4a16", moe_backend: str = "auto", order: str = "auto", param_dtype=BF16,
                   progress: bool = False) -> Qwen3MoeForCausalLM:
    """Load a Qwen3-MoE checkpoint folder (``config.json`` + safetensors) into :class:`Qwen3MoeForCausalLM`.

    Parameters
    ----------
    path : checkpoint folder: Hugging Face bf16/fp16/fp32, or NVFP4 written by
        :func:`jax_nvfp4.convert_checkpoint` (recognized by its ``nvfp4_config.json``)
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
    Qwen3MoeForCausalLM

    Raises
    ------
    CheckpointError : a tensor is missing, has the wrong shape or an unsupported dtype (e.g. FP8 dense
        weights), naming it.
    FileNotFoundError : ``path`` does not exist.
    """
    check_choice(mode, QUANTIZED_MODES, "mode")
    check_choice(order, WEIGHT_ORDERS, "order")
    root = checkpoint_folder(path)
    nvfp4 = (root / CONFIG_NAME).is_file()
    if nvfp4 and quantize:
        raise ValueError(f"{root} is already an NVFP4 checkpoint ({CONFIG_NAME}); load it with quantize=False")
    if not quantize and (ignore or recipe != "nvfp4"):
        raise ValueError("ignore and recipe apply only with quantize=True (a converted checkpoint was "
                         "quantized with the converter's own)")
    cfg = Qwen3MoeConfig.from_hf(root, moe_backend=moe_backend, param_dtype=param_dtype)
    ckpt = open_checkpoint(root)
    model = nnx.eval_shape(lambda: Qwen3MoeForCausalLM(cfg, rngs=nnx.Rngs(0)))

    if nvfp4:
        experts = load_nvfp4_experts(root)
    elif quantize:
        experts = quantize_checkpoint_experts(root, ignore=ignore, recipe=recipe, progress=progress)
    else:
        experts = {}
    modules = list(experts)
    _load_experts(model, experts, mode, order, strict=True, consume=True)  # one block repacked at a time
    used = {n for n in ckpt.tensors if any(n.startswith(m + ".experts.") for m in modules)}

    blocks = moe_modules(model)
    with TensorReader() as reader:
        for name, block in blocks.items():
            if not block.quantized:
                block.experts = _stack_bf16_experts(ckpt, reader, name, block, param_dtype)
                used.update(n for n in ckpt.tensors if n.startswith(name + ".experts."))
        for vpath, var in nnx.iter_graph(model):
            if not isinstance(var, nnx.Variable) or not isinstance(var.get_value(), jax.ShapeDtypeStruct):
                continue  # already loaded (experts)
            hf, transpose = _hf_name(vpath)
            var.set_value(_read_dense(ckpt, reader, hf, var.shape, transpose, var.get_value().dtype))
            used.add(hf)
    unused = sorted(set(ckpt.tensors) - used)
    if unused:
        warnings.warn(f"{len(unused)} checkpoint tensors were not used, e.g. {unused[:3]}", stacklevel=2)
    return model
