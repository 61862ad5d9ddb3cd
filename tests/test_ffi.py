"""The ``ffi`` backend: XLA FFI custom calls (align, grouped W4A16 GEMM, finalize) against their
pure-JAX twins, the whole MoE against the twin pipeline and the ``xla`` backend, and the golden
files through the public API. CPU tests always run (the C++ handlers); ``@pytest.mark.gpu`` tests
run the CUDA kernels and are skipped without a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import textwrap
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nvfp4 as nv
from jax_nvfp4 import ops
from jax_nvfp4.backends import base
from jax_nvfp4.backends import ffi as ffi_backend
from conftest import ffi_call_now, golden_moe, golden_names, has_gpu, run_on_cpu_devices

pytestmark = pytest.mark.skipif(ops.extension_error() is not None,
                                reason=f"FFI extension not built: {ops.extension_error()}")

BF16 = jnp.bfloat16
ACTS = ("swiglu", "geglu", "relu2", "swiglu_oai")
MODES = ("w4a16", "w4a4")


def relerr(out, ref):
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    ref = np.asarray(jnp.asarray(ref, jnp.float32), np.float64)
    return np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30)


def f32(a):
    return np.asarray(jnp.asarray(a, jnp.float32))


def random_nvfp4(rng, shape, gscale):
    """A random NVFP4 tensor: uniform codes, E4M3 block scales in [1/8, 4], per-expert global scale."""
    *lead, kk = shape
    data = rng.integers(0, 256, (*lead, kk // 2), dtype=np.uint8)
    scales = rng.integers(0x20, 0x48, (*lead, kk // 16), dtype=np.uint8)  # exponents 2^-3 .. 2^1
    return nv.NVFP4Array(jnp.asarray(data), jax.lax.bitcast_convert_type(jnp.asarray(scales), jnp.float8_e4m3fn),
                         jnp.asarray(gscale, jnp.float32))


UNKNOWN_FLAG = 2 * max(int(f) for f in ops.KernelFlag)  # the next bit: no KernelFlag has it


def make_experts(seed, e, h, i, gated=True):
    """Random NVFP4 experts (no quantizer compile): GEMM1 rows [gate; up] (gated) or [up]."""
    rng = np.random.default_rng(seed)
    rows = 2 * i if gated else i
    gu = random_nvfp4(rng, (e, rows, h), rng.uniform(0.5, 2, e) / np.sqrt(h))
    dn = random_nvfp4(rng, (e, h, i), rng.uniform(0.5, 2, e) / np.sqrt(i))
    return nv.NVFP4Experts(gu, dn, gated)


def make_routing(seed, t, k, e_global, drop=0.1):
    """Distinct ids per token, with about `drop` of them replaced by padding (-1)."""
    rng = np.random.default_rng(seed)
    ids = np.asarray([rng.permutation(e_global)[:k] for _ in range(t)], np.int32).reshape(t, k)
    ids = np.where(rng.random((t, k)) < drop, -1, ids).astype(np.int32)
    w = rng.random((t, k)).astype(np.float32)
    return jnp.asarray(ids), jnp.asarray(w)


def routing_with_rows(seed, t, rows):
    """Two slots a token, expert e on rows[e] random tokens (distinct per token), the rest padding."""
    rng = np.random.default_rng(seed)
    ids = np.full((t, 2), -1, np.int32)
    for e, count in enumerate(rows):
        for _ in range(count):
            p = rng.integers(0, 2 * t)
            while ids.flat[p] >= 0 or (ids[p // 2] == e).any():
                p = rng.integers(0, 2 * t)
            ids.flat[p] = e
    return ids, jnp.asarray(rng.random((t, 2)), jnp.float32)


def make_x(seed, t, h):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((t, h)), BF16)


def used_rows(sorted_ids, tile_expert, tile_m):
    te = np.repeat(np.asarray(tile_expert), tile_m)
    return te >= 0


# ------------------------------------------------------------------------------------------
# Build facts shared by C++ and Python

def test_constants_and_decode_selftest():
    ops.check_constants()
    assert ops.extension._ffi._selftest_decode() == 0  # the GPU kernels' E2M1 -> bf16 bit decode, on the host
    regs = ops.extension._ffi.registrations()
    assert set(regs) == {ops.TARGET_ALIGN, ops.TARGET_GEMM, ops.TARGET_FINALIZE, ops.TARGET_QUANT,
                         ops.TARGET_ALIGN_QUANT, ops.TARGET_ALIGN_GEMM, ops.TARGET_CLOCK}
    assert all("cpu" in p for p in regs.values())
    if ops.build_info()["cuda"]:
        assert all("CUDA" in p for p in regs.values())


@pytest.mark.parametrize("n,e,tile", [(6, 4, 8), (13, 7, 16), (100, 3, 64), (5, 256, 32)])
def test_padded_rows_bound(n, e, tile):
    p = ops.padded_rows(n, e, tile)
    assert p % tile == 0 and p >= n + min(n, e) * (tile - 1)
    assert ops.choose_tile_m(1 * 8, 256) == 8 and ops.choose_tile_m(4096 * 8, 256) == 64


@pytest.mark.parametrize("rows_per_expert,tile", [(0.25, 8), (4, 8), (5, 16), (8, 16), (9, 16), (12, 16), (16, 16),
                                                  (24, 16), (25, 16), (32, 16), (33, 64), (128, 64)])
def test_choose_tile_m_fits_most_experts_in_one_tile(rows_per_expert, tile):
    """8-row tiles while they hold the mean plus two standard deviations of an expert's rows,
    then 16-row tiles; past 32 rows on average, the 64-row prefill tiles; with the sm_90a wgmma
    kernels, 32-row tiles from WGMMA_MIN_ROWS rows on and 64-row ones from WGMMA_64_ROWS."""
    pairs = int(rows_per_expert * 32)
    assert ops.choose_tile_m(pairs, 32) == tile
    assert ops.choose_tile_m(pairs, 32, wgmma=True) == (
        64 if rows_per_expert >= ops.WGMMA_64_ROWS else 32 if rows_per_expert >= ops.WGMMA_MIN_ROWS else tile)
    assert (ops.WGMMA_MIN_ROWS, ops.WGMMA_64_ROWS) == (9, 25)  # the measured thresholds (BENCHMARKS.md, session 25)


def test_moe_takes_wgmma_tiles_only_where_the_gpus_run_them():
    """The wgmma tiles from WGMMA_MIN_ROWS need the sm_90a warp-specialized GEMM1 and a chunk-ordered
    intermediate (none on the CPU, nor with NO_WGMMA / NO_WARP_SPECIALIZED / NATURAL_INTERMEDIATE or
    experts in the rows order); the lowered layer shows the tile size that was chosen (16 rows per
    expert: 32-row tiles only there)."""
    ex = make_experts(5, 8, 128, 128)
    blocked = nv.to_blocked_experts(ex)
    sm90a = has_gpu() and ops.chunk_intermediate_supported()
    assert not ops.wgmma_tiles(ex) and not ops.wgmma_tiles(blocked, ops.KernelFlag.NO_WGMMA)
    assert not ops.wgmma_tiles(blocked, ops.KernelFlag.NO_WARP_SPECIALIZED)
    assert not ops.wgmma_tiles(blocked, ops.KernelFlag.NATURAL_INTERMEDIATE)
    assert ops.wgmma_tiles(blocked) == sm90a
    x = make_x(1, 16, 128)
    ids, w = make_routing(2, 16, 8, 8)  # 16 rows per expert
    for experts, tile in ((ex, 16), (blocked, 32 if sm90a else 16)):
        text = jax.jit(lambda x, i, w, experts=experts: ops.moe(x, experts, i, w)).lower(x, ids, w).as_text()
        assert f"tile_m = {tile}" in text


def test_rows96_item_ratio_is_the_expected_items_over_the_tiles():
    """The ratio choose_rows96 weighs: ROWS96's items of up to 96 rows (32-row groups) over 64-row tiles, in
    expectation over Poisson rows an expert; against a sampled mean."""
    rng = np.random.default_rng(0)
    for lam in (0.5, 20, 64, 80, 128, 256, 700):
        n = rng.poisson(lam, 200_000)
        want = (((n + 31) // 32 + 2) // 3).mean() / ((n + 63) // 64).mean()
        assert abs(ops.rows96_item_ratio(lam) - want) < 0.01, (lam, ops.rows96_item_ratio(lam), want)
    assert ops.rows96_item_ratio(0) == 1.0 and abs(ops.rows96_item_ratio(1e5) - 2 / 3) < 1e-3


def test_moe_takes_rows96_where_its_items_cost_less():
    """ROWS96 (on 32-row tiles) is moe's default where its items, at ROWS96_ITEM_COST tiles each, cost less
    than 64-row tiles and the wgmma tiles run (an sm_90a GPU), with gated experts in the blocked order, unless
    NO_ROWS96 (or ROWS96) is given: at 256 and 64 rows an expert, not at 128 (0.81 of the tiles' items) or 32.
    Every lowered call carries the flags moe chose. The backend has moe judge by the experts routed over
    (global_experts, as spread_experts), as for the tile size: 256 rows for each of 4 local experts are 128 for
    each of 8."""
    ex = make_experts(5, 4, 128, 128)
    blocked = nv.to_blocked_experts(ex)
    sm90a = has_gpu() and ops.chunk_intermediate_supported()
    n = 256 * 4
    assert [ops.choose_rows96(r * 4, 4, blocked) for r in (256, 64, 128, 32)] == [sm90a, sm90a, False, False]
    relu2 = nv.to_blocked_experts(make_experts(5, 4, 128, 128, gated=False))
    assert not any((ops.choose_rows96(n, 4, ex), ops.choose_rows96(n, 4, relu2),
                    ops.choose_rows96(n, 4, blocked, ops.KernelFlag.NO_ROWS96)))
    assert ops.choose_tiles(n, 4, blocked) == ((32, ops.KernelFlag.ROWS96) if sm90a else (64, 0))
    x = make_x(1, n // 2, 128)
    ids, w = make_routing(2, n // 2, 2, 4)
    rows96, no_rows96 = int(ops.KernelFlag.ROWS96), int(ops.KernelFlag.NO_ROWS96)

    def flags(f):
        text = jax.jit(f).lower(x, ids, w).as_text()
        got = {int(v) & (rows96 | no_rows96) for v in re.findall(r"kernel_flags = (\d+)", text)}
        assert len(got) == 1, got  # (GEMM2's calls add WS_GEMM2)
        assert f"tile_m = {32 if got == {rows96} else 64}" in text
        return got.pop()

    assert flags(lambda x, i, w: ops.moe(x, blocked, i, w)) == (rows96 if sm90a else 0)
    assert flags(lambda x, i, w: ops.moe(x, blocked, i, w, kernel_flags=no_rows96)) == no_rows96
    for spread, want in ((4, rows96 if sm90a else 0), (8, 0)):
        problem = base.MoEProblem(n // 2, 128, 128, 4, 2, "w4a16", "swiglu", global_experts=spread)
        backend = ffi_backend.FFIBackend()
        assert flags(lambda x, i, w: backend(x, blocked, i, w, problem=problem, local_expert_offset=0)) == want
    np.testing.assert_array_equal(f32(ops.moe(x, blocked, ids, w, kernel_flags=no_rows96)),
                                  f32(ops.moe(x, blocked, ids, w)))


# ------------------------------------------------------------------------------------------
# Op 1: align

ALIGN_CASES = [(0, 4, 8, 0), (1, 1, 8, 0), (7, 8, 8, 0), (64, 2, 16, 4), (1000, 8, 256, 0), (300, 3, 5, 2)]


def _check_align_contract(ids, num_experts, offset, tile_m, sorted_ids, tile_expert, pair_to_row):
    ids = np.asarray(ids).reshape(-1)
    sid, te, p2r = np.asarray(sorted_ids), np.asarray(tile_expert), np.asarray(pair_to_row).reshape(-1)
    local = ids - offset
    valid = (ids >= 0) & (local >= 0) & (local < num_experts)
    assert (p2r[~valid] == -1).all()
    assert (sid[p2r[valid]] == np.flatnonzero(valid)).all()  # rows and pairs are inverse maps
    assert (sid >= 0).sum() == valid.sum()
    rows_e = np.repeat(te, tile_m)[p2r[valid]]
    assert (rows_e == local[valid]).all()  # each pair sits in a tile of its expert
    used = te[te >= 0]
    assert (np.diff(used) >= 0).all() and (te[len(used):] == -1).all()  # ascending, then unused


@pytest.mark.parametrize("tile_m", ops.TILE_MS)
@pytest.mark.parametrize("t,k,e,offset", ALIGN_CASES)
def test_align_matches_twin(t, k, e, offset, tile_m):
    rng = np.random.default_rng(t * 7 + k)
    ids = jnp.asarray(rng.integers(-2, e + offset + 3, (t, k)), jnp.int32)  # padding and foreign ids
    got = ops.moe_align(ids, e, tile_m=tile_m, expert_offset=offset, impl="ffi")
    want = ops.moe_align(ids, e, tile_m=tile_m, expert_offset=offset, impl="jax")
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    _check_align_contract(ids, e, offset, tile_m, *got)


# ------------------------------------------------------------------------------------------
# Op 2: grouped GEMM (every epilogue)

GEMM_CASES = [  # (activation, gather, row_scale_mode, out_dtype)
    (ops.Activation.SWIGLU, True, ops.RowScale.NONE, BF16),
    (ops.Activation.GEGLU, True, ops.RowScale.TOKEN, BF16),
    (ops.Activation.SWIGLU_OAI, True, ops.RowScale.NONE, jnp.float32),
    (ops.Activation.RELU2, True, ops.RowScale.TOKEN, jnp.float32),
    (ops.Activation.IDENTITY, False, ops.RowScale.PAIR, BF16),
    (ops.Activation.IDENTITY, False, ops.RowScale.ROW, BF16),
]


def _gemm_problem(act, gather, mode, t=23, k=3, e=5, h=64, n=48, tile_m=8, seed=0):
    rng = np.random.default_rng(seed)
    gated = act in (ops.Activation.SWIGLU, ops.Activation.GEGLU, ops.Activation.SWIGLU_OAI)
    rows = 2 * n if gated else n
    w = random_nvfp4(rng, (e, rows, h), rng.uniform(0.5, 2, e) / np.sqrt(h))
    ids = jnp.asarray(rng.integers(-1, e, (t, k)), jnp.int32)
    sorted_ids, tile_expert, _ = ops.moe_align(ids, e, tile_m=tile_m, impl="jax")
    p = sorted_ids.shape[0]
    a_rows = t if gather else p
    a = jnp.asarray(rng.standard_normal((a_rows, h)), BF16)
    rs_len = {ops.RowScale.NONE: 1, ops.RowScale.TOKEN: t, ops.RowScale.PAIR: t * k, ops.RowScale.ROW: p}[mode]
    row_scale = jnp.asarray(rng.uniform(0.5, 2, rs_len), jnp.float32)
    return a, w, sorted_ids, tile_expert, row_scale


def _run_gemm(impl, a, w, sorted_ids, tile_expert, row_scale, act, gather, mode, out_dtype, tile_m, k,
              k_split=None, kernel_flags=0, pairing=ops.Pairing.NONE):
    return ops.grouped_gemm(a, w, sorted_ids, tile_expert, tile_m=tile_m, activation=act, top_k=k, gather=gather,
                            row_scale=row_scale if mode != ops.RowScale.NONE else None, row_scale_mode=mode,
                            out_dtype=out_dtype, k_split=k_split, kernel_flags=kernel_flags, pairing=pairing,
                            impl=impl)


@pytest.mark.usefixtures("on_cpu")
@pytest.mark.parametrize("act,gather,mode,out_dtype", GEMM_CASES)
def test_gemm_matches_twin(act, gather, mode, out_dtype):
    a, w, sid, te, rs = _gemm_problem(act, gather, mode)
    args = (a, w, sid, te, rs, act, gather, mode, out_dtype, 8, 3)
    got, want = _run_gemm("ffi", *args), _run_gemm("jax", *args)
    assert got.dtype == jnp.dtype(out_dtype) and got.shape == want.shape
    assert relerr(got, want) < 1e-5  # same math; only the fp32 summation order differs
    assert (f32(got)[np.asarray(sid) < 0] == 0).all()  # padding rows are zero


def _direct_gemm(a, w, sid, te, row_scale, n_out, activation, pairing=0, *, scales=None, alpha=None, bias=None,
                 tile_m=8, k_split=1, kernel_flags=0):
    """grouped_gemm's custom call itself, past the Python checks: the handler's own (gathered, top_k 3, bf16
    [P, n_out] out; w's scales and global scale, no bias, 8-row tiles and no K split unless given)."""
    return ffi_call_now(ops.TARGET_GEMM, jax.ShapeDtypeStruct((sid.shape[0], n_out), BF16), vmap_method="sequential")(
        a, w.data, w.scales if scales is None else scales, w.global_scale if alpha is None else alpha,
        jnp.zeros((0,), jnp.float32) if bias is None else bias, sid, te, row_scale,
        activation=np.int64(activation), row_scale_mode=np.int64(0), top_k=np.int64(3), gather=np.int64(1),
        tile_m=np.int64(tile_m), k_split=np.int64(k_split), pairing=np.int64(pairing),
        kernel_flags=np.int64(kernel_flags))


def test_gemm_rejects_bad_shapes_with_named_arguments():
    a, w, sid, te, rs = _gemm_problem(ops.Activation.SWIGLU, True, ops.RowScale.NONE)

    def call(a=a, act=1, **kw):  # the handler on this problem, with the arguments given changed
        return _direct_gemm(a, w, sid, te, rs, 48, act, **kw)

    ops.ensure_registered()
    with pytest.raises(Exception, match="does not match K"):  # (K = 32 is also short of the GPU's K chunk)
        call(a=a[:, :32])
    if jax.default_backend() == "gpu":  # the platform's own limits, named once the operands agree
        a32, w32, _, _, _ = _gemm_problem(ops.Activation.SWIGLU, True, ops.RowScale.NONE, h=32)
        with pytest.raises(Exception, match=rf"K = 32 \(a.shape\[1\]\) must be a multiple of "
                                            rf"{ops.CUDA_K_MULTIPLE} on this platform"):
            _direct_gemm(a32, w32, sid, te, rs, 48, ops.Activation.SWIGLU)
    with pytest.raises(Exception, match=r"bias must be \[E, N\] = \[5, 96\] \(or \[0\]: none\)"):
        call(bias=jnp.zeros((5, 48), jnp.float32))
    with pytest.raises(Exception, match="bias must be float32 or bfloat16"):
        call(bias=jnp.zeros((5, 96), jnp.float16))
    with pytest.raises(ValueError, match=r"grouped_gemm: bias must be a float \[E, N\]"):
        ops.grouped_gemm(a, w, sid, te, tile_m=8, activation=ops.Activation.SWIGLU, top_k=3, gather=True,
                         bias=jnp.zeros((5, 48)))
    with pytest.raises(Exception, match="alpha must be"):
        call(alpha=w.global_scale[:2])
    with pytest.raises(Exception, match="w_scales must be float8_e4m3fn"):
        call(scales=w.scales.astype(BF16))
    np.testing.assert_array_equal(f32(call(scales=jax.lax.bitcast_convert_type(w.scales, jnp.uint8))),
                                  f32(call()))  # the scale bits as uint8 are accepted too
    with pytest.raises(Exception, match="tile_m must be"):
        call(tile_m=12)
    with pytest.raises(Exception, match="K .a.shape.1.. must be positive"):
        call(a=a[:, :0])
    with pytest.raises(Exception, match="pairing must combine"):
        call(pairing=32)
    with pytest.raises(Exception, match="unknown activation"):
        call(act=9)
    with pytest.raises(Exception, match="must be a multiple of tile_m = 16"):
        call(tile_m=16)
    with pytest.raises(Exception, match="k_split must be 1, 2 or 4, got 3"):
        call(k_split=3)
    with pytest.raises(Exception, match="k_split > 1 needs tile_m <= 16"):
        call(tile_m=32, k_split=2)
    with pytest.raises(Exception, match="kernel_flags must be a combination"):
        call(kernel_flags=UNKNOWN_FLAG)
    with pytest.raises(Exception, match="kernel_flags must be a combination"):
        call(kernel_flags=256)  # a retired bit (PAIRED_INPUT) inside the range of the others
    with pytest.raises(ValueError, match="kernel_flags must combine KernelFlag bits"):
        ops.grouped_gemm(a, w, sid, te, tile_m=8, activation=ops.Activation.SWIGLU, top_k=3, gather=True,
                         kernel_flags=-1)
    with pytest.raises(ValueError, match="k_split must be one of"):
        ops.grouped_gemm(a, w, sid, te, tile_m=32, activation=ops.Activation.SWIGLU, top_k=3, gather=True,
                         k_split=4)


def test_gemm_takes_bf16_biases_without_a_conversion():
    """A bf16 bias (gpt-oss checkpoints) goes to the kernels as it is, no conversion pass per call; other floats
    are converted to float32."""
    a, w, sid, te, _ = _gemm_problem(ops.Activation.SWIGLU, True, ops.RowScale.NONE)
    def lowered(dtype):
        return jax.jit(lambda b: ops.grouped_gemm(a, w, sid, te, tile_m=8, activation=ops.Activation.SWIGLU,
                                                  top_k=3, gather=True, bias=b)).lower(
            jax.ShapeDtypeStruct((5, 96), dtype)).as_text()
    assert "stablehlo.convert" not in lowered(BF16)
    assert re.search(r"custom_call @jax_nvfp4_grouped_gemm.*tensor<5x96xbf16>", lowered(BF16))
    assert re.search(r"custom_call @jax_nvfp4_grouped_gemm.*tensor<5x96xf32>", lowered(jnp.float16))


def test_align_takes_kernel_flags_and_checks_them():
    ids = jnp.asarray([[0, 3], [3, -1]], jnp.int32)
    flags = int(ops.KernelFlag.ALIGN_ONE_CTA)
    f = jax.jit(lambda i: ops.moe_align(i, 4, tile_m=8, kernel_flags=flags))
    assert "kernel_flags = 524288" in f.lower(ids).as_text()
    for g, w in zip(f(ids), ops.moe_align(ids, 4, tile_m=8, impl="jax")):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    ops.ensure_registered()
    out = (jax.ShapeDtypeStruct((32,), jnp.int32), jax.ShapeDtypeStruct((4,), jnp.int32),
           jax.ShapeDtypeStruct((2, 2), jnp.int32), jax.ShapeDtypeStruct((0,), jnp.int32))
    call = ffi_call_now(ops.TARGET_ALIGN, out)
    with pytest.raises(Exception, match="kernel_flags must be a combination"):
        call(ids, num_experts=np.int64(4), expert_offset=np.int64(0), tile_m=np.int64(8),
             kernel_flags=np.int64(UNKNOWN_FLAG))
    # The workspace (the GPU grid align's counts) is sized by the pairs, on both platforms.
    wrong = ffi_call_now(ops.TARGET_ALIGN, out[:3] + (jax.ShapeDtypeStruct((16,), jnp.int32),))
    with pytest.raises(Exception, match=r"workspace must be int32 \[0\] for 4 pairs, got \[16\]"):
        wrong(ids, num_experts=np.int64(4), expert_offset=np.int64(0), tile_m=np.int64(8), kernel_flags=np.int64(0))
    big = jnp.zeros((ops.ALIGN_GRID_MIN_PAIRS, 1), jnp.int32)
    grid_out = (jax.ShapeDtypeStruct((ops.padded_rows(ops.ALIGN_GRID_MIN_PAIRS, 4, 8),), jnp.int32),
                jax.ShapeDtypeStruct((ops.padded_rows(ops.ALIGN_GRID_MIN_PAIRS, 4, 8) // 8,), jnp.int32),
                jax.ShapeDtypeStruct(big.shape, jnp.int32), jax.ShapeDtypeStruct((0,), jnp.int32))
    with pytest.raises(Exception, match=rf"workspace must be int32 \[{ops.ALIGN_GRID_MAX_SLOTS}\] for 2048 pairs"):
        ffi_call_now(ops.TARGET_ALIGN, grid_out)(big, num_experts=np.int64(4), expert_offset=np.int64(0),
                                                 tile_m=np.int64(8), kernel_flags=np.int64(0))


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_paired_intermediate_is_bitwise_the_natural_order_on_the_cpu(mode):
    """On mma.sync tiles (8-32 rows) moe's GEMM1 writes the paired order and GEMM2 reads it
    (pairing attributes of the two calls, in order); KernelFlag.NATURAL_INTERMEDIATE and 64-row
    tiles keep the natural order, and so does an intermediate with a 64-K tail (I = 64; gpt-oss's 2880), whose
    paired GEMM2 would have to stream its weights. The layer's output does not change by a bit."""
    x = make_x(1, 7, 128)
    ids, w = make_routing(2, 7, 3, 8)
    natural, no_wgmma = int(ops.KernelFlag.NATURAL_INTERMEDIATE), int(ops.KernelFlag.NO_WGMMA)
    paired, plain = ["2", "1"], ["0", "0"]  # (I % 128 == 0: wgmma tiles take the chunk order, unless NO_WGMMA)
    for inter, cases in ((128, [(0, None, paired), (no_wgmma, 32, paired), (natural, None, plain)]),
                         (64, [(0, None, plain), (0, 32, plain), (natural, None, plain), (0, 64, plain)])):
        ex = make_experts(5, 8, 128, inter)
        f = jax.jit(lambda x, i, w, flags, tm, ex=ex: ops.moe_forward(x, ex, i, w, mode=mode, kernel_flags=flags,
                                                                      tile_m=tm), static_argnums=(3, 4))
        want = f32(f(x, ids, w, natural, None))
        for flags, tm, pairing in cases:
            assert re.findall(r"pairing = (\d)", f.lower(x, ids, w, flags, tm).as_text()) == pairing, (inter, flags)
            np.testing.assert_array_equal(f32(f(x, ids, w, flags, tm)), want)


@pytest.mark.usefixtures("on_cpu")
def test_kernel_flags_reach_the_custom_call_and_keep_the_function():
    """Kernel variants are a GPU choice: the attribute is in the lowered call, the CPU result is the same."""
    ex = make_experts(5, 4, 64, 32)
    x = make_x(1, 6, 64)
    ids, w = make_routing(2, 6, 2, 4)
    flags = int(ops.KernelFlag.NO_WGMMA | ops.KernelFlag.WGMMA_TWO_BLOCKS)
    f = jax.jit(lambda x, i, w: ops.moe(x, ex, i, w, kernel_flags=flags))
    assert "kernel_flags = 6" in f.lower(x, ids, w).as_text()
    np.testing.assert_array_equal(f32(f(x, ids, w)), f32(ops.moe(x, ex, ids, w)))
    assert ffi_backend.FFIBackend(flags).kernel_flags == flags
    with pytest.raises(ValueError, match="kernel_flags must combine"):
        ffi_backend.FFIBackend(UNKNOWN_FLAG)


def test_moe_passes_the_expert_arrays_without_copies():
    """The custom calls take the NVFP4 arrays as they are: no per-call bitcast-convert (a copy of
    every expert's scales, on the CPU at least) or other op on the weights in the compiled layer."""
    ex = make_experts(5, 4, 64, 32)
    x = make_x(1, 6, 64)
    ids, w = make_routing(2, 6, 2, 4)
    hlo = jax.jit(lambda x, i, w, ex: ops.moe(x, ex, i, w)).lower(x, ids, w, ex).compile().as_text()
    assert "bitcast-convert" not in hlo
    # (6 x 2 pairs: GEMM1 aligns in its CTAs, moe_align_gemm)
    assert hlo.count("custom_call_target=\"jax_nvfp4_grouped_gemm\"") == 1
    assert hlo.count("custom_call_target=\"jax_nvfp4_moe_align_gemm\"") == 1


def test_backend_k_split_reaches_decode_tiles_only():
    """FFIBackend(k_split=s) fixes the split of decode tiles (in the lowered GEMM calls) and leaves
    larger tiles, which never split, alone instead of failing."""
    ex = make_experts(5, 4, 128, 64)  # (H, I multiples of CUDA_K_MULTIPLE: the test runs on GPUs too)
    b = ffi_backend.FFIBackend(k_split=4)
    for t, want in ((2, "k_split = 4"), (300, "k_split = 1")):  # tile_m 8 (decode), 64 (prefill)
        x = make_x(1, t, 128)
        ids, w = make_routing(2, t, 2, 4)
        problem = base.MoEProblem(t, 128, 64, 4, 2, "w4a16", "swiglu")
        f = jax.jit(lambda x, i, w: b(x, ex, i, w, problem=problem, local_expert_offset=0))
        text = f.lower(x, ids, w).as_text()
        assert text.count(want) == 2, (t, want)
        got, default = f32(f(x, ids, w)), f32(ops.moe(x, ex, ids, w))
        if has_gpu():  # another K split sums in another order there
            assert relerr(got, default) < 1e-2
        else:  # the CPU handler: the same function
            np.testing.assert_array_equal(got, default)
    for bad in (3, (1, 3), (1, 2, 4), "2"):
        with pytest.raises(ValueError, match="k_split must be None, one of"):
            ffi_backend.FFIBackend(k_split=bad)


def test_moe_batch_invariant_fixes_the_k_split():
    """moe(batch_invariant=True) runs the ffi backend with every GEMM's K split 1 (in the lowered calls, where the
    default splits GEMM1's K 1024; also over an FFIBackend instance's split), the same function as the default layer
    on the CPU; other backends, bf16 experts are errors that say so; a traced offset (shard_map's) runs it too."""
    ex = make_experts(5, 4, 1024, 256)
    x = make_x(1, 2, 1024)
    ids, w = make_routing(2, 2, 2, 4, drop=0)

    def layer(**kw):
        f = jax.jit(lambda x, i, w: nv.moe(x, ex, topk_ids=i, topk_weights=w, **kw))
        return set(re.findall(r"k_split = (\d+)", f.lower(x, ids, w).as_text())), f32(f(x, ids, w))

    (split, want), (split_inv, got) = layer(backend="ffi"), layer(batch_invariant=True)
    assert split != {"1"} and split_inv == {"1"}, (split, split_inv)
    np.testing.assert_array_equal(got, want)
    # a backend instance's options (k_split 4 here) for this call, and batch_invariant's K split 1 over them
    four = ffi_backend.FFIBackend(k_split=4)
    assert layer(backend=four)[0] == {"4"} and layer(backend=four, batch_invariant=True)[0] == {"1"}
    with pytest.raises(ValueError, match="batch_invariant=True runs on backend 'ffi'"):
        nv.moe(x, ex, topk_ids=ids, topk_weights=w, backend="xla", batch_invariant=True)
    bf16 = nv.BF16Experts(jnp.zeros((4, 512, 1024), BF16), jnp.zeros((4, 1024, 256), BF16))
    with pytest.raises(ValueError, match="batch_invariant=True runs on backend 'ffi'"):
        nv.moe(x, bf16, topk_ids=ids, topk_weights=w, batch_invariant=True)
    traced = jax.jit(lambda o: nv.moe(x, ex, topk_ids=ids, topk_weights=w, local_expert_offset=o,
                                      batch_invariant=True))
    assert set(re.findall(r"k_split = (\d+)", traced.lower(jnp.int32(0)).as_text())) == {"1"}
    np.testing.assert_array_equal(f32(traced(jnp.int32(0))), got)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_gpu_moe_batch_invariant_probes_keep_their_bytes(mode):
    """moe(batch_invariant=True), blocked weights: 4 probe tokens give the bytes they give alone as the first rows
    of batches of 16-1024 tokens (8 experts, top-4: 8-, 16-, 32- and 64-row tiles, mma.sync and wgmma, ROWS96 at
    1024), where the default layer's decode K split changes with the batch."""
    if not has_gpu():
        pytest.skip("needs a GPU")
    ex = nv.to_blocked_experts(make_experts(21, 8, 1024, 512))
    x = make_x(22, 1024, 1024)
    ids, w = make_routing(23, 1024, 4, 8, drop=0)
    run = jax.jit(lambda x, i, w: nv.moe(x, ex, topk_ids=i, topk_weights=w, mode=mode, batch_invariant=True))
    want = f32(run(x[:4], ids[:4], w[:4]))
    assert np.isfinite(want).all() and (want != 0).any()
    for t in (16, 64, 256, 1024):
        np.testing.assert_array_equal(f32(run(x[:t], ids[:t], w[:t]))[:4], want, err_msg=f"T={t}")


def test_k_split_pair_sets_each_gemm():
    """k_split=(s1, s2) fixes GEMM1's split to s1 and GEMM2's to s2 (in the lowered calls, in order),
    and the layer is the same function as with any other split."""
    ex = make_experts(5, 4, 256, 64)
    x = make_x(1, 3, 256)
    ids, w = make_routing(2, 3, 2, 4)
    with pytest.raises(ValueError, match="k_split must be None, one of"):
        ops.moe(x, ex, ids, w, k_split=[1, 3])
    for ks in ((4, 1), (1, 2), [2, 1]):
        f = jax.jit(lambda x, i, w, ks=ks: ops.moe(x, ex, i, w, tile_m=8, k_split=ks))
        text = f.lower(x, ids, w).as_text()
        at = [text.find(f"k_split = {s}") for s in ks]
        assert -1 < at[0] and (at[0] < at[1] if ks[0] != ks[1] else True), (ks, at)
        np.testing.assert_allclose(f32(f(x, ids, w)), f32(ops.moe(x, ex, ids, w, tile_m=8, k_split=1)),
                                   rtol=2e-2, atol=2e-2)


def test_choose_k_split_on_the_benchmark_shapes():
    # Decode (one 8-row tile per expert hit): split K until ~1024 CTAs while each warp keeps
    # 2048 K, or 256 K while the GEMM has fewer than 264 CTAs.
    assert ops.choose_k_split(8, 2048, 7168, 8) == 2  # DeepSeek-V3 shard GEMM1, T = 1: 256 CTAs, not 1792 K
    assert ops.choose_k_split(8, 7168, 2048, 8) == 1  # ... GEMM2: 896 CTAs unsplit, 1024 K split
    assert ops.choose_k_split(8, 768, 2048, 8) == 4  # Qwen3-30B-A3B GEMM1: 96, then 192 CTAs
    assert ops.choose_k_split(8, 2048, 768, 8, gated=False) == 2  # ... GEMM2: 384 K per warp, not 192
    # Non-gated tiles (8 CTAs an SM) split down to 256 K until 528 CTAs: gpt-oss's GEMM2 (4 experts, H = I = 2944)
    # at T = 1 (184, 368, then 736 CTAs) and T = 2 (368, then 736), not at T = 4 (736 unsplit); as gated, half.
    assert [ops.choose_k_split(t, 2944, 2944, 8, gated=False) for t in (3.9, 7.8, 15.0)] == [4, 2, 1]
    assert [ops.choose_k_split(t, 2944, 2944, 8) for t in (3.9, 7.8, 15.0)] == [2, 1, 1]
    assert ops.choose_k_split(28.3, 768, 2048, 8) == 1  # ... GEMM1 at T = 4: 340 CTAs, 1024 K split
    assert ops.choose_k_split(512, 2048, 7168, 8) == 1  # CTAs enough without splitting
    assert ops.choose_k_split(8, 2048, 7168, 64) == 1  # prefill tiles never split
    # moe counts the tiles the routing is expected to fill, not the grid's upper bound: DeepSeek-V3
    # at T = 4 (32 pairs over 32 experts: 32 tiles, ~20 used) splits GEMM1 in two.
    assert ops.choose_k_split(ops.expected_tiles(32, 32, 8), 2048, 7168, 8) == 2
    assert ops.choose_k_split(ops.padded_rows(32, 32, 8) // 8, 2048, 7168, 8) == 1


def test_moe_splits_each_gemm_from_the_expected_tiles(monkeypatch):
    """moe asks choose_k_split once per GEMM with the expected tiles and that GEMM's (n_out, K):
    GEMM1 (I, H, gated), GEMM2 (H, I, not gated); the answers reach the lowered calls."""
    calls = []

    def fake(tiles, n_out, k, tile_m, gated=True):
        calls.append((tiles, n_out, k, tile_m, gated))
        return 2 if n_out == 64 else 4

    monkeypatch.setattr(ops.pipeline, "choose_k_split", fake)
    ex = make_experts(5, 16, 512, 64)
    x = make_x(1, 3, 512)
    ids, w = make_routing(2, 3, 4, 16)
    text = jax.jit(lambda x, i, w: ops.moe(x, ex, i, w)).lower(x, ids, w).as_text()
    tiles = ops.expected_tiles(12, 16, 8)
    assert calls == [(tiles, 64, 512, 8, True), (tiles, 512, 64, 8, False)]
    assert text.count("k_split = 2") == 1 and text.count("k_split = 4") == 1


@pytest.mark.parametrize("n,e,tile_m", [(1, 8, 8), (32, 32, 8), (512, 32, 16), (512, 128, 8), (40, 1, 16), (0, 4, 8)])
def test_expected_tiles_matches_a_sampled_routing(n, e, tile_m):
    """The Poisson estimate of the row tiles a uniform routing fills, against sampled routings
    (and the grid's upper bound P // tile_m, which it never exceeds)."""
    rng = np.random.default_rng(n + e)
    counts = np.stack([np.bincount(rng.integers(0, e, n), minlength=e) for _ in range(2000)])
    sampled = (-(-counts // tile_m)).sum(1).mean()
    est = ops.expected_tiles(n, e, tile_m)
    assert est <= ops.padded_rows(n, e, tile_m) // tile_m
    assert abs(est - sampled) <= 0.05 * sampled + 0.1, (est, sampled)


# ------------------------------------------------------------------------------------------
# Op 3: finalize

def test_finalize_matches_twin():
    rng = np.random.default_rng(3)
    y = jnp.asarray(rng.standard_normal((40, 64)), BF16)
    p2r = jnp.asarray(rng.integers(-1, 40, (9, 4)), jnp.int32)
    np.testing.assert_array_equal(f32(ops.moe_finalize(y, p2r)), f32(ops.moe_finalize(y, p2r, impl="jax")))


# ------------------------------------------------------------------------------------------
# Benchmark clock (runs on the default device: the CPU here, the GPU on a GPU machine)

def test_device_clock_brackets_the_work_between_two_readings():
    ex = make_experts(1, 8, 512, 256)
    x = make_x(0, 64, 512)
    ids, w = make_routing(0, 64, 2, 8)

    @functools.partial(jax.jit, static_argnums=1)
    def timed(x, layers):
        x, t0 = ops.device_clock(x)
        for _ in range(layers):
            x = ops.moe(x, ex, ids, w)
        x, t1 = ops.device_clock(x)
        return x, t0, t1

    def span(layers):  # output, best of 3 (t1 - t0)
        runs = [timed(x, layers) for _ in range(3)]
        assert all(t.dtype == jnp.uint32 and t.shape == (2,) and ops.clock_ns(t) > 0 for _, t, _ in runs)
        return runs[0][0], min(ops.clock_ns(t1) - ops.clock_ns(t0) for _, t0, t1 in runs)

    y0, idle = span(0)
    y4, busy = span(4)
    np.testing.assert_array_equal(f32(y0), f32(x))  # passes x through unchanged
    want = x
    for _ in range(4):
        want = ops.moe(want, ex, ids, w)
    np.testing.assert_array_equal(f32(y4), f32(want))
    assert 0 <= idle < busy  # the readings bracket the 4 layers


@pytest.mark.gpu
def test_gpu_device_clock_brackets_the_work_between_two_readings():
    """The same on the GPU (%globaltimer), in the GPU stage of scripts/gpu_ffi.sh."""
    if not has_gpu():
        pytest.skip("needs an NVIDIA GPU")
    test_device_clock_brackets_the_work_between_two_readings()


# ------------------------------------------------------------------------------------------
# The whole MoE: ffi == pure-JAX twin pipeline, and == backend "xla"

@pytest.fixture(scope="module")
def experts_cpu():
    """Small H/I to keep the CPU handlers fast (I = 32: the CUDA kernels take multiples of 64, so the tests that
    use them run on_cpu); E from 8 to 256."""
    return {(e, g): make_experts(e + g, e, 64, 32, gated=g) for e in (8, 64, 256) for g in (True, False)}


MOE_CASES = [  # (tokens, experts, top_k, activation): every activation, T from 1 to 4096, E 8..256, k 1..8
    (1, 8, 1, "swiglu"),
    (7, 8, 8, "geglu"),
    (64, 256, 8, "swiglu"),
    (64, 64, 4, "relu2"),
    (64, 8, 2, "swiglu_oai"),
    (1000, 256, 8, "swiglu"),
    (4096, 8, 2, "swiglu"),
]


@pytest.mark.usefixtures("on_cpu")
@pytest.mark.parametrize("t,e,k,act", MOE_CASES)
def test_moe_matches_twin_and_xla(experts_cpu, t, e, k, act):
    ex = experts_cpu[(e, act != "relu2")]
    x = make_x(t, t, 64)
    ids, w = make_routing(t + e, t, k, e)
    got = jax.jit(lambda x, i, w: ops.moe(x, ex, i, w, activation=act))(x, ids, w)
    assert got.dtype == BF16 and got.shape == (t, 64)
    twin = jax.jit(lambda x, i, w: ops.moe(x, ex, i, w, activation=act, impl="jax"))(x, ids, w)
    assert relerr(got, twin) < 1e-5  # the C++ handlers compute the twin's function
    ref = nv.moe(x, ex, topk_ids=ids, topk_weights=w, activation=act, backend="xla")
    assert relerr(got, ref) < 1e-2


@pytest.mark.usefixtures("on_cpu")
def test_moe_w4a4_matches_xla_and_grad(experts_cpu):
    """w4a4 (per-token NVFP4 activations) against backend "xla", forward and gradients (one shape:
    the quantizer dominates compile time on the CPU)."""
    ex = experts_cpu[(64, True)]
    x = make_x(7, 7, 64)
    ids, w = make_routing(7, 7, 4, 64)

    def loss(backend):
        def f(x, w):
            out = nv.moe(x, ex, topk_ids=ids, topk_weights=w, mode="w4a4", backend=backend)
            return jnp.sum(out.astype(jnp.float32) ** 2), out
        return jax.jit(jax.grad(f, argnums=(0, 1), has_aux=True))
    (gx, gw), got = loss("ffi")(x, w)
    (rx, rw), ref = loss("xla")(x, w)
    assert relerr(got, ref) < 1e-2
    assert relerr(gw, rw) < 2e-2
    assert not f32(gx).any() and not f32(rx).any()  # x is rounded onto the NVFP4 grid, as in "xla"


@pytest.mark.usefixtures("on_cpu")
def test_empty_batch(experts_cpu):
    ex = experts_cpu[(8, True)]
    out = nv.moe(jnp.zeros((0, 64), BF16), ex, topk_ids=jnp.zeros((0, 2), jnp.int32),
                 topk_weights=jnp.zeros((0, 2), jnp.float32), backend="ffi")
    assert out.shape == (0, 64) and out.dtype == BF16


@pytest.mark.usefixtures("on_cpu")
def test_experts_without_tokens_and_foreign_ids(experts_cpu):
    ex = experts_cpu[(64, True)]
    x = make_x(5, 16, 64)
    ids = jnp.asarray(np.random.default_rng(5).integers(-3, 6, (16, 3)), jnp.int32)  # experts 0..5 only
    w = jnp.ones((16, 3), jnp.float32)
    ref = nv.moe(x, ex, topk_ids=ids, topk_weights=w, backend="xla")
    assert relerr(nv.moe(x, ex, topk_ids=ids, topk_weights=w, backend="ffi"), ref) < 1e-2
    # Only padding / other shards' ids: exactly zero.
    z = nv.moe(x, ex, topk_ids=jnp.full((16, 3), -1, jnp.int32), topk_weights=w, backend="ffi")
    assert not f32(z).any()


@pytest.mark.usefixtures("on_cpu")
def test_expert_parallel_shards_sum_to_full(experts_cpu):
    full = experts_cpu[(8, True)]
    x = make_x(8, 33, 64)
    ids, w = make_routing(8, 33, 3, 8)
    ref = f32(nv.moe(x, full, topk_ids=ids, topk_weights=w, backend="ffi"))
    halves = [jax.tree_util.tree_map(lambda a: a[s], full) for s in (slice(0, 4), slice(4, 8))]
    parts = [f32(nv.moe(x, h, topk_ids=ids, topk_weights=w, local_expert_offset=o, backend="ffi"))
             for h, o in zip(halves, (0, 4))]
    assert relerr(parts[0] + parts[1], ref) < 1e-2
    # A traced offset (as from lax.axis_index under shard_map) gives the same shard output.
    traced = jax.jit(lambda o: ops.moe(x, halves[1], ids, w, local_expert_offset=o))(jnp.int32(4))
    np.testing.assert_array_equal(f32(traced), parts[1])


# Expert parallelism as users write it (its own process: the CPU device count is fixed when JAX starts).
# Its setup: 8 experts (H 128, I 64), 12 tokens, top-2 routing.
_EP_SETUP = textwrap.dedent("""
    import re, jax, jax.numpy as jnp, numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    import jax_nvfp4 as nv
    from jax_nvfp4 import ops
    k = jax.random.split(jax.random.key(0), 4)
    ex = nv.quantize_experts(jax.random.normal(k[0], (8, 128, 128), jnp.bfloat16),
                             jax.random.normal(k[1], (8, 128, 64), jnp.bfloat16))
    x = jax.random.normal(k[2], (12, 128), jnp.bfloat16)
    logits = jax.random.normal(k[3], (12, 8), jnp.float32)
""")
_SHARD_MAP_EP = _EP_SETUP + textwrap.dedent("""
    assert jax.device_count() == 2, jax.devices()

    def shard(x, ex, logits):  # this device's 4 experts: global ids 4 * axis_index ...
        off = jax.lax.axis_index("ep") * 4
        y = nv.moe(x, ex, router_logits=logits, top_k=2, local_expert_offset=off)
        return jax.lax.psum(y.astype(jnp.float32), "ep")

    mesh = jax.make_mesh((2,), ("ep",))
    put = lambda v, spec: jax.device_put(v, jax.sharding.NamedSharding(mesh, spec))
    args = put(x, P()), put(ex, P("ep")), put(logits, P())
    f = jax.jit(jax.shard_map(shard, mesh=mesh, in_specs=(P(), P("ep"), P()), out_specs=P()))
    assert ops.TARGET_GEMM in f.lower(*args).as_text()  # the ffi kernels, not the xla backend
    got = np.asarray(f(*args))
    halves = [jax.tree_util.tree_map(lambda a: a[s], ex) for s in (slice(0, 4), slice(4, 8))]
    want = sum(np.asarray(nv.moe(x, h, router_logits=logits, top_k=2, local_expert_offset=o, backend="ffi"),
                          np.float32) for h, o in zip(halves, (0, 4)))
    np.testing.assert_array_equal(got, want)
    full = np.asarray(nv.moe(x, ex, router_logits=logits, top_k=2, backend="ffi"), np.float32)
    assert np.linalg.norm(got - full) <= 1e-2 * np.linalg.norm(full)
    print("ok")
""")


def test_moe_in_shard_map_over_an_expert_axis():
    """nv.moe in jax.shard_map over 2 CPU devices, the experts sharded along E, each shard's offset from
    lax.axis_index (traced): it runs the ffi kernels (backend auto) and psum gives the two shards' sum, bitwise."""
    run_on_cpu_devices(_SHARD_MAP_EP)


# Plain jit with sharded inputs (no shard_map): the expert_sharding rule splits the kernels' work.
_JIT_SHARDED = _EP_SETUP + textwrap.dedent("""
    assert jax.device_count() == 4, jax.devices()
    f32 = lambda v: np.asarray(v, np.float32)
    layer = lambda x, ex, logits: nv.moe(x, ex, router_logits=logits, top_k=2)
    loss = lambda x, ex, logits: layer(x, ex, logits).astype(jnp.float32).sum()

    def shards_summed(n, mode="w4a16"):  # n expert shards, each run alone; their bf16 outputs summed in f32, rounded
        e = 8 // n
        parts = [f32(nv.moe(x, jax.tree_util.tree_map(lambda a: a[s * e:(s + 1) * e], ex), router_logits=logits,
                            top_k=2, local_expert_offset=s * e, mode=mode, backend="ffi")) for s in range(n)]
        return f32(jnp.asarray(sum(parts), jnp.bfloat16))

    grad = f32(jax.grad(loss)(x, ex, logits))
    cases = [(("dp", "ep"), P("dp"), P("ep"), 2),      # data x expert parallel
             (("a", "b"), P(), P(("a", "b")), 4),      # experts over both axes: ids from axis_index(("a", "b"))
             (("dp", "ep"), P(("dp", "ep")), P("ep"), 2),  # tokens also on the expert axis: gathered over it
             (("dp", "ep"), P("dp"), P(), 1)]          # data parallel only
    def check(types, axes, x_spec, ex_spec, n):
        mesh = jax.make_mesh((2, 2), axes, axis_types=types)
        put = lambda v, spec: jax.device_put(v, NamedSharding(mesh, spec))
        args = put(x, x_spec), put(ex, ex_spec), put(logits, x_spec)
        hlo = jax.jit(layer).lower(*args).compile().as_text()
        gathered = all_gathers(hlo)
        assert not [g for g in gathered if g.startswith(("u8[", "f8e4m3fn["))], gathered  # no expert bytes
        assert not [g for g in gathered if g.endswith("[12,128]")], gathered  # nor all the output's rows
        assert ("all-reduce" in hlo or "reduce-scatter" in hlo) == (n > 1)
        assert ("reduce-scatter" in hlo) == (x_spec == P(("dp", "ep")))  # the sum scattered back to its rows
        out = jax.jit(layer)(*args)
        assert tuple(out.sharding.spec)[:1] == tuple(x_spec)[:1] or out.sharding.is_fully_replicated, out.sharding
        np.testing.assert_array_equal(f32(out), shards_summed(n))
        twice = jax.jit(lambda x, ex, logits: jax.lax.scan(  # in a loop, as in a decode loop
            lambda h, _: (layer(h, ex, logits), None), x, length=2)[0])(*args)
        np.testing.assert_array_equal(f32(twice), f32(jax.jit(layer)(out, args[1], args[2])))
        # The backward pass (the pure-JAX twin's) splits alike: no expert gathered, on either axis type.
        g = jax.jit(jax.grad(loss))
        gathered = expert_gathers(g.lower(*args).compile().as_text())
        assert not gathered, gathered
        assert np.linalg.norm(f32(g(*args)) - grad) <= 1e-3 * np.linalg.norm(grad)

    for types in ((AxisType.Auto,) * 2, (AxisType.Explicit,) * 2):
        for case in cases:
            try:
                check(types, *case)
                if types[0] == AxisType.Explicit:  # and under jax.set_mesh, as jax 0.12 has Explicit meshes used
                    with jax.set_mesh(jax.make_mesh((2, 2), case[0], axis_types=types)):
                        check(types, *case)
            except AssertionError as err:
                raise AssertionError((types, case)) from err

        # w4a4 (its activations quantized per token in the kernels) splits alike.
        mesh = jax.make_mesh((2, 2), ("dp", "ep"), axis_types=types)
        put = lambda v, spec: jax.device_put(v, NamedSharding(mesh, spec))
        w4a4 = jax.jit(lambda x, ex, logits: nv.moe(x, ex, router_logits=logits, top_k=2, mode="w4a4"))
        np.testing.assert_array_equal(f32(w4a4(put(x, P("dp")), put(ex, P("ep")), put(logits, P("dp")))),
                                      shards_summed(2, "w4a4"))

        # Tiles chosen from one device's tokens: 192 tokens (384 pairs: 64-row tiles) over dp = 2, 16-row tiles.
        mesh = jax.make_mesh((2, 2), ("dp", "ep"), axis_types=types)
        put = lambda v, spec: jax.device_put(v, NamedSharding(mesh, spec))
        xb, lb = jnp.tile(x, (16, 1)), jnp.tile(logits, (16, 1))
        tiles = lambda f, *a: set(re.findall(r"tile_m = (\\d+)", jax.jit(f).lower(*a).compile().as_text()))
        assert tiles(layer, xb, ex, lb) == {"64"}
        assert tiles(layer, put(xb, P("dp")), put(ex, P()), put(lb, P("dp"))) == {"16"}

        # ops.moe called directly takes tiles for the experts it is given, not for one device's share (48 tokens
        # over 8 experts: 16-row tiles, which a K split needs; over 2 they would be 64-row ones).
        mesh = jax.make_mesh((2, 2), ("a", "b"), axis_types=types)
        xs, (ids, w) = jnp.tile(x, (4, 1)), nv.route(jnp.tile(logits, (4, 1)), "softmax_topk", top_k=2)
        split = lambda x, ex, i, w: ops.moe(x, ex, i, w, k_split=2)
        args = [jax.device_put(v, NamedSharding(mesh, spec))
                for v, spec in ((xs, P()), (ex, P(("a", "b"))), (ids, P()), (w, P()))]
        assert tiles(split, xs, ex, ids, w) == tiles(split, *args) == {"16"}
        want = f32(jax.jit(split)(xs, ex, ids, w))
        assert np.linalg.norm(f32(jax.jit(split)(*args)) - want) <= 1e-2 * np.linalg.norm(want)

        # shard_map over "ep" only, "dp" left to the partitioner: the kernels run as one op on it.
        mesh = jax.make_mesh((2, 2), ("dp", "ep"), axis_types=types)
        put = lambda v, spec: jax.device_put(v, NamedSharding(mesh, spec))
        def ep_layer(x, ex, logits):
            y = nv.moe(x, ex, router_logits=logits, top_k=2, local_expert_offset=jax.lax.axis_index("ep") * 4)
            return jax.lax.psum(y.astype(jnp.float32), "ep").astype(jnp.bfloat16)
        with jax.set_mesh(mesh):
            f = jax.jit(jax.shard_map(ep_layer, in_specs=(P(), P("ep"), P()), out_specs=P(), axis_names={"ep"}))
            np.testing.assert_array_equal(f32(f(put(x, P("dp")), put(ex, P("ep")), put(logits, P("dp")))),
                                          shards_summed(2))

    # The GSPMD partitioner (Shardy off) has no use for the rule: the kernels run unsplit, as one op.
    jax.config.update("jax_use_shardy_partitioner", False)
    mesh = jax.make_mesh((2, 2), ("dp", "ep"), axis_types=(AxisType.Auto,) * 2)
    put = lambda v, spec: jax.device_put(v, NamedSharding(mesh, spec))
    np.testing.assert_array_equal(f32(jax.jit(layer)(put(x, P("dp")), put(ex, P("ep")), put(logits, P("dp")))),
                                  f32(layer(x, ex, logits)))
    print("ok")
""")


def test_moe_under_jit_with_sharded_experts_and_tokens():
    """Plain jax.jit over 4 CPU devices, experts sharded along E and/or tokens along T by NamedShardings (Auto and
    Explicit mesh axes): no expert bytes are gathered, the output keeps x's sharding and equals the sum of the
    expert shards run alone, bitwise; gradients gather no expert either and match one device's; shard_map over part
    of the mesh still runs."""
    run_on_cpu_devices(_JIT_SHARDED, n=4)


@pytest.mark.parametrize("mode", MODES)
def test_moe_traces_without_constants_for_the_partitioning(monkeypatch, mode):
    """The ffi forward's trace holds no constants (a custom partitioning refuses them: expert_sharding would run
    it unsplit) at decode and prefill sizes, including the sm_90a branches, traced here as on an H200."""
    monkeypatch.setattr(ops.tiling, "_cuda_devices", lambda: [types.SimpleNamespace(compute_capability="9.0")])
    monkeypatch.setattr(ops.tiling, "build_info", lambda: {"cuda_archs": ["sm_90a"]})
    ex = nv.to_blocked_experts(make_experts(5, 8, 256, 256))
    leaves, treedef = jax.tree_util.tree_flatten(ex)
    assert ops.wgmma_tiles(ex)
    for t in (1, 8, 64, 512, 4096):
        x, (ids, w) = make_x(5, t, 256), make_routing(5, t, 4, 8)
        for flags in (0, ops.KernelFlag.ROWS96, ops.KernelFlag.NO_WGMMA):
            jaxpr = jax.make_jaxpr(lambda x, i, w, l: ops.moe_forward(
                x, jax.tree_util.tree_unflatten(treedef, l), i, w, mode=mode, kernel_flags=int(flags)))(x, ids, w, leaves)
            assert not jaxpr.consts, (t, flags, [c.shape for c in jaxpr.consts])


def test_moe_on_one_device_lowers_without_a_partitioning_call():
    """On one device the expert_sharding rule leaves the lowered module as it was: the kernels, no custom
    partitioning call."""
    ex = make_experts(3, 4, 64, 32)
    x, ids, w = make_x(3, 5, 64), jnp.zeros((5, 2), jnp.int32), jnp.ones((5, 2), jnp.float32)
    hlo = jax.jit(lambda x, ex: ops.moe(x, ex, ids, w)).lower(x, ex).as_text()
    assert ops.TARGET_GEMM in hlo and "CustomSPMDPartitioning" not in hlo


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_gpu_moe_in_shard_map_over_two_gpus(mode):
    """The shard_map recipe on two GPUs (the ffi kernels on each): bitwise the sum of the two shards' layers run on
    one GPU; and the same under plain jit with the experts only placed along the axis (expert_sharding), rounded to
    bf16. Skipped with fewer than two GPUs."""
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if len(gpus) < 2:
        pytest.skip("needs two GPUs")
    from jax.sharding import NamedSharding, PartitionSpec as P
    ex = nv.to_blocked_experts(make_experts(41, 8, 1024, 512))
    x = make_x(41, 48, 1024)
    logits = jnp.asarray(np.random.default_rng(41).standard_normal((48, 8)), jnp.float32)
    mesh = jax.sharding.Mesh(np.array(gpus[:2]), ("ep",))

    def shard(x, ex, logits):
        y = nv.moe(x, ex, router_logits=logits, top_k=2, mode=mode, local_expert_offset=jax.lax.axis_index("ep") * 4)
        return jax.lax.psum(y.astype(jnp.float32), "ep")

    args = [jax.device_put(v, NamedSharding(mesh, spec)) for v, spec in ((x, P()), (ex, P("ep")), (logits, P()))]
    f = jax.jit(jax.shard_map(shard, mesh=mesh, in_specs=(P(), P("ep"), P()), out_specs=P()))
    assert ops.TARGET_GEMM in f.lower(*args).as_text()
    halves = [jax.tree_util.tree_map(lambda a: a[s], ex) for s in (slice(0, 4), slice(4, 8))]
    want = sum(f32(nv.moe(x, h, router_logits=logits, top_k=2, mode=mode, local_expert_offset=o, backend="ffi"))
               for h, o in zip(halves, (0, 4)))
    np.testing.assert_array_equal(f32(f(*args)), want)
    plain = jax.jit(lambda x, ex, logits: nv.moe(x, ex, router_logits=logits, top_k=2, mode=mode))
    np.testing.assert_array_equal(f32(plain(*args)), f32(jnp.asarray(want, BF16)))


@pytest.mark.usefixtures("on_cpu")
def test_deterministic_and_jit_equals_eager(experts_cpu):
    ex = experts_cpu[(8, True)]
    x = make_x(2, 50, 64)
    ids, w = make_routing(2, 50, 2, 8)
    eager = f32(ops.moe(x, ex, ids, w))
    f = jax.jit(lambda x: ops.moe(x, ex, ids, w))
    for _ in range(3):
        np.testing.assert_array_equal(f32(f(x)), eager)


# ------------------------------------------------------------------------------------------
# Transformations: vmap rule, grad (custom_vjp through the pure-JAX twin)

@pytest.mark.usefixtures("on_cpu")
def test_vmap_folds_batch_into_tokens(experts_cpu):
    ex = experts_cpu[(8, True)]
    xb = jnp.stack([make_x(s, 9, 64) for s in range(3)])
    ids, w = make_routing(4, 9, 2, 8)
    out = jax.vmap(lambda x: ops.moe(x, ex, ids, w))(xb)
    for b in range(3):
        np.testing.assert_array_equal(f32(out[b]), f32(ops.moe(xb[b], ex, ids, w)))
    # batched routing too, and nested under jit
    idsb = jnp.stack([make_routing(s, 9, 2, 8)[0] for s in range(3)])
    out = jax.jit(jax.vmap(lambda x, i: ops.moe(x, ex, i, w)))(xb, idsb)
    np.testing.assert_array_equal(f32(out[1]), f32(ops.moe(xb[1], ex, idsb[1], w)))
    assert jax.vmap(lambda x: ops.moe(x, ex, ids, w))(xb[:0]).shape == (0, 9, 64)  # an empty batch
    # batched expert weights (global scales here): one MoE per batch element
    scale = jnp.asarray([1.0, 2.0], jnp.float32)

    def scaled(s, x):
        gu = ex.gate_up
        return ops.moe(x, nv.NVFP4Experts(nv.NVFP4Array(gu.data, gu.scales, gu.global_scale * s), ex.down),
                       ids, w)
    out = jax.vmap(scaled)(scale, xb[:2])
    np.testing.assert_array_equal(f32(out[1]), f32(scaled(scale[1], xb[1])))


@pytest.mark.usefixtures("on_cpu")
def test_grad_matches_xla_backend(experts_cpu):
    ex = experts_cpu[(8, True)]
    x = make_x(6, 11, 64)
    ids, w = make_routing(6, 11, 2, 8)

    def loss(backend):
        return jax.jit(jax.grad(lambda x, w: jnp.sum(nv.moe(x, ex, topk_ids=ids, topk_weights=w,
                                                            backend=backend).astype(jnp.float32) ** 2),
                                argnums=(0, 1)))
    gx, gw = loss("ffi")(x, w)
    rx, rw = loss("xla")(x, w)
    assert relerr(gx, rx) < 2e-2 and relerr(gw, rw) < 2e-2


@pytest.mark.usefixtures("on_cpu")
def test_second_order_derivatives_match_xla_backend(experts_cpu):
    # A derivative of the gradient differentiates the custom_vjp's rules: through the kernels' call in its forward
    # pass and the backward pass's batching and partitioning wrappers, by the pure-JAX twin's JVP.
    ex = experts_cpu[(8, True)]
    x = make_x(6, 11, 64)
    logits = jax.random.normal(jax.random.key(3), (11, 8))

    def derivatives(backend):
        def f(x, logits):
            return jnp.sum(nv.moe(x, ex, router_logits=logits, top_k=2, backend=backend).astype(jnp.float32) ** 2)

        def grad_norm(x, logits):  # e.g. a gradient penalty
            gx, gl = jax.grad(f, argnums=(0, 1))(x, logits)
            return jnp.sum(gx.astype(jnp.float32) ** 2) + jnp.sum(gl ** 2)

        # (a random direction: along ones a softmax's logits have a zero Hessian, both backends' rounding noise)
        v = jax.random.normal(jax.random.key(9), logits.shape)
        hvp = jax.jvp(lambda l: jax.grad(f, argnums=1)(x, l), (logits,), (v,))[1]
        return jax.jit(jax.grad(grad_norm, argnums=(0, 1)))(x, logits) + (hvp,)
    got, want = derivatives("ffi"), derivatives("xla")
    for g, r in zip(got, want):
        assert bool(jnp.all(jnp.isfinite(g.astype(jnp.float32)))) and float(jnp.abs(r.astype(jnp.float32)).max()) > 0
        assert relerr(g, r) < 3e-2


# ------------------------------------------------------------------------------------------
# Golden files (FlashInfer's reference W4A16 MoE) through the public API

@pytest.mark.parametrize("name", golden_names("moe_"))
def test_golden_through_public_api(name):
    g = golden_moe(name)
    out = nv.moe(g.x, g.experts, router_logits=g.logits, backend="ffi", **g.route_kwargs)
    assert relerr(out, g.out) < 1e-2
    xla = nv.moe(g.x, g.experts, router_logits=g.logits, backend="xla", **g.route_kwargs)
    assert relerr(out, xla) < 1e-2


# ------------------------------------------------------------------------------------------
# Backend availability, support and selection

def _problem(t=4, h=64, i=64, e=8, k=2, mode="w4a16", act="swiglu"):
    return base.MoEProblem(t, h, i, e, k, mode, act)


def test_backend_registered_and_auto_selects_it():
    b = base.get("ffi")
    assert isinstance(b, ffi_backend.FFIBackend) and "ffi" in base.names()
    assert b.unavailable_reason() is None
    assert base.select("auto", _problem()).name == "ffi"
    assert base.select("auto", _problem(mode="w4a4")).name == "ffi"


def test_unsupported_falls_back_to_xla():
    p = _problem(mode="bf16")
    assert "bf16" in ffi_backend.FFIBackend().unsupported_reason(p)
    assert base.select("auto", p).name == "xla"
    with pytest.raises(ValueError, match="backend='ffi' cannot run this MoE: mode 'bf16'"):
        base.select("ffi", p)


def test_gpu_limits_are_trace_time_reasons(monkeypatch):
    monkeypatch.setattr(base, "platform", lambda dev: "cuda")
    b = ffi_backend.FFIBackend()
    assert "multiples of 64" in b.unsupported_reason(_problem(h=96))
    assert "multiples of 64" in b.unsupported_reason(_problem(i=2880 + 16))
    assert b.unsupported_reason(_problem(h=2880, i=2880)) is None  # gpt-oss shapes: K tail of 64
    assert "at most 512" in b.unsupported_reason(_problem(h=128, i=128, e=1024))


class FakeGpu:
    platform, device_kind, compute_capability = "gpu", "NVIDIA A100", "8.0"
    client = type("C", (), {"platform_version": "cuda 13000"})()


def test_unavailable_reasons(monkeypatch):
    b = ffi_backend.FFIBackend()
    monkeypatch.setattr(base, "platform", lambda dev: "cpu")  # (the real device's checks come first)
    monkeypatch.setattr(ops, "extension_error", lambda: "ImportError: no module")
    assert "not built" in b.unavailable_reason() and isinstance(b.unavailable_reason(), base.InstallProblem)
    monkeypatch.undo()

    # What a rebuild fixes is an InstallProblem (backend="auto" warns where it passes over one); a GPU older than
    # Hopper is not.
    monkeypatch.setattr(base, "default_device", lambda: FakeGpu())
    monkeypatch.setattr(FakeGpu, "compute_capability", "8.0")
    monkeypatch.setattr(ops, "build_info", lambda: {"cuda": True, "cuda_archs": ["sm_90a", "sm_100a"]})
    why = b.unavailable_reason()
    assert "needs sm_80a" in why and "sm_90a" in why and not isinstance(why, base.InstallProblem)
    monkeypatch.setattr(ops, "build_info", lambda: {"cuda": False, "cuda_archs": []})
    assert "needs sm_80a" in b.unavailable_reason()  # (no rebuild would run it)
    monkeypatch.setattr(FakeGpu, "compute_capability", "9.0")
    why = b.unavailable_reason()
    assert "built without CUDA" in why and isinstance(why, base.InstallProblem)
    monkeypatch.setattr(ops, "build_info", lambda: {"cuda": True, "cuda_archs": ["sm_100a"]})
    why = b.unavailable_reason()
    assert 'needs sm_90a, but the ffi kernels are built for sm_100a: reinstall with ' \
        '--config-settings=cmake.define.JAX_NVFP4_CUDA_ARCHS="90a"' in why and isinstance(why, base.InstallProblem)
    monkeypatch.setattr(FakeGpu, "compute_capability", "12.0")
    assert not isinstance(b.unavailable_reason(), base.InstallProblem)  # (sm_120a: not a CMake default)
    monkeypatch.setattr(FakeGpu, "compute_capability", "9.0")
    monkeypatch.setattr(ops, "build_info", lambda: {"cuda": True, "cuda_archs": ["sm_90a"]})
    assert b.unavailable_reason() is None


def test_auto_warns_once_where_it_passes_over_an_unbuilt_extension(monkeypatch, on_cpu):
    """backend="auto" on the pure-JAX fallback because of an installation problem says so (once per reason), but
    not where the passed-over backend would not have run the problem anyway (mode bf16 has no ffi kernel)."""
    e, h, i = 4, 64, 32
    ex = nv.quantize_experts(jnp.ones((e, 2 * i, h), BF16), jnp.ones((e, h, i), BF16))
    x, logits = jnp.ones((3, h), BF16), jnp.ones((3, e), jnp.float32)
    monkeypatch.setattr(ops, "extension_error", lambda: "ImportError: no module named jax_nvfp4._ffi")
    monkeypatch.setattr(base, "_WARNED", set())
    with pytest.warns(RuntimeWarning, match="passes over backend 'ffi': the jax_nvfp4._ffi extension is not built"):
        nv.moe(x, ex, router_logits=logits, top_k=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        nv.moe(x, ex, router_logits=logits, top_k=2)  # once
        monkeypatch.setattr(base, "_WARNED", set())
        bf16 = nv.BF16Experts(jnp.ones((e, 2 * i, h), BF16), jnp.ones((e, h, i), BF16))
        nv.moe(x, bf16, router_logits=logits, top_k=2, mode="bf16")


def test_backends_judge_the_device_that_jax_default_device_names(monkeypatch):
    """On a GPU machine, ``with jax.default_device(cpu)`` runs the layer on the CPU: the backends' choices
    (availability, GPU shape limits, weight order, grouped matmul) follow it, not ``jax.devices()[0]``."""
    from jax_nvfp4.backends import xla
    cpu, real_devices = jax.devices("cpu")[0], jax.devices
    monkeypatch.setattr(jax, "devices", lambda backend=None: [FakeGpu()] if backend is None else real_devices(backend))
    monkeypatch.setattr(FakeGpu, "compute_capability", "9.0")
    monkeypatch.setattr(ops, "build_info", lambda: {"cuda": True, "cuda_archs": ["sm_90a"]})
    b, odd = ffi_backend.FFIBackend(), _problem(h=96)
    assert base.platform(base.default_device()) == "cuda"
    assert b.weight_order(128, 128) == "blocked" and "multiples of 64" in b.unsupported_reason(odd)
    assert xla.choose_gmm(8, 8, 1 << 22) == "ragged"
    for pin in (cpu, "cpu"):
        with jax.default_device(pin):
            assert base.default_device() == cpu and b.unavailable_reason() is None
            assert b.weight_order(128, 128) == "rows" and b.unsupported_reason(odd) is None
            assert xla.choose_gmm(8, 8, 1 << 22) == "tiled"


# ------------------------------------------------------------------------------------------
# GPU: the CUDA kernels (skipped without a GPU)

@pytest.fixture(scope="module")
def gpu_experts():
    if not has_gpu():
        pytest.skip("needs an NVIDIA GPU")
    # H = 320: two 128-K chunks plus the 64 tail; I = 192: one chunk plus the tail in GEMM2,
    # 3 slabs of 64 features in GEMM1 (gated: 384 rows).
    return {(e, g): make_experts(100 + e, e, 320, 192, gated=g) for e in (8, 32, 256) for g in (True, False)}


@pytest.mark.gpu
def test_gpu_backend_available():
    assert ffi_backend.FFIBackend().unavailable_reason() is None
    assert base.select("auto", _problem(h=128, i=128)).name == "ffi"


@pytest.mark.gpu
@pytest.mark.parametrize("t,k,e,offset,tile_m", [c + (ops.TILE_MS[n % len(ops.TILE_MS)],)
                                                  for n, c in enumerate(ALIGN_CASES)] + [
    (64, 2, 16, 4, 64), (4096, 8, 256, 0, 8), (4096, 8, 256, 0, 64), (20000, 8, 512, 0, 32)])
def test_gpu_align_matches_twin(t, k, e, offset, tile_m):
    rng = np.random.default_rng(t + k)
    ids = jnp.asarray(rng.integers(-2, e + offset + 3, (t, k)), jnp.int32)
    got = ops.moe_align(ids, e, tile_m=tile_m, expert_offset=offset, impl="ffi")
    want = ops.moe_align(ids, e, tile_m=tile_m, expert_offset=offset, impl="jax")
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.gpu
@pytest.mark.parametrize("tile_m", ops.TILE_MS)
@pytest.mark.parametrize("t,k,e,offset", [(1, 1, 8, 0), (1, 8, 32, 0), (4, 8, 32, 96), (3, 8, 5, 2), (8, 4, 256, 0),
                                          (7, 5, 16, 0), (5, 7, 8, 0)])
def test_gpu_align_one_warp_matches_twin(t, k, e, offset, tile_m):
    """The one-warp path for <= 32 pairs (the default; drops, foreign and repeated experts) writes
    the bytes of the block kernel (KernelFlag.ALIGN_ONE_CTA), which it leaves above 32 pairs (5 x 7)."""
    rng = np.random.default_rng(t * k + e)
    ids = jnp.asarray(rng.integers(-2, e + offset + 3, (t, k)), jnp.int32)
    _assert_align_is_one_cta_and_twin(ids, e, offset, tile_m, kernel_flags=0)


def _assert_align_is_one_cta_and_twin(ids, e, offset, tile_m, kernel_flags):
    """The CUDA align under kernel_flags writes the bytes of the one-CTA kernel and of the pure-JAX
    twin; returns its outputs."""
    got = ops.moe_align(ids, e, tile_m=tile_m, expert_offset=offset, kernel_flags=kernel_flags)
    one_cta = ops.moe_align(ids, e, tile_m=tile_m, expert_offset=offset,
                            kernel_flags=int(ops.KernelFlag.ALIGN_ONE_CTA))
    want = ops.moe_align(ids, e, tile_m=tile_m, expert_offset=offset, impl="jax")
    for g, o, w in zip(got, one_cta, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(o))
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    return got


@pytest.mark.gpu
@pytest.mark.parametrize("t,k,e,offset,tile_m,order", [
    (256, 8, 32, 0, 64, "random"),      # 2048 pairs: 4 CTAs (the fewest)
    (300, 7, 512, 3, 8, "random"),      # 2100 pairs over 512 experts: 4 CTAs of 525
    (4096, 8, 128, 0, 64, "random"),    # Qwen3 T=4096: 64 CTAs of 512 pairs
    (4096, 8, 512, 0, 32, "random"),    # 16 CTAs: 16 x 512 counts fill the workspace (32 KB)
    (4096, 8, 32, 96, 32, "sorted"),    # one expert per CTA range mostly; foreign ids; drops
    (5003, 3, 16, 0, 16, "one"),        # every pair on one expert, n not a multiple of the CTAs
    (4096, 8, 100, 0, 32, "random"),    # 512 % E != 0: threads left over, CTA segments of uneven length
    (4096, 8, 257, 1, 8, "random"),     # 31 CTAs, one segment of counts each
    (4096, 8, 3, 0, 64, "random"),      # as many count segments as CTAs (64)
    (4096, 8, 128, 0, 64, "hot"),       # 80% of the pairs on one expert
    (2047, 1, 8, 0, 64, "random")])     # just below the threshold: the one-CTA kernel
@pytest.mark.parametrize("pdl", [False, True])
def test_gpu_align_grid_matches_twin(t, k, e, offset, tile_m, order, pdl):
    """The grid align (the default from 2048 pairs on: counts, then offsets and ranks, two kernels
    on up to 64 CTAs, their counts through the call's workspace) writes the bytes of the one-CTA kernel
    (KernelFlag.ALIGN_ONE_CTA): random ids with drops and foreign experts, ids sorted (so that each CTA sees few experts), all
    pairs on one expert or most on one, and expert counts that do not divide the 512 threads."""
    rng = np.random.default_rng(t * k + e)
    if order == "one":
        ids = np.full((t, k), offset + e // 2)
    elif order == "hot":
        ids = rng.integers(offset, e + offset, (t, k))
        ids[rng.random((t, k)) < 0.8] = offset + e // 3
    else:
        ids = rng.integers(-2, e + offset + 3, (t, k))
        if order == "sorted":
            ids = np.sort(ids, axis=None).reshape(t, k)
    ids = jnp.asarray(ids, jnp.int32)
    got = _assert_align_is_one_cta_and_twin(ids, e, offset, tile_m, int(ops.KernelFlag.PDL) if pdl else 0)
    _check_align_contract(ids, e, offset, tile_m, *got)


@pytest.mark.gpu
@pytest.mark.parametrize("tile_m,h,k_split", [(8, 320, 1), (16, 320, 1), (32, 320, 1), (64, 320, 1), (8, 128, 1),
                                               (64, 128, 1), (8, 320, 2), (8, 320, 4), (16, 320, 4), (8, 128, 4),
                                               (16, 576, 2), (8, 1152, 1), (16, 1088, 2)])
@pytest.mark.parametrize("act,gather,mode,out_dtype", GEMM_CASES)
def test_gpu_gemm_matches_twin(act, gather, mode, out_dtype, h, tile_m, k_split):
    """Every kernel instance (tile_m = 8..64 tokens, k_split 1/2/4, gated or not, bf16/fp32 out);
    K = 320 runs two 128-K chunks and the 64 tail, K = 128 one chunk (k_split 4: two warps get
    no K at all), K = 1152 / 1088 run many chunks through the two rotating register buffers
    (K = 1152 with k_split 1 takes the streaming weight loads: K per warp >= 768), and
    n = 80 leaves the last slab of a CTA partly empty (tile_m 64: a warpgroup
    whose second weight block is past n_out)."""
    if not has_gpu():
        pytest.skip("needs an NVIDIA GPU")
    a, w, sid, te, rs = _gemm_problem(act, gather, mode, t=37, k=4, e=6, h=h, n=80, tile_m=tile_m, seed=h)
    args = (a, w, sid, te, rs, act, gather, mode, out_dtype, tile_m, 4, k_split)
    got, want = _run_gemm("ffi", *args), _run_gemm("jax", *args)
    used = used_rows(sid, te, tile_m)  # rows of unused tiles are not written by the GPU kernel
    assert relerr(f32(got)[used], f32(want)[used]) < 1e-2
    assert (f32(got)[used & (np.asarray(sid) < 0)] == 0).all()


@pytest.mark.parametrize("on_gpu", [False, pytest.param(True, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("tile_m,k_split", [(8, 1), (8, 4), (16, 2), (32, 1), (64, 1)])
@pytest.mark.parametrize("case", [0, 2, 4, 5])
def test_gemm_pairing_is_the_same_function(on_gpu, tile_m, k_split, case):
    """``pairing``: a paired ``a`` (Pairing.A) gives bitwise the output of the natural one, and a
    paired ``out`` (Pairing.OUT) is the natural output in the paired order, on the handler of the
    platform and in the twin (tile_m 64: the wgmma kernel on sm_90a)."""
    if on_gpu and not has_gpu():
        pytest.skip("needs an NVIDIA GPU")
    act, gather, mode, out_dtype = GEMM_CASES[case]
    a, w, sid, te, rs = _gemm_problem(act, gather, mode, t=37, k=4, e=6, h=320, n=80, tile_m=tile_m, seed=case)
    used = used_rows(sid, te, tile_m)
    dev = jax.devices()[0] if on_gpu else jax.devices("cpu")[0]
    for impl in ("ffi", "jax"):
        def run(a, pairing):
            with jax.default_device(dev):
                return f32(_run_gemm(impl, a, w, sid, te, rs, act, gather, mode, out_dtype, tile_m, 4, k_split,
                                     pairing=pairing))[used]
        base = run(a, ops.Pairing.NONE)
        np.testing.assert_array_equal(run(a, ops.Pairing.OUT), np.asarray(ops.to_paired(base)))
        if not on_gpu or (act == ops.Activation.IDENTITY and out_dtype == BF16):  # GEMM2: the GPU's paired case
            np.testing.assert_array_equal(run(ops.to_paired(a), ops.Pairing.A), base)
            np.testing.assert_array_equal(run(ops.to_paired(a), ops.Pairing.A | ops.Pairing.OUT),
                                          np.asarray(ops.to_paired(base)))


def test_gemm_pairing_checks():
    act, gather, mode, out_dtype = GEMM_CASES[0]
    a, w, sid, te, _ = _gemm_problem(act, gather, mode, h=64, tile_m=8)
    with pytest.raises(ValueError, match="Pairing"):
        ops.grouped_gemm(a, w, sid, te, tile_m=8, activation=act, top_k=3, gather=True, pairing=32)
    with pytest.raises(ValueError, match="'blocked' order"):  # w is in the rows order
        ops.grouped_gemm(a, w, sid, te, tile_m=8, activation=act, top_k=3, gather=True,
                         pairing=ops.Pairing.BLOCKED_W)
    w12 = random_nvfp4(np.random.default_rng(0), (5, 24, 64), np.ones(5, np.float32))  # 12 features
    with pytest.raises(ValueError, match="multiples of 8"):
        ops.grouped_gemm(a, w12, sid, te, tile_m=8, activation=act, top_k=3, gather=True, pairing=ops.Pairing.OUT)
    ops.ensure_registered()  # the handler checks it too (a direct call must not write out of bounds)
    no_scale = jnp.zeros((1,), jnp.float32)
    with pytest.raises(Exception, match="pairing needs K and the output features to be multiples of 8"):
        _direct_gemm(a, w12, sid, te, no_scale, 12, act, pairing=2)
    if jax.default_backend() == "gpu":  # unpaired, 12 features are short of the GPU's MMA fragment
        with pytest.raises(Exception, match=f"output features 12 must be a multiple of {ops.CUDA_N_MULTIPLE} on "
                                            "this platform"):
            _direct_gemm(a, w12, sid, te, no_scale, 12, act)
    for pairing, msg in [(4, "blocked weights"), (8, "chunk order"), (9, "not both")]:  # K = 64
        with pytest.raises(Exception, match=msg):
            _direct_gemm(a, w, sid, te, no_scale, 48, act, pairing=pairing)


def _code_words(v):
    """Little-endian 32-bit words of code bytes [..., C] (numpy)."""
    v = np.asarray(v).reshape(*np.shape(v)[:-1], -1, 4).astype(np.uint64)
    return v[..., 0] | v[..., 1] << 8 | v[..., 2] << 16 | v[..., 3] << 24


def test_blocked_weights_are_an_exact_permutation():
    """to_blocked_weights puts byte b of row n of expert e where ffi/moe_common.h's
    BlockedOffset says (16-row fragments x 128-K chunks, each block
    contiguous), with each 32-bit code word's bit i at BLOCKED_BIT_POS[i] (a permutation of 0..31, the
    table of the C++ decode: check_constants), and from_blocked_weights undoes it."""
    pos = nv.formats.BLOCKED_BIT_POS
    assert sorted(pos) == list(range(32))
    e, n, k = 3, 48, 384
    w = random_nvfp4(np.random.default_rng(5), (e, n, k), np.ones(e, np.float32))
    b = nv.to_blocked_weights(w)
    assert b.shape == w.shape and b.data.dtype == w.data.dtype and b.scales.dtype == w.scales.dtype
    rows, cols = np.meshgrid(np.arange(n), np.arange(k // 2), indexing="ij")
    code_off = ((rows // 16 * (k // 128) + cols // 64) * 16 + rows % 16) * 64 + cols % 64
    natural = _code_words(w.data)
    want = sum(((natural >> np.uint64(i)) & np.uint64(1)) << np.uint64(p) for i, p in enumerate(pos))
    np.testing.assert_array_equal(_code_words(np.asarray(b.data).reshape(e, -1)[:, code_off]), want)
    s_bits = lambda v: np.asarray(jax.lax.bitcast_convert_type(v, jnp.uint8))  # noqa: E731
    rows, cols = np.meshgrid(np.arange(n), np.arange(k // 16), indexing="ij")
    scale_off = ((rows // 16 * (k // 128) + cols // 8) * 16 + rows % 16) * 8 + cols % 8
    np.testing.assert_array_equal(s_bits(b.scales).reshape(e, -1)[:, scale_off], s_bits(w.scales))
    back = nv.from_blocked_weights(b)
    np.testing.assert_array_equal(np.asarray(back.data), np.asarray(w.data))
    np.testing.assert_array_equal(s_bits(back.scales), s_bits(w.scales))
    assert b.order == "blocked" and back.order == "rows" and b[1].order == "blocked" and b[1:].order == "blocked"
    with pytest.raises(IndexError, match="only along its leading axes"):  # a row's bytes are spread
        b[0, 3:19]
    # Per leading index: one expert's blocks are the blocked order of that expert alone.
    np.testing.assert_array_equal(np.asarray(nv.to_blocked_weights(w[1]).data), np.asarray(b.data[1]))
    with pytest.raises(ValueError, match="N % 16 == 0 and K % 128 == 0"):
        nv.to_blocked_weights(random_nvfp4(np.random.default_rng(0), (2, 24, 128), np.ones(2, np.float32)))
    # The order travels with the array: readers of rows restore them, nothing blocks twice.
    np.testing.assert_array_equal(np.asarray(nv.dequantize(b)), np.asarray(nv.dequantize(w)))
    np.testing.assert_array_equal(np.asarray(nv.dequantize(b[2])), np.asarray(nv.dequantize(w[2])))
    with pytest.raises(ValueError, match="'rows' order"):
        nv.to_blocked_weights(b)
    with pytest.raises(ValueError, match="'blocked' order"):
        nv.from_blocked_weights(w)
    a, _, sid, te, _ = _gemm_problem(ops.Activation.IDENTITY, True, ops.RowScale.NONE, h=k, n=n, e=e)
    with pytest.raises(ValueError, match="'blocked' order"):  # BLOCKED_W asked for rows-order weights
        ops.grouped_gemm(a, w, sid, te, tile_m=8, top_k=3, gather=True, pairing=ops.Pairing.BLOCKED_W)
    ex = make_experts(1, 2, 128, 128)
    with pytest.raises(ValueError, match="one byte order"):
        nv.NVFP4Experts(nv.to_blocked_weights(ex.gate_up), ex.down, True)


@pytest.mark.parametrize("on_gpu", [False, pytest.param(True, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("tile_m,k_split", [(8, 1), (8, 4), (16, 2), (32, 1), (64, 1)])
@pytest.mark.parametrize("case", [0, 2, 4, 5])
def test_gemm_blocked_weights_are_the_same_function(on_gpu, tile_m, k_split, case):
    """Weights in the blocked order (Pairing.BLOCKED_W, with the paired bits as moe uses them)
    give bitwise the row-major output on the platform's handler and in the twin (K = 1024: every
    warp's K range is whole 128-K blocks, so the GPU sums in the same order; 64-row tiles run the
    wgmma kernel, and with NO_WGMMA the mma.sync kernel)."""
    if on_gpu and not has_gpu():
        pytest.skip("needs an NVIDIA GPU")
    act, gather, mode, out_dtype = GEMM_CASES[case]
    a, w, sid, te, rs = _gemm_problem(act, gather, mode, t=37, k=4, e=6, h=1024, n=80, tile_m=tile_m, seed=case)
    wb = nv.to_blocked_weights(w)
    used = used_rows(sid, te, tile_m)
    dev = jax.devices()[0] if on_gpu else jax.devices("cpu")[0]
    paired_a = act == ops.Activation.IDENTITY and out_dtype == BF16  # (GEMM2's case: the GPU's paired a)
    extra = ops.Pairing.A if paired_a else ops.Pairing.OUT
    x = ops.to_paired(a) if paired_a else a
    wgmma_variants = [("ffi", int(ops.KernelFlag.NO_WGMMA))]
    for impl, flags in [("ffi", 0), ("jax", 0)] + (wgmma_variants if tile_m == 64 else []):
        def run(w, pairing):
            with jax.default_device(dev):
                return f32(_run_gemm(impl, x, w, sid, te, rs, act, gather, mode, out_dtype, tile_m, 4, k_split,
                                     kernel_flags=flags, pairing=pairing))[used]
        want = run(w, extra)
        assert np.isfinite(want).all() and (want != 0).any()
        np.testing.assert_array_equal(run(wb, extra | ops.Pairing.BLOCKED_W), want, err_msg=f"{impl} {flags}")


def test_chunk_order_positions():
    """to_chunk_order puts natural k = 32t + 8p + j of each 128-group at 32p + 8(j % 4) + 2t + j // 4
    (ChunkPos in ffi/moe_common.h, written out here independently), and from_chunk_order undoes it."""
    k = np.arange(3 * 128)
    r = k % 128
    t, p, j = r // 32, (r // 8) % 4, r % 8
    pos = k - r + 32 * p + 8 * (j % 4) + 2 * t + j // 4
    v = np.asarray(ops.to_chunk_order(jnp.asarray(np.tile(k, (2, 1)))))
    assert (v[:, pos] == k).all()
    np.testing.assert_array_equal(np.asarray(ops.from_chunk_order(jnp.asarray(v))), np.tile(k, (2, 1)))


@pytest.mark.parametrize("on_gpu", [False, pytest.param(True, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("h", [128, 256, 1280])
@pytest.mark.parametrize("flags", [0, int(ops.KernelFlag.WGMMA_TWO_BLOCKS), int(ops.KernelFlag.ROW_TILES_FIRST),
                                   int(ops.KernelFlag.PDL)] + [int(ops.KernelFlag.TMA_PERSISTENT | f) for f in (
                                       0, ops.KernelFlag.WGMMA_TWO_BLOCKS, ops.KernelFlag.ROW_TILES_FIRST,
                                       ops.KernelFlag.PDL)])
@pytest.mark.parametrize("gated", [False, True])
def test_gemm_chunk_order_is_the_same_function(on_gpu, h, flags, gated):
    """GEMM2's case (identity, not gathered, bf16 out) and a gated one (GEMM1's, rows gathered
    beforehand) on 64-row tiles with ``a`` in the chunk order (Pairing.CHUNK_A: on the GPU the
    TMA-fed wgmma kernel, here over one chunk and over ten, round its ring of four) give bitwise the
    natural-order output of the same tiling (rows and blocked weights; 384 features: a half-used
    slab for the two-block kernel; 200 tokens x 4 over 5 experts: two or three tiles an expert;
    ``a`` ends 70 rows before the last used tile does), and CHUNK_OUT writes that output in the
    chunk order. TMA_PERSISTENT: on the persistent grid, with 2400 tokens (310-465 work items, so
    that CTAs walk several and the ring runs on across them; with one or two chunks an item, every
    copy is of the next item's); h = 256 only there."""
    if on_gpu and not has_gpu():
        pytest.skip("needs an NVIDIA GPU")
    if h == 256 and not flags & ops.KernelFlag.TMA_PERSISTENT:
        pytest.skip("two chunks: for the persistent grid's copies across items")
    if not on_gpu and flags:
        pytest.skip("kernel flags are CUDA variants")
    act, gather, mode, out_dtype = (ops.Activation.SWIGLU, False, ops.RowScale.NONE, BF16) if gated else GEMM_CASES[4]
    t = 2400 if flags & ops.KernelFlag.TMA_PERSISTENT else 200
    a, w, sid, te, rs = _gemm_problem(act, gather, mode, t=t, k=4, e=5, h=h, n=384, tile_m=64, seed=h)
    used = used_rows(sid, te, 64)
    assert used.sum() < a.shape[0] and not used[used.sum():].any()  # the used tiles come first
    a = a[:used.sum() - 70]  # rows past a (not a whole tile) read as zeros: the tensor copy's bounds
    dev = jax.devices()[0] if on_gpu else jax.devices("cpu")[0]
    for impl in ("ffi", "jax"):
        for ww in (w, nv.to_blocked_weights(w)):
            def run(x, pairing):
                with jax.default_device(dev):
                    return _run_gemm(impl, x, ww, sid, te, rs, act, gather, mode, out_dtype, 64, 4,
                                     kernel_flags=flags, pairing=pairing)
            want = f32(run(a, ops.Pairing.NONE))[used]
            assert np.isfinite(want).all() and (want != 0).any()
            got = f32(run(ops.to_chunk_order(a), ops.Pairing.CHUNK_A))[used]
            np.testing.assert_array_equal(got, want, err_msg=f"{impl} {ww.order} CHUNK_A")
            out = f32(ops.from_chunk_order(run(a, ops.Pairing.CHUNK_OUT)))[used]
            np.testing.assert_array_equal(out, want, err_msg=f"{impl} {ww.order} CHUNK_OUT")


TMA_CASES = [  # (activation, row_scale_mode, cut) of non-gated GEMMs on the TMA-fed kernel, besides GEMM2's;
    # cut: used rows (ROW) or tokens (TOKEN) cut off row_scale's end, whose rows then scale by 0 (RowScaled)
    (ops.Activation.IDENTITY, ops.RowScale.NONE, 0),
    (ops.Activation.IDENTITY, ops.RowScale.ROW, 0),
    (ops.Activation.IDENTITY, ops.RowScale.TOKEN, 0),
    (ops.Activation.RELU2, ops.RowScale.PAIR, 0),
    (ops.Activation.IDENTITY, ops.RowScale.ROW, 120),  # (the last 70 rows are past a's end: zeros anyway)
    (ops.Activation.IDENTITY, ops.RowScale.TOKEN, 30),
]


@pytest.mark.parametrize("on_gpu", [False, pytest.param(True, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("flags", [0, int(ops.KernelFlag.TMA_PERSISTENT), int(ops.KernelFlag.WS_GEMM2),
                                   int(ops.KernelFlag.WS_GEMM2 | ops.KernelFlag.ROWS96)])
@pytest.mark.parametrize("case", range(len(TMA_CASES)))
def test_gemm_tma_epilogue_row_scales(on_gpu, flags, case):
    """The TMA-fed kernel's epilogue, and with WS_GEMM2 the warp-specialized kernel's (the same staged
    stores; with ROWS96 on work items of up to 96 rows; on the GPU: each tile's row ids and row-scale factors fetched
    into shared memory during the MMAs, values staged for 16-byte stores) under every row-scale mode
    and relu2, with dropped pairs (padding rows) and ``a`` ending 70 rows before the last used tile:
    bitwise the natural-order output of the staged kernel; with CHUNK_OUT too (the kernel's
    unstaged stores), that output in the chunk order. ``row_scale`` cut short in two cases: rows past
    its end scale by 0 (the zero-filled factor copies). 2400 tokens x 4 over 5 experts, so that
    TMA_PERSISTENT's CTAs walk several items."""
    if on_gpu and not has_gpu():
        pytest.skip("needs an NVIDIA GPU")
    if not on_gpu and flags:
        pytest.skip("kernel flags are CUDA variants")
    act, mode, cut = TMA_CASES[case]
    a, w, sid, te, rs = _gemm_problem(act, False, mode, t=2400 if on_gpu else 200, k=4, e=5, h=256, n=384,
                                      tile_m=64, seed=case)
    w = nv.to_blocked_weights(w)
    used = used_rows(sid, te, 64)
    a = a[:used.sum() - 70]
    dev = jax.devices()[0] if on_gpu else jax.devices("cpu")[0]

    def run(x, pairing):
        with jax.default_device(dev):
            return _run_gemm("ffi", x, w, sid, te, rs, act, False, mode, BF16, 64, 4, kernel_flags=flags,
                             pairing=pairing)

    want = f32(run(a, ops.Pairing.NONE))[used]
    assert np.isfinite(want).all() and (want != 0).any() and (want == 0).any()  # (padding rows)
    if cut:  # row_scale ends `cut` used rows (ROW) or tokens (TOKEN) early: those rows become zeros
        rs = rs[:(used.sum() if mode == ops.RowScale.ROW else rs.shape[0]) - cut]
        cut_want = f32(run(a, ops.Pairing.NONE))[used]
        assert ((cut_want == 0) & (want != 0)).any() and ((cut_want == want) | (cut_want == 0)).all()
        want = cut_want
    xa = ops.to_chunk_order(a)
    np.testing.assert_array_equal(f32(run(xa, ops.Pairing.CHUNK_A))[used], want)
    both = ops.Pairing.CHUNK_A | ops.Pairing.CHUNK_OUT
    np.testing.assert_array_equal(f32(ops.from_chunk_order(run(xa, both)))[used], want)


ROWS96_LAYOUTS = {  # rows an expert
    # 1, 1, 2, -, 3, 4, 5, 7, 2, 2 tiles of 64 rows: groups end in items of 96, 64 and 32 rows; an empty expert
    "mixed": [64, 1, 100, 0, 192, 256, 300, 447, 65, 128],
    # 128 experts (the item tables' scan over every lane of its warp), the last five empty
    "many": [int(n) for n in np.random.default_rng(128).integers(0, 200, 123)] + [0] * 5,
    "tiny": [20],  # fewer rows than one 96-row item (P = 64 on 32-row tiles: the tensor copies' box runs past P)
}


@pytest.mark.gpu
@pytest.mark.parametrize("layout,tile_m,flags", [("mixed", 64, 0), ("mixed", 64, int(ops.KernelFlag.PDL)),
                                                 ("many", 64, 0), ("many", 32, 0), ("tiny", 32, 0),
                                                 ("mixed", 32, int(ops.KernelFlag.NO_PERSISTENT))])
@pytest.mark.parametrize("act,gather,mode", [(ops.Activation.IDENTITY, False, ops.RowScale.PAIR),
                                             (ops.Activation.RELU2, False, ops.RowScale.NONE),
                                             (ops.Activation.SWIGLU, True, ops.RowScale.NONE),
                                             (ops.Activation.SWIGLU_OAI, True, ops.RowScale.TOKEN)])
def test_gpu_rows96_items_are_bitwise_the_row_tiles(act, gather, mode, layout, tile_m, flags):
    """ROWS96 (the warp-specialized work items of up to 96 rows of one expert's group, m64n96 wgmmas: GEMM2,
    and gated gathered GEMM1 on pairs of gate and up warpgroups) against the tiles of the same size without it:
    groups that end in items of 96, 64 and 32 rows (64-row tiles: 1 tile, one item of 64; 2: 96 + 32; 3: 96 +
    96; 4: 96 + 96 + 64; ...), empty experts (inside and at the end), 128 experts, fewer rows than one item,
    padding rows; launched with PDL and with a CTA per item: every used row bitwise (the rows of unused tiles
    are written by neither)."""
    rng = np.random.default_rng(96)
    sizes = ROWS96_LAYOUTS[layout]
    ids = np.concatenate([np.full(n, e) for e, n in enumerate(sizes)])
    ids = jnp.asarray(rng.permutation(ids).reshape(-1, 1), jnp.int32)
    e, h, n = len(sizes), 256, 512
    sid, te, _ = ops.moe_align(ids, e, tile_m=tile_m, impl="jax")
    p = sid.shape[0]
    w = nv.to_blocked_weights(random_nvfp4(rng, (e, n, h), rng.uniform(0.5, 2, e) / np.sqrt(h)))
    a = ops.to_chunk_order(jnp.asarray(rng.standard_normal((ids.shape[0] if gather else p, h)), BF16))
    rs = jnp.asarray(rng.uniform(0.5, 2, ids.shape[0]), jnp.float32)
    ws = ops.KernelFlag.WS_GEMM2 if not gather else 0
    pairing = ops.Pairing.CHUNK_A | (ops.Pairing.CHUNK_OUT if gather else 0)  # (moe's GEMM1 writes the chunk order)

    def run(more):
        return f32(_run_gemm("ffi", a, w, sid, te, rs, act, gather, mode, BF16, tile_m, 1,
                             kernel_flags=int(ws | flags | more), pairing=pairing))

    want, got = run(0), run(ops.KernelFlag.ROWS96)
    used = used_rows(sid, te, tile_m)
    assert (want[used] != 0).any() and (want[used & (np.asarray(sid) < 0)] == 0).all()
    np.testing.assert_array_equal(got[used], want[used])


WS_CASES = [  # (activation, gather, row_scale_mode, out_dtype): moe's GEMM1, its GEMM2, a gated GEMM on rows
    # not gathered (activations by tensor copies), relu2's GEMM1 (non-gated, gathered) and w4a4's GEMM1s
    # (token scales, float32 out)
    (ops.Activation.SWIGLU, True, ops.RowScale.NONE, BF16),
    (ops.Activation.IDENTITY, False, ops.RowScale.PAIR, BF16),
    (ops.Activation.SWIGLU, False, ops.RowScale.NONE, BF16),
    (ops.Activation.RELU2, True, ops.RowScale.TOKEN, BF16),
    (ops.Activation.GEGLU, True, ops.RowScale.TOKEN, jnp.float32),
    (ops.Activation.RELU2, True, ops.RowScale.TOKEN, jnp.float32),
]


@pytest.mark.parametrize("on_gpu", [False, pytest.param(True, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("h", [128, 1280])
@pytest.mark.parametrize("flags", [0, int(ops.KernelFlag.PDL), int(ops.KernelFlag.NO_PERSISTENT),
                                   int(ops.KernelFlag.NO_PERSISTENT | ops.KernelFlag.PDL), int(ops.KernelFlag.ROWS96),
                                   int(ops.KernelFlag.ROWS96 | ops.KernelFlag.NO_PERSISTENT)])
@pytest.mark.parametrize("case", range(len(WS_CASES)))
def test_gemm_warp_specialized_is_the_same_function(on_gpu, h, flags, case):
    """64-row tiles with blocked weights and ``a`` in the chunk order (on the GPU the warp-specialized
    kernel, bfloat16 or float32 out, ungathered ``a`` with WS_GEMM2: weights by tensor copies into a ring, rows by cp.async
    (gathered) or tensor copies, over one chunk and over ten, round the ring; launched plainly and
    with PDL; on the persistent grid, where CTAs walk several work items and the ring runs on across
    them, or with a CTA per item, NO_PERSISTENT; with ROWS96, items of up to 96 rows for moe's GEMM1 (gated,
    gathered: pairs of gate and up warpgroups) and GEMM2): bitwise the natural-order output of the staged
    kernel. 320 features: the last slab is partly idle (192 features a gated CTA, else 384); 2400
    tokens x 4 over 5 experts on the GPU's persistent grid (over 132 items), else 200, some pairs
    dropped; an ungathered ``a`` ends 70 rows before the last used tile does (the copies' bounds)."""
    if on_gpu and not has_gpu():
        pytest.skip("needs an NVIDIA GPU")
    if not on_gpu and flags:
        pytest.skip("kernel flags are CUDA variants")
    act, gather, mode, out_dtype = WS_CASES[case]
    t = 2400 if on_gpu and not flags & ops.KernelFlag.NO_PERSISTENT else 200
    a, w, sid, te, rs = _gemm_problem(act, gather, mode, t=t, k=4, e=5, h=h, n=320, tile_m=64, seed=h + case)
    wb = nv.to_blocked_weights(w)
    used = used_rows(sid, te, 64)
    if not gather:
        a = a[:used.sum() - 70]
        flags |= int(ops.KernelFlag.WS_GEMM2)
    dev = jax.devices()[0] if on_gpu else jax.devices("cpu")[0]
    with jax.default_device(dev):
        want = f32(_run_gemm("ffi", a, wb, sid, te, rs, act, gather, mode, out_dtype, 64, 4))[used]
        got = f32(_run_gemm("ffi", ops.to_chunk_order(a), wb, sid, te, rs, act, gather, mode, out_dtype, 64, 4,
                            kernel_flags=flags, pairing=ops.Pairing.CHUNK_A))[used]
    assert np.isfinite(want).all() and (want != 0).any()
    np.testing.assert_array_equal(got, want)



TILE32_CASES = [  # (activation, gather, row_scale_mode, out_dtype): the warp-specialized kernel's moe GEMM1s
    # (w4a16, relu2, w4a4: fp32 out), then the TMA-fed kernel's GEMM2 (pair and row scales) and relu2 GEMM
    (ops.Activation.SWIGLU, True, ops.RowScale.NONE, BF16),
    (ops.Activation.RELU2, True, ops.RowScale.TOKEN, BF16),
    (ops.Activation.GEGLU, True, ops.RowScale.TOKEN, jnp.float32),
    (ops.Activation.IDENTITY, False, ops.RowScale.PAIR, BF16),
    (ops.Activation.IDENTITY, False, ops.RowScale.ROW, BF16),
    (ops.Activation.RELU2, False, ops.RowScale.TOKEN, BF16),
    (ops.Activation.SWIGLU, False, ops.RowScale.NONE, BF16),  # the TMA-fed kernel's gated instance
]


@pytest.mark.parametrize("on_gpu", [False, pytest.param(True, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("h", [128, 1280])
@pytest.mark.parametrize("flags", [0, int(ops.KernelFlag.TMA_PERSISTENT), int(ops.KernelFlag.NO_PERSISTENT),
                                   int(ops.KernelFlag.WS_GEMM2), int(ops.KernelFlag.WS_THREE_GROUPS),
                                   int(ops.KernelFlag.WS_TWO_BLOCKS),
                                   int(ops.KernelFlag.WGMMA_TWO_BLOCKS | ops.KernelFlag.ROW_TILES_FIRST)])
@pytest.mark.parametrize("case", range(len(TILE32_CASES)))
def test_gemm_32_row_wgmma_tiles_are_the_64_row_function(on_gpu, h, flags, case):
    """32-row tiles with ``a`` in the chunk order (on the GPU the m64n32 forms of the warp-specialized
    kernel, gathered, or not with WS_GEMM2, and of the TMA-fed one, not: a six-stage ring, 32-row boxes,
    one row id a lane; gated on the warp-specialized kernel: four MMA warpgroups and five stages, or
    three and six with WS_THREE_GROUPS; non-gated: four of one 64-feature block, or three of two with WS_TWO_BLOCKS)
    give each pair bitwise the output of the 64-row wgmma tiles (the same K order), and close to the
    twin. The pairs' activations and row scales are the same in both tilings (ungathered ``a`` and ROW
    scales built per sorted row from per-pair values); 120 tokens x 4 over 5 experts (1-4 32-row tiles
    an expert; on the GPU 1200, so that the persistent grids walk several items), some pairs dropped;
    320 features (a partly idle last slab); one chunk and ten. An ungathered ``a`` that ends 70 rows
    before the last used 32-row tile gives zeros past its end and the same rows before it (the tensor
    copies' bounds)."""
    if on_gpu and not has_gpu():
        pytest.skip("needs an NVIDIA GPU")
    if on_gpu and not ops.chunk_intermediate_supported():
        pytest.skip("needs an sm_90 GPU and an sm_90a build")
    if not on_gpu and flags:
        pytest.skip("kernel flags are CUDA variants")
    act, gather, mode, out_dtype = TILE32_CASES[case]
    if flags & ~int(ops.KernelFlag.NO_PERSISTENT | ops.KernelFlag.WS_THREE_GROUPS) and gather:
        pytest.skip("TMA_PERSISTENT, WS_GEMM2, WGMMA_TWO_BLOCKS, ROW_TILES_FIRST: variants of ungathered calls")
    rng = np.random.default_rng(1000 + case + h)
    t, k, e, n = (1200 if on_gpu else 120), 4, 5, 320
    gated = act in (ops.Activation.SWIGLU, ops.Activation.GEGLU)
    if flags == ops.KernelFlag.WS_THREE_GROUPS and not gated:
        pytest.skip("WS_THREE_GROUPS changes gated tiles only (here the run of flags 0 or WS_GEMM2 again)")
    w = nv.to_blocked_weights(random_nvfp4(rng, (e, 2 * n if gated else n, h), rng.uniform(0.5, 2, e) / np.sqrt(h)))
    ids = jnp.asarray(rng.integers(-1, e, (t, k)), jnp.int32)
    x = rng.standard_normal((t if gather else t * k, h)).astype(np.float32)  # by token, or by pair
    scale = rng.uniform(0.5, 2, t * k if mode != ops.RowScale.TOKEN else t).astype(np.float32)
    if not gather:  # (the warp-specialized kernel)
        ws = ops.KernelFlag.NO_PERSISTENT | ops.KernelFlag.WS_THREE_GROUPS | ops.KernelFlag.WS_TWO_BLOCKS
        flags |= int(ops.KernelFlag.WS_GEMM2) if flags & ws else 0
    dev = jax.devices()[0] if on_gpu else jax.devices("cpu")[0]
    by_pair = {}
    for tile in (32, 64):
        sid, te, _ = ops.moe_align(ids, e, tile_m=tile, impl="jax")
        sid_np, used = np.asarray(sid), used_rows(sid, te, tile)
        a = x if gather else np.where((sid_np >= 0)[:, None], x[np.maximum(sid_np, 0)], 0)
        rs = scale[np.maximum(sid_np, 0)] if mode == ops.RowScale.ROW else scale
        with jax.default_device(dev):
            out = f32(_run_gemm("ffi", ops.to_chunk_order(jnp.asarray(a, BF16)), w, sid, te, jnp.asarray(rs), act,
                                gather, mode, out_dtype, tile, k, kernel_flags=flags if tile == 32 else 0,
                                pairing=ops.Pairing.CHUNK_A))
        rows = used & (sid_np >= 0)
        by_pair[tile] = out[rows][np.argsort(sid_np[rows])]
        if tile == 32 and not gather:  # a cut 70 rows before the last used tile's end
            end = int(used.sum()) - 70
            with jax.default_device(dev):
                cut = f32(_run_gemm("ffi", ops.to_chunk_order(jnp.asarray(a[:end], BF16)), w, sid, te, jnp.asarray(rs),
                                    act, gather, mode, out_dtype, tile, k, kernel_flags=flags,
                                    pairing=ops.Pairing.CHUNK_A))
            np.testing.assert_array_equal(cut[:end][used[:end]], out[:end][used[:end]])
            assert (cut[end:][used[end:]] == 0).all() and (out[end:][used[end:]] != 0).any()
        if tile == 32:
            twin = f32(_run_gemm("jax", jnp.asarray(a, BF16), w, sid, te, jnp.asarray(rs), act, gather, mode,
                                 out_dtype, tile, k))[rows][np.argsort(sid_np[rows])]
    assert np.isfinite(by_pair[64]).all() and (by_pair[64] != 0).any()
    np.testing.assert_array_equal(by_pair[32], by_pair[64])
    assert relerr(by_pair[32], twin) < 1e-2

def test_gemm_chunk_order_needs_whole_chunks():
    act, gather, mode, out_dtype = GEMM_CASES[4]
    a, w, sid, te, rs = _gemm_problem(act, gather, mode, h=192, n=64, tile_m=64)
    args = (a, w, sid, te, rs, act, gather, mode, out_dtype, 64, 3)
    with pytest.raises(ValueError, match="multiples of 128"):
        _run_gemm("ffi", *args, pairing=ops.Pairing.CHUNK_A)
    with pytest.raises(ValueError, match="multiples of 128"):
        _run_gemm("jax", *args, pairing=ops.Pairing.CHUNK_OUT)
    with pytest.raises(ValueError, match="paired order and the chunk order"):
        _run_gemm("ffi", *args, pairing=ops.Pairing.A | ops.Pairing.CHUNK_A)


@pytest.mark.gpu
@pytest.mark.parametrize("case,tile_m,flags", [(0, 64, 0), (2, 64, 0), (4, 16, 0), (4, 64, 2)])
def test_gpu_gemm_rejects_chunk_order_it_has_no_kernel_for(case, tile_m, flags):
    """Only the wgmma kernels read chunk-ordered activations: on weights in the rows order (no
    warp-specialized kernel), a gathered, float32-out, decode-tile or NO_WGMMA call with
    Pairing.CHUNK_A is an error, not a silent wrong result."""
    if not has_gpu():
        pytest.skip("needs an NVIDIA GPU")
    act, gather, mode, out_dtype = GEMM_CASES[case]
    a, w, sid, te, rs = _gemm_problem(act, gather, mode, h=128, n=128, tile_m=tile_m)
    with pytest.raises(Exception, match="chunk-ordered activations"):
        _run_gemm("ffi", ops.to_chunk_order(a), w, sid, te, rs, act, gather, mode, out_dtype, tile_m, 3,
                  kernel_flags=flags, pairing=ops.Pairing.CHUNK_A).block_until_ready()


@pytest.mark.parametrize("mode", MODES)
def test_moe_chunk_intermediate_is_the_same_layer_on_cpu(monkeypatch, mode):
    """On the CPU handler too, moe's chunk-ordered intermediate (64-row tiles, I % 128 == 0; in w4a4
    written so by quant_dequant_rows) gives the natural-order layer's bytes (forced on: a GPU of
    another generation turns it off)."""
    monkeypatch.setattr(ops.pipeline, "chunk_intermediate_supported", lambda: True)
    ex = make_experts(21, 8, 256, 128)
    x, (ids, w) = make_x(22, 100, 256), make_routing(23, 100, 4, 8)
    with jax.default_device(jax.devices("cpu")[0]):
        run = lambda flags, e=ex: f32(ops.moe(x, e, ids, w, mode=mode, tile_m=64, kernel_flags=int(flags)))
        want = run(ops.KernelFlag.NATURAL_INTERMEDIATE)
        assert np.isfinite(want).all() and (want != 0).any()
        np.testing.assert_array_equal(run(0), want)
        # Blocked weights: GEMM1 reads x in the chunk order too; the same bytes.
        np.testing.assert_array_equal(run(0, nv.to_blocked_experts(ex)), want)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("i", [256, 1280])
def test_gpu_moe_chunk_intermediate_is_bitwise_natural(i, mode):
    """moe on 64-row tiles (600 tokens x 4 of 16 experts) with I % 128 == 0 writes its intermediate
    in the chunk order (w4a16: GEMM1's epilogue; w4a4: quant_dequant_rows) and runs GEMM2 on it on a
    wgmma kernel (rows: the TMA-fed one; blocked weights: GEMM1 and GEMM2 on the warp-specialized one,
    GEMM1 reading x in the chunk order; w4a4: fp32 out): bitwise the layer of the staged kernels
    (NATURAL_INTERMEDIATE | NO_WARP_SPECIALIZED), as are the variants in between (GEMM2 on the
    warp-specialized kernel too: WS_GEMM2, moe's default on 64-row tiles since session 38; the TMA-fed
    GEMM2 again: TMA_GEMM2; either with a CTA per work item, not the persistent grid: NO_PERSISTENT; both
    GEMMs on work items of up to 96 rows: ROWS96, over 64-row tiles, moe's choice, or 32-row ones),
    and close to the twin."""
    if not has_gpu() or not ops.chunk_intermediate_supported():
        pytest.skip("needs an sm_90 GPU and an sm_90a build")
    assert ops.choose_tile_m(600 * 4, 16) == 64
    ex = make_experts(11, 16, 512, i)
    x = make_x(12, 600, 512)
    ids, w = make_routing(13, 600, 4, 16)
    kf = ops.KernelFlag
    for experts in (ex, nv.to_blocked_experts(ex)):
        run = lambda flags, **kw: f32(ops.moe(x, experts, ids, w, mode=mode, kernel_flags=int(flags), **kw))  # noqa: E731
        want = run(kf.NATURAL_INTERMEDIATE | kf.NO_WARP_SPECIALIZED)
        assert np.isfinite(want).all() and (want != 0).any()
        for flags in (0, kf.NATURAL_INTERMEDIATE, kf.NO_WARP_SPECIALIZED, kf.WS_GEMM2, kf.NO_PERSISTENT,
                      kf.NO_PERSISTENT | kf.WS_GEMM2, kf.TMA_PERSISTENT, kf.TMA_GEMM2, kf.ROWS96,
                      kf.ROWS96 | kf.NO_PERSISTENT):
            np.testing.assert_array_equal(run(flags), want, err_msg=f"{experts.gate_up.order} {flags!r}")
        # ROWS96's items over groups of 32-row tiles too (moe's own choice: 64-row tiles, the tiles it was timed on)
        np.testing.assert_array_equal(run(kf.ROWS96, tile_m=32), want)
        layer = jax.jit(lambda x: ops.moe(x, experts, ids, w, mode=mode, kernel_flags=int(kf.ROWS96)))
        assert set(re.findall(r"tile_m = (\d+)", layer.lower(x).as_text())) == {"64"}
        assert relerr(run(0), run(0, impl="jax")) < (1e-2 if mode == "w4a16" else 5e-2)


@pytest.mark.parametrize("on_gpu", [False, pytest.param(True, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("t", [1, 48, 600])
def test_moe_blocked_weights_are_the_same_layer(on_gpu, mode, t):
    """moe on to_blocked_experts (read in the blocked order) gives the row-major layer's bytes
    (t = 1 / 48 / 600 x 4 pairs over 16 experts: 8-, 16- and 64-row tiles, the latter on the wgmma
    kernel and, with NO_WGMMA, on the mma.sync one)."""
    if on_gpu and not has_gpu():
        pytest.skip("needs an NVIDIA GPU")
    dev = jax.devices()[0] if on_gpu else jax.devices("cpu")[0]
    with jax.default_device(dev):
        ex = make_experts(9, 16, 512, 256)
        x = make_x(t, t, 512)
        ids, w = make_routing(t, t, 4, 16)
        tm = ops.choose_tile_m(t * 4, 16)  # the same tiles for both (blocked experts alone take wgmma tiles from
        # WGMMA_MIN_ROWS on the GPU: another kernel, whose MMAs may round otherwise)
        for flags in (0, int(ops.KernelFlag.NO_WGMMA)):
            want = f32(ops.moe(x, ex, ids, w, mode=mode, tile_m=tm, kernel_flags=flags))
            got = f32(ops.moe(x, nv.to_blocked_experts(ex), ids, w, mode=mode, tile_m=tm, kernel_flags=flags))
            assert np.isfinite(want).all() and (want != 0).any()
            np.testing.assert_array_equal(got, want, err_msg=f"flags {flags}")


_KF = ops.KernelFlag
BIAS_CASES = [  # (tokens, activation, mode, kernel flags): GEMM1's bias in each CUDA epilogue
    (1, "swiglu_oai", "w4a16", 0),  # the align inside GEMM1 (8-row mma.sync tile)
    (3, "relu2", "w4a4", 0),  # 8-row tiles, x's token scales
    (48, "geglu", "w4a16", 0),  # 32-row warp-specialized tiles
    (600, "swiglu_oai", "w4a16", 0),  # 64-row ones, their stores from the registers
    (600, "swiglu_oai", "w4a16", int(_KF.ROWS96)),  # 96-row items: the gate / up halves' split stores
    (600, "relu2", "w4a16", int(_KF.NATURAL_INTERMEDIATE)),  # not gated, natural columns: the staged stores
    (600, "swiglu", "w4a4", int(_KF.NO_WARP_SPECIALIZED)),  # the one-block wgmma kernel, fp32 out
    (600, "geglu", "w4a16", int(_KF.NO_WGMMA)),  # 64-row mma.sync tiles
]


@pytest.mark.parametrize("on_gpu", [False, pytest.param(True, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("case", range(len(BIAS_CASES)))
def test_moe_expert_biases_match_twin_and_xla(on_gpu, case):
    """Experts with biases (gpt-oss): GEMM1's added in the kernels' epilogues before the activation, GEMM2's after
    the finalize; the layer is the twin's (the C++ handlers: to fp32 rounding) and backend xla's, and the biases
    count. 600 tokens x 4 of 16 experts reach the GPU's 64-row tiles; blocked experts, its warp-specialized ones."""
    if on_gpu and not has_gpu():
        pytest.skip("needs an NVIDIA GPU")
    t, act, mode, flags = BIAS_CASES[case]
    dev = jax.devices()[0] if on_gpu else jax.devices("cpu")[0]
    with jax.default_device(dev):
        rng = np.random.default_rng(case)
        ex = make_experts(40 + case, 16, 512, 256, gated=act != "relu2")
        ex = nv.to_blocked_experts(ex) if on_gpu else ex
        gate_up_bias = jnp.asarray(rng.standard_normal(ex.gate_up.shape[:2]), BF16)  # (exact in float32 too)
        biased = dataclasses.replace(ex, gate_up_bias=gate_up_bias.astype(jnp.float32),
                                     down_bias=jnp.asarray(rng.standard_normal((16, 512)), BF16))
        x = make_x(case, t, 512)
        ids, w = make_routing(case, t, 4, 16)
        def run(e, **kw):
            return f32(ops.moe(x, e, ids, w, mode=mode, activation=act, kernel_flags=flags, **kw))
        got = run(biased)
        assert np.isfinite(got).all()
        # The checkpoint's bf16 bias, read by the epilogues as it is: the same values, the same bits.
        np.testing.assert_array_equal(run(dataclasses.replace(biased, gate_up_bias=gate_up_bias)), got)
        assert relerr(got, run(biased, impl="jax")) < (1e-2 if on_gpu else 1e-4)  # (bf16 intermediates)
        ref = f32(nv.moe(x, biased, topk_ids=ids, topk_weights=w, mode=mode, activation=act, backend="xla"))
        assert relerr(got, ref) < (1e-2 if mode == "w4a16" else 5e-2)
        assert relerr(run(ex), ref) > 0.1


@pytest.mark.gpu
def test_gpu_weight_order_is_blocked_for_ffi():
    """On a CUDA GPU the ffi backend (and "auto", while FlashInfer is not available) asks for the
    blocked order where its zero padding of H and I to multiples of 128 adds at most 12.5% of the bytes
    (none, or gpt-oss's 4.5%), and rows elsewhere."""
    if not has_gpu():
        pytest.skip("needs an NVIDIA GPU")
    assert nv.weight_order("ffi", hidden_size=7168, intermediate_size=2048) == "blocked"
    assert nv.weight_order("ffi", hidden_size=2880, intermediate_size=2880) == "blocked"
    assert nv.weight_order("ffi", hidden_size=7168, intermediate_size=192) == "rows"  # 33% more bytes
    assert nv.weight_order("xla", hidden_size=7168, intermediate_size=2048) == "rows"
    if base.get("flashinfer").unavailable_reason():
        assert nv.weight_order(hidden_size=2048, intermediate_size=768) == "blocked"


@pytest.mark.parametrize("on_gpu,t,mode", [(False, 1, "w4a16"), (False, 9, "w4a4")] + [
    pytest.param(True, t, m, marks=pytest.mark.gpu) for t, m in ((1, "w4a16"), (40, "w4a4"), (600, "w4a16"))])
def test_moe_on_zero_padded_blocked_experts(on_gpu, t, mode):
    """gpt-oss's H = I = 2880 (22.5 chunks of 128): to_blocked_experts pads them to 2944, and the layer on the
    padded experts (the GPU's blocked, whole-chunk kernels: decode tiles, 32- and 64-row wgmma ones) is the
    layer on the rows order (on the CPU the same bytes), with biases; the padded features stay out of it."""
    if on_gpu and not has_gpu():
        pytest.skip("needs an NVIDIA GPU")
    dev = jax.devices()[0] if on_gpu else jax.devices("cpu")[0]
    with jax.default_device(dev):
        rng = np.random.default_rng(t)
        e, h = 8, 2880
        ex = dataclasses.replace(
            make_experts(60 + t, e, h, h), gate_up_bias=jnp.asarray(rng.standard_normal((e, 2 * h)), BF16),
            down_bias=jnp.asarray(rng.standard_normal((e, h)), BF16))
        padded = nv.to_blocked_experts(ex)
        assert padded.gate_up.shape == (e, 2 * 2944, 2944) and padded.valid_sizes == (h, h)
        x = make_x(t, t, h)
        ids, w = make_routing(t, t, 4, e)
        run = jax.jit(lambda x, ex: nv.moe(x, ex, topk_ids=ids, topk_weights=w, mode=mode, activation="swiglu_oai",
                                           backend="ffi"))
        got, rows = f32(run(x, padded)), f32(run(x, ex))
        assert got.shape == (t, h) and np.isfinite(got).all()
        if on_gpu:  # (sums over other K splits)
            ref = f32(nv.moe(x, ex, topk_ids=ids, topk_weights=w, mode=mode, activation="swiglu_oai", backend="xla"))
            assert relerr(got, ref) < (1e-2 if mode == "w4a16" else 5e-2)
            assert relerr(got, rows) < (1e-2 if mode == "w4a16" else 5e-2)
        else:
            np.testing.assert_array_equal(got, rows)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [0, 2, 3])
def test_gpu_gemm_rejects_paired_activations_it_has_no_kernel_for(case):
    """The CUDA handler has paired-activation kernels only for GEMM2's case (non-gated, bf16 out):
    a gated or float32-out call with Pairing.A is an error, not a silent wrong result."""
    if not has_gpu():
        pytest.skip("needs an NVIDIA GPU")
    act, gather, mode, out_dtype = GEMM_CASES[case]
    a, w, sid, te, rs = _gemm_problem(act, gather, mode, h=128, tile_m=8)
    with pytest.raises(Exception, match="paired activations"):
        ops.grouped_gemm(ops.to_paired(a), w, sid, te, tile_m=8, activation=act, top_k=3, gather=gather,
                         row_scale=rs if mode != ops.RowScale.NONE else None, row_scale_mode=mode,
                         out_dtype=out_dtype, pairing=ops.Pairing.A).block_until_ready()


@pytest.mark.parametrize("on_gpu", [False, pytest.param(True, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("tile_m", [8, 16, 64])
def test_gemm_without_activation_rows_writes_zeros(on_gpu, tile_m):
    """``a`` with no rows: every used row is padding and comes out zero (the CUDA handler zeroes
    the output without launching a kernel)."""
    if on_gpu and not has_gpu():
        pytest.skip("needs an NVIDIA GPU")
    dev = jax.devices()[0] if on_gpu else jax.devices("cpu")[0]
    act, gather, mode, out_dtype = GEMM_CASES[0]
    a, w, sid, te, _ = _gemm_problem(act, gather, mode, h=128, tile_m=tile_m)
    with jax.default_device(dev):
        out = ops.grouped_gemm(a[:0], w, sid, te, tile_m=tile_m, activation=act, top_k=3, gather=True,
                               out_dtype=out_dtype)
    used = used_rows(sid, te, tile_m)
    assert used.any() and (f32(out)[used] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("flags", [int(ops.KernelFlag.PLAIN_WEIGHT_LOADS),
                                   int(ops.KernelFlag.NO_WGMMA),
                                   int(ops.KernelFlag.WGMMA_TWO_BLOCKS), int(ops.KernelFlag.ROW_TILES_FIRST),
                                   int(ops.KernelFlag.ROW_TILES_FIRST | ops.KernelFlag.WGMMA_TWO_BLOCKS)])
@pytest.mark.parametrize("act,gather,mode,out_dtype", [GEMM_CASES[0], GEMM_CASES[-1]])
@pytest.mark.parametrize("tile_m,h", [(8, 1152), (16, 1152), (64, 320)])
def test_gpu_kernel_variants_match_twin(act, gather, mode, out_dtype, h, tile_m, flags):
    """Every KernelFlag variant of the GEMM (plain weight loads on 8- and 16-row tiles, mma.sync
    64-row tiles, two-block wgmma, the row-tiles-first wgmma grid)."""
    if not has_gpu():
        pytest.skip("needs an NVIDIA GPU")
    a, w, sid, te, rs = _gemm_problem(act, gather, mode, t=37, k=4, e=6, h=h, n=80, tile_m=tile_m, seed=h)
    args = (a, w, sid, te, rs, act, gather, mode, out_dtype, tile_m, 4)
    got = _run_gemm("ffi", *args, kernel_flags=flags)
    want = _run_gemm("jax", *args)
    used = used_rows(sid, te, tile_m)
    assert relerr(f32(got)[used], f32(want)[used]) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("act,gather,mode,out_dtype", [GEMM_CASES[0], GEMM_CASES[2]])
@pytest.mark.parametrize("h,k_split,blocked", [(2048, 1, True), (4096, 2, True), (2048, 1, False),
                                               (2112, 1, False), (1920, 1, True), (2048, 4, True),
                                               (1024, 4, True)])
def test_gpu_activations_ahead_are_the_loop_that_loads_them_per_piece(act, gather, mode, out_dtype, h, k_split,
                                                                       blocked):
    """Gated 8-row tiles whose warps span >= 512 K load a chunk's activations with its weights, a
    chunk ahead (the default there; ACTIVATIONS_IN_LOOP loads them as each piece is multiplied): the
    same bits, and the twin's values. K = 2048 and 4096 / 2 (16 chunks a warp, the last one's loads
    not issued past it), in both weight orders; K = 2112: 16 chunks and the 64-K tail (rows order);
    K = 1920: 15 chunks; 2048 / 4: 4 chunks a warp (Qwen3-30B-A3B's GEMM1 at T = 1); 1024 / 4 (256 K
    a warp, under the span): the old loop either way."""
    if not has_gpu():
        pytest.skip("needs an NVIDIA GPU")
    a, w, sid, te, rs = _gemm_problem(act, gather, mode, t=37, k=4, e=6, h=h, n=80, tile_m=8, seed=h)
    if blocked:
        w = nv.to_blocked_weights(w)
    args = (a, w, sid, te, rs, act, gather, mode, out_dtype, 8, 4, k_split)
    got = f32(_run_gemm("ffi", *args))
    in_loop = f32(_run_gemm("ffi", *args, kernel_flags=int(ops.KernelFlag.ACTIVATIONS_IN_LOOP)))
    used = used_rows(sid, te, 8)
    np.testing.assert_array_equal(got[used], in_loop[used])
    assert relerr(got[used], f32(_run_gemm("jax", *args))[used]) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("t", [1, 4, 16])
def test_gpu_activations_ahead_in_the_layer(mode, t):
    """The same in whole decode layers at Qwen3-30B-A3B's H = 2048 (GEMM1 unsplit: t = 1 and 4 with
    the align in GEMM1's CTAs, t = 16 after the align's own launch), against ACTIVATIONS_IN_LOOP."""
    if not has_gpu():
        pytest.skip("needs an NVIDIA GPU")
    ex = nv.to_blocked_experts(make_experts(5, 32, 2048, 256))
    x = make_x(t, t, 2048)
    ids, w = make_routing(t, t, 8, 32)
    assert ops.choose_tile_m(8 * t, 32, wgmma=True) == 8
    f = jax.jit(lambda x, i, w, flags: ops.moe(x, ex, i, w, mode=mode, k_split=(1, 1), kernel_flags=flags),
                static_argnums=3)
    got = f32(f(x, ids, w, 0))
    np.testing.assert_array_equal(got, f32(f(x, ids, w, int(ops.KernelFlag.ACTIVATIONS_IN_LOOP))))
    assert relerr(got, f32(ops.moe(x, ex, ids, w, mode=mode, impl="jax"))) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("gated", [True, False])
def test_gpu_tile_sizes_are_bitwise_equal(gpu_experts, mode, gated):
    """A pair's output does not depend on the tile that holds it (the same K order per row with
    k_split 1): 8-, 16- and 32-row tiles give the same bits, so the 16- and 32-row kernels'
    skipped blocks (the 8-row blocks after a tile's last row, UsedBlocks) lose nothing. The
    routing gives the 8 experts 1 to 40 rows, so every count of used blocks occurs."""
    ex = gpu_experts[(8, gated)]
    t = 80
    ids, w = routing_with_rows(7, t, [1, 7, 9, 16, 17, 25, 33, 40])  # 148 pairs in 80 tokens x 2 slots
    x = make_x(3, t, 320)
    act = "swiglu" if gated else "relu2"
    f = jax.jit(lambda x, i, w, tm: ops.moe(x, ex, i, w, mode=mode, activation=act, tile_m=tm, k_split=1),
                static_argnums=3)
    want = f32(f(x, jnp.asarray(ids), w, 8))
    for tm in (16, 32):
        np.testing.assert_array_equal(f32(f(x, jnp.asarray(ids), w, tm)), want, err_msg=f"tile_m={tm}")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("act", ["swiglu", "relu2"])
@pytest.mark.parametrize("inter", [256, ops.WS_GEMM2_MIN_K])
def test_gpu_moe_32_row_wgmma_tiles(mode, act, inter):
    """moe on 32-row tiles where the GPU runs the wgmma kernels (blocked experts, H and I multiples of
    128: GEMM1 on the warp-specialized kernel's m64n32 form, the intermediate in the chunk order,
    GEMM2 on the TMA-fed kernel's, or from I = WS_GEMM2_MIN_K on the warp-specialized one's; w4a4: fp32
    GEMM1 out, moe_align_quant at t = 4) gives bitwise the
    64-row wgmma layer, and close to the 16-row mma.sync one and to the 32-row layers with
    NO_WARP_SPECIALIZED (GEMM1 on the mma.sync kernel writing the chunk order) and NO_WGMMA; GEMM1's
    four MMA warpgroups a CTA give bitwise the layer of three (WS_THREE_GROUPS), and GEMM2's four
    warpgroups of one block the layer of three of two (WS_TWO_BLOCKS). The routing gives the
    8 experts 1 to 64 rows (up to two 32-row tiles)."""
    if not has_gpu() or not ops.chunk_intermediate_supported():
        pytest.skip("needs an sm_90 GPU and an sm_90a build")
    ex = nv.to_blocked_experts(make_experts(31, 8, 256, inter, gated=act == "swiglu"))
    t = 120
    ids, w = routing_with_rows(8, t, [1, 9, 17, 32, 33, 40, 64, 25])  # 221 pairs in 120 tokens x 2 slots
    x = make_x(4, t, 256)
    f = jax.jit(lambda x, i, w, tm, fl: ops.moe(x, ex, i, w, mode=mode, activation=act, tile_m=tm, kernel_flags=fl),
                static_argnums=(3, 4))
    got = f32(f(x, jnp.asarray(ids), w, 32, 0))
    assert np.isfinite(got).all() and (got != 0).any()
    np.testing.assert_array_equal(got, f32(f(x, jnp.asarray(ids), w, 64, 0)))
    assert relerr(got, f32(f(x, jnp.asarray(ids), w, 16, 0))) < 1e-2
    for flags in (ops.KernelFlag.WS_THREE_GROUPS, ops.KernelFlag.WS_TWO_BLOCKS):  # (GEMM2 one-block from WS_GEMM2_MIN_K)
        np.testing.assert_array_equal(f32(f(x, jnp.asarray(ids), w, 32, int(flags))), got, err_msg=str(flags))
    for flags in (ops.KernelFlag.NO_WARP_SPECIALIZED, ops.KernelFlag.NO_WGMMA):
        assert relerr(f32(f(x, jnp.asarray(ids), w, 32, int(flags))), got) < 1e-2, flags
    xs, ids4, w4 = x[:4], jnp.asarray(ids[:4]), w[:4]  # <= 32 pairs: moe_align_quant in w4a4
    np.testing.assert_array_equal(f32(f(xs, ids4, w4, 32, 0)), f32(f(xs, ids4, w4, 64, 0)))

_MOE_JIT = jax.jit(ops.moe, static_argnames=("mode", "kernel_flags"))  # one jit cache for the tests below
_OPT_IN_DEFAULTS = {}  # (t, mode) -> the default kernels' output

OPT_IN_FLAGS = (ops.KernelFlag.JAX_QUANT, ops.KernelFlag.ROW_TILES_FIRST, ops.KernelFlag.PDL,
                ops.KernelFlag.NATURAL_INTERMEDIATE, ops.KernelFlag.PLAIN_WEIGHT_LOADS, ops.KernelFlag.ALIGN_ONE_CTA,
                ops.KernelFlag.SEPARATE_X_QUANT, ops.KernelFlag.SEPARATE_ALIGN, ops.KernelFlag.QUANT_NARROW_ROWS,
                ops.KernelFlag.ACTIVATIONS_IN_LOOP,  # (a no-op at H = 320: see test_gpu_activations_ahead_*)
                ops.KernelFlag.TMA_GEMM2)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("t", [1, 4, 48, 2000])
@pytest.mark.parametrize("flags", [int(f) for f in OPT_IN_FLAGS] + [int(sum(OPT_IN_FLAGS))])
def test_gpu_opt_in_variants_are_bitwise_the_default(gpu_experts, t, mode, flags):
    """The pure-JAX quantizer, the row-tiles-first wgmma grid, the one-CTA align, PDL launches, x
    quantized in its own launch (not moe_align_quant's: w4a4, t <= 4), the align in its own launch (not
    in GEMM1's CTAs: w4a16, t <= 4), the quantize's rows on fewer threads (w4a4), plain weight loads (the same K order per thread) and the natural intermediate (the same MMA
    operands as the paired one and, on 64-row tiles, as the chunk-ordered one that the TMA-fed
    wgmma GEMM2 reads) change where and how the work runs, not a single output bit (t = 2000 x 8
    pairs over 32 experts: 64-row wgmma tiles and the grid align by default; H = 320 and I = 192 keep
    the experts in rows, so GEMM2 is TMA-fed here with or without TMA_GEMM2, which
    test_gpu_moe_chunk_intermediate_is_bitwise_natural checks on blocked experts; t = 48: 16-row decode
    tiles; t = 4: 32 pairs, the one-warp align by default; t = 1: 8-row tiles)."""
    ex = gpu_experts[(32, True)]
    x = make_x(t, t, 320)
    ids, w = make_routing(t, t, 8, 32)
    if (t, mode) not in _OPT_IN_DEFAULTS:  # compiled and run once per (t, mode), not once per flag
        _OPT_IN_DEFAULTS[t, mode] = f32(_MOE_JIT(x, ex, ids, w, mode=mode, kernel_flags=0))
    np.testing.assert_array_equal(f32(_MOE_JIT(x, ex, ids, w, mode=mode, kernel_flags=flags)),
                                  _OPT_IN_DEFAULTS[t, mode])


@pytest.mark.gpu
def test_gpu_finalize_matches_twin():
    rng = np.random.default_rng(3)
    y = jnp.asarray(rng.standard_normal((300, 1024 + 64)), BF16)
    p2r = jnp.asarray(rng.integers(-1, 300, (77, 8)), jnp.int32)
    np.testing.assert_array_equal(f32(ops.moe_finalize(y, p2r)), f32(ops.moe_finalize(y, p2r, impl="jax")))


def _gpu_moe_check(ex, t, e, k, act, mode, h=320):
    x = make_x(t, t, h)
    ids, w = make_routing(t + e + k, t, k, e)
    f = jax.jit(lambda x, i, w: nv.moe(x, ex, topk_ids=i, topk_weights=w, mode=mode, activation=act,
                                       backend="ffi"))
    got = f(x, ids, w)
    assert got.shape == (t, h) and got.dtype == BF16
    if t == 0:
        return
    if t <= 64:
        twin = ops.moe(x, ex, ids, w, mode=mode, activation=act, impl="jax")
        assert relerr(got, twin) < 1e-2
    ref = nv.moe(x, ex, topk_ids=ids, topk_weights=w, mode=mode, activation=act, backend="xla")
    assert relerr(got, ref) < 1e-2
    np.testing.assert_array_equal(f32(f(x, ids, w)), f32(got))  # bitwise reproducible


@pytest.mark.gpu
@pytest.mark.parametrize("t", [0, 1, 7, 64, 1000, 4096])
@pytest.mark.parametrize("e,k", [(8, 2), (256, 8), (32, 1)])
def test_gpu_moe_token_counts(gpu_experts, t, e, k):
    _gpu_moe_check(gpu_experts[(e, True)], t, e, k, "swiglu", "w4a16")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("t,e,k", [(7, 32, 4), (1000, 256, 8)])
def test_gpu_moe_activations_and_modes(gpu_experts, t, e, k, act, mode):
    _gpu_moe_check(gpu_experts[(e, act != "relu2")], t, e, k, act, mode)


@pytest.mark.gpu
def test_gpu_large_shapes_and_determinism():
    """DeepSeek-V3 expert shapes (H 7168, I 2048), 16 local experts of 128: decode and prefill."""
    if not has_gpu():
        pytest.skip("needs an NVIDIA GPU")
    ex = make_experts(7, 16, 7168, 2048)
    f = jax.jit(lambda x, i, w: nv.moe(x, ex, topk_ids=i, topk_weights=w, backend="ffi"))
    for t in (1, 64, 1024):
        x = make_x(t, t, 7168)
        ids, w = make_routing(t, t, 8, 128, drop=0.0)  # global ids: most belong to other shards
        ids = jnp.where(jnp.arange(t)[:, None] == 0, jnp.arange(8, dtype=jnp.int32)[None], ids)  # hit some
        got = f(x, ids, w)
        ref = nv.moe(x, ex, topk_ids=ids, topk_weights=w, backend="xla")
        assert relerr(got, ref) < 1e-2, t
        np.testing.assert_array_equal(f32(f(x, ids, w)), f32(got))


@pytest.mark.gpu
def test_gpu_golden_through_public_api():
    if not has_gpu():
        pytest.skip("needs an NVIDIA GPU")
    for name in golden_names("moe_"):
        test_golden_through_public_api(name)
