"""Checkpoints: one format for both trainers, atomic writes, rotation, safe loading.

A checkpoint is a plain dict of tensors and Python scalars (``weights_only=True`` loads it):
``model`` and ``optimizer`` state dicts (on CPU, unwrapped, SPMD-consolidated), ``step``,
``tokens_seen``, ``data`` (epoch, global offset), ``rng``, ``nonfinite`` counters, the resolved
``config`` and ``format_version``. Files are ``ckpt_00000100.pt``; each is written to a hidden
temporary name in the same directory, fsynced, then renamed, so a file with the final name is
always complete.
"""
from __future__ import annotations

import os
import random
import re
import sys
from pathlib import Path
from typing import Callable

import numpy as np
import torch

FORMAT_VERSION = 1
_NAME = re.compile(r"^ckpt_(\d{8,})\.pt$")


def checkpoint_path(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / f"ckpt_{step:08d}.pt"


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete-looking checkpoints (final names only), oldest first."""
    d = Path(run_dir)
    if not d.is_dir():
        return []
    found = []
    for p in d.iterdir():
        m = _NAME.match(p.name)
        if m and p.is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_torch_save(obj, path: str | Path, save_fn: Callable | None = None) -> None:
    """Write ``obj`` to a temporary file next to ``path``, fsync, rename.

    ``save_fn(obj, tmp_path)`` defaults to ``torch.save``; the XLA backend passes its own (which
    moves device tensors to the host first).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    try:
        (save_fn or torch.save)(obj, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    fsync_dir(path.parent)


def rotate(run_dir: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` checkpoints; return what was deleted."""
    ckpts = list_checkpoints(run_dir)
    doomed = [p for _, p in ckpts[:-keep]] if keep > 0 else []
    for p in doomed:
        p.unlink(missing_ok=True)
    # temporary files left by a killed writer are never complete: clean them too
    for p in Path(run_dir).glob(".ckpt_*.pt.tmp-*"):
        pid = p.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            p.unlink(missing_ok=True)
    return doomed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class CheckpointError(RuntimeError):
    pass


def load_checkpoint(path: str | Path) -> dict:
    """Load one checkpoint on CPU with ``weights_only=True``; reject pickled code and bad files."""
    path = Path(path)
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such checkpoint") from None
    except Exception as e:  # truncated zip, pickled code (UnpicklingError), garbage
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path}: not a loadable checkpoint ({msg[:200]})") from None
    if not isinstance(ckpt, dict) or "model" not in ckpt or "format_version" not in ckpt:
        raise CheckpointError(f"{path}: not a Nash-MHC checkpoint (missing model/format_version)")
    if ckpt["format_version"] > FORMAT_VERSION:
        raise CheckpointError(f"{path}: format_version {ckpt['format_version']} is newer than this "
                              f"code's {FORMAT_VERSION}")
    return ckpt


def find_resume(run_dir: str | Path, warn: Callable[[str], None] = print) -> tuple[Path, dict] | None:
    """The newest checkpoint in ``run_dir`` that loads; a corrupt newer one is reported and skipped."""
    for _, path in reversed(list_checkpoints(run_dir)):
        try:
            return path, load_checkpoint(path)
        except CheckpointError as e:
            warn(f"warning: {e}; trying the previous checkpoint")
    return None


class Checkpointer:
    """What the training loop calls for checkpoints: ``find`` (the resume point), ``save``,
    ``wait`` (for a save still being written) and ``rotate``.

    The backend writes (``backend.save``); the master process rotates.
    """

    def __init__(self, run_dir: str | Path, keep: int, backend, log: Callable[[str], None] = print):
        self.run_dir, self.keep, self.backend, self.log = Path(run_dir), keep, backend, log

    def find(self, resume: str) -> tuple[Path, dict] | None:
        """``checkpoint.resume``: ``auto`` (the newest loadable checkpoint in the run directory, if
        any), ``none``, or a path (an error if it does not load)."""
        if resume == "none":
            return None
        if resume == "auto":
            return find_resume(self.run_dir, warn=self.log)
        path = Path(resume).expanduser()
        return path, load_checkpoint(path)

    def save(self, ckpt: dict, step: int, reason: str) -> Path:
        path = checkpoint_path(self.run_dir, step)
        self.backend.save(ckpt, path)
        self.rotate()
        self.log(f"saved {path} ({reason})")
        return path

    def wait(self) -> None:
        """Block until no save is in flight (saves are synchronous here)."""

    def rotate(self) -> list[Path]:
        """The master deletes all but the newest ``keep`` checkpoints."""
        return rotate(self.run_dir, self.keep) if self.backend.is_master else []


# -- RNG state, as weights_only-loadable tensors and lists -------------------------------------

def rng_state() -> dict:
    py = random.getstate()
    np_state = np.random.get_state()
    state = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    if "python" in state:
        v, internal, gauss = state["python"]
        random.setstate((v, tuple(internal), gauss))
    if "numpy" in state:
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        try:
            torch.cuda.set_rng_state_all(state["cuda"])
        except (RuntimeError, IndexError):
            print("warning: CUDA RNG state not restored (different device count)", file=sys.stderr)
