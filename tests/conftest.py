"""Shared test fixtures: golden vectors beside the checkout, GPU gating."""

import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
# CI and developers have ../shared beside the checkout; GPU runs carry a copy inside it.
GOLDEN = pathlib.Path(os.environ.get("JAX_NVFP4_GOLDEN", REPO.parent / "shared" / "golden"))
if not GOLDEN.exists() and (REPO / "shared" / "golden").exists():
    GOLDEN = REPO / "shared" / "golden"


def has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


def ffi_call_now(target, result_shape_dtypes, **kwargs):
    """jax.ffi.ffi_call whose calls block on their results: a GPU handler's error comes with the results, not
    with the dispatch, so a pytest.raises around the call sees it on every platform."""
    call = jax.ffi.ffi_call(target, result_shape_dtypes, **kwargs)
    return lambda *args, **attrs: jax.block_until_ready(call(*args, **attrs))


# Defined for every run_on_cpu_devices script: what the sharding tests look for in compiled HLO text.
_SCRIPT_PRELUDE = r"""
import re as _re
def all_gathers(hlo):
    # Result shapes of the all-gathers in compiled HLO text, e.g. 'u8[8,64,32]'.
    return _re.findall(r"= (\w+\[[^]]*\])[^=]* all-gather(?:-start)?\(", hlo)
def expert_gathers(hlo):
    # The all-gathers of an expert stack (rank >= 3) or of NVFP4 bytes: none where experts stay split.
    return [g for g in all_gathers(hlo) if g.count(",") >= 2 or g.startswith(("u8[", "f8e4m3fn["))]
"""


def run_on_cpu_devices(code: str, n: int = 2) -> None:
    """Run ``code`` in a Python process whose JAX has ``n`` CPU devices (fixed when JAX starts, hence the
    process) and assert that it exits 0 with ``ok`` as its last line of output. The code may call
    ``all_gathers(hlo)`` and ``expert_gathers(hlo)`` (``_SCRIPT_PRELUDE``)."""
    flags = (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}").strip()
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags)
    r = subprocess.run([sys.executable, "-c", _SCRIPT_PRELUDE + code], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), (r.stdout[-1000:], r.stderr[-3000:])


@pytest.fixture
def on_cpu():
    """Run the test under ``jax.default_device(cpu)``: for tests of the C++ handlers' own behaviour (shapes the
    CUDA kernels reject, rows they leave unwritten), which a GPU machine would otherwise send to the GPU."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def pytest_collection_modifyitems(config, items):
    if has_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def golden(name: str):
    """Load ``../shared/golden/<name>``; skip the test if the golden folder is absent."""
    path = GOLDEN / name
    if not path.exists():
        pytest.skip(f"golden file {path} not found")
    return np.load(path)


def golden_names(prefix: str) -> list[str]:
    return sorted(p.name for p in GOLDEN.glob(f"{prefix}*.npz")) if GOLDEN.exists() else []


def golden_moe(name: str):
    """A golden MoE case in jax_nvfp4's conventions (see jax_nvfp4.arg_specs.load_golden_moe)."""
    from jax_nvfp4.arg_specs import load_golden_moe
    golden(name)  # skips when absent
    return load_golden_moe(GOLDEN, name)


def write_hf(root, weights: dict, config: dict):
    """A Hugging Face checkpoint folder: ``config.json`` and one ``model.safetensors`` of numpy ``weights``."""
    import json
    from safetensors.numpy import save_file
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    save_file(weights, str(root / "model.safetensors"), metadata={"format": "pt"})
    return root
