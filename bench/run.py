"""Does Nash-MHC pay for itself? One command measures it and writes one report.

    .venv/bin/python bench/run.py                     # everything: ~35 min on a 2-core CPU
    .venv/bin/python bench/run.py --quick             # tiny budgets, one seed: a smoke test (~3-5 min on 2 cores)
    .venv/bin/python bench/run.py --only attention,data

Writes OUT/latest.json (every figure, per run and per seed), OUT/latest.md (the tables, with the
machine they ran on) and OUT/loss_curves.png; OUT is bench/results (bench/results/quick with
--quick). --only re-measures the named sections and keeps the others from OUT/latest.json.

Sections, all on the demo model's shape (configs/demo.yaml: d_model 128, 4 layers, 4 heads, 2 kv
heads, vocab 2048) unless said otherwise. Four variants at the same width and depth, the model
engineer's (bench/model.py VARIANTS): baseline (1 stream, 1 scale, full causal attention),
nash-mhc (4 streams, 3 scales, compression 4, window 64), mhc-only (4 streams, 1 scale, full
attention), nash-only (1 stream, 3 scales, window 64).

1. learning   train.py on the CPU (fp32), every variant x seed at the same token budget on
              data/stdlib, runs interleaved (seed by seed, variant by variant). Validation loss at
              equal tokens (end of the budget) and at equal wall-clock: at T, the median training
              time of the fastest variant, each run's validation curve read at training time T
              (linear interpolation between evaluations). Training time is the loop's own clock:
              metrics.jsonl's step_time, which leaves the evaluation passes out. Mean and standard
              deviation over seeds; differences to the baseline are paired by seed (same data
              order). loss_curves.png is drawn from the runs' metrics.jsonl.
2. speed      forward+backward step time of each variant at seq 512 (batch 4) and 2048 (batch 1)
              with bench/model.py's interleaved timer; tokens/s and the ratio to the baseline.
              With a CUDA GPU also a full training step (bf16 autocast, torch.compile, fused
              AdamW, clipping) of the ~125M shape (configs/small_gpu.yaml, or d_model 768,
              12 layers, 12 heads, vocab 32768) at seq 512, 1024 and 2048, with MFU from
              flops_per_token and the GPU's dense bf16 peak.
3. attention  one attention module (model.NashAttention), forward+backward, at T = 512 ... 4096:
              windowed Nash attention (3 scales, compression 4, window 512) against full causal
              attention (1 scale, no window), same width; the length from which Nash is cheaper.
4. data       the training loader (TokenWindows + DataStream with the demo's batch, seq_len and
              num_workers) in tokens/s, against what a train.py demo step consumes.
5. xla        a short train_xla.py demo run on PJRT CPU: compilations, CPU fallbacks and
              device-to-host transfers per 10 steps after warm-up, from metrics.jsonl's xla_*
              counters at two step counts, and the run's totals (xla_metrics.json).

configs/demo.yaml is read once, at the start: every run of one invocation uses that snapshot
(OUT/demo_config.yaml), so an edit of the config during a run cannot split a comparison.

Timings are medians over interleaved repeats (variants take turns, so a change in the machine's
load hits them alike); CPU work runs with --threads intra-op threads (default 1: steadier on a
shared machine). A section that fails is reported as failed and the others still run; the exit
code is then 1.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Run as a script, sys.path[0] is bench/, where model.py and prepare_data.py would shadow the
# top-level modules of the same names: the repository root takes its place.
if sys.path and Path(sys.path[0] or ".").resolve() == ROOT / "bench":
    sys.path[0] = str(ROOT)
elif str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.model import VARIANTS as MODEL_VARIANTS  # noqa: E402
from bench.model import interleaved, many_compiled_variants, time_variants, write_json  # noqa: E402

SECTIONS = ("learning", "speed", "attention", "data", "xla")
VARIANTS = ("baseline", "nash-mhc", "mhc-only", "nash-only")   # the baseline first: the reference
DEMO_CONFIG = ROOT / "configs" / "demo.yaml"
SMALL_GPU_CONFIG = ROOT / "configs" / "small_gpu.yaml"
# The ~125M GPU model when configs/small_gpu.yaml does not exist: GPT-2 small's shape.
SMALL_GPU = dict(vocab_size=32768, d_model=768, n_layers=12, n_heads=12, n_kv_heads=12, max_seq_len=1024,
                 mhc_streams=4, nash_scales=3, nash_compression=4, nash_window=256)
# The learning runs train in fp32: bf16 autocast on a CPU without bf16 instructions is slower, not
# faster (a demo train.py step: 6.9s in bf16, 1.1s in fp32 on a 2-core EPYC), and fp32 keeps the
# comparison free of rounding effects.
LEARNING_PRECISION = "fp32"

# Budgets: the full benchmark, and --quick (a smoke test of every code path).
BUDGETS = {
    "full": {
        # 409,600 tokens: the 12 runs take ~22 min on 2 shared cores
        "learning": dict(seeds=3, tokens=409_600, evals=5, logs_per_eval=4, warmup_fraction=1 / 6,
                         eval_tokens=40_960),
        "speed": dict(shapes=[(512, 4), (2048, 1)], warmup=2, repeats=7,
                      gpu_seqs=[512, 1024, 2048], gpu_tokens=32768, gpu_warmup=3, gpu_repeats=10),
        "attention": dict(lengths=[512, 1024, 2048, 4096], d_model=256, n_heads=4, n_kv_heads=2, window=512,
                          warmup=2, repeats=7),
        "data": dict(batches=200, repeats=3, consume_steps=30, consume_log_interval=5),
        "xla": dict(max_steps=30, log_interval=5, overrides=[],
                    # issue 12: graphs by accumulation x log interval x mode (1 layer: the count does
                    # not depend on depth), log steps vs others, compile time per layer, scan on/off
                    graph_settings=[(1, 1), (4, 1), (1, 10), (4, 10)], graph_modes=["ddp", "spmd"],
                    graph_layers=1, log_steps=40, log_interval_steps=5, log_repeats=2,
                    accum_layers=2, accum_steps=12, accum_batch=2,
                    compile_layers=[2, 8, 28], compile_d_model=64, compile_repeats=2),
    },
    "quick": {
        "learning": dict(seeds=1, tokens=8 * 8 * 256, evals=2, logs_per_eval=2, warmup_fraction=1 / 4,
                         eval_tokens=8192),
        "speed": dict(shapes=[(512, 4), (2048, 1)], warmup=1, repeats=2,
                      gpu_seqs=[1024], gpu_tokens=16384, gpu_warmup=2, gpu_repeats=3),
        "attention": dict(lengths=[512, 1024, 2048, 4096], d_model=256, n_heads=4, n_kv_heads=2, window=512,
                          warmup=1, repeats=2),
        "data": dict(batches=40, repeats=1, consume_steps=10, consume_log_interval=2),
        # one block: the smoke test checks the plumbing, not the demo's compile time
        "xla": dict(max_steps=8, log_interval=2, overrides=["model.n_layers=1"],
                    graph_settings=[(1, 1), (4, 3)], graph_modes=["ddp"], graph_layers=1,
                    log_steps=12, log_interval_steps=3, log_repeats=1,
                    accum_layers=1, accum_steps=5, accum_batch=1,
                    compile_layers=[1, 2], compile_d_model=32, compile_repeats=1),
    },
}


class BenchError(RuntimeError):
    """A measurement that could not be taken; its message is one line."""


# ----------------------------------------------------------------------------------------------
# Small pieces: statistics, interpolation, the training clock of a run.

def mean_sd(values: list[float]) -> dict:
    """Mean, sample standard deviation (0 for one value), min and max."""
    return {"mean": statistics.fmean(values), "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values), "n": len(values)}


def value_at(xs: list[float], ys: list[float], x: float) -> tuple[float | None, bool]:
    """``ys`` read at ``x`` by linear interpolation (``xs`` increasing).

    Returns (value, ended): before ``xs[0]`` there is nothing to read (None); after ``xs[-1]`` the
    last value, with ``ended`` true (the run stopped before ``x``).
    """
    if not xs or x < xs[0]:
        return None, False
    if x >= xs[-1]:
        return ys[-1], x > xs[-1]
    for i in range(1, len(xs)):
        if x <= xs[i]:
            x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
            return (y1 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)), False
    raise AssertionError("unreachable")


def training_clock(records: list[dict]) -> list[dict]:
    """Each metrics.jsonl line with ``train_s``: the training seconds from the loop's start to
    that step. The loop logs ``step_time``, the wall time since the previous line per step with
    the evaluation passes left out (training/loop.py), so this is its clock without evaluations."""
    if not records:
        raise BenchError("metrics.jsonl is empty")
    out, t, prev = [], 0.0, 0
    for r in records:
        if "step_time" not in r:
            raise BenchError(f"metrics.jsonl: step {r['step']} has no step_time")
        t += (r["step"] - prev) * r["step_time"]
        prev = r["step"]
        out.append({**r, "train_s": t})
    return out


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise BenchError(f"{path} was not written")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def crossover(lengths: list[int], ratios: list[float]) -> dict:
    """The shortest measured length from which ``ratios`` (Nash / full) stay below 1, and a
    log-linear estimate of where the ratio crosses 1 just below it."""
    first = None
    for i in range(len(lengths) - 1, -1, -1):
        if ratios[i] >= 1:
            break
        first = i
    if first is None:
        return {"length": None, "estimate": None}
    est = None
    if first > 0:
        (t0, r0), (t1, r1) = (lengths[first - 1], ratios[first - 1]), (lengths[first], ratios[first])
        f = (r0 - 1) / (r0 - r1)
        est = 2 ** (math.log2(t0) + f * (math.log2(t1) - math.log2(t0)))
    return {"length": lengths[first], "estimate": est}


# ----------------------------------------------------------------------------------------------
# Subprocesses: train.py and train_xla.py with config overrides.

def run_trainer(script: str, config: Path, overrides: list[str], run_dir: Path, env: dict, timeout: float) -> dict:
    """Run ``script CONFIG OVERRIDES checkpoint.dir=run_dir`` in a fresh directory; its output
    goes to run_dir/train.log. Returns wall and CPU seconds of the process tree."""
    if run_dir.exists():
        shutil.rmtree(run_dir)  # metrics.jsonl is appended to: start from nothing
    run_dir.mkdir(parents=True)
    cmd = [sys.executable, str(ROOT / script), str(config), *overrides, f"checkpoint.dir={run_dir}",
           "checkpoint.interval=0", "checkpoint.keep=1", "checkpoint.resume=none",
           "logging.progress_bar=false", "logging.tensorboard=false"]
    before = os.times()
    t0 = time.perf_counter()
    with open(run_dir / "train.log", "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        try:
            rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            raise BenchError(f"{script} ran over {timeout:.0f}s; see {run_dir / 'train.log'}") from None
    wall = time.perf_counter() - t0
    after = os.times()
    if rc != 0:
        lines = (run_dir / "train.log").read_text().strip().splitlines()
        raise BenchError(f"{script} exited with {rc}: {lines[-1] if lines else ''} (see {run_dir / 'train.log'})")
    cpu = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    return {"wall_s": wall, "cpu_s": cpu, "command": " ".join(cmd[1:])}


def display_path(p: Path) -> str:
    """``p`` relative to the repository when it is inside it."""
    try:
        return str(p.relative_to(ROOT))
    except ValueError:
        return str(p)


def child_env(threads: int, **extra) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1",
           "TOKENIZERS_PARALLELISM": "false", **extra}
    return env


def variant_overrides(variant: str) -> list[str]:
    return [f"model.{k}={v}" for k, v in MODEL_VARIANTS[variant].items()]


def snapshot_demo_config(args) -> Path:
    """configs/demo.yaml resolved now (data.dir = --data), written to OUT/demo_config.yaml: the
    one config of every run and model of this invocation."""
    import yaml
    from training.config import load_config

    cfg = load_config(DEMO_CONFIG, [f"data.dir={args.data}"])
    path = args.out / "demo_config.yaml"
    atomic_write_text(path, f"# {display_path(DEMO_CONFIG)} as bench/run.py read it at "
                            f"{datetime.datetime.now().astimezone().isoformat(timespec='seconds')}\n"
                            + yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    return path


def demo_config(args):
    """The snapshot's Config (training.config.Config)."""
    from training.config import load_config

    return load_config(args.config)


def demo_model_config(args, **over):
    """The snapshot's model section with ``over`` applied."""
    from model import ModelConfig

    return ModelConfig(**{**demo_config(args).model.to_dict(), **over})


# ----------------------------------------------------------------------------------------------
# 1. Learning

def compare_runs(runs: dict[str, list[dict]], baseline: str) -> tuple[float, str, dict]:
    """Equal tokens and equal wall-clock comparisons of the learning runs, paired by seed with the
    ``baseline`` variant's.

    ``runs[variant]`` is a list of runs, each with ``seed``, ``train_s`` and ``final_val_loss`` and
    an ``eval`` curve of ``{"train_s", "val_loss"}``. T is the median training time of the fastest
    variant, so every curve reaches T up to the seed-to-seed noise of the others (a run that ended
    before T is read at its end and flagged "ended"; one whose first evaluation came after T has no
    value at T). Sets ``val_loss_at_T`` and ``ended_before_T`` on every run; returns (T, the
    fastest variant, a summary per variant).
    """
    med_time = {v: statistics.median(r["train_s"] for r in rs) for v, rs in runs.items()}
    fastest = min(med_time, key=med_time.get)
    T = med_time[fastest]
    base = {r["seed"]: r for r in runs[baseline]}
    for rs in runs.values():
        for r in rs:
            r["val_loss_at_T"], r["ended_before_T"] = value_at(
                [e["train_s"] for e in r["eval"]], [e["val_loss"] for e in r["eval"]], T)
    summary = {}
    for v, rs in runs.items():
        at_T = [r["val_loss_at_T"] for r in rs if r["val_loss_at_T"] is not None]
        paired = [r["val_loss_at_T"] - base[r["seed"]]["val_loss_at_T"] for r in rs
                  if r["val_loss_at_T"] is not None and base[r["seed"]]["val_loss_at_T"] is not None]
        summary[v] = {
            "final_val_loss": mean_sd([r["final_val_loss"] for r in rs]),
            "delta_final": mean_sd([r["final_val_loss"] - base[r["seed"]]["final_val_loss"] for r in rs]),
            "val_loss_at_T": mean_sd(at_T) if at_T else None,
            "delta_at_T": mean_sd(paired) if paired else None,
            "ended_before_T": sum(r["ended_before_T"] for r in rs),
            "train_s": med_time[v],
        }
    return T, fastest, summary


def learning(args, budget: dict) -> dict:
    from model import NashMHC

    cfg = demo_config(args)
    tokens_per_step = cfg.training.batch_size * cfg.data.seq_len
    steps = max(1, budget["tokens"] // tokens_per_step)
    eval_interval = max(1, steps // budget["evals"])
    b = {**budget, "max_steps": steps, "eval_interval": eval_interval,
         "log_interval": max(1, eval_interval // budget["logs_per_eval"]),
         "warmup_steps": round(steps * budget["warmup_fraction"]),
         "eval_steps": max(1, budget["eval_tokens"] // tokens_per_step)}
    seeds = [1337 + i for i in range(args.seeds or b["seeds"])]
    runs_root = args.out / "runs" / "learning"
    env = child_env(args.threads)
    common = [f"training.max_steps={b['max_steps']}", "training.total_tokens=null",
              f"training.warmup_steps={b['warmup_steps']}", f"training.precision={LEARNING_PRECISION}",
              "training.gradient_accumulation_steps=1", "training.device=cpu",
              f"evaluation.interval={b['eval_interval']}", f"evaluation.steps={b['eval_steps']}",
              f"logging.interval={b['log_interval']}"]
    runs = {v: [] for v in VARIANTS}
    for seed in seeds:            # interleaved: every variant once per seed, in turn
        for v in VARIANTS:
            run_dir = runs_root / f"{v}-seed{seed}"
            print(f"  learning: {v}, seed {seed} ...", flush=True)
            proc = run_trainer("train.py", args.config, common + variant_overrides(v) + [f"training.seed={seed}"],
                               run_dir, env, timeout=args.run_timeout)
            recs = training_clock(read_metrics(run_dir))
            evals = [r for r in recs if "eval_loss" in r]
            clean = [r["tokens_per_sec"] for r in recs[1:] if "eval_loss" not in r and "tokens_per_sec" in r]
            runs[v].append({
                "seed": seed, "dir": str(run_dir.relative_to(args.out)), **proc,
                "train_s": recs[-1]["train_s"], "tokens": recs[-1]["tokens_seen"],
                "final_val_loss": evals[-1]["eval_loss"], "final_train_loss": recs[-1]["loss"],
                "tokens_per_sec": statistics.median(clean) if clean else None,
                "eval": [{"step": r["step"], "tokens": r["tokens_seen"], "train_s": r["train_s"],
                          "val_loss": r["eval_loss"]} for r in evals],
                "train": [{"step": r["step"], "tokens": r["tokens_seen"], "train_s": r["train_s"],
                           "loss": r["loss"]} for r in recs],
            })
            print(f"    val loss {evals[-1]['eval_loss']:.4f} after {recs[-1]['train_s']:.0f}s of training "
                  f"({proc['wall_s']:.0f}s wall)", flush=True)

    T, fastest, summary = compare_runs(runs, "baseline")
    out = {"variants": {}, "T_s": T, "T_variant": fastest, "seeds": seeds, "tokens": runs[VARIANTS[0]][0]["tokens"],
           "budget": {**b, "seeds": len(seeds), "tokens_per_step": tokens_per_step,
                      "precision": LEARNING_PRECISION, "threads": args.threads,
                      "eval_tokens": b["eval_steps"] * tokens_per_step},
           "model": {k: getattr(cfg.model, k) for k in ("d_model", "n_layers", "n_heads", "n_kv_heads",
                                                        "vocab_size", "nash_compression", "nash_window")},
           "data": {"dir": display_path(Path(cfg.data.dir)), "seq_len": cfg.data.seq_len,
                    "batch_size": cfg.training.batch_size,
                    "learning_rate": cfg.training.learning_rate}}
    for v in VARIANTS:
        mcfg = demo_model_config(args, **MODEL_VARIANTS[v])
        out["variants"][v] = {
            "mhc_streams": mcfg.mhc_streams, "nash_scales": mcfg.nash_scales, "nash_window": mcfg.nash_window,
            "params": NashMHC(mcfg).num_params(), **summary[v],
            "tokens_per_sec": statistics.median(r["tokens_per_sec"] for r in runs[v] if r["tokens_per_sec"]),
            "runs": runs[v],
        }
    plot_loss_curves(out, args.out / "loss_curves.png")
    out["plot"] = "loss_curves.png"
    return out


def plot_loss_curves(result: dict, path: Path) -> None:
    """Validation loss against tokens and against training time, one colour per variant, one
    line per seed; the dashed line is the equal-wall-clock time T."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_tok, ax_time) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    colors = dict(zip(VARIANTS, ("black", "tab:red", "tab:blue", "tab:green")))
    for v, res in result["variants"].items():
        for i, r in enumerate(res["runs"]):
            label = f"{v} ({res['mhc_streams']} streams, {res['nash_scales']} scales)" if i == 0 else None
            ax_tok.plot([e["tokens"] / 1e6 for e in r["eval"]], [e["val_loss"] for e in r["eval"]],
                        color=colors[v], marker="o", ms=3, lw=1.2, alpha=0.8, label=label)
            ax_time.plot([e["train_s"] for e in r["eval"]], [e["val_loss"] for e in r["eval"]],
                         color=colors[v], marker="o", ms=3, lw=1.2, alpha=0.8)
    ax_time.axvline(result["T_s"], color="grey", ls="--", lw=1)
    ax_time.annotate(f" T = {result['T_s']:.0f}s", (result["T_s"], 0.98), xycoords=("data", "axes fraction"),
                     va="top", fontsize=8, color="grey")
    ax_tok.set_xlabel("training tokens (M)")
    ax_time.set_xlabel("training time (s, evaluations excluded)")
    ax_tok.set_ylabel("validation loss")
    for ax in (ax_tok, ax_time):
        ax.grid(alpha=0.3)
    ax_tok.legend(fontsize=8)
    m = result["model"]
    fig.suptitle(f"demo shape (d_model {m['d_model']}, {m['n_layers']} layers) on {result['data']['dir']}, "
                 f"{result['budget']['precision']}, {len(result['seeds'])} seed(s): one line per run", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    os.close(fd)
    try:
        fig.savefig(tmp, format="png", dpi=110)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.unlink(tmp)


# ----------------------------------------------------------------------------------------------
# 2. Speed

def speed(args, budget: dict) -> dict:
    import torch

    demo = demo_model_config(args)
    rows = []
    for seq, batch in budget["shapes"]:
        # the snapshot's whole model section (streams, scales, window, mHC-lite, ...), as the
        # learning section trains it; the variants take their settings away from it
        ns = argparse.Namespace(variants=list(VARIANTS), base_model={**demo.to_dict(), "max_seq_len": seq},
                                vocab=demo.vocab_size, d_model=demo.d_model, n_layers=demo.n_layers,
                                n_heads=demo.n_heads, n_kv_heads=demo.n_kv_heads, batch=batch, seq=seq,
                                warmup=budget["warmup"], repeats=budget["repeats"])
        print(f"  speed: CPU, seq {seq} x batch {batch} ...", flush=True)
        res = time_variants(ns)
        ref = res["baseline"]
        for v in VARIANTS:
            r = res[v]
            rows.append({"variant": v, "seq": seq, "batch": batch, "params": r["params"], "step_s": r["wall_s"],
                         "cpu_s": r["cpu_s"], "tokens_per_sec": batch * seq / r["wall_s"],
                         "x_baseline_wall": r["wall_s"] / ref["wall_s"], "x_baseline_cpu": r["cpu_s"] / ref["cpu_s"]})
    out = {"cpu": {"rows": rows, "step": "forward+backward (bench/model.py time_variants), fp32",
                   "threads": args.threads, "warmup": budget["warmup"], "repeats": budget["repeats"],
                   "model": {k: getattr(demo, k) for k in ("d_model", "n_layers", "n_heads", "n_kv_heads",
                                                           "vocab_size")}}}
    if torch.cuda.is_available():
        print(f"  speed: GPU ({torch.cuda.get_device_name(0)}) ...", flush=True)
        out["gpu"] = gpu_speed(budget)
    else:
        out["gpu"] = {"measured": False, "reason": "no GPU (torch.cuda.is_available() is False)",
                      "seqs": budget["gpu_seqs"]}
    return out


def small_gpu_base() -> tuple[dict, str]:
    from model import load_model_config

    if SMALL_GPU_CONFIG.is_file():
        return load_model_config(str(SMALL_GPU_CONFIG)).to_dict(), str(SMALL_GPU_CONFIG.relative_to(ROOT))
    return dict(SMALL_GPU), "bench/run.py SMALL_GPU (configs/small_gpu.yaml does not exist)"


def train_step(backend, cfg, mcfg, batch: int, seq: int, amp, prepared=None):
    """One model built and placed as train.py does (``backend.prepare_model``: compiled per
    ``cfg.training.compile``) and its full training step on one random batch (forward under
    ``amp`` autocast, backward, clipping, the optimiser's update): (step, the unwrapped model).
    ``prepared(model)`` may change the model after its placement."""
    import torch
    from model import NashMHC
    from training.optim import build_optimizer

    torch.manual_seed(0)
    raw = NashMHC(mcfg)
    model = backend.prepare_model(raw, cfg)
    if prepared:
        prepared(raw)
    opt = build_optimizer(raw, cfg.training, backend.adamw_factory())
    params = [p for p in raw.parameters() if p.requires_grad]
    x, y = (torch.randint(0, mcfg.vocab_size, (batch, seq), device=backend.device) for _ in range(2))

    def step():
        with backend.autocast(amp):
            loss = model(x, y).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.training.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, raw


def time_train_steps(model_cfgs: dict, batch: int, seq: int, device: str, precision: str, compile: bool,
                     warmup: int, repeats: int, prepared=None) -> dict:
    """Full training steps (forward, backward, clipping, fused AdamW) of several models, built and
    placed as train.py does (TorchBackend), timed interleaved. Returns per model: step seconds,
    tokens/s, FLOPs per token, MFU (where the device's peak is known), or the error that stopped it.
    ``prepared(name, model)``, if given, may change each model after train.py's placement (a
    before/after comparison of one of its steps)."""
    import functools

    import torch
    from training.backend import TorchBackend
    from training.config import Config

    cfg = Config()
    backend = TorchBackend(device, cpu_malloc=cfg.training.cpu_malloc)
    cfg.training.compile = compile
    many_compiled_variants()   # each model, and each earlier call here (4 variants x 3 lengths)
    amp = backend.autocast_dtype(precision)
    on_cuda = backend.device.type == "cuda"
    sync = torch.cuda.synchronize if on_cuda else None
    peak = backend.peak_flops(precision if amp else "fp32")
    fns, out = {}, {}
    for name, mcfg in model_cfgs.items():
        step, raw = train_step(backend, cfg, mcfg, batch, seq, amp, prepared and functools.partial(prepared, name))
        fpt = raw.flops_per_token(seq)
        out[name] = {"params": raw.num_params(), "flops_per_token": fpt}
        try:
            for _ in range(warmup):  # compilation, lazy optimiser state
                step()
            if sync:
                sync()
        except torch.cuda.OutOfMemoryError:
            out[name]["error"] = f"out of memory at batch {batch} x seq {seq}"
            del raw, step
            torch.cuda.empty_cache()
            continue
        fns[name] = step
    for name, r in interleaved(fns, 0, repeats, sync).items():
        tps = batch * seq / r["wall_s"]
        out[name].update(step_s=r["wall_s"], tokens_per_sec=tps,
                         mfu=tps * out[name]["flops_per_token"] / peak if peak else None)
    return {"device": backend.device_name(), "peak_flops": peak, "precision": precision if amp else "fp32",
            "compile": compile and on_cuda, "batch": batch, "seq": seq, "models": out}


def gpu_speed(budget: dict) -> dict:
    from model import ModelConfig

    base, source = small_gpu_base()
    base["max_seq_len"] = max(base["max_seq_len"], *budget["gpu_seqs"])
    shapes = []
    for seq in budget["gpu_seqs"]:
        batch = max(1, budget["gpu_tokens"] // seq)
        cfgs = {v: ModelConfig(**{**base, **MODEL_VARIANTS[v]}) for v in VARIANTS}
        res = time_train_steps(cfgs, batch, seq, "cuda", "bf16", True, budget["gpu_warmup"], budget["gpu_repeats"])
        ref = res["models"]["baseline"]
        for v, r in res["models"].items():
            if "step_s" in r and "step_s" in ref:
                r["x_baseline"] = r["step_s"] / ref["step_s"]
        shapes.append(res)
    return {"measured": True, "model_source": source, "model": base, "shapes": shapes,
            "step": "forward+backward+clip+fused AdamW, bf16 autocast, torch.compile",
            "mfu_target": 0.40, "target_seq": 1024 if 1024 in budget["gpu_seqs"] else budget["gpu_seqs"][0]}


# ----------------------------------------------------------------------------------------------
# 3. Attention cost against length

def attention(args, budget: dict) -> dict:
    import torch
    from model import ModelConfig, NashAttention, attention_masks, rope_tables

    b = budget
    kinds = {"full": dict(nash_scales=1, nash_window=0),
             "nash": dict(nash_scales=3, nash_compression=4, nash_window=b["window"])}
    rows = []
    for T in b["lengths"]:
        fns = {}
        for kind, over in kinds.items():
            cfg = ModelConfig(d_model=b["d_model"], n_heads=b["n_heads"], n_kv_heads=b["n_kv_heads"],
                              max_seq_len=max(b["lengths"]), **over)
            torch.manual_seed(0)
            module = NashAttention(cfg)
            module.reset_parameters()  # the temperatures (torch.empty until then)
            cos, sin = rope_tables(cfg.head_dim, T, cfg.rope_theta)
            masks = attention_masks(cfg, T)  # as in the model: once per forward, for all its layers
            x = torch.randn(1, T, cfg.d_model, requires_grad=True)
            g = torch.randn(1, T, cfg.d_model)

            def step(module=module, x=x, g=g, cos=cos, sin=sin, masks=masks):
                out, _ = module(x, cos, sin, masks)
                out.backward(g)
                module.zero_grad(set_to_none=True)
                x.grad = None

            fns[kind] = step
        print(f"  attention: T = {T} ...", flush=True)
        res = interleaved(fns, b["warmup"], b["repeats"])
        rows.append({"T": T, "full_s": res["full"]["wall_s"], "nash_s": res["nash"]["wall_s"],
                     "full_cpu_s": res["full"]["cpu_s"], "nash_cpu_s": res["nash"]["cpu_s"],
                     "ratio": res["nash"]["wall_s"] / res["full"]["wall_s"]})
    cross = crossover([r["T"] for r in rows], [r["ratio"] for r in rows])
    return {"rows": rows, "crossover": cross, "threads": args.threads, "warmup": b["warmup"], "repeats": b["repeats"],
            "config": {"d_model": b["d_model"], "n_heads": b["n_heads"], "n_kv_heads": b["n_kv_heads"], "batch": 1,
                       "nash": "3 scales, compression 4, window %d" % b["window"], "full": "1 scale, no window"}}


# ----------------------------------------------------------------------------------------------
# 4. Data

def data(args, budget: dict) -> dict:
    from training.data import DataStream, TokenWindows

    cfg = demo_config(args)
    batch, seq, workers = cfg.training.batch_size, cfg.data.seq_len, cfg.data.num_workers
    ds = TokenWindows(cfg.data.dir, "train", seq)
    rates, firsts = [], []
    print(f"  data: loader, batch {batch} x seq {seq}, {workers} worker(s) ...", flush=True)
    for rep in range(budget["repeats"]):
        stream = DataStream(ds, batch, 1, 0, cfg.training.seed + rep, num_workers=workers)
        t0 = time.perf_counter()
        next(stream)                      # the worker's start-up and its first batch
        t1 = time.perf_counter()
        for _ in range(budget["batches"]):
            next(stream)
        rates.append(budget["batches"] * batch * seq / (time.perf_counter() - t1))
        firsts.append(t1 - t0)
        del stream
    print("  data: a short train.py demo run for the model's consumption ...", flush=True)
    run_dir = args.out / "runs" / "data-consumption"
    n, li = budget["consume_steps"], budget["consume_log_interval"]
    run_trainer("train.py", args.config, [f"training.max_steps={n}", "training.total_tokens=null",
                                          f"logging.interval={li}", f"training.precision={LEARNING_PRECISION}",
                                          "training.device=cpu", "evaluation.interval=0", "evaluation.steps=1"],
                run_dir, child_env(args.threads), timeout=args.run_timeout)
    recs = read_metrics(run_dir)
    steady = [r["tokens_per_sec"] for r in recs[1:] if "eval_loss" not in r and "tokens_per_sec" in r]
    if not steady:
        raise BenchError(f"{run_dir}/metrics.jsonl: no steady interval to read tokens/s from")
    consume = statistics.median(steady)
    loader = statistics.median(rates)
    return {"loader_tokens_per_sec": loader, "loader_all": rates, "first_batch_s": statistics.median(firsts),
            "model_tokens_per_sec": consume, "ratio": loader / consume, "target": 10.0,
            "batch": batch, "seq_len": seq, "num_workers": workers, "batches": budget["batches"],
            "repeats": budget["repeats"], "model_run": {"steps": n, "precision": LEARNING_PRECISION,
                                                        "dir": str(run_dir.relative_to(args.out))}}


# ----------------------------------------------------------------------------------------------
# 5. XLA health

def xla(args, budget: dict) -> dict:
    run_dir = args.out / "runs" / "xla"
    n, li = budget["max_steps"], budget["log_interval"]
    env = child_env(args.threads, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="1")
    print(f"  xla: train_xla.py demo, {n} steps on PJRT CPU ...", flush=True)
    proc = run_trainer("train_xla.py", args.config,
                       [f"training.max_steps={n}", "training.total_tokens=null", f"logging.interval={li}",
                        "evaluation.interval=0", "evaluation.steps=2", "xla.compile_cache=", "xla.mode=ddp",
                        *budget["overrides"]],
                       run_dir, env, timeout=args.run_timeout)
    recs = [r for r in read_metrics(run_dir) if "xla_compilations" in r]
    # Steady window: from the second logged step (the training graph is compiled by then) to the
    # last one before the final step (which adds the evaluation graph).
    window = [r for r in recs if r["step"] < n][1:]
    if len(window) < 2:
        raise BenchError(f"{run_dir}/metrics.jsonl: fewer than two steady log lines (need max_steps >= 4 x interval)")
    a, b = window[0], window[-1]
    per10 = {k: (b[f"xla_{k}"] - a[f"xla_{k}"]) * 10 / (b["step"] - a["step"])
             for k in ("compilations", "transfers")}
    # values reach the host at log steps only: transfers per log line, whatever the interval
    per_log = (b["xla_transfers"] - a["xla_transfers"]) / (len(window) - 1)
    totals = json.loads((run_dir / "xla_metrics.json").read_text())
    return {"steps": [a["step"], b["step"]], "per_10_steps": per10, "transfers_per_log_line": per_log,
            "cpu_fallback_ops": {"at": [a["xla_cpu_fallbacks"], b["xla_cpu_fallbacks"]]},
            "warmup_compilations": recs[0]["xla_compilations"], "warmup_step": recs[0]["step"],
            "totals": totals, "max_steps": n, "log_interval": li, "overrides": budget["overrides"],
            "precision": demo_config(args).training.precision, "wall_s": proc["wall_s"],
            "steady_step_s": statistics.median(r["step_time"] for r in window[1:]),
            "dir": str(run_dir.relative_to(args.out)), **xla_at_scale(args, budget)}


# Issue 12's figures, each in its own function: compiled graphs by accumulation, log interval and
# mode; host time of log steps against the others; compile time and HLO size by depth, scanned
# or unrolled.

XLA_FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def xla_at_scale(args, budget: dict) -> dict:
    return {"graphs": xla_graphs(args, budget), "log_steps": xla_log_steps(args, budget),
            "accumulation": xla_accumulation(args, budget), "compile": xla_compile(args, budget)}


def xla_child(args, what: str, overrides: list[str], env: dict, timeout: float, extra=()) -> dict:
    """``bench/xla.py WHAT`` on the demo config snapshot; the JSON of its RESULT line."""
    cmd = [sys.executable, str(ROOT / "bench" / "xla.py"), what, str(args.config), *overrides, *extra]
    try:
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise BenchError(f"bench/xla.py {what} ran over {timeout:.0f}s") from None
    lines = [line for line in r.stdout.splitlines() if line.startswith("RESULT ")]
    if r.returncode != 0 or not lines:
        tail = (r.stderr.strip().splitlines() or [""])[-1]
        raise BenchError(f"bench/xla.py {what} {' '.join(overrides)} exited with {r.returncode}: {tail}")
    return json.loads(lines[-1][len("RESULT "):])


def xla_graphs(args, budget: dict) -> dict:
    """train_xla.py runs that differ only in accumulation, log interval and mode (ddp on one
    device; spmd on a 2 x 2 mesh of 4 CPU devices): compilations by the first log line, any added
    in the steady window up to the step before the last (which adds the evaluation graphs), run
    totals, and device-to-host transfers per log line. LLVM at -O0: counts, not compile times."""
    longest = max(li for _, li in budget["graph_settings"])
    steps = 2 * longest + 1
    rows = []
    for mode in budget["graph_modes"]:
        for acc, li in budget["graph_settings"]:
            run_dir = args.out / "runs" / f"xla_graphs_{mode}_a{acc}_i{li}"
            print(f"  xla graphs: {mode}, accumulation {acc}, log interval {li} ...", flush=True)
            env = child_env(args.threads, PJRT_DEVICE="CPU", XLA_FLAGS=XLA_FAST_COMPILE,
                            CPU_NUM_DEVICES="4" if mode == "spmd" else "1")
            over = [*budget["overrides"], f"training.max_steps={steps}", "training.total_tokens=null",
                    f"logging.interval={li}", f"training.gradient_accumulation_steps={acc}",
                    f"model.n_layers={budget['graph_layers']}",
                    "evaluation.interval=0", "evaluation.steps=2", "xla.compile_cache=", f"xla.mode={mode}"]
            if mode == "spmd":
                over += ["xla.mesh.data=2", "xla.mesh.fsdp=2"]
            run_trainer("train_xla.py", args.config, over, run_dir, env, timeout=args.run_timeout)
            recs = [r for r in read_metrics(run_dir) if "xla_compilations" in r]
            steady = [r for r in recs if r["step"] < steps]
            totals = json.loads((run_dir / "xla_metrics.json").read_text())
            rows.append({"mode": mode, "accumulation": acc, "log_interval": li,
                         "by_first_line": steady[0]["xla_compilations"],
                         "added_after": steady[-1]["xla_compilations"] - steady[0]["xla_compilations"],
                         "total": totals["compilations"],
                         "transfers_per_line": (steady[-1]["xla_transfers"] - steady[0]["xla_transfers"])
                         / max(1, len(steady) - 1)})
    return {"steps": steps, "n_layers": budget["graph_layers"], "rows": rows}


def xla_log_steps(args, budget: dict) -> dict:
    """Host time of each step of the real Trainer (bench/xla.py steps): log steps against the
    others, with asynchronous step closures (train_xla.py) and synchronous ones (torch_xla's
    default, what it used before), runs interleaved. The first log interval (compilation) and the
    last step (final evaluation) are left out."""
    n, li = budget["log_steps"], budget["log_interval_steps"]
    env = child_env(args.threads, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="1")
    runs = {"async": [], "sync": []}
    for rep in range(budget["log_repeats"]):
        for closures in runs:
            print(f"  xla log steps: {closures} closures, {n} steps, log every {li} (round {rep + 1}) ...",
                  flush=True)
            run_dir = args.out / "runs" / f"xla_log_steps_{closures}"
            if run_dir.exists():
                shutil.rmtree(run_dir)
            over = [*budget["overrides"], f"training.max_steps={n}", "training.total_tokens=null",
                    f"logging.interval={li}", "evaluation.interval=0", "evaluation.steps=2", "xla.compile_cache=",
                    "xla.mode=ddp", f"checkpoint.dir={run_dir}", "checkpoint.interval=0", "checkpoint.resume=none",
                    "logging.progress_bar=false", "logging.tensorboard=false"]
            runs[closures].append(xla_child(args, "steps", over, env, args.run_timeout,
                                             extra=["--closures", closures]))
    out = {"steps": n, "log_interval": li, "repeats": budget["log_repeats"]}
    for closures, results in runs.items():
        log_s, other_s, per_line = [], [], []
        for res in results:
            for i, dt in enumerate(res["step_s"][li:n - 1], start=li + 1):  # step numbers
                (log_s if i % li == 0 else other_s).append(dt)
            t = res["transfers"]
            per_line.append((t[-2][1] - t[0][1]) / max(1, len(t) - 2))
        out[closures] = {"log_step_s": statistics.median(log_s), "other_step_s": statistics.median(other_s),
                         "ratio": statistics.median(log_s) / statistics.median(other_s),
                         "transfers_per_line": statistics.median(per_line)}
    return out


def xla_accumulation(args, budget: dict) -> dict:
    """Gradient accumulation three ways (bench/xla.py accumulation): the loop before issue 12,
    train_xla.py's, and torch_xla's experimental.gradient_accumulation; accumulation 1 and 4,
    demo shape with ``accum_layers`` blocks and micro-batches of ``accum_batch``. Compilations
    over the run and the median host time per step after 3 steps."""
    env = child_env(args.threads, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="1")
    rows = []
    for accum in (1, 4):
        for scheme in ("before", "train_xla", "gradient_accumulation"):
            print(f"  xla accumulation: {scheme}, {accum} micro-step(s) ...", flush=True)
            over = [*budget["overrides"], f"model.n_layers={budget['accum_layers']}",
                    f"training.batch_size={budget['accum_batch']}",
                    f"training.gradient_accumulation_steps={accum}", "xla.mode=ddp", "xla.compile_cache="]
            res = xla_child(args, "accumulation", over, env, args.run_timeout,
                            extra=["--scheme", scheme, "--steps", str(budget["accum_steps"])])
            rows.append({"scheme": scheme, "accumulation": accum, "compilations": res["compilations"][-1],
                         "after_first_step": res["compilations"][-1] - res["compilations"][0],
                         "step_s": res["step_s"], "first_losses": res["losses"][:3]})
    return {"n_layers": budget["accum_layers"], "batch": budget["accum_batch"], "steps": budget["accum_steps"],
            "rows": rows}


def xla_compile(args, budget: dict) -> dict:
    """The training step's model graph (forward and backward of one micro-batch) at each depth,
    unrolled and scanned (``xla.scan_layers``): HLO lines and XLA compile time, the median of
    ``compile_repeats`` fresh processes, interleaved. Demo shape at width ``compile_d_model``."""
    d = budget["compile_d_model"]
    env = child_env(args.threads, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="1")
    samples: dict[tuple, list[dict]] = {}
    for rep in range(budget["compile_repeats"]):
        for layers in budget["compile_layers"]:
            for scan in (False, True):
                print(f"  xla compile: {layers} layers, {'scanned' if scan else 'unrolled'} (round {rep + 1}) ...",
                      flush=True)
                over = [*budget["overrides"], f"model.n_layers={layers}", f"model.d_model={d}", "xla.mode=ddp",
                        "xla.compile_cache=", f"xla.scan_layers={'true' if scan else 'false'}"]
                samples.setdefault((layers, scan), []).append(
                    xla_child(args, "compile", over, env, args.run_timeout))
    rows = []
    for (layers, scan), res in sorted(samples.items()):
        rows.append({"n_layers": layers, "scan": scan, "hlo_lines": res[0]["hlo_lines"],
                     "compile_s": statistics.median(r["compile_s"] for r in res),
                     "all_compile_s": [r["compile_s"] for r in res],
                     "trace_s": statistics.median(r["trace_s"] for r in res)})
    lo, hi = min(budget["compile_layers"]), max(budget["compile_layers"])
    per_layer = {}
    for scan in (False, True):
        a = next(r for r in rows if r["n_layers"] == lo and r["scan"] == scan)
        b = next(r for r in rows if r["n_layers"] == hi and r["scan"] == scan)
        per_layer["scan" if scan else "unrolled"] = {
            "compile_s": (b["compile_s"] - a["compile_s"]) / (hi - lo),
            "hlo_lines": (b["hlo_lines"] - a["hlo_lines"]) / (hi - lo)}
    return {"d_model": d, "repeats": budget["compile_repeats"], "rows": rows, "per_layer": per_layer}


# ----------------------------------------------------------------------------------------------
# The report

def machine_info() -> dict:
    cpu = platform.processor() or platform.machine()
    mem = None
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
        with open("/proc/meminfo") as f:
            mem = next((int(line.split()[1]) / 2**20 for line in f if line.startswith("MemTotal")), None)
    except OSError:
        pass

    def version(pkg):
        try:
            return importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    def git(*a):
        r = subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else ""

    import torch

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(mem, 1) if mem else None,
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "python": platform.python_version(), "torch": version("torch"), "torch_xla": version("torch_xla"),
            "os": platform.platform(),
            "git_commit": commit + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")}


def _ms(s: float) -> str:
    return f"{s * 1e3:,.1f}"


def _pm(d: dict | None, digits: int = 3, signed: bool = False) -> str:
    if not d:
        return "-"
    sign = "+" if signed else ""
    return f"{d['mean']:{sign}.{digits}f} ± {d['sd']:.{digits}f}"


def render_markdown(report: dict) -> str:
    m = report["machine"]
    L = [f"# Nash-MHC benchmarks{' (--quick: smoke-test budgets, not results)' if report.get('quick') else ''}",
         "",
         f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB"
         f"{', GPU ' + m['gpu'] if m['gpu'] else ', no GPU'}; Python {m['python']}, torch {m['torch']}, "
         f"torch_xla {m['torch_xla']}; commit {m['git_commit']}.  ",
         f"Run: `{report['command']}` on {report['date']}, {report['wall_s'] / 60:.1f} min; load average "
         f"{report['load_start']:.2f} at the start, {report['load_end']:.2f} at the end (other work on the "
         "machine shows up as load above the benchmark's own ~1).",
         ""]
    s = report["sections"]
    for name in SECTIONS:
        if name not in s:
            continue
        sec = s[name]
        L += [f"## {SECTION_TITLES[name]}", ""]
        if "error" in sec:
            L += [f"Not measured: {sec['error']}", ""]
            continue
        meta = sec["_meta"]
        try:
            L += RENDER[name](sec)
        except (KeyError, TypeError, IndexError, ValueError) as e:  # kept by --only from an older bench/run.py
            L += [f"Not shown: a result of an older bench/run.py ({type(e).__name__}: {e}); re-run it with "
                  f"`--only {name}`", ""]
        L += ["", f"<sub>measured {meta['date']} at commit {meta.get('commit', '?')}, {meta['wall_s']:.0f}s, load "
                  f"average {meta['load_start']:.2f} → {meta['load_end']:.2f}"
                  f"{', --quick budgets' if meta['quick'] else ''}</sub>", ""]
    return "\n".join(L).rstrip() + "\n"


def render_learning(r: dict) -> list[str]:
    b, md, d = r["budget"], r["model"], r["data"]
    L = [f"train.py on the CPU ({b['precision']}, {b['threads']} thread(s)), demo shape (d_model {md['d_model']}, "
         f"{md['n_layers']} layers, {md['n_heads']} heads / {md['n_kv_heads']} kv, vocab {md['vocab_size']}), "
         f"batch {d['batch_size']} x seq {d['seq_len']}, lr {d['learning_rate']}, {b['max_steps']} steps "
         f"({r['tokens']:,} tokens, warmup {b['warmup_steps']}) on `{d['dir']}`; validation every "
         f"{b['eval_interval']} steps on the same {b['eval_tokens']:,} tokens; seeds {', '.join(map(str, r['seeds']))}. "
         f"Mean ± sd over seeds; Δ: paired by seed against the baseline (negative = better). Equal wall-clock: "
         f"T = {r['T_s']:.0f}s, the median training time of the fastest variant ({r['T_variant']}), evaluations "
         "excluded; each run's validation curve is read at T.",
         "",
         "| variant | streams | scales | window | params | val loss @ equal tokens | Δ vs baseline | "
         "train time | tokens/s | val loss @ T | Δ vs baseline @ T |",
         "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for v, x in r["variants"].items():
        ended = f" ({x['ended_before_T']} run(s) ended before T)" if x["ended_before_T"] else ""
        ref = "(reference)" if v == "baseline" else ""
        L.append(f"| {v} | {x['mhc_streams']} | {x['nash_scales']} | {x['nash_window'] or 'none'} | "
                 f"{x['params']:,} | {_pm(x['final_val_loss'])} | {ref or _pm(x['delta_final'], signed=True)} | "
                 f"{x['train_s']:.0f}s | {x['tokens_per_sec']:,.0f} | {_pm(x['val_loss_at_T'])}{ended} | "
                 f"{ref or _pm(x['delta_at_T'], signed=True)} |")
    L += ["", f"Loss curves: `{r['plot']}`. Windows apply to the full-resolution scale; 'none' is full causal attention."]
    return L


def render_speed(r: dict) -> list[str]:
    c = r["cpu"]
    md = c["model"]
    L = [f"CPU, {c['step']}, {c['threads']} thread(s), demo shape (d_model {md['d_model']}, {md['n_layers']} layers, "
         f"vocab {md['vocab_size']}); median of {c['repeats']} interleaved rounds after {c['warmup']} warm-up.",
         "",
         "| variant | seq x batch | params | step (ms) | tokens/s | × baseline (wall) | × baseline (CPU time) |",
         "|---|---|---:|---:|---:|---:|---:|"]
    for x in c["rows"]:
        L.append(f"| {x['variant']} | {x['seq']} x {x['batch']} | {x['params']:,} | {_ms(x['step_s'])} | "
                 f"{x['tokens_per_sec']:,.0f} | {x['x_baseline_wall']:.2f} | {x['x_baseline_cpu']:.2f} |")
    g = r["gpu"]
    L += ["", "GPU (~125M shape, bf16, torch.compile, full training step):", ""]
    if not g.get("measured"):
        L += ["| variant | seq x batch | step (ms) | tokens/s | MFU | × baseline |", "|---|---|---:|---:|---:|---:|"]
        seqs = ", ".join(map(str, g.get("seqs", [])))   # the budget's lengths (absent in older reports)
        L += [f"| {v} | {seqs} | not measured (no GPU) | | | |" for v in VARIANTS]
        return L
    gm = g["model"]
    L.insert(-1, f"Model from {g['model_source']}: d_model {gm['d_model']}, {gm['n_layers']} layers, "
                 f"{gm['n_heads']} heads, vocab {gm['vocab_size']}, window {gm['nash_window']}; {g['step']}; "
                 f"MFU = tokens/s x flops_per_token / dense bf16 peak (target ≥ {g['mfu_target']:.0%} for the baseline "
                 f"at seq {g['target_seq']}).\n")
    L += ["| variant | seq x batch | params | step (ms) | tokens/s | MFU | × baseline |", "|---|---|---:|---:|---:|---:|---:|"]
    for sh in g["shapes"]:
        for v, x in sh["models"].items():
            if "error" in x:
                L.append(f"| {v} | {sh['seq']} x {sh['batch']} | {x['params']:,} | {x['error']} | | | |")
                continue
            mfu = f"{x['mfu']:.1%}" if x.get("mfu") is not None else "peak unknown"
            xb = f"{x['x_baseline']:.2f}" if "x_baseline" in x else "-"
            L.append(f"| {v} | {sh['seq']} x {sh['batch']} | {x['params']:,} | {_ms(x['step_s'])} | "
                     f"{x['tokens_per_sec']:,.0f} | {mfu} | {xb} |")
    L.append(f"\nDevice: {g['shapes'][0]['device']}, peak {g['shapes'][0]['peak_flops'] or 0:.3g} FLOP/s.")
    return L


def render_attention(r: dict) -> list[str]:
    c = r["config"]
    L = [f"One attention module, forward+backward, batch 1, d_model {c['d_model']}, {c['n_heads']} heads / "
         f"{c['n_kv_heads']} kv; Nash: {c['nash']}; full: {c['full']}; {r['threads']} thread(s), median of "
         f"{r['repeats']} interleaved rounds after {r['warmup']} warm-up.",
         "",
         "| T | full causal (ms) | Nash windowed (ms) | Nash / full |",
         "|---:|---:|---:|---:|"]
    for x in r["rows"]:
        L.append(f"| {x['T']} | {_ms(x['full_s'])} | {_ms(x['nash_s'])} | {x['ratio']:.2f} |")
    cr = r["crossover"]
    if cr["length"] is None:
        L += ["", f"Nash is cheaper: not within {r['rows'][-1]['T']}."]
    else:
        est = f" (the ratio crosses 1 near T ≈ {cr['estimate']:.0f}, log-linear between measured lengths)" \
            if cr["estimate"] else ""
        L += ["", f"Nash is cheaper from T = {cr['length']} on, at every measured length{est}."]
    return L


def render_data(r: dict) -> list[str]:
    ok = "yes" if r["ratio"] >= r["target"] else "**no**"
    return [f"Loader: TokenWindows + DataStream, batch {r['batch']} x seq {r['seq_len']}, {r['num_workers']} "
            f"worker(s), {r['batches']} batches after the first (median of {r['repeats']}); consumption: a "
            f"{r['model_run']['steps']}-step train.py demo run ({r['model_run']['precision']}, nash-mhc), median "
            "tokens/s after the first log interval.",
            "",
            "| loader tokens/s | first batch | demo model tokens/s | loader / model | ≥ 10x |",
            "|---:|---:|---:|---:|---|",
            f"| {r['loader_tokens_per_sec']:,.0f} | {r['first_batch_s'] * 1e3:,.0f} ms | "
            f"{r['model_tokens_per_sec']:,.0f} | {r['ratio']:,.0f}x | {ok} |"]


def render_xla(r: dict) -> list[str]:
    t = r["totals"]
    ops = ", ".join(f"{k} x{v}" for k, v in t["fallback_ops"].items()) or "none"
    a, b = r["steps"]
    over = f", overrides {' '.join(r['overrides'])}" if r["overrides"] else ""
    steady = f"{r['steady_step_s']:.2f}s"
    return [f"`train_xla.py configs/demo.yaml` on PJRT CPU, 1 device, {r['precision']}, {r['max_steps']} steps, "
            f"logged every {r['log_interval']}{over}; per 10 steps = counter difference between steps {a} and {b}, "
            f"scaled to 10 steps.",
            "",
            f"| compilations / 10 steps | CPU fallback ops (step {a} → {b}) | device-to-host transfers / 10 steps "
            f"(per log line) | compilations by step {r['warmup_step']} | run total: compilations, transfers, "
            "executions | fallback ops | steady step |",
            "|---:|---:|---:|---:|---:|---|---:|",
            f"| {r['per_10_steps']['compilations']:g} | {r['cpu_fallback_ops']['at'][0]} → "
            f"{r['cpu_fallback_ops']['at'][1]} | {r['per_10_steps']['transfers']:g} "
            f"({r['transfers_per_log_line']:g}) | {r['warmup_compilations']} | "
            f"{t['compilations']}, {t['device_to_host_transfers']}, {t['executions']} | {ops} | {steady} |",
            *render_xla_at_scale(r)]


def render_xla_at_scale(r: dict) -> list[str]:
    if "graphs" not in r:
        return []
    g, ls, c = r["graphs"], r["log_steps"], r["compile"]
    L = ["", f"Compiled graphs of `train_xla.py` runs that differ only in accumulation, log interval and mode "
             f"({g['n_layers']} layer(s), {g['steps']} steps, evaluation at the last step; spmd: 2 x 2 mesh of 4 "
             "CPU devices). Steady window: first log line to the one before the last step.",
         "",
         "| mode | accumulation | log interval | compilations by the first log line | added in the steady "
         "window | run total (with evaluation) | transfers per log line |",
         "|---|---:|---:|---:|---:|---:|---:|"]
    L += [f"| {x['mode']} | {x['accumulation']} | {x['log_interval']} | {x['by_first_line']} | {x['added_after']} | "
          f"{x['total']} | {x['transfers_per_line']:g} |" for x in g["rows"]]
    L += ["", f"Host time per step of the Trainer, {ls['steps']} steps logged every {ls['log_interval']} "
              f"(median over {ls['repeats']} run(s) each, first interval and last step left out):", "",
          "| step closures | log steps | other steps | log / other | transfers per log line |",
          "|---|---:|---:|---:|---:|"]
    for k, name in (("async", "asynchronous (train_xla.py)"), ("sync", "synchronous (before)")):
        x = ls[k]
        L.append(f"| {name} | {_ms(x['log_step_s'])} ms | {_ms(x['other_step_s'])} ms | {x['ratio']:.2f} | "
                 f"{x['transfers_per_line']:g} |")
    a = r["accumulation"]
    L += ["", f"Gradient accumulation three ways, demo shape with {a['n_layers']} layer(s), micro-batch "
              f"{a['batch']}, {a['steps']} steps (compilations include the set-up graph; step time: median host "
              "time per step after 3 steps):", "",
          "| scheme | accumulation | compilations | of which after step 1 | step |", "|---|---:|---:|---:|---:|"]
    names = {"before": "before (gradients from None, no cut)", "train_xla": "train_xla.py (kept buffers, update "
             "graph)", "gradient_accumulation": "torch_xla gradient_accumulation (While loop)"}
    L += [f"| {names[x['scheme']]} | {x['accumulation']} | {x['compilations']} | {x['after_first_step']} | "
          f"{_ms(x['step_s'])} ms |" for x in a["rows"]]
    L += ["", f"The training step's model graph (forward + backward, one micro-batch) by depth, demo shape at "
              f"d_model {c['d_model']}; compile time: median of {c['repeats']} fresh process(es).", "",
          "| layers | unrolled: HLO lines | unrolled: compile | scanned: HLO lines | scanned: compile |",
          "|---:|---:|---:|---:|---:|"]
    by = {(x["n_layers"], x["scan"]): x for x in c["rows"]}
    for layers in sorted({x["n_layers"] for x in c["rows"]}):
        u, s_ = by[(layers, False)], by[(layers, True)]
        L.append(f"| {layers} | {u['hlo_lines']:,} | {u['compile_s']:.1f} s | {s_['hlo_lines']:,} | "
                 f"{s_['compile_s']:.1f} s |")
    pl = c["per_layer"]
    L.append(f"| per layer | {pl['unrolled']['hlo_lines']:,.0f} | {pl['unrolled']['compile_s']:.2f} s | "
             f"{pl['scan']['hlo_lines']:,.0f} | {pl['scan']['compile_s']:.2f} s |")
    return L


SECTION_TITLES = {"learning": "1. Learning: validation loss at equal tokens and equal wall-clock",
                  "speed": "2. Speed: step time and tokens/s",
                  "attention": "3. Attention cost against sequence length",
                  "data": "4. Data: loader throughput against the model's consumption",
                  "xla": "5. XLA health on PJRT CPU"}
RENDER = {"learning": render_learning, "speed": render_speed, "attention": render_attention,
          "data": render_data, "xla": render_xla}
RUNNERS = {"learning": learning, "speed": speed, "attention": attention, "data": data, "xla": xla}


def atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny budgets and one seed: a smoke test (~3-5 min on 2 cores)")
    p.add_argument("--only", metavar="SECTION[,SECTION]",
                   help="run only these sections, keeping the others from OUT/latest.json: " + ", ".join(SECTIONS))
    p.add_argument("--out", type=Path, help="results directory (default bench/results, bench/results/quick with --quick)")
    p.add_argument("--data", type=Path, default=ROOT / "data" / "stdlib", help="prepared data directory (default data/stdlib)")
    p.add_argument("--seeds", type=int, help="learning: seeds per variant (default 3, 1 with --quick)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads for every CPU measurement (default 1)")
    p.add_argument("--run-timeout", type=float, default=1800, help="seconds before a training subprocess is killed")
    args = p.parse_args(argv)
    if args.only is None:
        args.sections = list(SECTIONS)
    else:
        args.sections = [s.strip() for s in args.only.split(",") if s.strip()]
        bad = [s for s in args.sections if s not in SECTIONS]
        if bad or not args.sections:
            p.exit(2, f"{p.prog}: error: --only: unknown section {', '.join(bad) or '(none)'}; "
                      f"choose from {', '.join(SECTIONS)}\n")
    if args.threads < 1 or (args.seeds is not None and args.seeds < 1) or args.run_timeout <= 0:
        p.exit(2, f"{p.prog}: error: --threads and --seeds must be at least 1, --run-timeout positive\n")
    args.out = (args.out or ROOT / "bench" / "results" / ("quick" if args.quick else "")).resolve()
    args.data = args.data.resolve()
    if {"learning", "data", "xla"} & set(args.sections) and not (args.data / "meta.json").is_file():
        p.exit(2, f"{p.prog}: error: --data: {args.data}/meta.json not found; prepare it with "
                  "`make demo` or prepare_data.py (see README.md)\n")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch

    torch.set_num_threads(args.threads)
    budgets = BUDGETS["quick" if args.quick else "full"]
    args.out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = args.out / "latest.json", args.out / "latest.md"
    sections = {}
    if args.only is not None and json_path.is_file():
        try:
            sections = json.loads(json_path.read_text()).get("sections", {})
        except (OSError, ValueError):
            print(f"warning: {json_path} is unreadable: starting a new report", file=sys.stderr)
    command = " ".join(["bench/run.py", *(sys.argv[1:] if argv is None else argv)])
    load_start, t_start = os.getloadavg()[0], time.perf_counter()
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    args.config = snapshot_demo_config(args)
    start_commit = machine_info()["git_commit"]
    print(f"bench/run.py: sections {', '.join(args.sections)} -> {args.out} (load average {load_start:.2f})", flush=True)
    failed = []
    for name in args.sections:
        l0, t0 = os.getloadavg()[0], time.perf_counter()
        print(f"[{name}]", flush=True)
        try:
            res = RUNNERS[name](args, budgets[name])
        except Exception as e:  # one section's failure does not cost the others their results
            msg = " ".join(f"{type(e).__name__ if not isinstance(e, BenchError) else ''} {e}".split())
            print(f"  {name} failed: {msg}", file=sys.stderr, flush=True)
            res = {"error": msg}
            failed.append(name)
        res["_meta"] = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                        "wall_s": time.perf_counter() - t0, "load_start": l0, "load_end": os.getloadavg()[0],
                        "quick": args.quick, "commit": machine_info()["git_commit"],
                        "demo_config": demo_config(args).to_dict()}
        sections[name] = res
        report = {"command": command, "date": date, "quick": args.quick, "machine": machine_info(),
                  "start_commit": start_commit,
                  "wall_s": time.perf_counter() - t_start, "load_start": load_start,
                  "load_end": os.getloadavg()[0], "sections": sections}
        write_json(str(json_path), report)  # after every section: a crash later keeps what was measured
        atomic_write_text(md_path, render_markdown(report))
    print(f"\n{md_path.read_text()}")
    print(f"wrote {json_path}, {md_path}" + (f", {args.out / 'loss_curves.png'}" if "learning" in args.sections
                                             and "learning" not in failed else ""))
    if failed:
        print(f"bench/run.py: error: section(s) failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
