"""The pure-JAX MoE backend (``backend="xla"``): sort-based dispatch and a grouped matmul.

Runs on every JAX device and is the reference the other backends are tested against.
Pipeline for ``M = T * k`` token-expert pairs (no ``[T, E, H]`` tensor anywhere):

1. **Dispatch.** Pairs are stably sorted by local expert id; ids that are negative (padding) or
   outside this shard's ``[offset, offset + E)`` get the key ``E`` and sort last, where the
   grouped matmul ignores them (they lie past the sum of the group sizes).
2. **Weights.** Two static strategies, chosen from shapes alone (``dispatch``):

   - ``"gather"`` (decode-sized batches, ``M < E``): the packed bytes of the experts that are
     actually hit (at most ``M`` distinct) are gathered and only those are decoded, so a
     decode step never dequantizes an expert no token uses.
   - ``"all"``: every local expert is decoded once (exactly, to bf16: ``e2m1 * scale`` has
     at most 6 significant bits), the per-expert global scale applied to the fp32 result as
     ``alpha`` (the gate and up rows of GEMM1 each their own where ``up_global_scale`` is set).
3. **Grouped matmul** (``gmm``), bf16 operands with fp32 accumulation:

   - ``"ragged"``: :func:`jax.lax.ragged_dot_general`. XLA lowers it (on CPU and GPU) by
     expanding the rows densely over the groups, costing ``G * M`` row products, so it is
     used only while that is cheap (few groups or few rows; see :func:`choose_gmm`).
   - ``"tiled"``: groups are padded to a row tile; a ``lax.scan`` over at most
     ``(M + min(G, M) * (tile - 1)) / tile`` tiles multiplies each tile by its group's
     weights, costing about ``M + G * tile`` row products. Always used on the CPU.

4. **Activation** in fp32; the intermediate is rounded to bf16 (``bf16``/``w4a16``) or
   quantized per row to NVFP4 and decoded exactly (``w4a4``) before GEMM2. ``w4a4`` on experts with static
   activation scales (``input_scales``) quantizes each pair's rows of x and of the intermediate on its expert's
   scale instead of per token.
5. **Combine.** Rows are scaled by ``topk_weight * alpha2`` (and the activation scales in
   ``w4a4``), un-sorted by a gather, and each token's ``k`` rows are summed in a fixed order
   (deterministic, no scatter-add), then rounded to bf16.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import activations
from ..expert_sharding import over_experts, with_batching, with_expert_grads
from ..formats import BF16Experts, NVFP4Experts, dequantize
from ..quantize import quant_dequant_static, quantize
from .base import MoEProblem, Options, default_platform, register

DISPATCH = ("auto", "gather", "all")
GMM = ("auto", "ragged", "tiled")
# Roofline constants for the strategy choice: H200 figures (spec section 6) and an estimate of
# the fixed cost of one scan step of the tiled matmul (loop iteration, weight slice, launch).
_FLOP_S, _BYTES_S, _STEP_S = 790e12, 4.3e12, 10e-6
_RAGGED_DN = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])


# ---------------------------------------------------------------------------------------------
# Static strategy choice


def choose_dispatch(pairs: int, num_experts: int) -> str:
    """``"gather"`` when there are fewer token-expert pairs than local experts, else ``"all"``."""
    return "gather" if pairs < num_experts else "all"


def tile_rows(rows: int, groups: int) -> int:
    """Row tile of the tiled matmul: about one tile per group, a power of two in [8, 256]."""
    avg = max(1, -(-rows // max(groups, 1)))
    return int(min(256, max(8, 1 << (avg - 1).bit_length())))


def num_tiles(rows: int, groups: int, tile: int) -> int:
    """Static bound on ``sum_g ceil(size_g / tile)``: at most ``min(groups, rows)`` groups are
    non-empty, each wasting less than one tile."""
    return max(1, (rows + min(groups, rows) * (tile - 1)) // tile)


def choose_gmm(rows: int, groups: int, weights: int = 1 << 22, platform: str | None = None) -> str:
    """``"ragged"`` or ``"tiled"`` for grouped matmuls of ``rows`` sorted rows over ``groups``
    groups of ``weights`` weights each (GEMM1 plus GEMM2).

    XLA:CPU runs the dense expansion of ``ragged_dot`` slowly at any size, so the CPU always
    tiles. Elsewhere a roofline estimate with H200 figures picks the cheaper one: ``ragged`` is
    one matmul over ``groups * rows`` rows that reads every group's weights once; ``tiled`` is
    ``num_tiles`` scan steps, each reading one group's weights and paying a fixed step cost
    (an estimate, to be calibrated with ``benchmarks/moe_bench.py --xla-variants``).
    """
    platform = default_platform() if platform is None else platform
    if platform == "cpu":
        return "tiled"
    tile = tile_rows(rows, groups)
    w_bytes = 2.0 * weights  # bf16 operands
    ragged = max(2.0 * groups * rows * weights / _FLOP_S, groups * w_bytes / _BYTES_S)
    step = max(2.0 * tile * weights / _FLOP_S, w_bytes / _BYTES_S) + 2 * _STEP_S
    return "ragged" if ragged <= num_tiles(rows, groups, tile) * step else "tiled"


def resolve_strategy(pairs: int, experts, dispatch: str = "auto", gmm: str = "auto"):
    """Replace ``"auto"`` by the static choice for ``pairs`` token-expert pairs and ``experts``."""
    e = experts.num_experts
    dispatch = choose_dispatch(pairs, e) if dispatch == "auto" else dispatch
    if gmm == "auto":
        weights = (experts.gate_up.shape[1] + experts.intermediate_size) * experts.hidden_size
        gmm = choose_gmm(pairs, pairs if dispatch == "gather" else e, weights)
    return dispatch, gmm


# ---------------------------------------------------------------------------------------------
# Grouped matmul: lhs [M, K] rows sorted by group, rhs [G, N, K] -> [M, N] float32.
# Rows past sum(group_sizes) give zeros.


def gmm_ragged(lhs, rhs, group_sizes):
    """``lax.ragged_dot_general`` contracting ``rhs``'s last axis (no transpose materialized)."""
    return lax.ragged_dot_general(lhs, rhs, group_sizes, _RAGGED_DN,
                                  preferred_element_type=jnp.float32)


def gmm_tiled(lhs, rhs, group_sizes, tile: int | None = None):
    """Tile-padded grouped matmul: a scan over row tiles, each multiplied by one group's weights.

    Parameters
    ----------
    lhs : ``[M, K]`` rows sorted by group
    rhs : ``[G, N, K]``
    group_sizes : int32 ``[G]``, sum <= M
    tile : rows per tile (static; default :func:`tile_rows`)

    Returns
    -------
    float32 ``[M, N]``.
    """
    m, kdim = lhs.shape
    g, n, _ = rhs.shape
    tile = tile_rows(m, g) if tile is None else tile
    n_tiles = num_tiles(m, g, tile)
    tiles = (group_sizes + tile - 1) // tile
    tile_end = jnp.cumsum(tiles)
    row_end = jnp.cumsum(group_sizes)
    rows = jnp.arange(m, dtype=jnp.int32)
    grp = jnp.searchsorted(row_end, rows, side="right")  # == g past the last group
    gc = jnp.minimum(grp, g - 1)
    dest = (tile_end[gc] - tiles[gc]) * tile + rows - (row_end[gc] - group_sizes[gc])
    dest = jnp.where(grp < g, dest, n_tiles * tile)  # out of bounds: dropped
    buf = jnp.zeros((n_tiles * tile, kdim), lhs.dtype).at[dest].set(lhs, mode="drop")
    # Unused trailing tiles (zero rows) repeat the last group instead of branching: a lax.cond
    # would cost a device-to-host sync per step on GPUs, more than the wasted tile.
    tile_grp = jnp.minimum(jnp.searchsorted(tile_end, jnp.arange(n_tiles, dtype=jnp.int32),
                                            side="right"), g - 1)

    # Checkpointed so that reverse mode saves only the step inputs, not each step's weight slice.
    @jax.checkpoint
    def step(carry, inp):
        xt, gi = inp
        w = lax.dynamic_index_in_dim(rhs, gi, keepdims=False)
        return carry, lax.dot_general(xt, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

    _, ys = lax.scan(step, None, (buf.reshape(n_tiles, tile, kdim), tile_grp))
    return ys.reshape(n_tiles * tile, n).at[dest].get(mode="fill", fill_value=0)


def _gmm(kind, lhs, rhs, group_sizes):
    return gmm_ragged(lhs, rhs, group_sizes) if kind == "ragged" else gmm_tiled(lhs, rhs, group_sizes)


# ---------------------------------------------------------------------------------------------
# Dispatch plan and weights


def _plan(flat_ids, num_experts, offset, dispatch):
    """Sort pairs by local expert; return (order, valid_sorted, group_sizes, row_group, hit)."""
    m = flat_ids.shape[0]
    local = flat_ids - offset
    valid = (flat_ids >= 0) & (local >= 0) & (local < num_experts)
    key = jnp.where(valid, local, num_experts).astype(jnp.int32)
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    skey = key[order]
    valid_s = skey < num_experts
    if dispatch == "gather":
        # Slot = rank of the pair's expert among the distinct experts hit (sorted, so contiguous).
        new = jnp.concatenate([jnp.ones((1,), bool), skey[1:] != skey[:-1]])
        slot = jnp.cumsum(new.astype(jnp.int32)) - 1
        hit = jnp.zeros((m,), jnp.int32).at[slot].set(jnp.minimum(skey, num_experts - 1))
        sizes = jnp.zeros((m,), jnp.int32).at[slot].add(valid_s.astype(jnp.int32))
        return order, valid_s, sizes, slot, hit
    sizes = jnp.zeros((num_experts,), jnp.int32).at[skey].add(1, mode="drop")
    return order, valid_s, sizes, jnp.minimum(skey, num_experts - 1), None


def _weights(experts, hit):
    """bf16 GEMM operands (of the hit experts, if given) and per-expert alphas: GEMM1's, its up rows' own (None
    without ``up_global_scale``), GEMM2's (all None for bf16)."""
    if isinstance(experts, NVFP4Experts):
        gu, dn, up = experts.gate_up, experts.down, experts.up_global_scale
        if hit is not None:  # gather packed bytes first: decode only what is used
            gu, dn, up = gu[hit], dn[hit], (None if up is None else up[hit])
        return (dequantize(gu, jnp.bfloat16, apply_global_scale=False),
                dequantize(dn, jnp.bfloat16, apply_global_scale=False),
                gu.global_scale.astype(jnp.float32), up, dn.global_scale.astype(jnp.float32))
    w1, w2 = experts.gate_up, experts.down
    if hit is not None:
        w1, w2 = jnp.take(w1, hit, axis=0), jnp.take(w2, hit, axis=0)
    return w1.astype(jnp.bfloat16), w2.astype(jnp.bfloat16), None, None, None


def _exact_bf16(q):
    """NVFP4 per-row activations -> (bf16 values without the global scale, global scale [rows])."""
    return dequantize(q, jnp.bfloat16, apply_global_scale=False), q.global_scale.astype(jnp.float32)


def moe_experts(x, experts, topk_ids, topk_weights, *, mode: str, activation: str,
                local_expert_offset=0, dispatch: str = "auto", gmm: str = "auto"):
    """Expert part of the MoE layer in pure JAX (routing already decided); jitted.

    Parameters
    ----------
    x : bfloat16 ``[T, H]``
    experts : NVFP4Experts (``w4a16``, ``w4a4``) or BF16Experts (``bf16``) with ``E`` local experts
    topk_ids : int ``[T, k]`` global ids; negative = padding, outside
        ``[local_expert_offset, local_expert_offset + E)`` = another shard's expert
    topk_weights : float ``[T, k]``
    mode, activation : str (static)
    local_expert_offset : int or int32 scalar (may be traced, e.g. from ``lax.axis_index``)
    dispatch : ``"auto"``, ``"gather"`` or ``"all"`` (static; see the module docstring)
    gmm : ``"auto"``, ``"ragged"`` or ``"tiled"`` (static)

    Returns
    -------
    bfloat16 ``[T, H]``.
    """
    t, h = x.shape
    k = topk_ids.shape[1]
    e = experts.num_experts
    m = t * k
    if m == 0:
        return jnp.zeros((t, h), jnp.bfloat16)
    dispatch, gmm = resolve_strategy(m, experts, dispatch, gmm)
    order, valid_s, sizes, row_group, hit = _plan(topk_ids.reshape(m).astype(jnp.int32), e,
                                                  local_expert_offset, dispatch)
    tok = order // k
    w1, w2, alpha1, alpha1_up, alpha2 = _weights(experts, hit)
    b1, b2 = (None if b is None else jnp.asarray(b if hit is None else b[hit], jnp.float32)[row_group]
              for b in (experts.gate_up_bias, experts.down_bias))  # per row, float32

    static = mode == "w4a4" and isinstance(experts, NVFP4Experts) and experts.input_scales is not None
    if static:  # each pair's row on its expert's static scale (columns: GEMM1's, GEMM2's input)
        s_in = experts.input_scales if hit is None else experts.input_scales[hit]
        xs, dx = quant_dequant_static(x[tok], s_in[row_group, 0])
    elif mode == "w4a4":
        xq, dx = _exact_bf16(quantize(x, per_token=True))
        xs, dx = xq[tok], dx[tok]
    else:
        xs, dx = x[tok], None
    g = _gmm(gmm, xs, w1, sizes)  # [M, N1] f32
    if alpha1 is not None:  # the kernels' order: (da * alpha) per row, then times the sum
        row_scale = lambda a: (a[row_group] if dx is None else dx * a[row_group])[:, None]  # noqa: E731
        s = row_scale(alpha1)
        if alpha1_up is not None:  # the up half (the last n1 / 2 features) by its own
            s = jnp.where(jnp.arange(g.shape[1]) < g.shape[1] // 2, s, row_scale(alpha1_up))
        g = g * s
    if b1 is not None:
        g = g + b1
    a = activations.apply(activation, g)  # [M, I] f32

    w = topk_weights.reshape(m).astype(jnp.float32)[order]
    # The spec's order, w * da * alpha2 (the ffi kernels' too); with a down bias w * (da * alpha2 * acc + b2).
    scale2 = jnp.ones_like(w) if b2 is not None else w
    if mode == "w4a4":
        a, da = quant_dequant_static(a, s_in[row_group, 1]) if static else _exact_bf16(quantize(a, per_token=True))
        scale2 = scale2 * da
    else:
        a = a.astype(jnp.bfloat16)
    if alpha2 is not None:
        scale2 = scale2 * alpha2[row_group]
    y = _gmm(gmm, a, w2, sizes) * scale2[:, None]  # [M, H] f32
    if b2 is not None:
        y = (y + b2) * w[:, None]
    y = jnp.where(valid_s[:, None], y, 0.0)

    inv = jnp.zeros((m,), jnp.int32).at[order].set(jnp.arange(m, dtype=jnp.int32))
    return y[inv].reshape(t, k, h).sum(axis=1).astype(jnp.bfloat16)


# Jitted so that eager calls compile once per shape (inside an outer jit this is inlined).
moe_experts = jax.jit(moe_experts, static_argnames=("mode", "activation", "dispatch", "gmm"))


def _on_leaves(mode: str, activation: str, dispatch: str, gmm: str, treedef):
    """:func:`moe_experts` as ``f(x, topk_ids, topk_weights, leaves, offset)`` on the experts' flat leaves, its
    ``"auto"`` strategies resolved first (so that equal strategies share one compiled function)."""

    def at(x, topk_ids, topk_weights, leaves, offset):
        experts = jax.tree_util.tree_unflatten(treedef, leaves)
        d, g = resolve_strategy(topk_ids.shape[0] * topk_ids.shape[1], experts, dispatch, gmm)
        return moe_experts(x, experts, topk_ids, topk_weights, mode=mode, activation=activation,
                           local_expert_offset=offset, dispatch=d, gmm=g)
    return at


@functools.lru_cache(maxsize=None)
def _over_devices(mode: str, activation: str, offset: int, dispatch: str, gmm: str, treedef):
    """:func:`moe_experts` at a static ``offset`` as ``f(x, topk_ids, topk_weights, leaves)`` (the experts' flat
    leaves) with :mod:`~jax_nvfp4.expert_sharding`'s rule: under plain ``jit`` over several devices each device runs
    its own experts on its own tokens (each choosing its strategy for its share) instead of XLA gathering every
    expert; its gradients (a ``custom_vjp``: reverse mode only) split alike. ``jax.vmap`` folds a batch of token sets
    into one (shared experts) or, for a batch of expert sets, runs one element after the other (each split)."""

    at = _on_leaves(mode, activation, dispatch, gmm, treedef)
    split = with_batching(over_experts(at, offset))
    return with_expert_grads(split, at, offset)


@functools.lru_cache(maxsize=None)
def _one_device(mode: str, activation: str, offset: int, dispatch: str, gmm: str, treedef):
    """:func:`moe_experts` at a static ``offset`` as ``f(x, topk_ids, topk_weights, leaves)`` with a ``jax.vmap``
    rule: a batch of token sets runs as one set, a batch of expert sets one set after the other (as the ffi kernels
    do). Batched as it is, the function would reach ``lax.ragged_dot``'s batching rule, which refuses tokens batched
    with a routing that is not. Derivatives, both modes, are the function's own (a ``custom_jvp`` whose rule
    differentiates it), so ``vmap`` of a derivative still batches it."""

    plain = functools.partial(_on_leaves(mode, activation, dispatch, gmm, treedef), offset=offset)
    batched = with_batching(plain)
    f = jax.custom_jvp(batched)
    f.defjvp(lambda primals, tangents: jax.jvp(plain, primals, tangents))
    return f


class XLABackend(Options):
    """The ``xla`` backend (see the module docstring); supports every mode and activation.

    Parameters
    ----------
    dispatch : ``"auto"``, ``"gather"`` or ``"all"``
    gmm : ``"auto"``, ``"ragged"`` or ``"tiled"``
        Overrides of the static strategy choice (for tests and benchmarks).
    """

    name = "xla"

    def __init__(self, dispatch: str = "auto", gmm: str = "auto"):
        if dispatch not in DISPATCH:
            raise ValueError(f"dispatch must be one of {DISPATCH}, got {dispatch!r}")
        if gmm not in GMM:
            raise ValueError(f"gmm must be one of {GMM}, got {gmm!r}")
        self.dispatch, self.gmm = dispatch, gmm

    def unavailable_reason(self) -> str | None:
        return None

    def unsupported_reason(self, problem: MoEProblem) -> str | None:
        return None

    def __call__(self, x, experts, topk_ids, topk_weights, *, problem: MoEProblem,
                 local_expert_offset):
        if not isinstance(experts, (NVFP4Experts, BF16Experts)):
            raise TypeError(f"experts must be NVFP4Experts or BF16Experts, got {type(experts).__name__}")
        if isinstance(local_expert_offset, (int, np.integer)):
            # Under plain jit over several devices the experts and tokens may be sharded: split the work as the ffi
            # kernels do. (Both forms carry vmap rules; a traced offset, inside shard_map, runs the plain function.)
            leaves, treedef = jax.tree_util.tree_flatten(experts)
            f = (_over_devices if jax.device_count() > 1 else _one_device)(
                problem.mode, problem.activation, int(local_expert_offset), self.dispatch, self.gmm, treedef)
            return f(x, topk_ids, topk_weights, tuple(leaves))
        # Resolve "auto" here so that equal strategies share one compiled function.
        dispatch, gmm = resolve_strategy(topk_ids.shape[0] * topk_ids.shape[1], experts,
                                         self.dispatch, self.gmm)
        return moe_experts(x, experts, topk_ids, topk_weights, mode=problem.mode,
                           activation=problem.activation, local_expert_offset=local_expert_offset,
                           dispatch=dispatch, gmm=gmm)


register(XLABackend())
