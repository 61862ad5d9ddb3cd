"""Names: routed-expert tensors of a source checkpoint, ignore patterns, and the NVFP4 output's names.

Recognized source expert names (``L`` layer, ``N`` expert)::

    Mixtral:              model.layers.L.block_sparse_moe.experts.N.{w1,w3,w2}.weight  (gate, up, down)
    Qwen3-MoE, DeepSeek:  model.layers.L.mlp.experts.N.{gate,up,down}_proj.weight

with ``weight_scale_inv`` / ``weight_scale`` / ``input_scale`` in place of ``weight`` for FP8 scales, and
``weight_scale`` / ``weight_scale_2`` / ``input_scale`` for NVFP4 (ModelOpt) block, global and activation scales, and
``weight_packed`` / ``weight_scale`` / ``weight_global_scale`` / ``input_global_scale`` for NVFP4 (compressed-tensors);
experts stacked in one tensor per projection (gpt-oss, Llama 4) are named in :mod:`.stacked`.
The *MoE module* is the part before ``.experts`` (``model.layers.L.mlp``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import NamedTuple

FORMAT_NAME = "jax_nvfp4"
# The newest format version: 2, optional expert biases (``*.bias``); 3, GEMM1's global scale [2] (gate, up) in modules
# whose pre-quantized source quantized gate and up apart (moe_modules' ``up_global_scale``); 4, the static activation
# scales of pre-quantized sources (``*.input_scale``, moe_modules' ``input_scales``). Each is written only where needed
# (a reader refuses newer versions than its own rather than drop what they add); older versions still load.
FORMAT_VERSION = 4
READABLE_VERSIONS = (1, 2, 3, 4)
CONFIG_NAME = "nvfp4_config.json"
GATE_UP, UP, DOWN = "gate_up_proj", "up_proj", "down_proj"  # output projection names
DATA, BLOCK_SCALE, GLOBAL_SCALE = "weight", "weight_scale", "weight_global_scale"  # output params
BIAS = "bias"  # an expert's bias [N] (gate entries first), unquantized
INPUT_SCALE = "input_scale"  # a pre-quantized expert's static activation decode scale ([2] for gate and up)
GEMMS = ("gate_up", "down")  # keys of output_names, in GEMM order

_EXPERT_RE = re.compile(
    r"^(?P<module>.+)\.experts\.(?P<expert>\d+)\."
    r"(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)\."
    r"(?P<param>weight|weight_packed|weight_scale_inv|weight_scale_2|weight_scale|weight_global_scale|input_scale"
    r"|input_global_scale)$")
_ROLE = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


class ExpertName(NamedTuple):
    """A parsed source expert tensor name."""

    module: str  # the MoE module, e.g. "model.layers.0.mlp"
    expert: int
    role: str  # "gate", "up" or "down", whatever the naming convention
    param: str  # "weight", "weight_scale_inv", "weight_scale", "input_scale", or an NVFP4 one (the regex)


def parse_expert_name(name: str) -> ExpertName | None:
    """The parts of a routed-expert tensor name, or None for any other tensor."""
    m = _EXPERT_RE.match(name)
    if not m:
        return None
    return ExpertName(m["module"], int(m["expert"]), _ROLE[m["proj"]], m["param"])


def strip_model(name: str) -> str:
    """``name`` without a leading ``model.``."""
    return name[len("model."):] if name.startswith("model.") else name


def ignore_patterns(ignore: str | Sequence[str]) -> list[str]:
    """The ignore patterns as a list (a single string is one pattern, not a sequence of letters)."""
    return [ignore] if isinstance(ignore, str) else list(ignore)


def matches_ignore(name: str, pattern: str) -> bool:
    """Whether ignore ``pattern`` selects tensor or module ``name``.

    A pattern matches the name exactly or as a dotted prefix (``layers.3.mlp`` matches
    ``layers.3.mlp.experts.0.gate_proj.weight`` but not ``layers.3.mlp2...``), with or without a
    leading ``model.`` on either side.
    """
    n, p = strip_model(name), strip_model(pattern.strip().strip("."))
    return bool(p) and (n == p or n.startswith(p + "."))


def output_names(module: str, e: int, gated: bool, bias: bool = False,
                 input_scale: bool = False) -> dict[str, dict[str, str]]:
    """Output tensor names of expert ``e``: ``{"gate_up"|"down": {"data"|"scales"|"global_scale"[|"bias"]
    [|"input_scale"]: name}}``."""
    p = f"{module}.experts.{e}"
    params = ({"data": DATA, "scales": BLOCK_SCALE, "global_scale": GLOBAL_SCALE} | ({"bias": BIAS} if bias else {})
              | ({"input_scale": INPUT_SCALE} if input_scale else {}))
    return {gemm: {part: f"{p}.{proj}.{param}" for part, param in params.items()}
            for gemm, proj in zip(GEMMS, (GATE_UP if gated else UP, DOWN))}
