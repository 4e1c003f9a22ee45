"""Measurements of train_xla.py's XLA path that need a process of their own (PJRT on the CPU, or a
TPU): bench/run.py's XLA section runs them and reads the JSON each prints last.

    PJRT_DEVICE=CPU python bench/xla.py steps CONFIG [section.key=value ...] [--closures sync]
    PJRT_DEVICE=CPU python bench/xla.py compile CONFIG [section.key=value ...]

steps     the real Trainer (training/loop.py) with the XLA backend, each step's host-side time
          (from one train_step call to the next): log steps against the others, and device-to-host
          transfers per log line. ``--closures sync`` forces torch_xla's synchronous step closures
          (what train_xla.py used before: the loop waits for the step's values at a log step), for
          a side-by-side comparison.
compile   the training step's model graph (forward and backward of one micro-batch, built with
          the XLA backend's prepare_model, so ``xla.scan_layers`` applies as in training): its HLO
          lines before optimisation and its XLA compile time (torch_xla's CompileTime metric).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0] or ".").resolve() == ROOT / "bench":
    sys.path[0] = str(ROOT)  # model.py, not bench/model.py


def step_times(config: str, overrides: list[str], closures: str) -> dict:
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met

    from training.config import load_config
    from training.loop import Trainer
    from training.xla_backend import XLABackend

    if closures == "sync":  # the loop waits for each log line's values, as before issue 12
        add = xm.add_step_closure
        xm.add_step_closure = lambda fn, args=(), run_async=False: add(fn, args, run_async=False)
    cfg = load_config(config, overrides)
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=("steps", "compile"))
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--closures", choices=("async", "sync"), default="async")
    args = p.parse_args(argv)
    if args.what == "steps":
        res = step_times(args.config, args.overrides, args.closures)
    else:
        res = compile_graph(args.config, args.overrides)
    print("RESULT " + json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
