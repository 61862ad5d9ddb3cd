"""Shared MoE problem shapes and input builders, for benchmarks, tests and kernel checks.

The shapes are the ones the project is measured on (spec section 6): a DeepSeek-V3 expert-parallel
shard (256 experts routed top-8, 32 held locally) and Qwen3-30B-A3B (128 experts, top-8, all
local), plus tiny analogues for CPU smoke runs. Builders make random NVFP4 experts directly from
random codes and scales on the device (no bf16 stack, no quantizer), so that full-size problems
are quick to set up.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from .backends.base import MoEProblem
from .formats import BF16Experts, NVFP4Array, NVFP4Experts

H200_HBM_BYTES_PER_S = 4.3e12  # measured HBM copy rate (spec section 6)
H200_BF16_FLOP_PER_S = 790e12  # upper end of the measured bf16 dense matmul rate
NVFP4_BYTES_PER_WEIGHT = 0.5 + 1 / 16  # E2M1 nibble + one E4M3 byte per 16 weights
BF16_BYTES_PER_WEIGHT = 2.0


@dataclasses.dataclass(frozen=True)
class MoEShape:
    """One MoE layer as seen by one device.

    Attributes
    ----------
    name : str
    num_experts : int
        Global experts the router chooses among (``router_logits.shape[1]``).
    local_experts : int
        Experts held by this device (``experts.num_experts``); the rest live on other shards.
    hidden, intermediate : int
        H and I (GEMM1 ``[2I, H]`` gated, GEMM2 ``[H, I]``).
    top_k : int
    local_expert_offset : int
        Global id of local expert 0.
    gated : bool
    activation : str
    expert_bias : bool
        The experts carry biases (``gate_up_bias [E, 2I]``, ``down_bias [E, H]``; gpt-oss).
    input_scales : bool
        The experts carry static activation scales (``input_scales [E, 2]``, ModelOpt's), which mode w4a4 then uses.
    """

    name: str
    num_experts: int
    local_experts: int
    hidden: int
    intermediate: int
    top_k: int
    local_expert_offset: int = 0
    gated: bool = True
    activation: str = "swiglu"
    expert_bias: bool = False
    input_scales: bool = False

    def problem(self, tokens: int, mode: str) -> MoEProblem:
        """The backends' static description of this layer at ``tokens`` tokens."""
        return MoEProblem(tokens, self.hidden, self.intermediate, self.local_experts, self.top_k, mode,
                          self.activation, expert_bias=self.expert_bias,
                          static_input_scales=self.input_scales and mode == "w4a4")

    @property
    def gemm1_rows(self) -> int:
        return (2 if self.gated else 1) * self.intermediate

    @property
    def weights_per_expert(self) -> int:
        """Weights of one expert: GEMM1 plus GEMM2."""
        return (self.gemm1_rows + self.intermediate) * self.hidden

    def weight_bytes(self, experts_hit: float, mode: str) -> float:
        """Bytes of the weights (and block scales) of ``experts_hit`` experts."""
        per = BF16_BYTES_PER_WEIGHT if mode == "bf16" else NVFP4_BYTES_PER_WEIGHT
        return experts_hit * self.weights_per_expert * per

    def flops(self, rows: int) -> float:
        """Matmul FLOPs of ``rows`` token-expert pairs: ``2 * rows * H * (gemm1_rows + I)``."""
        return 2.0 * rows * self.weights_per_expert


DEEPSEEK_V3_EP8 = MoEShape("deepseek_v3_ep8", num_experts=256, local_experts=32, hidden=7168,
                           intermediate=2048, top_k=8)
QWEN3_30B_A3B = MoEShape("qwen3_30b_a3b", num_experts=128, local_experts=128, hidden=2048,
                         intermediate=768, top_k=8)
SHAPES = {s.name: s for s in (DEEPSEEK_V3_EP8, QWEN3_30B_A3B)}  # issue 5's table
# gpt-oss-120b: 128 experts top-4, H = I = 2880 (K tails of 64 in the kernels), its SwiGLU and expert biases
GPT_OSS_120B = MoEShape("gpt_oss_120b", num_experts=128, local_experts=128, hidden=2880, intermediate=2880,
                        top_k=4, activation="swiglu_oai", expert_bias=True)
GPT_OSS_20B = MoEShape("gpt_oss_20b", num_experts=32, local_experts=32, hidden=2880, intermediate=2880,
                       top_k=4, activation="swiglu_oai", expert_bias=True)
OTHER_SHAPES = {s.name: s for s in (GPT_OSS_120B, GPT_OSS_20B)}
TOKENS = (1, 4, 16, 64, 256, 1024, 4096)

# Tiny analogues (same structure, CPU-sized) for smoke runs and tests.
TINY_EP = MoEShape("tiny_ep", num_experts=64, local_experts=8, hidden=256, intermediate=128, top_k=4,
                   local_expert_offset=8)
TINY = MoEShape("tiny", num_experts=16, local_experts=16, hidden=128, intermediate=64, top_k=2)
QUICK_SHAPES = {s.name: s for s in (TINY_EP, TINY)}
ALL_SHAPES = {**SHAPES, **OTHER_SHAPES, **QUICK_SHAPES}  # every name the benchmark scripts take
QUICK_TOKENS = (1, 16)

_SCALE_CHOICES = np.array([0.25, 0.375, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0], np.float32)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _random_nvfp4(key, shape, k):
    """Random NVFP4Array of logical shape ``shape + (k,)`` with values of typical magnitude
    ``1/sqrt(k)`` (so activations neither vanish nor overflow through the layer)."""
    kd, kg = jax.random.split(key)
    data = jax.random.bits(kd, shape + (k // 2,), jnp.uint8)
    # Scale choice from the top bits of every 8th data byte (so tied to one code of the block,
    # which does not matter here): one random draw fewer keeps compiles quick on the CPU.
    idx = (data[..., ::8] >> 5).astype(jnp.int32)
    scales = jnp.asarray(_SCALE_CHOICES).astype(jnp.float8_e4m3fn)[idx]
    gs = jax.random.uniform(kg, shape[:1], jnp.float32, 0.5, 1.0) / (2.5 * np.sqrt(k))
    return NVFP4Array(data, scales, gs)


def random_nvfp4_experts(key, shape: MoEShape, num_experts: int | None = None) -> NVFP4Experts:
    """Random NVFP4 experts for ``shape`` (``num_experts`` defaults to ``shape.local_experts``), with bf16
    biases of scale 0.1 when ``shape.expert_bias`` and static activation scales when ``shape.input_scales`` (about a
    standard normal x's amax and a 16 times larger intermediate's, / 2688)."""
    e = shape.local_experts if num_experts is None else num_experts
    k1, k2, k3, k4 = jax.random.split(key, 4)
    biases = {}
    if shape.expert_bias:
        biases = dict(gate_up_bias=0.1 * jax.random.normal(k3, (e, shape.gemm1_rows), jnp.bfloat16),
                      down_bias=0.1 * jax.random.normal(k4, (e, shape.hidden), jnp.bfloat16))
    if shape.input_scales:
        biases["input_scales"] = jnp.broadcast_to(jnp.asarray([4.0, 64.0], jnp.float32) / 2688, (e, 2))
    return NVFP4Experts(_random_nvfp4(k1, (e, shape.gemm1_rows), shape.hidden),
                        _random_nvfp4(k2, (e, shape.hidden), shape.intermediate), shape.gated, **biases)


def to_bf16_experts(experts: NVFP4Experts) -> BF16Experts:
    """bf16 copy of NVFP4 experts (decoded with the global scale, rounded to bf16; biases as they are)."""
    return experts.dequantized(jnp.bfloat16)


@functools.partial(jax.jit, static_argnums=(1, 2))
def random_hidden(key, tokens: int, shape: MoEShape):
    """bf16 ``[tokens, H]`` standard normal hidden states."""
    return jax.random.normal(key, (tokens, shape.hidden), jnp.bfloat16)


@functools.partial(jax.jit, static_argnums=(1, 2), static_argnames=("local_only",))
def random_routing(key, tokens: int, shape: MoEShape, *, local_only: bool = True):
    """Random top-k routing: ``(topk_ids int32 [T, k], topk_weights float32 [T, k])``.

    ``local_only=True`` puts every token's ``k`` distinct experts on this shard (ids in
    ``[offset, offset + local_experts)``; e.g. 8 rows a token over DeepSeek-V3's 32 local
    experts); otherwise they are drawn from all ``num_experts`` global experts.
    """
    ki, kw = jax.random.split(key)
    pool = shape.local_experts if local_only else shape.num_experts
    if shape.top_k > pool:
        raise ValueError(f"top_k={shape.top_k} > {pool} experts to choose from")
    ids = jnp.argsort(jax.random.uniform(ki, (tokens, pool)), axis=-1)[:, :shape.top_k]
    if local_only:
        ids = ids + shape.local_expert_offset
    w = jax.nn.softmax(jax.random.normal(kw, (tokens, shape.top_k)), axis=-1)
    return ids.astype(jnp.int32), w.astype(jnp.float32)


def experts_hit(topk_ids, shape: MoEShape) -> int:
    """Distinct local experts that ``topk_ids`` routes to (host-side count)."""
    ids = np.asarray(topk_ids).reshape(-1) - shape.local_expert_offset
    return int(np.unique(ids[(ids >= 0) & (ids < shape.local_experts)]).size)


@dataclasses.dataclass(frozen=True)
class GoldenMoE:
    """One of FlashInfer's reference W4A16 MoE cases (``golden/moe_<routing>.npz``), converted to
    jax_nvfp4's conventions (GEMM1 rows ``[gate; up]``; global scales exactly 1).

    ``moe(x, experts, router_logits=logits, **route_kwargs)`` should give ``out`` (float32 of the
    golden bf16 output).
    """

    name: str
    x: jax.Array
    logits: jax.Array
    experts: NVFP4Experts
    route_kwargs: dict
    out: np.ndarray


def load_golden_moe(golden_dir, name: str) -> GoldenMoE:
    """Load ``golden_dir/name`` (e.g. ``moe_deepseek_v3.npz``) with its MANIFEST.json parameters."""
    import json
    import pathlib

    import ml_dtypes

    golden_dir = pathlib.Path(golden_dir)
    d = np.load(golden_dir / name)
    p = json.loads((golden_dir / "MANIFEST.json").read_text())[name]
    method = name[len("moe_"):-len(".npz")]
    bf = lambda k: jnp.asarray(d[k].view(ml_dtypes.bfloat16))  # noqa: E731
    from .layouts import gate_up_to_up_gate
    rows = np.argsort(gate_up_to_up_gate(2 * p["intermediate"]))  # golden [up; gate] -> [gate; up]
    ones = np.ones(p["experts"], np.float32)
    experts = NVFP4Experts.from_parts(d["w13_data"][:, rows], d["w13_scales"][:, rows], ones,
                                      d["w2_data"], d["w2_scales"], ones)
    kw = dict(routing=method, top_k=p["top_k"])
    if method == "deepseek_v3":
        kw.update(bias=bf("bias_bf16_bits"), n_group=p["n_group"], topk_group=p["topk_group"],
                  routed_scaling_factor=p["routed_scaling_factor"])
    return GoldenMoE(name, bf("x_bf16_bits"), bf("logits_bf16_bits"), experts, kw,
                     np.asarray(bf("out_bf16_bits"), np.float32))
