"""Find out what XLA:GPU does to a plain transcription of the quantizer (spec section 7).

Runs the golden quantization cases three ways on the default device: jax_nvfp4's exact
quantizer; the same code with the exact helpers replaced by plain jnp arithmetic; and reports
whether fp32 subnormal products survive (FTZ). Prints one line per variant.
"""

import glob
import os
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import jax_nvfp4 as nv
from jax_nvfp4 import _exact as ex

GOLDEN = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "..", "shared", "golden")
VARIANTS = {"tensor": {}, "token": dict(per_token=True), "fourover6_tensor": dict(recipe="4over6"),
            "fourover6_token": dict(per_token=True, recipe="4over6")}


def count_exact():
    ok = total = 0
    for f in sorted(glob.glob(os.path.join(GOLDEN, "quant_*.npz"))):
        z = np.load(f)
        x = jnp.asarray(z["x_bf16_bits"].view(ml_dtypes.bfloat16))
        for pre, kw in VARIANTS.items():
            q = jax.jit(lambda x: nv.quantize(x, **kw))(x)
            total += 1
            ok += (np.array_equal(np.asarray(q.data), z[pre + "_data"])
                   and np.array_equal(np.asarray(q.scales).view(np.uint8), z[pre + "_scales"]))
    return ok, total


def main():
    print("device:", jax.devices()[0].device_kind, "jax", jax.__version__)
    tiny = jnp.float32(2.0**-130)
    prod = jax.jit(lambda a, b: a * b)(tiny, jnp.float32(0.5))
    print("subnormal product kept (no FTZ):", float(prod) != 0.0)
    ok, total = count_exact()
    print(f"exact quantizer: {ok}/{total} golden cases bit-exact under jit")
    # Plain transcription: hardware division, no fences, hardware f32 -> e4m3 round trip.
    saved = (ex.div_rn, ex.fence, ex.f32_to_e4m3_bits)
    ex.div_rn = lambda a, b: jnp.asarray(a, jnp.float32) / jnp.asarray(b, jnp.float32)
    ex.fence = lambda x, zero=None: x
    ex.f32_to_e4m3_bits = lambda x: jax.lax.bitcast_convert_type(
        jnp.asarray(x, jnp.float32).astype(jnp.float8_e4m3fn), jnp.uint8)
    try:
        ok, total = count_exact()
        print(f"plain jnp transcription: {ok}/{total} golden cases bit-exact under jit")
    finally:
        ex.div_rn, ex.fence, ex.f32_to_e4m3_bits = saved


if __name__ == "__main__":
    main()
