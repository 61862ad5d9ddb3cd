"""Demo: quantize a random MoE layer's experts online and run it jitted in every mode.

    python -m jax_nvfp4.demo [--experts 16 --hidden 1024 --intermediate 512 --tokens 64 --top-k 4]

Prints the weight quantization error, the MoE output error of w4a16/w4a4 against bf16, and
the time of each jitted call on the default device.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

import jax_nvfp4 as nv


def _time(fn, *args, repeats: int = 5) -> float:
    jax.block_until_ready(fn(*args))  # compile + warm up
    t0 = time.perf_counter()
    for _ in range(repeats):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / repeats


def _rel(a, b) -> float:
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m jax_nvfp4.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--top-k", type=int, default=4)
    a = p.parse_args(argv)
    E, H, I, T = a.experts, a.hidden, a.intermediate, a.tokens
    k = jax.random.split(jax.random.key(0), 4)
    gate_up = (jax.random.normal(k[0], (E, 2 * I, H), jnp.float32) * H**-0.5).astype(jnp.bfloat16)
    down = (jax.random.normal(k[1], (E, H, I), jnp.float32) * I**-0.5).astype(jnp.bfloat16)
    x = jax.random.normal(k[2], (T, H), jnp.bfloat16)
    logits = jax.random.normal(k[3], (T, E), jnp.float32)
    print(f"device: {jax.devices()[0].device_kind}  jax {jax.__version__}")
    print(f"MoE layer: {E} experts, hidden {H}, intermediate {I}, {T} tokens, top-{a.top_k}, SwiGLU")

    quantize = jax.jit(nv.quantize_experts)
    t_q = _time(quantize, gate_up, down)
    w4 = quantize(gate_up, down)
    err_w = _rel(jnp.concatenate([nv.dequantize(w4.gate_up).ravel(), nv.dequantize(w4.down).ravel()]),
                 jnp.concatenate([gate_up.ravel(), down.ravel()]))  # both tensors
    n_bytes = gate_up.size * 2 + down.size * 2
    print(f"online quantization: {t_q * 1e3:8.2f} ms for {n_bytes / 1e6:.1f} MB of bf16 experts "
          f"({n_bytes / t_q / 1e9:.2f} GB/s); weight rel. error {err_w:.4f}")

    bf16 = nv.BF16Experts(gate_up, down)
    layer = jax.jit(lambda x, w, l, mode: nv.moe(x, w, router_logits=l, top_k=a.top_k, mode=mode),
                    static_argnames="mode")
    ref = layer(x, bf16, logits, "bf16")
    for mode, w in (("bf16", bf16), ("w4a16", w4), ("w4a4", w4)):
        t = _time(layer, x, w, logits, mode)
        err = _rel(layer(x, w, logits, mode), ref)
        print(f"moe mode={mode:6s} {t * 1e3:8.2f} ms/call   output rel. error vs bf16 {err:.4f}")


if __name__ == "__main__":
    main()
