"""Checkpoints: two forms, one loader, commit markers, rotation, asynchronous saves, safe loading.

Layout of ``checkpoint.dir`` (the run directory)::

    ckpt_00001000.pt          one file: a single-process run (train.py on one device or DDP,
                              train_xla.py in ddp mode); written by the master process
    ckpt_00002000/            a torch.distributed.checkpoint (DCP) directory: train.py with
        .metadata             training.fsdp under torchrun, train_xla.py in SPMD mode
        __0_0.distcp          one file per writing process: its own shards, replicated tensors once
        __1_0.distcp
        checkpoint.json       the commit marker, written last by the global master

The single file is a dict that ``torch.load(weights_only=True)`` reads: ``model`` (state dict by
parameter name), ``optimizer`` (``{"state": {name: {...}}, "param_groups": [...]}``, keyed by
parameter *name*, the layout of ``torch.distributed.checkpoint.state_dict``), ``step``,
``tokens_seen``, ``data`` (epoch, global sample offset), ``rng``, ``nonfinite``, the resolved
``config``, ``trainer`` and ``format_version``. It is written under a hidden temporary name,
fsynced and renamed, so a file with a final name is complete.

A DCP directory holds the same tensors (``model``, ``optimizer.state``) as shards, and everything
else in ``checkpoint.json``. A directory counts only once ``checkpoint.json`` exists: the master
writes it (atomically) after DCP's own ``.metadata``, which DCP writes after gathering every
writer's result. Anything without a marker is a save that did not finish: ``resume: auto`` skips
it and the master deletes it at start. Rotation deletes only committed checkpoints older than the
one just committed, only on the master, marker first.

``load_checkpoint(path)`` returns the same dict for either form: a DCP directory is consolidated
on the CPU in one process (no process group, no torch_xla). Nothing is unpickled except through
``weights_only=True`` or, for DCP's pickled ``.metadata``, a restricted unpickler that admits only
DCP's own metadata classes (``read_dcp_metadata``); the marker is JSON.

``python -m training.checkpoint consolidate CKPT_DIR OUT.pt`` writes a DCP directory as one file.
"""
from __future__ import annotations

import argparse
import errno
import fcntl
import io
import json
import os
import pickle
import random
import re
import secrets
import shutil
import sys
import threading
import time
import warnings
import zipfile
from pathlib import Path, PurePosixPath, PureWindowsPath, PosixPath, WindowsPath
from typing import Any, Callable

import numpy as np
import torch

from .distributed import HostGroup

FORMAT_VERSION = 2  # 2: optimizer state keyed by parameter name; DCP directories
MARKER = "checkpoint.json"
_FILE = re.compile(r"^ckpt_(\d{8,})\.pt$")
_DIR = re.compile(r"^ckpt_(\d{8,})$")
_TMP = re.compile(r"^\.ckpt_(\d{8,})\.pt\.tmp-")
_SHARD_FILE = re.compile(r"^__\d+_\d+\.distcp$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message is one line naming the path."""


# -- names --------------------------------------------------------------------------------------

def checkpoint_path(run_dir: str | Path, step: int, sharded: bool = False) -> Path:
    """``ckpt_00001000.pt`` (one file) or ``ckpt_00001000`` (a DCP directory)."""
    name = f"ckpt_{step:08d}"
    return Path(run_dir) / (name if sharded else name + ".pt")


def is_dcp_dir(path: str | Path) -> bool:
    p = Path(path)
    return p.is_dir() and ((p / MARKER).exists() or (p / ".metadata").exists())


def _entries(run_dir: Path) -> list[tuple[int, Path, bool]]:
    """(step, path, committed) of every checkpoint-like entry."""
    if not run_dir.is_dir():
        return []
    out = []
    for p in run_dir.iterdir():
        if (m := _FILE.match(p.name)) and p.is_file():
            out.append((int(m.group(1)), p, True))
        elif (m := _DIR.match(p.name)) and p.is_dir():
            out.append((int(m.group(1)), p, (p / MARKER).is_file()))
        elif (m := _TMP.match(p.name)) and p.is_file():
            out.append((int(m.group(1)), p, False))
    return sorted(out, key=lambda e: (e[0], e[1].name))


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Committed checkpoints (files with final names, DCP directories with a marker), oldest first."""
    return [(s, p) for s, p, ok in _entries(Path(run_dir)) if ok]


# -- atomic writes --------------------------------------------------------------------------------

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


def _atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}"
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    fsync_dir(path.parent)


def atomic_torch_save(obj, path: str | Path) -> None:
    """Write ``obj`` with ``torch.save`` to a temporary file next to ``path``, fsync, rename."""
    _atomic_write(Path(path), lambda tmp: torch.save(obj, tmp))


def atomic_write_json(obj: dict, path: str | Path) -> None:
    _atomic_write(Path(path), lambda tmp: tmp.write_text(json.dumps(obj, indent=1) + "\n"))


def atomic_write_text(text: str, path: str | Path) -> None:
    _atomic_write(Path(path), lambda tmp: tmp.write_text(text))


# -- DCP metadata, unpickled safely ---------------------------------------------------------------

def _allowed_globals() -> dict[tuple[str, str], Any]:
    import torch.distributed.checkpoint.filesystem as fs
    import torch.distributed.checkpoint.metadata as md
    allowed = {("torch.distributed.checkpoint.metadata", n): getattr(md, n) for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")}
    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = fs._StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    for name, value in vars(torch).items():  # dtypes are pickled as globals: torch.float32, ...
        if isinstance(value, torch.dtype):
            allowed[("torch", name)] = value
    for cls in (PosixPath, WindowsPath, PurePosixPath, PureWindowsPath):  # StorageMeta.checkpoint_id
        allowed[("pathlib", cls.__name__)] = cls
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    """Admits only DCP's metadata classes, torch.Size, dtypes and layouts, and paths."""

    _allowed: dict | None = None

    def find_class(self, module: str, name: str):
        if _MetadataUnpickler._allowed is None:
            _MetadataUnpickler._allowed = _allowed_globals()
        try:
            return _MetadataUnpickler._allowed[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"refused to load {module}.{name}") from None


def read_dcp_metadata(ckpt_dir: str | Path):
    """DCP's ``.metadata`` of ``ckpt_dir``, unpickled by ``_MetadataUnpickler`` and checked: tensor
    entries only (DCP loads byte entries with ``torch.load(weights_only=False)``; we never write
    them), storage in this directory's ``__R_0.distcp`` files and within their sizes."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

    d = Path(ckpt_dir)
    path = d / ".metadata"
    try:
        with open(path, "rb") as f:
            meta = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise CheckpointError(f"{d}: no .metadata (not a finished DCP checkpoint)") from None
    except Exception as e:  # refused global, truncated file, garbage
        raise CheckpointError(f"{path}: unreadable DCP metadata ({first_line(e)})") from None
    if not isinstance(meta, Metadata) or not isinstance(meta.state_dict_metadata, dict) \
            or not isinstance(meta.storage_data, dict):
        raise CheckpointError(f"{path}: not DCP metadata")
    for key, item in meta.state_dict_metadata.items():
        if not isinstance(key, str) or not isinstance(item, TensorStorageMetadata):
            raise CheckpointError(f"{path}: entry {str(key)[:80]!r} is not a tensor (refused)")
    sizes: dict[str, int] = {}
    for index, info in meta.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo) \
                or not isinstance(info.relative_path, str) or not _SHARD_FILE.match(info.relative_path):
            raise CheckpointError(f"{path}: bad storage entry {str(index)[:120]}")
        if info.relative_path not in sizes:
            shard = d / info.relative_path
            sizes[info.relative_path] = shard.stat().st_size if shard.is_file() else -1
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)  # a None is not pickled
        if type(offset) is not int or type(length) is not int or offset < 0 or length < 0 \
                or offset + length > sizes[info.relative_path]:
            raise CheckpointError(f"{d / info.relative_path}: missing or truncated")
    return meta


def safe_reader(ckpt_dir: str | Path):
    """A ``FileSystemReader`` whose ``read_metadata`` is ``read_dcp_metadata`` (DCP's own calls
    ``pickle.load``). Tensor data is read by DCP with ``torch.load(weights_only=True)``."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeFileSystemReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            if kwargs.get("rank") is not None:
                raise CheckpointError(f"{self.path}: per-rank metadata is not supported")
            meta = read_dcp_metadata(self.path)
            if getattr(meta, "storage_meta", None) is None:
                meta.storage_meta = StorageMeta()
            meta.storage_meta.load_id = self.load_id
            return meta

    return SafeFileSystemReader(ckpt_dir)


# -- reading -------------------------------------------------------------------------------------

def first_line(e: BaseException) -> str:
    """An exception as one line for the user: its first line (or its type), at most 300 characters."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return (lines[0] if lines else type(e).__name__)[:300]


def _check_fields(path: Path, ckpt: dict, need: dict) -> None:
    """A one-line error naming the first of ``need``'s keys that ``ckpt`` lacks or holds as
    another type than ``need`` gives; ``data`` (the stream position) must hold integers."""
    for key, tp in need.items():
        if not isinstance(ckpt.get(key), tp) or (tp is int and isinstance(ckpt[key], bool)):
            raise CheckpointError(f"{path}: missing or malformed {key!r}")
    if "data" in need and not all(isinstance(ckpt["data"].get(k), int) for k in ("epoch", "offset")):
        raise CheckpointError(f"{path}: missing or malformed 'data' (epoch and offset)")


def read_marker(ckpt_dir: str | Path) -> dict:
    """The commit marker of a DCP directory, checked (JSON; an error if missing or malformed)."""
    d = Path(ckpt_dir)
    path = d / MARKER
    try:
        marker = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{d}: not committed (no {MARKER}: the save did not finish)") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable ({first_line(e)})") from None
    if not isinstance(marker, dict):
        raise CheckpointError(f"{path}: malformed (a JSON {type(marker).__name__}, not an object)")
    _check_fields(path, marker, {"format_version": int, "step": int, "tokens_seen": int, "data": dict,
                                 "config": dict, "rng": dict, "optimizer_param_groups": list})
    if marker["format_version"] > FORMAT_VERSION:
        raise CheckpointError(f"{path}: format_version {marker['format_version']} is newer than this "
                              f"code's {FORMAT_VERSION}")
    return marker


def _dcp_meta(ckpt_dir: Path) -> dict:
    """A DCP checkpoint's dict without its tensors (marker and metadata checked)."""
    marker = read_marker(ckpt_dir)
    read_dcp_metadata(ckpt_dir)
    meta = {k: v for k, v in marker.items() if k not in ("optimizer_param_groups", "format", "writers",
                                                           "saved_at")}
    try:
        meta["rng"] = rng_from_json(marker["rng"])
        check_rng_state(meta["rng"])
    except CheckpointError as e:
        raise CheckpointError(f"{ckpt_dir}: {e}") from None
    meta["optimizer"] = {"param_groups": marker["optimizer_param_groups"]}
    return meta


def _header_kind(path: Path) -> str:
    """A file's kind from its first bytes: "empty", "zip" (torch.save's format), "safetensors",
    "other", or "unreadable"."""
    try:
        with open(path, "rb") as f:
            head = f.read(9)
    except OSError:
        return "unreadable"
    if not head:
        return "empty"
    if head[:4] == b"PK\x03\x04":
        return "zip"
    if len(head) == 9 and head[8:9] == b"{":  # an 8-byte header length, then the JSON header
        return "safetensors"
    return "other"


def _file_kind(path: Path, e: Exception) -> str:
    """What a file torch.load cannot read is, from its first bytes: torch's own message for a
    zip (torch.save's format), which names what is wrong inside; else what the bytes say."""
    return {"unreadable": first_line(e), "empty": "the file is empty",
            "zip": f"a truncated or corrupt torch.save file: {first_line(e)}",
            "safetensors": ("a safetensors file, weights alone: a Hugging Face model's directory is loaded "
                            "with transformers, and a Llama's starts a run with checkpoint.init_from"),
            }.get(_header_kind(path), "its bytes are not torch.save's zip format")


def _load_file(path: Path, with_optimizer: bool = True) -> dict:
    # mmap: the tensors are read from the page cache as they are used, so the processes of a host
    # that resume from one file (every DDP rank) share one copy of it instead of holding one each
    # (copy-on-write: training may update a CPU tensor in place; saves are atomic renames and old
    # checkpoints are unlinked, so the mapped file never changes under a reader)
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such checkpoint") from None
    except pickle.UnpicklingError as e:
        # torch's message advises weights_only=False, i.e. running the file's code: keep only
        # the line that names what was refused.
        what = [ln.strip() for ln in str(e).splitlines() if "unsupported" in ln.lower()] or [first_line(e)]
        raise CheckpointError(f"{path}: not a loadable checkpoint (refused: {what[0][:160]}; nothing we "
                              "load runs pickled code)") from None
    except Exception as e:  # truncated zip, garbage
        raise CheckpointError(f"{path}: not a loadable checkpoint ({_file_kind(path, e)})") from None
    if not isinstance(ckpt, dict) or "model" not in ckpt or "format_version" not in ckpt:
        raise CheckpointError(f"{path}: not a Nash-MHC checkpoint (missing model/format_version)")
    if type(ckpt["format_version"]) is not int:
        raise CheckpointError(f"{path}: not a Nash-MHC checkpoint (format_version "
                              f"{ckpt['format_version']!r} is not an integer)")
    if ckpt["format_version"] > FORMAT_VERSION:
        raise CheckpointError(f"{path}: format_version {ckpt['format_version']} is newer than this "
                              f"code's {FORMAT_VERSION}")
    _check_fields(path, ckpt, {"model": dict, "step": int})
    if "optimizer" in ckpt:  # a checkpoint a run resumes from, not weights alone
        _check_fields(path, ckpt, {"optimizer": dict, "tokens_seen": int, "data": dict, "rng": dict,
                                   "config": dict})
        try:
            check_rng_state(ckpt["rng"])
        except CheckpointError as e:
            raise CheckpointError(f"{path}: {e}") from None
    if not with_optimizer:
        ckpt.pop("optimizer", None)
    return ckpt


def _load_dcp(ckpt_dir: Path, with_optimizer: bool = True) -> dict:
    """Consolidate a committed DCP directory on the CPU, in this process alone."""
    # What torch's dcp_to_torch_save does (format_utils.py), with the safe reader.
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    meta = _dcp_meta(ckpt_dir)
    tensors: dict = {}
    keys = None if with_optimizer else {"model"}
    try:
        with warnings.catch_warnings():  # "no process group: loading in a single process" is the point
            warnings.simplefilter("ignore", UserWarning)
            _load_state_dict(tensors, storage_reader=safe_reader(ckpt_dir),
                             planner=_EmptyStateDictLoadPlanner(keys=keys), no_dist=True)
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"{ckpt_dir}: DCP checkpoint does not load ({first_line(e)})") from None
    if "model" not in tensors:
        raise CheckpointError(f"{ckpt_dir}: no model tensors")
    meta["model"] = tensors["model"]
    if with_optimizer:
        meta["optimizer"]["state"] = tensors.get("optimizer", {}).get("state", {})
    else:
        meta.pop("optimizer")
    return meta


def load_checkpoint(path: str | Path, with_optimizer: bool = True) -> dict:
    """Load a checkpoint of either form on the CPU: a ``ckpt_*.pt`` file or a committed DCP
    directory (consolidated here; no process group or torch_xla needed). Both give the same dict:
    ``model``, ``optimizer`` (unless ``with_optimizer=False``: faster for sampling and export),
    ``step``, ``tokens_seen``, ``data``, ``rng``, ``nonfinite``, ``config``, ``trainer``,
    ``format_version``. Pickled code, an uncommitted directory and corrupt data are refused with
    ``CheckpointError``."""
    p = Path(path)
    if p.is_dir():
        return _load_dcp(p, with_optimizer)
    return _load_file(p, with_optimizer)


def peek_checkpoint(path: str | Path) -> dict:
    """What resuming needs to decide (config, step, ...), checked for loadability: a file is
    loaded whole; a DCP directory gives its marker's contents (no tensors: those are read into the
    live model later, each process its own shards) after its metadata and shard sizes are checked."""
    p = Path(path)
    return _dcp_meta(p) if p.is_dir() else _load_file(p)


def checkpoint_digest(path: str | Path, window: int = 1 << 20) -> str:
    """A short digest that tells two copies of one checkpoint from two different checkpoints
    (processes that resume from their own copies must hold the same one): a DCP directory's
    commit marker (it records when the save was made) and metadata, a file's size and its first
    and last ``window`` bytes (hashing a whole multi-GB file would cost as much as reading it)."""
    import hashlib

    p, h = Path(path), hashlib.sha256()
    try:
        if p.is_dir():
            for name in (MARKER, ".metadata"):
                f = p / name
                h.update(f.read_bytes() if f.is_file() else b"-")
        else:
            size = p.stat().st_size
            h.update(str(size).encode())
            with open(p, "rb") as f:
                h.update(f.read(window))
                f.seek(max(0, size - window))
                h.update(f.read(window))
    except OSError as e:
        raise CheckpointError(f"{p}: cannot read ({e.strerror or first_line(e)})") from None
    return h.hexdigest()[:12]


def find_latest(run_dir: str | Path, warn: Callable[[str], None] = print) -> tuple[Path, dict] | None:
    """The newest committed checkpoint in ``run_dir`` that passes ``peek_checkpoint``, with what it
    returned; a corrupt newer one is reported and skipped (never deleted)."""
    for step, path in reversed(list_checkpoints(run_dir)):
        try:
            return path, _named_step(path, step, peek_checkpoint(path))
        except CheckpointError as e:
            warn(f"warning: {e}; trying the previous checkpoint")
    return None


def _named_step(path: Path, step: int, ckpt: dict) -> dict:
    """``ckpt``, read from ``path`` in a run directory, if it holds the step its name says: the
    names order the checkpoints (resume, rotation), and one renamed or copied under a later
    step's name would be resumed from again and again, the run's newer saves sorting before it."""
    if ckpt["step"] != step:
        raise CheckpointError(f"{path}: holds step {ckpt['step']}, not the {step} its name says (renamed, "
                              "or copied in under another name): rename it or move it away")
    return ckpt


def find_resume(run_dir: str | Path, warn: Callable[[str], None] = print,
                with_optimizer: bool = True) -> tuple[Path, dict] | None:
    """The newest committed checkpoint in ``run_dir`` that loads, loaded (``load_checkpoint``)."""
    for step, path in reversed(list_checkpoints(run_dir)):
        try:
            return path, _named_step(path, step, load_checkpoint(path, with_optimizer))
        except CheckpointError as e:
            warn(f"warning: {e}; trying the previous checkpoint")
    return None


def resolve_checkpoint(path: str | Path, warn: Callable[[str], None] = print,
                       with_optimizer: bool = True) -> tuple[Path, dict]:
    """A checkpoint file or directory, or a run directory (its newest committed checkpoint)."""
    p = Path(path).expanduser()
    if p.is_dir() and not is_dcp_dir(p):
        found = find_resume(p, warn, with_optimizer)
        if found is None:
            if (p / "config.json").is_file() and not list_checkpoints(p):
                raise CheckpointError(f"{p}: a Hugging Face model directory (config.json), not a checkpoint: "
                                      "load it with transformers; a Llama's starts a run with "
                                      "checkpoint.init_from")
            raise CheckpointError(f"{p}: no checkpoint in this run directory (no committed ckpt_*), "
                                  "and not a checkpoint directory itself")
        return found
    return p, load_checkpoint(p, with_optimizer)


def check_checkpoint_out(out: Path, overwrite: bool) -> None:
    """Before a tool writes the one-file checkpoint ``out``: it is new, or, with ``overwrite``, a
    torch.save file (whole, or damaged by an interrupted write or copy; or empty), which is
    replaced. Never a directory, a device, or a file of anything else (a data shard, a tokenizer,
    safetensors: a mistyped path), as a CheckpointError."""
    if out.is_dir():
        raise CheckpointError(f"{out}: is a directory (give the file to write, e.g. {out / 'model.pt'})")
    if not out.exists():
        return
    if not overwrite:
        raise CheckpointError(f"{out}: exists (pass --overwrite to replace it)")
    if not out.is_file():
        raise CheckpointError(f"{out}: not a regular file (a device or a socket is never replaced)")
    what = _not_torch_save(out)
    if what:
        raise CheckpointError(f"{out}: not a checkpoint ({what}); --overwrite replaces a checkpoint only")


def _not_torch_save(path: Path) -> str:
    """What ``path`` is if it is not a torch.save file ("" if it is one, whole or truncated, or is
    empty), from its bytes alone: nothing in it is loaded."""
    kind = _header_kind(path)
    if kind != "zip":
        return {"empty": "", "safetensors": "a safetensors file", "unreadable": "it cannot be read"}.get(
            kind, "its bytes are not torch.save's zip format")
    try:
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
    except (zipfile.BadZipFile, OSError):
        return ""   # a zip cut short: an interrupted torch.save or copy
    return "" if any(n.endswith("/data.pkl") for n in names) else "a zip archive torch.save did not write"


def consolidate(src: str | Path, out: str | Path, model_only: bool = False,
                overwrite: bool = False) -> dict:
    """Write a checkpoint (usually a DCP directory) as one ``ckpt_*.pt``-style file, loadable with
    ``weights_only=True`` and resumable by either trainer (``model_only``: weights and metadata
    only, for sampling and export). Never replaces an existing file unless ``overwrite``."""
    out = Path(out)
    check_checkpoint_out(out, overwrite)
    ckpt = load_checkpoint(src, with_optimizer=not model_only)
    write_checkpoint_file(ckpt, out)
    return ckpt


def write_checkpoint_file(obj: dict, out: Path) -> None:
    """A tool's ``atomic_torch_save``: a write that fails (a full disk, which torch's writer
    reports as a RuntimeError; a directory that cannot be written) is a one-line CheckpointError,
    and ``out`` is left as it was."""
    try:
        atomic_torch_save(obj, out)
    except (OSError, RuntimeError) as e:
        raise CheckpointError(f"{out}: cannot write ({first_line(e)})") from None


# -- rotation and clean-up (master only) ----------------------------------------------------------

def _delete(path: Path) -> None:
    """Uncommit first (a crash half-way leaves an uncommitted directory, which is ignored). A
    symlink (a checkpoint of another run linked in to resume from) is removed, never what it
    points to: through it, the other run's marker went and its next start deleted the checkpoint."""
    if path.is_symlink():
        path.unlink()
    elif path.is_dir():
        (path / MARKER).unlink(missing_ok=True)
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def rotate(run_dir: str | Path, keep: int, newest: int | None = None,
           warn: Callable[[str], None] | None = None, keep_every: int = 0) -> list[Path]:
    """Delete committed checkpoints older than ``newest`` (default: the newest committed) beyond
    the ``keep`` newest, and unfinished saves older than it; return what was deleted. Committed
    checkpoints whose step is a multiple of ``keep_every`` (when not 0) are milestones: never
    deleted here, and not among the ``keep``. The master
    calls it after a commit: nothing older than that commit is still being written. With ``warn``,
    one that cannot be deleted (a bucket that takes new objects but refuses deletes) is said
    there and the others still go; without, the error is raised."""
    entries = _entries(Path(run_dir))
    committed = [(s, p) for s, p, ok in entries if ok]
    if newest is None:
        if not committed:
            return []
        newest = committed[-1][0]
    older = [p for s, p in committed if s < newest and not (keep_every and s % keep_every == 0)]
    doomed = older[:max(0, len(older) - (keep - 1))] if keep > 0 else []
    doomed += [p for s, p, ok in entries if not ok and s < newest]
    return _delete_all(doomed, warn, f"(checkpoint.keep={keep})", "the next save tries again")


def clean_uncommitted(run_dir: str | Path, warn: Callable[[str], None] | None = None) -> list[Path]:
    """Delete every unfinished save (uncommitted DCP directories, temporary files) and return what
    was deleted. Only at start, on the master, before any save of this run: nothing can be in
    flight. With ``warn``, one that cannot be deleted is said there (it is never loaded, and
    rotation tries again); without, the error is raised."""
    doomed = [p for _, p, ok in _entries(Path(run_dir)) if not ok]
    return _delete_all(doomed, warn, "(an unfinished save)", "it is never resumed from")


def _delete_all(paths: list[Path], warn: Callable[[str], None] | None, what: str, after: str) -> list[Path]:
    """Delete ``paths``; those deleted. One that cannot be: the error raised, or with ``warn`` said
    there (``what`` the path is, ``after`` why going on is safe) and the others still go."""
    deleted = []
    for p in paths:
        try:
            _delete(p)
            deleted.append(p)
        except OSError as e:
            if warn is None:
                raise
            warn(f"warning: cannot delete {p} {what}: {e.strerror or e}; the run goes on ({after})")
    return deleted


# -- the object the training loop calls -----------------------------------------------------------

# checkpoint.dir (real path) -> the descriptor of its .lock, held by this process until the run ends
_RUN_LOCKS: dict[str, int] = {}


def release_run_lock(run_dir: str | Path) -> None:
    """Let another run use ``run_dir`` (training.loop.train, at the end of a run in this process)."""
    fd = _RUN_LOCKS.pop(os.path.realpath(Path(run_dir).expanduser()), None)
    if fd is not None:
        os.close(fd)


class Checkpointer:
    """What the loop calls for checkpoints: ``find`` (the resume point), ``restore``, ``save``,
    ``wait`` (for a save being written) and ``rotate``.

    ``save`` copies the state to the host at the step (``backend.stage``: on XLA SPMD each process
    copies only its local shards; with FSDP2 each rank its shard; in the single-file form only the
    master copies). The write (``torch.save`` by the master, or ``dcp.save`` by every process over
    the backend's checkpoint group) then runs at once, or with ``async_save`` in a background
    thread while training continues. At most one save is pending: the next ``save`` waits for it
    first. After the write the master commits (a DCP directory's marker) and rotates. A failed
    background save raises ``CheckpointError`` at the next ``save``/``wait``.
    """

    def __init__(self, run_dir: str | Path, keep: int, backend, log: Callable[[str], None] = print,
                 async_save: bool = False, keep_every: int = 0):
        self.run_dir, self.keep, self.backend, self.log = Path(run_dir), keep, backend, log
        self.keep_every = keep_every
        self.async_save = async_save
        self.sharded = backend.checkpoint_format == "dcp"
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    # -- resume ------------------------------------------------------------------------------
    def find(self, resume: str) -> tuple[Path, dict] | None:
        """``checkpoint.resume``: ``auto`` (the newest committed checkpoint in the run directory
        that passes ``peek_checkpoint``, if any), ``none``, or a path (an error if it does not
        load). The master first deletes unfinished saves in the run directory. Every process must
        arrive at the same checkpoint (checked with one host-side collective).

        A run that does not continue the run directory's newest checkpoint (``none``, or a path to
        an older one) is refused while the directory holds committed checkpoints past its start:
        its saves would overwrite some of them and leave the others, which ``auto``, sample.py and
        export_hf.py would then take for this run's newest. Unless that newest was saved by a run
        started from the same path (``_continuation``): the same command, run again after a stop,
        goes on from it.

        With several processes, ``checkpoint.dir`` must be one directory for all of them (a DCP
        save writes every process's shards there, the master commits): checked first, with a
        file the master writes and every process reads back."""
        self._check_shared()
        self._lock_run_dir()
        if self.backend.is_master:
            for p in clean_uncommitted(self.run_dir, warn=self.log):
                self.log(f"removed {p}: an unfinished save")
        error = found = digest = None
        continued = False
        try:
            if resume not in ("auto", "none"):
                found = self._continuation(resume)
                continued = found is not None
            found = found or self._find(resume)
            # what the files hold, not only their names: with checkpoint.resume a path on each
            # host's own disk, hosts that were given different copies would train on apart
            digest = checkpoint_digest(found[0]) if found else None
        except CheckpointError as e:
            error = e
        self.backend.host.raise_together(error, CheckpointError)  # all stop, or none
        start = found[1]["step"] if found else 0
        ahead = ([p for s, p in list_checkpoints(self.run_dir) if s > start]
                 if resume != "auto" and not continued else [])
        # auto with committed checkpoints of which none loads: starting over would save new
        # checkpoints among the old ones, under the same names
        unloadable = resume == "auto" and found is None and bool(list_checkpoints(self.run_dir))
        seen = f"{found[0].name}@{start}" if found else "none"
        names = f"{seen} ahead:{ahead[-1].name if ahead else None} {unloadable}"
        if not self.backend.all_equal(f"{names} {digest}"):   # one collective; a second only to say what differs
            if not self.backend.all_equal(names):
                raise CheckpointError(f"{self.run_dir}: the processes see different checkpoints to "
                                      f"resume from (this one: {seen}); put checkpoint.dir on storage "
                                      "every host sees (a shared filesystem or a gcsfuse bucket)")
            raise CheckpointError(f"{found[0]}: the processes hold different contents under this name "
                                  f"(this one's digest: {digest}): give every host the same checkpoint, "
                                  "or put it on storage every host sees")
        if unloadable:
            raise CheckpointError(
                f"{self.run_dir} holds committed checkpoints and none of them loads (the warnings "
                "above say why): move them away, or set checkpoint.resume to a checkpoint that loads")
        if found is not None and "optimizer" not in found[1]:
            raise CheckpointError(f"{found[0]}: weights only (export_hf.py --import?): start a run "
                                  "from it with checkpoint.init_from")
        if ahead:
            raise CheckpointError(
                f"{self.run_dir} holds {len(ahead)} checkpoint(s) past step {start} (newest {ahead[-1].name}) "
                f"that checkpoint.resume={resume} would overwrite or mix with this run's: use another "
                "checkpoint.dir, move them away, or resume: auto")
        return found

    def _find(self, resume: str) -> tuple[Path, dict] | None:
        """``find``'s lookup in this process: the checkpoint ``resume`` names, or None."""
        if resume == "none":
            return None
        if resume == "auto":
            return find_latest(self.run_dir, warn=self.log)
        path = Path(resume).expanduser()
        if path.is_dir() and not is_dcp_dir(path):  # a run directory: its newest
            found = find_latest(path, warn=self.log)
            if found is None:
                raise CheckpointError(f"checkpoint.resume={resume}: no committed checkpoint in "
                                      "this run directory, and not a checkpoint directory itself")
            return found
        return path, peek_checkpoint(path)

    def _continuation(self, resume: str) -> tuple[Path, dict] | None:
        """With ``checkpoint.resume`` a path: the run directory's newest checkpoint that loads, if
        the run that saved it was started from that same path. The same command run again (a job
        requeued after a preemption) then goes on from where it stopped, as with ``auto``, instead
        of being refused for the checkpoints its own first run saved past its start."""
        if not list_checkpoints(self.run_dir):
            return None
        found = find_latest(self.run_dir, warn=self.log)
        if found is None:
            return None
        started = found[1].get("config", {}).get("checkpoint", {}).get("resume")
        if started in (None, "auto", "none") or (Path(started).expanduser().resolve()
                                                  != Path(resume).expanduser().resolve()):
            return None
        self.log(f"checkpoint.resume={resume}: {found[0].name} in {self.run_dir} was saved by a run "
                 f"started from it; going on from there (step {found[1]['step']})")
        return found

    def _lock_run_dir(self) -> None:
        """One run at a time in a ``checkpoint.dir``: the master holds an exclusive lock on its
        ``.lock`` until the run ends (``release_run_lock``; the kernel lets go when the process
        ends, SIGKILL included). A second run started there meanwhile (launched twice, a requeue while the old
        job lives) would delete the first one's save in progress as unfinished, and overwrite its
        checkpoints: it is refused on every process, before anything is touched. A POSIX record
        lock (``lockf``), not ``flock``: a flock belongs to the open file, which the forked data
        loader workers share, so after a SIGKILL of the master it lived on in them for seconds and
        an immediate restart was refused; a record lock is the process's own. A filesystem without
        locks (gcsfuse) enforces nothing."""
        error = None
        if self.backend.is_master:
            key = os.path.realpath(self.run_dir)
            if key not in _RUN_LOCKS:  # this process's: taken once, whatever the Checkpointers
                fd = None
                try:
                    fd = os.open(self.run_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
                    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    _RUN_LOCKS[key], fd = fd, None
                    # probes left by a run killed here: removed under the lock, never another
                    # launch's live one (this run's own is gone already)
                    for old in self.run_dir.glob(".shared-probe-*"):
                        old.unlink(missing_ok=True)
                except OSError as e:  # held (EAGAIN, EACCES), or no locks here (ENOLCK, ENOTSUP)
                    if e.errno in (errno.EAGAIN, errno.EACCES):
                        error = CheckpointError(
                            f"checkpoint.dir={self.run_dir}: another run is using it (it holds "
                            f"{self.run_dir / '.lock'}); let it end or stop it, or use another checkpoint.dir")
                finally:
                    if fd is not None:
                        os.close(fd)
        self.backend.host.raise_together(error, CheckpointError)

    def _check_shared(self) -> None:
        """Refuse, on every process together, a ``checkpoint.dir`` that some process does not see
        as the master does (a local disk on each host instead of a shared filesystem or bucket):
        its saves would be missing the other hosts' shards, and resume would differ per host.
        In the sharded (DCP) form every process also writes (and removes) a probe file of its
        own there, since every process writes its shards: one that cannot (a read-only mount on
        one host) failed only at the first save, after training. One process checks only that
        it can write there (before, a file or a read-only directory in its way was a traceback
        from the first log line)."""
        host = self.backend.host
        token = ""
        if self.backend.is_master:
            token = secrets.token_hex(8)
            try:
                self.run_dir.mkdir(parents=True, exist_ok=True)
                atomic_write_json({"token": token}, self.run_dir / f".shared-probe-{token}")
            except OSError as e:  # said on every process: the others wait in the gather below
                token = f"!{first_line(e)}"
        if host.size > 1:
            token = host.all_gather_text(token)[0]  # after the master's write, on every process
        if token.startswith("!"):
            who = "process 0 cannot" if host.size > 1 else "cannot"
            raise CheckpointError(f"checkpoint.dir={self.run_dir}: {who} write there: {token[1:]}")
        probe = self.run_dir / f".shared-probe-{token}"
        if host.size == 1:
            probe.unlink(missing_ok=True)
            return
        try:
            seen = json.loads(probe.read_text()).get("token") == token
        except (OSError, ValueError):
            seen = False
        mine = "1" if seen else "0"
        if self.sharded and not self.backend.is_master and seen:
            own = self.run_dir / f".shared-probe-{token}-{host.rank}"
            try:
                atomic_write_json({"token": token}, own)
                own.unlink()
            except OSError as e:
                mine = f"!{first_line(e)}"
        seen_by = host.all_gather_text(mine)
        if self.backend.is_master:
            probe.unlink(missing_ok=True)
        blind = [str(rank) for rank, s in enumerate(seen_by) if s == "0"]
        if blind:
            raise CheckpointError(
                f"checkpoint.dir={self.run_dir}: process(es) {', '.join(blind)} do not see the files "
                "process 0 writes there: put it on storage every host mounts (a shared filesystem "
                "or a gcsfuse bucket), at the same path")
        unwritable = [(rank, s[1:]) for rank, s in enumerate(seen_by) if s.startswith("!")]
        if unwritable:
            rank, why = unwritable[0]
            others = f" (and process(es) {', '.join(str(r) for r, _ in unwritable[1:])})" if unwritable[1:] else ""
            raise CheckpointError(
                f"checkpoint.dir={self.run_dir}: process {rank} cannot write there{others}, and every "
                f"process writes its own shards of a sharded checkpoint: {why}")

    def restore(self, path: Path, peeked: dict, model, optimizer) -> None:
        """Load the tensors of a ``find`` result into the live (placed, sharded) model and
        optimiser. A DCP directory on a sharded backend: each process reads its own shards, for
        any mesh or world size (``backend.load_sharded_state``). Otherwise the whole state on the
        CPU (a file, or a DCP directory consolidated) into ``backend.load_full_state``.

        A failure (shards that ``peek_checkpoint``'s size checks passed but do not read, a state
        that does not fit) stops every process, in one line naming the checkpoint."""
        from torch.distributed.checkpoint.api import CheckpointException as DCPCheckpointException
        error = None
        try:
            if Path(path).is_dir() and self.sharded:
                self.backend.load_sharded_state(model, optimizer, path,
                                                peeked["optimizer"]["param_groups"], safe_reader(path))
            else:
                full = peeked if "model" in peeked else load_checkpoint(path)
                self.backend.load_full_state(model, optimizer, full["model"], full["optimizer"])
        except CheckpointError as e:
            error = e
        except torch.OutOfMemoryError:
            raise  # not the checkpoint's fault
        except (DCPCheckpointException, OSError, RuntimeError, ValueError, KeyError) as e:
            # what unreadable shards (DCP gathers every reader's failure) or a state that does
            # not fit the model raise
            inside = Path(path).resolve().parent == self.run_dir.resolve()
            advice = ("move it out of checkpoint.dir (resume: auto then takes the one before it)" if inside
                      else "check that it is whole and still there, or resume from another checkpoint")
            error = CheckpointError(f"{path}: cannot be loaded ({type(e).__name__}: {first_line(e)}); {advice}")
        self.backend.host.raise_together(error, CheckpointError)  # all stop, or none

    # -- save --------------------------------------------------------------------------------
    def save(self, meta: dict, model, optimizer, reason: str, wait: bool = False) -> Path:
        """Save ``meta`` (plain data: step, config, ...) with the model and optimiser state."""
        self.wait()
        step = int(meta["step"])
        path = checkpoint_path(self.run_dir, step, self.sharded)
        t0 = time.time()
        state = self.backend.checkpoint_state(model, optimizer)
        if self.sharded:
            marker = {**meta, "format": "dcp", "rng": rng_to_json(meta["rng"]),
                      "optimizer_param_groups": _jsonable(state["optimizer"]["param_groups"]),
                      "writers": self.backend.host.size}
            tensors = self.backend.stage({"model": state["model"],  # device -> host, now
                                          "optimizer": {"state": state["optimizer"]["state"]}},
                                         sharded=True)
            job = lambda: self._write_dcp(path, tensors, marker)  # noqa: E731
        else:
            staged = self.backend.stage(state, sharded=False)  # the master's copy, now
            obj = None if staged is None else {**meta, **staged}
            job = lambda: self._write_file(path, obj)  # noqa: E731
        staged_s = time.time() - t0
        note = f"{reason}; staged in {staged_s:.2f}s"

        def run():
            try:
                job()
                if self.backend.is_master:
                    self.rotate(newest=step)
                    self.log(f"saved {path} ({note}, written in {time.time() - t0 - staged_s:.2f}s)")
            except BaseException as e:  # noqa: BLE001 (re-raised by wait())
                self._error = e

        if self.async_save and not wait:
            self._thread = threading.Thread(target=run, name="checkpoint-writer", daemon=True)
            self._thread.start()
        else:
            run()
            self._raise()
        return path

    def _write_file(self, path: Path, obj: dict | None) -> None:
        if obj is not None:  # the master
            atomic_torch_save(obj, path)

    def _write_dcp(self, path: Path, tensors: dict, marker: dict) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException as DCPCheckpointException

        group = self.backend.ckpt_group
        error = None
        if self.backend.is_master:
            try:
                if path.exists():  # a stale save of the same step (e.g. after resuming further back)
                    _delete(path)
                path.mkdir(parents=True, exist_ok=True)
            except OSError as e:  # a full disk, a quota, a storage error: every process stops this save
                error = CheckpointError(f"{path}: cannot make the checkpoint directory ({e.strerror or e})")
        # nobody writes before the stale one is gone, and nobody waits for a master that failed
        # (a barrier here hung every other process while the master went on to report its error)
        HostGroup(group).raise_together(error, CheckpointError)
        with warnings.catch_warnings():  # one process: "saving in a single process" is the point
            if group is None:
                warnings.simplefilter("ignore", UserWarning)
            # The tensors are already on the host (stage()): per_thread_copy_ahead=0 keeps DCP's
            # writer on its serial loader. Its overlapping loader exists for device-to-host copies
            # and asks the PrivateUse1 device module for streams: with torchax installed (JAX, for
            # xla.scan_layers) that module has none and every save failed.
            writer = dcp.FileSystemWriter(path, sync_files=True, per_thread_copy_ahead=0)
            try:
                dcp.save(tensors, storage_writer=writer, planner=self.backend.dcp_save_planner(),
                         process_group=group, no_dist=group is None)
            except DCPCheckpointException:
                # Every process has it (DCP gathers the writers' results before it decides), so
                # none writes here any more: the shards go now, not at the next start (on a full
                # disk they would keep it full).
                if self.backend.is_master:
                    _delete(path)
                raise
        # dcp.save returned: every writer finished and the coordinator (the master) wrote .metadata.
        if self.backend.is_master:
            try:
                atomic_write_json({**marker, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
                                  path / MARKER)
            except BaseException:  # a full disk after the shards fit: they go now, as above
                if not (path / MARKER).exists():  # (once it is there the save is committed)
                    _delete(path)
                raise

    def wait(self, quiet: bool = False) -> None:
        """Block until the pending save (if any) is written and committed; raise its error
        (``quiet``: report it instead, when another error is already on its way)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if quiet:  # on an error path, where the other processes may not be waiting with us
            if self._error is not None:
                self.log(f"warning: the pending checkpoint save failed ({first_line(self._error)})")
                self._error = None
            return
        self._raise()

    def failed(self) -> bool:
        """Whether an asynchronous save has ended with an error not yet raised (``wait`` raises it)."""
        return self._error is not None and (self._thread is None or not self._thread.is_alive())

    def _raise(self) -> None:
        """Raise a failed save's error on every process, decided together (every process calls
        this at the same points): a master that failed alone would exit while the others waited
        for it in the next step's collectives."""
        if not self.backend.any_process(self._error is not None):
            return
        e, self._error = self._error, None
        if e is None:
            raise CheckpointError(f"{self.run_dir}: saving a checkpoint failed on another process")
        if isinstance(e, CheckpointError):
            raise e
        raise CheckpointError(f"{self.run_dir}: saving a checkpoint failed ({self._why(e)})") from e

    def _why(self, e: BaseException) -> str:
        """A failed save in one line: DCP's CheckpointException by its first failing process's
        error, and the space left where the run saves (torch's writer reports a full disk as
        "unexpected pos N vs M")."""
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict) and failures:
            rank = min(failures)
            why = f"process {rank}: {first_line(failures[rank][0])}"
        else:
            why = first_line(e)
        try:
            why += f"; {shutil.disk_usage(self.run_dir).free / 2 ** 20:,.0f} MiB free on its disk"
        except OSError:
            pass
        return why

    def rotate(self, newest: int | None = None) -> list[Path]:
        """The master deletes committed checkpoints older than ``newest`` beyond ``keep``."""
        return (rotate(self.run_dir, self.keep, newest, warn=self.log, keep_every=self.keep_every)
                if self.backend.is_master else [])


def _jsonable(obj):
    """Plain JSON data (the optimiser's param_groups: numbers, strings, flags, lists)."""
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, torch.Tensor) and obj.numel() == 1:
        return obj.item()
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"not JSON data: {type(obj).__name__}")


# -- optimiser state by parameter name ------------------------------------------------------------

def parameter_names(model: torch.nn.Module) -> dict[int, str]:
    """Each parameter's name by its id: a tied tensor under its first name (``named_parameters``
    gives it once), the name state dicts key it by."""
    return {id(p): name for name, p in model.named_parameters()}


def optimizer_state_by_name(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> dict:
    """A format-1 optimiser state (keyed by index, ``Optimizer.state_dict()``) keyed by parameter
    name instead, as ``torch.distributed.checkpoint.state_dict`` keys it. Index i is the i-th
    parameter of the param groups, which ``build_optimizer`` orders the same way every run."""
    keys = list(state.get("state", {}))
    if not keys or not all(isinstance(k, int) for k in keys):
        return state
    names = parameter_names(model)
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    n_saved = sum(len(g["params"]) for g in state["param_groups"])
    if n_saved != len(order):
        raise CheckpointError(f"the checkpoint's optimizer has {n_saved} parameters, this one {len(order)}")
    return {"state": {order[i]: v for i, v in state["state"].items()},
            "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in state["param_groups"]]}


def keep_hyperparameters(optimizer: torch.optim.Optimizer):
    """A context for loading optimiser state that keeps this run's hyperparameters and
    implementation flags (``load_state_dict`` restores the saved groups' learning rate, weight
    decay and ``fused``/``foreach`` flags, which belong to the old config or the other trainer).

    ``load_state_dict`` also placed each ``step`` by the *saved* group's flags: a checkpoint of
    ``training.optim.AdamW`` (train_xla.py, MPS; ``fused`` None) left it on the CPU, where this
    run's ``torch.optim.AdamW(fused=True)`` on a GPU refuses it at the first update ("Expected all
    tensors to be on the same device"). With this run's flags back, a fused or capturable group's
    ``step`` goes where torch's own rule puts it: fp32 on its parameter's device."""
    import contextlib

    @contextlib.contextmanager
    def ctx():
        fresh = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        yield
        for group, mine in zip(optimizer.param_groups, fresh):
            for k in [k for k in group if k not in mine and k != "params"]:
                del group[k]
            group.update(mine)
            if group.get("fused") or group.get("capturable"):
                for p in group["params"]:
                    step = optimizer.state.get(p, {}).get("step")
                    if torch.is_tensor(step) and (step.device != p.device or step.dtype != torch.float32):
                        optimizer.state[p]["step"] = step.to(p.device, torch.float32)
    return ctx()


# -- RNG state ------------------------------------------------------------------------------------

def rng_state() -> dict:
    """The host RNGs, as weights_only-loadable tensors and lists."""
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


def _set_host_rngs(state: dict, python=random, numpy=np.random, torch_set=torch.set_rng_state) -> None:
    """``state``'s host generator parts set on ``python`` (``setstate``), ``numpy``
    (``set_state``) and through ``torch_set``: the global generators, or scratch ones."""
    if "python" in state:
        v, internal, gauss = state["python"]
        python.setstate((v, tuple(internal), gauss))
    if "numpy" in state:
        name, keys, pos, has_gauss, cached = state["numpy"]
        keys = keys.numpy() if isinstance(keys, torch.Tensor) else np.asarray(keys)
        numpy.set_state((name, keys.astype(np.uint32), pos, has_gauss, cached))
    if "torch" in state:
        torch_set(state["torch"])


def set_rng_state(state: dict) -> None:
    _set_host_rngs(state)
    if "cuda" in state and torch.cuda.is_available():
        try:
            torch.cuda.set_rng_state_all(state["cuda"])
        except (RuntimeError, IndexError):
            print("warning: CUDA RNG state not restored (different device count)", file=sys.stderr)


def check_rng_state(state: dict) -> None:
    """``CheckpointError`` unless ``set_rng_state`` takes ``state``: each host generator's part is
    set on a scratch generator of its kind (a part of the wrong size or type fails here, when the
    checkpoint is peeked, not in the middle of a resume). The CUDA part depends on the device
    count and ``set_rng_state`` already warns and goes on without it."""
    try:
        _set_host_rngs(state, random.Random(), np.random.RandomState(), torch.Generator().set_state)
    except Exception as e:   # whatever the generators refuse (ValueError, TypeError, RuntimeError)
        raise CheckpointError(f"malformed RNG state ({first_line(e)})") from None


def rng_to_json(state: dict) -> dict:
    """``rng_state()`` as JSON data (for a DCP checkpoint's marker)."""
    out = {"python": state["python"],
           "numpy": [state["numpy"][0], state["numpy"][1].tolist(), *state["numpy"][2:]],
           "torch": state["torch"].tolist()}
    if "cuda" in state:
        out["cuda"] = [t.tolist() for t in state["cuda"]]
    return out


def rng_from_json(state: dict) -> dict:
    try:
        out = {"python": state["python"],
               "numpy": [state["numpy"][0], torch.tensor(state["numpy"][1], dtype=torch.int64),
                         *state["numpy"][2:]],
               "torch": torch.tensor(state["torch"], dtype=torch.uint8)}
        if "cuda" in state:
            out["cuda"] = [torch.tensor(t, dtype=torch.uint8) for t in state["cuda"]]
    except (KeyError, TypeError, ValueError, IndexError, OverflowError) as e:
        raise CheckpointError(f"malformed RNG state in {MARKER} ({first_line(e)})") from None
    return out


# -- command line ---------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m training.checkpoint",
                                 description="Checkpoint tools.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("consolidate", help="write a checkpoint (a DCP directory, or a run "
                       "directory's newest) as one ckpt_*.pt-style file")
    c.add_argument("checkpoint", help="a DCP checkpoint directory, a ckpt_*.pt file, or a run directory")
    c.add_argument("out", help="the file to write (e.g. model.pt)")
    c.add_argument("--model-only", action="store_true", help="leave the optimizer state out")
    c.add_argument("--overwrite", action="store_true", help="replace OUT if it is a checkpoint")
    args = ap.parse_args(argv)
    try:
        src = Path(args.checkpoint).expanduser()
        if src.is_dir() and not is_dcp_dir(src):  # a run directory: its newest committed checkpoint
            found = find_latest(src, warn=lambda m: print(m, file=sys.stderr))
            if found is None:
                raise CheckpointError(f"{src}: no committed checkpoint (ckpt_*) in this directory")
            src = found[0]
        ckpt = consolidate(src, args.out, model_only=args.model_only, overwrite=args.overwrite)
    except CheckpointError as e:
        print(f"training.checkpoint: error: {e}", file=sys.stderr)
        return 2
    n = sum(v.numel() for v in ckpt["model"].values())
    print(f"wrote {args.out}: {src} (step {ckpt['step']}, {n / 1e6:.2f}M model values"
          f"{'' if args.model_only else ', with optimizer state'})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
