"""The training loop shared by train.py and train_xla.py.

One step: ``accumulation`` micro-steps of forward and backward, a gradient reduction (where the
backend needs one), clipping of the *reduced* global gradient, an update that is skipped when the
loss or the gradient is not finite, and a device sync. Nothing in a step reads a tensor value on
the host: losses, norms and counters stay on the device and reach the host through
``backend.on_host`` at log intervals only.
"""
from __future__ import annotations

import math
import os
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from model import NashMHC

from .backend import Backend
from .checkpoint import (FORMAT_VERSION, CheckpointError, checkpoint_path, find_resume,
                         load_checkpoint, rng_state, rotate, set_rng_state)
from .config import Config, ConfigError, check_data, config_from_dict
from .data import DataStream, TokenWindows, eval_batches
from .hf import load_initial_weights
from .monitor import Monitor, info
from .optim import build_optimizer, lr_at, set_lr


class StopRequested:
    """SIGTERM/SIGINT: finish the current step, save, exit 0. A second SIGINT exits at once."""

    def __init__(self):
        self.requested = False
        self.signal_name = ""
        self._old = {}

    def install(self) -> "StopRequested":
        if self._old:
            return self
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def _handle(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            info("second interrupt: exiting now without saving")
            os._exit(130)
        self.requested = True
        self.signal_name = signal.Signals(signum).name
        info(f"{self.signal_name} received: finishing this step, saving a checkpoint, then exiting "
             "(Ctrl+C again to exit at once)")

    def restore(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            self.requested = False  # the handlers stay with the main thread that installed them
            return
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}
        self.requested = False


# One per process: a worker whose training loop runs outside the main thread (xmp.spawn runs it
# in a thread) installs the handlers from its main thread at import (train_xla.py).
STOP = StopRequested()


@dataclass
class RunState:
    step: int = 0
    tokens_seen: int = 0
    epoch: int = 0          # data position at the start of the run (resume point)
    offset: int = 0
    batches_done: int = 0   # global batches consumed since that point
    nonfinite_total: int = 0


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def resolve_resume(cfg: Config, run_dir: Path) -> tuple[Path, dict] | None:
    mode = cfg.checkpoint.resume
    if mode == "none":
        return None
    if mode == "auto":
        return find_resume(run_dir, warn=info)
    path = Path(mode).expanduser()
    return path, load_checkpoint(path)  # an explicit path that does not load is an error


def check_resume_compatible(cfg: Config, ckpt: dict, path: Path) -> None:
    """The architecture of a checkpoint must match the config's (anything else may change)."""
    try:
        saved = config_from_dict(ckpt["config"]).model
    except (ConfigError, KeyError) as e:
        raise CheckpointError(f"{path}: stored config unreadable ({e})") from None
    if saved != cfg.model:
        diff = [f"model.{k}: {getattr(saved, k)!r} -> {getattr(cfg.model, k)!r}"
                for k in cfg.model.__dataclass_fields__ if getattr(saved, k) != getattr(cfg.model, k)]
        structural = [d for d in diff if not d.startswith(("model.dropout", "model.activation_checkpointing"))]
        if structural:
            raise CheckpointError(f"{path}: model config differs from the checkpoint's ({'; '.join(structural)})")


def train(cfg: Config, backend: Backend) -> int:
    """Run (or resume) training as the config says; returns the process exit code."""
    t_cfg, d_cfg = cfg.training, cfg.data
    meta = check_data(cfg)
    run_dir = Path(cfg.checkpoint.dir).expanduser()
    log = info if backend.is_master else (lambda msg: None)

    train_ds = TokenWindows(d_cfg.dir, "train", d_cfg.seq_len)
    val_ds = TokenWindows(d_cfg.dir, "val", d_cfg.seq_len)
    replicas = backend.world_size
    if len(val_ds) < t_cfg.batch_size * replicas:
        raise ConfigError(f"data.dir: the val split has {len(val_ds)} windows of {d_cfg.seq_len + 1} "
                          f"tokens, fewer than one global batch ({t_cfg.batch_size} x {replicas})")
    max_steps = cfg.resolve_steps(replicas)
    tokens_per_step = cfg.tokens_per_step(replicas)

    seed_everything(t_cfg.seed)
    model = NashMHC(cfg.model)  # same seed on every process: identical initial weights
    state = RunState()
    resumed = resolve_resume(cfg, run_dir)
    if resumed is not None and "optimizer" not in resumed[1]:
        raise CheckpointError(f"{resumed[0]}: weights only (export_hf.py --import?): start a run from it "
                              "with checkpoint.init_from")
    if resumed is None and cfg.checkpoint.init_from:
        init_path, init = load_initial_weights(cfg.checkpoint.init_from, warn=log)
        check_resume_compatible(cfg, init, init_path)
        model.load_state_dict(init["model"])
        log(f"initial weights from {init_path}")
        del init
    if resumed is not None:
        ckpt_path, ckpt = resumed
        check_resume_compatible(cfg, ckpt, ckpt_path)
        if int(ckpt["step"]) >= max_steps:
            # Nothing to do: no data workers, no compilation, and the checkpoint stays as it is.
            log(f"{ckpt_path} is at step {int(ckpt['step'])}: this run is done ({max_steps:,} steps). "
                "Raise training.max_steps (or training.total_tokens) to train further, or set "
                "checkpoint.resume=none or another checkpoint.dir to start over.")
            return 0
        model.load_state_dict(ckpt["model"])

    log(f"config (resolved):\n{_yaml(cfg.to_dict())}")
    log(f"device: {backend.device_name()} x {replicas} replica(s) | model: "
        f"{model.num_params() / 1e6:.2f}M parameters | data: {meta['splits']['train']['tokens']:,} "
        f"train tokens, vocab {meta['vocab_size']}")
    log(f"effective batch: {t_cfg.batch_size} per replica x {replicas} replica(s) x "
        f"{t_cfg.gradient_accumulation_steps} accumulation = "
        f"{t_cfg.batch_size * replicas * t_cfg.gradient_accumulation_steps} sequences = "
        f"{tokens_per_step:,} tokens per step; {max_steps:,} steps"
        + (f" (training.total_tokens={t_cfg.total_tokens:,})" if t_cfg.max_steps is None else ""))

    train_model = backend.prepare_model(model, cfg)
    raw_model = backend.unwrap(train_model)
    optimizer = build_optimizer(raw_model, t_cfg, backend.adamw_factory())
    if hasattr(optimizer, "init_state"):
        optimizer.init_state()  # state exists before step 1: the first step traces the steady graph
    if resumed is None:
        backend.prepare_optimizer(optimizer)
    else:
        backend.load_optimizer_state(optimizer, ckpt["optimizer"])
        set_rng_state(ckpt["rng"])
        state.step, state.tokens_seen = int(ckpt["step"]), int(ckpt["tokens_seen"])
        state.epoch, state.offset = int(ckpt["data"]["epoch"]), int(ckpt["data"]["offset"])
        state.nonfinite_total = int(ckpt.get("nonfinite", {}).get("total", 0))
        log(f"resumed from {ckpt_path} at step {state.step} (epoch {state.epoch}, sample "
            f"{state.offset}, {state.tokens_seen:,} tokens seen)")
        del ckpt

    stream = DataStream(train_ds, t_cfg.batch_size, replicas, backend.rank, t_cfg.seed,
                        num_workers=d_cfg.num_workers)
    stream.set_position(state.epoch, state.offset)
    batches = backend.batches(stream)
    amp_dtype = backend.autocast_dtype(t_cfg.precision)
    monitor = Monitor(cfg, run_dir, backend.is_master, max_steps, state.step)
    stopper = STOP.install()
    params = [p for p in raw_model.parameters() if p.requires_grad]
    flops_per_token = raw_model.flops_per_token(d_cfg.seq_len)
    peak = cfg.logging.peak_flops or backend.peak_flops()
    device = backend.device

    # Device-side counters: no host sync needed to keep them.
    # Cumulative, never reset: every step then traces the same graph (XLA compiles it once).
    streak = torch.zeros((), device=device)        # non-finite steps in a row
    worst_streak = torch.zeros((), device=device)  # the longest such run in this process
    skipped = torch.zeros((), device=device)       # non-finite steps in this process
    skipped_logged = 0
    backend.sync()  # materialise the counters and the optimiser state: step 1 = every later step

    host = {"stop_nonfinite": False, "last_log_time": time.time(), "last_log_step": state.step,
            "last": {}, "eval_seconds": 0.0}

    def save(reason: str) -> None:
        pos = stream.advance(state.epoch, state.offset, state.batches_done)
        ckpt = {
            "format_version": FORMAT_VERSION,
            "model": backend.model_state(train_model),
            "optimizer": backend.optimizer_state(optimizer),
            "step": state.step,
            "tokens_seen": state.tokens_seen,
            "data": {"epoch": pos[0], "offset": pos[1]},
            "rng": rng_state(),
            "nonfinite": {"total": state.nonfinite_total},
            "config": cfg.to_dict(),
            "trainer": backend.name,
        }
        path = checkpoint_path(run_dir, state.step)
        backend.save(ckpt, path)
        if backend.is_master:
            rotate(run_dir, cfg.checkpoint.keep)
        log(f"saved {path} ({reason})")

    def evaluate() -> torch.Tensor:
        """Mean validation loss over the same ``evaluation.steps`` batches every time."""
        t0 = time.time()
        raw_model.eval()
        batch_losses = []
        with torch.no_grad():
            for x, y in backend.batches(eval_batches(val_ds, t_cfg.batch_size, cfg.evaluation.steps,
                                                      replicas, backend.rank)):
                with backend.autocast(amp_dtype):
                    batch_losses.append(raw_model(x, y).loss.float())
                backend.sync()  # one forward graph, the same for every batch
        raw_model.train()
        host["eval_seconds"] += time.time() - t0
        return backend.mean_across(torch.stack(batch_losses).mean())

    def on_log(values: dict) -> None:
        """Runs on the host once a log step's tensors are computed (XLA: in a step closure)."""
        step = int(values.pop("_step"))
        now = time.time()
        dt = max(now - host["last_log_time"] - host["eval_seconds"], 1e-9)  # training time only
        host["eval_seconds"] = 0.0
        steps = step - host["last_log_step"]
        host["last_log_time"], host["last_log_step"] = now, step
        nonlocal skipped_logged
        skipped_now = int(values.pop("_skipped"))
        state.nonfinite_total += skipped_now - skipped_logged
        skipped_logged = skipped_now
        if values.pop("_worst_streak") >= t_cfg.max_nonfinite_steps:
            host["stop_nonfinite"] = True
        rec = {"loss": values.pop("loss"), "lr": values.pop("lr"), "grad_norm": values.pop("grad_norm"),
               "tokens_seen": state_tokens(step)}
        if steps > 0:
            rec["tokens_per_sec"] = steps * tokens_per_step / dt
            rec["step_time"] = dt / steps
            if peak:
                rec["mfu"] = rec["tokens_per_sec"] * flops_per_token / (peak * replicas)
        if "eval_loss" in values:
            rec["eval_loss"] = values.pop("eval_loss")
            rec["eval_ppl"] = math.exp(min(rec["eval_loss"], 50.0))
        rec["nonfinite_skipped"] = state.nonfinite_total
        rec.update(values)  # model metrics (nash entropy, mHC gates, ...)
        rec.update(backend.log_extras())
        host["last"] = rec
        monitor.log(step, rec)
        if "eval_loss" in rec:
            log(f"step {step}: loss {rec['loss']:.4f} | val loss {rec['eval_loss']:.4f} "
                f"(ppl {rec['eval_ppl']:.2f})")

    start_tokens, start_step = state.tokens_seen, state.step

    def state_tokens(step: int) -> int:
        return start_tokens + (step - start_step) * tokens_per_step

    accum = t_cfg.gradient_accumulation_steps
    train_model.train()
    exit_reason = "done"
    try:
        while state.step < max_steps:
            lr = lr_at(state.step, max_steps, t_cfg.learning_rate, t_cfg.warmup_steps, t_cfg.min_lr_ratio)
            set_lr(optimizer, lr / t_cfg.learning_rate)
            micro_losses = []
            for micro in range(accum):
                x, y = next(batches)
                with backend.no_sync(train_model, last_micro_step=micro == accum - 1):
                    with backend.autocast(amp_dtype):
                        out = train_model(x, y)
                    (out.loss / accum).backward()
                micro_losses.append(out.loss.detach().float())
            backend.reduce_gradients(optimizer)
            grads = [p.grad for p in params if p.grad is not None]
            grad_norm = torch.nn.utils.get_total_norm(grads)
            if t_cfg.grad_clip > 0:
                torch.nn.utils.clip_grads_with_norm_(params, t_cfg.grad_clip, grad_norm)
            loss = micro_losses[0] if accum == 1 else torch.stack(micro_losses).mean()
            ok = torch.isfinite(loss) & torch.isfinite(grad_norm)
            optimizer.found_inf = (~ok).float()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            bad = (~ok).float()
            streak = (streak + 1) * bad
            worst_streak = torch.maximum(worst_streak, streak)
            skipped = skipped + bad

            state.step += 1
            state.batches_done += accum
            state.tokens_seen = state_tokens(state.step)
            last = state.step == max_steps
            do_eval = last or (cfg.evaluation.interval > 0 and state.step % cfg.evaluation.interval == 0)
            do_log = last or do_eval or state.step % cfg.logging.interval == 0
            # Held every step, not only at log steps, so that every step's graph has the same
            # outputs (one compilation on XLA); they reach the host only at log steps.
            values = {"loss": loss, "grad_norm": grad_norm, "_skipped": skipped,
                      "_worst_streak": worst_streak, **out.metrics}
            if do_log:
                values = {**values, "loss": backend.mean_across(loss), "lr": torch.tensor(lr),
                          "_step": torch.tensor(state.step)}
                if do_eval:
                    values["eval_loss"] = evaluate()
                backend.on_host(on_log, values)
            backend.sync()
            monitor.advance(state.step)

            check = do_log or state.step % backend.signal_check_interval == 0
            if check and backend.any_process(host["stop_nonfinite"]):
                exit_reason = "nonfinite"
                break
            if check and backend.any_process(stopper.requested):
                exit_reason = "signal"
                break
            if cfg.checkpoint.interval > 0 and state.step % cfg.checkpoint.interval == 0 and not last:
                save("interval")
    finally:
        stopper.restore()
        monitor.close()
        backend.close_batches(batches)  # stop prefetching and join the data workers
        stream.close()

    if exit_reason == "nonfinite":
        save("non-finite loss")
        log(f"error: the loss or gradient was NaN/Inf for {t_cfg.max_nonfinite_steps} steps in a row "
            f"(step {state.step}); updates were skipped, so the checkpoint holds the last good weights. "
            "Lower training.learning_rate, check the data, or use precision=fp32.")
        backend.finish(run_dir, log)
        return 3
    save("signal" if exit_reason == "signal" else "final")
    if exit_reason == "signal":
        log(f"stopped at step {state.step} after {stopper.signal_name}; resume with the same command")
    else:
        last = host["last"]
        if "eval_loss" in last:
            log(f"done: {state.step} steps, {state.tokens_seen:,} tokens; final val loss "
                f"{last['eval_loss']:.4f} (ppl {last['eval_ppl']:.2f})")
    backend.finish(run_dir, log)
    return 0


def _yaml(tree: dict) -> str:
    import yaml
    return yaml.safe_dump(tree, sort_keys=False, default_flow_style=None).rstrip()


def main(argv: list[str] | None, make_backend, prog: str) -> int:
    """Command-line entry shared by train.py and train_xla.py: config errors are one line, exit 2."""
    import argparse
    from .config import load_config

    parser = argparse.ArgumentParser(prog=prog, description="Train a Nash-MHC transformer.")
    parser.add_argument("config", help="YAML config (see configs/)")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        check_data(cfg)
        return make_backend(cfg)
    except (ConfigError, CheckpointError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
