"""MoE expert activations (spec section 5), computed in float32.

A gated activation takes the GEMM1 output ``h [..., 2I]`` whose columns are ``[gate; up]``
(jax_nvfp4's canonical GEMM1 row order) and returns ``[..., I]``; ``relu2`` is not gated and
maps ``[..., I]`` to ``[..., I]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .backends.base import ACTIVATIONS, GATED_ACTIVATIONS

SWIGLU_OAI_ALPHA = 1.702
SWIGLU_OAI_LIMIT = 7.0


def swiglu(gate, up):
    """``silu(gate) * up``."""
    return jax.nn.silu(gate) * up


def geglu(gate, up):
    """``gelu_tanh(gate) * up`` (the tanh approximation of GELU)."""
    return jax.nn.gelu(gate, approximate=True) * up


def swiglu_oai(gate, up, alpha: float = SWIGLU_OAI_ALPHA, limit: float = SWIGLU_OAI_LIMIT):
    """gpt-oss SwiGLU: ``g * sigmoid(alpha * g) * (u + 1)`` with ``g = min(gate, limit)``,
    ``u = clip(up, -limit, limit)`` (the gate is clamped from above only)."""
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return gate * jax.nn.sigmoid(alpha * gate) * (up + 1.0)


def relu2(h):
    """``relu(h) ** 2`` (not gated)."""
    r = jax.nn.relu(h)
    return r * r


_GATED = {"swiglu": swiglu, "geglu": geglu, "swiglu_oai": swiglu_oai}


def is_gated(name: str) -> bool:
    """Whether activation ``name`` consumes ``[gate; up]`` (2I GEMM1 rows) or not (I rows)."""
    check(name)
    return name in GATED_ACTIVATIONS


def check(name: str) -> None:
    """Raise ValueError unless ``name`` is a known activation."""
    if name not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {name!r}")


def apply(name: str, h):
    """Apply activation ``name`` to a GEMM1 output.

    Parameters
    ----------
    name : one of :data:`~jax_nvfp4.backends.base.ACTIVATIONS`
    h : float ``[..., 2I]`` (gated, columns ``[gate; up]``) or ``[..., I]`` (``relu2``)

    Returns
    -------
    ``[..., I]`` in ``h.dtype`` (float32 in the MoE).
    """
    check(name)
    if name == "relu2":
        return relu2(h)
    n = h.shape[-1]
    if n % 2:
        raise ValueError(f"gated activation {name!r} needs an even GEMM1 width [gate; up], got {n}")
    return _GATED[name](h[..., : n // 2], h[..., n // 2:])
