"""The notebooks under notebooks/ run top to bottom on the CPU (executed with nbclient) and are stored
without outputs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))


def test_notebooks_are_present_and_stored_without_outputs():
    nbformat = pytest.importorskip("nbformat")
    assert {p.name for p in NOTEBOOKS} >= {"quickstart.ipynb", "rl_rollout.ipynb", "benchmarks.ipynb"}
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        for i, cell in enumerate(nb.cells):
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, (
                    f"{path.name} cell {i} has stored outputs: clear them (e.g. jupyter nbconvert "
                    "--clear-output --inplace)")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("matplotlib")
    pytest.importorskip("ipykernel")
    nb = nbformat.read(path, as_version=4)
    # The kernel runs in notebooks/ on the CPU, with a non-interactive matplotlib backend.
    env = dict(os.environ, JAX_PLATFORMS="cpu", MPLBACKEND="Agg")
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    old = dict(os.environ)
    os.environ.update(env)  # the kernel inherits this process's environment
    try:
        client.execute()
    finally:
        os.environ.clear()
        os.environ.update(old)
