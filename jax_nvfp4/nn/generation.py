"""Batched generation and scoring for RL rollouts, each one ``jax.jit``.

:func:`generate` runs the prefill and a ``lax.while_loop`` of decode steps in one compiled function:
temperature / top-p sampling, per-token log-probabilities, EOS handling, and optionally every
layer's expert selection (``return_routing``) for routing replay. :func:`sequence_logprobs` scores
given sequences by teacher forcing (in passes of at most 8192 tokens), e.g. under the bf16 policy, to measure the
mismatch of a quantized rollout engine.

Both take any :class:`~jax_nvfp4.nn.CausalLM` (``Qwen3MoeForCausalLM``, ``GptOssForCausalLM``: ``config``,
``init_cache``, ``hidden_states``, ``logits``). Prompts are left-padded: ``prompt_mask`` is False on
the padding, and every sequence's last prompt token sits in the last column.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from flax import nnx


class GenerationOutput(NamedTuple):
    """Result of :func:`generate` (``N = max_new_tokens``, ``P`` prompt columns).

    tokens : int32 ``[B, N]``: sampled tokens, ``pad_id`` after a sequence's EOS
    logprobs : float32 ``[B, N]``: log-probability of each token under the sampling distribution
        ``softmax(logits / temperature)`` (before top-p truncation; ``temperature=1`` when greedy);
        0 where ``mask`` is False
    mask : bool ``[B, N]``: True for generated tokens, up to and including EOS
    routing : int32 ``[L, B, P + N, k]`` or None: expert ids of every layer at every position
        (prompt and generated; -1 where nothing was computed)
    """

    tokens: Any
    logprobs: Any
    mask: Any
    routing: Any = None


def _check_prompts(tokens, mask, vocab_size: int, names=("prompt_tokens", "prompt_mask"), left_padded=False):
    """tokens int [B, P] and an optional mask of its shape; ``names``: the caller's argument names. Concrete values
    are checked too (one host sync; under an outer jit they cannot be): ids in the vocabulary (an embedding lookup
    would clamp or give NaN, silently) and, with ``left_padded``, masks False only on a leading prefix."""
    if tokens.ndim != 2:
        raise ValueError(f"{names[0]} must be [B, P], got shape {tuple(tokens.shape)}")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise TypeError(f"{names[0]} must be integer token ids, got {tokens.dtype}")
    if mask is not None and tuple(mask.shape) != tuple(tokens.shape):
        raise ValueError(f"{names[1]} must have {names[0]}' shape {tuple(tokens.shape)}, got {tuple(mask.shape)}")
    if isinstance(tokens, np.ndarray) and (mask is None or isinstance(mask, np.ndarray)):
        valid = np.ones(tokens.shape, bool) if mask is None else mask.astype(bool)  # on the host: no device work
        ids = tokens.astype(np.int64)
        out_of_vocab = np.any(valid & ((ids < 0) | (ids >= vocab_size)))
        not_left = np.any(valid[:, :-1] & ~valid[:, 1:])
    else:  # one host sync (an array still being computed is waited for); inside jax.jit none can be
        valid = jnp.ones(tokens.shape, bool) if mask is None else jnp.asarray(mask).astype(bool)
        out_of_vocab, not_left = _prompt_faults(jnp.asarray(tokens), valid, vocab_size)
        if isinstance(out_of_vocab, jax.core.Tracer):
            return
    if out_of_vocab:
        ids = np.asarray(tokens).astype(np.int64)[np.asarray(valid)]
        raise ValueError(f"{names[0]} must be ids in [0, vocab_size={vocab_size}) where {names[1]} is True, "
                         f"got {ids[(ids < 0) | (ids >= vocab_size)][0]}")
    if left_padded and not_left:
        raise ValueError(f"{names[1]} must be left-padded (False only before a row's first True): generation "
                         f"continues from the last position")


@jax.jit
def _prompt_faults(tokens, valid, vocab_size):
    ids = tokens.astype(jnp.int32)  # (compared in the tokens' dtype, a vocabulary past it would wrap)
    out_of_vocab = jnp.any(valid & ((ids < 0) | (ids >= vocab_size)))
    return out_of_vocab, jnp.any(valid[:, :-1] & ~valid[:, 1:])


def sample_logits(key, logits, *, temperature: float = 1.0, top_p: float = 1.0):
    """Sample one token per row.

    Parameters
    ----------
    key : PRNG key
    logits : float ``[B, V]``
    temperature : float (static): 0 is greedy (argmax)
    top_p : float (static) in (0, 1]: sample among the most likely tokens whose probabilities sum to
        at least ``top_p`` (nucleus sampling; the most likely token is always kept)

    Returns
    -------
    (tokens int32 ``[B]``, logprobs float32 ``[B]`` under ``softmax(logits / temperature)``)
    """
    logits = logits.astype(jnp.float32)
    if temperature == 0:
        tok = jnp.argmax(logits, axis=-1)
        logp = jax.nn.log_softmax(logits, axis=-1)
    else:
        z = logits / temperature
        logp = jax.nn.log_softmax(z, axis=-1)
        if top_p < 1.0:
            srt = jnp.sort(logp, axis=-1)[:, ::-1]
            p = jnp.exp(srt)
            keep = (jnp.cumsum(p, axis=-1) - p) < top_p  # mass before this token is below top_p
            threshold = jnp.min(jnp.where(keep, srt, jnp.inf), axis=-1, keepdims=True)
            z = jnp.where(logp >= threshold, z, -jnp.inf)
        tok = jax.random.categorical(key, z, axis=-1)
    tok = tok.astype(jnp.int32)
    return tok, jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0]


def _call_on_mesh(jitted, graphdef, state, *args, **kwargs):
    """``jitted(graphdef, state, *args, **kwargs)``, under the mesh of the model's weights where its axes are Explicit
    and no mesh is set (e.g. :func:`~jax_nvfp4.nn.expert_parallel`'s experts: their blocks' outputs are typed on the
    mesh, so must the rest be, else the KV cache's update fails with a ``ShardingTypeError``), its array inputs not
    on the mesh yet (e.g. a ``prompt_mask`` made on one device) placed there replicated. Inside ``jax.jit`` no mesh
    can be set: a clear error instead."""
    current = jax.sharding.get_abstract_mesh()
    mesh = None
    for v in jax.tree.leaves(state):
        sh = jax.typeof(v).sharding if isinstance(v, jax.core.Tracer) else getattr(v, "sharding", None)
        if isinstance(sh, jax.sharding.NamedSharding) and jax.sharding.AxisType.Explicit in sh.mesh.axis_types:
            mesh = sh.mesh
            break
    if mesh is None or not current.empty and current != getattr(mesh, "abstract_mesh", mesh):
        return jitted(graphdef, state, *args, **kwargs)
    unset = ValueError(f"the model's weights are split over a mesh of Explicit axes {dict(mesh.shape)} (e.g. by "
                       f"expert_parallel); inside jax.jit or another transformation, run it under "
                       f"`with jax.set_mesh(mesh):` around the call")
    if not isinstance(mesh, jax.sharding.Mesh):  # (a traced model's: abstract)
        if current.empty:
            raise unset
        return jitted(graphdef, state, *args, **kwargs)
    try:
        on_mesh = jax.set_mesh(mesh) if current.empty else contextlib.nullcontext()
    except ValueError as err:  # inside jax.jit
        raise unset from err
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def place(v):
        if isinstance(v, jax.core.Tracer) or not isinstance(v, (jax.Array, np.ndarray)) or (
                isinstance(v, jax.Array) and isinstance(v.sharding, jax.sharding.NamedSharding)
                and v.sharding.mesh == mesh):
            return v
        return jax.device_put(v, replicated)
    args, kwargs = jax.tree.map(place, (args, kwargs))
    with on_mesh:
        return jitted(graphdef, state, *args, **kwargs)


def generate(model, prompt_tokens, *, key, max_new_tokens: int, prompt_mask=None, temperature: float = 1.0,
             top_p: float = 1.0, eos_id: int | None = None, pad_id: int = 0,
             return_routing: bool = False) -> GenerationOutput:
    """Sample continuations of a batch of prompts: prefill + decode loop, one ``jax.jit``.

    Parameters
    ----------
    model : a :class:`~jax_nvfp4.nn.CausalLM` (bf16 or quantized: its MoE mode decides)
    prompt_tokens : int32 ``[B, P]``, left-padded
    key : PRNG key
    max_new_tokens : int (static) N
    prompt_mask : optional bool ``[B, P]``: False on left padding (default: all True)
    temperature, top_p : float (static), see :func:`sample_logits`
    eos_id : optional int: a sequence stops after emitting it; the loop ends early when all have
    pad_id : int: filler after EOS
    return_routing : bool (static): also return the expert ids of every layer and position

    Returns
    -------
    :class:`GenerationOutput`

    Notes
    -----
    Compiled once per model structure (graph, MoE modes) and static argument set; callable inside
    an outer ``jax.jit`` too (e.g. after :func:`~jax_nvfp4.nn.quantize_moe` of a merged policy).
    """
    _check_prompts(prompt_tokens, prompt_mask, model.config.vocab_size, left_padded=True)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if prompt_mask is None:
        prompt_mask = jnp.ones(prompt_tokens.shape, bool)
    graphdef, state = nnx.split(model)
    # eos_id and pad_id are traced (no recompilation per value); -1 never matches a sampled token.
    eos = jnp.asarray(-1 if eos_id is None else eos_id, jnp.int32)
    return _call_on_mesh(_generate, graphdef, state, prompt_tokens.astype(jnp.int32), prompt_mask.astype(bool),
                         key, eos, jnp.asarray(pad_id, jnp.int32), max_new_tokens=int(max_new_tokens),
                         temperature=float(temperature), top_p=float(top_p), return_routing=bool(return_routing))


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "temperature", "top_p", "return_routing"))
def _generate(graphdef, state, prompts, prompt_mask, key, eos_id, pad_id, *, max_new_tokens, temperature, top_p,
              return_routing):
    model = nnx.merge(graphdef, state)
    b, p = prompts.shape
    n = max_new_tokens
    cache = model.init_cache(b, p + n)
    out = model.hidden_states(prompts, attention_mask=prompt_mask, cache=cache, return_routing=return_routing)
    logits = model.logits(out.hidden[:, -1])
    routing = None
    if return_routing:
        n_layers, _, _, k = out.routing.shape
        routing = jnp.full((n_layers, b, p + n, k), -1, jnp.int32)
        routing = lax.dynamic_update_slice(routing, out.routing, (0, 0, 0, 0))

    init = dict(i=jnp.zeros((), jnp.int32), cache=out.cache, logits=logits, done=jnp.zeros((b,), bool),
                tokens=jnp.full((b, n), pad_id, jnp.int32), logprobs=jnp.zeros((b, n), jnp.float32),
                mask=jnp.zeros((b, n), bool), routing=routing)

    def cond(c):
        return (c["i"] < n) & ~jnp.all(c["done"])

    def body(c):
        i = c["i"]
        tok, lp = sample_logits(jax.random.fold_in(key, i), c["logits"], temperature=temperature, top_p=top_p)
        live = ~c["done"]
        tok = jnp.where(live, tok, pad_id)
        done = c["done"] | (live & (tok == eos_id))
        # Feed the token: its logits are the next step's, its experts complete the routing record.
        step = model.hidden_states(tok[:, None], attention_mask=live[:, None], cache=c["cache"],
                                   return_routing=return_routing)
        new = dict(i=i + 1, cache=step.cache, logits=model.logits(step.hidden[:, -1]), done=done,
                   tokens=c["tokens"].at[:, i].set(tok), logprobs=c["logprobs"].at[:, i].set(jnp.where(live, lp, 0.0)),
                   mask=c["mask"].at[:, i].set(live), routing=c["routing"])
        if return_routing:
            new["routing"] = lax.dynamic_update_slice(c["routing"], step.routing, (0, 0, p + i, 0))
        return new

    final = lax.while_loop(cond, body, init)
    return GenerationOutput(final["tokens"], final["logprobs"], final["mask"], final["routing"])


_LOGITS_CHUNK_BYTES = 1 << 28  # float32 logits materialized at a time by sequence_logprobs (256 MiB)
# Tokens of one forward pass of sequence_logprobs by default. XLA keeps each layer's loop buffers of the bf16 (xla
# backend) experts apart, so a pass's memory grows with layers x tokens: about 4.7 GB a layer at 64 x 384 tokens of
# Qwen3-30B-A3B or gpt-oss-20b (XLA:CPU memory_analysis); 64 x 384 tokens of 8 gpt-oss-20b layers asked the H100 for
# 35.7 GiB (2026-12-06).
_SCORE_TOKENS = 8192


def sequence_logprobs(model, tokens, *, attention_mask=None, temperature: float = 1.0, topk_ids=None,
                      chunk: int | None = None, batch_chunk: int | None = None):
    """Teacher-forced log-probabilities of each next token (one ``jax.jit``; forward passes of ``batch_chunk``
    sequences).

    Parameters
    ----------
    model : a :class:`~jax_nvfp4.nn.CausalLM`
    tokens : int32 ``[B, L]`` (left-padded prompt followed by its continuation, say)
    attention_mask : optional bool ``[B, L]``: False on padding
    temperature : float (static): log-probabilities of ``softmax(logits / temperature)`` (as the sampler's)
    topk_ids : optional int32 ``[num_layers, B, L, k]``: replay these expert selections (e.g. the rollout's
        ``GenerationOutput.routing``) instead of routing with this model's routers
    chunk : int (static), optional: positions whose ``[B, chunk, V]`` float32 logits are materialized at
        a time; default: as many as fit in 256 MiB (e.g. 6 for B = 64 and Qwen3's 151936-token vocabulary)
    batch_chunk : int (static), optional: sequences per forward pass (one ``lax.map`` over the passes, each
        sequence scored as alone: the model's memory is that of ``batch_chunk`` sequences); default: the batch
        split evenly into passes of at most 8192 tokens (e.g. 4 passes of 16 for 64 x 384 tokens)

    Returns
    -------
    float32 ``[B, L - 1]``: entry ``t`` is ``log p(tokens[:, t + 1] | tokens[:, : t + 1])``; 0 where
    ``attention_mask[:, t + 1]`` is False.
    """
    _check_prompts(tokens, attention_mask, model.config.vocab_size, ("tokens", "attention_mask"))
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probabilities, got {temperature}")
    if tokens.shape[1] < 2:
        raise ValueError(f"tokens needs at least 2 positions, got shape {tuple(tokens.shape)}")
    if attention_mask is None:
        attention_mask = jnp.ones(tokens.shape, bool)
    if chunk is None:
        chunk = max(1, _LOGITS_CHUNK_BYTES // (4 * tokens.shape[0] * model.config.vocab_size))
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    b, length = tokens.shape
    if batch_chunk is None:
        passes = -(-b // max(1, _SCORE_TOKENS // length))
        batch_chunk = -(-b // passes)
    if isinstance(batch_chunk, bool) or not isinstance(batch_chunk, int) or batch_chunk < 1:
        raise ValueError(f"batch_chunk must be an int >= 1, got {batch_chunk!r}")
    graphdef, state = nnx.split(model)
    return _call_on_mesh(_sequence_logprobs, graphdef, state, tokens.astype(jnp.int32), attention_mask.astype(bool),
                         topk_ids, temperature=float(temperature), chunk=int(chunk), batch_chunk=min(batch_chunk, b))


@functools.partial(jax.jit, static_argnames=("graphdef", "temperature", "chunk", "batch_chunk"))
def _sequence_logprobs(graphdef, state, tokens, mask, topk_ids, *, temperature, chunk, batch_chunk):
    model = nnx.merge(graphdef, state)
    b = tokens.shape[0]
    if batch_chunk >= b:
        return _score(model, tokens, mask, topk_ids, temperature, chunk)
    # Passes of batch_chunk sequences; the padding rows (no real token) are dropped.
    n = -(-b // batch_chunk)
    pad = n * batch_chunk - b

    def split(a, axis=0):
        a = jnp.pad(a, [(0, pad) if i == axis else (0, 0) for i in range(a.ndim)])
        return jnp.moveaxis(a.reshape(a.shape[:axis] + (n, batch_chunk) + a.shape[axis + 1:]), axis, 0)
    ids = None if topk_ids is None else split(topk_ids, axis=1)
    lp = lax.map(lambda a: _score(model, a[0], a[1], a[2], temperature, chunk), (split(tokens), split(mask), ids))
    return lp.reshape(n * batch_chunk, -1)[:b]


def _score(model, tokens, mask, topk_ids, temperature, chunk):
    """float32 ``[B, L - 1]`` log-probabilities of one forward pass (see :func:`sequence_logprobs`)."""
    b, length = tokens.shape
    hidden = model.hidden_states(tokens, attention_mask=mask, topk_ids=topk_ids).hidden[:, :-1]
    targets = tokens[:, 1:]
    m = length - 1
    c = min(chunk, m)
    n_chunks = -(-m // c)
    pad = n_chunks * c - m
    hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))

    # One chunk of positions at a time: the full [B, L, V] float32 logits can be gigabytes.
    def score(j):
        h = lax.dynamic_slice_in_dim(hidden, j * c, c, axis=1)
        tgt = lax.dynamic_slice_in_dim(targets, j * c, c, axis=1)
        logp = jax.nn.log_softmax(model.logits(h) / temperature, axis=-1)
        return jnp.take_along_axis(logp, tgt[..., None], axis=-1)[..., 0]

    lp = lax.map(score, jnp.arange(n_chunks))  # [n_chunks, B, c]
    lp = jnp.moveaxis(lp, 0, 1).reshape(b, n_chunks * c)[:, :m]
    return jnp.where(mask[:, 1:], lp, 0.0)
