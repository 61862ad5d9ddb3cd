"""Kernel layouts: 128x4 scale swizzle and kernel row orders, bit-equal to the golden files."""

import jax
import numpy as np
import pytest

import jax_nvfp4 as nv
from jax_nvfp4 import layouts
from conftest import golden, golden_names


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", golden_names("swizzle_"))
def test_swizzle_golden(name, jit):
    z = golden(name)
    lin, sw = z["linear"], z["swizzled"]
    m, kb = lin.shape
    swz = jax.jit(nv.swizzle_scales) if jit else nv.swizzle_scales
    unswz = jax.jit(nv.unswizzle_scales, static_argnums=(1, 2)) if jit else nv.unswizzle_scales
    np.testing.assert_array_equal(np.asarray(swz(lin)), sw)
    np.testing.assert_array_equal(np.asarray(unswz(sw, m, kb)), lin)


def test_swizzle_batched_and_fp8():
    rng = np.random.default_rng(0)
    s = rng.integers(0, 127, (3, 200, 7), dtype=np.uint8)
    out = np.asarray(nv.swizzle_scales(jax.lax.bitcast_convert_type(s, np.dtype("float8_e4m3fn"))))
    for e in range(3):
        np.testing.assert_array_equal(out[e].view(np.uint8), np.asarray(nv.swizzle_scales(s[e])))
    with pytest.raises(ValueError, match="need"):
        nv.unswizzle_scales(np.zeros(100, np.uint8), 200, 7)


@pytest.mark.parametrize("m", [256, 1024])
def test_trtllm_rows_golden(m):
    z = golden(f"trtllm_rows_{m}.npz")
    np.testing.assert_array_equal(layouts.trtllm_gated_reorder(m), z["gated_reorder"])
    np.testing.assert_array_equal(layouts.trtllm_epilogue_shuffle(m), z["epilogue_shuffle"])
    np.testing.assert_array_equal(nv.trtllm_gemm1_rows(m), z["w13_rows"])
    np.testing.assert_array_equal(nv.trtllm_gemm2_rows(m), z["epilogue_shuffle"])


@pytest.mark.parametrize("m", [256, 1024])
def test_cutedsl_rows_golden(m):
    z = golden(f"cutedsl_rows_{m}.npz")
    np.testing.assert_array_equal(nv.cutedsl_gemm1_rows(m), z["w13_rows"])


def test_row_orders_are_permutations_and_gate_up_roll():
    for rows in (nv.trtllm_gemm1_rows(512), nv.cutedsl_gemm1_rows(512), nv.gate_up_to_up_gate(512)):
        assert sorted(rows.tolist()) == list(range(512))
    r = nv.gate_up_to_up_gate(8)
    np.testing.assert_array_equal(r, [4, 5, 6, 7, 0, 1, 2, 3])
    with pytest.raises(ValueError, match="multiple of 128"):
        nv.cutedsl_gemm1_rows(192)
    with pytest.raises(ValueError, match="trtllm_gemm1_rows: the number of rows must be a multiple of 32"):
        nv.trtllm_gemm1_rows(48)
