"""Logging for the master process: a tqdm bar, metrics.jsonl, TensorBoard and (optionally) W&B.

Every other process gets a ``Monitor`` whose methods do nothing, so the loop calls it unguarded.
"""
from __future__ import annotations

import errno
import itertools
import json
import math
import os
import re
import secrets
import sys
import time
from pathlib import Path

from .checkpoint import atomic_write_text, first_line

# Dense peak FLOP/s of one GPU in the precision a run trains in there, for MFU (vendors' data
# sheets, without sparsity; TPUs are in TPU_DEVICE_KINDS): bf16, except on GPUs without bf16 (V100,
# T4), where training.precision bf16 falls back to fp32 (TorchBackend.autocast_dtype) and the fp32
# peak is the one to compare with.
# training.precision=fp32 on the others runs its matmuls in TF32 (TorchBackend enables it), whose
# dense peak is half the bf16 one on every GPU listed (A100 156, H100 SXM 495, L4 60 TFLOP/s).
# A key matches a device name that holds its words in order, whole: "L4" is not the "L40" in
# "NVIDIA L40"; the longest matching key wins ("H100 PCIe" over "H100", which is the SXM part;
# V100 the SXM2 part).
PEAK_FLOPS = {
    "B200": 2250e12, "GB200": 2500e12, "H200": 989e12, "H200 NVL": 835e12, "H20": 148e12,
    "H100": 989e12, "H100 PCIe": 756e12, "H100 NVL": 835e12, "H800": 989e12, "H800 PCIe": 756e12, "GH200": 989e12, "A100": 312e12, "A100X": 312e12, "A800": 312e12, "L40S": 362e12, "L40": 181e12,
    "L4": 121e12, "A10": 125e12, "A10G": 70e12, "RTX 4090": 165e12, "RTX 3090": 71e12,
    "V100": 15.7e12, "V100 PCIe": 14e12, "V100S": 16.4e12, "T4": 8.1e12,
}


# What torch_xla 2.9's ``xm.xla_device_kind()`` returns on each TPU generation, and the dense bf16
# peak FLOP/s of one chip (one PJRT device; v4 and v5p chips are megacore). Matched exactly:
# "TPU v5" is a v5p, which a substring match would confuse with "TPU v5 lite" (v5e).
TPU_DEVICE_KINDS = {
    "TPU v4": ("v4", 275e12),
    "TPU v5 lite": ("v5e", 197e12),
    "TPU v5": ("v5p", 459e12),
    "TPU v6 lite": ("v6e", 918e12),
}


FP32_ONLY = {"V100", "V100 PCIe", "V100S", "T4"}  # no bf16, no TF32: their PEAK_FLOPS entry is the fp32 peak


def peak_flops_for(device_name: str, precision: str = "bf16") -> float | None:
    """Dense peak FLOP/s of one device for a run in ``training.precision``: a TPU by its exact
    ``xla_device_kind`` (bf16 in both precisions: XLA's default matmul precision for fp32 inputs
    on TPU is one bf16 pass), a GPU by name (fp32: its TF32 peak where it has one)."""
    kind = TPU_DEVICE_KINDS.get(" ".join(device_name.split()))
    if kind is not None:
        return kind[1]
    words = _words(device_name)
    for key in sorted(PEAK_FLOPS, key=len, reverse=True):
        k = _words(key)
        if any(words[i:i + len(k)] == k for i in range(len(words) - len(k) + 1)):
            tf32 = precision == "fp32" and key not in FP32_ONLY
            return PEAK_FLOPS[key] / 2 if tf32 else PEAK_FLOPS[key]
    return None


def _words(name: str) -> list[str]:
    """"NVIDIA A100-SXM4-80GB" -> ["nvidia", "a100", "sxm4", "80gb"]."""
    return re.findall(r"[a-z0-9]+", name.lower())


# A stream whose reader is gone: a closed pipe or socket, a hung-up terminal.
_READER_GONE = {errno.EPIPE, errno.ECONNRESET, errno.EIO}


class _LostTerminalSafe:
    """stdout or stderr that outlives its reader: a pod run started over ssh lost its terminal when
    the session ended (Ctrl+C on the laptop, a dropped connection), and the master's next progress
    line raised BrokenPipeError (EIO on a hung-up tty): it died without a checkpoint while the other
    hosts waited for it. The first write that finds the reader gone points the descriptor at
    /dev/null; moving the descriptor, not just this object, also quiets what still writes there
    (Python's own flush at exit, which turned a clean end into exit code 120, and C++ logs). Another
    error (a full disk under ``> train.log``) loses that write only."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text):
        try:
            return self._stream.write(text)
        except OSError as e:
            self._failed(e)
            return len(text)

    def flush(self):
        try:
            self._stream.flush()
        except OSError as e:
            self._failed(e)

    def _failed(self, e: OSError) -> None:
        if e.errno in _READER_GONE:
            self._to_null()

    def _to_null(self) -> None:
        try:
            null = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(null, self._stream.fileno())
            finally:
                os.close(null)
            self._stream.flush()  # what the failed write left in the buffer
        except (OSError, ValueError):  # no descriptor (a test's capture): drop this stream's output
            self._stream = open(os.devnull, "w")

    def __getattr__(self, name):
        return getattr(self._stream, name)


def survive_a_lost_terminal() -> None:
    """From here on, a closed stdout or stderr drops this process's output instead of ending it
    (``_LostTerminalSafe``); the run, its checkpoints and its metrics files go on."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _LostTerminalSafe):
            setattr(sys, name, _LostTerminalSafe(stream))


def info(msg: str) -> None:
    """A line for the user, on stderr so it never mixes with a tqdm bar's redraws."""
    try:
        from tqdm import tqdm
        tqdm.write(msg, file=sys.stderr)
    except ImportError:
        print(msg, file=sys.stderr, flush=True)


def _set_aside(path: Path) -> Path:
    """Rename ``path`` (a file or directory) to a name no earlier run has taken:
    ``metrics.jsonl`` -> ``metrics.20261124-132400.jsonl`` (``...-2`` and on within a second)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    stem, suffix = (path.stem, path.suffix) if path.is_file() else (path.name, "")
    for n in itertools.count(1):
        aside = path.with_name(f"{stem}.{stamp}{'' if n == 1 else f'-{n}'}{suffix}")
        if not aside.exists() and not aside.is_symlink():
            os.rename(path, aside)  # only the master logs: no one else picks a name here
            return aside


def _continue_logs(run_dir: Path, start_step: int, tensorboard: bool) -> int | None:
    """Make metrics.jsonl (and TensorBoard's ``tb/``) continue at ``start_step``; return
    TensorBoard's ``purge_step``.

    Resuming from a checkpoint at step k: lines past k describe steps that will run again, so they
    are dropped (the file is rewritten atomically) and TensorBoard purges its events from step
    k + 1 on (step k was logged by the run that saved the checkpoint). Starting from step 0 over an
    old run's logs: they are kept under new names, never mixed with the new run's.
    """
    path = run_dir / "metrics.jsonl"
    if start_step == 0:
        for old in (path, run_dir / "tb"):
            if old.exists():
                aside = _set_aside(old)
                info(f"warning: starting from step 0: the previous {old.name} is kept as {aside.name}")
        return None
    if path.exists():
        kept = []
        for line in path.read_text().splitlines():
            try:
                step = json.loads(line).get("step", 0)
                if isinstance(step, int) and step <= start_step:
                    kept.append(line)
            except (ValueError, AttributeError):  # a line cut by a crash; not a record (edited by hand)
                continue
        atomic_write_text("".join(line + "\n" for line in kept), path)
    return start_step + 1 if tensorboard else None


LOG_OWNER = "log_owner.json"


def log_dir_owner(log_dir: Path) -> str | None:
    """The run (its resolved checkpoint.dir) whose logs a ``logging.dir`` holds, from its
    ``log_owner.json``; None if there is none (or it is unreadable)."""
    try:
        owner = json.loads((Path(log_dir) / LOG_OWNER).read_text()).get("checkpoint_dir")
    except (OSError, ValueError, AttributeError):
        return None
    return owner if isinstance(owner, str) else None


def claim_log_dir(log_dir: Path, run_dir: Path) -> str | None:
    """Make ``logging.dir`` this run's (the master, at start): create it and record the run in
    ``log_owner.json``. A resumed run truncates metrics.jsonl there and a run from step 0 sets it
    aside, so a directory that holds another run's logs is refused, as is one that cannot be
    written. Returns the one-line reason, or None."""
    owner, log_dir = str(Path(run_dir).resolve()), Path(log_dir)
    if log_dir.resolve() == Path(owner):
        return None  # checkpoint.dir itself, whose checks are the checkpointer's
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
        other = log_dir_owner(log_dir)
        if other is None and (log_dir / "metrics.jsonl").exists():
            other = "another checkpoint.dir"
        if other is not None and other != owner:
            return (f"logging.dir={log_dir} holds the logs of the run in {other}: give each run a "
                    f"logging.dir of its own (or, if this run's checkpoint.dir moved, remove {LOG_OWNER} there)")
        if other is None:
            atomic_write_text(json.dumps({"checkpoint_dir": owner}) + "\n", log_dir / LOG_OWNER)
    except OSError as e:
        return f"logging.dir={log_dir}: cannot write there ({first_line(e)})"
    return None


def _wandb_run_id(run_dir: Path, start_step: int) -> str:
    """The W&B run this run logs to: a resumed run continues the one its directory started (its
    id is kept in ``wandb_run_id``); a run from step 0 starts a new one."""
    path = run_dir / "wandb_run_id"
    if start_step > 0 and path.is_file():
        run_id = path.read_text().strip()
        if re.fullmatch(r"[a-z0-9]{8,64}", run_id):
            return run_id
    run_id = secrets.token_hex(4)
    atomic_write_text(run_id + "\n", path)
    return run_id


class StepProfiler:
    """A profiler trace of optimiser steps ``start`` .. ``start + steps - 1`` (1-based; at most
    ``max_steps``) that this run executes, on every process (the steps are the same everywhere:
    nothing to agree on), through the backend's profiler; ``start`` 0: none. A run resumed past
    ``start`` traces nothing; one that stops inside the window writes what it traced."""

    def __init__(self, backend, folder: Path, start: int, steps: int, max_steps: int, log):
        self.backend, self.folder, self.log = backend, folder, log
        self.first, self.last = start, min(start + steps - 1, max_steps)
        self.running = False

    def step(self, step: int):
        """Around step ``step``: starts the trace at the first."""
        if self.first and step == self.first:
            self.backend.start_profile(self.folder, f"steps{self.first}-{self.last}")
            self.running = True
        return self.backend.profile_scope(f"step {step}")

    def after(self, step: int) -> float:
        """After step ``step`` (and its sync): the trace ends after the last. Returns the seconds
        that took (writing the trace), which are no training time."""
        if not (self.running and step >= self.last):
            return 0.0
        # Pending log lines first (XLA writes them in asynchronous closures): each stamps the
        # clock its interval ends at, and one that ran after the writing had it left out twice.
        self.backend.wait_host()
        t0 = time.perf_counter()
        self.close()
        return time.perf_counter() - t0

    def close(self) -> None:
        if self.running:
            self.running = False
            self.log(f"profiler trace of steps {self.first}-{self.last}: {self.backend.stop_profile()}")


def progress_line(step: int, total: int, m: dict) -> str:
    """The console line of a log step without a progress bar: what the bar shows, and the time left."""
    parts = [f"step {step}/{total}", f"loss {m['loss']:.4f}", f"lr {m.get('lr', 0):.2e}"]
    if "tokens_per_sec" in m:
        parts.append(f"{m['tokens_per_sec']:,.0f} tok/s")
    if "mfu" in m:
        parts.append(f"MFU {m['mfu']:.1%}")
    if m.get("step_time"):
        left = max(0, total - step) * m["step_time"]
        parts.append(f"{int(left // 3600)}:{int(left % 3600 // 60):02d}:{int(left % 60):02d} left")
    return " | ".join(parts)


WANDB_STEP = "trainer/step"


class Monitor:
    def __init__(self, cfg, log_dir: Path, enabled: bool, total_steps: int, start_step: int):
        """``log_dir``: logging.dir, or checkpoint.dir when it is null."""
        self.enabled = enabled
        self.log_dir = Path(log_dir)
        self.total_steps = total_steps
        self.bar = None
        self.tb = None
        self.wandb = None
        self.jsonl = None
        if not enabled:
            return
        self.log_dir.mkdir(parents=True, exist_ok=True)
        lc = cfg.logging
        purge_step = _continue_logs(self.log_dir, start_step, lc.tensorboard)
        self.jsonl = open(self.log_dir / "metrics.jsonl", "a", buffering=1)
        if lc.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(str(self.log_dir / "tb"), purge_step=purge_step)
            except ImportError:
                info("warning: tensorboard is not installed; logging.tensorboard ignored")
            except Exception as e:  # noqa: BLE001  a tensorboard/protobuf version mismatch: TypeError
                info(f"warning: tensorboard cannot start ({first_line(e)}); logging.tensorboard ignored")
        if lc.wandb.enabled:
            try:
                import wandb
                os.environ.setdefault("WANDB_SILENT", "true")
                name = lc.wandb.run_name or Path(cfg.checkpoint.dir).expanduser().name  # the run's name
                self.wandb = wandb.init(project=lc.wandb.project, entity=lc.wandb.entity,
                                        name=name, mode=lc.wandb.mode,
                                        dir=str(self.log_dir), config=cfg.to_dict(),
                                        id=_wandb_run_id(self.log_dir, start_step), resume="allow")
                # the training step as a metric of its own, every chart's x axis: W&B's own step
                # only grows, so a resumed run's steps after its checkpoint (logged once already,
                # before the stop) would be dropped as "less than the current step"
                self.wandb.define_metric(WANDB_STEP)
                self.wandb.define_metric("*", step_metric=WANDB_STEP)
            except ImportError:
                info("warning: wandb is not installed (pip install wandb); logging.wandb ignored")
            except Exception as e:  # noqa: BLE001  no API key, no network, a bad entity: train on
                # without it (only this process logs: raising here would leave the others waiting)
                info(f"warning: wandb.init failed ({first_line(e)}); logging.wandb is off for this run "
                     "(wandb login, or logging.wandb.mode=offline)")
        if lc.progress_bar:
            from tqdm import tqdm
            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True,
                            file=sys.stderr, smoothing=0.1)

    def log(self, step: int, metrics: dict) -> None:
        """One JSON line, TensorBoard scalars and W&B, for one step's host-side metrics."""
        if not self.enabled:
            return
        clean = {"step": step}
        for k, v in metrics.items():
            clean[k] = v if not isinstance(v, float) or math.isfinite(v) else str(v)
        clean["time"] = round(time.time(), 3)
        try:
            if self.jsonl is not None:
                self.jsonl.write(json.dumps(clean) + "\n")
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    if self.tb is not None:
                        self.tb.add_scalar(k, v, step)
        except OSError as e:
            self._files_failed(e)
        if self.wandb is not None:
            try:
                self.wandb.log({**{k: v for k, v in metrics.items() if isinstance(v, (int, float))}, WANDB_STEP: step})
            except Exception as e:  # noqa: BLE001  its service died, a network error: train on without it
                self._wandb_failed(e)
        if self.bar is not None and "loss" in metrics:
            post = {"loss": f"{metrics['loss']:.4f}", "lr": f"{metrics.get('lr', 0):.2e}"}
            if "tokens_per_sec" in metrics:
                post["tok/s"] = f"{metrics['tokens_per_sec']:.0f}"
            if "eval_loss" in metrics:
                post["val"] = f"{metrics['eval_loss']:.4f}"
            self.bar.set_postfix(post, refresh=False)
        elif "loss" in metrics:   # no bar (logging.progress_bar=false: batch logs): a line per log step
            info(progress_line(step, self.total_steps, metrics))

    def _files_failed(self, e: OSError) -> None:
        """A full disk (or a quota, a storage error) under metrics.jsonl or TensorBoard's files: only
        this process writes them, so it alone would stop while the others waited for it in the
        next collective. The run goes on without them (its next checkpoint save, on the same
        disk, is a decision every process takes together)."""
        info(f"warning: writing the metrics under {self.log_dir} failed ({e.strerror or e}); "
             "metrics.jsonl and TensorBoard are off for the rest of this run")
        for f in (self.jsonl, self.tb):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass
        self.jsonl = self.tb = None

    def _wandb_failed(self, e: Exception) -> None:
        """W&B failing mid-run (its wandb-core service gone: ConnectionResetError) ended the run with
        a traceback and no save; only this process logs to it, so the run goes on without it."""
        info(f"warning: wandb failed ({first_line(e)}); logging.wandb is off for the rest of this run "
             "(metrics.jsonl has every step)")
        run, self.wandb = self.wandb, None
        try:
            run.finish(exit_code=1)
        except Exception:  # noqa: BLE001  the same dead service
            pass

    def advance(self, step: int) -> None:
        if self.bar is not None:
            self.bar.update(step - self.bar.n)

    def close(self) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.close()
        if self.wandb is not None:
            try:
                self.wandb.finish()
            except Exception as e:  # noqa: BLE001  the files below are closed whatever W&B does
                info(f"warning: wandb.finish failed ({first_line(e)})")
            self.wandb = None
        try:
            for f in (self.tb, self.jsonl):
                if f is not None:
                    f.close()  # flushes: a full disk shows here too
        except OSError as e:
            self._files_failed(e)
