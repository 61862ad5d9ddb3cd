"""Smoke runs of the benchmark scripts on tiny shapes (CPU): a GPU session must not lose its
device time to a broken argument or result row. Not timings: only that every row is well formed."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import moe_bench  # noqa: E402
import profile_kernels  # noqa: E402
import batch_invariance  # noqa: E402


@pytest.mark.parametrize("clock", ["device", "host"])
def test_moe_bench_quick_rows(tmp_path, clock):
    out = tmp_path / "bench.json"
    moe_bench.main(["--quick", "--shapes", "tiny", "--tokens", "1,5", "--modes", "w4a16", "--backends", "ffi,xla",
                    "--chain", "2", "--clock", clock, "--ffi-flags", "1,6", "--sets", "1", "--json", str(out)])
    rows = json.loads(out.read_text())["results"]
    names = {(r["backend"], r["tokens"]) for r in rows}
    for b in ("ffi", "xla", "ffi[flags=1]", "ffi[flags=6]", moe_bench.BASELINE):
        assert {(b, 1), (b, 5)} <= names, b
    for r in rows:
        assert "error" not in r, r
        assert r["median_us"] > 0 and r["floor_us"] > 0
        assert r["timing"] == (f"chain2/{clock}" if r["backend"].startswith("ffi") else "median")


def test_moe_bench_rejects_bad_kernel_flags(capsys):
    with pytest.raises(SystemExit) as e:
        moe_bench.main(["--quick", "--ffi-flags", "128"])
    assert e.value.code == 2 and "--ffi-flags" in capsys.readouterr().err


def test_profile_kernels_runs(capsys):
    profile_kernels.main(["--shape", "tiny", "--tokens", "3", "--calls", "1"])
    assert "ran tiny T=3 w4a16 on ffi: 2 calls" in capsys.readouterr().out


def test_profile_kernels_runs_a_kernel_variant(capsys):
    profile_kernels.main(["--shape", "tiny", "--tokens", "3", "--mode", "w4a4", "--kernel-flags", "8", "--calls", "1"])
    assert "ran tiny T=3 w4a4 on ffi[flags=8]: 2 calls" in capsys.readouterr().out


def test_batch_invariance_rows(tmp_path):
    out = tmp_path / "bi.json"
    rows = batch_invariance.main(["--shape", "tiny", "--tokens", "2,9,600", "--probes", "2", "--variants", "2:1,0:4",
                                  "--json", str(out)])
    assert json.loads(out.read_text())["results"] == rows
    by = {(r["config"], r["tokens"]): r for r in rows}
    assert {c for c, _ in by} == {"xla", "ffi", "ffi[flags=2,k_split=1]", "ffi[flags=0,k_split=4]"}
    assert all(r["bitwise_equal"] for r in rows if "error" not in r)  # the CPU kernels are batch-invariant
    assert "k_split" in by[("ffi[flags=0,k_split=4]", 600)]["error"]  # 64-row tiles take no K split
