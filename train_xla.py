"""Train a Nash-MHC transformer with PyTorch/XLA: on a TPU VM, or on the CPU through PJRT.

    python train_xla.py configs/nash_mhc_3b.yaml [section.key=value ...]
    PJRT_DEVICE=CPU python train_xla.py configs/demo.yaml            # no TPU: the CPU
    CPU_NUM_DEVICES=4 python train_xla.py configs/demo.yaml xla.mode=spmd xla.mesh.fsdp=2 xla.mesh.tp=2

``xla.mode: ddp`` (default) runs one process per core/chip with ``xmp.spawn`` (on the CPU, one
device: this process); ``xla.mode: spmd`` runs one process over a data x fsdp x tp mesh of every
device. Config, data, loop and checkpoints are train.py's (training/); checkpoints move freely
between the two.
"""
from __future__ import annotations

import glob
import importlib.util
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
from concurrent.futures.process import BrokenProcessPool

from training import launch
from training.checkpoint import first_line
from training.config import check_xla, xla_ignores
from training.data import stop_signals_taken
from training.loop import STOP, main, train


class TrainingExit(Exception):
    """A worker's non-zero exit code or one-line error, carried back to the launcher."""

    def __init__(self, code: int, message: str = ""):
        super().__init__(code, message)
        self.code, self.message = code, message


def _libtpu_found() -> bool:
    """Whether torch_xla 2.9 finds the TPU runtime (``torch_xla._setup_tpu_vm_library_path``, read
    without importing torch_xla, which must see PJRT_DEVICE first): TPU_LIBRARY_PATH, the
    libtpu.so bundled in torch_xla/lib, or the libtpu package."""
    if "TPU_LIBRARY_PATH" in os.environ:
        return True
    spec = importlib.util.find_spec("torch_xla")
    if spec is not None and spec.origin and os.path.isfile(os.path.join(os.path.dirname(spec.origin), "lib",
                                                                        "libtpu.so")):
        return True
    return importlib.util.find_spec("libtpu") is not None


def _tpu_device_nodes() -> bool:
    """Whether this machine has TPU device nodes: ``/dev/accel*`` (v2-v4, v5p) or ``/dev/vfio/N``
    (v5e, v6e), what libtpu opens."""
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def _default_pjrt_device() -> None:
    if "PJRT_DEVICE" in os.environ:
        return
    # as torch_xla's own default: the TPU runtime installed *and* TPU chips here (a TPU image
    # without a TPU, e.g. a CPU CI job, has libtpu and no device)
    on_tpu = _libtpu_found() and _tpu_device_nodes()
    os.environ["PJRT_DEVICE"] = "TPU" if on_tpu else "CPU"
    if not on_tpu:
        print("train_xla.py: no TPU found: using PJRT_DEVICE=CPU (set PJRT_DEVICE to choose)",
              file=sys.stderr)


# The PJRT_DEVICE values torch_xla 2.9 has a client for without a plugin (its C++ registry), and
# what each needs installed; other names are those of installed plugin packages (the
# ``torch_xla.plugins`` entry points, which torch_xla registers under their upper-case names).
_BUILT_IN_DEVICES = {"CPU": None, "TPU": "libtpu (pip install torch_xla[tpu])", "NEURON": "libneuronxla"}


def _plugin_problem(kind: str) -> str | None:
    """Why the PJRT library of torch_xla's plugin for device ``kind`` does not load, or None."""
    import ctypes
    from importlib.metadata import entry_points

    try:
        plugin, = [ep for ep in entry_points(group="torch_xla.plugins") if ep.name.upper() == kind]
        path = plugin.load()().library_path()
        ctypes.CDLL(path)
    except Exception as e:  # noqa: BLE001 (the plugin's own import or lookup, or dlopen's OSError)
        return " ".join(str(e).split()) or type(e).__name__
    return None


def _check_pjrt_device(cfg) -> None:
    """A ``ConfigError`` naming ``PJRT_DEVICE`` when torch_xla cannot run on it here: a name it has
    no client for (``cpu``: torch_xla reads the name as given), TPU without the TPU runtime, or
    in ddp mode a machine whose PCI bus has no TPU chip (torch_xla's own count, which xmp.spawn
    makes a process per). Otherwise these fail inside torch_xla, as a traceback or as a bare
    ``KeyError: 'cpu'`` or ``max_workers must be greater than 0`` from the spawn."""
    from importlib.metadata import entry_points
    from training.config import ConfigError

    value = os.environ["PJRT_DEVICE"]
    kind = value.split("_")[0]  # as torch_xla.runtime.device_type() reads it (TPU_C_API: TPU)
    known = set(_BUILT_IN_DEVICES) | {ep.name.upper() for ep in entry_points(group="torch_xla.plugins")}
    if kind not in known:
        hint = f"; did you mean {kind.upper()}?" if kind.upper() in known else ""
        raise ConfigError(f"PJRT_DEVICE={value}: torch_xla has no device of that name (here: "
                          f"{', '.join(sorted(known))}){hint}")
    if kind not in _BUILT_IN_DEVICES:  # a plugin's (XPU): its PJRT library must load, or it is a traceback
        problem = _plugin_problem(kind)
        if problem:
            raise ConfigError(f"PJRT_DEVICE={value}, but torch_xla's {kind} plugin cannot load here ({problem}); "
                              "on a machine without that device use PJRT_DEVICE=CPU")
    need = _BUILT_IN_DEVICES.get(kind)
    found = {"TPU": _libtpu_found, "NEURON": lambda: importlib.util.find_spec("libneuronxla") is not None}
    if need and not found[kind]():
        raise ConfigError(f"PJRT_DEVICE={value}, but {need} is not installed here; on a machine without "
                          "that device use PJRT_DEVICE=CPU (or unset it: train_xla.py finds the device)")
    if kind == "TPU" and _spawns(cfg):
        from torch_xla._internal import tpu
        if tpu.num_available_chips() == 0:
            raise ConfigError(f"PJRT_DEVICE={value}, but this machine has no TPU chip (torch_xla finds none "
                              "on its PCI bus); on a machine without a TPU use PJRT_DEVICE=CPU")
    elif kind == "TPU" and not _tpu_device_nodes():
        # one process (SPMD, xla.nprocs=1): libtpu finds the chips itself, a generation newer than
        # torch_xla's PCI table too, but none without their device nodes (torch_xla's traceback)
        raise ConfigError(f"PJRT_DEVICE={value}, but this machine has no TPU device (no /dev/accel* or "
                          "/dev/vfio/N); on a machine without a TPU use PJRT_DEVICE=CPU")


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
        print(f"train_xla.py: error: {f'[process {index}] ' if index else ''}{e}", file=sys.stderr, flush=True)
        code = 2
    except BaseException:
        if not spawned:
            raise
        traceback.print_exc()
        code = 1
    else:
        if code != 0:
            raise TrainingExit(code)
        return
    finally:
        if backend is not None:
            backend.shutdown()  # the gloo group of a multi-process run, as train.py does
    # A spawned replica that failed ends its process, error said first. Raising would hand the
    # error to xmp.spawn's pool and leave the process alive, while the other replicas wait for it
    # in their next collective for ever (the pool reports nothing until every replica returned);
    # a process that ends breaks the pool, and the launcher's _PeerWatch stops the others.
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(code)


def _spawns(cfg) -> bool:
    """Whether the workers are processes of their own (xmp.spawn's pool), not this process: not
    in SPMD, not in ddp with xla.nprocs 1, and not on PJRT CPU with one device (CPU_NUM_DEVICES
    unset or 1). There torch_xla's pool is one process running one replica: this process's work,
    after Python, torch and torch_xla start a second time (~6 s, and its exit ~4 s more: a tiny
    run 26.6 s -> 16.9 s)."""
    if cfg.xla.mode == "spmd" or cfg.xla.nprocs == 1:
        return False
    return not launch.one_pjrt_cpu_device()


_FORWARDED: list[int] = []  # the signals the launcher passed on, in order


def _forward_signals_to_workers() -> None:
    """The launcher passes the stop signals on to the worker processes, which stop and save (a
    hang-up that the launcher was started ignoring, ``nohup``, the workers ignore too)."""
    def forward(signum, frame):
        _FORWARDED.append(signum)
        for child in multiprocessing.active_children():
            try:
                os.kill(child.pid, signum)
            except ProcessLookupError:
                pass
    for sig in stop_signals_taken():
        signal.signal(sig, forward)


WORKER_GRACE_S = 10.0  # how long the other replicas may take to end after one failed


class _PeerWatch(threading.Thread):
    """The launcher's watch over xmp.spawn's worker processes: once one has ended with a non-zero
    exit code (a replica that failed, or a process the kernel killed), the others get
    ``WORKER_GRACE_S`` to end by themselves (replicas that failed together), then SIGKILL. They
    cannot finish without the failed one (every step and every save is collective), and a
    replica waiting in a collective never returns: SIGTERM, which the pool sends when it breaks,
    only asks them to save, which needs the failed one too. torchrun stops its workers so."""

    def __init__(self, grace_s: float):
        super().__init__(name="peer-watch", daemon=True)
        self.grace_s = grace_s
        self.killed = 0                  # how many were killed after the grace period
        self._seen: dict[int, multiprocessing.Process] = {}
        self._done = threading.Event()

    @property
    def failed(self) -> int | None:
        """The exit code that tells the most of the workers' ends so far: a failed replica's own
        (positive) before a signal's (negative); None while none ended with one."""
        codes = [p.exitcode for p in self._seen.values() if p.exitcode not in (None, 0)]
        return max(codes, default=None, key=lambda c: (c > 0, -abs(c)))

    def run(self) -> None:
        deadline = None
        while not self._done.wait(0.2):
            for p in multiprocessing.active_children():
                self._seen.setdefault(p.pid, p)
            if deadline is None:
                if self.failed is not None:
                    deadline = time.monotonic() + self.grace_s
            elif time.monotonic() >= deadline:
                for p in self._seen.values():
                    if p.exitcode is None:
                        p.kill()
                        self.killed += 1
                return

    def stop(self) -> None:
        self._done.set()
        self.join()


def _several_hosts(cfg) -> bool:
    """Whether this is one host of a multi-host TPU job (a pod slice: torch_xla's own count of
    the slice's workers, from the TPU metadata; or one of several slices, as the multi-slice
    runtime's MEGASCALE_NUM_SLICES says, where each slice may be one host). Asked only after
    ``check_data`` failed here: the run then goes on to the launch agreement, where every host
    stops with the same line instead of the others waiting for this one in the rendezvous."""
    _default_pjrt_device()
    if os.environ.get("PJRT_DEVICE") != "TPU":
        return False
    if os.environ.get("MEGASCALE_NUM_SLICES", "1").strip() not in ("", "0", "1"):
        return True
    try:
        from torch_xla._internal import tpu
        return tpu.num_tpu_workers() > 1
    except Exception:  # no metadata server, no torch_xla: one host, as before
        return False


def run(cfg) -> int:
    _default_pjrt_device()
    _check_pjrt_device(cfg)
    for line in xla_ignores(cfg):
        print(f"train_xla.py: warning: {line}", file=sys.stderr)
    if _spawns(cfg):  # once, here, not in every spawned worker (main says a ConfigError); a worker
        check_xla(cfg)  # in this process has its backend check it, with the devices
    if cfg.xla.mode != "spmd":
        import torch_xla.distributed.xla_multiprocessing as xmp
    try:
        if cfg.xla.mode == "spmd":
            _worker(0, cfg)
        elif not _spawns(cfg):  # the worker is this process, with its own stop handlers
            xmp.spawn(_worker, args=(cfg,), nprocs=1)
        else:
            _forward_signals_to_workers()
            watch = _PeerWatch(WORKER_GRACE_S)
            watch.start()
            try:
                xmp.spawn(_worker, args=(cfg,), nprocs=cfg.xla.nprocs)
            except BrokenProcessPool:
                if _FORWARDED.count(signal.SIGINT) >= 2:
                    print("train_xla.py: error: a worker process ended without finishing (a second Ctrl+C: "
                          "no checkpoint saved)", file=sys.stderr)
                    return 130
                code = watch.failed if watch.failed is not None else 1
                how = f"exit code {code} (its error is above)" if code > 0 else f"signal {-code} (killed)"
                stopped = f"; {watch.killed} other(s) stopped after {watch.grace_s:g} s" if watch.killed else ""
                print(f"train_xla.py: error: a worker process ended with {how}{stopped}", file=sys.stderr)
                return code if code > 0 else 1
            except TrainingExit:
                raise
            except Exception as e:  # from xmp.spawn's own code around the workers (a worker's
                # _worker never raises): in this process, or in a worker before _worker ran, whose
                # traceback comes back as the exception's cause
                traceback.print_exception(e)
                print(f"train_xla.py: error: torch_xla could not start the worker processes "
                      f"({type(e).__name__}: {first_line(e)})", file=sys.stderr)
                return 1
            finally:
                watch.stop()
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
    sys.exit(main(sys.argv[1:], run, "train_xla.py", entry="xla", launched_together=_several_hosts))
