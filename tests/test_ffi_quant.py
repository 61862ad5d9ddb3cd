"""``quant_dequant_rows``: the fused per-token NVFP4 quantize-and-decode custom call (w4a4
activations) against the pure-JAX quantizer, byte for byte, on the CPU handler and (``gpu``
marked) on the CUDA kernel; and the w4a4 MoE with ``KernelFlag.JAX_QUANT`` (the pure-JAX
quantizer) against the default.
"""

from __future__ import annotations

import dataclasses
import itertools

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jax_nvfp4 as nv
from jax_nvfp4 import ops
from conftest import ffi_call_now
from test_ffi import UNKNOWN_FLAG, make_experts, make_routing, make_x

pytestmark = pytest.mark.skipif(ops.extension_error() is not None,
                                reason=f"FFI extension not built: {ops.extension_error()}")

JAX_QUANT = int(ops.KernelFlag.JAX_QUANT)
NARROW_ROWS = int(ops.KernelFlag.QUANT_NARROW_ROWS)


def bits(a):
    a = np.asarray(a)
    return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def assert_same_bytes(got, want):
    """Every output equal byte for byte: quant_dequant_rows' (out, scale), or moe_align_quant's five."""
    names = ("out", "scale") if len(want) == 2 else ("sorted_ids", "tile_expert", "pair_to_row", "xq", "x_scale")
    assert len(got) == len(want) == len(names)
    for g, w, name in zip(got, want, names):
        g, w = bits(g), bits(w)
        assert g.shape == w.shape and g.dtype == w.dtype, name
        bad = np.argwhere(g != w)
        assert bad.size == 0, f"{name}: {len(bad)} values differ, first at {bad[0].tolist()}: {g[tuple(bad[0])]:#x} vs {w[tuple(bad[0])]:#x}"


def rows_with_wide_range(rng, r, k, dtype, log2_lo=-140, log2_hi=120):
    """Rows whose magnitudes span the float range (per row and within rows), with zero rows,
    negative zeros and exact E2M1 ties mixed in."""
    x = rng.standard_normal((r, k)) * np.exp2(rng.uniform(log2_lo, log2_hi, (r, 1)))
    x *= np.exp2(rng.integers(-12, 12, (r, k)))
    x[rng.random((r, k)) < 0.05] = -0.0
    if r > 2:
        x[1] = 0.0
        x[2, : k // 2] = np.tile([6.0, -0.25, 0.75, 2.5, 5.0, -1.25, 1.75, 3.5], k // 16)  # ties after scaling
    with np.errstate(over="ignore", under="ignore"):
        return jnp.asarray(x.astype(np.float32), dtype)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("r,k", [(1, 16), (5, 96), (64, 2048), (3, 7168), (0, 64)])
def test_matches_pure_jax_quantizer(dtype, r, k):
    rng = np.random.default_rng(r * 131 + k)
    x = rows_with_wide_range(rng, r, k, dtype)
    assert_same_bytes(ops.quant_dequant_rows(x), ops.quant_dequant_rows(x, impl="jax"))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("r,k", [(3, 128), (5, 768)])
def test_chunk_out_is_the_natural_rows_in_the_chunk_order(dtype, r, k):
    rng = np.random.default_rng(r + k)
    x = rows_with_wide_range(rng, r, k, dtype, -30, 30)
    ids = jnp.asarray(np.where(np.arange(r) == 1, -1, np.arange(r)), jnp.int32)
    out, scale = ops.quant_dequant_rows(x, ids)
    want = (ops.to_chunk_order(out), scale)
    assert_same_bytes(ops.quant_dequant_rows(x, ids, chunk_out=True), want)
    assert_same_bytes(ops.quant_dequant_rows(x, ids, chunk_out=True, impl="jax"), want)
    assert not np.array_equal(bits(want[0]), bits(out))  # the order moved values


def test_row_weights_scale_the_used_rows():
    """scale[r] = row_weights[row_ids[r]] * the row's decode scale (0 for unused rows and ids past
    the weights' end), in the kernels as in the twin; the values are those without weights."""
    rng = np.random.default_rng(7)
    x = rows_with_wide_range(rng, 7, 64, jnp.float32, -30, 30)
    ids = jnp.asarray([3, -1, 0, 5, 9, 2, 3], jnp.int32)  # 9: past the end of 6 weights
    wts = jnp.asarray(rng.uniform(0.1, 2.0, 6), jnp.float32)
    out, scale = ops.quant_dequant_rows(x, ids)
    got = ops.quant_dequant_rows(x, ids, row_weights=wts)
    assert_same_bytes(got, ops.quant_dequant_rows(x, ids, row_weights=wts, impl="jax"))
    want = np.where(np.asarray(ids) >= 0, np.asarray(wts)[np.clip(ids, 0, 5)], 0) * np.asarray(scale)
    want[4] = 0.0
    assert_same_bytes(got, (out, want.astype(np.float32)))
    assert (np.asarray(got[1])[[0, 2, 3, 5, 6]] != 0).all()
    empty = (jnp.zeros((0, 32), jnp.bfloat16), jnp.zeros((0,), jnp.int32))  # no rows: nothing to weigh
    assert_same_bytes(ops.quant_dequant_rows(*empty, row_weights=wts),
                      ops.quant_dequant_rows(*empty, row_weights=wts, impl="jax"))


ALIGN_QUANT_CASES = [(1, 8, 128, 0, 2048, 8), (4, 8, 32, 0, 7168, 16), (3, 2, 5, 2, 64, 8), (2, 8, 256, 96, 768, 8),
                     (1, 1, 8, 0, 16, 64), (4, 8, 8, 0, 8448, 8), (3, 4, 16, 0, 1536, 32), (2, 0, 8, 0, 64, 8),
                     (2, 8, 64, 0, 4096, 8), (1, 4, 16, 0, 20480, 8), (2, 2, 8, 0, 33792, 8)]


def _align_quant_check(t, k, e, offset, kk, tile_m, impls=("ffi", "jax"), kernel_flags=0):
    """moe_align_quant against moe_align and quant_dequant_rows (twins), per token and, k >= 1, on static scales
    (a table [e, 2]; x's row once per pair on its expert's scale in column 0, ids outside the slice clamped)."""
    rng = np.random.default_rng(t * 7 + kk)
    ids = jnp.asarray(rng.integers(-1, e + offset + 3, (t, k)), jnp.int32)  # some dropped, some past the slice
    x = rows_with_wide_range(rng, t, kk, jnp.bfloat16, -30, 30)
    table = scale_table(rng, x, e)
    for chunk, static in itertools.product((False, True) if kk % ops.CHUNK_K == 0 else (False,),
                                           (False, True) if k else (False,)):
        s_in = table if static else None
        quant = (dict(input_scale=ops.ScaleLookup(table, ids.reshape(-1), offset=offset), repeat=k) if static
                 else {})
        want = (*ops.moe_align(ids, e, tile_m=tile_m, expert_offset=offset, impl="jax"),
                *ops.quant_dequant_rows(x, chunk_out=chunk, impl="jax", **quant))
        for impl in impls:
            got = ops.moe_align_quant(ids, x, e, tile_m=tile_m, expert_offset=offset, chunk_out=chunk, input_scale=s_in,
                                      impl=impl, kernel_flags=kernel_flags)
            assert_same_bytes(got, want)


@pytest.mark.parametrize("t,k,e,offset,kk,tile_m", ALIGN_QUANT_CASES)
def test_align_quant_is_align_then_quantize(t, k, e, offset, kk, tile_m):
    """moe_align_quant's outputs are the bytes of moe_align's and quant_dequant_rows' twins (the custom
    call on this platform, and the fused op's own twin)."""
    _align_quant_check(t, k, e, offset, kk, tile_m)


def test_align_quant_rejects_what_it_is_not_for():
    ids = jnp.zeros((5, 8), jnp.int32)  # 40 pairs: more than the one-warp align
    with pytest.raises(ValueError, match="at most 32 pairs"):
        ops.moe_align_quant(ids, jnp.zeros((5, 64), jnp.bfloat16), 8, tile_m=8)
    with pytest.raises(ValueError, match="x must be bfloat16"):
        ops.moe_align_quant(ids[:2], jnp.zeros((3, 64), jnp.bfloat16), 8, tile_m=8)
    with pytest.raises(ValueError, match="multiple of 16"):
        ops.moe_align_quant(ids[:2], jnp.zeros((2, 40), jnp.bfloat16), 8, tile_m=8)
    ops.ensure_registered()  # the handler checks them too
    with pytest.raises(ValueError, match=r"static scales \(input_scale\) need k >= 1"):
        ops.moe_align_quant(ids[:, :0], jnp.zeros((5, 64), jnp.bfloat16), 8, tile_m=8,
                            input_scale=jnp.ones((8, 2), jnp.float32))
    for s_in in (jnp.ones((8,)), jnp.ones((7, 2)), jnp.ones((8, 2), jnp.int32)):
        with pytest.raises(ValueError, match=r"moe_align_quant: input_scale must be float32 \[E, c >= 1\] = \[8, c\]"):
            ops.moe_align_quant(ids[:2], jnp.zeros((2, 64), jnp.bfloat16), 8, tile_m=8, input_scale=s_in)
    with pytest.raises(ValueError, match=r"with static scales, expert_offset must be in \[0, 2\^31 - n\] "
                                         r"\(n = 8 table rows\), got -1"):
        ops.moe_align_quant(ids[:2], jnp.zeros((2, 64), jnp.bfloat16), 8, tile_m=8, expert_offset=-1,
                            input_scale=jnp.ones((8, 2)))

    def call(ids, t, s_in=jnp.zeros((0,), jnp.float32), offset=0):
        r = ids.size if s_in.ndim == 2 else t
        return ffi_call_now(ops.TARGET_ALIGN_QUANT, (jax.ShapeDtypeStruct((8 * 40,), jnp.int32),
                                                     jax.ShapeDtypeStruct((40,), jnp.int32),
                                                     jax.ShapeDtypeStruct(ids.shape, jnp.int32),
                                                     jax.ShapeDtypeStruct((r, 64), jnp.bfloat16),
                                                     jax.ShapeDtypeStruct((r,), jnp.float32)),
                            vmap_method="sequential")(ids, jnp.zeros((t, 64), jnp.bfloat16), s_in,
                                                      num_experts=np.int64(8), expert_offset=np.int64(offset),
                                                      tile_m=np.int64(8), chunk_out=False, kernel_flags=np.int64(0))
    with pytest.raises(Exception, match="at most 32 token-expert pairs"):
        call(ids, 5)
    for s_in in (jnp.ones((8,), jnp.float32), jnp.ones((7, 2), jnp.float32)):
        with pytest.raises(Exception, match=r"input_scale must be a table \[E, c >= 1\] = \[8, c\] \(static scales\) "
                                            r"or \[0\], got \[[78]"):
            call(ids[:2], 2, s_in)
    with pytest.raises(Exception, match=r"with static scales, expert_offset must be in \[0, 2\^31 - n\] "
                                        r"\(n = 8 table rows\), got 2147483641"):
        call(ids[:2], 2, jnp.ones((8, 2), jnp.float32), offset=2 ** 31 - 7)
    with pytest.raises(Exception, match=r"static scales need k >= 1"):
        call(ids[:2, :0], 2, jnp.ones((8, 2), jnp.float32))


def test_twin_is_quantize_then_decode():
    x = rows_with_wide_range(np.random.default_rng(1), 9, 48, jnp.bfloat16, -20, 20)
    q = nv.quantize(x, per_token=True)
    out, scale = ops.quant_dequant_rows(x, impl="jax")
    assert_same_bytes((out, scale), (nv.dequantize(q, jnp.bfloat16, apply_global_scale=False), q.global_scale))
    # and the global scale restores the values: out * scale == dequantize(q)
    np.testing.assert_array_equal(np.asarray(out, np.float32) * np.asarray(scale)[:, None],
                                  np.asarray(nv.dequantize(q, jnp.float32)))


finite_f32 = st.floats(width=32, allow_nan=False, allow_infinity=False, allow_subnormal=True)


@settings(max_examples=150, deadline=None)
@given(hnp.arrays(np.float32, (3, 32), elements=finite_f32), st.integers(-149, 127))
def test_property_f32_rows(x, log2_scale):
    """Any finite fp32 rows, subnormals included, rescaled across the exponent range."""
    with np.errstate(over="ignore", under="ignore"):
        x = np.nan_to_num(x * np.float32(2.0) ** log2_scale, posinf=3.4e38, neginf=-3.4e38).astype(np.float32)
    x = jnp.asarray(x)
    assert_same_bytes(ops.quant_dequant_rows(x), ops.quant_dequant_rows(x, impl="jax"))


@settings(max_examples=150, deadline=None)
@given(hnp.arrays(np.float32, (2, 32), elements=finite_f32),
       hnp.arrays(np.float32, (4,), elements=st.floats(width=32, min_value=float(np.float32(1e-45)),
                                                       max_value=float(np.float32(3.4e38)))))
def test_property_static_scales(x, s):
    """Static decode scales (quant_dequant_static's rows), any positive finite fp32 (subnormal ones included: the
    encode scale 1 / s is then infinite), on any finite rows, each quantized twice (repeat) on two scales."""
    x, s = jnp.asarray(x), jnp.asarray(s)
    assert_same_bytes(ops.quant_dequant_rows(x, input_scale=s, repeat=2),
                      ops.quant_dequant_rows(x, input_scale=s, repeat=2, impl="jax"))


@settings(max_examples=60, deadline=None)
@given(hnp.arrays(np.uint16, (2, 64), elements=st.integers(0, 0xFFFF)))
def test_property_every_bf16_bit_pattern(u):
    """Raw bf16 bit patterns (infinities included; NaN rows are skipped: their NaN bytes are unspecified, see
    test_nan_rows_are_nan_as_in_the_reference)."""
    x = jax.lax.bitcast_convert_type(jnp.asarray(u), jnp.bfloat16)
    keep = ~np.isnan(np.asarray(x, np.float32)).any(axis=1)
    x = x[np.flatnonzero(keep)]
    assert_same_bytes(ops.quant_dequant_rows(x), ops.quant_dequant_rows(x, impl="jax"))


def test_nan_rows_are_nan_as_in_the_reference():
    """A row holding NaN has the reference's NaN global scale, so its every output is NaN, on the kernel and its twin
    alike (the NaN bytes themselves are unspecified); an infinity is an amax like any other."""
    x = np.ones((3, 64), np.float32)
    x[0, 5], x[2, 7] = np.nan, -np.inf
    for impl in ("ffi", "jax"):
        out, scale = (np.asarray(v, np.float32)
                      for v in ops.quant_dequant_rows(jnp.asarray(x, jnp.bfloat16), impl=impl))
        assert np.isnan(scale[0]) and np.isnan(out[0]).all(), impl
        assert np.isfinite(scale[1:]).all() and np.isfinite(out[1:]).all(), impl
        assert out[2, 7] == -2688 and (out[2, :7] == 0).all(), impl  # -inf: the row's amax, the rest underflow


def test_unused_rows_are_zero_whatever_they_hold():
    rng = np.random.default_rng(2)
    x = np.asarray(rng.standard_normal((6, 32)), np.float32)
    x[[1, 4]] = np.nan  # garbage in rows the GEMM never wrote
    ids = jnp.asarray([0, -1, 5, 7, -1, 2], jnp.int32)
    got = ops.quant_dequant_rows(jnp.asarray(x), ids)
    assert_same_bytes(got, ops.quant_dequant_rows(jnp.asarray(x), ids, impl="jax"))
    assert not np.any(bits(got[0])[[1, 4]]) and not np.any(bits(got[1])[[1, 4]])
    used = np.asarray([0, 2, 3, 5])
    assert_same_bytes((got[0][used], got[1][used]), ops.quant_dequant_rows(jnp.asarray(x[used])))


def test_jit_vmap_and_eager_agree():
    x = rows_with_wide_range(np.random.default_rng(3), 4, 32, jnp.bfloat16, -8, 8)
    eager = ops.quant_dequant_rows(x)
    assert_same_bytes(jax.jit(ops.quant_dequant_rows)(x), eager)
    batched = jax.vmap(ops.quant_dequant_rows)(jnp.stack([x, x[::-1]]))
    assert_same_bytes((batched[0][0], batched[1][0]), eager)
    assert_same_bytes((batched[0][1], batched[1][1]), ops.quant_dequant_rows(x[::-1]))


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="K a multiple of 16"):
        ops.quant_dequant_rows(jnp.zeros((2, 24), jnp.bfloat16))
    with pytest.raises(TypeError, match="bfloat16 or float32"):
        ops.quant_dequant_rows(jnp.zeros((2, 32), jnp.float16))
    with pytest.raises(ValueError, match=r"row_ids must be integer \[R\] = \[2\]"):
        ops.quant_dequant_rows(jnp.zeros((2, 32), jnp.bfloat16), jnp.zeros((3,), jnp.int32))
    with pytest.raises(ValueError, match="impl"):
        ops.quant_dequant_rows(jnp.zeros((2, 32), jnp.bfloat16), impl="cuda")
    with pytest.raises(ValueError, match="chunk_out needs K = x.shape.1. to be a multiple of 128, got 96"):
        ops.quant_dequant_rows(jnp.zeros((2, 96), jnp.bfloat16), chunk_out=True)
    with pytest.raises(ValueError, match="row_weights must be float32 .n., n >= 1, and come with row_ids"):
        ops.quant_dequant_rows(jnp.zeros((2, 32), jnp.bfloat16), row_weights=jnp.ones((2,), jnp.float32))
    with pytest.raises(ValueError, match=r"row_weights must be float32 .*got float32\[0\]"):
        ops.quant_dequant_rows(jnp.zeros((2, 32), jnp.bfloat16), jnp.zeros((2,), jnp.int32),
                               row_weights=jnp.ones((0,), jnp.float32))
    x4, table = jnp.zeros((4, 32), jnp.bfloat16), jnp.ones((3, 2), jnp.float32)
    for lookup, msg in [(ops.ScaleLookup(table, jnp.zeros((4,), jnp.int32), column=2), r"column must be in \[0, 2\)"),
                        (ops.ScaleLookup(table, jnp.zeros((3,), jnp.int32)), r"ids must be integer \[R / group\] = "
                                                                              r"\[4 / 1\] .*got int32\[3\]"),
                        (ops.ScaleLookup(table, jnp.zeros((2,), jnp.float32), group=2), "ids must be integer"),
                        (ops.ScaleLookup(table, jnp.zeros((4,), jnp.int32), offset=1.0), "offset must be a Python int"),
                        (ops.ScaleLookup(table[0], jnp.zeros((4,), jnp.int32)), "table must be float32 .n >= 1, c.")]:
        for impl in ("ffi", "jax"):
            with pytest.raises(ValueError, match=msg):
                ops.quant_dequant_rows(x4, input_scale=lookup, impl=impl)
    for offset in (-1, 2 ** 31 - 2):
        with pytest.raises(ValueError, match=r"ScaleLookup.offset must be in \[0, 2\^31 - n\] \(n = 3 table rows\)"):
            ops.quant_dequant_rows(x4, input_scale=ops.ScaleLookup(table, jnp.zeros((4,), jnp.int32), offset=offset))
    # the lookup's rule: table[clip(ids[r // group], offset, offset + n - 1) - offset, column], the kernels' too
    # (int32 extremes: no wrap-around), and for no rows
    lookup = ops.ScaleLookup(jnp.arange(6, dtype=jnp.float32).reshape(3, 2), jnp.asarray([0, 3, 9], jnp.int32),
                             group=2, offset=3, column=1)
    np.testing.assert_array_equal(lookup.per_row(), [1, 1, 1, 1, 5, 5])
    extremes = ops.ScaleLookup(jnp.asarray([[1.0], [2.0], [4.0]]), jnp.asarray([-2 ** 31, 2 ** 31 - 1, 6], jnp.int32),
                               offset=5)
    for x_, lk in [(jnp.ones((3, 32), jnp.bfloat16), extremes),
                   (jnp.ones((0, 32), jnp.bfloat16), ops.ScaleLookup(table, jnp.zeros((0,), jnp.int32)))]:
        want = ops.quant_dequant_rows(x_, input_scale=lk, impl="jax")
        assert_same_bytes(ops.quant_dequant_rows(x_, input_scale=lk), want)
    np.testing.assert_array_equal(want[1].shape, (0,))
    np.testing.assert_array_equal(ops.quant_dequant_rows(jnp.ones((3, 32), jnp.bfloat16), input_scale=extremes,
                                                         impl="jax")[1], [1, 4, 2])
    # a pytree whose ints are static: it crosses a jit
    np.testing.assert_array_equal(jax.jit(lambda lk: lk.per_row())(lookup), lookup.per_row())


def test_handler_rejects_bad_shapes_with_named_arguments():
    """The C++ checks behind the Python ones (shared by the CPU and CUDA handlers)."""
    def call(x, ids, out_shape=None, scale_shape=None, chunk_out=False, weights=jnp.zeros((0,), jnp.float32),
             s_in=jnp.zeros((0,), jnp.float32), repeat=1, s_ids=jnp.zeros((0,), jnp.int32), group=1, column=0,
             offset=0):
        r, k = x.shape
        r *= max(repeat, 1)
        return ffi_call_now(ops.TARGET_QUANT, (jax.ShapeDtypeStruct(out_shape or (r, k), jnp.bfloat16),
                                               jax.ShapeDtypeStruct(scale_shape or (r,), jnp.float32)),
                            vmap_method="sequential")(x, ids, weights, s_in, s_ids, chunk_out=chunk_out,
                                                      repeat=np.int64(repeat), scale_group=np.int64(group),
                                                      scale_offset=np.int64(offset), scale_column=np.int64(column),
                                                      kernel_flags=np.int64(0))
    ops.ensure_registered()
    x = jnp.zeros((3, 32), jnp.bfloat16)
    with pytest.raises(Exception, match=r"row_ids must be \[R\] = \[3\] or \[0\]"):
        call(x, jnp.zeros((2,), jnp.int32))
    with pytest.raises(Exception, match="must be a multiple of 16"):
        call(jnp.zeros((3, 40), jnp.bfloat16), jnp.zeros((0,), jnp.int32))
    with pytest.raises(Exception, match="x must be bfloat16 or float32"):
        call(jnp.zeros((3, 32), jnp.float16), jnp.zeros((0,), jnp.int32))
    with pytest.raises(Exception, match="scale output must be"):
        call(x, jnp.zeros((0,), jnp.int32), scale_shape=(4,))
    with pytest.raises(Exception, match="output must be"):
        call(x, jnp.zeros((0,), jnp.int32), out_shape=(3, 16))
    with pytest.raises(Exception, match=r"chunk_out needs K = 32 \(x.shape\[1\]\) to be a multiple of 128"):
        call(x, jnp.zeros((0,), jnp.int32), chunk_out=True)
    with pytest.raises(Exception, match="row_weights must be 1-D, and empty unless row_ids is given"):
        call(x, jnp.zeros((0,), jnp.int32), weights=jnp.ones((3,), jnp.float32))
    with pytest.raises(Exception, match="row_weights must be 1-D"):
        call(x, jnp.zeros((3,), jnp.int32), weights=jnp.ones((3, 1), jnp.float32))
    with pytest.raises(Exception, match=r"input_scale must be \[R\] = \[6\] \(x.shape\[0\] \* repeat\) or \[0\]"):
        call(x, jnp.zeros((0,), jnp.int32), s_in=jnp.ones((3,), jnp.float32), repeat=2)
    with pytest.raises(Exception, match=r"output must be \[R, K\] = \[6, 32\]"):
        call(x, jnp.zeros((0,), jnp.int32), out_shape=(3, 32), repeat=2)
    with pytest.raises(Exception, match="repeat must be in"):
        call(x, jnp.zeros((0,), jnp.int32), out_shape=(3, 32), scale_shape=(3,), repeat=0)
    none, table = jnp.zeros((0,), jnp.int32), jnp.ones((4, 2), jnp.float32)
    with pytest.raises(Exception, match=r"input_scale must be \[R\] = \[3\] .* \(a table \[n, c\] comes with "
                                        r"scale_ids\)"):
        call(x, none, s_in=table)
    with pytest.raises(Exception, match=r"scale_offset must be in \[0, 2\^31 - n\] \(n = 4 table rows\), got -1"):
        call(x, none, s_in=table, s_ids=jnp.zeros((3,), jnp.int32), offset=-1)
    with pytest.raises(Exception, match=r"with scale_ids, input_scale must be a table \[n >= 1, c\] and scale_column "
                                        r"in \[0, c\), got \[3\] and column 0"):
        call(x, none, s_in=jnp.ones((3,), jnp.float32), s_ids=jnp.zeros((3,), jnp.int32))
    with pytest.raises(Exception, match=r"got \[4, 2\] and column 2"):
        call(x, none, s_in=table, s_ids=jnp.zeros((3,), jnp.int32), column=2)
    with pytest.raises(Exception, match=r"scale_ids must be \[R / scale_group\] = \[6 / 4\], got \[1\]"):
        call(x, none, s_in=table, s_ids=jnp.zeros((1,), jnp.int32), group=4, repeat=2)
    with pytest.raises(Exception, match=r"scale_ids must be 1-D"):
        call(x, none, s_in=table, s_ids=jnp.zeros((3, 1), jnp.int32))
    with pytest.raises(ValueError, match="kernel_flags must combine"):
        ops.quant_dequant_rows(x, kernel_flags=UNKNOWN_FLAG)


def test_kernel_flag_mirrors_cpp():
    ops.check_constants()
    assert ops.extension._ffi.constants()["KernelFlag"]["jax_quant"] == JAX_QUANT


def _moe_case(seed, t, e, k, h=64, i=32, gated=True):
    """Random NVFP4 experts, activations and routing (with padding ids), as test_ffi builds them."""
    return make_x(seed, t, h), make_experts(seed, e, h, i, gated=gated), *make_routing(seed, t, k, e)


@pytest.mark.parametrize("act", ["swiglu", "relu2"])
@pytest.mark.parametrize("t", [13, 4])  # 39 pairs: the align and quantize launches; 12: moe_align_quant's one
@pytest.mark.parametrize("static", [False, True])  # per token; NVFP4Experts.input_scales (looked up in the launches)
def test_moe_w4a4_kernel_quant_is_the_jax_quantizer(act, t, static):
    x, experts, ids, w = _moe_case(4, t, 8, 3, i=64, gated=act != "relu2")  # (the GPU GEMMs: K % 64 == 0)
    if static:
        rng = np.random.default_rng(t)
        experts = dataclasses.replace(experts, input_scales=scale_table(rng, x, 8))
    run = lambda flags: ops.moe(x, experts, ids, w, mode="w4a4", activation=act, kernel_flags=flags)  # noqa: E731
    np.testing.assert_array_equal(bits(run(0)), bits(run(JAX_QUANT)))


# ---- the CUDA kernel -------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("r,k", [(1, 16), (1, 7168), (8, 768), (37, 2048), (4096, 7168), (32768, 768), (5, 4096),
                                 (3, 8448), (9, 1536), (2, 24576), (1, 33792), (2049, 8448)])
def test_gpu_matches_pure_jax_quantizer(dtype, r, k):
    """Up to 2048 rows a CTA a row: 512 threads over 128 blocks, holding 1 (K 4096, 7168), 2 (8448) or 4
    (24576) blocks a thread or reading twice (33792), else 128 threads, 1 block; past 2048 rows, 128-thread
    rows from 128 blocks on (4 blocks, 4096 x 7168; read twice, 2049 x 8448) and warp rows below (2
    blocks a lane, 32768 x 768). The narrow rows at any R (partial last CTAs): the test below."""
    rng = np.random.default_rng(r + k)
    _check_row_variants(rng, rows_with_wide_range(rng, r, k, dtype))


def static_scales(rng, x, repeat=1):
    """float32 [R * repeat]: a static decode scale per output row, its x row's amax / 2688 times 2^[-3, 3) (rows
    that saturate and rows that use few codes), kept finite and > 0 (zero and infinite rows included)."""
    amax = np.abs(np.asarray(x, np.float32)).max(axis=1) if x.shape[1] else np.zeros(x.shape[0], np.float32)
    s = np.repeat(amax, repeat).astype(np.float64) / 2688 * np.exp2(rng.uniform(-3, 3, x.shape[0] * repeat))
    return jnp.asarray(np.clip(np.nan_to_num(s, posinf=1e30), 1e-38, 1e30).astype(np.float32))


def scale_table(rng, x, n, c=2):
    """float32 [n, c]: static scales of x's rows (static_scales) picked at random (ones if x has no rows)."""
    if not x.shape[0]:
        return jnp.ones((n, c), jnp.float32)
    s = static_scales(rng, x, n * c)
    return s[rng.permutation(s.shape[0])[:n * c]].reshape(n, c)


def _check_row_variants(rng, x, kernel_flags=0):
    """quant_dequant_rows of x against its twin: every row used, unused rows (ids), the chunk-ordered
    stores (K a multiple of 128), GEMM2's row scales (routing weights; ids past their end: 0) and static
    scales, with each row of x repeated 3 times (unused rows, weights and the chunk order too)."""
    r, k = x.shape
    ids = jnp.asarray(np.where(rng.random(r) < 0.3, -1, np.arange(r)), jnp.int32)
    ids3 = jnp.asarray(np.where(rng.random(3 * r) < 0.3, -1, np.arange(3 * r)), jnp.int32)
    wts = jnp.asarray(rng.uniform(0.5, 1.5, r // 2 + 1), jnp.float32)
    cases = [dict(), dict(row_ids=ids), dict(row_ids=ids, row_weights=wts), dict(input_scale=static_scales(rng, x)),
             dict(row_ids=ids3, row_weights=wts, input_scale=static_scales(rng, x, 3), repeat=3)]
    cases += [dict(row_ids=ids, chunk_out=True)] if k % ops.CHUNK_K == 0 else []
    cases += [dict(input_scale=static_scales(rng, x, 2), repeat=2, chunk_out=True)] if k % ops.CHUNK_K == 0 else []
    # ScaleLookup: a table [5, 2] of scales, by an id a row (global ids, offset 2: some clamped below and above) or
    # an id per group of 4 or 2 rows (as a tile's expert)
    if r:
        table = scale_table(rng, x, 5)
        cases += [dict(input_scale=ops.ScaleLookup(table, jnp.asarray(rng.integers(-2, 10, 3 * r), jnp.int32),
                                                   offset=2, column=1), repeat=3, row_ids=ids3)]
        g = 4 if r % 4 == 0 else 2 if r % 2 == 0 else 1
        cases += [dict(input_scale=ops.ScaleLookup(table, jnp.asarray(rng.integers(-1, 5, r // g), jnp.int32),
                                                   group=g), row_ids=ids, row_weights=wts,
                       chunk_out=k % ops.CHUNK_K == 0)]
    for kw in cases:
        assert_same_bytes(ops.quant_dequant_rows(x, **kw, kernel_flags=kernel_flags),
                          ops.quant_dequant_rows(x, **kw, impl="jax"))


@pytest.mark.gpu
@pytest.mark.parametrize("flags", [0, NARROW_ROWS])
@pytest.mark.parametrize("t,k,e,offset,kk,tile_m", ALIGN_QUANT_CASES)
def test_gpu_align_quant_is_align_then_quantize(t, k, e, offset, kk, tile_m, flags):
    """One launch (the align in CTA 0, x's rows in the others: CTA- and warp-per-row instances holding
    1, 2 or 4 blocks a thread, or reading twice: 512 threads by default, 128 with QUANT_NARROW_ROWS; no
    pair, k = 0) gives the twins' bytes."""
    _align_quant_check(t, k, e, offset, kk, tile_m, impls=("ffi",), kernel_flags=flags)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("r,k", [(1, 16), (8, 768), (64, 768), (5, 96), (37, 2048), (3, 1536), (5, 4096)])
def test_narrow_rows_flag_is_the_same_function(dtype, r, k):
    """KernelFlag.QUANT_NARROW_ROWS (the GPU: rows under 128 blocks on a warp at any R, longer ones on 128
    threads, not a CTA each of 128 or 512 up to 2048 rows; the CPU ignores it) gives the twin's bytes, with row
    ids, routing weights and the chunk order."""
    rng = np.random.default_rng(r * 3 + k)
    _check_row_variants(rng, rows_with_wide_range(rng, r, k, dtype), kernel_flags=NARROW_ROWS)


@pytest.mark.gpu
def test_gpu_subnormals_and_extremes():
    x = np.zeros((4, 64), np.float32)
    x[0] = np.float32(1e-45) * np.arange(64)  # subnormal amax
    x[1] = np.float32(3e38) * np.linspace(-1, 1, 64, dtype=np.float32)
    x[2, ::3] = np.inf
    x[3] = np.float32(1e-38) * np.linspace(-1, 1, 64, dtype=np.float32)
    x = jnp.asarray(x)
    assert_same_bytes(ops.quant_dequant_rows(x), ops.quant_dequant_rows(x, impl="jax"))
    s = jnp.asarray([1e-45, 1e-40, 3e38, 2.0 ** -126, 1.0, 3e-3, 1e30, 7e-39], jnp.float32)  # static: 1/s inf to tiny
    assert_same_bytes(ops.quant_dequant_rows(x, input_scale=s, repeat=2),
                      ops.quant_dequant_rows(x, input_scale=s, repeat=2, impl="jax"))


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 64, 1000])
def test_gpu_moe_w4a4_kernel_quant_is_the_jax_quantizer(t):
    x, experts, ids, w = _moe_case(5, t, 32, 4, h=256, i=128)
    run = lambda flags: ops.moe(x, experts, ids, w, mode="w4a4", kernel_flags=flags)  # noqa: E731
    np.testing.assert_array_equal(bits(run(0)), bits(run(JAX_QUANT)))
