"""bench/run.py: the arithmetic behind its figures (interpolation, the training clock, the
crossover length), the GPU step timer run on the CPU, and the command itself in --quick mode."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from bench import run as bench

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}

finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False)


@st.composite
def curves(draw):
    """Strictly increasing xs with ys of the same length."""
    gaps = draw(st.lists(st.floats(min_value=1e-3, max_value=1e3), min_size=1, max_size=12))
    x0 = draw(st.floats(min_value=0, max_value=1e3))
    xs = [x0]
    for g in gaps:
        xs.append(xs[-1] + g)
    ys = draw(st.lists(finite, min_size=len(xs), max_size=len(xs)))
    return xs, ys


@given(curves(), st.data())
def test_value_at_reads_between_neighbours(curve, data):
    xs, ys = curve
    for x, y in zip(xs, ys):  # exact at the measured points
        v, ended = bench.value_at(xs, ys, x)
        assert v == pytest.approx(y, rel=1e-9, abs=1e-6) and not ended
    i = data.draw(st.integers(min_value=1, max_value=len(xs) - 1))
    x = data.draw(st.floats(min_value=xs[i - 1], max_value=xs[i]))
    v, ended = bench.value_at(xs, ys, x)
    lo, hi = sorted((ys[i - 1], ys[i]))
    assert lo - 1e-6 <= v <= hi + 1e-6 and not ended


@given(curves(), st.floats(min_value=1e-3, max_value=1e3))
def test_value_at_outside_the_curve(curve, d):
    xs, ys = curve
    assert bench.value_at(xs, ys, xs[0] - d) == (None, False)      # nothing measured yet
    assert bench.value_at(xs, ys, xs[-1] + d) == (ys[-1], True)     # the run had ended


@settings(max_examples=50)
@given(st.lists(st.tuples(st.integers(min_value=1, max_value=50), st.floats(min_value=1e-3, max_value=10)),
                min_size=1, max_size=30))
def test_training_clock_sums_the_loops_step_times(intervals):
    """train_s at a line = the sum of step_time x steps of every interval up to it."""
    recs, step = [], 0
    for steps, t in intervals:
        step += steps
        recs.append({"step": step, "step_time": t, "loss": 1.0})
    clock = bench.training_clock(recs)
    assert [c["step"] for c in clock] == [r["step"] for r in recs]
    expected = 0.0
    for c, (steps, t) in zip(clock, intervals):
        expected += steps * t
        assert c["train_s"] == pytest.approx(expected)
    assert all(b["train_s"] > a["train_s"] for a, b in zip(clock, clock[1:]))


def test_training_clock_refuses_lines_without_step_time():
    with pytest.raises(bench.BenchError, match="no step_time"):
        bench.training_clock([{"step": 5, "step_time": 1.0}, {"step": 10, "loss": 1.0}])
    with pytest.raises(bench.BenchError, match="empty"):
        bench.training_clock([])


@pytest.mark.parametrize("ratios, length", [
    ([1.5, 1.4, 0.9, 0.6], 2048),
    ([1.2, 0.9, 1.1, 0.8], 4096),       # cheaper at 1024 but not at 2048: not "from 1024 on"
    ([1.1, 1.2, 1.05, 1.01], None),
    ([0.9, 0.8, 0.7, 0.6], 512),
])
def test_crossover(ratios, length):
    lengths = [512, 1024, 2048, 4096]
    c = bench.crossover(lengths, ratios)
    assert c["length"] == length
    if length is None or length == lengths[0]:
        assert c["estimate"] is None
    else:
        i = lengths.index(length)
        assert lengths[i - 1] <= c["estimate"] <= length


def test_crossover_estimate_is_exact_for_a_log_linear_ratio():
    lengths = [512, 1024, 2048, 4096]
    ratios = [1 + 0.25 * (math.log2(1500) - math.log2(t)) for t in lengths]
    assert bench.crossover(lengths, ratios)["estimate"] == pytest.approx(1500)


def _run(seed, evals, final=None):
    """A learning run with fixed timings: ``evals`` = [(train_s, val_loss), ...]."""
    return {"seed": seed, "train_s": evals[-1][0], "final_val_loss": final or evals[-1][1],
            "eval": [{"train_s": t, "val_loss": v} for t, v in evals]}


def test_compare_runs_with_fixed_timings():
    """The equal-tokens and equal-wall-clock arithmetic, on fixed timings (never measured ones)."""
    runs = {
        "baseline": [_run(1, [(10, 5.0), (20, 4.0)]), _run(2, [(12, 5.2), (24, 4.2)])],
        # slower: read at T = 22 (the baseline's median time) between its evaluations
        "slow": [_run(1, [(20, 4.8), (40, 3.8)]), _run(2, [(30, 4.6), (60, 3.6)])],
        # first evaluation after T: nothing to read at T for that seed
        "late": [_run(1, [(15, 4.5), (30, 3.5)]), _run(2, [(25, 4.4), (50, 3.4)])],
    }
    T, fastest, summary = bench.compare_runs(runs, "baseline")
    assert (T, fastest) == (22.0, "baseline")
    base = summary["baseline"]
    assert base["delta_final"]["mean"] == 0
    # the baseline has a value at T only if an evaluation of its came before T: machine load decides
    assert base["delta_at_T"] is None if base["val_loss_at_T"] is None else base["delta_at_T"]["mean"] == 0
    assert [r["val_loss_at_T"] for r in runs["baseline"]] == [4.0, pytest.approx(4.2 + 1.0 * 2 / 12)]
    assert [r["ended_before_T"] for r in runs["baseline"]] == [True, False]
    assert [r["val_loss_at_T"] for r in runs["slow"]] == [pytest.approx(4.8 - 0.1), None]
    assert summary["slow"]["delta_at_T"]["n"] == 1
    assert summary["slow"]["delta_at_T"]["mean"] == pytest.approx(4.7 - 4.0)
    assert summary["slow"]["delta_final"]["mean"] == pytest.approx(((3.8 - 4.0) + (3.6 - 4.2)) / 2)
    assert [r["val_loss_at_T"] for r in runs["late"]] == [pytest.approx(4.5 - 1.0 * 7 / 15), None]
    assert summary["late"]["train_s"] == 40 and summary["slow"]["train_s"] == 50
    # no run of a variant has a value at T: no mean and no paired difference, not a crash
    runs["late"][0]["eval"][0]["train_s"] = 23
    _, _, summary = bench.compare_runs(runs, "baseline")
    assert summary["late"]["val_loss_at_T"] is None and summary["late"]["delta_at_T"] is None


def test_time_train_steps_on_cpu(monkeypatch):
    """The GPU speed path's timer, on the CPU without compile: every model times, MFU needs a peak;
    its backend is train.py's, training.cpu_malloc included (not applied to this process's heap here)."""
    from model import ModelConfig, NashMHC
    from training import backend as B

    monkeypatch.setattr(B, "keep_freed_memory", lambda: True)

    cfgs = {v: ModelConfig(vocab_size=256, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, max_seq_len=64,
                           **bench.MODEL_VARIANTS[v]) for v in ("baseline", "nash-mhc")}
    res = bench.time_train_steps(cfgs, batch=2, seq=64, device="cpu", precision="fp32", compile=False,
                                 warmup=1, repeats=2)
    assert res["device"] == "cpu (glibc malloc keeps freed memory)" and res["compile"] is False
    assert res["peak_flops"] is None
    for v, cfg in cfgs.items():
        r = res["models"][v]
        assert r["step_s"] > 0 and r["tokens_per_sec"] == pytest.approx(2 * 64 / r["step_s"])
        assert r["flops_per_token"] == NashMHC(cfg).flops_per_token(64) and r["mfu"] is None


def run_bench(*args, timeout=600):
    return subprocess.run([sys.executable, str(ROOT / "bench" / "run.py"), *map(str, args)], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("args, message", [
    (["--only", "learning,bogus"], "unknown section bogus"),
    (["--only", "data", "--data", "/nonexistent"], "meta.json not found"),
    (["--threads", "0"], "must be at least 1"),
])
def test_bad_arguments_are_one_line_errors(tmp_path, args, message):
    r = run_bench(*args, "--out", tmp_path)
    assert r.returncode == 2 and message in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert not (tmp_path / "latest.json").exists()


@pytest.mark.slow
def test_quick_attention_keeps_other_sections(tmp_path):
    """--only re-measures one section and keeps the others from latest.json; the report renders
    them, and says which kept one an older bench/run.py wrote with other fields."""
    data_section = {"loader_tokens_per_sec": 2e6, "loader_all": [2e6], "first_batch_s": 0.05,
                    "model_tokens_per_sec": 4e3, "ratio": 500.0, "target": 10.0, "batch": 16, "seq_len": 256,
                    "num_workers": 1, "batches": 40, "repeats": 1,
                    "model_run": {"steps": 10, "precision": "fp32", "dir": "runs/data-consumption"},
                    "_meta": {"date": "earlier", "wall_s": 1.0, "load_start": 1.0, "load_end": 1.0, "quick": True}}
    old_xla = {"graphs": 2, "_meta": data_section["_meta"]}
    (tmp_path / "latest.json").write_text(json.dumps({"sections": {"data": data_section, "xla": old_xla}}))
    r = run_bench("--quick", "--only", "attention", "--out", tmp_path)
    assert r.returncode == 0, r.stderr
    report = json.loads((tmp_path / "latest.json").read_text())
    assert set(report["sections"]) == {"attention", "data", "xla"} and report["sections"]["data"] == data_section
    att = report["sections"]["attention"]
    assert [row["T"] for row in att["rows"]] == [512, 1024, 2048, 4096]
    for row in att["rows"]:
        assert row["full_s"] > 0 and row["nash_s"] > 0 and row["ratio"] == pytest.approx(row["nash_s"] / row["full_s"])
    md = (tmp_path / "latest.md").read_text()
    assert "## 3. Attention cost" in md and "## 4. Data" in md and "500x" in md and "Machine:" in md
    assert "Not shown: a result of an older bench/run.py" in md and "re-run it with `--only xla`" in md
    assert not list(tmp_path.glob("*.tmp"))  # atomic writes leave no temporary files


@pytest.mark.slow
def test_quick_learning_on_the_test_corpus(tmp_path, stdlib_data):
    """Four train.py runs: every variant gets a curve, T is the fastest variant's time, the
    baseline's paired differences are zero, and the PNG is written."""
    r = run_bench("--quick", "--only", "learning", "--data", stdlib_data, "--out", tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    snapshot = yaml.safe_load((tmp_path / "demo_config.yaml").read_text())
    tokens_per_step = snapshot["training"]["batch_size"] * snapshot["data"]["seq_len"]
    assert snapshot["data"]["dir"] == str(stdlib_data)
    res = json.loads((tmp_path / "latest.json").read_text())["sections"]["learning"]
    steps = bench.BUDGETS["quick"]["learning"]["tokens"] // tokens_per_step
    assert list(res["variants"]) == list(bench.VARIANTS)
    times = {v: x["train_s"] for v, x in res["variants"].items()}
    assert res["T_s"] == min(times.values()) and res["T_variant"] == min(times, key=times.get)
    for v, x in res["variants"].items():
        (run,) = x["runs"]
        assert run["tokens"] == res["tokens"] == steps * tokens_per_step
        assert [e["step"] for e in run["eval"]] == [steps // 2, steps]
        assert run["train_s"] == run["eval"][-1]["train_s"] > run["eval"][0]["train_s"] > 0
        assert x["final_val_loss"]["mean"] == run["eval"][-1]["val_loss"] and math.isfinite(run["final_val_loss"])
        # which evaluations fall before T depends on how fast each run went: only the reading is checked
        curve = ([e["train_s"] for e in run["eval"]], [e["val_loss"] for e in run["eval"]])
        assert (run["val_loss_at_T"], run["ended_before_T"]) == bench.value_at(*curve, res["T_s"])
    base = res["variants"]["baseline"]
    assert base["delta_final"]["mean"] == 0
    # the baseline has a value at T only if an evaluation of its came before T: machine load decides
    assert base["delta_at_T"] is None if base["val_loss_at_T"] is None else base["delta_at_T"]["mean"] == 0
    assert base["mhc_streams"] == 1 and base["nash_scales"] == 1
    assert res["variants"]["nash-mhc"]["mhc_streams"] == 4 and res["variants"]["nash-mhc"]["nash_scales"] == 3
    png = tmp_path / "loss_curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- bench/model.py's --loss-compare ------------------------------------------------------------

def test_loss_compare_settings_parse_and_bad_ones_name_the_entry():
    from bench import model as bench_model

    got = bench_model.parse_loss_settings("mhc_lite=false, sinkhorn_iters=5+stream_dtype=bf16")
    assert got == {"mhc_lite=false": {"mhc_lite": False},
                   "sinkhorn_iters=5+stream_dtype=bf16": {"sinkhorn_iters": 5, "stream_dtype": "bf16"}}
    for bad in ("mhc_lte=true", "mhc_lite", ""):
        with pytest.raises(ValueError, match="--loss-compare"):
            bench_model.parse_loss_settings(bad)


def test_bench_model_rejects_a_bad_loss_setting_in_one_line():
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "model.py"), "--loss-steps", "1",
                        "--loss-compare", "mhc_streams=7+mhc_lite=true"], capture_output=True, text=True, env=ENV)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        "error: mhc_lite=true needs mhc_streams <= 6 (it mixes all n! permutations; mhc_lite: false uses "
        "Sinkhorn), got 7"]


# -- bench/model.py's --model-root (before/after side by side) ----------------------------------

def test_model_root_variants_are_built_by_the_other_checkouts_model(tmp_path):
    import argparse

    import torch

    import model
    from bench import model as bench_model

    other = tmp_path / "other"
    other.mkdir()
    # another checkout whose model differs visibly: one more default layer
    (other / "model.py").write_text((ROOT / "model.py").read_text().replace(
        'n_layers: int = _help("number of blocks", 4)', 'n_layers: int = _help("number of blocks", 5)'))
    args = argparse.Namespace(vocab=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, seq=64, window=16,
                              sinkhorn_iters=3, stream_dtype=None, model_root=str(other))
    here, there = bench_model.make_config(args, "nash-mhc"), bench_model.make_config(args, "root:nash-mhc")
    assert type(here) is model.ModelConfig and type(there).__module__ == "model_at_root"
    assert type(there)().n_layers == 5 and there.n_layers == 1
    torch.manual_seed(0)
    a = bench_model.build_model(here)
    torch.manual_seed(0)
    b = bench_model.build_model(there)
    assert type(b).__module__ == "model_at_root" and not isinstance(b, model.NashMHC)
    idx = torch.randint(0, 64, (1, 64))
    assert torch.equal(a(idx).logits, b(idx).logits)   # the same code: the same numbers


def test_bench_model_root_variant_without_a_root_is_a_one_line_error():
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "model.py"), "--backends", "eager",
                        "--variants", "baseline,root:baseline"], capture_output=True, text=True, env=ENV)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == ["error: variant 'root:baseline' needs --model-root"]


def test_report_gives_each_ratio_s_spread_over_the_rounds():
    """Beside the ratio of the medians, the report gives the least and the most of the variant's
    step over the baseline's in the same round (the two ran next to each other), in the text and in
    the markdown table; the baseline's own rows, a result without per-round times, or with a
    different number of rounds, get none."""
    import argparse

    from bench import model as bench_model

    def result(walls):
        return {"params": 1, "warmup_s": 1.0, "wall_s": sorted(walls)[len(walls) // 2],
                "cpu_s": sorted(walls)[len(walls) // 2], "wall_all": walls}

    args = argparse.Namespace(batch=4, seq=512, d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab=512,
                              window=128, sinkhorn_iters=20, stream_dtype=None, threads=2, hlo_only=False,
                              repeats=3, warmup=1, cpu_malloc="tuned", warmup_rounds=1)
    # rounds: 1.6, 1.1 and 1.0 the baseline's, so 1.00-1.60; the medians' ratio is 1.6 / 1.5. Paired
    # by sorted rank, or against the baseline's rounds reversed, it would read 1.07-1.50.
    res = {"baseline": result([1.0, 2.0, 1.5]), "nash-mhc": result([1.6, 2.2, 1.5]),
           "mhc-only": result([1.2, 1.2]), "nash-only": {**result([1.2]), "wall_all": None}}
    text = bench_model.render(args, {"load": (0.0, 0.0), "backends": {"eager": {"results": res}}})
    rows = {s.split()[1]: s.split() for s in text.splitlines() if s.startswith("eager ")}
    assert rows["nash-mhc"][5:9] == ["1.07", "/", "1.07", "1.00-1.60"]
    assert rows["baseline"][5:9] == ["1.00", "/", "1.00", "-"]
    assert rows["mhc-only"][8] == rows["nash-only"][8] == "-"      # 2 rounds against 3; none recorded
    assert "| eager | 1500 ms | 1600 ms | 1.07x (1.00-1.60) | 0.80x | 0.80x |" in text
    assert bench_model.round_band(res["nash-mhc"], None) is None


def test_compile_warmups_are_measured_alone(monkeypatch):
    """In one worker the later variants reuse kernels the earlier ones compiled; the compile
    backend's warm-up is each variant's in a worker of its own, the shared figure kept aside; and
    each round also times each variant's first step in a fresh worker without the tiny model
    (--cold: a launch's first step, the compiler's one-time set-up in it), reported beside it."""
    import argparse

    from bench import model as bench_model

    calls = []
    alone = {"baseline": iter([10.0, 12.0, 9.0]), "nash-mhc": iter([40.0, 90.0, 41.0])}   # one slow round
    cold = {"baseline": iter([16.0, 15.0, 17.0]), "nash-mhc": iter([45.0, 47.0, 46.0])}

    def fake_worker(args, backend, extra=()):
        calls.append((backend, tuple(extra)))
        if extra:   # alone: --variants=NAME --warmup-only [--cold]
            v = extra[0].split("=", 1)[1]
            return {"results": {v: {"params": 1, "warmup_s": next((cold if "--cold" in extra else alone)[v])}}}
        return {"results": {"baseline": {"params": 1, "warmup_s": 10.0, "wall_s": 1.0},
                            "nash-mhc": {"params": 1, "warmup_s": 30.0, "wall_s": 1.2}}}

    monkeypatch.setattr(bench_model, "run_worker", fake_worker)
    args = argparse.Namespace(variants=["baseline", "nash-mhc"], warmup_rounds=3)
    out = bench_model.run_backend(args, "compile")["results"]
    assert out["nash-mhc"]["warmup_s"] == 41.0 and out["nash-mhc"]["warmup_shared_s"] == 30.0   # medians
    assert out["baseline"]["warmup_s"] == 10.0 and out["nash-mhc"]["wall_s"] == 1.2
    assert out["nash-mhc"]["warmup_alone_s"] == [40.0, 90.0, 41.0]
    assert (out["baseline"]["first_step_s"], out["nash-mhc"]["first_step_s"]) == (16.0, 46.0)
    assert out["nash-mhc"]["first_step_alone_s"] == [45.0, 47.0, 46.0]
    # the variants in turn, round after round: a slow spell of the machine falls on both
    assert calls == [("compile", ())] + [("compile", (f"--variants={v}", "--warmup-only", *cold_flag))
                                         for _ in range(3) for v in ("baseline", "nash-mhc")
                                         for cold_flag in ((), ("--cold",))]
    calls.clear()
    assert bench_model.run_backend(args, "eager")["results"]["nash-mhc"]["warmup_s"] == 30.0
    assert calls == [("eager", ())]
    # the report says both, each over the baseline's
    args = argparse.Namespace(batch=4, seq=512, d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab=512,
                              window=128, sinkhorn_iters=20, stream_dtype=None, threads=2, hlo_only=False,
                              repeats=5, warmup=1, cpu_malloc="tuned", warmup_rounds=3)
    for r in out.values():
        r.update(cpu_s=r["wall_s"])
    text = bench_model.render(args, {"load": (0.0, 0.0), "backends": {"compile": {"results": out}}})
    assert "a first launch's first step" in text and "baseline 16.0 s (1.00x), nash-mhc 46.0 s (2.88x)" in text


@pytest.mark.slow
def test_profile_splits_each_step_by_kind_of_op(tmp_path):
    """--profile at a tiny shape: eager as a user runs it (bench/model.py, its worker process),
    torch.compile's worker in this process (its inductor set-up is ~30 s in a fresh one). Eager
    runs no inductor kernel, torch.compile's generated kernels are recorded one by one
    (``kernel_kind`` "inductor", not lumped into the graph's call as "other"); both see attention
    and matmuls; with one round the kinds and the time outside any op add up to the step; the top
    ops are the slowest, each of a kind."""
    import argparse

    import torch
    import torch._dynamo
    import torch._inductor.config

    from bench import model as bench_model

    threads = torch.get_num_threads()
    args = dict(batch=1, seq=64, vocab=67, d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, window=16,
                sinkhorn_iters=20, threads=1, warmup=0, repeats=1, profile_rows=5, stream_dtype=None,
                model_root=None, cpu_malloc="default")   # the compile worker below runs in this process
    tiny = [f"--{k.replace('_', '-')}={v}" for k, v in args.items() if v is not None]
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "model.py"), "--backends", "eager", "--variants",
                        "baseline,nash-mhc", "--no-memory", "--profile", *tiny, "--json", str(tmp_path / "out.json")],
                       capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    prof = json.loads((tmp_path / "out.json").read_text())["profile"]
    assert list(prof) == ["eager"] and list(prof["eager"]) == ["baseline", "nash-mhc"]
    try:   # what the worker sets for its process, put back for the tests after this one
        with torch._inductor.config.patch({"cpp.enable_kernel_profile": False}), \
                torch._dynamo.config.patch(recompile_limit=torch._dynamo.config.recompile_limit):
            # the baseline alone: inductor's warm-up of even a tiny nash-mhc is ~40 s here
            prof["compile"] = bench_model.profile_worker(argparse.Namespace(**args, worker="compile",
                                                                            variants=["baseline"]))
    finally:
        torch.set_num_threads(threads)
        torch._dynamo.reset()   # the tiny model's compiled entries: not counted against later tests' limit
    for backend, res in prof.items():
        for v, r in res.items():
            kinds = r["by_kind_ms"]
            assert kinds["attention"] > 0 and kinds["matmul"] > 0, (backend, v, kinds)
            assert (kinds["inductor"] > 0) == (backend == "compile"), (backend, v, kinds)
            assert sum(kinds.values()) + r["outside_ops_ms"] == pytest.approx(r["step_ms"])
            ms = [t["ms"] for t in r["top"]]
            assert len(ms) == 5 and ms == sorted(ms, reverse=True) and ms[-1] > 0
            assert all(t["kind"] in kinds and t["calls"] >= 1 for t in r["top"])
    text = bench_model.render_profiles(argparse.Namespace(**args), prof)
    assert "| eager | nash-mhc |" in text and "compile, baseline: top ops by self CPU time" in text


def test_profile_rounds_are_summarised_by_medians():
    """Three rounds of one variant: each kind's, the step's and each op's median (an op missing
    from a round is 0 there), the most calls in a round, the slowest ops first."""
    from bench import model as bench_model

    mm, sdpa, k0, mul = ("aten::mm", "aten::_scaled_dot_product_flash_attention_for_cpu",
                         "graph_0_cpp_fused_add_mul_0", "aten::mul")
    rounds = [(100.0, {mm: (50.0, 4), sdpa: (20.0, 2), mul: (5.0, 10)}),
              (130.0, {mm: (70.0, 4), sdpa: (30.0, 2), k0: (9.0, 1), mul: (6.0, 12)}),
              (110.0, {mm: (60.0, 4), sdpa: (10.0, 2), k0: (3.0, 1), mul: (7.0, 11)})]
    r = bench_model.summarise_profile(rounds, rows=3)
    assert r["step_ms"] == 110.0
    assert r["by_kind_ms"] == {"matmul": 60.0, "attention": 20.0, "inductor": 3.0, "other": 6.0}
    assert r["outside_ops_ms"] == pytest.approx(25.0)   # 25, 15, 30 (sorted: 15, 25, 30)
    assert [(t["op"], t["kind"], t["ms"], t["calls"]) for t in r["top"]] == [
        (mm, "matmul", 60.0, 4), (sdpa, "attention", 20.0, 2), (mul, "other", 6.0, 12)]
    assert bench_model.summarise_profile(rounds, rows=9)["top"][-1] == {"op": k0, "kind": "inductor", "ms": 3.0,
                                                                        "calls": 1}


@pytest.mark.parametrize("args, message", [
    (["--backends", "xla", "--profile"], "--profile profiles the eager and compile backends: name one in --backends"),
    (["--backends", "eager", "--profile", "--hlo-only"], "--profile profiles the timed steps, which --hlo-only "
                                                          "does not run"),
    (["--backends", "eager", "--profile-rows", "3"], "--profile-rows applies with --profile"),
])
def test_bench_model_profile_options_are_checked(args, message):
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "model.py"), *args], capture_output=True, text=True,
                       env=ENV)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [f"error: {message}"]


def test_a_cold_worker_times_the_variant_without_the_tiny_model_before_it(monkeypatch):
    """The warm-up is each variant's first step after a tiny model has paid the compiler's
    one-time set-up in the process; --cold leaves that set-up in the variant's first step."""
    import argparse

    import torch

    from bench import model as bench_model

    built = []
    monkeypatch.setattr(bench_model, "torch_step", lambda a, v, compiled: (built.append((v, a.d_model)) or
                                                                          (lambda: None), 1))
    threads = torch.get_num_threads()
    try:
        for cold, want in ((False, [("baseline", 32), ("nash-mhc", 256)]), (True, [("nash-mhc", 256)])):
            built.clear()
            args = argparse.Namespace(worker="eager", threads=threads, variants=["nash-mhc"], warmup_only=True,
                                      cold=cold, compile_split=False, d_model=256, n_heads=8, n_kv_heads=4,
                                      n_layers=4, batch=4, seq=512, vocab=512, window=128)
            out = bench_model.backend_worker(args)
            assert built == want and list(out["results"]) == ["nash-mhc"], (cold, built)
    finally:
        torch.set_num_threads(threads)


def test_bench_model_times_with_train_py_s_cpu_malloc():
    """bench/model.py's torch backends are train.py's step: the same training.cpu_malloc default,
    named apart so that its command line does not import torch to learn it."""
    from bench import model as bench_model
    from training.config import TrainingConfig

    assert bench_model.CPU_MALLOC == TrainingConfig().cpu_malloc


def test_memory_is_measured_with_the_plain_heap_under_tuned_malloc():
    """--cpu-malloc tuned (a timing setting: glibc keeps freed memory) must not reach the memory
    worker: there the heap would keep the warm-up step's memory, and the measured step's rise
    above the resident set before it would read a fraction of it (16 KiB of a ~300 MiB step at
    issue 13's shape, ~16 of ~60 MiB at one layer of it)."""
    import argparse

    from bench import model as bench_model

    args = argparse.Namespace(batch=4, seq=512, vocab=512, d_model=256, n_layers=1, n_heads=8, n_kv_heads=4,
                              window=128, sinkhorn_iters=20, threads=1, warmup=0, repeats=1, variants=["baseline"],
                              stream_dtype=None, cpu_malloc="tuned", model_root=None)
    plain = bench_model.measure_memory(argparse.Namespace(**{**vars(args), "cpu_malloc": "default"}), "baseline")
    tuned = bench_model.measure_memory(args, "baseline")
    assert plain["step_rss"] > 32 * 2 ** 20   # ~60 MiB; with the tuned heap it had read ~16 MiB
    assert tuned["step_rss"] > plain["step_rss"] / 2


def test_variants_take_model_settings_and_bad_ones_name_the_option():
    import argparse

    from bench import model as bench_model

    args = argparse.Namespace(vocab=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, seq=64, window=16,
                              sinkhorn_iters=3, stream_dtype=None, model_root=None)
    plain, game_off = (bench_model.make_config(args, v) for v in ("nash-only", "nash-only+aggregation=mean"))
    assert (plain.aggregation, game_off.aggregation) == ("nash", "mean")
    assert {k: v for k, v in vars(game_off).items() if k != "aggregation"} == \
           {k: v for k, v in vars(plain).items() if k != "aggregation"}
    two = bench_model.make_config(args, "nash-mhc+mhc_lite=false+sinkhorn_iters=5")
    assert (two.mhc_lite, two.sinkhorn_iters, two.mhc_streams) == (False, 5, 4)
    for bad, msg in (("nash-onl", "--variants: unknown 'nash-onl'"),
                     ("nash-only+aggregaton=mean", "--variants: 'aggregaton=mean' is not field=value"),
                     ("nash-only+", "--variants: '' is not field=value")):
        with pytest.raises(ValueError, match=msg):
            bench_model.make_config(args, bad)


@pytest.mark.parametrize("args, message", [
    (["--repeats", "0"], "--repeats must be at least 1, got 0"),
    (["--workdir", "/nonexistent"], "--workdir /nonexistent: no such directory"),
    (["--tokenizer", "/nonexistent"], "--tokenizer /nonexistent: no tokenizer.json there"),
    (["--json", "/nonexistent/out.json"], "--json /nonexistent/out.json: no directory /nonexistent"),
    (["--large-file-mb", "100,60"], "--large-file-mb 100,60: sizes must be whole numbers of MB over "
                                    "prepare_data.STREAM_BYTES (67 MB), or 0"),
    (["--large-file-mb", "1e9"], "--large-file-mb 1e9: sizes must be whole numbers of MB over "
                                 "prepare_data.STREAM_BYTES (67 MB), or 0"),
])
def test_bench_prepare_data_bad_arguments_are_one_line_errors(tmp_path, args, message):
    """Refused before any corpus is copied or tokenizer trained, and nothing written."""
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "prepare_data.py"), "--json", str(tmp_path / "r.json"),
                        "--workdir", str(tmp_path), *args], cwd=ROOT, env=ENV, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and r.stderr.strip() == f"bench/prepare_data.py: error: {message}", r.stderr
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------------------------
# bench/gpu.py: what can be checked without a GPU

@pytest.mark.parametrize("args, message", [
    (["--only", "tests,bogus"], "unknown stage(s) bogus"),
    (["--data", "/nonexistent"], "/nonexistent: no meta.json"),
    (["--steps", "5"], "--steps must be at least 20"),
    (["--only", "variants", "--variants", "baseline,nash-mhc+bogus=1"], "'bogus=1' is not field=value"),
    (["--only", "baseline"], "runs/baseline exists"),
    (["--only", "resume"], "without nash-mhc: no "),
    ([], "no CUDA GPU here"),                     # CI has none: every other check comes first
])
def test_bench_gpu_bad_arguments_are_one_line_errors(tmp_path, stdlib_data, args, message):
    (tmp_path / "out" / "runs" / "baseline").mkdir(parents=True)   # an earlier call's run: never resumed
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "--data", str(stdlib_data),
                        "--out", str(tmp_path / "out"), "--only", "tests", *args],
                       cwd=ROOT, env={**ENV, "CUDA_VISIBLE_DEVICES": ""},   # no GPU, on a GPU machine too
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and message in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert not (tmp_path / "out" / "gpu.json").exists()


def test_bench_gpu_summarises_train_py_lines_after_the_first(tmp_path):
    """The figures of a training stage come from train.py's metrics.jsonl: medians over the lines
    after the first (which holds the compile warm-up), the last evaluation, the largest peak."""
    from bench import gpu

    lines = [{"step": 10, "time": 130.0, "step_time": 3.0, "tokens_per_sec": 1e4, "mfu": 0.05, "loss": 9.0,
              "mem_peak_gib": 30.0},
             {"step": 20, "time": 131.0, "step_time": 0.2, "tokens_per_sec": 2e5, "mfu": 0.30, "loss": 7.0,
              "mem_peak_gib": 34.0},
             {"step": 30, "time": 133.0, "step_time": 0.1, "tokens_per_sec": 3e5, "mfu": 0.40, "loss": 6.5,
              "eval_loss": 6.6, "mem_peak_gib": 33.0},
             {"step": 40, "time": 134.0, "step_time": 0.3, "tokens_per_sec": 1e5, "mfu": 0.20, "loss": 6.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    m = gpu.summarise(tmp_path, start=100.0)
    assert m["first_log_s"] == 30.0 and m["first_log_step"] == 10 and m["last_step"] == 40
    assert m["step_ms"] == pytest.approx(200.0) and m["tokens_per_sec"] == 2e5 and m["mfu"] == pytest.approx(0.30)
    assert m["mem_peak_gib"] == 34.0 and m["mem_reserved_gib"] is None
    assert m["val_loss"] == 6.6 and m["loss"] == 6.0
    resumed = gpu.summarise(tmp_path, start=132.0, from_step=20)    # a resumed run's own lines
    assert resumed["first_log_step"] == 30 and resumed["first_log_s"] == 1.0 and resumed["step_ms"] == pytest.approx(300.0)
    assert gpu.summarise(tmp_path, start=0.0, from_step=40) == {}


def test_bench_gpu_variants_time_every_named_form_on_cpu(tmp_path, monkeypatch):
    """The variants stage on the CPU (its GPU path but eager): every name, settings and the
    eager-loss form included, is built as named and timed; the first is the reference."""
    from bench import gpu
    from model import lm_loss

    small = gpu.small_gpu_configs
    monkeypatch.setattr(gpu, "DEVICE", "cpu")
    monkeypatch.setattr(gpu, "small_gpu_configs", lambda names, seq: {
        k: dataclasses.replace(c, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=128)
        for k, c in small(names, seq).items()})
    real, seen = gpu.eager_loss, {}

    def spy(name, model):   # on the CPU nothing is compiled: mark the loss as if it were
        model.loss_fn = None
        real(name, model)
        seen[name] = model.loss_fn is lm_loss
        model.loss_fn = lm_loss

    monkeypatch.setattr(gpu, "eager_loss", spy)
    names = ["baseline", "nash-mhc/eager-loss", "mhc-only+stream_dtype=bf16"]
    gpu.variants(tmp_path, batch=1, names=names, seq=32)
    res = json.loads((tmp_path / "variants.json").read_text())
    assert list(res["models"]) == names
    assert seen == {"baseline": False, "nash-mhc/eager-loss": True, "mhc-only+stream_dtype=bf16": False}
    assert res["models"]["baseline"]["x_baseline"] == 1.0
    assert all(r["step_s"] > 0 for r in res["models"].values())
    cfgs = small(names, 32)
    assert (cfgs["baseline"].mhc_streams, cfgs["nash-mhc/eager-loss"].mhc_streams) == (1, 4)
    assert cfgs["nash-mhc/eager-loss"].nash_scales == 3 and cfgs["mhc-only+stream_dtype=bf16"].nash_scales == 1
    assert cfgs["mhc-only+stream_dtype=bf16"].stream_dtype == "bf16" and cfgs["baseline"].stream_dtype == "fp32"


def test_bench_gpu_attention_times_each_call_against_flex(tmp_path, monkeypatch):
    """The attention stage on the CPU (fp32): one row per SDPA call of Nash attention (full causal,
    the window, each pooled scale), the model's form timed; flex_attention's form timed with its
    outputs equal to the model's, or its error reported (torch 2.9's CPU inductor cannot compile
    flex_attention's backward) without stopping the others."""
    from bench import gpu

    small = gpu.small_gpu_configs
    monkeypatch.setattr(gpu, "DEVICE", "cpu")
    monkeypatch.setattr(gpu, "small_gpu_configs", lambda names, seq: {
        k: dataclasses.replace(c, d_model=32, n_heads=2, n_kv_heads=1, nash_window=16, max_seq_len=seq)
        for k, c in small(names, seq).items()})
    real, order = gpu._cuda_ms, []

    def in_turn(fns, warmup=3, repeats=20):   # the real timer, 2 repeats, each call's form recorded
        order.append([])
        return real({k: lambda k=k, f=f: (order[-1].append(k), f()) for k, f in fns.items()}, 0, 2)

    monkeypatch.setattr(gpu, "_cuda_ms", in_turn)
    gpu.attention(tmp_path, batch=1, seq=64)
    rows = json.loads((tmp_path / "attention.json").read_text())["rows"]
    assert [r["call"] for r in rows] == ["full causal (the baseline's)", "scale 0: window 16",
                                         "scale 1: 16 pooled keys", "scale 2: 4 pooled keys"]
    for r, timed in zip(rows, order):
        assert r["model_ms"] > 0 and "model_error" not in r
        assert ("flex_ms" in r and r["max_diff"] < 1e-5) or "flex_error" in r
        # the forms side by side: one after the other in every repeat
        assert timed == (["model", "flex"] * 2 if "flex_ms" in r else ["model"] * 2)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")   # wanted here
def test_bench_gpu_flex_forms_see_what_the_model_sees():
    """bench/gpu.py's flex_attention forms compute the model's attention calls: the same outputs
    from eager flex_attention (PyTorch's reference path; the compiled one fails on the CPU, so the
    comparison above is made on a GPU only), i.e. block masks of the same visibility as the
    model's masks, for the window and every pooled scale, at a length with several window chunks
    and a padded last one."""
    import torch

    from bench import gpu
    from model import ModelConfig

    seq = 80    # window 24: 4 chunks, the last padded; blocks of 4 and 16 tokens
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, max_seq_len=seq,
                      nash_scales=3, nash_compression=4, nash_window=24)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, seq, 16, generator=g)
    k, v = (torch.randn(1, 1, seq, 16, generator=g) for _ in range(2))
    calls = gpu.attention_calls(cfg, 1, seq, "cpu", compiled=False)
    assert len(calls) == 4
    for name, (model_form, flex_form) in calls.items():
        torch.testing.assert_close(flex_form(q, k, v), model_form(q, k, v), rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("name, kind", [       # kernel names from bench/gpu.py's profile on an H100
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64_1x4x1", "attention"),
    ("void cudnn::fusion::compute_dot_do_o_specialized<true, 64>(void const*, void const*)", "attention"),
    ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "matmul"),
    ("sm80_xmma_gemm_f32f32_f32f32_f32_tn_n_tilesize128x32x8_stage3_warpsize2x2x1_ffma", "matmul"),
    ("triton_red_fused__to_copy_expand_mul_permute_squeeze_sum_unsqueeze_view_5", "inductor"),
    ("triton_poi_fused__scaled_dot_product_cudnn_attention_backward__softmax_backward_data", "attention"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float>", "other"),
    # and on the CPU (bench/model.py --profile: torch.profiler's ops, inductor's C++ kernels)
    ("aten::mm", "matmul"), ("aten::bmm", "matmul"), ("aten::addmm", "matmul"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu_backward", "attention"),
    ("graph_2_cpp_fused__unsafe_view_add_div_expand_mul_permute_pow_squeeze_sum_unsqueeze_view_5", "inductor"),
    ("aten::_fused_adamw_", "other"), ("aten::mul", "other"),
])
def test_bench_gpu_kernel_kinds(name, kind):
    from bench import gpu
    assert gpu.kernel_kind(name) == kind


def test_bench_optimizer_counts_every_collective_of_an_hlo_dump():
    """bench/optimizer.py's spmd section reads XLA's dumps: an all-to-all's result is a tuple (with
    XLA's /*index=5*/ comments past five), a scalar all-reduce has no layout, an asynchronous
    all-gather is a start and a done (counted once, by its gathered result); other ops are not
    collectives. (A single-array pattern missed 64 of 249 collectives and a third of the bytes.)"""
    from bench.optimizer import _collectives

    six = ", ".join(["f32[2,4]{1,0}"] * 5 + ["/*index=5*/f32[2,4]{1,0}"])
    hlo = "\n".join([
        "HloModule m, entry_computation_layout={(f32[2,16]{1,0})->f32[8,16]{1,0}}",
        f"  %all-to-all.1 = ({six}) all-to-all({six} %a), replica_groups={{{{0,1,2,3}}}}",
        "  %all-reduce.2 = f32[] all-reduce(f32[] %x), replica_groups={{0,1,2,3}}, to_apply=%add",
        "  %ag-start = (f32[2,16]{1,0}, f32[8,16]{1,0}) all-gather-start(f32[2,16]{1,0} %p), dimensions={0}",
        "  %ag-done = f32[8,16]{1,0} all-gather-done((f32[2,16]{1,0}, f32[8,16]{1,0}) %ag-start)",
        "  ROOT %all-gather.3 = bf16[8,16]{1,0} all-gather(bf16[2,16]{1,0} %q), dimensions={0}",
        "  %add.4 = f32[8,16]{1,0} add(f32[8,16]{1,0} %ag-done, f32[8,16]{1,0} %ag-done)",
        "  %cp = s32[3]{0} collective-permute(s32[3]{0} %i), source_target_pairs={{0,1}}",
    ])
    assert _collectives([hlo]) == {
        "collectives": 5, "by_kind": {"all-to-all": 1, "all-reduce": 1, "all-gather": 2, "collective-permute": 1},
        "result_bytes_per_device": 6 * 8 * 4 + 4 + 8 * 16 * 4 + 8 * 16 * 2 + 3 * 4}


def test_bench_optimizer_fsdp2_and_ddp_sections_run_as_written():
    """`bench/optimizer.py --only fsdp2,ddp` at a tiny shape (2 gloo processes), as the README runs it
    at full size (its fsdp2 section once broke unnoticed): every form takes the same first step
    (gathered exactly, the others to rounding), with the collectives its docstring says: one
    all-gather per matrix shape gathered, twice that by matrix (two all-to-alls, each an all-gather
    on gloo), many more per product; the DDP replicas' shared Newton-Schulz is bit-identical."""
    r = subprocess.run([sys.executable, "bench/optimizer.py", "--only", "fsdp2,ddp", "--d-model", "64",
                        "--layers", "1", "--repeats", "1"], cwd=ROOT, env=ENV, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    forms, diff = res["fsdp2"]["forms"], res["fsdp2"]["first_step_max_weight_difference_from_by_matrix"]
    assert diff["gathered"] == 0.0 and diff["tensor_op_adamw"] < 1e-6 and diff["per_product"] < 1e-3
    shapes = forms["gathered"]["by_kind"]["all_gather_into_tensor"]
    assert forms["gathered"]["collectives"] == shapes > 0
    assert forms["by_matrix"]["collectives"] == forms["tensor_op_adamw"]["collectives"] == 2 * shapes
    assert forms["per_product"]["collectives"] > 4 * forms["by_matrix"]["collectives"]
    assert all(f["step_ms"] > 0 for f in forms.values())
    assert res["ddp"]["first_step_max_weight_difference"] == 0.0


@pytest.mark.parametrize("args, message", [
    (["--only", "zero", "--scan-layers"], "the tp section's: add tp to --only"),
    (["--only", "tp", "--model-root", "/nonexistent"], "--model-root /nonexistent: no model.py there"),
])
def test_optimizer_bench_refuses_options_it_would_ignore(args, message):
    r = subprocess.run([sys.executable, "bench/optimizer.py", *args], cwd=ROOT, env=ENV, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and message in r.stderr.strip().splitlines()[-1], r.stderr[-2000:]


@pytest.mark.xla
def test_zero2_state_lies_within_each_devices_parameter_shard_and_activations_keep_the_batch():
    """`bench/optimizer.py --only zero,activations,tp` at a tiny shape (data 2 x fsdp 2 PJRT CPU
    devices). zero: with the ZeRO-2 state split fsdp-major (training/sharding.py), the update's
    only collectives are the all-gathers of the updated shards over data; split data-major (as
    before), XLA moves each state piece to its parameter shard and back (collective-permutes) for
    twice the update's bytes; the forward and backward deliver no more bytes.
    activations: annotated with the batch's split, the forward and backward move weights only
    (all-gathers and gradient all-reduces); left to propagation, activations change layout
    (all-to-alls, permutes) and the collectives deliver more bytes.
    tp (fsdp 2 x tp 2, no --model-root): this checkout's model alone, its graphs compiled before
    the timed steps. muon_zero: Muon's orthogonalised stacks laid out like their state again
    before the update slices them, its update moves whole matrices (all-to-alls) and gathers the
    updated shards, no all-reduce of matrices made whole on every device, fewer bytes, the same
    weights."""
    r = subprocess.run([sys.executable, "bench/optimizer.py", "--only", "zero,muon_zero,activations,tp",
                        "--d-model", "64",
                        "--layers", "2", "--repeats", "1"], cwd=ROOT, env=ENV, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    ours, before = res["zero"]["forms"]["fsdp_major"], res["zero"]["forms"]["data_major"]
    assert set(ours["update"]["by_kind"]) == {"all-gather"}
    assert before["update"]["by_kind"]["collective-permute"] > 0
    assert ours["update"]["by_kind"]["all-gather"] == before["update"]["by_kind"]["all-gather"]
    assert ours["update"]["result_bytes_per_device"] < before["update"]["result_bytes_per_device"]
    fb = "forward_backward"
    assert ours[fb]["result_bytes_per_device"] <= before[fb]["result_bytes_per_device"]
    assert ours["compiled_while_timed"] == before["compiled_while_timed"] == 0
    constrained, propagated = (res["activations"]["forms"][f][fb] for f in ("constrained", "propagated"))
    assert set(constrained["by_kind"]) <= {"all-gather", "all-reduce", "reduce-scatter"}, constrained
    assert {"all-to-all", "collective-permute"} & set(propagated["by_kind"]), propagated
    assert constrained["result_bytes_per_device"] < propagated["result_bytes_per_device"]
    back, sliced = (res["muon_zero"]["forms"][f]["update"] for f in ("back", "sliced"))
    assert set(back["by_kind"]) == {"all-to-all", "all-gather"} and sliced["by_kind"]["all-reduce"] > 0, (back, sliced)
    assert back["result_bytes_per_device"] < sliced["result_bytes_per_device"]
    assert res["muon_zero"]["max_weight_difference_after_all_steps"] == 0.0
    assert list(res["tp"]["forms"]) == ["this"] and "root_over_this" not in res["tp"]
    this = res["tp"]["forms"]["this"]
    assert this[fb]["by_kind"]["all-reduce"] > 0 and this["compiled_while_timed"] == 0   # tp's partial sums
