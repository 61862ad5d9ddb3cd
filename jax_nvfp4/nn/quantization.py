"""Online quantization of a live NNX model's MoE blocks, and loading NVFP4 experts into them.

:func:`quantize_moe` walks any NNX model and replaces the bf16 experts of its :class:`~jax_nvfp4.nn.MoE`
blocks by NVFP4 ones (spec section 4: one global scale per expert for gate and up together, one for
down). It is plain Python over traced or concrete arrays, so it runs eagerly (each block's
quantization is one compiled call) and inside ``jax.jit`` / ``nnx.jit``, e.g. fused with a rollout
after each policy update. :func:`load_experts` puts the experts of a converted checkpoint into the
blocks instead, without materialising bf16.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import jax
from flax import nnx

from .. import activations
from ..backends.base import MODES
from ..checkpoint.naming import ignore_patterns, matches_ignore, strip_model
from ..formats import ORDERS, from_blocked_experts, to_blocked_experts
from ..moe import weight_order
from ..quantize import RECIPES, non_finite_experts, quantize_experts
from .moe import MoE, NVFP4ExpertWeights, check_backend, check_choice, check_expert_axis

QUANTIZED_MODES = ("w4a16", "w4a4")
WEIGHT_ORDERS = ("auto",) + ORDERS


_to_blocked, _from_blocked = jax.jit(to_blocked_experts), jax.jit(from_blocked_experts)


def _order_of(block: MoE, order: str, keep: bool = True) -> str:
    """The byte order ``order`` asks of ``block`` (``"auto"``: the one its backend reads fastest;
    with ``keep``, a block that already holds NVFP4 experts keeps theirs)."""
    if order == "auto":
        if keep and block.quantized:
            return block.experts.order
        return weight_order(block.backend, hidden_size=block.hidden_size, intermediate_size=block.intermediate_size)
    return order


def _weights(ex, order: str) -> NVFP4ExpertWeights:
    """``ex`` in ``order`` (a resolved one: ``_order_of``) as block weights."""
    if ex.gate_up.order != order:
        ex = _to_blocked(ex) if order == "blocked" else _from_blocked(ex)
    return NVFP4ExpertWeights(ex)


def _path_name(path) -> str:
    return ".".join(str(p) for p in path)


def moe_modules(model) -> dict[str, MoE]:
    """Every :class:`MoE` block of an NNX model by dotted path (``"model.layers.0.mlp"``), in graph order."""
    if isinstance(model, MoE):
        return {"": model}
    return {_path_name(p): m for p, m in nnx.iter_graph(model) if isinstance(m, MoE)}


def _selected(names, ignore):
    """(names not ignored, {pattern: matched anything})."""
    hits = {p: False for p in ignore}
    keep = []
    for n in names:
        matched = [p for p in ignore if matches_ignore(n, p)] if n else []
        for p in matched:
            hits[p] = True
        if not matched:
            keep.append(n)
    return keep, hits


# One compiled quantization per expert shape when called eagerly; inlined under an outer jit.
_quantize_experts = jax.jit(quantize_experts, static_argnames=("recipe", "gated"))


def quantize_moe(model, *, ignore: str | Sequence[str] = (), recipe: str = "nvfp4", mode: str = "w4a16",
                 order: str = "auto", inplace: bool = False):
    """Replace the bf16 experts of every :class:`MoE` block of ``model`` by NVFP4 ones.

    Parameters
    ----------
    model : an NNX module (or an :class:`MoE` itself)
    ignore : str or sequence of str
        Blocks to keep in bf16, by dotted path, with the converter's rules
        (:func:`jax_nvfp4.checkpoint.matches_ignore`: exact or dotted-prefix match, with or without
        a leading ``model.``), e.g. ``["model.layers.0.mlp"]``. A pattern that matches no block warns.
    recipe : ``"nvfp4"`` (FlashInfer's quantizer, bit-exact) or ``"4over6"``
    mode : ``"w4a16"`` or ``"w4a4"``
        The mode the quantized blocks run in. Blocks that already hold NVFP4 experts keep their
        weights (in ``order``) and only switch mode, so one quantization serves both modes.
    order : ``"auto"``, ``"rows"`` or ``"blocked"``
        Byte order of the NVFP4 experts (:attr:`jax_nvfp4.NVFP4Array.order`; the same weights either
        way). ``"auto"`` (default): per block, the order its backend reads fastest
        (:func:`jax_nvfp4.weight_order`: blocked for the ffi backend on a CUDA GPU), and blocks
        already in NVFP4 keep theirs.
    inplace : bool
        False (default): return a copy (``nnx.clone``: the arrays of everything else are shared, not
        copied) and leave ``model`` (e.g. a bf16 policy) unchanged. True: modify ``model``.

    Returns
    -------
    The quantized model (``model`` itself when ``inplace``).

    Raises
    ------
    ValueError
        Where bf16 expert weights hold NaN or Inf, naming the blocks, tensors and experts (outside ``jax.jit``;
        checked once all blocks are quantized, so an ``inplace`` model holds them, with NaN global scales
        there). Under ``jax.jit`` those experts' global scales are NaN (:func:`jax_nvfp4.quantize_experts`).

    Notes
    -----
    Works eagerly (one compiled quantization per distinct expert shape) and under ``jax.jit`` /
    ``nnx.jit``: e.g. ``nnx.jit(lambda m: quantize_moe(m))(policy)``, or merge the model inside a
    jitted rollout and quantize there. Quantization is bit-exact with :func:`jax_nvfp4.quantize_experts`.
    """
    check_choice(recipe, RECIPES, "recipe")
    check_choice(mode, QUANTIZED_MODES, "mode")
    check_choice(order, WEIGHT_ORDERS, "order")
    ignore = ignore_patterns(ignore)
    target = model if inplace else nnx.clone(model)
    blocks = moe_modules(target)
    if not blocks:
        raise ValueError(f"model ({type(model).__name__}) has no jax_nvfp4.nn.MoE block to quantize")
    keep, hits = _selected(list(blocks), ignore)
    for p, hit in hits.items():
        if not hit:
            warnings.warn(f"ignore pattern {p!r} matches no MoE block (blocks: "
                          f"{', '.join(map(repr, list(blocks)[:4]))}{', ...' if len(blocks) > 4 else ''})",
                          stacklevel=2)
    orders = {name: _order_of(blocks[name], order) for name in keep}
    label = lambda name: name or "(the model itself)"  # noqa: E731
    scales = {}  # the new global scales, NaN where an expert's weights were not finite
    for name in keep:  # (block by block: inplace, each block's bf16 experts can be freed as it is replaced)
        block, ex = blocks[name], blocks[name].experts
        if not block.quantized:
            try:
                q = _quantize_experts(ex.gate_up[...], ex.down[...], recipe=recipe, gated=ex.gated, **ex.biases())
            except (TypeError, ValueError) as err:  # (shapes NVFP4 cannot take: name the block)
                if type(err) not in (TypeError, ValueError):
                    raise
                raise type(err)(f"MoE block {label(name)}: {err}") from err
            scales[name] = (q.gate_up.global_scale, q.down.global_scale)
            block.experts = _weights(q, orders[name])
        elif ex.order != orders[name]:
            block.experts = _weights(ex.experts(), orders[name])
        block.mode = mode
    if scales and not any(isinstance(v, jax.core.Tracer) for v in jax.tree.leaves(scales)):  # one host sync
        bad = [f"{label(name)}.{t}: experts {non_finite_experts(v)}" for name, pair in jax.device_get(scales).items()
               for t, v in zip(("gate_up", "down"), pair) if non_finite_experts(v)]
        if bad:
            raise ValueError(f"NaN or Inf in the bf16 expert weights of {len(bad)} tensor(s): {'; '.join(bad[:4])}"
                             f"{' ...' if len(bad) > 4 else ''} (NVFP4 weights must be finite)")
    return target


def set_moe_options(model, *, mode: str | None = None, backend=None, inplace: bool = False):
    """Set the ``mode`` and/or ``backend`` of the :class:`MoE` blocks (a copy unless ``inplace``).

    ``mode="w4a16"`` or ``"w4a4"`` applies to the blocks holding NVFP4 experts; bf16 blocks (e.g. kept
    by an ignore list) go on running in bf16. ``mode="bf16"`` needs every block to hold bf16 experts
    (ValueError naming the first that does not). ``backend`` applies to every block; the experts keep
    their byte order (every backend reads both; :func:`quantize_moe` with ``order=`` changes it).
    """
    if mode is not None:
        check_choice(mode, MODES, "mode")
    if backend is not None:
        check_backend(backend)
    target = model if inplace else nnx.clone(model)
    blocks = moe_modules(target)
    if not blocks:
        raise ValueError(f"model ({type(model).__name__}) has no jax_nvfp4.nn.MoE block")
    for name, block in blocks.items():
        if mode == "bf16" and block.quantized:
            raise ValueError(f"MoE block {name!r} holds NVFP4 experts and cannot run mode='bf16'")
        if mode is not None and block.quantized == (mode != "bf16"):
            block.mode = mode
        if backend is not None:
            block.backend = backend
    return target


def expert_parallel(model, mesh: jax.sharding.Mesh, axis: str = "ep", *, token_axis=None, inplace: bool = False):
    """Run every :class:`MoE` block of ``model`` with its experts split over ``axis`` of ``mesh`` (a copy
    unless ``inplace``).

    Each block's ``expert_axis`` and ``mesh`` are set (the experts run in ``jax.shard_map``, each device on
    its ``E / mesh.shape[axis]`` experts, the outputs summed over the axis) and its expert stacks, bf16 or
    NVFP4, are placed along the axis (``NamedSharding(mesh, P(axis))`` on their leading E axis): each device
    holds its own experts only. Everything else stays where it is, so it must be uncommitted (as arrays
    made by jax operations are) or on the mesh's devices (``x``, the router and the output are
    replicated over ``axis``; with ``token_axis``, mesh axes of data parallelism, the tokens are split along them:
    :class:`MoE`'s ``token_axis``). Call it after :func:`quantize_moe` / :func:`load_experts`, which make new
    expert arrays. On a mesh of ``Explicit`` axes (``jax.make_mesh``'s default in jax 0.12) run the model
    under ``jax.set_mesh(mesh)``: the blocks' outputs are typed on the mesh, and a jitted call's other arrays
    must be too (a KV cache made inside the call is; put inputs such as a ``prompt_mask`` there with
    ``jax.device_put(v, NamedSharding(mesh, P()))``, as ``examples/rl_rollout.py --expert-parallel`` does).
    :func:`~jax_nvfp4.nn.generate` and :func:`~jax_nvfp4.nn.sequence_logprobs` do both themselves where no mesh is
    set, except inside ``jax.jit``, where they ask for it.
    Tested on two CPU devices (``tests/test_nn.py``): blocks bitwise the sum of their shards, a Qwen3-MoE
    model's jitted generation. (Blocks whose experts, NVFP4 or bf16, are only placed along the axis split the
    same way under plain ``jit``, gradients too (reverse mode), by :mod:`jax_nvfp4.expert_sharding`'s
    partitioning rules.)
    """
    target = model if inplace else nnx.clone(model)
    blocks = moe_modules(target)
    if not blocks:
        raise ValueError(f"model ({type(model).__name__}) has no jax_nvfp4.nn.MoE block")
    for block in blocks.values():
        check_expert_axis(block.num_experts, axis, mesh, token_axis)
    placed = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(axis))
    for block in blocks.values():
        block.expert_axis, block.mesh, block.token_axis = axis, mesh, token_axis
        nnx.update(block.experts, jax.device_put(nnx.state(block.experts), placed))
    return target


def load_experts(model, source, *, mode: str = "w4a16", order: str = "auto", strict: bool = True):
    """Put NVFP4 experts from a converted (or ModelOpt) checkpoint into the :class:`MoE` blocks of ``model``, in place.

    Parameters
    ----------
    model : an NNX module whose MoE block paths match the checkpoint's MoE module names (e.g.
        ``model.layers.0.mlp``; a leading ``model.`` is optional on either side). The model may be
        abstract (``nnx.eval_shape``): the bf16 expert stacks are replaced, never materialised.
    source : path of an NVFP4 checkpoint written by :func:`jax_nvfp4.convert_checkpoint` or exported by NVIDIA
        ModelOpt (:func:`jax_nvfp4.load_nvfp4_experts`), or the dict
        returned by :func:`jax_nvfp4.load_nvfp4_experts` / :func:`jax_nvfp4.quantize_checkpoint_experts`
    mode : ``"w4a16"`` or ``"w4a4"`` for the loaded blocks
    order : ``"auto"``, ``"rows"`` or ``"blocked"``: byte order of the loaded experts, as in
        :func:`quantize_moe` (the checkpoint holds rows; ``"auto"`` repacks them once for the ffi
        backend on a CUDA GPU). Repacking a block needs its size again in device memory while it
        runs; from a path that is one block at a time, while the arrays of a ``source`` dict stay
        alive as long as the caller holds it.
    strict : bool
        Raise if a checkpoint module matches no block. Blocks absent from the checkpoint (kept in
        source precision by the converter's ignore list) are left as they are either way.

    Returns
    -------
    list of the block paths that were loaded.
    """
    check_choice(mode, QUANTIZED_MODES, "mode")
    check_choice(order, WEIGHT_ORDERS, "order")
    if isinstance(source, dict):
        return _load_experts(model, source, mode, order, strict, consume=False)
    from ..checkpoint import load_nvfp4_experts
    return _load_experts(model, load_nvfp4_experts(source), mode, order, strict, consume=True)


def _load_experts(model, source: dict, mode: str, order: str, strict: bool, consume: bool):
    """load_experts on a dict; ``consume``: drop each entry once placed (its rows arrays are freed
    while the next block is repacked)."""
    blocks = {strip_model(n): b for n, b in moe_modules(model).items()}
    loaded = []
    for module in list(source):
        ex = source.pop(module) if consume else source[module]
        block = blocks.get(strip_model(module))
        if block is None:
            if strict:
                raise ValueError(f"checkpoint MoE module {module!r} matches no MoE block of the model "
                                 f"(blocks: {', '.join(list(blocks)[:4])}...)")
            continue
        want = (block.num_experts, block.hidden_size, block.intermediate_size)
        got = (ex.num_experts, ex.hidden_size, ex.intermediate_size)
        if want != got or ex.gated != activations.is_gated(block.activation):
            raise ValueError(f"checkpoint MoE module {module!r}: experts (E, H, I) = {got}, gated={ex.gated} "
                             f"do not fit the block's {want} with activation {block.activation!r}")
        if ex.has_bias != block.experts.has_bias:
            raise ValueError(f"checkpoint MoE module {module!r}: experts {'with' if ex.has_bias else 'without'} "
                             f"biases, but the block has {'some' if block.experts.has_bias else 'none'} (expert_bias)")
        block.experts = _weights(ex, _order_of(block, order, keep=False))
        block.mode = mode
        loaded.append(module)
    return loaded
