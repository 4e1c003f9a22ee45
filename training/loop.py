"""The training loop shared by train.py and train_xla.py.

One step: ``accumulation`` micro-steps of forward and backward, a gradient reduction (where the
backend needs one), clipping of the *reduced* global gradient, an update that is skipped when the
loss or the gradient is not finite, and a device sync. Nothing in a step reads a tensor value on
the host: losses, norms and counters stay on the device and reach the host through
``backend.on_host`` at log intervals only.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import random
import re
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
from .checkpoint import (FORMAT_VERSION, Checkpointer, CheckpointError, first_line, release_run_lock, rng_state,
                         set_rng_state)
from .config import Config, ConfigError, check_data, config_from_dict, yaml_value
from .data import (DataStream, TokenWindows, check_same_tokenizer, data_change_warning,
                   data_fingerprint, eval_batches, stop_signals_taken)
from .hf import load_initial_weights
from .monitor import Monitor, StepProfiler, claim_log_dir, info, survive_a_lost_terminal
from .optim import build_optimizer, lr_at, set_lr


class StopRequested:
    """SIGTERM/SIGINT/SIGHUP: stop at the next decision point (every step in one process, the next
    log step with several: all processes stop at the same step), save, exit 0. A second SIGINT
    exits at once, unless it comes within ``SAME_INTERRUPT_S`` of the first: one Ctrl+C reaches a
    worker twice, from the terminal (its process group) and from the launcher that passes it on
    (torchrun, train_xla.py's xmp.spawn), and must not count as two. A SIGHUP that the process
    was started ignoring (``nohup``) stays ignored: a hang-up then is no stop."""

    SAME_INTERRUPT_S = 1.0

    def __init__(self, clock=time.monotonic):
        self.requested = False
        self.signal_name = ""
        self._old = {}
        self._clock, self._first_at = clock, 0.0

    def install(self) -> "StopRequested":
        if self._old:
            return self
        for sig in stop_signals_taken():
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def _handle(self, signum, frame):
        if self.requested:
            if signum == signal.SIGINT and self._clock() - self._first_at > self.SAME_INTERRUPT_S:
                self._say("second interrupt: exiting now without saving")
                os._exit(130)
            return
        self.requested, self._first_at = True, self._clock()
        self.signal_name = signal.Signals(signum).name
        self._say(f"{self.signal_name} received: stopping at the next decision step, saving a checkpoint, "
                  "then exiting (Ctrl+C again to exit at once)")

    @staticmethod
    def _say(msg: str) -> None:
        """A line on stderr from the handler, written to the file descriptor: the handler runs
        between two bytecodes of the main thread, which may be inside a write to ``sys.stderr``
        (a log line, tqdm's redraw), and Python's buffered streams refuse a reentrant write with a
        RuntimeError in the main thread (the run died instead of stopping). On a terminal the line
        first clears a progress bar's partial line."""
        try:
            lead = "\r\x1b[K" if os.isatty(2) else ""
            os.write(2, f"{lead}{msg}\n".encode())
        except OSError:
            pass

    def cause(self) -> str:
        """What asked for the stop that every process decided on, for the closing line."""
        return self.signal_name or "a stop signal on another process"

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

# Processes that do not take the stop decision after every step (train_xla.py with several
# processes, whose hosts trace ahead of the device) take it about this often, and at log steps.
DECISION_SECONDS = 1.0


def decision_interval(seconds_per_step: float, log_interval: int) -> int:
    """Steps between two stop decisions for ``seconds_per_step``: about ``DECISION_SECONDS`` of
    steps, at least one, at most ``log_interval`` (log steps decide anyway). A preemption's
    SIGTERM is then acted on within a second or one step (GCE gives 30 s), not a log interval
    later (10 steps of ~12 s for nash_mhc_3b.yaml on a v4-32: two minutes)."""
    if not seconds_per_step > 0:
        return 1
    return max(1, min(log_interval, int(DECISION_SECONDS / seconds_per_step)))


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


def step_seed(seed: int, replica: int, step: int) -> int:
    """The seed of the random draws (dropout) of optimiser step ``step`` (0-based) on data-parallel
    replica ``replica``: numpy's ``SeedSequence`` of the three, 63 bits. Replicas draw different
    masks, and a step draws the same ones whether the run was resumed before it or not (nothing
    about the generator needs to be in a checkpoint)."""
    ss = np.random.SeedSequence(seed % 2**64, spawn_key=(replica, step))
    return int(ss.generate_state(1, np.uint64)[0] >> np.uint64(1))


def settings_warnings(cfg: Config, tokens_per_step: int, data_vocab: int | None = None,
                      max_steps: int | None = None) -> list[str]:
    """Settings that are legal but do nothing, or not what they say, in this config (``data_vocab``:
    the data's vocabulary, from its meta.json; ``max_steps``: the run's, from total_tokens too)."""
    m, t, out = cfg.model, cfg.training, []
    if max_steps is not None and t.warmup_steps >= max_steps:
        out.append(f"warning: training.warmup_steps={t.warmup_steps} is not below the run's {max_steps:,} "
                   "steps: the learning rate rises for the whole run and never decays")
    elif max_steps is not None and t.warmup_steps and t.warmup_steps == max_steps - 1 and t.schedule == "cosine":
        # the cosine's one step (its progress 0 of at least 1) is at the peak
        out.append(f"warning: training.warmup_steps={t.warmup_steps} leaves one of the run's {max_steps:,} "
                   "steps after warmup, at the peak learning rate: it never decays")
    c = cfg.checkpoint
    if c.keep_every and c.interval and c.keep_every % c.interval:
        every = math.lcm(c.keep_every, c.interval)
        out.append(f"warning: checkpoint.keep_every={c.keep_every} is not a multiple of checkpoint.interval="
                   f"{c.interval}: the checkpoints kept are those at multiples of {every:,}")
    if max_steps is not None and cfg.logging.profile_start > max_steps:
        out.append(f"warning: logging.profile_start={cfg.logging.profile_start} is past the run's "
                   f"{max_steps:,} steps: nothing is profiled")
    if data_vocab is not None and m.vocab_size > 2 * data_vocab:
        unused = m.vocab_size - data_vocab
        weights = unused * m.d_model * (1 if m.tie_embeddings else 2)
        out.append(f"warning: model.vocab_size={m.vocab_size:,} is {m.vocab_size / data_vocab:.1f}x the data's "
                   f"vocabulary ({data_vocab:,} in {cfg.data.dir}): {unused:,} token ids never occur "
                   f"({weights / 1e6:,.1f}M weights trained only towards zero probability); set "
                   f"model.vocab_size to the data's (or a multiple of 64 just above it)")
    if m.nash_window and m.nash_window >= cfg.data.seq_len:
        out.append(f"warning: model.nash_window={m.nash_window} is not below data.seq_len={cfg.data.seq_len}: "
                   "scale 0 attends to every earlier token, as with nash_window: 0")
    if m.aggregation == "nash" and m.nash_scales == 2:
        out.append("warning: model.aggregation=nash with model.nash_scales=2 is the mean of the two scales: "
                   "the game's two players are alike, so from its uniform start every round gives each the "
                   "same weight, and model.nash_tau never trains; use nash_scales >= 3, or aggregation: mean")
    if m.mhc_streams == 1 and m.stream_dtype != "fp32":
        out.append(f"warning: model.stream_dtype={m.stream_dtype} applies to mHC's streams, and "
                   "model.mhc_streams=1 has none: the residual is in the parameters' dtype")
    if t.total_tokens is not None and t.total_tokens < tokens_per_step:
        out.append(f"warning: training.total_tokens={t.total_tokens:,} is less than one step's "
                   f"{tokens_per_step:,} tokens: the run is one step")
    return out


def architecture(m) -> dict:
    """The model settings that make the weights and what they compute, for comparing a checkpoint's
    with the config's: the SwiGLU width as ``ffn_hidden`` (``ffn_mult`` and ``ffn_multiple_of``
    are one way to spell it: an export to Llama and back gives 3.0 / 64 for 2.67 / 32), and
    without mHC's settings when there are no streams, the fusion's when there is one scale (they
    build nothing), dropout, activation checkpointing and the loss's chunking (free to change)."""
    a = {k: v for k, v in dataclasses.asdict(m).items() if k not in (
        "ffn_mult", "ffn_multiple_of", "dropout", "activation_checkpointing", "loss_chunk")}
    a["ffn_hidden"] = m.ffn_hidden
    if m.mhc_streams == 1:
        for k in ("mhc_lite", "sinkhorn_iters", "stream_dtype"):
            del a[k]
    if m.nash_scales == 1:
        for k in ("nash_compression", "nash_iters", "nash_tau", "nash_pool", "aggregation"):
            del a[k]
    return a


def check_resume_compatible(cfg: Config, ckpt: dict, path: Path, optimizer: bool = True) -> None:
    """The architecture of a checkpoint must match the config's (anything else may change); so
    must the optimizer when its state is to be loaded (``optimizer``; ``init_from`` takes the
    weights only)."""
    try:
        saved = config_from_dict(ckpt["config"]).model
    except (ConfigError, KeyError) as e:
        raise CheckpointError(f"{path}: stored config unreadable ({e})") from None
    was, now = architecture(saved), architecture(cfg.model)
    # a key one side lacks (mHC's without streams) differs because mhc_streams or nash_scales does,
    # which is said: only the keys both have are listed
    structural = [f"model.{k}: {yaml_value(was[k])} -> {yaml_value(now[k])}"
                  for k in was if k in now and was[k] != now[k]]
    if structural:
        raise CheckpointError(f"{path}: model config differs from the checkpoint's ({'; '.join(structural)})")
    if not optimizer:
        return
    try:
        saved_opt = ckpt["config"]["training"]["optimizer"]
    except (KeyError, TypeError):
        saved_opt = cfg.training.optimizer
    if saved_opt != cfg.training.optimizer:
        raise CheckpointError(f"{path}: training.optimizer {saved_opt!r} -> {cfg.training.optimizer!r}: "
                              "the optimizer state does not carry over (use the checkpoint's optimizer, "
                              "or checkpoint.resume=none)")


class Trainer:
    """One training run, in named pieces: set-up (``__init__``), ``train_step``, ``evaluate``,
    ``log`` (on the host, at log steps), ``should_stop`` (decisions every process takes together),
    ``save`` (through a ``Checkpointer``) and ``fit``, the loop that calls them.

    ``fit()`` returns the process exit code: 0 done or stopped by a signal (after saving), 3 after
    ``training.max_nonfinite_steps`` non-finite steps in a row (after saving the last good state).
    """

    def __init__(self, cfg: Config, backend: Backend):
        self.cfg, self.backend = cfg, backend
        t_cfg, d_cfg = cfg.training, cfg.data
        self.meta = check_data(cfg)
        self.run_dir = Path(cfg.checkpoint.dir).expanduser()
        self.log_dir = Path(cfg.logging.dir).expanduser() if cfg.logging.dir else self.run_dir
        self.log_line = info if backend.is_master else (lambda msg: None)

        # -- data sizes and the schedule ---------------------------------------------------------
        # every process opens the shards itself: one host's missing or damaged shard stops all of
        # them with its reason (the launch agreement compared meta.json only). The evaluation's
        # batches are the same every time: their token ids are checked here, once (evaluation
        # runs the model's collectives under FSDP2, where one process stopping alone in it would
        # leave the others waiting)
        error = None
        try:
            self.train_ds = TokenWindows(d_cfg.dir, "train", d_cfg.seq_len)
            self.val_ds = TokenWindows(d_cfg.dir, "val", d_cfg.seq_len)
            per_batch = t_cfg.batch_size * backend.world_size
            self.val_ds.check_ids(range(min(cfg.evaluation.steps, len(self.val_ds) // per_batch) * per_batch))
        except ConfigError as e:
            error = e
        backend.host.raise_together(error, ConfigError)
        for split, ds in (("train", self.train_ds), ("val", self.val_ds)):
            if (unused := ds.unused_warning(split)) is not None:
                self.log_line(unused)
        self.replicas = replicas = backend.world_size
        if len(self.val_ds) < t_cfg.batch_size * replicas:
            raise ConfigError(f"data.dir: the val split has {len(self.val_ds)} windows of "
                              f"{d_cfg.seq_len + 1} tokens, fewer than one global batch "
                              f"({t_cfg.batch_size} x {replicas})")
        self.max_steps = cfg.resolve_steps(replicas)
        self.tokens_per_step = cfg.tokens_per_step(replicas)

        # -- the model and the resume point ------------------------------------------------------
        seed_everything(t_cfg.seed)
        # same seed on every process: identical initial weights (or, under FSDP2, rank 0's only)
        model = backend.new_model(lambda: NashMHC(cfg.model))
        holds_weights = not next(model.parameters()).is_meta
        self.state = RunState()
        self.checkpointer = Checkpointer(self.run_dir, cfg.checkpoint.keep, backend, self.log_line,
                                         async_save=cfg.checkpoint.async_, keep_every=cfg.checkpoint.keep_every)
        resumed = self.checkpointer.find(cfg.checkpoint.resume)
        if cfg.logging.dir:  # the master's to write: its verdict is everyone's
            error = claim_log_dir(self.log_dir, self.run_dir) if backend.is_master else None
            backend.host.raise_together(ConfigError(error) if error else None, ConfigError)
        if resumed is None and cfg.checkpoint.init_from:
            error = init = None
            if holds_weights:  # under FSDP2 rank 0 alone reads and checks them, and sends them
                try:
                    init_path, init = load_initial_weights(cfg.checkpoint.init_from, warn=self.log_line)
                    check_resume_compatible(cfg, init, init_path, optimizer=False)
                    check_same_tokenizer(init, self.meta, init_path, cfg.data.dir)
                except (CheckpointError, ConfigError) as e:
                    error = e
            backend.host.raise_together(error, CheckpointError)  # all stop, or none
            if init is not None:
                model.load_state_dict(init["model"])
                self.log_line(f"initial weights from {init_path}")
                del init
        self.finished = False
        self.saved_step = None  # the step of this run's latest save
        # The schedule's position is the step, or with a token budget the tokens trained on in
        # steps of this run's size: the same when the tokens per step did not change since the
        # checkpoint, and a continuation of the cosine where they did (lr_at takes a fraction).
        self.schedule_shift = 0.0
        if resumed is not None:
            ckpt_path, ckpt = resumed
            check_resume_compatible(cfg, ckpt, ckpt_path)
            check_same_tokenizer(ckpt, self.meta, ckpt_path, cfg.data.dir)
            if t_cfg.total_tokens is not None:
                step, seen = int(ckpt["step"]), int(ckpt["tokens_seen"])
                self.max_steps = cfg.resolve_steps(replicas, step, seen)
                self.schedule_shift = seen / self.tokens_per_step - step
            if int(ckpt["step"]) >= self.max_steps:
                # Nothing to do: no data workers, no compilation, and the checkpoint stays as it is.
                self.log_line(
                    f"{ckpt_path} is at step {int(ckpt['step'])}: this run is done "
                    f"({self.max_steps:,} steps). Raise training.max_steps (or training.total_tokens) "
                    "to train further, or use another checkpoint.dir to start over.")
                self.finished = True
                return
        self._log_start(model)

        # -- device placement, the optimiser, then the saved state into them ---------------------
        self.train_model = backend.prepare_model(model, cfg)
        self.model = raw_model = backend.unwrap(self.train_model)
        self.optimizer = build_optimizer(raw_model, t_cfg, backend.adamw_factory())
        if hasattr(self.optimizer, "init_state"):
            self.optimizer.init_state()  # state exists before step 1: step 1 traces the steady graph
        backend.prepare_optimizer(self.optimizer)
        if resumed is not None:
            self.checkpointer.restore(ckpt_path, ckpt, self.train_model, self.optimizer)
            self._restore_state(ckpt_path, ckpt)
            del ckpt, resumed

        # -- data on the device, logging, signals ------------------------------------------------
        state = self.state
        self.stream = DataStream(self.train_ds, t_cfg.batch_size, replicas, backend.rank, t_cfg.seed,
                                 num_workers=d_cfg.num_workers)
        self.stream.set_position(state.epoch, state.offset)
        self.batches = backend.batches(self.stream)
        self.amp_dtype = backend.autocast_dtype(t_cfg.precision)
        self.monitor = Monitor(cfg, self.log_dir, backend.is_master, self.max_steps, state.step)
        self.profiler = StepProfiler(backend, self.log_dir / "profile", cfg.logging.profile_start,
                                     cfg.logging.profile_steps, self.max_steps, self.log_line)
        self.params = [p for p in raw_model.parameters() if p.requires_grad]
        self.flops_per_token = raw_model.flops_per_token(d_cfg.seq_len)
        self.peak = cfg.logging.peak_flops or backend.peak_flops(cfg.training.precision)

        # Device-side counters: no host sync needed to keep them. Cumulative, never reset: every
        # step then traces the same graph (XLA compiles it once).
        device = backend.device
        self.streak = torch.zeros((), device=device)        # non-finite steps in a row
        self.worst_streak = torch.zeros((), device=device)  # the longest such run in this process
        self.skipped = torch.zeros((), device=device)       # non-finite steps in this process
        # a micro-step's loss times 1, or NaN for a batch this process could not use: device data
        # either way, so that step traces the graph of every other (XLA compiles nothing new)
        self.loss_factor = {False: torch.ones((), device=device), True: torch.full((), math.nan, device=device)}
        self.keep_grads = backend.keep_gradients(self.params, t_cfg.gradient_accumulation_steps)
        backend.sync()  # materialise the counters and the optimiser state: step 1 = every later step
        self.value_names: list[str] = []  # what train_step's vector holds, in order

        # Host-side bookkeeping of the log steps.
        self.skipped_logged = 0
        self.stop_nonfinite = False
        # a batch this process could not use (a token id past the vocabulary): the others are in
        # the same step's collectives, so it is replaced and its step skipped, and every process
        # stops at the next decision (should_stop), each with this error
        self.data_error: ConfigError | None = None
        self.last_batch = None
        self.last_log_time, self.last_log_step = time.time(), state.step
        self.paused_seconds = 0.0  # evaluation and checkpoint saves since the last log line
        # The stop decisions (should_stop): when the last was taken, and the step of the next one
        # where the backend does not decide after every step.
        self.last_decision = (time.time(), state.step)
        self.next_decision = state.step + 1
        self.last_record: dict = {}
        self.start_tokens, self.start_step = state.tokens_seen, state.step

    def _log_start(self, model: NashMHC) -> None:
        cfg, t_cfg, backend = self.cfg, self.cfg.training, self.backend
        self.log_line(f"config (resolved):\n{_yaml(cfg.to_dict())}")
        split = backend.batch_split   # SPMD: one global batch over the mesh, not one per replica
        self.log_line(
            f"device: {backend.device_name()}{'' if split else f' x {self.replicas} replica(s)'} | model: "
            f"{model.num_params() / 1e6:.2f}M parameters | data: "
            f"{self.meta['splits']['train']['tokens']:,} train tokens, vocab {self.meta['vocab_size']}")
        per = (f"{t_cfg.batch_size} global (split over {split})" if split else
               f"{t_cfg.batch_size} per replica x {self.replicas} replica(s)")
        self.log_line(
            f"effective batch: {per} x {t_cfg.gradient_accumulation_steps} accumulation = "
            f"{t_cfg.batch_size * self.replicas * t_cfg.gradient_accumulation_steps} sequences = "
            f"{self.tokens_per_step:,} tokens per step; {self.max_steps:,} steps"
            + (f" (training.total_tokens={t_cfg.total_tokens:,})" if t_cfg.max_steps is None else ""))
        if split is None and cfg.xla.mode == "spmd" and self.replicas > 1:
            # a config written for train_xla.py's spmd mode (the 3B one) run under torchrun
            self.log_line(f"warning: the config's xla.mode is spmd, where training.batch_size={t_cfg.batch_size} is "
                          f"the global batch; here it is per process: {self.replicas} processes train "
                          f"{self.replicas}x as many sequences per step (set training.batch_size and "
                          "training.gradient_accumulation_steps for this run)")
        for warning in settings_warnings(cfg, self.tokens_per_step, self.meta["vocab_size"], self.max_steps):
            self.log_line(warning)
        e_cfg, global_batch = cfg.evaluation, t_cfg.batch_size * self.replicas
        if len(self.val_ds) // global_batch < e_cfg.steps:
            self.log_line(f"note: evaluation.steps={e_cfg.steps}, but the val split holds "
                          f"{len(self.val_ds) // global_batch} global batches of {global_batch}: "
                          "each evaluation uses those")

    def _restore_state(self, path: Path, ckpt: dict) -> None:
        """RNG, step, tokens, data position and counters from a checkpoint (the tensors are in)."""
        state = self.state
        set_rng_state(ckpt["rng"])
        state.step, state.tokens_seen = int(ckpt["step"]), int(ckpt["tokens_seen"])
        state.epoch, state.offset = int(ckpt["data"]["epoch"]), int(ckpt["data"]["offset"])
        state.nonfinite_total = int(ckpt.get("nonfinite", {}).get("total", 0))
        self.log_line(f"resumed from {path} at step {state.step} (epoch {state.epoch}, sample "
                      f"{state.offset}, {state.tokens_seen:,} tokens seen)")
        changed = data_change_warning(ckpt, self.meta, f"data.dir={self.cfg.data.dir} holds other data "
                                      f"now; training goes on at epoch {state.epoch}, sample "
                                      f"{state.offset} of this data's order")
        if changed:
            self.log_line(changed)
        try:
            saved_len = int(ckpt["config"]["data"]["seq_len"])
        except (KeyError, TypeError, ValueError):
            saved_len = self.cfg.data.seq_len
        if saved_len != self.cfg.data.seq_len:
            self.log_line(f"warning: data.seq_len {saved_len} -> {self.cfg.data.seq_len}: the data position "
                          f"counts windows of {saved_len} tokens, so training goes on at sample "
                          f"{state.offset} of epoch {state.epoch} in the order of the new windows, "
                          "not where the run stopped")
        try:
            saved_seed = int(ckpt["config"]["training"]["seed"])
        except (KeyError, TypeError, ValueError):
            saved_seed = self.cfg.training.seed
        if saved_seed != self.cfg.training.seed:  # the epochs' order is drawn from the seed
            self.log_line(f"warning: training.seed {saved_seed} -> {self.cfg.training.seed}: epoch "
                          f"{state.epoch} is drawn in another order, so its remaining samples are not "
                          "the ones the run had left (some come twice, some not at all)")

    def _count_skipped(self, skipped_now: int) -> None:
        """Fold this process's device counter of skipped steps (``self.skipped``, read at a log line
        or a save) into the run's total, which checkpoints carry across resumes."""
        self.state.nonfinite_total += skipped_now - self.skipped_logged
        self.skipped_logged = skipped_now

    def tokens_at(self, step: int) -> int:
        return self.start_tokens + (step - self.start_step) * self.tokens_per_step

    # -- the step ----------------------------------------------------------------------------
    def train_step(self, lr: float) -> torch.Tensor:
        """One optimiser step at learning rate ``lr``: ``accumulation`` micro-steps of forward and
        backward, the gradient reduction, clipping of the reduced gradient, an update that is
        skipped when the loss or the gradient is not finite, and the device-side counters.

        Returns the step's values (``self.value_names``) stacked in one device vector, averaged
        over replicas: read on the host at log steps only, as one transfer. The same outputs
        every step, so that every step traces the same graphs. On XLA those are two, whatever the
        accumulation and the log interval: the micro-step (forward, backward, gradients added
        into buffers that exist) and the update (the loader's sync ends each micro-step).
        """
        t_cfg, backend, optimizer = self.cfg.training, self.backend, self.optimizer
        accum = t_cfg.gradient_accumulation_steps
        set_lr(optimizer, lr / t_cfg.learning_rate)
        backend.seed_rng(step_seed(t_cfg.seed, backend.rank, self.state.step))
        micro_losses, micro_metrics = [], []
        for micro in range(accum):
            bad_batch = False
            try:
                x, y = self.last_batch = next(self.batches)
            except StopIteration:
                # the training stream never ends: its loader stopped because it failed (torch_xla's
                # ParallelLoader prints the error in its thread and ends the stream)
                raise RuntimeError("the data loader stopped: loading failed (the error is printed above)") from None
            except ConfigError as e:   # this process's batch only: step on with a harmless one
                self.data_error, bad_batch = self.data_error or e, True
                x, y = self.last_batch or tuple(t.to(backend.device) for t in self.stream.placeholder())
            with backend.no_sync(self.train_model, last_micro_step=micro == accum - 1):
                with backend.autocast(self.amp_dtype):
                    out = self.train_model(x, y)
                out.logits = None  # [batch, seq, vocab], unused: free it now (and keep it out of XLA's outputs)
                (out.loss / accum).backward()
            micro_losses.append(out.loss.detach().float() * self.loss_factor[bad_batch])  # NaN: skipped everywhere
            micro_metrics.append(out.metrics)
        backend.sync()  # XLA: the update is its own graph, the same for every accumulation
        backend.reduce_gradients(optimizer)
        grads = [p.grad for p in self.params if p.grad is not None]
        grad_norm = backend.grad_norm(grads)
        if t_cfg.grad_clip > 0:
            torch.nn.utils.clip_grads_with_norm_(self.params, t_cfg.grad_clip, grad_norm)
        # the loss and the model's statistics of the whole batch: the micro-batches' means, taken
        # here (an add inside the micro-steps would make the first one's graph differ from the rest)
        loss = _micro_mean(micro_losses)
        model_metrics = {k: _micro_mean([m[k].float() for m in micro_metrics]) for k in micro_metrics[0]}
        # skip or not: decided together, on the replicas' mean loss and the reduced gradients'
        # norm (a loss that is not finite on one replica only must not skip the step there alone)
        ok = torch.isfinite(backend.mean_across(loss)) & torch.isfinite(grad_norm)
        optimizer.found_inf = (~ok).float()
        optimizer.step()
        optimizer.zero_grad(set_to_none=not self.keep_grads)
        bad = (~ok).float()
        self.streak = (self.streak + 1) * bad
        self.worst_streak = torch.maximum(self.worst_streak, self.streak)
        self.skipped = self.skipped + bad
        values = {"loss": loss, "grad_norm": grad_norm, "_skipped": self.skipped,
                  "_worst_streak": self.worst_streak, **model_metrics}
        self.value_names = list(values)
        return backend.mean_across(torch.stack([backend.whole(v).float() for v in values.values()]))

    # -- evaluation --------------------------------------------------------------------------
    def evaluate(self) -> torch.Tensor:
        """Mean validation loss over the same ``evaluation.steps`` batches every time (a device
        tensor, averaged over replicas)."""
        backend, model = self.backend, self.model
        backend.wait_host()     # a pending log line's clock is read before this pause, as at a save
        backend.wait_device()   # the step before is training time, the evaluation's work is not
        t0 = time.time()
        model.eval()
        batch_losses = []
        with torch.no_grad():
            for x, y in backend.batches(eval_batches(self.val_ds, self.cfg.training.batch_size,
                                                      self.cfg.evaluation.steps, self.replicas,
                                                      backend.rank)):
                with backend.autocast(self.amp_dtype):
                    batch_losses.append(model(x, y).loss.float())
                backend.sync()  # one forward graph, the same for every batch
        model.train()
        loss = backend.mean_across(torch.stack(batch_losses).mean())
        backend.wait_device()
        self.paused_seconds += time.time() - t0
        return loss

    # -- logging -----------------------------------------------------------------------------
    def log(self, numbers: list[float], names: list[str], step: int, lr: float, paused_s: float) -> None:
        """A log step's values (``numbers``, named ``names``), on the host once computed (XLA: in
        an asynchronous step closure, while the loop runs on): metrics.jsonl, the progress bar,
        TensorBoard/W&B, the non-finite counters. ``paused_s``: time since the last line spent in
        evaluation and checkpoint saves, left out of the training throughput."""
        t_cfg, state = self.cfg.training, self.state
        values = dict(zip(names, numbers))
        now = time.time()
        dt = max(now - self.last_log_time - paused_s, 1e-9)  # training time only
        steps = step - self.last_log_step
        self.last_log_time, self.last_log_step = now, step
        # whole numbers, averaged over replicas: XLA's all-reduce multiplies by float32(1/n), which
        # can give k - 1 ulp (k = 5 over 244 processes: 4.9999995), so rounded, not truncated
        self._count_skipped(round(values.pop("_skipped")))
        if round(values.pop("_worst_streak")) >= t_cfg.max_nonfinite_steps:
            self.stop_nonfinite = True
        rec = {"loss": values.pop("loss"), "lr": lr, "grad_norm": values.pop("grad_norm"),
               "tokens_seen": self.tokens_at(step)}
        if steps > 0:
            rec["tokens_per_sec"] = steps * self.tokens_per_step / dt
            rec["step_time"] = dt / steps
            if self.peak:  # one device's peak, times the devices the step runs on
                rec["mfu"] = (rec["tokens_per_sec"] * self.flops_per_token
                              / (self.peak * self.backend.n_devices))
        if "eval_loss" in values:
            rec["eval_loss"] = values.pop("eval_loss")
            rec["eval_ppl"] = math.exp(rec["eval_loss"]) if rec["eval_loss"] < 700 else math.inf
        rec["nonfinite_skipped"] = state.nonfinite_total
        rec.update(values)  # model metrics (nash entropy, mHC gates, ...)
        rec.update(self.backend.log_extras())
        self.last_record = rec
        self.monitor.log(step, rec)
        if "eval_loss" in rec:
            self.log_line(f"step {step}: loss {rec['loss']:.4f} | val loss {rec['eval_loss']:.4f} "
                          f"(ppl {rec['eval_ppl']:.2f})")

    # -- decisions taken by every process together -------------------------------------------
    def should_stop(self) -> str | None:
        """``"nonfinite"``, ``"signal"`` or ``None``: the same answer on every process, from one
        host-side all-reduce of both flags (a SIGTERM that reached one host stops them all). The
        same all-reduce agrees on the step of the next decision (``next_decision``): this
        process's ``decision_interval``, the slowest process's where they differ."""
        now, step = time.time(), self.state.step
        (then, before), interval = self.last_decision, 1
        if step > before:
            interval = decision_interval((now - then) / (step - before), self.cfg.logging.interval)
        nonfinite, signalled, fewest, bad_data, save_failed = self.backend.max_across(
            self.stop_nonfinite, STOP.requested, -interval, self.data_error is not None,
            self.checkpointer.failed())
        self.last_decision, self.next_decision = (now, step), step - fewest
        if bad_data:   # every process takes part: the failing one's reason for all
            self.backend.host.raise_together(self.data_error, ConfigError)
        if save_failed:  # an asynchronous save that failed: said now, not at the next save an interval on
            self.checkpointer.wait()
        if nonfinite:
            return "nonfinite"
        if signalled:
            return "signal"
        return None

    # -- checkpoints -------------------------------------------------------------------------
    def save(self, reason: str, wait: bool = False) -> None:
        """Checkpoint the model, optimiser and run state (``wait``: synchronously even with
        ``checkpoint.async``, as the last save of a run is)."""
        state = self.state
        self.backend.wait_host()  # pending log lines update state.nonfinite_total
        self.backend.wait_device()  # the steps before are training time, not the save's
        # and the steps skipped since the last log line (a save between log steps recorded only
        # those logged, and the resumed run's count stayed short for good): one read, at a save
        self._count_skipped(int(self.skipped.cpu()))   # a transfer, not .item() (an aten fallback on XLA)
        t0 = time.time()  # after the last log line's clock: the pause starts here
        pos = self.stream.advance(state.epoch, state.offset, state.batches_done)
        meta = {
            "format_version": FORMAT_VERSION,
            "step": state.step,
            "tokens_seen": state.tokens_seen,
            "data": {"epoch": pos[0], "offset": pos[1], "fingerprint": data_fingerprint(self.meta),
                     "tokenizer_sha256": self.meta.get("tokenizer_sha256")},
            "rng": rng_state(),
            "nonfinite": {"total": state.nonfinite_total},
            "config": self.cfg.to_dict(),
            "trainer": self.backend.name,
        }
        self.checkpointer.save(meta, self.train_model, self.optimizer, reason, wait=wait)
        self.saved_step = state.step
        self.paused_seconds += time.time() - t0  # not training time: left out of tokens_per_sec

    # -- the loop ----------------------------------------------------------------------------
    def fit(self) -> int:
        """Train to ``max_steps`` (or a stop decision), save, and return the exit code."""
        if self.finished:
            return 0
        STOP.install()  # train() installed it before start-up already
        try:
            if self.should_stop() == "signal":  # during start-up (a checkpoint loading, a compile)
                self.log_line(f"stopped before step {self.state.step + 1} after {STOP.cause()}: nothing new to "
                              "save; resume with the same command")
                self._close()
                return 0
            return self._finish(self._train_loop())
        finally:
            STOP.restore()  # after the last save: a signal repeated during it must not cut it short

    def _train_loop(self) -> str:
        """The steps, until ``max_steps`` or a stop decision; returns why it ended."""
        cfg, t_cfg, backend, state = self.cfg, self.cfg.training, self.backend, self.state
        self.train_model.train()
        exit_reason = "done"
        try:
            while state.step < self.max_steps:
                lr = lr_at(state.step + self.schedule_shift, self.max_steps + self.schedule_shift,
                           t_cfg.learning_rate, t_cfg.warmup_steps, t_cfg.min_lr_ratio,
                           t_cfg.schedule, t_cfg.decay_ratio, t_cfg.decay_shape)
                with self.profiler.step(state.step + 1):
                    values = self.train_step(lr)
                state.step += 1
                state.batches_done += t_cfg.gradient_accumulation_steps
                state.tokens_seen = self.tokens_at(state.step)
                last = state.step == self.max_steps
                do_eval = last or (cfg.evaluation.interval > 0 and state.step % cfg.evaluation.interval == 0)
                do_log = last or do_eval or state.step % cfg.logging.interval == 0
                names = self.value_names
                if do_eval:
                    backend.sync()  # the step's graphs alone, as on every step; then evaluation's
                    values, names = torch.cat([values, self.evaluate().view(1)]), names + ["eval_loss"]
                if do_log:
                    paused_s, self.paused_seconds = self.paused_seconds, 0.0
                    backend.on_host(self.log, values, names, state.step, lr, paused_s)
                backend.sync()
                self.monitor.advance(state.step)
                self.paused_seconds += self.profiler.after(state.step)

                saving = cfg.checkpoint.interval > 0 and state.step % cfg.checkpoint.interval == 0 and not last
                # Decisions together, after every step (Backend.decides_every_step) or at the
                # steps agreed at the decision before and at log steps (every process logs at the
                # same steps); before a periodic save, so that a batch some process could not use
                # stops the run before this step's state is saved (on XLA SPMD across hosts the
                # step may have been skipped on that host's chips only); and after it, so that a
                # stop requested during the save ends the run on the state it just saved.
                if saving or do_log or backend.decides_every_step or state.step >= self.next_decision:
                    reason = self.should_stop()
                    if reason is not None:
                        exit_reason = reason
                        break
                if saving:
                    self.save("interval")
                    reason = self.should_stop()
                    if reason is not None:
                        exit_reason = reason
                        break
        except BaseException:
            try:
                self.checkpointer.wait(quiet=True)  # a save in flight still commits if it can
            finally:  # a second Ctrl+C during that wait: the data workers are still stopped
                self._close(after_error=True)
            raise
        self._close()
        return exit_reason

    def _close(self, after_error: bool = False) -> None:
        """Flush the logs, stop the data. Each step runs even if one before it fails: data workers
        left running would hang the exit (they ignore SIGTERM, which multiprocessing sends them
        before it joins them). ``after_error``: the loop is ending with an error, which stays the
        one reported (a failure here is a warning line; it would otherwise replace it, and a one-line
        ``CheckpointError`` would become another exception's traceback)."""
        try:
            with contextlib.ExitStack() as cleanup:  # callbacks run last in, first out
                cleanup.callback(self.stream.close)
                cleanup.callback(self.backend.close_batches, self.batches)  # stop prefetching, join the workers
                cleanup.callback(self.monitor.close)
                cleanup.callback(self.backend.wait_host)  # the last log lines reach metrics.jsonl first
                cleanup.callback(self.profiler.close)  # a run stopped inside the window: what it traced
        except Exception as e:
            if not after_error:
                raise
            print(f"warning: stopping after the error below, closing the logs and data also failed: "
                  f"{type(e).__name__}: {first_line(e)}", file=sys.stderr)

    def _save_last(self, reason: str) -> None:
        """The run's last save, committed before returning; none when the periodic save of this
        very step is the state (a stop decided right after it): that one is waited for."""
        if self.saved_step == self.state.step:
            self.checkpointer.wait()
        else:
            self.save(reason, wait=True)

    def _weights_finite(self) -> bool:
        """Are the model's weights finite on every process (each process checks its own shards)?
        One device-to-host transfer and one host-side agreement, at a non-finite stop only."""
        shards = [p.detach().to_local() if hasattr(p, "to_local") else p.detach() for p in self.params]
        bad = torch.stack([~torch.isfinite(t).all() for t in shards]).any()
        return not self.backend.any_process(bool(bad.cpu()))

    def _finish(self, exit_reason: str) -> int:
        state = self.state
        if exit_reason == "signal" and state.step >= self.max_steps:
            exit_reason = "done"   # the stop came with the last step: the run is complete
        if exit_reason == "done" and self.should_stop() == "nonfinite":
            # the last steps' log lines ran after the loop's last decision (on XLA the host reads
            # them in an asynchronous closure): a run that diverged at its end is not "done"
            exit_reason = "nonfinite"
        if exit_reason == "nonfinite":
            what = (f"error: the loss or gradient was NaN/Inf for {self.cfg.training.max_nonfinite_steps} "
                    f"steps in a row (step {state.step})")
            if self._weights_finite():
                self._save_last("non-finite loss")
                self.log_line(f"{what}; updates were skipped from the first of them, so the checkpoint "
                              "holds the weights that step saw. Lower training.learning_rate, check "
                              "the data, or use precision=fp32.")
            else:  # saved, they would replace a checkpoint that can be resumed from (rotation)
                # but a periodic save still being written (checkpoint.async) is of finite weights:
                # it is finished, not cut off by the interpreter's exit with its daemon thread
                self.checkpointer.wait()
                self.log_line(f"{what}, and the weights themselves are NaN/Inf (an update overflowed "
                              "them): nothing was saved. Resume from a checkpoint of a step before the "
                              "loss stopped being finite (metrics.jsonl) with a lower "
                              "training.learning_rate.")
            self.backend.finish(self.log_dir, self.log_line)
            return 3
        self._save_last("signal" if exit_reason == "signal" else "final")
        if exit_reason == "signal":
            self.log_line(f"stopped at step {state.step} after {STOP.cause()}; resume with the same command")
        elif "eval_loss" in self.last_record:
            last = self.last_record
            self.log_line(f"done: {state.step} steps, {state.tokens_seen:,} tokens; final val loss "
                          f"{last['eval_loss']:.4f} (ppl {last['eval_ppl']:.2f})")
        self.backend.finish(self.log_dir, self.log_line)
        return 0


def _micro_mean(values: list[torch.Tensor]) -> torch.Tensor:
    """The micro-steps' mean of a step's value; without accumulation the value itself (no op)."""
    return values[0] if len(values) == 1 else torch.stack(values).mean()


def train(cfg: Config, backend: Backend) -> int:
    """Run (or resume) training as the config says; returns the process exit code. A SIGTERM or
    Ctrl+C from here on asks for a stop (start-up included), which ``fit`` honours; a terminal
    lost on the way (the ssh session that started a pod run) does not end it (here again for
    the processes xmp.spawn starts, which do not run ``main``)."""
    survive_a_lost_terminal()
    STOP.install()
    try:
        return Trainer(cfg, backend).fit()
    finally:
        STOP.restore()
        release_run_lock(cfg.checkpoint.dir)


def _yaml(tree: dict) -> str:
    import yaml
    return yaml.safe_dump(tree, sort_keys=False, default_flow_style=None).rstrip()


def main(argv: list[str] | None, make_backend, prog: str, entry: str = "torch",
         launched_together=None) -> int:
    """Command-line entry shared by train.py and train_xla.py (``entry`` "torch" or "xla"): config
    errors are one line, exit 2. ``--plan`` prints the memory and time plan instead of training
    (training/plan.py): exit 0 if it fits, 1 if not.

    ``launched_together(cfg)``: whether this process is one of several started separately
    (torchrun's processes, a TPU pod's hosts), asked only when ``check_data`` fails here. Such a
    process goes on to make its backend instead of exiting: the others would wait for it in the
    process group's rendezvous (30 minutes). The backend's launch agreement runs ``check_data``
    again, with them, and every process exits 2 with the same line."""
    import argparse
    from .config import load_config

    parser = argparse.ArgumentParser(prog=prog, description="Train a Nash-MHC transformer.")
    parser.add_argument("config", help="YAML config (see configs/)")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    plan = parser.add_argument_group("plan (nothing is allocated, no device or data needed)")
    plan.add_argument("--plan", action="store_true",
                      help="print per-chip memory by part and the time to the token budget, then exit: "
                           "0 if it fits, 1 if not")
    plan.add_argument("--device-kind", help="v6e, v5p, v5e, v4 (train_xla.py); h100, h200, a100, "
                                            "a100-40 (train.py); cpu (default: the accelerator here, else cpu)")
    plan.add_argument("--mfu", help="assumed model FLOPs utilisation (default 0.4)")
    plan.add_argument("--world-size", help="replicas in ddp mode: default WORLD_SIZE or 1 for train.py; "
                      "xla.nprocs, else the TPU slice's chips, else 1 for train_xla.py")
    plan.add_argument("--margin", help="share of the chip's memory kept free (default 0.1)")
    plan.add_argument("--usd-per-chip-hour", help="price, to turn chip-hours into dollars")

    def one_line_error(message: str):  # argparse prints its usage first: a bad flag is one line here too
        print(f"{prog}: error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)

    parser.error = one_line_error
    argv = list(sys.argv[1:] if argv is None else argv)
    dashed = next((a for a in argv if re.fullmatch(r"--[A-Za-z_]\w*\.[\w.]+=.*", a)), None)
    if dashed:  # argparse would call every override after it unrecognised
        one_line_error(f"{dashed}: overrides take no leading --: {dashed[2:]}")
    args = parser.parse_intermixed_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        if args.plan:
            from .plan import run_plan
            return run_plan(cfg, entry, args.config, args.device_kind, _number(args.mfu or "0.4", "--mfu", 0, 1),
                            _number(args.world_size, "--world-size", 0, None, int),
                            _number(args.usd_per_chip_hour, "--usd-per-chip-hour", 0, None),
                            _number(args.margin or "0.1", "--margin", 0, 1, lo_open=False))
        extra = [f for f in ("device_kind", "mfu", "world_size", "margin", "usd_per_chip_hour")
                 if getattr(args, f) is not None]
        if extra:
            raise ConfigError(f"--{extra[0].replace('_', '-')} is a --plan option")
        try:
            check_data(cfg)
        except ConfigError:
            if launched_together is None or not launched_together(cfg):
                raise  # one process: said now, before anything is made
        survive_a_lost_terminal()  # from the launch on: the hosts' rendezvous can take minutes
        return make_backend(cfg)
    except (ConfigError, CheckpointError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2


def _number(text, flag: str, lo, hi, kind=float, lo_open: bool = True):
    """``text`` as a ``kind`` in (lo, hi] (``[lo, hi)`` without ``lo_open``), or a ConfigError; None stays None."""
    if text is None:
        return None
    try:
        value = kind(text)
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: expected {'an integer' if kind is int else 'a number'}") from None
    low_ok = value > lo if lo_open else value >= lo
    high_ok = hi is None or (value <= hi if lo_open else value < hi)
    if not (low_ok and high_ok and math.isfinite(value)):
        rng = f"{'(' if lo_open else '['}{lo}, {hi if hi is not None else 'inf'}{']' if lo_open else ')'}"
        raise ConfigError(f"{flag} {text!r}: expected a value in {rng}")
    return value
