"""The README's examples run as written, on two CPU devices (their expert-parallel parts split the experts over
them). "Use": its Python block, given small random inputs under the names it uses and, in its working folder, tiny
checkpoints under the names it loads (gpt-oss's MXFP4 release, a ModelOpt NVFP4 export of Qwen3-MoE). The Flax
block: on the tiny Qwen3-MoE model. An API change that breaks an example fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("flax")  # (the ModelOpt writer's module needs it)
import conftest  # noqa: E402
import gpt_oss_numpy_ref  # noqa: E402
import qwen3_moe_numpy_ref  # noqa: E402
from test_gpt_oss import HF_CONFIG as OSS_CONFIG  # noqa: E402
from test_prequantized import modelopt_weights, write_modelopt  # noqa: E402
from test_qwen3_moe import HF_CONFIG as QWEN_CONFIG  # noqa: E402

README = Path(__file__).resolve().parents[1] / "README.md"


def python_block(section: str) -> str:
    """The first ```python block of the README's ``## section`` (or ``### section``)."""
    text = re.split(rf"\n##+ {re.escape(section)}\n", README.read_text(), maxsplit=1)[1]
    return re.search(r"```python\n(.*?)```", text, re.S).group(1)


# The names the example takes as given, at the checkpoints' sizes (H 64, E 8; I 32; 2 stacked layers).
INPUTS = """
import numpy as np, jax.numpy as jnp
rng = np.random.default_rng(0)
L, E, H, I, T = 2, 8, 64, 32, 6
def w(*shape, scale=0.05):
    return jnp.asarray(rng.standard_normal(shape) * scale, jnp.bfloat16)
gate_up, down, x, logits = w(E, 2 * I, H), w(E, H, I), w(T, H, scale=1.0), w(T, E, scale=1.0)
b13, b2 = w(E, 2 * I), w(E, H)
gate_ups, downs, routers = w(L, E, 2 * I, H), w(L, E, H, I), w(L, H, E, scale=0.2)
s = 0.05
"""

CHECKS = """
import jax_nvfp4 as nv
assert jax.device_count() == 2 and len(experts.gate_up.data.sharding.device_set) == 2
assert y.shape == (T, H) and y.dtype == jnp.bfloat16 and h.shape == (T, H) and x_hat.shape == (T, H)
unsplit = nv.quantize_experts(gate_up, down)  # the experts the example splits, on one device
if nv.weight_order(hidden_size=H, intermediate_size=I) == "blocked":
    unsplit = nv.to_blocked_experts(unsplit)
whole = np.asarray(nv.moe(x, unsplit, router_logits=logits, top_k=8), np.float32)
np.testing.assert_allclose(np.asarray(y, np.float32), whole, rtol=2e-2, atol=2e-3)
print("ok")
"""


def test_readme_use_example_runs(tmp_path):
    conftest.write_hf(tmp_path / "gpt-oss-20b", gpt_oss_numpy_ref.random_weights(OSS_CONFIG, seed=1, mxfp4=True),
                      OSS_CONFIG)
    write_modelopt(tmp_path / "Qwen3-30B-A3B-NVFP4",
                   modelopt_weights(qwen3_moe_numpy_ref.random_weights(QWEN_CONFIG, seed=0))[0])
    example = python_block("Use")
    code = (f"import os\nos.chdir({str(tmp_path)!r})\n{INPUTS}\n"
            f"exec(compile({example!r}, 'README.md', 'exec'))\n{CHECKS}")
    conftest.run_on_cpu_devices(code, n=2)


NN_INPUTS = """
import types
import jax, numpy as np, jax.numpy as jnp
from flax import nnx
from jax_nvfp4 import nn as nvnn
self, rngs = types.SimpleNamespace(), nnx.Rngs(0)  # (the block's first line is a module's __init__'s)
hidden, inter, num_experts, top_k = 64, 32, 8, 2
model = nvnn.Qwen3MoeForCausalLM(nvnn.CONFIGS["tiny"], rngs=nnx.Rngs(1))
prompts, key = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 5)), jnp.int32), jax.random.key(0)
mesh = jax.make_mesh((jax.device_count(),), ("ep",))
"""

NN_CHECKS = """
assert jax.device_count() == 2 and self.mlp.num_experts == num_experts
assert out.tokens.shape == ep_out.tokens.shape == (2, 256) and logp.shape == (2, 256 + 4)
assert out.routing.shape[0] == 2 and bool(jnp.all(jnp.isfinite(logp)))
ex = ep_model.model.layers[1].mlp.experts.experts()
assert len(ex.gate_up.data.sharding.device_set) == 2 and ex.gate_up.data.addressable_shards[0].data.shape[0] == 4
print("ok")
"""


def test_readme_flax_example_runs():
    example = python_block("In a Flax NNX model, and RL rollouts (`jax_nvfp4.nn`, needs `flax`)")
    conftest.run_on_cpu_devices(f"{NN_INPUTS}\nexec(compile({example!r}, 'README.md', 'exec'))\n{NN_CHECKS}", n=2)
