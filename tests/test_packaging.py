"""What `pip install` from a source distribution gets: the sdist holds every tracked file the build and the
package need (CMake, the FFI sources, the Python package) and none of the checkout's local, ignored trees."""

import pathlib
import shutil
import subprocess
import tarfile

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
NEEDED = ("pyproject.toml", "CMakeLists.txt", "README.md", "ffi/", "jax_nvfp4/")
LOCAL = ("build/", "shared/", ".prebuilt/", ".ab_old/", "out/")


def _tracked():
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs a git checkout")
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return {f for f in out.splitlines() if f.startswith(NEEDED)}


def test_sdist_holds_what_a_build_needs(tmp_path, monkeypatch):
    sk = pytest.importorskip("scikit_build_core.build")
    tracked = _tracked()
    monkeypatch.chdir(REPO)  # (scikit-build-core reads pyproject.toml from the working directory)
    name = sk.build_sdist(str(tmp_path))
    with tarfile.open(tmp_path / name) as t:
        files = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    assert {"pyproject.toml", "CMakeLists.txt", "ffi/module.cc", "jax_nvfp4/__init__.py"} <= tracked
    assert not tracked - files, f"tracked files missing from the sdist: {sorted(tracked - files)[:10]}"
    assert not [f for f in files if f.startswith(LOCAL)], "the sdist holds local trees"
    assert not [f for f in files if f.endswith(".so")], "the sdist holds a built extension"
