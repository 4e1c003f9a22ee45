"""Train a Nash-MHC transformer with PyTorch/XLA: on a TPU VM, or on the CPU through PJRT.

    python train_xla.py configs/nash_mhc_3b.yaml [section.key=value ...]
    PJRT_DEVICE=CPU python train_xla.py configs/demo.yaml            # no TPU: the CPU
    CPU_NUM_DEVICES=4 python train_xla.py configs/demo.yaml xla.mode=spmd xla.mesh.fsdp=2 xla.mesh.tp=2

``xla.mode: ddp`` (default) runs one process per core/chip with ``xmp.spawn``; ``xla.mode: spmd``
runs one process over a data x fsdp x tp mesh of every device. Config, data, loop and checkpoints
are train.py's (training/); checkpoints move freely between the two.
"""
from __future__ import annotations

import glob
import importlib.util
import multiprocessing
import os
import signal
import sys
import traceback
from concurrent.futures.process import BrokenProcessPool

from training.checkpoint import first_line
from training.loop import STOP, main, train


class TrainingExit(Exception):
    """A worker's non-zero exit code or one-line error, carried back to the launcher."""

    def __init__(self, code: int, message: str = ""):
        super().__init__(code, message)
        self.code, self.message = code, message


def _default_pjrt_device() -> None:
    if "PJRT_DEVICE" in os.environ:
        return
    on_tpu = importlib.util.find_spec("libtpu") is not None or glob.glob("/dev/accel*") \
        or glob.glob("/dev/vfio/[0-9]*")
    os.environ["PJRT_DEVICE"] = "TPU" if on_tpu else "CPU"
    if not on_tpu:
        print("train_xla.py: no TPU found: using PJRT_DEVICE=CPU (set PJRT_DEVICE to choose)",
              file=sys.stderr)


def _worker(index: int, cfg) -> None:
    """One replica (xmp.spawn calls this in each process) or the single SPMD process."""
    from training.config import ConfigError
    from training.checkpoint import CheckpointError
    from training.xla_backend import XLABackend

    spawned = _spawns(cfg)
    backend = None
    try:
        backend = XLABackend(cfg)
        code = train(cfg, backend)
    except (ConfigError, CheckpointError, ValueError) as e:
        if not spawned:
            raise TrainingExit(2, str(e)) from None
        # said now: the launcher learns of a worker's end only after every worker has ended, and
        # the others may be waiting for this one in a collective
        print(f"train_xla.py: error: {f'[process {index}] ' if index else ''}{e}", file=sys.stderr, flush=True)
        raise TrainingExit(2) from None
    except BaseException:
        if spawned:
            traceback.print_exc()
            sys.stderr.flush()
        raise
    finally:
        if backend is not None:
            backend.shutdown()  # the gloo group of a multi-process run, as train.py does
    if code != 0:
        raise TrainingExit(code)


def _spawns(cfg) -> bool:
    """Whether the workers are processes of their own (xmp.spawn's pool), not this process (SPMD,
    or ddp with xla.nprocs 1)."""
    return cfg.xla.mode != "spmd" and cfg.xla.nprocs != 1


_FORWARDED: list[int] = []  # the signals the launcher passed on, in order


def _forward_signals_to_workers() -> None:
    """The launcher passes SIGTERM/SIGINT on to the worker processes, which stop and save."""
    def forward(signum, frame):
        _FORWARDED.append(signum)
        for child in multiprocessing.active_children():
            try:
                os.kill(child.pid, signum)
            except ProcessLookupError:
                pass
    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)


def run(cfg) -> int:
    _default_pjrt_device()
    if cfg.xla.mode != "spmd":
        import torch_xla.distributed.xla_multiprocessing as xmp
    try:
        if cfg.xla.mode == "spmd":
            _worker(0, cfg)
        elif not _spawns(cfg):  # xla.nprocs 1: the worker is this process, with its own stop handlers
            xmp.spawn(_worker, args=(cfg,), nprocs=1)
        else:
            _forward_signals_to_workers()
            try:
                xmp.spawn(_worker, args=(cfg,), nprocs=cfg.xla.nprocs)
            except BrokenProcessPool:
                twice = _FORWARDED.count(signal.SIGINT) >= 2
                print("train_xla.py: error: a worker process ended without finishing "
                      + ("(a second Ctrl+C: no checkpoint saved)" if twice else "(killed, or crashed: see above)"),
                      file=sys.stderr)
                return 130 if twice else 1
            except TrainingExit:
                raise
            except Exception as e:  # a worker's own exception, pickled back: its traceback is printed
                print(f"train_xla.py: error: a worker process failed ({type(e).__name__}: {first_line(e)}; "
                      "its traceback is above)", file=sys.stderr)
                return 1
    except TrainingExit as e:
        if e.message:
            print(f"train_xla.py: error: {e.message}", file=sys.stderr)
        return e.code
    return 0


if __name__ == "__mp_main__":
    # Imported by an xmp.spawn worker (spawn re-runs the main script under this name, in the
    # worker's main thread). Its training loop runs in a thread that cannot install signal
    # handlers, so the stop-and-save handlers are installed here.
    STOP.install()

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], run, "train_xla.py", entry="xla"))
