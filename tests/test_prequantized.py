"""Pre-quantized NVFP4 checkpoints: as NVIDIA ModelOpt exports them (``weight`` U8 codes, ``weight_scale`` E4M3
``[N, K/16]``, ``weight_scale_2`` the F32 global decode scale, ``input_scale`` the static activation decode scale)
and as compressed-tensors
(llm-compressor) writes them (``weight_packed``, ``weight_scale``, ``weight_global_scale`` the F32 global *encode*
scale, ``input_global_scale``): experts loaded with their bytes as stored, other NVFP4 layers dequantized,
mismatched gate / up global scales (both kept), static activation scales (the module's largest kept), NaN block
scales, malformed scales.

The ModelOpt checkpoints here are written from the bf16 test checkpoint with jax_nvfp4's quantizer (FlashInfer's
arithmetic; ModelOpt's global scale is the same ``amax / (6 * 448)``), so loading one must give exactly the bytes
that converting the bf16 checkpoint gives."""

from __future__ import annotations

import dataclasses
import json
import warnings
import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

pytest.importorskip("flax")
from flax import nnx  # noqa: E402

import jax_nvfp4 as nv  # noqa: E402
from jax_nvfp4 import nn as nvnn  # noqa: E402
from jax_nvfp4.checkpoint import CheckpointError, open_checkpoint, read_nvfp4_config  # noqa: E402
from jax_nvfp4.checkpoint.safetensors_io import TensorReader  # noqa: E402
from jax_nvfp4.checkpoint.sources import read_source_experts  # noqa: E402
import conftest  # noqa: E402
import qwen3_moe_numpy_ref as ref  # noqa: E402
from test_qwen3_moe import HF_CONFIG, assert_close_to_reference  # noqa: E402

F8 = ml_dtypes.float8_e4m3fn
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def quantized(x, amax=None):
    """(codes uint8 [N, K/2], scales e4m3 [N, K/16], global decode scale f32 []) of x [N, K] (its own amax)."""
    x = jnp.asarray(x)
    amax = jnp.max(jnp.abs(x.astype(jnp.float32))) if amax is None else amax
    q = nv.quantize(x, global_amax=jnp.asarray(amax, jnp.float32))
    return np.asarray(q.data), np.asarray(q.scales), np.asarray(q.global_scale, np.float32)


def dequantized(parts) -> np.ndarray:
    data, scales, g = parts
    q = nv.NVFP4Array(jnp.asarray(data), jnp.asarray(scales), jnp.asarray(g))
    return np.asarray(nv.dequantize(q))


def modelopt_weights(w: dict, *, attention: bool = True, synced: bool = True) -> tuple[dict, dict]:
    """A ModelOpt NVFP4 export of the bf16 HF tensors ``w``: every expert projection (gate and up with one global
    scale when ``synced``) and, with ``attention``, the attention projections; routers, norms, embeddings and the LM
    head stay bf16 (ModelOpt's default exclusions). Returns (tensors, the quantized parts by weight name)."""
    out, parts = {}, {}
    for name, x in w.items():
        quant = ".experts." in name or (attention and name.split(".")[-2] in ATTENTION)
        if not quant:
            out[name] = x
            continue
        amax = None
        if synced and (".gate_proj." in name or ".up_proj." in name):
            other = name.replace(".gate_proj.", ".up_proj.") if ".gate_proj." in name else \
                name.replace(".up_proj.", ".gate_proj.")
            amax = max(np.abs(x.astype(np.float32)).max(), np.abs(w[other].astype(np.float32)).max())
        parts[name] = quantized(x, amax)
        p = name[: -len("weight")]
        out[name], out[p + "weight_scale"], out[p + "weight_scale_2"] = parts[name]
        out[p + "input_scale"] = input_scale(name)
    return out, parts


def input_scale(name: str) -> np.ndarray:
    """A static activation decode scale of its own for each projection (about 0.01)."""
    return np.array(0.01 * (1 + (zlib.crc32(name.encode()) % 97) / 97), np.float32)


def layer_input_scales(tensors: dict, module: str) -> np.ndarray:
    """The module's largest gate / up and down input scales, ``[2]``."""
    def top(roles):
        return max(float(x) for n, x in tensors.items() if n.startswith(module + ".experts.")
                   and n.endswith(tuple(f".{r}_proj.input_scale" for r in roles)))
    return np.array([top(("gate", "up")), top(("down",))], np.float32)


def without_input_scales(experts: dict) -> dict:
    return {m: dataclasses.replace(e, input_scales=None) for m, e in experts.items()}


def state_leaves(model, input_scales: bool = True) -> list:
    """The model's state arrays, without its experts' input scales unless ``input_scales``."""
    return [v for path, v in jax.tree_util.tree_leaves_with_path(nnx.state(model))
            if input_scales or "input_scales" not in jax.tree_util.keystr(path)]


def write_modelopt(root, tensors):
    conftest.write_hf(root, tensors, HF_CONFIG | {"quantization_config": {"quant_method": "modelopt",
                                                                            "quant_algo": "NVFP4"}})
    (root / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4", "group_size": 16,
                                                             "kv_cache_quant_algo": None,
                                                             "exclude_modules": ["lm_head"]}}))
    return root


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """(bf16 weights, ModelOpt checkpoint, its quantized parts, the bf16 one converted by jax_nvfp4)."""
    w = ref.random_weights(HF_CONFIG, seed=0)
    root = tmp_path_factory.mktemp("modelopt")
    tensors, parts = modelopt_weights(w)
    src = conftest.write_hf(root / "bf16", w, HF_CONFIG)
    conv = root / "converted"
    nv.convert_checkpoint(src, conv, progress=False)
    return w, write_modelopt(root / "modelopt", tensors), parts, conv


def same_bytes(a, b):
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def assert_same_experts(x: dict, y: dict):
    assert x.keys() == y.keys() and x
    for m in x:
        for a, b in zip(jax.tree.leaves(x[m]), jax.tree.leaves(y[m]), strict=True):
            assert same_bytes(a, b), m


def test_modelopt_experts_load_as_stored(ckpts):
    w, mo, parts, conv = ckpts
    experts = nv.load_nvfp4_experts(mo)
    # the bytes of converting the bf16 checkpoint (same quantizer, gate and up sharing one global scale) ...
    assert_same_experts(without_input_scales(experts), nv.load_nvfp4_experts(conv))
    # ... with static activation scales: every expert the module's largest of GEMM1 (gate and up) and of GEMM2
    tensors = open_checkpoint(mo)
    with TensorReader() as reader:
        stored = {n: reader.read(t) for n, t in tensors.tensors.items() if n.endswith("input_scale")}
    for m, ex in experts.items():
        want = layer_input_scales(stored, m)
        assert want[0] != want[1]
        np.testing.assert_array_equal(ex.input_scales, np.broadcast_to(want, (HF_CONFIG["num_experts"], 2)))
    # ... which are the ModelOpt tensors themselves: gate rows, then up rows
    e = experts["model.layers.1.mlp"]
    p = "model.layers.1.mlp.experts.5."
    gate, up, down = (parts[p + f"{r}_proj.weight"] for r in ("gate", "up", "down"))
    assert same_bytes(e.gate_up.data[5], np.concatenate([gate[0], up[0]]))
    assert same_bytes(e.gate_up.scales[5], np.concatenate([gate[1], up[1]]))
    assert e.gate_up.global_scale[5] == gate[2] == up[2] and e.down.global_scale[5] == down[2]
    assert same_bytes(e.down.data[5], down[0])
    # quantize_checkpoint_experts takes them as stored too; the converter repacks them into our format
    assert_same_experts(nv.quantize_checkpoint_experts(mo), experts)
    re = mo.parent / "reconverted"
    nv.convert_checkpoint(mo, re, progress=False)
    assert_same_experts(nv.load_nvfp4_experts(re), experts)
    cfg = read_nvfp4_config(re)
    module = cfg["moe_modules"]["model.layers.0.mlp"]
    assert module["source_dtype"] == "nvfp4" and module["input_scales"] is True and cfg["format_version"] == 4
    assert not cfg["dropped_tensors"]  # (each projection's input scale kept: gate's and up's as [2])
    with TensorReader() as reader:
        kept = reader.read(open_checkpoint(re).tensors["model.layers.1.mlp.experts.5.gate_up_proj.input_scale"])
    np.testing.assert_array_equal(kept, [stored[p + "gate_proj.input_scale"], stored[p + "up_proj.input_scale"]])


def test_modelopt_model_loads_experts_and_dequantized_attention(ckpts, tmp_path):
    w, mo, parts, conv = ckpts
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every tensor used (the static input scales knowingly), nothing rescaled
        model = nvnn.load_qwen3_moe(mo)
    # The same model as a bf16 checkpoint whose attention holds bf16(dequantized NVFP4), its experts converted.
    w2 = dict(w)
    for name, pt in parts.items():
        if ".experts." not in name:
            w2[name] = dequantized(pt).astype(ml_dtypes.bfloat16)
    conv2 = tmp_path / "converted"
    nv.convert_checkpoint(conftest.write_hf(tmp_path / "bf16", w2, HF_CONFIG), conv2, progress=False)
    other = nvnn.load_qwen3_moe(conv2)
    for a, b in zip(state_leaves(model, input_scales=False), state_leaves(other), strict=True):
        assert same_bytes(a, b)
    np.testing.assert_array_equal(model.model.layers[1].mlp.experts.input_scales[...],
                                  nv.load_nvfp4_experts(mo)["model.layers.1.mlp"].input_scales)
    q = model.model.layers[0].self_attn.q_proj.kernel[...]
    want = dequantized(parts["model.layers.0.self_attn.q_proj.weight"]).astype(ml_dtypes.bfloat16).T
    assert same_bytes(q, want)
    toks = jnp.asarray(np.random.default_rng(1).integers(0, HF_CONFIG["vocab_size"], 12))[None]
    logits = model(toks).logits
    assert np.isfinite(np.asarray(logits)).all()
    np.testing.assert_array_equal(logits, other(toks).logits)
    with pytest.raises(ValueError, match="already an NVFP4 checkpoint.*ModelOpt"):
        nvnn.load_qwen3_moe(mo, quantize=True)
    # an FP8 KV cache's scales are named as such, not as unknown tensors
    kv = tmp_path / "kv"
    tensors, _ = modelopt_weights(w)
    write_modelopt(kv, tensors | {f"model.layers.{L}.self_attn.{p}_proj.{p}_scale": np.array(0.1, np.float32)
                                  for L in range(2) for p in "kv"})
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        nvnn.load_qwen3_moe(kv)
    assert [str(r.message) for r in rec] == ["4 KV-cache scales (e.g. 'model.layers.0.self_attn.k_proj.k_scale') go "
                                             "unused: the KV cache here is bf16"]


def test_modelopt_model_runs_w4a4_on_its_static_scales(ckpts):
    """A ModelOpt model loaded with mode w4a4 quantizes its MoE activations on the checkpoint's input scales: its
    blocks give bitwise what jax_nvfp4.moe gives on the loaded experts (with their scales), not the per-token result,
    and the logits are as close to w4a16's as per-token w4a4's."""
    mo = ckpts[1]
    model = nvnn.load_qwen3_moe(mo, mode="w4a4")
    experts = nv.load_nvfp4_experts(mo)["model.layers.0.mlp"]
    block = model.model.layers[0].mlp
    np.testing.assert_array_equal(block.experts.input_scales[...], experts.input_scales)
    x = jnp.asarray(np.random.default_rng(5).standard_normal((6, HF_CONFIG["hidden_size"])), jnp.bfloat16)
    ids, w = nv.route(x.astype(jnp.float32) @ jnp.asarray(np.random.default_rng(6).standard_normal(
        (HF_CONFIG["hidden_size"], HF_CONFIG["num_experts"])), jnp.float32), "softmax_topk", top_k=2)
    ours = nv.moe(x, block.experts.experts(), topk_ids=ids, topk_weights=w, mode="w4a4")
    np.testing.assert_array_equal(np.asarray(ours, np.float32), np.asarray(
        nv.moe(x, nv.to_blocked_experts(experts) if block.experts.order == "blocked" else experts, topk_ids=ids,
               topk_weights=w, mode="w4a4"), np.float32))
    toks = jnp.asarray(np.random.default_rng(7).integers(0, HF_CONFIG["vocab_size"], 12))[None]
    static = np.asarray(model(toks).logits, np.float64)
    per_token = nvnn.set_moe_options(model, mode="w4a4")
    for b in nvnn.moe_modules(per_token).values():
        b.experts.input_scales = None
    w4a16 = np.asarray(nvnn.set_moe_options(model, mode="w4a16")(toks).logits, np.float64)
    dynamic = np.asarray(per_token(toks).logits, np.float64)
    assert np.isfinite(static).all() and not np.array_equal(static, dynamic)
    err = [np.linalg.norm(v - w4a16) / np.linalg.norm(w4a16) for v in (static, dynamic)]
    assert err[0] < 1.5 * err[1], err  # (0.114 and 0.114 on 2026-12-06: these scales, ~0.01, saturate little)


def test_mismatched_gate_up_global_scales_are_both_kept(ckpts, tmp_path):
    """Gate and up quantized apart (ModelOpt's own global scale each): the bytes as stored, gate's scale as gate_up's
    global scale and up's as ``up_global_scale``; converting keeps both ([2] global scales, format 3); the model's
    MoE blocks run them as the float64 reference of the stored values does."""
    w = ckpts[0]
    tensors, parts = modelopt_weights(w, attention=False, synced=False)
    root = write_modelopt(tmp_path / "mismatched", tensors)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing rescaled, nothing to warn about
        experts = nv.load_nvfp4_experts(root)
    differ = 0
    for L in range(HF_CONFIG["num_hidden_layers"]):
        ex = experts[f"model.layers.{L}.mlp"]
        assert ex.up_global_scale is not None
        for e in range(HF_CONFIG["num_experts"]):
            p = f"model.layers.{L}.mlp.experts.{e}."
            (gd, gs, gg), (ud, us, ug) = parts[p + "gate_proj.weight"], parts[p + "up_proj.weight"]
            differ += gg != ug
            assert ex.gate_up.global_scale[e] == gg and ex.up_global_scale[e] == ug
            assert same_bytes(ex.gate_up.data[e], np.concatenate([gd, ud]))
            assert same_bytes(ex.gate_up.scales[e], np.concatenate([gs, us]))
    assert differ >= 12  # (bf16 amaxes may tie)
    conv = tmp_path / "converted"
    nv.convert_checkpoint(root, conv, progress=False)
    cfg = read_nvfp4_config(conv)
    assert cfg["format_version"] == 4 and cfg["moe_modules"]["model.layers.0.mlp"]["up_global_scale"] is True
    assert open_checkpoint(conv).tensors["model.layers.0.mlp.experts.0.gate_up_proj.weight_global_scale"].shape == (2,)
    assert_same_experts(nv.load_nvfp4_experts(conv), experts)
    # The model: its MoE blocks hold both scales and compute with the stored values (the float64 reference of
    # the bf16 checkpoint whose experts are those values)
    model = nvnn.load_qwen3_moe(conv)
    up = model.model.layers[1].mlp.experts.up_global_scale[...]
    np.testing.assert_array_equal(up, experts["model.layers.1.mlp"].up_global_scale)
    w2 = dict(w) | {name: dequantized(pt) for name, pt in parts.items()}
    assert_close_to_reference(model, w2, np.random.default_rng(3).integers(0, HF_CONFIG["vocab_size"], 12))


def test_nan_block_scales(ckpts, tmp_path):
    w = ckpts[0]
    tensors, _ = modelopt_weights(w, attention=False)
    name = "model.layers.0.mlp.experts.3.down_proj."
    data, scales = tensors[name + "weight"].copy(), tensors[name + "weight_scale"].copy()
    data[2, 8:16] = 0x08  # block [2, 1]: codes +0 / -0, as an exporter writes a block of amax 0 ...
    scales[2, 1] = np.float32(np.nan)  # ... with its 0 / 0 scale
    root = write_modelopt(tmp_path / "nan", tensors | {name + "weight": data, name + "weight_scale": scales})
    with pytest.warns(UserWarning, match="1 NaN block scales of all-zero blocks set to 0"):
        experts = nv.load_nvfp4_experts(root)
    down = experts["model.layers.0.mlp"].down
    assert float(np.asarray(down.scales[3, 2, 1], np.float32)) == 0.0
    assert np.isfinite(np.asarray(nv.dequantize(down))).all()
    data[2, 8] = 0x21  # a nonzero code under the NaN scale: refused
    root = write_modelopt(tmp_path / "nan2", tensors | {name + "weight": data, name + "weight_scale": scales})
    with pytest.raises(CheckpointError, match=r"NaN block scale at \[2, 1\] over nonzero codes"):
        nv.load_nvfp4_experts(root)


@pytest.mark.parametrize("what", ["scale_shape", "scale_dtype", "global_shape", "no_block_scales", "negative",
                                  "no_global_scale"])
def test_malformed_nvfp4_scales_are_named(ckpts, tmp_path, what):
    tensors, _ = modelopt_weights(ckpts[0], attention=False)
    p = "model.layers.1.mlp.experts.2.up_proj."
    t = dict(tensors)
    if what == "scale_shape":
        t[p + "weight_scale"] = t[p + "weight_scale"][:, :-1]
        match = "weight_scale.*expected F8_E4M3"
    elif what == "scale_dtype":
        t[p + "weight_scale"] = t[p + "weight_scale"].astype(np.float32)
        match = "weight_scale.*expected F8_E4M3"
    elif what == "global_shape":
        t[p + "weight_scale_2"] = np.ones(2, np.float32)
        match = "weight_scale_2.*one F32 global decode scale"
    elif what == "no_block_scales":
        del t[p + "weight_scale"]
        match = "block scales \\(weight_scale\\) missing"
    elif what == "negative":
        t[p + "weight_scale_2"] = np.array(-1.0, np.float32)
        match = "weight_scale_2.*global scale -1.0"
    else:  # U8 codes without their global scale: not NVFP4, and not a dtype to quantize
        del t[p + "weight_scale_2"]
        match = "up_proj.weight.*unsupported dtype U8.*weight_scale_2"
    with pytest.raises(CheckpointError, match=match):
        nv.load_nvfp4_experts(write_modelopt(tmp_path / what, t))


def test_unquantized_read_of_nvfp4_experts_dequantizes(ckpts):
    w, mo, parts, _ = ckpts
    ckpt = open_checkpoint(mo)
    with TensorReader() as reader:
        gate_up, down, biases = read_source_experts(ckpt, reader, "model.layers.0.mlp", np.dtype(ml_dtypes.bfloat16))
    assert not biases
    p = "model.layers.0.mlp.experts.6."
    want = np.concatenate([dequantized(parts[p + "gate_proj.weight"]), dequantized(parts[p + "up_proj.weight"])])
    assert same_bytes(gate_up[6], want.astype(ml_dtypes.bfloat16))
    assert same_bytes(down[6], dequantized(parts[p + "down_proj.weight"]).astype(ml_dtypes.bfloat16))


def compressed_tensors(tensors: dict) -> tuple[dict, dict]:
    """The ModelOpt export ``tensors`` renamed as compressed-tensors writes NVFP4 (``weight_packed``; the global scale
    stored as its encode scale ``1 / decode``, shape [1]). Returns (tensors, the ModelOpt export with the decode scales
    a reader of the compressed-tensors one gets back, ``1 / (1 / g)`` in fp32)."""
    out, same = {}, dict(tensors)
    for name, x in tensors.items():
        if name.endswith(".weight_scale_2"):
            p = name[: -len("weight_scale_2")]
            enc = np.float32(1) / x
            out[p + "weight_global_scale"] = np.reshape(enc, [1]).astype(np.float32)
            same[name] = np.asarray(np.float32(1) / enc, np.float32)
        elif name.endswith(".input_scale"):
            enc = np.float32(1) / x
            out[name[: -len("input_scale")] + "input_global_scale"] = np.reshape(enc, [1])
            same[name] = np.asarray(np.float32(1) / enc, np.float32)
        elif name.endswith(".weight") and name[: -len("weight")] + "weight_scale_2" in tensors:
            out[name[: -len("weight")] + "weight_packed"] = x
        else:
            out[name] = x
    return out, same


def test_compressed_tensors_checkpoint_loads_as_stored(ckpts, tmp_path):
    """The same bytes under compressed-tensors' names: the same model as the ModelOpt export with the decode scales
    ``1 / weight_global_scale`` (fp32), experts as stored, attention dequantized."""
    w = ckpts[0]
    tensors, _ = modelopt_weights(w)
    ct, same = compressed_tensors(tensors)
    assert not any(n.endswith((".weight_scale_2", ".input_scale")) for n in ct)
    cfg = HF_CONFIG | {"quantization_config": {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"}}
    ct_root = conftest.write_hf(tmp_path / "ct", ct, cfg)
    mo_root = write_modelopt(tmp_path / "mo", same)
    assert_same_experts(nv.load_nvfp4_experts(ct_root), nv.load_nvfp4_experts(mo_root))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        a = nvnn.load_qwen3_moe(ct_root)
    b = nvnn.load_qwen3_moe(mo_root)
    for x, y in zip(jax.tree.leaves(nnx.state(a)), jax.tree.leaves(nnx.state(b)), strict=True):
        assert same_bytes(x, y)
    bad = dict(ct)
    bad["model.layers.0.mlp.experts.1.down_proj.weight_global_scale"] = np.zeros([1], np.float32)
    with pytest.raises(CheckpointError, match="down_proj.weight_global_scale.*global encode scale 0.0"):
        nv.load_nvfp4_experts(conftest.write_hf(tmp_path / "bad", bad, cfg))
