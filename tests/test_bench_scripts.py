"""Smoke runs of the benchmark scripts on tiny shapes (CPU): a GPU session must not lose its
device time to a broken argument or result row. Not timings: only that every row is well formed."""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import subprocess
import sys

import jax
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))

import _timing  # noqa: E402
import ab_summary  # noqa: E402
import moe_bench  # noqa: E402
import profile_kernels  # noqa: E402
import quantize as quantize_bench  # noqa: E402  (benchmarks/quantize.py)
import routing as routing_bench  # noqa: E402  (benchmarks/routing.py)
import batch_invariance  # noqa: E402
import ncu_summary  # noqa: E402
import sass_loops  # noqa: E402
import targets  # noqa: E402

from jax_nvfp4 import ops  # noqa: E402


@pytest.mark.parametrize("clock", ["device", "host"])
def test_moe_bench_quick_rows(tmp_path, clock):
    out = tmp_path / "bench.json"
    moe_bench.main(["--quick", "--shapes", "tiny", "--tokens", "1,5", "--modes", "w4a16", "--backends", "ffi,xla",
                    "--chain", "2", "--clock", clock, "--ffi-flags", "2,6", "--ffi-k-splits", "4,1/2",
                    "--ffi-tile-ms", "32,16:2", "--ffi-configs", "512:2", "--ffi-rows", "--sets", "1",
                    "--json", str(out)])
    rows = json.loads(out.read_text())["results"]
    names = {(r["backend"], r["tokens"]) for r in rows}
    for b in ("ffi", "xla", "ffi[flags=2]", "ffi[flags=6]", "ffi[ks=4]", "ffi[ks=1/2]", "ffi[tm=32]", "ffi[tm=16,flags=2]",
              "ffi[flags=512,ks=2]", "ffi[rows]", moe_bench.BASELINE):
        assert {(b, 1), (b, 5)} <= names, b
    rows = [r for r in rows if "skipped" not in r]
    for r in rows:
        assert "error" not in r, r
        assert r["median_us"] > 0 and r["floor_us"] > 0
        assert r["timing"] == (f"chain2/{clock}" if r["backend"].startswith("ffi") else "median")
    summary = "\n".join(ab_summary.summary_lines(rows))
    assert all(f"ffi[{v}]" in summary for v in ("flags=2", "flags=6", "ks=4", "tm=32", "tm=16,flags=2", "flags=512,ks=2")), summary


def test_moe_bench_expert_bias_rows(tmp_path):
    """--expert-bias: the shape's experts carry biases (rows named shape+bias) and every backend that takes them
    runs them; gpt-oss-120b is a known shape with its activation and biases."""
    out = tmp_path / "bench.json"
    moe_bench.main(["--quick", "--shapes", "tiny", "--tokens", "3", "--modes", "bf16,w4a16", "--backends", "ffi,xla",
                    "--expert-bias", "--sets", "1", "--json", str(out)])
    rows = json.loads(out.read_text())["results"]
    assert {r["shape"] for r in rows} == {"tiny+bias"}
    ran = {(r["backend"], r["mode"]) for r in rows if "median_us" in r}
    assert {("xla", "bf16"), ("xla", "w4a16"), ("ffi", "w4a16"), (moe_bench.BASELINE, "bf16")} <= ran, rows
    assert not [r for r in rows if "error" in r]
    tiny = moe_bench.specs.QUICK_SHAPES["tiny"]
    biased = moe_bench.specs.random_nvfp4_experts(jax.random.key(0), dataclasses.replace(tiny, expert_bias=True))
    assert biased.has_bias and moe_bench.specs.to_bf16_experts(biased).has_bias
    oss = moe_bench.specs.OTHER_SHAPES["gpt_oss_120b"]
    assert oss.expert_bias and oss.problem(1, "w4a16").activation == "swiglu_oai"


def test_moe_bench_static_scales_rows(tmp_path):
    """--static-scales: the shape's experts carry input_scales (rows named shape+static) and w4a4 quantizes on them."""
    out = tmp_path / "bench.json"
    moe_bench.main(["--quick", "--shapes", "tiny", "--tokens", "3", "--modes", "w4a4", "--backends", "ffi,xla",
                    "--static-scales", "--no-baseline", "--sets", "1", "--json", str(out)])
    rows = json.loads(out.read_text())["results"]
    assert {r["shape"] for r in rows} == {"tiny+static"} and not [r for r in rows if "error" in r]
    assert {r["backend"] for r in rows if "median_us" in r} == {"ffi", "xla"}
    tiny = dataclasses.replace(moe_bench.specs.QUICK_SHAPES["tiny"], input_scales=True)
    assert moe_bench.specs.random_nvfp4_experts(jax.random.key(0), tiny).input_scales.shape == (tiny.local_experts, 2)
    assert tiny.problem(3, "w4a4").static_input_scales and not tiny.problem(3, "w4a16").static_input_scales


def test_moe_bench_times_each_backend_in_its_weight_order(tmp_path, monkeypatch):
    """The ffi rows get the experts in jax_nvfp4.weight_order (blocked on a GPU: here forced, the
    CPU handler reads it too), ffi[rows] the rows order; both run."""
    seen = []

    def blocked_ffi(backend, **shape):
        seen.append(backend)
        return "blocked" if backend == "ffi" else "rows"

    monkeypatch.setattr(moe_bench.nv, "weight_order", blocked_ffi)
    monkeypatch.setattr(moe_bench.nv, "to_blocked_experts", lambda ex, f=moe_bench.nv.to_blocked_experts: seen.append(
        "to_blocked") or f(ex))
    out = tmp_path / "bench.json"
    moe_bench.main(["--quick", "--shapes", "tiny_ep", "--tokens", "3", "--modes", "w4a16,w4a4", "--backends", "ffi",
                    "--no-baseline", "--ffi-rows", "--ffi-flags", "128", "--sets", "1", "--json", str(out)])
    rows = json.loads(out.read_text())["results"]
    assert {(r["backend"], r["mode"], r["weight_order"]) for r in rows if r.get("median_us", 0) > 0} == {
        (b, m, "rows" if b == "ffi[rows]" else "blocked") for b in ("ffi", "ffi[rows]", "ffi[flags=128]")
        for m in ("w4a16", "w4a4")}
    assert seen.count("to_blocked") == 1 and "ffi" in seen  # repacked once, outside the timing


def test_moe_bench_saves_each_finished_token_count(tmp_path, monkeypatch):
    """A run stopped by a time limit leaves the rows it finished (complete=False); a finished run
    writes complete=True; no temp file is left."""
    out = tmp_path / "bench.json"
    real, seen = moe_bench.write_json, []

    def spy(path, data):
        real(path, data)
        seen.append((data["complete"], sorted({r["tokens"] for r in data["results"]})))

    monkeypatch.setattr(moe_bench, "write_json", spy)
    moe_bench.main(["--quick", "--shapes", "tiny", "--tokens", "1,3", "--modes", "w4a16", "--backends", "xla",
                    "--no-baseline", "--sets", "1", "--json", str(out)])
    assert seen == [(False, [1]), (False, [1, 3]), (True, [1, 3])]
    assert json.loads(out.read_text())["complete"] is True
    assert [p.name for p in tmp_path.iterdir()] == ["bench.json"]


def test_quantize_bench_shape_rows(tmp_path, capsys):
    out = tmp_path / "q.json"
    quantize_bench.main(["--shape", "2,32,64", "--repeats", "1", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["tensor"], r["recipe"], r["shape"]) for r in rows] == [("[2,32,64]", "nvfp4", [2, 32, 64]),
                                                                     ("[2,32,64]", "4over6", [2, 32, 64])]
    assert all(r["quantize_s"] > 0 and r["input_bytes"] == 2 * 32 * 64 * 2 for r in rows)
    with pytest.raises(SystemExit) as e:
        quantize_bench.main(["--shape", "2,32,60"])
    assert e.value.code == 2 and "--shape" in capsys.readouterr().err


def test_routing_bench_rows(tmp_path, capsys):
    rows = routing_bench.main(["--shapes", "3,8,2", "--repeats", "1", "--json", str(tmp_path / "r.json")])
    assert json.loads((tmp_path / "r.json").read_text())["rows"] == rows
    assert [(r["T"], r["E"], r["k"]) for r in rows] == [(3, 8, 2)]
    assert set(rows[0]["us"]) == set(routing_bench.FORMS) and min(rows[0]["us"].values()) > 0
    with pytest.raises(SystemExit) as e:
        routing_bench.main(["--shapes", "3,8,9"])
    assert e.value.code == 2 and "1 <= k <= E" in capsys.readouterr().err


def test_moe_bench_rejects_bad_kernel_flags(capsys):
    with pytest.raises(SystemExit) as e:
        moe_bench.main(["--quick", "--ffi-flags", str(2 * max(ops.KernelFlag))])
    assert e.value.code == 2 and "--ffi-flags" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        moe_bench.main(["--quick", "--ffi-k-splits", "3"])
    assert e.value.code == 2 and "--ffi-k-splits" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        moe_bench.main(["--quick", "--ffi-tile-ms", "24"])
    assert e.value.code == 2 and "--ffi-tile-ms" in capsys.readouterr().err
    for bad in ("1:2", "512:3", "512"):  # a removed flag, a bad K split, no pair
        with pytest.raises(SystemExit) as e:
            moe_bench.main(["--quick", "--ffi-configs", bad])
        assert e.value.code == 2 and "--ffi-configs" in capsys.readouterr().err, bad


def test_profile_kernels_runs(capsys):
    profile_kernels.main(["--shape", "tiny", "--tokens", "3", "--calls", "1"])
    assert "ran tiny T=3 w4a16 on ffi, rows weights: 2 calls" in capsys.readouterr().out


def test_profile_kernels_runs_a_kernel_variant(capsys):
    profile_kernels.main(["--shape", "tiny_ep", "--tokens", "3", "--mode", "w4a4", "--kernel-flags", "8", "--calls", "1",
                          "--order", "blocked"])
    assert "ran tiny_ep T=3 w4a4 on ffi[flags=8], blocked weights: 2 calls" in capsys.readouterr().out


def test_profile_kernels_timeline(capsys):
    profile_kernels.main(["--shape", "tiny", "--tokens", "3", "--calls", "1", "--timeline", "2"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if "ffi_call" in line]
    assert len(rows) == 3, out  # GEMM1 with the align (moe_align_gemm), GEMM2, finalize: the CPU trace's XLA ops
    assert "3 kernels: busy" in out


def test_batch_invariance_rows(tmp_path):
    out = tmp_path / "bi.json"
    rows = batch_invariance.main(["--shape", "tiny", "--tokens", "2,9,600", "--probes", "2", "--variants", "2:1,0:4",
                                  "--json", str(out)])
    assert json.loads(out.read_text())["results"] == rows
    by = {(r["config"], r["tokens"]): r for r in rows}
    assert {c for c, _ in by} == {"xla", "ffi", "moe(batch_invariant=True)", "ffi[flags=2,k_split=1]",
                                  "ffi[flags=0,k_split=4]"}
    assert all(r["bitwise_equal"] for r in rows if "error" not in r)  # the CPU kernels are batch-invariant
    assert "k_split" in by[("ffi[flags=0,k_split=4]", 600)]["error"]  # 64-row tiles take no K split


def test_ncu_summary_lines():
    # The shape of `ncu --csv --print-units base` output (details page): section rows and raw metrics.
    head = '"ID","Process ID","Kernel Name","Section Name","Metric Name","Metric Unit","Metric Value"'
    rows = [head, "==PROF== Disconnected",
            '"0","1","W4A16GroupedGemmKernel<1, 4, true>(GemmParams)","","gpu__time_duration.sum","ns","50,000"',
            '"0","1","W4A16GroupedGemmKernel<1, 4, true>(GemmParams)","","dram__bytes_read.sum","byte","100000000"',
            '"0","1","W4A16GroupedGemmKernel<1, 4, true>(GemmParams)","Occupancy","Achieved Occupancy","%","41.5"',
            '"0","1","W4A16GroupedGemmKernel<1, 4, true>(GemmParams)","Occupancy","Unlisted Metric","%","1"',
            '"1","1","MoeFinalizeKernel(int)","","gpu__time_duration.sum","ns","3000"']
    lines = [r + "\n" for r in rows]
    out = ncu_summary.summary_lines(lines, "dsv3:1")
    assert len(out) == 2
    assert "W4A16GroupedGemmKernel" in out[0] and "ns=50,000" in out[0] and "TB/s=2.00" in out[0]
    assert "occ%=41.5" in out[0] and "Unlisted" not in out[0]
    assert "MoeFinalizeKernel" in out[1] and "TB/s" not in out[1]
    assert ncu_summary.summary_lines(["==ERROR== no kernels\n"], "x") == ["x no ncu rows"]
    assert ncu_summary.short_name("void jax_nvfp4::(anonymous namespace)::W4A16GroupedGemmKernel<1, 4, 2, true, "
                                  "unsigned short>(jax_nvfp4::GemmParams)") == "W4A16GroupedGemmKernel<1,4,2,true,u16>"
    assert ncu_summary.short_name("MoeFinalizeKernel(const unsigned short *, int)") == "MoeFinalizeKernel"


def test_sass_loops_finds_the_loop_and_groups_its_opcodes():
    sass = """
\t\tFunction : _Z6KernelILi1EEv
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LOP3.LUT R2, R3, 0xf000f, RZ, 0xc0, !PT ;
        /*0020*/                   IMAD R4, R2, 0x1040, RZ ;
        /*0030*/                   HMMA.16816.F32.BF16 R8, R12, R16, R8 ;
        /*0040*/              @!P0 BRA 0x10 ;
        /*0050*/                   EXIT ;
        /*0060*/                   BRA 0x60;
\t\tFunction : _Z5OtherILi2EEv
        /*0000*/                   EXIT ;
"""
    fns = sass_loops.functions(sass)
    assert list(fns) == ["_Z6KernelILi1EEv", "_Z5OtherILi2EEv"]
    (start, end, counts), = sass_loops.loops(fns["_Z6KernelILi1EEv"])  # the exit trap is no loop
    assert (start, end) == (0x10, 0x40)
    assert counts == {"LOP3": 1, "IMAD": 1, "HMMA": 1, "BRA": 1}
    assert sass_loops.describe(counts).startswith("alu=1 fma=1 tensor=1 other=1")
    assert sass_loops.loops(fns["_Z5OtherILi2EEv"]) == []


def test_sass_setmaxnreg_check_finds_registers_past_the_allocation():
    sass = """
\t\tFunction : _Z2WsILi4EEv
        /*0000*/                   USETMAXREG.DEALLOC.CTAPOOL 0x20 ;
        /*0010*/                   USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0x70 ;
        /*0020*/                   IMAD R107, R2, UR12, RZ ;
\t\tFunction : _Z2WsILi5EEv
        /*0000*/                   USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0x70 ;
        /*0010*/                   MOV R115, R1 ;
\t\tFunction : _Z5PlainILi2EEv
        /*0000*/                   MOV R200, R1 ;
"""
    fns = sass_loops.functions(sass)
    assert sass_loops.setmaxnreg_use(fns["_Z2WsILi4EEv"]) == (107, 112)  # (UR12 is a uniform register)
    assert sass_loops.setmaxnreg_use(fns["_Z2WsILi5EEv"]) == (115, 112)  # over: the hang of 2026-12-03
    assert sass_loops.setmaxnreg_use(fns["_Z5PlainILi2EEv"]) is None


def test_clocked_chain_reads_the_clock_before_any_layer_work():
    """Work of the layers that does not depend on x (here a sort of the routing; in the MoE every
    layer's align) must not be scheduled before the first device_clock reading."""
    jnp = _timing.jax.numpy

    def layer(x, ids):
        return x + jnp.sort(jnp.tile(ids, (64, 64)))[0, 0]

    x, ids = jnp.ones((4, 4)), jnp.arange(64.0)
    timed = _timing.clocked_chain(layer, 3, 1)
    entry = timed.lower(x, [(ids,)]).compile().as_text().split("ENTRY")[1].splitlines()
    first_clock = next(i for i, line in enumerate(entry) if "jax_nvfp4_device_clock" in line)
    routing_work = [i for i, line in enumerate(entry) if " sort(" in line or "fusion(" in line]
    assert routing_work and min(routing_work) > first_clock, entry


def test_clocked_chain_runs_expert_only_work_in_every_layer():
    """Work that reads only the experts (in gpt-oss's layers once a bias conversion) runs once per chained layer,
    as in a model whose layers have their own experts, not once for the chain."""
    jnp = _timing.jax.numpy

    def layer(x, ids, bias):
        return x + ids[:4] + jnp.sort(bias.astype(jnp.float32))[:4]

    x, ids, bias = jnp.ones((4,)), jnp.arange(4.0), jnp.arange(64.0, 0, -1, dtype=jnp.bfloat16)
    timed = _timing.clocked_chain(layer, 3, 3)
    entry = timed.lower(x, [(ids,), (ids + 1,), (ids + 2,)], bias).compile().as_text().split("ENTRY")[1]
    # (a sort instruction on XLA:CPU, a fusion around one on XLA:GPU)
    sorts = re.findall(r" (?:sort|fusion)\([^\n]*op_name=\"[^\"]*/sort\"", entry)
    assert len(sorts) == 3, entry


def test_chained_time_wants_a_routing_per_layer():
    """Layers sharing a routing would share their align (XLA merges equal custom calls), which
    the chain would then time once for several layers."""
    x, ids = _timing.jax.numpy.ones((4, 4)), _timing.jax.numpy.arange(4.0)
    with pytest.raises(ValueError, match="routing per layer"):
        _timing.chained_time(lambda x, ids: x + ids, x, [(ids,)] * 2, (), n=3)


@pytest.mark.parametrize("script", sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "scripts", "*.sh"))),
                         ids=os.path.basename)
def test_gpu_scripts_parse(script):
    """A syntax error in a device script would cost a GPU session's time: bash -n here first."""
    r = subprocess.run(["bash", "-n", script], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_ffi_stamp_follows_the_extension_sources(tmp_path):
    """gpu_ffi.sh takes a prebuilt extension (scripts/prebuild_ffi.sh) only for a tree with its stamp: the
    stamp must change with any C++/CUDA source or CMakeLists.txt, and with nothing else."""
    root = os.path.join(os.path.dirname(__file__), "..")
    stamp_sh = os.path.join(root, "scripts", "ffi_stamp.sh")

    def stamp(tree, **env):
        r = subprocess.run(["bash", stamp_sh, str(tree)], capture_output=True, text=True, check=True,
                           env=dict(os.environ, **env))
        return r.stdout.strip()
    (tmp_path / "ffi" / "cuda").mkdir(parents=True)
    for name in ("ffi/cuda/k.cu", "ffi/cuda/k.cuh", "ffi/h.h", "ffi/m.cc", "CMakeLists.txt"):
        (tmp_path / name).write_text(name)
    first = stamp(tmp_path)
    assert first.startswith("sources=") and first.endswith(" archs=90a")
    (tmp_path / "README.md").write_text("not a source")
    (tmp_path / "ffi" / "notes.txt").write_text("not a source")
    assert stamp(tmp_path) == first
    assert stamp(tmp_path, GPU_ARCHS="90a;100a") != first
    for name in ("ffi/cuda/k.cu", "ffi/cuda/k.cuh", "ffi/h.h", "ffi/m.cc", "CMakeLists.txt"):
        old = (tmp_path / name).read_text()
        (tmp_path / name).write_text(old + " ")
        assert stamp(tmp_path) != first, name
        (tmp_path / name).write_text(old)
    assert stamp(tmp_path) == first
    assert stamp(root).startswith("sources=")  # the repository's own tree


def test_ab_summary_verdicts():
    def row(backend, t, us, mode="w4a16"):
        return dict(backend=backend, shape="s", tokens=t, mode=mode, median_us=us)
    rows = [row("ffi", 1, 100.0), row("ffi", 4, 200.0), row("ffi", 4, 300.0, "w4a4"),
            row("ffi[flags=64]", 1, 90.0), row("ffi[flags=64]", 4, 180.0),  # faster everywhere
            row("ffi[ks=2]", 1, 99.0), row("ffi[ks=2]", 4, 250.0),  # one tie, one loss
            row("ffi[flags=8]", 4, 295.0, "w4a4"), row("ffi[flags=8]", 64, 1.0, "w4a4"),  # no default at T=64
            dict(backend="ffi[flags=1]", shape="s", tokens=1, mode="w4a16", error="boom")]
    lines = ab_summary.summary_lines(rows)
    head = {ln.split()[0]: ln for ln in lines if not ln.startswith(" ")}
    assert set(head) == {"ffi[flags=64]", "ffi[ks=2]", "ffi[flags=8]"}
    assert "WINS EVERYWHERE" in head["ffi[flags=64]"] and "geomean x0.900" in head["ffi[flags=64]"]
    assert "slower  1" in head["ffi[ks=2]"] and "loses" in head["ffi[ks=2]"]
    assert "rows  1" in head["ffi[flags=8]"] and "no loss" in head["ffi[flags=8]"]
    assert ab_summary.summary_lines([row("ffi", 1, 1.0)]) == ["no variant rows with a default row to compare"]
    best = ab_summary.best_lines(rows)
    assert best[0].startswith("best per row")
    assert "T=    1 w4a16  best ffi[flags=64]" in best[1] and "x0.900" in best[1]  # 90 < 99 < 100
    assert "T=    4 w4a16  best ffi[flags=64]" in best[2]
    assert "T=    4 w4a4   best default" in best[3] and "x1.000" in best[3]  # 295 is within 3% of 300
    assert len(best) == 4  # T=64 w4a4 has no default row
    assert ab_summary.best_lines([row("ffi[ks=2]", 1, 1.0)]) == []


def test_targets_judge_each_row_by_the_issue_thresholds():
    def rows(shape, t, w4a16, w4a4=None, ragged=None, floor=100.0, bf16_floor=356.0, flops_us=10.0):
        common = dict(shape=shape, tokens=t, experts_hit=8.0, floor_nvfp4_bytes_us=floor,
                      floor_bf16_bytes_us=bf16_floor, floor_flops_us=flops_us)
        out = [dict(common, backend="ffi", mode="w4a16", median_us=w4a16)]
        out += [dict(common, backend="ffi", mode="w4a4", median_us=w4a4)] if w4a4 else []
        out += [dict(common, backend=targets.BASELINE, mode="bf16", median_us=ragged)] if ragged else []
        return out
    run = dict(hbm_bytes_per_s=4.3e12, bf16_flop_per_s=790e12, results=[
        *rows("a", 1, 160.0, w4a4=200.0, ragged=1700.0),            # target 160: met; w4a4 1.25x; 10.6x
        *rows("a", 4, 160.5, ragged=1000.0),                        # just over; 10x is 100 us = the floor
        *rows("a", 64, 150.0, w4a4=196.0, ragged=1200.0),           # met; w4a4 1.31x; 10x needs 3.58 TB/s
        *rows("b", 1, 60.0, ragged=900.0, floor=40.0, bf16_floor=59.0),  # under 70 but not the bf16 floor
        *rows("b", 4096, 2000.0, ragged=30000.0, flops_us=1000.0),  # 395 TFLOP/s
        *rows("b", 256, 500.0, flops_us=200.0),                     # no target, TFLOP/s shown
        dict(shape="b", tokens=16, experts_hit=8.0, floor_nvfp4_bytes_us=100.0, floor_bf16_bytes_us=356.0,
             floor_flops_us=1.0, backend="ffi", mode="w4a16", error="boom")])  # a failed row is not met
    lines, unmet = targets.evaluate(run)
    table = {tuple(c.strip() for c in ln.split("|")[1:3]): [c.strip() for c in ln.split("|")[1:-1]]
             for ln in lines[2:]}
    assert set(table) == {("a", "1"), ("a", "4"), ("a", "64"), ("b", "1"), ("b", "16"), ("b", "256"), ("b", "4096")}
    assert table[("b", "16")][4:7] == ["", "", ""]
    assert table[("a", "1")][5:9] == ["160.0", "yes", "200.0", "1.25"]
    assert table[("a", "4")][6] == "no" and table[("a", "64")][6] == "yes"
    assert table[("a", "64")][11] == "3.58" and table[("a", "1")][11] == ""
    assert table[("b", "1")][6] == "no"
    assert table[("b", "4096")][5:7] == ["400 TFLOP/s", "no"] and table[("b", "4096")][12] == "395"
    assert table[("b", "256")][5:7] == ["", ""] and table[("b", "256")][12] == "316"
    assert unmet == ["a T=4: 160.5 us over the decode target 160.0",
                     "a T=4: 6.2x ragged_dot; 10x is 100.0 us (the weights read at 4.30 TB/s)",
                     "a T=64: 8.0x ragged_dot; 10x is 120.0 us (the weights read at 3.58 TB/s)",
                     "a T=64: w4a4 1.31x of w4a16",
                     "b T=1: 60.0 us, not under the bf16 byte floor 59.0",
                     "b T=16: w4a16 boom",
                     "b T=4096: 395 TFLOP/s under 400"]
    run["results"] += rows("c", 16, 300.0, ragged=900.0)  # 10x is 90 us, under the 100-us floor
    assert targets.evaluate(run)[1][-1] == "c T=16: 3.0x ragged_dot; 10x is 90.0 us (under the NVFP4 byte floor)"


def test_stream_probe_compiles(tmp_path):
    """benchmarks/stream_probe.cu (the decode access-pattern probe of gpu_ffi.sh's probe stage)
    builds for sm_90a, so a GPU session does not lose device time to a compile error."""
    import shutil
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)
    if nvcc is None:
        pytest.skip("needs nvcc")
    src = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "stream_probe.cu")
    out = tmp_path / "stream_probe"
    r = subprocess.run([nvcc, "-O3", "-std=c++17", "-arch=sm_90a", "-o", str(out), src], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert out.stat().st_size > 0
