"""moe_align_gemm: moe_align, then GEMM1 of the pairs' tokens, in one call (decode batches of at most
32 pairs; on the GPU one launch whose CTAs each align for their own row tile). Its outputs must be the
bytes of the two ops it replaces, on the CPU handler, the CUDA kernel and the twin."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jax_nvfp4 as nv
from jax_nvfp4 import ops
from conftest import ffi_call_now, has_gpu
from test_ffi import f32, make_experts, make_x, used_rows

ACT = ops.Activation
# (t, k, e, offset, h, i, tile_m, activation, blocked, k_split, f32 out, paired out): Qwen3-like T = 1 and
# DeepSeek-V3-like T = 4 (32 pairs), ids past the local slice and dropped, every activation, both weight
# orders and K splits.
CASES = [
    (1, 8, 128, 0, 256, 128, 8, ACT.SWIGLU, True, 4, False, True),
    (4, 8, 32, 0, 384, 256, 8, ACT.SWIGLU, True, 2, True, False),
    (3, 2, 5, 2, 256, 64, 8, ACT.RELU2, False, 1, False, False),
    (2, 8, 8, 0, 256, 128, 8, ACT.GEGLU, True, 1, False, True),
    (1, 1, 4, 0, 128, 32, 8, ACT.SWIGLU_OAI, False, 2, False, False),
    (4, 6, 16, 3, 128, 48, 8, ACT.RELU2, True, 4, True, False),
]
# Experts with more than 8 pairs (an expert's tiles after its first), no other shard's ids.
SEVERAL_TILES = [
    (16, 2, 2, 0, 256, 64, 8, ACT.SWIGLU, True, 2, False, False),
    (32, 1, 1, 1, 128, 32, 8, ACT.RELU2, False, 1, False, True),
]


def _ids(seed, t, k, e, offset, foreign=3):
    rng = np.random.default_rng(seed)
    pool = max(e + offset + foreign, k)  # distinct ids a token, `foreign` of them another shard's
    ids = np.stack([rng.permutation(pool)[:k] for _ in range(t)])
    ids[rng.random(ids.shape) < 0.15] = -1  # dropped pairs
    return jnp.asarray(ids, jnp.int32)


def _check(t, k, e, offset, h, i, tile_m, act, blocked, k_split, f32_out, paired, impls=("ffi", "jax"), seed=0,
           foreign=3):
    gated = act != ACT.RELU2
    ex = make_experts(seed + 1, e, h, i, gated=gated)
    w = nv.to_blocked_weights(ex.gate_up) if blocked else ex.gate_up
    ids, x = _ids(seed, t, k, e, offset, foreign), make_x(seed, t, h)
    assert ids.shape == (t, k)
    kw = dict(tile_m=tile_m, activation=act, k_split=k_split, out_dtype=jnp.float32 if f32_out else jnp.bfloat16,
              pairing=ops.Pairing.OUT if paired else ops.Pairing.NONE)
    align = ops.moe_align(ids, e, tile_m=tile_m, expert_offset=offset, impl="jax")
    used = used_rows(align[0], align[1], tile_m)
    for impl in impls:
        want = ops.grouped_gemm(x, w, *align[:2], top_k=k, gather=True, impl=impl, **kw)
        got = ops.moe_align_gemm(ids, x, w, expert_offset=offset, impl=impl, **kw)
        for name, g, a in zip(("sorted_ids", "tile_expert", "pair_to_row"), got[1:], align):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(a), err_msg=f"{impl}: {name}")
        assert got[0].dtype == want.dtype and got[0].shape == want.shape
        # (rows of unused tiles: left unwritten by the CUDA kernel)
        np.testing.assert_array_equal(f32(got[0])[used], f32(want)[used], err_msg=f"{impl}: out")
    local = (np.asarray(ids) >= offset) & (np.asarray(ids) < offset + e)
    assert used.any() == local.any()
    return int(np.asarray(align[1]).max(initial=-1) >= 0 and np.bincount(
        np.asarray(align[1])[np.asarray(align[1]) >= 0]).max())  # the most tiles of one expert


@pytest.mark.parametrize("case", range(len(CASES)))
def test_align_gemm_is_align_then_gemm(case):
    """The outputs are the align's twin's bytes and grouped_gemm's on the same platform (the CPU
    handler where there is no GPU), and the fused op's twin is the two twins."""
    _check(*CASES[case])


@pytest.mark.parametrize("on_gpu", [False, pytest.param(True, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("case", range(len(SEVERAL_TILES)))
def test_align_gemm_experts_with_several_tiles(on_gpu, case):
    """The same where an expert's pairs fill more than one 8-row tile (each CTA finds its tile's owner
    and rows past the expert's first tile)."""
    if on_gpu and not has_gpu():
        pytest.skip("needs an NVIDIA GPU")
    assert _check(*SEVERAL_TILES[case], impls=("ffi",) if on_gpu else ("ffi", "jax"), foreign=0) > 1


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(len(CASES)))
def test_gpu_align_gemm_is_align_then_gemm(case):
    """On the GPU: the mma.sync decode kernel aligning in every CTA gives the align's bytes and
    bitwise the GEMM after a separate align (the same kernel instance reading moe_align's outputs)."""
    _check(*CASES[case], impls=("ffi",))


@settings(max_examples=8, deadline=None)
@given(t=st.integers(1, 4), k=st.integers(1, 8), e=st.sampled_from([1, 3, 8, 40]), offset=st.integers(0, 4),
       seed=st.integers(0, 2**16))
def test_align_gemm_property(t, k, e, offset, seed):
    """Any routing of at most 32 pairs (experts with no pair, with several, ids of other shards)."""
    _check(t, k, e, offset, 128, 32, 8, ACT.SWIGLU, True, 1, False, False, impls=("ffi",), seed=seed)


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_moe_decode_aligns_inside_gemm1(mode, monkeypatch):
    """moe's w4a16 decode (<= 32 pairs, 8-row tiles, GEMM1 of at most ALIGN_GEMM_MAX_CTAS CTAs) calls
    moe_align_gemm, not moe_align (w4a4 keeps moe_align_quant), and SEPARATE_ALIGN gives the separate align
    and the same bytes."""
    ex = nv.to_blocked_experts(make_experts(5, 16, 256, 128))
    x, ids = make_x(2, 4, 256), _ids(3, 4, 8, 16, 0)
    w = jnp.full(ids.shape, 0.125, jnp.float32)
    f = jax.jit(lambda x, i, w, fl: ops.moe(x, ex, i, w, mode=mode, kernel_flags=fl), static_argnums=3)
    fused = f.lower(x, ids, w, 0).as_text()
    separate = f.lower(x, ids, w, int(ops.KernelFlag.SEPARATE_ALIGN)).as_text()
    assert (ops.TARGET_ALIGN_GEMM in fused) == (mode == "w4a16")
    assert ops.TARGET_ALIGN_GEMM not in separate
    assert f"@{ops.TARGET_ALIGN}(" in separate or ops.TARGET_ALIGN_QUANT in separate
    np.testing.assert_array_equal(f32(f(x, ids, w, 0)), f32(f(x, ids, w, int(ops.KernelFlag.SEPARATE_ALIGN))))
    big = make_x(2, 5, 256), _ids(3, 5, 8, 16, 0)  # 40 pairs: the separate align
    assert ops.TARGET_ALIGN_GEMM not in f.lower(big[0], big[1], jnp.ones((5, 8), jnp.float32), 0).as_text()
    monkeypatch.setattr(ops.pipeline, "ALIGN_GEMM_MAX_CTAS", 16)  # (GEMM1: 17 row tiles x 2 slabs or more): separate
    assert ops.TARGET_ALIGN_GEMM not in f.lower(x[:3], ids[:3], w[:3], 0).as_text()  # (new shapes: a new trace)


def test_align_gemm_rejects_what_it_is_not_for():
    ex = make_experts(1, 8, 128, 32)
    x, ids = make_x(1, 5, 128), jnp.zeros((5, 8), jnp.int32)  # 40 pairs: more than the one-warp align
    with pytest.raises(ValueError, match="at most 32 pairs"):
        ops.moe_align_gemm(ids, x, ex.gate_up, tile_m=8, activation=ACT.SWIGLU)
    with pytest.raises(ValueError, match="tile_m must be one of"):
        ops.moe_align_gemm(ids[:2], x[:2], ex.gate_up, tile_m=16, activation=ACT.SWIGLU)
    with pytest.raises(ValueError, match="CHUNK_A"):
        ops.moe_align_gemm(ids[:2], x[:2], ex.gate_up, tile_m=8, pairing=ops.Pairing.CHUNK_A)
    with pytest.raises(ValueError, match="a row per token"):
        ops.moe_align_gemm(ids[:2], x[:3], ex.gate_up, tile_m=8, activation=ACT.SWIGLU)
    with pytest.raises(ValueError, match="a must be"):
        ops.moe_align_gemm(ids[:2], x[:2, :64], ex.gate_up, tile_m=8, activation=ACT.SWIGLU)
    ops.ensure_registered()  # the handler checks them too
    w = ex.gate_up
    alpha = jnp.asarray(w.global_scale, jnp.float32).reshape(-1)

    def call(t, p, tile_m):
        out = (jax.ShapeDtypeStruct((p, 32), jnp.bfloat16), jax.ShapeDtypeStruct((p,), jnp.int32),
               jax.ShapeDtypeStruct((p // tile_m,), jnp.int32), jax.ShapeDtypeStruct((t, 8), jnp.int32))
        return ffi_call_now(ops.TARGET_ALIGN_GEMM, out)(
            ids[:t], x[:t], w.data, w.scales, alpha, jnp.zeros((0,), jnp.float32), jnp.zeros((1,), jnp.float32),
            expert_offset=np.int64(0), activation=np.int64(ACT.SWIGLU), row_scale_mode=np.int64(0),
            tile_m=np.int64(tile_m), k_split=np.int64(1), pairing=np.int64(0), kernel_flags=np.int64(0))

    with pytest.raises(Exception, match="at most 32 token-expert pairs"):
        call(5, 320, 8)
    with pytest.raises(Exception, match="tile_m must be 8"):
        call(2, 256, 16)
    # (no pair: k = 0 on both platforms, the align's outputs empty)
    out = ops.moe_align_gemm(jnp.zeros((3, 0), jnp.int32), x[:3], ex.gate_up, tile_m=8, activation=ACT.SWIGLU)
    assert [o.shape for o in out] == [(0, 32), (0,), (0,), (3, 0)]

