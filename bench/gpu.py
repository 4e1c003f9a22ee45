"""What only a CUDA GPU can show, in one call: the CUDA-only tests, train.py's real GPU path
(bf16 autocast, torch.compile, fused AdamW) on configs/small_gpu.yaml and its baseline twin, a
resume from the checkpoint it wrote, and sampling from it.

    python bench/gpu.py --data data/stdlib32k --out /tmp/gpu     # ~6 min on one H100
    python bench/gpu.py --data data/stdlib32k --only tests,nash-mhc --steps 40

--data is a prepare_data.py directory whose vocabulary fits small_gpu's 32,768 (e.g. the Python
standard library with --vocab-size 32768, 8M tokens: this script measures speed, not learning).

Stages, each a subprocess with its own time limit, in this order (a stage that fails is reported
and the others still run; the exit code is then 1):

  tests     pytest on the tests that skip without CUDA (SDPA kernels against the math path; the
            compiled regions under bf16 against eager bf16)
  nash-mhc  train.py configs/small_gpu.yaml, batch 32 x seq 1024, no accumulation, --steps steps,
            logging every 10, an evaluation and a checkpoint at --steps - 10 and at the end
  baseline  the same with configs/small_gpu_baseline.yaml (1 stream, 1 scale, full attention)
  resume    nash-mhc again, to --steps + 20: resumes from its final checkpoint (compiles again,
            from inductor's cache when it is warm)
  sample    sample.py from nash-mhc's run directory on the GPU
  variants  bench/run.py's GPU training step (time_train_steps: bf16, torch.compile, clipping,
            fused AdamW) of small_gpu's shape as baseline, nash-mhc, mhc-only, nash-only and
            baseline-window (bench/model.py VARIANTS; --variants), timed interleaved: where the cost is
  profile   torch.profiler over compiled nash-mhc and baseline training steps: GPU time per step
            by kind of kernel (matrix products, attention, inductor's fused kernels, other) and
            the kernels that take the most (with --code, inductor's source of each in profile.log)
  attention each SDPA call of small_gpu's Nash attention alone (forward + backward, bf16, batch
            --variant-batch): the window's chunks, each pooled scale, and full causal attention
            (the baseline's), as the model makes them and as flex_attention with a block mask of the
            same visibility (compiled; its backward needs a GPU): what a block-sparse kernel would
            save. On an H200 the window's flex form took 0.75 ms against the model's 1.80 (eager,
            alone), yet with it in the compiled blocks the training step did not get faster
            (README, Benchmarks 8): a call alone is not the step

Per training stage: the wall time of the process; "first log" is the time from the process's
start to its first metrics.jsonl line (start-up, data, torch.compile's warm-up and the first
10 steps); the median step time, tokens/s and MFU over the log lines after the first
(train.py's own figures: evaluation and saves are left out of its throughput), the peak memory
train.py logged, and the last validation loss. Writes OUT/gpu.json after every stage (a run cut
short keeps what it measured) and each stage's output to OUT/<stage>.log; the runs go to --runs.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script, sys.path[0] is bench/
    sys.path.insert(0, str(ROOT))
STAGES = ("tests", "nash-mhc", "baseline", "resume", "sample", "variants", "profile", "attention")
DEVICE = "cuda"   # the inner stages' device (tests/test_bench.py runs ``variants`` on "cpu")
VARIANTS = ("baseline", "nash-mhc", "mhc-only", "nash-only", "baseline-window")
EAGER_LOSS = "/eager-loss"   # a variant's suffix: the loss left eager (before compile_regions compiled it)
CONFIGS = {"nash-mhc": "configs/small_gpu.yaml", "baseline": "configs/small_gpu_baseline.yaml"}


def run_stage(name: str, cmd: list[str], out: Path, limit: float, env: dict | None = None) -> dict:
    """Run one stage's command with a time limit; its output goes to OUT/<name>.log."""
    print(f"== {name}: {' '.join(cmd)}", flush=True)
    t0 = time.time()
    with open(out / f"{name}.log", "w") as log:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=limit,
                                env={**os.environ, **(env or {})}).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    res = {"cmd": cmd, "rc": rc, "wall_s": round(time.time() - t0, 1), "start": t0}
    tail = (out / f"{name}.log").read_text(errors="replace").replace("\r", "\n").strip().splitlines()[-3:]
    print(f"   rc {rc}, {res['wall_s']} s: " + " | ".join(tail), flush=True)
    return res


def train_cmd(config: str, data: Path, run_dir: Path, steps: int, batch: int) -> list[str]:
    save = max(steps - 10, 10)
    return [sys.executable, "train.py", config, f"data.dir={data}", f"checkpoint.dir={run_dir}",
            "training.total_tokens=null", f"training.max_steps={steps}", f"training.batch_size={batch}",
            "training.gradient_accumulation_steps=1", "training.warmup_steps=10", "training.device=cuda",
            "logging.interval=10", "logging.tensorboard=false", f"evaluation.interval={save}",
            "evaluation.steps=10", f"checkpoint.interval={save}", "checkpoint.resume=auto"]


def summarise(run_dir: Path, start: float, from_step: int = 0) -> dict:
    """train.py's own figures from metrics.jsonl, lines after ``from_step`` (a resumed run's)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return {}
    lines = []
    for s in path.read_text().splitlines():
        try:
            lines.append(json.loads(s))
        except ValueError:   # the last line of a process stopped at the time limit, half written
            pass
    lines = [r for r in lines if r["step"] > from_step]
    if not lines:
        return {}
    warm = lines[1:] or lines
    med = lambda key: statistics.median(r[key] for r in warm) if all(key in r for r in warm) else None
    evals = [r["eval_loss"] for r in lines if "eval_loss" in r]
    return {"first_log_s": round(lines[0]["time"] - start, 1), "first_log_step": lines[0]["step"],
            "step_ms": med("step_time") and 1000 * med("step_time"), "tokens_per_sec": med("tokens_per_sec"),
            "mfu": med("mfu"), "mem_peak_gib": max((r["mem_peak_gib"] for r in lines if "mem_peak_gib" in r), default=None),
            "mem_reserved_gib": max((r["mem_reserved_gib"] for r in lines if "mem_reserved_gib" in r), default=None),
            "last_step": lines[-1]["step"], "loss": lines[-1]["loss"], "val_loss": evals[-1] if evals else None}


def table(results: dict) -> str:
    fmt = lambda v, f: "-" if v is None else format(v, f)
    rows = ["| stage | rc | wall s | first log s | step ms | tokens/s | MFU | peak GiB | val loss |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in results["stages"].items():
        m = r.get("metrics", {})
        rows.append(f"| {name} | {r['rc']} | {r['wall_s']} | {fmt(m.get('first_log_s'), '')} | "
                    f"{fmt(m.get('step_ms'), '.1f')} | {fmt(m.get('tokens_per_sec'), ',.0f')} | "
                    f"{fmt(m.get('mfu'), '.1%')} | {fmt(m.get('mem_peak_gib'), '.1f')} | "
                    f"{fmt(m.get('val_loss'), '.4f')} |")
    base, nash = (results["stages"].get(k, {}).get("metrics", {}).get("step_ms") for k in ("baseline", "nash-mhc"))
    if base and nash:
        rows.append(f"\nNash-MHC / baseline step time: {nash / base:.2f}x (train.py runs one after the other; "
                    "the side-by-side ratio: the variants stage)")
    return "\n".join(rows)


def small_gpu_configs(names, seq: int) -> dict:
    """small_gpu's model as each named variant: bench/model.py's NAME[+field=value...], and
    NAME/eager-loss (the same model)."""
    from bench.model import VARIANTS as MODEL_VARIANTS
    from bench.model import split_variant
    from bench.run import small_gpu_base
    from model import ModelConfig

    base, _ = small_gpu_base()
    base["max_seq_len"] = max(base["max_seq_len"], seq)
    out = {}
    for v in names:
        name, settings = split_variant(v.removesuffix(EAGER_LOSS))
        out[v] = ModelConfig(**{**base, **MODEL_VARIANTS[name], **settings})
    return out


def eager_loss(name: str, model) -> None:
    if name.endswith(EAGER_LOSS):
        from model import lm_loss
        model.loss_fn = lm_loss


def variants(out: Path, batch: int, names, seq: int = 1024) -> None:
    """The training step of every named model at small_gpu's shape, interleaved (in this process)."""
    from bench.run import time_train_steps

    res = time_train_steps(small_gpu_configs(names, seq), batch, seq, DEVICE, "bf16", True, 3, 10, eager_loss)
    ref = res["models"][names[0]].get("step_s")   # the first named: the reference
    print(f"{res['device']}, batch {batch} x seq {seq}, {res['precision']}, "
          f"{'torch.compile' if res['compile'] else 'eager'}, median of 10 interleaved steps")
    print(f"| variant | step ms | x {names[0]} | tokens/s | MFU |\n|---|---:|---:|---:|---:|")
    for v, r in res["models"].items():
        if "step_s" not in r:
            print(f"| {v} | {r.get('error', 'failed')} | | | |")
            continue
        r["x_baseline"] = r["step_s"] / ref if ref else None
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") else "-"
        x = f"{r['x_baseline']:.2f}" if ref else "-"
        print(f"| {v} | {1000 * r['step_s']:.1f} | {x} | {r['tokens_per_sec']:,.0f} | {mfu} |")
    (out / "variants.json").write_text(json.dumps(res, indent=1) + "\n")


# The first kind whose key a name contains. An inductor kernel named after an attention op (the
# element-wise work it fused around an attention call) counts as attention.
KINDS = (("attention", ("fmha", "flash", "attention", "cudnn", "sdpa")),
         ("matmul", ("gemm", "xmma", "cutlass", "nvjet", "sm90", "cublas",
                     "aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm")),   # the last: CPU ops
         ("inductor", ("triton", "cpp_fused")))   # inductor's kernels on CUDA, and on the CPU (bench/model.py)
KIND_NAMES = tuple(kind for kind, _ in KINDS) + ("other",)


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KINDS if any(k in low for k in keys)), "other")


def time_by_kind(pairs) -> dict:
    """The summed time of each ``kernel_kind`` over ``(name, time)`` pairs (kinds with none left out)."""
    out: dict = {}
    for name, t in pairs:
        out[kernel_kind(name)] = out.get(kernel_kind(name), 0) + t
    return out


def profile(out: Path, batch: int, seq: int = 1024, steps: int = 5) -> None:
    """GPU time per training step by kind of kernel, and the top kernels, of nash-mhc and baseline."""
    import torch
    from bench.run import train_step
    from training.backend import TorchBackend
    from training.config import Config

    backend = TorchBackend(DEVICE)
    cfg = Config()
    cfg.training.compile = True
    for name, mcfg in small_gpu_configs(("nash-mhc", "baseline"), seq).items():
        step, raw = train_step(backend, cfg, mcfg, batch, seq, backend.autocast_dtype("bf16"))
        for _ in range(3):
            step()
        backend.wait_device()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step()
            backend.wait_device()
        kernels = [e for e in prof.key_averages() if e.self_device_time_total > 0]
        total = sum(e.self_device_time_total for e in kernels)
        if not total:
            print(f"{name}: no GPU kernels recorded")
            continue
        by_kind = time_by_kind((e.key, e.self_device_time_total) for e in kernels)
        print(f"\n{name}: {total / steps / 1000:.1f} ms of GPU kernels per step (batch {batch} x seq {seq}); by kind: "
              + ", ".join(f"{k} {v / steps / 1000:.1f} ms ({v / total:.0%})" for k, v in
                          sorted(by_kind.items(), key=lambda kv: -kv[1])))
        top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:25]
        print("| ms/step | calls/step | kind | kernel |\n|---:|---:|---|---|")
        for e in top:
            print(f"| {e.self_device_time_total / steps / 1000:.2f} | {e.count / steps:.0f} | "
                  f"{kernel_kind(e.key)} | {e.key[:110]} |")
        del step, raw
        torch.cuda.empty_cache()


def _cuda_ms(fns: dict, warmup: int = 3, repeats: int = 20) -> dict:
    """Median milliseconds of each ``fns[name]()`` on the device (CUDA events; wall time
    elsewhere), the callables in turn in every repeat: a clock or thermal drift falls on all."""
    import torch
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            if DEVICE == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times[name].append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times[name].append(1000 * (time.perf_counter() - t0))
    return {name: statistics.median(t) for name, t in times.items()}


def attention_calls(cfg, batch: int, seq: int, device: str, compiled: bool = True) -> dict:
    """Nash attention's SDPA calls at ``cfg``'s shape, each as ``(model form, flex form)``: callables
    of ``(q, k, v)`` for the model's ``local_attention``/``attend`` with its masks, and
    flex_attention with a block mask of the same visibility (None where flex is not importable),
    torch.compile'd unless ``compiled`` is False (eager flex_attention: PyTorch's reference
    implementation, slow, but it runs wherever torch does)."""
    import torch
    from model import NashAttention, attend, attention_masks, local_attention

    masks = attention_masks(cfg, seq, device)
    W, r = cfg.nash_window, cfg.nash_compression
    pool = NashAttention(cfg).pool          # the model's pooling (mean, or learned weights at init)
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        flex = torch.compile(flex_attention, fullgraph=True, dynamic=False) if compiled else flex_attention
    except ImportError:
        flex = create_block_mask = None

    def flex_form(mask_mod, kv_len):
        if flex is None:
            return None
        block = create_block_mask(mask_mod, None, None, seq, kv_len, device=device)
        return lambda q, k, v: flex(q, k, v, block_mask=block, enable_gqa=q.shape[1] != k.shape[1])

    calls = {"full causal (the baseline's)": (lambda q, k, v: attend(q, k, v),
                                              flex_form(lambda b, h, t, s: s <= t, seq))}
    if W:
        calls[f"scale 0: window {W}"] = (lambda q, k, v: local_attention(q, k, v, W, masks.get("local")),
                                         flex_form(lambda b, h, t, s: (s <= t) & (t - s < W), seq))
    # attention_masks' scale l as a mask_mod, the block size in a closure: as a default argument
    # (one code object for every scale) flex_attention, through Dynamo (eager flex too), ran
    # scale 2 with scale 1's mask after the window's call (tests/test_bench.py)
    def seen_at(blk):
        def seen(b, h, t, j):
            return ((j + 1) * blk - 1 <= t) | ((j == 0) & (t < blk - 1))
        return seen

    for l in range(1, cfg.nash_scales):
        blk = r ** l
        pooled = flex_form(seen_at(blk), seq // blk)
        calls[f"scale {l}: {seq // blk} pooled keys"] = (
            lambda q, k, v, l=l, m=masks[f"scale{l}"]: attend(q, pool(k, l), pool(v, l), m),
            pooled and (lambda q, k, v, l=l, f=pooled: f(q, pool(k, l), pool(v, l))))
    return calls


def attention(out: Path, batch: int, seq: int = 1024) -> None:
    """Each of small_gpu's attention calls alone, forward + backward in bf16: the model's form
    against flex_attention's, with the largest difference of their outputs."""
    import torch

    (cfg,) = small_gpu_configs(("nash-only",), seq).values()
    H, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    q = torch.randn(batch, H, seq, D, device=DEVICE, dtype=dtype, generator=gen)
    k, v = (torch.randn(batch, Hkv, seq, D, device=DEVICE, dtype=dtype, generator=gen) for _ in range(2))
    qkv = [t.requires_grad_(True) for t in (q, k, v)]
    grad = torch.randn_like(q)
    rows = []
    print(f"{DEVICE}, batch {batch} x seq {seq}, {H} heads / {Hkv} kv x {D}, {dtype}; forward + backward, "
          "median of 20, the forms in turn\n| call | model's form ms | flex_attention ms | flex / model | max |diff| |\n|---|---:|---:|---:|---:|")
    for name, (model_fn, flex_fn) in attention_calls(cfg, batch, seq, DEVICE).items():
        row, runs = {"call": name}, {}
        for form, fn in (("model", model_fn), ("flex", flex_fn)):
            if fn is None:
                continue
            try:   # once first (flex compiles): a form this torch cannot run is reported, the others still run
                fn(*qkv).backward(grad)
                with torch.no_grad():
                    row[f"{form}_out"] = fn(q.detach(), k.detach(), v.detach()).float()
                runs[form] = lambda fn=fn: fn(*qkv).backward(grad)
            except Exception as e:
                row[f"{form}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        row.update({f"{form}_ms": ms for form, ms in _cuda_ms(runs).items()})   # the forms in turn
        if "model_out" in row and "flex_out" in row:
            row["max_diff"] = (row["model_out"] - row["flex_out"]).abs().max().item()
        row.pop("model_out", None), row.pop("flex_out", None)
        rows.append(row)
        fmt = lambda key: f"{row[key]:.3f}" if key in row else row.get(key.replace("_ms", "_error"), "-")
        ratio = f"{row['flex_ms'] / row['model_ms']:.2f}" if "flex_ms" in row and "model_ms" in row else "-"
        diff = f"{row['max_diff']:.2e}" if "max_diff" in row else "-"
        print(f"| {name} | {fmt('model_ms')} | {fmt('flex_ms')} | {ratio} | {diff} |", flush=True)
    (out / "attention.json").write_text(json.dumps({"device": DEVICE, "batch": batch, "seq": seq, "rows": rows}, indent=1) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, required=True, help="prepare_data.py directory (vocabulary <= 32768)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gpu")
    ap.add_argument("--runs", type=Path, help="run directories (checkpoints: ~1.5 GB per run; default OUT/runs)")
    ap.add_argument("--only", default=",".join(STAGES), help=f"comma-separated, from: {', '.join(STAGES)}")
    ap.add_argument("--steps", type=int, default=60, help="training steps of nash-mhc and baseline")
    ap.add_argument("--batch", type=int, default=32, help="sequences of 1024 tokens per step")
    ap.add_argument("--variant-batch", type=int, default=16,
                    help="variants, profile: sequences of 1024 tokens per step (several models on the GPU at once)")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="variants: comma-separated, bench/model.py's NAME[+field=value...] (e.g. "
                         "nash-mhc+stream_dtype=bf16), NAME/eager-loss: the loss not compiled")
    ap.add_argument("--code", action="store_true",
                    help="profile: also write inductor's generated code (TORCH_LOGS=output_code) to "
                         "OUT/profile.log, where the profile's kernels are found by name")
    ap.add_argument("--limit", type=float, default=240, help="seconds before a stage is stopped")
    ap.add_argument("--inner", choices=("variants", "profile", "attention"), help=argparse.SUPPRESS)  # a stage's process
    args = ap.parse_args()
    args.out = args.out.resolve()   # the stages run in the repository's root
    if args.inner:
        args.out.mkdir(parents=True, exist_ok=True)
        if args.inner == "variants":
            variants(args.out, args.batch, args.variants.split(","))
        elif args.inner == "attention":
            attention(args.out, args.batch)
        else:
            profile(args.out, args.batch)
        return 0
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    fail = lambda msg: ap.exit(2, f"{ap.prog}: error: {msg}\n")
    if bad := sorted(set(only) - set(STAGES)):
        fail(f"--only: unknown stage(s) {', '.join(bad)}; expected {', '.join(STAGES)}")
    if not (args.data / "meta.json").is_file():
        fail(f"--data {args.data}: no meta.json (a prepare_data.py output directory)")
    if args.steps < 20 or args.batch < 1 or args.variant_batch < 1:
        fail("--steps must be at least 20, --batch and --variant-batch at least 1")
    runs = (args.runs or args.out / "runs").resolve()
    for stage in set(only) & set(CONFIGS):
        if (runs / stage).exists():   # train.py would resume it: a measurement of nothing
            fail(f"--runs: {runs / stage} exists (a run of an earlier call); remove it or give another --runs")
    if "nash-mhc" not in only and {"resume", "sample"} & set(only) \
            and not (runs / "nash-mhc" / f"ckpt_{args.steps:08d}.pt").is_file():
        fail(f"--only resume/sample without nash-mhc: no {runs / 'nash-mhc'}/ckpt_{args.steps:08d}.pt "
             "(an earlier call's nash-mhc run with the same --steps and --runs)")
    if "variants" in only:
        from bench.model import split_variant
        try:
            for v in args.variants.split(","):
                split_variant(v.removesuffix(EAGER_LOSS))
        except ValueError as e:
            fail(str(e))
    import torch  # after the argument checks: a wrong flag answers at once

    if not torch.cuda.is_available():
        fail("no CUDA GPU here (torch.cuda.is_available() is False)")
    from training.monitor import peak_flops_for

    args.out.mkdir(parents=True, exist_ok=True)
    data = args.data.resolve()
    name = torch.cuda.get_device_name(0)
    results = {"device": name, "torch": torch.__version__, "cuda": torch.version.cuda,
               "peak_bf16_flops": peak_flops_for(name, "bf16"), "steps": args.steps, "batch": args.batch,
               "seq": 1024, "stages": {}}
    print(f"{name}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"peak bf16 {results['peak_bf16_flops']}", flush=True)
    for stage in [s for s in STAGES if s in only]:
        if stage == "tests":
            r = run_stage(stage, [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                  "tests/test_model.py", "-k", "cuda"], args.out, args.limit)
        elif stage in CONFIGS:
            run_dir = runs / stage
            r = run_stage(stage, train_cmd(CONFIGS[stage], data, run_dir, args.steps, args.batch), args.out, args.limit)
            r["metrics"] = summarise(run_dir, r["start"])
        elif stage in ("resume", "sample") and results["stages"].get("nash-mhc", {}).get("rc", 0) != 0:
            r = {"rc": "skipped", "wall_s": 0, "why": "nash-mhc failed in this call"}
        elif stage == "resume":
            run_dir = runs / "nash-mhc"
            r = run_stage(stage, train_cmd(CONFIGS["nash-mhc"], data, run_dir, args.steps + 20, args.batch),
                          args.out, args.limit)
            r["metrics"] = summarise(run_dir, r["start"], from_step=args.steps)
        elif stage in ("variants", "profile", "attention"):
            code = {"TORCH_LOGS": "output_code"} if args.code and stage == "profile" else None
            r = run_stage(stage, [sys.executable, "bench/gpu.py", "--data", str(data), "--out", str(args.out),
                                  "--batch", str(args.variant_batch), "--variants", args.variants, "--inner", stage],
                          args.out, args.limit, env=code)
        else:  # sample
            r = run_stage(stage, [sys.executable, "sample.py", str(runs / "nash-mhc"), "--device", "cuda",
                                  "--prompt", "def ", "--max-new-tokens", "64", "--num-samples", "2"],
                          args.out, args.limit)
        results["stages"][stage] = r
        (args.out / "gpu.json").write_text(json.dumps(results, indent=1) + "\n")
    print("\n" + table(results), flush=True)
    return 0 if all(r["rc"] == 0 for r in results["stages"].values()) else 1   # a skipped stage too


if __name__ == "__main__":
    sys.exit(main())
