"""Host-side agreement between processes: small gloo collectives on CPU tensors.

Decisions that must be the same on every process or host (stop after a SIGTERM that reached one
of them, stop after too many non-finite steps, "is the data the same everywhere?") are taken with
ONE tiny all-reduce over a gloo process group. The tensors live on the host, so the collective
never waits for the accelerator (no device sync, unlike an all-reduce on the training group with
nccl or XLA) and needs no rendezvous: it is an ordinary collective on a group made once at start.

Every process must make the same calls in the same order (the loop takes decisions at log steps,
which are the same steps everywhere). In a single process every method answers locally.

Groups are made by the backends: ``TorchBackend`` after ``init_process_group`` (torchrun),
``XLABackend`` after ``init_gloo("xla://")`` (one rank per host in SPMD, one per chip in ddp
mode), whose group also carries the launch checks (``all_gather_text``). Checkpoint I/O gets a
group of its own (``new_gloo_group``): an asynchronous save runs DCP's collectives in a background
thread, and two threads must never share a process group.
"""
from __future__ import annotations

import datetime
import hashlib
from typing import Sequence

import torch
import torch.distributed as dist


def group_timeout(seconds: "float | None") -> "datetime.timedelta | None":
    """``training.dist_timeout_s`` as the process groups take it (``None``: torch's default)."""
    return None if seconds is None else datetime.timedelta(seconds=seconds)


def init_gloo(init_method: str, timeout_s: "float | None" = None, store=None, rank: int = -1,
              world_size: int = -1) -> None:
    """The default process group, with gloo, unless one is already initialised (a test, a
    notebook, a caller that made it): then that one is used as it is. ``store``, ``rank`` and
    ``world_size``: a rendezvous made by the caller instead of ``init_method``'s."""
    if not dist.is_initialized():
        if store is not None:
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                    timeout=group_timeout(timeout_s))
        else:
            dist.init_process_group("gloo", init_method=init_method, timeout=group_timeout(timeout_s))


def new_gloo_group(timeout_s: "float | None" = None) -> "dist.ProcessGroup | None":
    """A new gloo group over every process of the initialised default group (``None`` when there
    is no default group or only one process). Every process must call it, in the same order."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    return dist.new_group(backend="gloo", timeout=group_timeout(timeout_s))


class HostGroup:
    """Host-side collectives for decisions: ``any``, ``all_equal``, ``all_gather_text``,
    ``raise_together`` (no barrier: a process that failed before one would leave the rest waiting;
    agree on the failure instead).

    ``group`` is a gloo process group (``None``: one process, everything is local).
    """

    def __init__(self, group: "dist.ProcessGroup | None" = None):
        self.group = group

    @property
    def size(self) -> int:
        return 1 if self.group is None else dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        """This process's index in the group (its place in ``all_gather_text``'s list)."""
        return 0 if self.group is None else dist.get_rank(self.group)

    def max(self, values: Sequence[int]) -> tuple[int, ...]:
        """For each integer: its largest value over the processes. One all-reduce (MAX)."""
        values = tuple(int(v) for v in values)
        if self.group is None:
            return values
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return tuple(int(v) for v in t.tolist())

    def any(self, flags: Sequence[bool]) -> tuple[bool, ...]:
        """For each flag: is it true on any process? One all-reduce (MAX) for all of them."""
        return tuple(bool(v) for v in self.max([bool(f) for f in flags]))

    def all_equal(self, text: str) -> bool:
        """Is ``text`` the same on every process? (Compares a 62-bit hash: one all-reduce of
        ``[h, -h]`` with MAX gives max(h) and -min(h).) The same answer everywhere."""
        if self.group is None:
            return True
        h = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 2
        t = torch.tensor([h, -h], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t[0]) == -int(t[1])

    def all_gather_text(self, text: str, size: int = 1024) -> list[str]:
        """Every process's ``text`` (UTF-8, cut at ``size`` bytes), in rank order: for decisions
        that need to know who differs (the launch checks). One all-gather of ``size`` bytes."""
        data = text.encode()[:size]
        if self.group is None:
            return [data.decode(errors="replace")]
        mine = torch.zeros(size, dtype=torch.uint8)
        mine[:len(data)] = torch.tensor(list(data), dtype=torch.uint8)  # frombuffer refuses b""
        everyone = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(everyone, mine, group=self.group)
        return [bytes(t.tolist()).rstrip(b"\0").decode(errors="replace") for t in everyone]

    def raise_together(self, error: Exception | None, kind: type = RuntimeError) -> None:
        """Raise on every process if ``error`` happened on any, for work that may fail on some
        processes only (a checkpoint one host cannot read), instead of the others dying in the
        next collective: this process's own ``error``, or ``kind`` with the first failing
        process's reason (rank order). One all-gather."""
        mine = "" if error is None else (str(error) or type(error).__name__)   # a message-less error too
        failed = mine if self.group is None else next((e for e in self.all_gather_text(mine) if e), "")
        if failed:
            raise error or kind(f"{failed} (on another process)")
