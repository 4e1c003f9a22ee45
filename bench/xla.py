"""Measurements of train_xla.py's XLA path that need a process of their own (PJRT on the CPU, or a
TPU): bench/run.py's XLA section runs them and reads the JSON each prints last.

    PJRT_DEVICE=CPU python bench/xla.py steps CONFIG [section.key=value ...] [--closures sync] [--steps N]
    PJRT_DEVICE=CPU python bench/xla.py accumulation CONFIG [...] --scheme gradient_accumulation
    PJRT_DEVICE=CPU python bench/xla.py compile CONFIG [section.key=value ...]
    PJRT_DEVICE=CPU python bench/xla.py optimizer CONFIG [section.key=value ...] [--steps N]

steps     the real Trainer (training/loop.py) with the XLA backend (a run of its own, in a temporary
          directory unless an override names checkpoint.dir), each step's host-side time
          (from one train_step call to the next): log steps against the others, and device-to-host
          transfers per log line. ``--closures sync`` forces torch_xla's synchronous step closures
          (what train_xla.py used before: the loop waits for the step's values at a log step), for
          a side-by-side comparison.
accumulation  gradient accumulation three ways, on the model and optimiser of the config: "before"
          (gradients created by the first micro-step; each micro-step its own graph: first, middle
          and last+update differ), "train_xla" (what the Trainer does: with accumulation the
          gradient buffers exist before every micro-step, and the update is its own graph) and
          torch_xla's ``experimental.gradient_accumulation`` (the micro-steps in one XLA While
          loop over stacked micro-batches): compilations and the median host time per step.
compile   the training step's model graph (forward and backward of one micro-batch, built with
          the XLA backend's prepare_model, so ``xla.scan_layers`` applies as in training): its HLO
          lines before optimisation and its XLA compile time (torch_xla's CompileTime metric).
optimizer the host time of tracing one AdamW update of the config's model (every parameter with
          a gradient), with the XLA backend's AdamW (torch_xla's fused op per parameter) and with
          training.optim's tensor-op AdamW (what the XLA backend used before), interleaved, and the
          whole update (trace, sync, execution): medians over --steps rounds after 2.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0] or ".").resolve() == ROOT / "bench":
    sys.path[0] = str(ROOT)  # model.py, not bench/model.py


def step_times(config: str, overrides: list[str], closures: str, steps: int | None, run_dir: str) -> dict:
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met

    from training.config import load_config
    from training.loop import Trainer
    from training.xla_backend import XLABackend

    if closures == "sync":  # the loop waits for each log line's values, as before issue 12
        add = xm.add_step_closure
        xm.add_step_closure = lambda fn, args=(), run_async=False: add(fn, args, run_async=False)
    # a run of its own: never the config's checkpoint.dir (its run would be resumed and trained on)
    # unless the overrides name one; --steps, when given, is the run's length
    own = [f"checkpoint.dir={run_dir}", "checkpoint.resume=none", "checkpoint.interval=0"]
    length = [f"training.max_steps={steps}", "training.total_tokens=null"] if steps is not None else []
    cfg = load_config(config, [*own, *overrides, *length])
    trainer = Trainer(cfg, XLABackend(cfg))
    starts, step_fn = [], trainer.train_step

    def timed_step(lr):
        starts.append(time.perf_counter())
        return step_fn(lr)

    trainer.train_step = timed_step
    code = trainer.fit()
    starts.append(time.perf_counter())
    rows = [json.loads(line) for line in (Path(cfg.checkpoint.dir).expanduser() / "metrics.jsonl").open()]
    return {"code": code, "step_s": [b - a for a, b in zip(starts, starts[1:])],
            "log_interval": cfg.logging.interval, "closures": closures,
            "transfers": [[r["step"], r["xla_transfers"]] for r in rows],
            "compilations": int(met.counter_value("UncachedCompile") or 0)}


def accumulation(config: str, overrides: list[str], scheme: str, steps: int) -> dict:
    import statistics

    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met
    from torch_xla.experimental.gradient_accumulation import gradient_accumulation

    from model import NashMHC
    from training.config import load_config
    from training.optim import build_optimizer
    from training.xla_backend import XLABackend

    cfg = load_config(config, overrides)
    accum, (B, T) = cfg.training.gradient_accumulation_steps, (cfg.training.batch_size, cfg.data.seq_len)
    backend = XLABackend(cfg)
    torch.manual_seed(0)
    model = backend.prepare_model(NashMHC(cfg.model), cfg)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = build_optimizer(model, cfg.training, backend.adamw_factory())
    opt.init_state()
    keep = scheme == "train_xla" and backend.keep_gradients(params, accum)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, cfg.model.vocab_size, (steps, accum, 2, B, T), generator=g)
    names = list(model.stat_names)
    torch_xla.sync()
    starts, compiles, losses = [], [], []
    for step in range(steps):
        starts.append(time.perf_counter())
        if scheme == "gradient_accumulation":
            x, y = data[step, :, 0].to(backend.device), data[step, :, 1].to(backend.device)

            def micro_step(xi, yi, stats):
                out = model(xi, yi)
                return out.loss, stats + torch.stack([out.metrics[n] for n in names]) / accum

            loss, stats = gradient_accumulation(micro_step, (x, y), model,
                                                torch.zeros(len(names), device=backend.device))
        else:
            micro = []
            for i in range(accum):
                x, y = data[step, i, 0].to(backend.device), data[step, i, 1].to(backend.device)
                torch_xla.sync()  # what the device loader's next() does
                out = model(x, y)
                (out.loss / accum).backward()
                micro.append(out.loss.detach())
            if scheme == "train_xla":
                torch_xla.sync()  # the update is its own graph
            loss = torch.stack(micro).mean()
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        torch.nn.utils.clip_grads_with_norm_(params, 1.0, norm)
        opt.step()
        opt.zero_grad(set_to_none=not keep)
        losses.append(torch.stack([loss, norm]))
        torch_xla.sync()
        compiles.append(int(met.counter_value("UncachedCompile") or 0))
    xm.wait_device_ops()
    starts.append(time.perf_counter())
    step_s = [b - a for a, b in zip(starts, starts[1:])]
    # the first three compile; the last one also waits for the device to drain the queue that the
    # earlier ones only filled (XLA runs ahead of the host): the steps between them
    return {"scheme": scheme, "accumulation": accum, "compilations": compiles,
            "step_s": statistics.median(step_s[3:-1]), "losses": [float(v[0]) for v in losses]}


def compile_graph(config: str, overrides: list[str]) -> dict:
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met

    from model import NashMHC
    from training.config import load_config
    from training.xla_backend import XLABackend

    cfg = load_config(config, overrides)
    backend = XLABackend(cfg)
    torch.manual_seed(0)
    model = backend.prepare_model(NashMHC(cfg.model), cfg)
    model.train()
    shape = (cfg.training.batch_size, cfg.data.seq_len)
    x = torch.randint(0, cfg.model.vocab_size, shape).to(backend.device)
    y = torch.randint(0, cfg.model.vocab_size, shape).to(backend.device)
    torch_xla.sync()
    met.clear_all()
    t0 = time.perf_counter()
    with backend.autocast(backend.autocast_dtype(cfg.training.precision)):
        out = model(x, y)
    out.loss.backward()
    trace_s = time.perf_counter() - t0
    outputs = [out.loss, *out.metrics.values(), *(p.grad for p in model.parameters())]
    hlo = torch_xla._XLAC._get_xla_tensors_hlo(outputs)
    torch_xla.sync()
    xm.wait_device_ops()
    compile_ns = met.metric_data("CompileTime")
    return {"n_layers": cfg.model.n_layers, "scan_layers": cfg.xla.scan_layers,
            "hlo_lines": len(hlo.splitlines()), "trace_s": trace_s,
            "compile_s": compile_ns[1] / 1e9 if compile_ns else None,
            "compilations": int(met.counter_value("UncachedCompile") or 0)}


def optimizer_times(config: str, overrides: list[str], steps: int) -> dict:
    import statistics

    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met

    from bench.model import bare_data_dir
    from model import NashMHC
    from training.config import load_config
    from training.optim import AdamW, build_optimizer
    from training.xla_backend import XLABackend

    cfg = load_config(config, overrides)
    cfg.data.dir = bare_data_dir()  # no data is read
    backend = XLABackend(cfg)
    torch.manual_seed(0)
    model = backend.prepare_model(NashMHC(cfg.model), cfg)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    opts = {"xla_backend": build_optimizer(model, cfg.training, backend.adamw_factory()),
            "tensor_ops": build_optimizer(model, cfg.training, AdamW)}
    for opt in opts.values():
        opt.init_state()
        backend.prepare_optimizer(opt)
    torch_xla.sync()
    times = {k: {"trace_ms": [], "update_ms": []} for k in opts}
    for r in range(steps + 2):
        for name, opt in opts.items():
            t0 = time.perf_counter()
            opt.step()
            t1 = time.perf_counter()
            torch_xla.sync()
            xm.wait_device_ops()
            t2 = time.perf_counter()
            if r >= 2:
                times[name]["trace_ms"].append((t1 - t0) * 1e3)
                times[name]["update_ms"].append((t2 - t0) * 1e3)
    return {"parameters": sum(1 for _ in model.parameters()), "rounds": steps,
            "fallbacks": sorted(n for n in met.counter_names() if n.startswith("aten::")),
            **{name: {k: statistics.median(v) for k, v in t.items()} for name, t in times.items()}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=("steps", "accumulation", "compile", "optimizer"))
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--closures", choices=("async", "sync"), default="async")
    p.add_argument("--scheme", choices=("before", "train_xla", "gradient_accumulation"), default="train_xla")
    p.add_argument("--steps", type=int, help="steps: the run's length (default: the config's); accumulation, "
                                              "optimizer: rounds (default 12)")
    p.add_argument("--run-dir", help="steps: where the run writes its checkpoint, metrics.jsonl and xla_metrics.json "
                                     "(default: a temporary directory, removed at the end)")
    args = p.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        p.error(f"--steps must be at least 1, got {args.steps}")
    if args.what == "accumulation" and args.steps is not None and args.steps < 5:
        p.error(f"accumulation: --steps must be at least 5 (three that compile, one timed, one that "
                f"waits for the device), got {args.steps}")
    from training.config import ConfigError
    try:
        if args.what == "steps":
            if args.run_dir is not None:
                res = step_times(args.config, args.overrides, args.closures, args.steps, args.run_dir)
            else:
                with tempfile.TemporaryDirectory(prefix="bench-xla-steps-") as run_dir:
                    res = step_times(args.config, args.overrides, args.closures, args.steps, run_dir)
                print(f"xla.py: {run_dir} (the run's files, named above) is removed: --run-dir DIR keeps them",
                      file=sys.stderr)
        elif args.what == "accumulation":
            res = accumulation(args.config, args.overrides, args.scheme, args.steps or 12)
        elif args.what == "optimizer":
            res = optimizer_times(args.config, args.overrides, args.steps or 12)
        else:
            res = compile_graph(args.config, args.overrides)
    except ConfigError as e:  # a config or an override: one line
        print(f"xla.py: error: {e}", file=sys.stderr)
        return 2
    print("RESULT " + json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
