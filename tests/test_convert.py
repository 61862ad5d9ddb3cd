"""Checkpoint conversion (jax_nvfp4.checkpoint, jax_nvfp4.convert) on synthetic safetensors checkpoints."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import tracemalloc
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors
from safetensors.numpy import save_file

import jax_nvfp4
from jax_nvfp4.checkpoint import conversion as ckpt_mod
from jax_nvfp4.checkpoint import CheckpointError, convert_checkpoint, load_nvfp4_experts, matches_ignore

BF16, F8 = ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn
DTYPES = {"bf16": BF16, "fp16": np.float16, "fp32": np.float32}
NAMING = {  # (MoE module under model.layers.L, gate, up, down)
    "qwen": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
}
ST_DTYPE = {np.dtype(BF16): "BF16", np.dtype(np.float16): "F16", np.dtype(np.float32): "F32",
            np.dtype(F8): "F8_E4M3", np.dtype(np.uint8): "U8", np.dtype(np.int64): "I64"}


# ----------------------------------------------------------------------------- synthetic checkpoints

def expert_name(layer, e, role, naming="qwen", param="weight"):
    mod, *projs = NAMING[naming]
    proj = dict(zip(("gate", "up", "down"), projs))[role]
    return f"model.layers.{layer}.{mod}.experts.{e}.{proj}.{param}"


def module_name(layer, naming="qwen"):
    return f"model.layers.{layer}.{NAMING[naming][0]}"


def randw(rng, shape, dtype=BF16, scale=0.05):
    return (rng.standard_normal(shape, np.float32) * scale).astype(dtype)


def make_tensors(*, naming="qwen", dtype="bf16", layers=2, E=4, H=64, I=32, gated=True, seed=0):
    """Expert and non-expert tensors of a small MoE model (numpy, source dtype)."""
    rng = np.random.default_rng(seed)
    dt = DTYPES[dtype]
    t = {"model.embed_tokens.weight": randw(rng, (32, H)), "lm_head.weight": randw(rng, (32, H)),
         "model.norm.weight": np.ones(H, np.float32), "model.step": np.array([7], np.int64)}
    for L in range(layers):
        mod = module_name(L, naming)
        t[f"model.layers.{L}.self_attn.q_proj.weight"] = randw(rng, (H, H))
        t[f"model.layers.{L}.input_layernorm.weight"] = rng.standard_normal(H).astype(np.float32)
        t[f"{mod}.gate.weight"] = randw(rng, (E, H))  # router
        t[f"{mod}.shared_experts.gate_proj.weight"] = randw(rng, (I, H))  # DeepSeek-style shared expert
        for e in range(E):
            # per-expert magnitude differs so every expert gets its own global scale
            s = 0.02 * (1 + e + L)
            if gated:
                t[expert_name(L, e, "gate", naming)] = randw(rng, (I, H), dt, s)
            t[expert_name(L, e, "up", naming)] = randw(rng, (I, H), dt, 1.5 * s)
            t[expert_name(L, e, "down", naming)] = randw(rng, (H, I), dt, s)
    return t


def write_checkpoint(root: Path, tensors: dict, shards: int = 1, config: dict | None = None) -> Path:
    """Write tensors as model.safetensors, or round-robin into shards with an index (partners get split)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config or {"model_type": "test_moe"}))
    (root / "tokenizer.json").write_text("{}")
    if shards == 1:
        save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
        return root
    names = sorted(tensors)
    files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    weight_map = {n: files[i % shards] for i, n in enumerate(names)}
    for f in files:
        save_file({n: tensors[n] for n in names if weight_map[n] == f}, str(root / f), metadata={"format": "pt"})
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": sum(a.nbytes for a in tensors.values())}, "weight_map": weight_map}))
    return root


def read_output(dst: Path) -> dict[str, tuple[str, tuple, bytes]]:
    """Every tensor of every output file via the safetensors library: name -> (dtype, shape, bytes)."""
    out = {}
    for f in sorted(dst.glob("*.safetensors")):
        for name, t in safetensors.deserialize(f.read_bytes()):
            out[name] = (t["dtype"], tuple(t["shape"]), bytes(t["data"]))
    return out


def as_array(entry) -> np.ndarray:
    dtype, shape, data = entry
    npdt = {v: k for k, v in ST_DTYPE.items()}[dtype]
    return np.frombuffer(data, npdt).reshape(shape)


def expected_experts(tensors, layer, E, naming="qwen", gated=True, recipe="nvfp4"):
    """jax_nvfp4.quantize_experts on the stacked source weights: the reference bytes."""
    gu = np.stack([np.concatenate([tensors[expert_name(layer, e, r, naming)] for r in
                                   (("gate", "up") if gated else ("up",))]) for e in range(E)])
    dn = np.stack([tensors[expert_name(layer, e, "down", naming)] for e in range(E)])
    return _quantize_experts(gu, dn, recipe=recipe, gated=gated)


# jit: one compilation per shape instead of one per eager op (exact on the CPU either way, spec section 7)
_quantize_experts = jax.jit(jax_nvfp4.quantize_experts, static_argnames=("recipe", "gated"))


def out_names(layer, e, naming="qwen", gated=True):
    p = f"{module_name(layer, naming)}.experts.{e}"
    g1 = "gate_up_proj" if gated else "up_proj"
    return {k: (f"{p}.{proj}.weight", f"{p}.{proj}.weight_scale", f"{p}.{proj}.weight_global_scale")
            for k, proj in (("gate_up", g1), ("down", "down_proj"))}


def assert_experts_equal(out, ref: jax_nvfp4.NVFP4Experts, layer, naming="qwen", gated=True):
    for e in range(ref.num_experts):
        names = out_names(layer, e, naming, gated)
        for key, q in (("gate_up", ref.gate_up), ("down", ref.down)):
            d, s, g = (as_array(out[n]) for n in names[key])
            assert out[names[key][0]][0] == "U8" and out[names[key][1]][0] == "F8_E4M3"
            assert out[names[key][2]][:2] == ("F32", ())
            np.testing.assert_array_equal(d, np.asarray(q.data[e]), err_msg=names[key][0])
            np.testing.assert_array_equal(s.view(np.uint8), np.asarray(q.scales[e]).view(np.uint8),
                                          err_msg=names[key][1])
            assert g.tobytes() == np.asarray(q.global_scale[e], np.float32).tobytes(), names[key][2]


def assert_loaded_equal(got: jax_nvfp4.NVFP4Experts, ref: jax_nvfp4.NVFP4Experts):
    assert got.gated == ref.gated and got.gate_up.shape == ref.gate_up.shape and got.down.shape == ref.down.shape
    for a, b in ((got.gate_up, ref.gate_up), (got.down, ref.down)):
        assert a.global_scale.shape == (ref.num_experts,) and a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a.data), np.asarray(b.data))
        np.testing.assert_array_equal(np.asarray(a.scales).view(np.uint8), np.asarray(b.scales).view(np.uint8))
        np.testing.assert_array_equal(np.asarray(a.global_scale), np.asarray(b.global_scale))


def is_expert(name):
    return ".experts." in name and "shared_experts" not in name


def assert_copied(out, tensors, skip=is_expert):
    """Non-expert tensors: same dtype, shape and bytes."""
    for n, a in tensors.items():
        if not skip(n):
            assert out[n] == (ST_DTYPE[a.dtype], a.shape, a.tobytes()), n


def siblings(path: Path) -> set[str]:
    return set(os.listdir(path.parent))


# ----------------------------------------------------------------------------- tests: conversion is exact

@pytest.mark.parametrize("naming,dtype,shards", [
    ("qwen", "bf16", 3), ("qwen", "bf16", 1), ("mixtral", "bf16", 2), ("mixtral", "fp16", 1), ("qwen", "fp32", 2),
])
def test_convert_matches_quantize_experts(tmp_path, naming, dtype, shards):
    tensors = make_tensors(naming=naming, dtype=dtype)
    src = write_checkpoint(tmp_path / "src", tensors, shards)
    summary = convert_checkpoint(src, tmp_path / "dst", progress=False)
    dst = tmp_path / "dst"
    out = read_output(dst)
    for L in range(2):
        assert_experts_equal(out, expected_experts(tensors, L, 4, naming), L, naming)
    assert_copied(out, tensors)
    # nothing else: every source expert weight was replaced by the 6 tensors of its expert
    n_other = sum(not is_expert(n) for n in tensors)
    assert len(out) == n_other + 2 * 4 * 6
    assert (summary.experts_converted, summary.layers_converted, summary.layers_ignored) == (8, 2, 0)
    assert summary.tensors_copied == n_other and summary.bytes_out < summary.bytes_in
    # layout: shards mirror the source, index consistent with the files
    src_files = sorted(p.name for p in src.glob("*.safetensors"))
    assert sorted(p.name for p in dst.glob("*.safetensors")) == src_files
    if shards > 1:
        index = json.loads((dst / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(out)
        for f in src_files:
            with safetensors.safe_open(str(dst / f), "flax") as h:
                assert set(h.keys()) == {n for n, v in index["weight_map"].items() if v == f}
        assert index["metadata"]["total_size"] == sum(len(v[2]) for v in out.values())
    else:
        assert not (dst / "model.safetensors.index.json").exists()
    # side files copied, no temp folder left
    assert (dst / "config.json").read_text() == (src / "config.json").read_text()
    assert (dst / "tokenizer.json").exists()
    assert siblings(dst) == {"src", "dst"}
    assert dst.stat().st_mode & 0o777 == src.stat().st_mode & 0o777  # not mkdtemp's 0700


def test_output_format_and_metadata(tmp_path):
    tensors = make_tensors(dtype="bf16")
    src = write_checkpoint(tmp_path / "src", tensors, 2)
    dst = tmp_path / "dst"
    convert_checkpoint(src, dst, progress=False)
    cfg = json.loads((dst / "nvfp4_config.json").read_text())
    assert cfg["format"] == "jax_nvfp4" and cfg["format_version"] == 2 and cfg["recipe"] == "nvfp4"
    assert cfg["source_dtype"] == "bfloat16" and cfg["group_size"] == 16 and cfg["ignore"] == []
    assert cfg["gemm1_row_order"] == ["gate", "up"]
    assert cfg["moe_modules"]["model.layers.1.mlp"] == dict(
        num_experts=4, quantized=True, source_dtype="bfloat16", gated=True, hidden_size=64, intermediate_size=32,
        quantized_dtype="bfloat16")
    for f in dst.glob("*.safetensors"):
        raw = f.read_bytes()
        n = struct.unpack("<Q", raw[:8])[0]
        assert n % 8 == 0  # header padded like the safetensors library pads it
        header = json.loads(raw[8:8 + n])
        meta = header.pop("__metadata__")
        assert meta["format"] == "pt"  # source metadata kept
        assert meta["nvfp4_format"] == "jax_nvfp4" and meta["nvfp4_format_version"] == "2"
        assert meta["nvfp4_recipe"] == "nvfp4" and json.loads(meta["nvfp4_source_dtype"]) == "bfloat16"
        spans = sorted(h["data_offsets"] for h in header.values())
        assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        assert spans[-1][1] == len(raw) - 8 - n
        for h in header.values():  # every tensor aligned to its element size
            size = {"F32": 4, "I64": 8, "BF16": 2, "F16": 2}.get(h["dtype"], 1)
            assert (8 + n + h["data_offsets"][0]) % size == 0
        with safetensors.safe_open(str(f), "flax") as st:  # the reference reader accepts the file
            assert st.metadata() == meta
            for k in st.keys():
                if header[k]["dtype"] != "F8_E4M3":  # its flax loader has no float8 (a library bug)
                    assert tuple(st.get_tensor(k).shape) == tuple(header[k]["shape"])
    # version 1 (before expert biases) is the same without them: still read; a newer one is refused
    for version, ok in ((1, True), (5, False)):
        (dst / "nvfp4_config.json").write_text(json.dumps(cfg | {"format_version": version}))
        if ok:
            assert set(load_nvfp4_experts(dst)) == set(cfg["moe_modules"])
        else:
            with pytest.raises(CheckpointError, match="version 5 is not 'jax_nvfp4' version 1 or 2 or 3 or 4"):
                load_nvfp4_experts(dst)


def test_four_over_six_recipe(tmp_path):
    tensors = make_tensors(layers=1)
    src = write_checkpoint(tmp_path / "src", tensors)
    convert_checkpoint(src, tmp_path / "dst", recipe="4over6", progress=False)
    out = read_output(tmp_path / "dst")
    assert_experts_equal(out, expected_experts(tensors, 0, 4, recipe="4over6"), 0)
    assert json.loads((tmp_path / "dst" / "nvfp4_config.json").read_text())["recipe"] == "4over6"
    with pytest.raises(ValueError, match="recipe"):
        convert_checkpoint(src, tmp_path / "dst2", recipe="mxfp4", progress=False)


def test_not_gated_experts(tmp_path):
    tensors = make_tensors(layers=1, gated=False)
    src = write_checkpoint(tmp_path / "src", tensors)
    convert_checkpoint(src, tmp_path / "dst", progress=False)
    out = read_output(tmp_path / "dst")
    ref = expected_experts(tensors, 0, 4, gated=False)
    assert_experts_equal(out, ref, 0, gated=False)
    assert_loaded_equal(load_nvfp4_experts(tmp_path / "dst")["model.layers.0.mlp"], ref)


# ----------------------------------------------------------------------------- FP8 sources

def fp8_block_quantize(w: np.ndarray, block=(128, 128)):
    """A DeepSeek-style block-FP8 weight: (float8_e4m3fn [out, in], f32 scale [ceil(out/bo), ceil(in/bi)])."""
    bo, bi = block
    n, k = w.shape
    grid = (-(-n // bo), -(-k // bi))
    amax = np.zeros(grid, np.float32)
    for i in range(grid[0]):
        for j in range(grid[1]):
            amax[i, j] = np.abs(w[i * bo:(i + 1) * bo, j * bi:(j + 1) * bi]).max()
    s = (amax / 448).astype(np.float32) * np.float32(1.37)  # odd scales: products are not exact in bf16
    full = np.kron(s, np.ones(block, np.float32))[:n, :k]
    return (w / full).astype(F8), s


def fp8_reference(w8, s, block=(128, 128)):
    """fp32(w) * scale per block, rounded to bf16 (spec section 4)."""
    n, k = w8.shape
    if s.size == 1:
        full = np.full((n, k), s.reshape(()), np.float32)
    else:
        full = np.kron(s, np.ones(block, np.float32))[:n, :k]
    return w8.astype(np.float32) * full


def make_fp8_source(E=2, H=256, I=160, block=(128, 128), per_tensor=False, seed=1):
    """One MoE layer in FP8 plus an FP8 attention weight (copied unchanged); returns (tensors, bf16 reference)."""
    rng = np.random.default_rng(seed)
    t = {"model.embed_tokens.weight": randw(rng, (16, H))}
    w8, s = fp8_block_quantize(rng.standard_normal((H, H), np.float32), block)
    t["model.layers.0.self_attn.o_proj.weight"], t["model.layers.0.self_attn.o_proj.weight_scale_inv"] = w8, s
    ref = {}
    for e in range(E):
        for role, shape in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
            w = rng.standard_normal(shape, np.float32) * (0.1 + e)
            name = expert_name(0, e, role)
            if per_tensor:
                s = np.array(np.abs(w).max() / 448 * 1.37, np.float32)  # scalar weight_scale
                w8 = (w / s).astype(F8)
                t[name], t[name.replace("weight", "weight_scale")] = w8, s
                t[name.replace("weight", "input_scale")] = np.array(0.5, np.float32)  # dropped
            else:
                w8, s = fp8_block_quantize(w, block)
                t[name], t[name + "_scale_inv"] = w8, s
            ref[name] = fp8_reference(w8, s, block).astype(BF16)
    return t, ref


@pytest.mark.parametrize("shards", [1, 2])
def test_block_fp8_source(tmp_path, shards):
    tensors, ref_bf16 = make_fp8_source()
    src = write_checkpoint(tmp_path / "src", tensors, shards)
    convert_checkpoint(src, tmp_path / "dst", progress=False)
    out = read_output(tmp_path / "dst")
    ref = expected_experts(ref_bf16, 0, 2)
    assert_experts_equal(out, ref, 0)
    # the double rounding matters: quantizing the fp32 dequantized weights gives other bytes
    fp32 = {n: fp8_reference(tensors[n], tensors[n + "_scale_inv"]) for n in ref_bf16}
    alt = expected_experts(fp32, 0, 2)
    assert not np.array_equal(np.asarray(alt.gate_up.data), np.asarray(ref.gate_up.data))
    # FP8 non-expert weights and their scales are copied unchanged; expert scales are consumed
    assert_copied(out, tensors)
    assert not any(n.endswith("weight_scale_inv") and is_expert(n) for n in out)
    cfg = json.loads((tmp_path / "dst" / "nvfp4_config.json").read_text())
    m = cfg["moe_modules"]["model.layers.0.mlp"]
    assert cfg["source_dtype"] == "float8_e4m3fn" and m["fp8_scaling"] == "block 128x128"
    assert m["quantized_dtype"] == "bfloat16"
    assert_loaded_equal(load_nvfp4_experts(tmp_path / "dst")["model.layers.0.mlp"], ref)


def test_per_tensor_fp8_and_block_size_from_config(tmp_path):
    tensors, ref_bf16 = make_fp8_source(E=4, H=64, I=32, per_tensor=True)
    src = write_checkpoint(tmp_path / "src", tensors)
    convert_checkpoint(src, tmp_path / "dst", progress=False)
    assert_experts_equal(read_output(tmp_path / "dst"), expected_experts(ref_bf16, 0, 4), 0)
    cfg = json.loads((tmp_path / "dst" / "nvfp4_config.json").read_text())
    assert cfg["moe_modules"]["model.layers.0.mlp"]["fp8_scaling"] == "per-tensor"
    inputs = sorted(n for n in tensors if n.endswith("input_scale"))
    assert len(inputs) == 12 and cfg["dropped_tensors"] == inputs
    # source expert tensors are gone (down_proj.weight_scale is now the E4M3 block scale, checked above)
    assert not any(k in n for n in read_output(tmp_path / "dst") for k in (".gate_proj.", ".up_proj.", "input_scale"))
    # a 32x16 block grid declared in config.json (gate/up grid [1, 4], down [2, 2])
    tensors, ref_bf16 = make_fp8_source(E=4, H=64, I=32, block=(32, 16), seed=3)
    cfg = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [32, 16]}}
    src = write_checkpoint(tmp_path / "src2", tensors, config=cfg)
    convert_checkpoint(src, tmp_path / "dst2", progress=False)
    assert_experts_equal(read_output(tmp_path / "dst2"), expected_experts(ref_bf16, 0, 4), 0)


# ----------------------------------------------------------------------------- ignore patterns, loader

def test_matches_ignore():
    n = "model.layers.3.mlp.experts.0.gate_proj.weight"
    for p in ("layers.3.mlp", "model.layers.3.mlp", "model.layers.3", "layers.3.mlp.", n, "layers.3.mlp.experts.0"):
        assert matches_ignore(n, p), p
    for p in ("layers.3.ml", "layers.30", "layers.3.mlp.experts.1", "mlp", ""):
        assert not matches_ignore(n, p), p
    assert matches_ignore("layers.3.mlp.experts.0.up_proj.weight", "model.layers.3.mlp")


def test_ignore_keeps_layers_in_source_precision(tmp_path):
    tensors = make_tensors()
    src = write_checkpoint(tmp_path / "src", tensors, 2)
    with pytest.warns(UserWarning, match="lm_head"):
        s = convert_checkpoint(src, tmp_path / "dst", ignore=["layers.1.mlp", "lm_head"], progress=False)
    assert (s.layers_converted, s.layers_ignored, s.experts_converted) == (1, 1, 4)
    out = read_output(tmp_path / "dst")
    assert_experts_equal(out, expected_experts(tensors, 0, 4), 0)
    assert_copied(out, tensors, skip=lambda n: is_expert(n) and ".layers.0." in n)  # layer 1 experts untouched
    assert not any(".layers.1." in n and "gate_up_proj" in n for n in out)
    cfg = json.loads((tmp_path / "dst" / "nvfp4_config.json").read_text())
    assert cfg["ignore"] == ["layers.1.mlp", "lm_head"] and cfg["ignored_modules"] == ["model.layers.1.mlp"]
    assert cfg["moe_modules"]["model.layers.1.mlp"]["quantized"] is False
    assert set(load_nvfp4_experts(tmp_path / "dst")) == {"model.layers.0.mlp"}
    # quantizing while loading honours the same patterns
    assert set(load_nvfp4_experts(src, quantize_source=True, ignore=["model.layers.1.mlp"])) == {"model.layers.0.mlp"}


def test_partial_ignore_is_an_error(tmp_path):
    src = write_checkpoint(tmp_path / "src", make_tensors(layers=1))
    with pytest.raises(CheckpointError, match=r"only part of MoE module 'model.layers.0.mlp'"):
        convert_checkpoint(src, tmp_path / "dst", ignore=["layers.0.mlp.experts.1"], progress=False)
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("naming", ["qwen", "mixtral"])
def test_loader_and_online_quantization(tmp_path, naming):
    tensors = make_tensors(naming=naming)
    src = write_checkpoint(tmp_path / "src", tensors, 2)
    convert_checkpoint(src, tmp_path / "dst", progress=False)
    loaded = load_nvfp4_experts(tmp_path / "dst")
    online = jax_nvfp4.quantize_checkpoint_experts(src)
    assert set(loaded) == set(online) == {module_name(0, naming), module_name(1, naming)}
    for L in range(2):
        ref = expected_experts(tensors, L, 4, naming)
        assert isinstance(loaded[module_name(L, naming)], jax_nvfp4.NVFP4Experts)
        assert_loaded_equal(loaded[module_name(L, naming)], ref)
        assert_loaded_equal(online[module_name(L, naming)], ref)
    e = loaded[module_name(0, naming)]
    assert (e.num_experts, e.hidden_size, e.intermediate_size) == (4, 64, 32)
    assert e.gate_up.global_scale.shape == (4,) and e.gate_up.data.shape == (4, 64, 32)
    # the loader also accepts a file of the checkpoint, and refuses a source checkpoint without the flag
    assert set(load_nvfp4_experts(tmp_path / "dst" / "model.safetensors.index.json")) == set(loaded)
    with pytest.raises(CheckpointError, match="quantize_source=True"):
        load_nvfp4_experts(src)
    with pytest.raises(FileNotFoundError, match="checkpoint not found"):  # not the parent's checkpoint
        load_nvfp4_experts(tmp_path / "dst" / "typo")


def test_fp16_source_loads_with_its_dtype(tmp_path):
    tensors = make_tensors(dtype="fp16", layers=1)
    src = write_checkpoint(tmp_path / "src", tensors)
    got = load_nvfp4_experts(src, quantize_source=True)["model.layers.0.mlp"]
    assert_loaded_equal(got, expected_experts(tensors, 0, 4))
    assert got.gate_up.dtype == np.float16


# ----------------------------------------------------------------------------- CLI, progress, atomicity

def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "jax_nvfp4.convert", *map(str, args)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})


def test_cli(tmp_path):
    tensors = make_tensors(naming="mixtral")
    src = write_checkpoint(tmp_path / "src", tensors, 2)
    r = run_cli(src, tmp_path / "dst", "--ignore", "layers.1.block_sparse_moe", "--no-progress")
    assert r.returncode == 0, r.stderr
    assert "converted 4 experts in 1 MoE layers (1 ignored)" in r.stdout and " s -> " in r.stdout
    assert_experts_equal(read_output(tmp_path / "dst"), expected_experts(tensors, 0, 4, "mixtral"), 0, "mixtral")
    # errors: exit status 1, message on stderr naming the tensor, no output
    bad = dict(tensors)
    del bad[expert_name(1, 2, "up", "mixtral")]
    write_checkpoint(tmp_path / "bad", bad)
    r = run_cli(tmp_path / "bad", tmp_path / "dst_bad", "--no-progress", "--recipe", "4over6")
    assert r.returncode == 1 and "error:" in r.stderr and "experts.2" in r.stderr and "up partner" in r.stderr
    assert not (tmp_path / "dst_bad").exists()
    r = run_cli(src, tmp_path / "dst")  # exists
    assert r.returncode == 1 and "already exists" in r.stderr
    r = run_cli(src, src, "--overwrite")  # a bad argument: a message, not a traceback
    assert r.returncode == 1 and "error: dst must differ" in r.stderr and "Traceback" not in r.stderr


def test_progress_bar(tmp_path, capsys):
    src = write_checkpoint(tmp_path / "src", make_tensors(layers=1, E=2))
    convert_checkpoint(src, tmp_path / "dst", progress=True)
    assert "nvfp4 convert" in capsys.readouterr().err
    convert_checkpoint(src, tmp_path / "dst2", progress=False)
    assert "nvfp4 convert" not in capsys.readouterr().err


def test_existing_dst_and_overwrite(tmp_path):
    src = write_checkpoint(tmp_path / "src", make_tensors(layers=1, E=2))
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "old.txt").write_text("x")
    with pytest.raises(FileExistsError):
        convert_checkpoint(src, dst, progress=False)
    convert_checkpoint(src, dst, progress=False, overwrite=True)
    assert not (dst / "old.txt").exists() and (dst / "nvfp4_config.json").exists()
    assert siblings(dst) == {"src", "dst"}


def test_interrupted_conversion_leaves_nothing(tmp_path, monkeypatch):
    src = write_checkpoint(tmp_path / "src", make_tensors(), 2)
    calls = []
    real = ckpt_mod._run_unit

    def flaky(*a, **k):
        calls.append(1)
        if len(calls) == 10:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(ckpt_mod, "_run_unit", flaky)
    with pytest.raises(KeyboardInterrupt):
        convert_checkpoint(src, tmp_path / "dst", progress=False)
    assert siblings(tmp_path / "dst") == {"src"}


# ----------------------------------------------------------------------------- bad input

def _nan(t):
    n = expert_name(1, 2, "up")
    a = t[n].copy()
    a[3, 5] = np.nan
    t[n] = a
    return n, "non-finite"


def _inf(t):
    n = expert_name(0, 1, "down")
    a = t[n].copy()
    a[0, 0] = -np.inf
    t[n] = a
    return n, "non-finite"


def _missing_gate(t):
    del t[expert_name(1, 3, "gate")]
    return "model.layers.1.mlp.experts.3.", "gate partner is missing"


def _missing_down(t):
    del t[expert_name(0, 0, "down")]
    return "model.layers.0.mlp.experts.0.", "down partner is missing"


def _unequal(t):
    n = expert_name(1, 2, "down")
    t[n] = t[n][:, :16].copy()
    return n, "equal shapes"


def _k_not_16(t):
    for e in range(4):
        for r in ("gate", "up"):
            t[expert_name(0, e, r)] = t[expert_name(0, e, r)][:, :40].copy()
        t[expert_name(0, e, "down")] = t[expert_name(0, e, "down")][:40].copy()
    return "model.layers.0.mlp.experts.0.", "not a multiple of 16"


def _dtype(t):
    for e in range(4):
        for r in ("gate", "up", "down"):
            t[expert_name(1, e, r)] = t[expert_name(1, e, r)].astype(np.int64)
    return "model.layers.1.mlp.experts.0.", "unsupported dtype I64"


def _fp8_no_scale(t):
    for e in range(4):
        for r in ("gate", "up", "down"):
            t[expert_name(0, e, r)] = t[expert_name(0, e, r)].astype(F8)
    return "model.layers.0.mlp.experts.0.", "without its scale"


def _expert_gap(t):
    for r in ("gate", "up", "down"):
        del t[expert_name(0, 1, r)]
    return "model.layers.0.mlp", "expert 1 is missing"


@pytest.mark.parametrize("corrupt", [_nan, _inf, _missing_gate, _missing_down, _unequal, _k_not_16, _dtype,
                                     _fp8_no_scale, _expert_gap], ids=lambda f: f.__name__[1:])
def test_bad_input(tmp_path, corrupt):
    tensors = make_tensors()
    name, msg = corrupt(tensors)
    src = write_checkpoint(tmp_path / "src", tensors, 2)
    with pytest.raises(CheckpointError) as info:
        convert_checkpoint(src, tmp_path / "out" / "dst", progress=False)
    assert name in str(info.value) and msg in str(info.value), str(info.value)
    assert not (tmp_path / "out" / "dst").exists()
    assert not (tmp_path / "out").exists() or os.listdir(tmp_path / "out") == []  # no stray temp folder
    with pytest.raises(CheckpointError, match=msg):  # quantizing while loading refuses the same input
        load_nvfp4_experts(src, quantize_source=True)


def test_fp8_bad_scale_shape(tmp_path):
    tensors, _ = make_fp8_source()
    n = expert_name(0, 1, "down") + "_scale_inv"
    tensors[n] = tensors[n][:1].copy()
    src = write_checkpoint(tmp_path / "src", tensors)
    with pytest.raises(CheckpointError, match=n.replace(".", r"\.") + ".*block grid"):
        convert_checkpoint(src, tmp_path / "dst", progress=False)
    assert siblings(tmp_path / "dst") == {"src"}


# ----------------------------------------------------------------------------- memory

def test_peak_memory_is_one_expert_not_the_model(tmp_path):
    """64 experts of 768 KB (48 MB of bf16): the conversion must never hold more than a few experts.

    numpy (and bytearray) allocations are tracked by tracemalloc; reading the whole model, or keeping
    every expert's source buffer, would exceed the bound many times over.
    """
    E, H, I = 64, 512, 256
    expert_bytes = 3 * H * I * 2
    rng = np.random.default_rng(0)
    tensors = {"model.embed_tokens.weight": randw(rng, (8, H))}
    for e in range(E):
        for r, shape in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
            tensors[expert_name(0, e, r)] = randw(rng, shape, scale=0.01 * (1 + e % 7))
    src = write_checkpoint(tmp_path / "src", tensors, 2)
    small = write_checkpoint(tmp_path / "small", {n: a for n, a in tensors.items() if ".experts.0." in n})
    del tensors
    convert_checkpoint(small, tmp_path / "warm", progress=False)  # compile outside the measurement

    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        s = convert_checkpoint(src, tmp_path / "dst", progress=False)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    total = E * expert_bytes
    bound = 3 * expert_bytes
    assert s.experts_converted == E and total > 20 * bound
    assert peak < bound, f"peak {peak / 1e6:.1f} MB > {bound / 1e6:.1f} MB (one expert {expert_bytes / 1e6:.2f} MB)"


# ----------------------------------------------------------------------------- stacked experts (gpt-oss, Llama 4)

def gpt_oss_module(L):
    return f"model.layers.{L}.mlp"


def mxfp4_reference(blocks, scales) -> np.ndarray:
    """float32 ``[..., N, K]`` of MXFP4 blocks ``[..., N, K/32, 16]`` and E8M0 scales (ml_dtypes decodes E2M1)."""
    codes = np.stack([blocks & 15, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)
    vals = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    return (vals * np.exp2(scales.astype(np.float64) - 127)[..., None]).astype(np.float32).reshape(
        *blocks.shape[:-2], -1)


def make_stacked(kind="gpt_oss_bf16", *, layers=2, E=4, H=64, I=32, bias=True, seed=3):
    """A Hugging Face-style checkpoint with stacked experts, and each layer's source weights in our layout
    (gate_up ``[E, 2I, H]`` rows [gate; up], down ``[E, H, I]``, biases de-interleaved), written by the test."""
    rng = np.random.default_rng(seed)
    t = {"model.embed_tokens.weight": randw(rng, (32, H))}
    ours = {}
    for L in range(layers):
        m = gpt_oss_module(L)
        t[f"{m}.router.weight"], t[f"{m}.router.bias"] = randw(rng, (E, H)), randw(rng, (E,))
        if kind == "gpt_oss_mxfp4":
            g = {}
            for proj, (n, k) in (("gate_up_proj", (2 * I, H)), ("down_proj", (H, I))):
                t[f"{m}.experts.{proj}_blocks"] = rng.integers(0, 256, (E, n, k // 32, 16), dtype=np.uint8)
                t[f"{m}.experts.{proj}_scales"] = rng.integers(119, 125, (E, n, k // 32), dtype=np.uint8)
                g[proj] = mxfp4_reference(t[f"{m}.experts.{proj}_blocks"], t[f"{m}.experts.{proj}_scales"])
            gu_rows, down = g["gate_up_proj"].astype(BF16), g["down_proj"].astype(BF16)  # [E, 2I, H] interleaved
        else:
            gu_rows = randw(rng, (E, 2 * I, H), scale=0.05)
            down = randw(rng, (E, H, I), scale=0.05)
            t[f"{m}.experts.gate_up_proj"] = np.ascontiguousarray(gu_rows.transpose(0, 2, 1))  # [E, H, 2I], x @ w
            t[f"{m}.experts.down_proj"] = np.ascontiguousarray(down.transpose(0, 2, 1))  # [E, I, H]
        if bias:
            t[f"{m}.experts.gate_up_proj_bias"] = randw(rng, (E, 2 * I), scale=0.5)
            t[f"{m}.experts.down_proj_bias"] = randw(rng, (E, H), scale=0.5)
        b1 = t.get(f"{m}.experts.gate_up_proj_bias")
        if kind.startswith("gpt_oss"):  # gpt-oss alternates gate and up columns: ours has the gate rows first
            gu_rows = np.concatenate([gu_rows[:, 0::2], gu_rows[:, 1::2]], axis=1)
            b1 = None if b1 is None else np.concatenate([b1[:, 0::2], b1[:, 1::2]], axis=1)
        ours[m] = dict(gate_up=gu_rows, down=down, gate_up_bias=b1, down_bias=t.get(f"{m}.experts.down_proj_bias"))
    return t, ours


_STACKED_CONFIG = {"gpt_oss_bf16": "gpt_oss", "gpt_oss_mxfp4": "gpt_oss", "llama4_bf16": "llama4"}


def expected_stacked(w) -> jax_nvfp4.NVFP4Experts:
    ref = _quantize_experts(w["gate_up"], w["down"])
    return ref.__class__(ref.gate_up, ref.down, True, w["gate_up_bias"], w["down_bias"])


def assert_biases_equal(got: jax_nvfp4.NVFP4Experts, ref: jax_nvfp4.NVFP4Experts):
    for b in ("gate_up_bias", "down_bias"):
        g, r = getattr(got, b), getattr(ref, b)
        assert (g is None) == (r is None), b
        if r is not None:
            assert g.dtype == r.dtype and g.tobytes() == np.asarray(r).tobytes(), b


@pytest.mark.parametrize("kind,bias,shards", [("gpt_oss_bf16", True, 2), ("gpt_oss_mxfp4", True, 1),
                                              ("llama4_bf16", False, 1)])
def test_stacked_experts_convert_and_load(tmp_path, kind, bias, shards):
    """gpt-oss (bf16 or MXFP4, gate/up interleaved, biases) and Llama 4 (halves): quantized exactly as our layout of
    the same weights would be, by convert_checkpoint, load_nvfp4_experts and quantizing while loading."""
    tensors, ours = make_stacked(kind, bias=bias)
    src = write_checkpoint(tmp_path / "src", tensors, shards, config={"model_type": _STACKED_CONFIG[kind]})
    online = jax_nvfp4.quantize_checkpoint_experts(src)
    summary = convert_checkpoint(src, tmp_path / "dst", progress=False)
    loaded = load_nvfp4_experts(tmp_path / "dst")
    assert set(online) == set(loaded) == set(ours) and summary.experts_converted == 8
    for m, w in ours.items():
        ref = expected_stacked(w)
        for got in (online[m], loaded[m]):
            assert_loaded_equal(got, ref)
            assert_biases_equal(got, ref)
    out = read_output(tmp_path / "dst")
    assert not any(".experts.gate_up_proj" in n or ".experts.down_proj" in n for n in out)  # consumed
    assert_copied(out, tensors, skip=lambda n: ".experts." in n)
    assert len(out) == sum(".experts." not in n for n in tensors) + 2 * 4 * (8 if bias else 6)
    cfg = json.loads((tmp_path / "dst" / "nvfp4_config.json").read_text())
    mod = cfg["moe_modules"][gpt_oss_module(0)]
    assert cfg["format_version"] == 2 and mod["intermediate_size"] == 32 and mod["gated"]
    assert mod["source_dtype"] == cfg["source_dtype"] == ("mxfp4" if "mxfp4" in kind else "bfloat16")
    assert mod.get("bias_dtype") == ("bfloat16" if bias else None)


def gpt_oss_mlp_reference(x, router_w, router_b, w, top_k):
    """Transformers' GptOssMLP in float64 on the source weights in gpt-oss's own layout: router logits plus bias,
    top-k then softmax, interleaved gate/up, clamped SwiGLU with alpha 1.702 and up + 1, biases."""
    x = x.astype(np.float64)
    logits = x @ router_w.astype(np.float64).T + router_b.astype(np.float64)
    ids = np.argsort(-logits, axis=1, kind="stable")[:, :top_k]
    top = np.take_along_axis(logits, ids, 1)
    wts = np.exp(top - top.max(1, keepdims=True))
    wts /= wts.sum(1, keepdims=True)
    gu_hf = w["gate_up_hf"].astype(np.float64)  # [E, H, 2I], columns gate, up, gate, up, ...
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j, e in enumerate(ids[t]):
            gu = x[t] @ gu_hf[e] + w["gate_up_bias_hf"][e].astype(np.float64)
            gate, up = np.minimum(gu[0::2], 7.0), np.clip(gu[1::2], -7.0, 7.0)
            h = (up + 1) * gate / (1 + np.exp(-1.702 * gate))
            out[t] += wts[t, j] * (h @ w["down_hf"][e].astype(np.float64) + w["down_proj_bias"][e].astype(np.float64))
    return out


def test_gpt_oss_block_matches_transformers_semantics(tmp_path):
    """A gpt-oss MoE layer from its checkpoint: nn.MoE(routing="renormalize", activation="swiglu_oai", router and
    expert biases) with the checkpoint's experts loaded, against Transformers' GptOssMLP on the source weights.

    The test's de-interleaving is checked bit-exact against the loader above; here bf16 experts in that layout must
    give gpt-oss's output (bf16 rounding only), and the NVFP4 experts loaded from the checkpoint must come within
    NVFP4's error of it, far closer than the same layer with gate and up swapped."""
    from flax import nnx

    from jax_nvfp4 import nn as nvnn

    E, H, I, k, T = 4, 64, 32, 2, 16
    tensors, ours = make_stacked("gpt_oss_bf16", layers=1, E=E, H=H, I=I)
    m = gpt_oss_module(0)
    w = ours[m] | {"gate_up_hf": tensors[f"{m}.experts.gate_up_proj"], "down_hf": tensors[f"{m}.experts.down_proj"],
                   "gate_up_bias_hf": tensors[f"{m}.experts.gate_up_proj_bias"],
                   "down_proj_bias": tensors[f"{m}.experts.down_proj_bias"]}
    src = write_checkpoint(tmp_path / "src", tensors, config={"model_type": "gpt_oss"})
    x = randw(np.random.default_rng(9), (T, H), scale=1.0)
    ref = gpt_oss_mlp_reference(x, tensors[f"{m}.router.weight"], tensors[f"{m}.router.bias"], w, k)

    class Model(nnx.Module):  # the MoE block at the checkpoint's path, model.layers.0.mlp
        def __init__(self):
            self.layers = nnx.List([nnx.Module()])
            self.layers[0].mlp = nvnn.MoE(H, I, E, k, routing="renormalize", activation="swiglu_oai",
                                          router_bias=True, expert_bias=True, backend="xla", rngs=nnx.Rngs(0))

    model = Model()
    block = model.layers[0].mlp
    block.router.kernel[...] = jnp.asarray(tensors[f"{m}.router.weight"].T)
    block.router_bias[...] = jnp.asarray(tensors[f"{m}.router.bias"], jnp.float32)
    for name in ("gate_up", "down", "gate_up_bias", "down_bias"):
        getattr(block.experts, name)[...] = jnp.asarray(w[name])
    def rel(y, want=ref):
        return np.linalg.norm(np.asarray(y, np.float64) - want) / np.linalg.norm(want)

    assert rel(block(jnp.asarray(x))) < 0.01  # bf16 experts in our layout give gpt-oss's layer
    convert_checkpoint(src, tmp_path / "dst", progress=False)
    assert nvnn.load_experts(model, tmp_path / "dst") == [m]  # NVFP4 experts with their biases
    assert block.mode == "w4a16" and block.experts.down_bias[...].dtype == jnp.bfloat16
    err = rel(block(jnp.asarray(x)))
    gu = w["gate_up_hf"]
    swapped = w | {"gate_up_hf": np.stack([gu[..., 1::2], gu[..., 0::2]], -1).reshape(gu.shape)}
    wrong = gpt_oss_mlp_reference(x, tensors[f"{m}.router.weight"], tensors[f"{m}.router.bias"], swapped, k)
    assert err < 0.1 and rel(wrong) > 4 * err, (err, rel(wrong))  # NVFP4's error, not a wrong layer


def _no_down(t):
    for p in ("_blocks", "_scales", "_bias"):
        del t[f"model.layers.1.mlp.experts.down_proj{p}"]
    return "model.layers.1.mlp.experts.gate_up_proj", "down_proj is missing"


def _blocks_without_scales(t):
    del t["model.layers.0.mlp.experts.down_proj_scales"]
    return "model.layers.0.mlp.experts.down_proj_blocks", "without model.layers.0.mlp.experts.down_proj_scales"


def _nan_scale(t):
    t["model.layers.1.mlp.experts.gate_up_proj_scales"][2, 5, 1] = 255  # E8M0 NaN
    return "model.layers.1.mlp.experts.gate_up_proj_blocks (expert 2)", "non-finite value nan"


def _unequal_i(t):
    n = "model.layers.0.mlp.experts.down_proj_blocks"
    for part in (n, n.replace("blocks", "scales"), n.replace("blocks", "bias")):
        t[part] = t[part][:, :48].copy()
    return "model.layers.0.mlp", "[2I, H] = [64, 64] but down_proj 4 of [H, I] = [48, 32]"


def _bias_shape(t):
    n = "model.layers.0.mlp.experts.gate_up_proj_bias"
    t[n] = t[n][:, :-2].copy()
    return n, "expected [4, 64] (one bias per expert and output feature)"


def _also_per_expert(t):
    t["model.layers.0.mlp.experts.0.up_proj.weight"] = np.zeros((32, 64), BF16)
    return "model.layers.0.mlp", "both per-expert tensors"


def _nan_bias(t):
    n = "model.layers.0.mlp.experts.down_proj_bias"
    t[n][3, 1] = np.nan
    return n + "' (expert 3)", "non-finite bias values"


def _unknown_model_type(t):
    return "model.layers.0.mlp", "model_type ['gpt_oss', 'llama4', 'llama4_text'], got 'mystery_moe'"


@pytest.mark.parametrize("corrupt", [_no_down, _blocks_without_scales, _nan_scale, _unequal_i, _bias_shape,
                                     _nan_bias, _also_per_expert, _unknown_model_type], ids=lambda f: f.__name__[1:])
def test_stacked_bad_input(tmp_path, corrupt):
    tensors, _ = make_stacked("gpt_oss_mxfp4")
    name, msg = corrupt(tensors)
    model_type = "mystery_moe" if corrupt is _unknown_model_type else "gpt_oss"
    src = write_checkpoint(tmp_path / "src", tensors, 2, config={"model_type": model_type})
    for convert in (lambda: convert_checkpoint(src, tmp_path / "dst", progress=False),
                    lambda: load_nvfp4_experts(src, quantize_source=True)):
        with pytest.raises(CheckpointError) as info:
            convert()
        assert name in str(info.value) and msg in str(info.value), str(info.value)
    assert siblings(tmp_path / "dst") == {"src"}
