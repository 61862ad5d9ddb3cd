"""grouped_gemm with ``row_scale_mode=QUANT_ROW``: a float32 ``[P, K]`` quantized per row inside the GEMM (w4a4's
GEMM2 at decode, on the GPU without quant_dequant_rows' launch before it). Its output must be the bytes of
quant_dequant_rows then grouped_gemm with ``ROW``, on the CPU handler, the CUDA kernel and the twin."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jax_nvfp4 as nv
from jax_nvfp4 import _ffi_ops as ops
from conftest import has_gpu
from test_ffi import f32, make_experts, make_routing, used_rows
from test_ffi_quant import rows_with_wide_range

pytestmark = pytest.mark.skipif(ops.extension_error() is not None,
                                reason=f"FFI extension not built: {ops.extension_error()}")

RS = ops.RowScale
# (e, t, k, K, N, blocked, k_split, paired): Qwen3-like (K = 768) and DeepSeek-V3-like (K = 2048) decode, the
# 64-K tail of row-major weights, the largest K the GPU takes; natural a (CPU only: the GPU needs it paired).
CASES = [
    (16, 1, 8, 768, 256, True, 4, True),
    (32, 4, 8, 2048, 128, True, 2, True),
    (5, 3, 2, 192, 64, False, 1, True),
    (4, 2, 3, ops.QUANT_ROW_MAX_K, 64, True, 1, True),
    (6, 5, 4, 128, 48, False, 2, True),
]
CPU_ONLY = [(8, 3, 4, 256, 64, True, 1, False)]


def _case(e, t, k, kk, n, blocked, seed=0, short_weights=True):
    """GEMM2 operands as moe makes them: the fp32 intermediate (NaN in the padding rows, which GEMM1 leaves
    unwritten), the align of routing with dropped pairs, and routing weights (some pairs past their end)."""
    ex = make_experts(seed, e, n, kk, gated=False)
    w = nv.to_blocked_weights(ex.down) if blocked else ex.down
    ids, wts = make_routing(seed, t, k, e)
    sorted_ids, tile_expert, _ = ops.moe_align(ids, e, tile_m=8, impl="jax")
    a = rows_with_wide_range(np.random.default_rng(seed), sorted_ids.shape[0], kk, jnp.float32, -60, 60)
    a = jnp.where(sorted_ids[:, None] >= 0, a, jnp.nan)
    row_scale = wts.reshape(-1)[: t * k - 1 if short_weights and t * k > 1 else t * k]
    return w, a, sorted_ids, tile_expert, row_scale


def _check(e, t, k, kk, n, blocked, k_split, paired, impls=("ffi", "jax"), seed=0):
    w, a, sorted_ids, tile_expert, row_scale = _case(e, t, k, kk, n, blocked, seed)
    kw = dict(tile_m=8, k_split=k_split, pairing=ops.Pairing.A if paired else ops.Pairing.NONE)
    used = used_rows(sorted_ids, tile_expert, 8)
    for impl in impls:
        aq, rs = ops.quant_dequant_rows(a, sorted_ids, row_weights=row_scale, impl=impl)
        want = ops.grouped_gemm(aq, w, sorted_ids, tile_expert, row_scale=rs, row_scale_mode=RS.ROW, impl=impl, **kw)
        got = ops.grouped_gemm(a, w, sorted_ids, tile_expert, row_scale=row_scale, row_scale_mode=RS.QUANT_ROW,
                               impl=impl, **kw)
        assert got.dtype == want.dtype == jnp.bfloat16 and got.shape == want.shape
        # (rows of unused tiles: left unwritten by the CUDA kernel)
        np.testing.assert_array_equal(f32(got)[used], f32(want)[used], err_msg=impl)
        assert np.isfinite(f32(got)[used]).all()  # (the padding rows' NaNs never reach an output)
    return f32(got)[used]


@pytest.mark.parametrize("case", CASES + CPU_ONLY)
def test_quant_row_is_quantize_then_gemm(case):
    """The CPU handler (or the CUDA kernel where there is a GPU) and the twin: bitwise the two ops on
    the same platform."""
    if not case[-1] and has_gpu():
        pytest.skip("natural-order a is a CPU case (the GPU needs it paired)")
    assert (_check(*case) != 0).any()


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_gpu_quant_row_is_quantize_then_gemm(case):
    """On the GPU: GEMM2's CTAs quantizing their rows into shared memory give the bytes of the quantize
    kernel then the same GEMM instance reading its output (every K split, both weight orders, the tail)."""
    assert (_check(*case, impls=("ffi",)) != 0).any()


@settings(max_examples=10, deadline=None)
@given(t=st.integers(1, 4), k=st.integers(1, 8), e=st.sampled_from([1, 3, 8, 40]), k_split=st.sampled_from([1, 2, 4]),
       seed=st.integers(0, 2**16))
def test_quant_row_property(t, k, e, k_split, seed):
    """Any decode routing and rows whose magnitudes span the float range."""
    _check(e, t, min(k, e), 256, 32, True, k_split, True, impls=("ffi",), seed=seed)  # (distinct ids a token)


@pytest.mark.parametrize("mode", ["w4a4"])
def test_moe_w4a4_decode_quantizes_inside_gemm2(mode):
    """moe's w4a4 decode on 8-row tiles calls GEMM2 with QUANT_ROW and no quant_dequant_rows for the
    intermediate (x's quantize stays in moe_align_quant); SEPARATE_H_QUANT and JAX_QUANT keep it, with the same
    bytes; 16-row tiles keep it too."""
    ex = nv.to_blocked_experts(make_experts(5, 16, 256, 128))
    ids, w = make_routing(3, 4, 8, 16)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((4, 256)), jnp.bfloat16)
    f = jax.jit(lambda x, i, w, fl, tm: ops.moe(x, ex, i, w, mode=mode, kernel_flags=fl, tile_m=tm),
                static_argnums=(3, 4))
    fused = f.lower(x, ids, w, 0, None).as_text()
    assert ops.TARGET_QUANT not in fused and ops.TARGET_ALIGN_QUANT in fused
    for flag in (ops.KernelFlag.SEPARATE_H_QUANT, ops.KernelFlag.JAX_QUANT):
        assert (ops.TARGET_QUANT in f.lower(x, ids, w, int(flag), None).as_text()) == (flag != ops.KernelFlag.JAX_QUANT)
        np.testing.assert_array_equal(f32(f(x, ids, w, int(flag), None)), f32(f(x, ids, w, 0, None)), err_msg=str(flag))
    assert ops.TARGET_QUANT in f.lower(x, ids, w, 0, 16).as_text()


def test_quant_row_rejects_what_it_is_not_for():
    w, a, sorted_ids, tile_expert, row_scale = _case(4, 2, 2, 128, 32, False)
    gemm = lambda a, **kw: ops.grouped_gemm(a, w, sorted_ids, tile_expert, row_scale=row_scale,  # noqa: E731
                                            row_scale_mode=RS.QUANT_ROW, **{"tile_m": 8, **kw})
    with pytest.raises(ValueError, match="gather=False"):
        gemm(a[:2], gather=True, top_k=2)
    with pytest.raises(ValueError, match="gather=False"):
        gemm(a, pairing=ops.Pairing.CHUNK_A)
    with pytest.raises(ValueError, match="ungathered rows"):
        ops.moe_align_gemm(jnp.zeros((2, 2), jnp.int32), a[:2].astype(jnp.bfloat16), w, tile_m=8,
                           row_scale=row_scale, row_scale_mode=RS.QUANT_ROW)
    ops.ensure_registered()  # the handler checks the dtypes and, on the GPU, what its kernel takes
    alpha = jnp.asarray(w.global_scale, jnp.float32).reshape(-1)

    def call(a, mode, tile_m=8, pairing=ops.Pairing.A, gather=0):
        return jax.ffi.ffi_call(ops.TARGET_GEMM, jax.ShapeDtypeStruct((a.shape[0], 32), jnp.bfloat16))(
            a, w.data, w.scales, alpha, sorted_ids, tile_expert[: a.shape[0] // tile_m], row_scale,
            activation=np.int64(0), row_scale_mode=np.int64(mode), top_k=np.int64(2), gather=np.int64(gather),
            tile_m=np.int64(tile_m), k_split=np.int64(1), pairing=np.int64(pairing), kernel_flags=np.int64(0))

    with pytest.raises(Exception, match="QUANT_ROW.*needs a float32 a"):
        call(a.astype(jnp.bfloat16), RS.QUANT_ROW)
    with pytest.raises(Exception, match="a must be bfloat16"):
        call(a, RS.ROW)
    with pytest.raises(Exception, match="gather = 0"):
        call(a, RS.QUANT_ROW, gather=1)
    with pytest.raises(Exception, match="unknown row_scale_mode"):
        call(a, 5)
    if has_gpu():
        with pytest.raises(Exception, match="on the GPU needs tile_m = 8, paired a"):
            call(a, RS.QUANT_ROW, pairing=ops.Pairing.NONE)
        with pytest.raises(Exception, match="on the GPU needs tile_m = 8"):
            call(a, RS.QUANT_ROW, tile_m=16)


@pytest.mark.gpu
def test_gpu_quant_row_rejects_long_rows():
    w, a, sorted_ids, tile_expert, row_scale = _case(2, 1, 2, ops.QUANT_ROW_MAX_K + 64, 16, False)
    with pytest.raises(Exception, match=f"K <= {ops.QUANT_ROW_MAX_K}"):
        ops.grouped_gemm(a, w, sorted_ids, tile_expert, tile_m=8, row_scale=row_scale,
                         row_scale_mode=RS.QUANT_ROW, pairing=ops.Pairing.A)
