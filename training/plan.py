"""Know before you launch: the per-chip memory and time plan of a config (``--plan``).

    python train_xla.py configs/nash_mhc_3b.yaml --plan --device-kind v4
    python train.py configs/small_gpu.yaml --plan --device-kind h100 --world-size 8

Nothing is allocated and no device is needed. The memory of a training step is not a hand formula:
one real step of the real model (``model.py``, the loop's step: forward under autocast, backward,
clipping, the optimiser's update) runs on fake tensors (``FakeTensorMode``: shapes and dtypes, no
data) under a dispatch mode that records when every tensor storage is created and freed, as the
eager PyTorch allocator would see it. That timeline, per kind of tensor, is then laid out on one
chip of the configured mesh: weights, gradients and optimiser state divided by their sharding
(``training/sharding.py``, the rule the XLA backend applies), activations at the per-chip batch.
Its maximum is the per-chip peak; the evaluation forward is traced the same way.

What the trace does not see (README, "Planning a run"): XLA's own fusion (which removes many
eager temporaries) and rematerialisation, its buffer assignment and fragmentation, the runtime's
reserved memory, and how long XLA keeps all-gathered weights alive; a weight used in an op is
counted as all-gathered for that op only. Tensor parallelism divides the weights but the
activations are counted whole (an upper bound). A safety margin (``--margin``, default 10%) of the
chip's memory is kept for all of that.
"""
from __future__ import annotations

import bisect
import contextlib
import dataclasses
import functools
import glob
import itertools
import math
import os
import re
import sys
import types
import weakref
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from model import ModelConfig, NashMHC

from .backend import fused_adamw
from .config import Config, ConfigError, check_xla
from .monitor import TPU_DEVICE_KINDS, peak_flops_for
from .optim import AdamW, build_optimizer
from .sharding import param_partition_spec, shard_factor, state_partition_spec

GiB = 2 ** 30


# ----------------------------------------------------------------------------------------------
# Devices.

@dataclass(frozen=True)
class Device:
    kind: str
    name: str               # as the backends name it (monitor.TPU_DEVICE_KINDS, monitor.PEAK_FLOPS)
    memory: int             # bytes per chip
    compiler: str           # "xla" (train_xla.py) or "eager" (train.py)

    def peak_flops(self, precision: str = "bf16") -> Optional[float]:
        return peak_flops_for(self.name, precision)


# Memory per chip, from the vendors' pages (the peak FLOP/s come from training/monitor.py's tables,
# the ones MFU is logged with): TPU v4 32 GiB, v5e 16 GB, v5p 95 GB, v6e 32 GB
# (https://cloud.google.com/tpu/docs/v4, .../v5e, .../v5p, .../v6e); H100 SXM 80 GB, H200 141 GB,
# A100 40/80 GB (NVIDIA data sheets). TPU HBM is built in binary sizes (Google's v4 page says GiB,
# the newer pages GB for the same parts); GPU capacities are taken as decimal GB, below what
# torch.cuda reports (80 GB H100: 79.1 GiB). The runtime's own reservation is left to the margin.
_TPU_NAME = {short: kind for kind, (short, _) in TPU_DEVICE_KINDS.items()}  # "v4" -> "TPU v4"
DEVICES = {
    "v6e": Device("v6e", _TPU_NAME["v6e"], 32 * GiB, "xla"),
    "v5p": Device("v5p", _TPU_NAME["v5p"], 95 * GiB, "xla"),
    "v5e": Device("v5e", _TPU_NAME["v5e"], 16 * GiB, "xla"),
    "v4": Device("v4", _TPU_NAME["v4"], 32 * GiB, "xla"),
    "h100": Device("h100", "H100", 80 * 10 ** 9, "eager"),
    "h200": Device("h200", "H200", 141 * 10 ** 9, "eager"),
    "a100": Device("a100", "A100 80GB", 80 * 10 ** 9, "eager"),
    "a100-40": Device("a100-40", "A100 40GB", 40 * 10 ** 9, "eager"),
    "cpu": Device("cpu", "cpu", 0, "eager"),  # memory: this machine's RAM (filled in by device_for)
}
TPU_KINDS = ("v6e", "v5p", "v5e", "v4")
# Accelerator types as TPU VMs report them (v5litepod-8 is a v5e slice).
_TPU_TYPE = {"v6e": "v6e", "v5litepod": "v5e", "v5e": "v5e", "v5p": "v5p", "v4": "v4"}
# torch_xla's ParallelLoader keeps up to this many batches on the device (device_prefetch_size),
# plus the one in use: xla_backend._DeviceBatches uses its defaults.
XLA_DEVICE_PREFETCH = 8


def device_for(kind: Optional[str], entry: str) -> Device:
    """The target device: ``kind`` (``--device-kind``), else the accelerator on this machine."""
    if kind is None:
        kind = _present_device_kind(entry)
    if kind not in DEVICES:
        raise ConfigError(f"--device-kind {kind!r}: expected one of {', '.join(DEVICES)}")
    dev = DEVICES[kind]
    if entry == "xla" and dev.compiler != "xla" and kind != "cpu":
        raise ConfigError(f"--device-kind {kind}: train_xla.py plans for TPUs ({', '.join(TPU_KINDS)}) "
                          f"or cpu; plan GPU runs with train.py --plan")
    if entry == "torch" and dev.compiler == "xla":
        raise ConfigError(f"--device-kind {kind}: train.py runs on GPUs and the CPU; plan TPU runs "
                          "with train_xla.py --plan")
    if kind == "cpu":
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        dev = dataclasses.replace(dev, memory=ram, compiler="xla" if entry == "xla" else "eager")
    elif dev.compiler == "eager" and _cuda_kind() == kind:  # planning for the GPU installed here
        # its memory, and its name, by which MFU is logged: an H100 PCIe's or NVL's peak is not the SXM's
        dev = dataclasses.replace(dev, memory=torch.cuda.get_device_properties(0).total_memory,
                                  name=torch.cuda.get_device_name(0))
    return dev


def _cuda_kind() -> Optional[str]:
    """The kind of this machine's CUDA GPU; None without one or for a GPU the planner does not know."""
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(0)
    if "GH200" in name.upper():  # Grace Hopper: not an H200 (another memory size, and its own peak)
        return None
    for kind in ("h200", "h100", "a100"):
        if kind.upper() in name.upper():
            if kind == "a100" and torch.cuda.get_device_properties(0).total_memory < 60 * 10 ** 9:
                return "a100-40"
            return kind
    return None


def _present_device_kind(entry: str) -> str:
    """The kind of accelerator on this machine (a CUDA GPU, or the TPU VM's accelerator type), else cpu."""
    if entry == "torch" and torch.cuda.is_available():
        kind = _cuda_kind()
        if kind is None:
            raise ConfigError(f"the GPU here ({torch.cuda.get_device_name(0)}) is not one the planner "
                              "knows: pass --device-kind")
        return kind
    if entry == "xla":
        accel = tpu_accelerator_type()
        if accel:
            kind = tpu_generation(accel)
            if kind:
                return kind
            raise ConfigError(f"TPU accelerator type {accel!r} is not one the planner knows: pass --device-kind")
    return "cpu"  # as training.device auto falls back to it


def tpu_generation(accelerator_type: str) -> Optional[str]:
    """'v5litepod-16' -> 'v5e', 'v4-8' -> 'v4'; None for a type the planner does not know."""
    return _TPU_TYPE.get(accelerator_type.split("-")[0])


def tpu_chips(accelerator_type: str) -> Optional[int]:
    """Chips in a slice from its accelerator type: the number counts TensorCores on v4 and v5p
    (two per chip, one megacore device) and chips on v5e and v6e (one core each)."""
    kind = tpu_generation(accelerator_type)
    count = accelerator_type.rsplit("-", 1)[-1]
    if kind is None or not count.isdigit():
        return None
    return int(count) // 2 if kind in ("v4", "v5p") else int(count)


def tpu_accelerator_type() -> Optional[str]:
    """'v6e-8', 'v4-8', ...: TPU_ACCELERATOR_TYPE, else the TPU VM's metadata (as torch_xla's
    ``_internal/tpu.py`` reads it), only where a TPU device file exists."""
    if os.environ.get("TPU_ACCELERATOR_TYPE"):
        return os.environ["TPU_ACCELERATOR_TYPE"]
    if not (glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*")):
        return None
    import urllib.request
    req = urllib.request.Request(
        "http://metadata.google.internal/computeMetadata/v1/instance/attributes/tpu-env",
        headers={"Metadata-Flavor": "Google"})
    try:
        with urllib.request.urlopen(req, timeout=3) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    m = re.search(r"^ACCELERATOR_TYPE:\s*'?([\w-]+)'?", text, re.MULTILINE)
    return m.group(1) if m else None


# ----------------------------------------------------------------------------------------------
# How a config spreads over the chips.

# The spec of what no layout shards (buffers, the optimizer's step counters): replicated under
# SPMD like a ``None`` spec, and left whole by FSDP2, which shards every parameter.
NEVER_SHARDED = ()


@dataclass(frozen=True)
class Layout:
    entry: str                 # "xla" (train_xla.py) or "torch" (train.py)
    mode: str                  # "spmd" (one process, a mesh), "ddp" (a replica per chip) or
                               # "fsdp2" (train.py's training.fsdp: every tensor sharded on dim 0)
    mesh: dict                 # {"data", "fsdp", "tp"}: all 1 outside SPMD
    chips: int
    replicas: int              # what Config.tokens_per_step/resolve_steps call replicas
    micro_batch: int           # sequences per chip per micro-step
    zero: bool                 # gradients and optimiser state sharded over data x fsdp too

    def param_factor(self, spec) -> int:
        if self.mode == "fsdp2":  # fully_shard splits every parameter's dim 0 over the processes
            return 1 if spec == NEVER_SHARDED else self.chips
        return shard_factor(spec, self.mesh)

    def state_factor(self, spec) -> int:
        if self.mode == "fsdp2":  # gradients and optimizer state follow their parameter's shard
            return 1 if spec == NEVER_SHARDED else self.chips
        return shard_factor(state_partition_spec(spec, self.zero), self.mesh)

    @property
    def gradient_buckets(self) -> bool:
        """train.py's DDP, with more than one process (backend.py): every gradient in a bucket
        alive from the start of the run, evaluation included."""
        return self.entry == "torch" and self.mode == "ddp" and self.chips > 1

    def describe(self) -> str:
        if self.mode == "spmd":
            m = self.mesh
            return (f"train_xla.py, SPMD mesh data {m['data']} x fsdp {m['fsdp']} x tp {m['tp']} = "
                    f"{self.chips} chips")
        if self.mode == "fsdp2":
            return f"train.py, FSDP2 over {self.chips} process(es), one per chip"
        prog = "train_xla.py (ddp)" if self.entry == "xla" else "train.py"
        return f"{prog}, {self.chips} replica(s), one per chip"


def layout_for(cfg: Config, entry: str, world_size: Optional[int], device_kind: Optional[str] = None) -> Layout:
    """How ``cfg`` spreads over the chips. ``device_kind``: the TPU planned for (the slice here
    counts the replicas of a ddp run only when it is of that generation)."""
    t = cfg.training
    if entry == "xla" and cfg.xla.mode == "spmd":
        m = cfg.xla.mesh
        mesh = {"data": m.data, "fsdp": m.fsdp, "tp": m.tp}
        chips = m.data * m.fsdp * m.tp
        if world_size is not None and world_size != chips:
            raise ConfigError(f"--world-size {world_size}: the SPMD mesh data x fsdp x tp = {m.data} x "
                              f"{m.fsdp} x {m.tp} has {chips} chips")
        shards = m.data * m.fsdp
        return Layout(entry, "spmd", mesh, chips, 1, -(-t.batch_size // shards),
                      zero=cfg.xla.shard_optimizer_over_data and m.data > 1)
    if world_size is None:
        if entry == "xla":
            # xmp.spawn with xla.nprocs null: one process per chip of the slice, on every host
            accel = None if cfg.xla.nprocs else tpu_accelerator_type()
            if accel and device_kind is not None and tpu_generation(accel) != device_kind:
                accel = None  # planning for another generation than this slice's
            world_size = cfg.xla.nprocs or (accel and tpu_chips(accel)) or 1
        else:
            world_size = int(os.environ.get("WORLD_SIZE", 1))
    if entry == "torch" and t.fsdp and world_size > 1:  # with one process train.py does not shard
        return Layout(entry, "fsdp2", {"data": 1, "fsdp": world_size, "tp": 1}, world_size, world_size,
                      t.batch_size, zero=True)
    return Layout(entry, "ddp", {"data": world_size, "fsdp": 1, "tp": 1}, world_size, world_size,
                  t.batch_size, zero=False)


# ----------------------------------------------------------------------------------------------
# The trace: when every storage is created and freed, by kind.

# Kinds of tensor memory. Owned kinds belong to a parameter and shard like it; the others are
# per-chip already (the trace runs at the per-chip batch).
WEIGHTS, COPIES, GRADS, OPT, OPT_TEMP = "weights", "weight copies", "gradients", "optimizer state", \
    "optimizer temporaries"
ACT, TEMP, INPUTS = "activations", "backward temporaries", "inputs"
OWNED = (WEIGHTS, COPIES, GRADS, OPT, OPT_TEMP)
PHASES = ("forward", "backward", "optimizer", "evaluation")


class _Recorder(TorchDispatchMode):
    """Records, for every tensor storage an op creates, its bytes, its kind and (for a tensor made
    from parameter-owned tensors only, such as autocast's bf16 copy of a weight or an optimiser
    temporary) the owning parameter's partition spec, and when it is freed.

    Rows: row 0 is the state before the step, row i the state after the i-th op that created a
    storage (views and in-place ops create none) or where a phase began. A storage freed before
    that op ends (or before the phase begins) counts until the row before it. An op that mixes a
    parameter-owned tensor with activations (a matmul with a weight) is noted too, so that an SPMD
    layout can add that weight's all-gather for the op.
    ``mark(name)`` remembers where the rows stand (block boundaries).
    """

    def __init__(self):
        super().__init__()
        self.op = 0
        self.phase = 0
        self.classes: dict[tuple, int] = {}     # (kind, spec) -> column
        self.kinds: list[tuple] = []           # column -> (kind, spec)
        self.deltas: list[tuple[int, int, int]] = []     # (row, column, +/- bytes)
        self.gathers: list[tuple[int, int, int]] = []    # (row, column, bytes)
        self.ops: list[str] = [""]
        self.phases: list[int] = [0]
        self.where: list[str] = [""]
        # [first row, first row freed, bytes, column, shape, dtype, op, [(row, earlier column)]]
        self.records: list[list] = []
        self.marks: dict[str, int] = {}
        self._info = WeakIdKeyDictionary()     # storage -> (record index, weakref)
        self._where = ""
        self.closed = False
        self.compiling = False

    def column(self, kind: str, spec) -> int:
        key = (kind, spec if kind in OWNED else None)
        if key not in self.classes:
            self.classes[key] = len(self.classes)
            self.kinds.append(key)
        return self.classes[key]

    def track(self, t: torch.Tensor, kind: str, spec=None, op_name: str = "") -> tuple[int, int]:
        """Count ``t``'s storage from this row on (once: a view of a counted storage adds nothing);
        returns (column, bytes added)."""
        st = t.untyped_storage()
        if st in self._info:
            return 0, 0
        nbytes = st.nbytes()
        col = self.column(kind, spec)
        idx = len(self.records)
        self.records.append([self.op, math.inf, nbytes, col, tuple(t.shape), t.dtype, op_name, []])
        self.deltas.append((self.op, col, nbytes))
        self._info[st] = (idx, weakref.ref(st, self._freed(idx)))
        return col, nbytes

    def retag(self, t: torch.Tensor, kind: str, spec) -> None:
        """From now on count ``t``'s storage as ``kind`` (a gradient once autograd stored it)."""
        st = t.untyped_storage()
        if st not in self._info:
            self.track(t, kind, spec)
            return
        rec = self.records[self._info[st][0]]
        col = self.column(kind, spec)
        if col != rec[3]:
            self.deltas.append((self.op, rec[3], -rec[2]))
            self.deltas.append((self.op, col, rec[2]))
            rec[7].append((self.op, rec[3]))  # until this row it was counted in the old column
            rec[3] = col

    def _freed(self, idx: int):
        def callback(_ref):
            if self.closed:  # the fake model and optimiser going away after the trace
                return
            rec = self.records[idx]
            rec[1] = self.op + 1
            self.deltas.append((self.op + 1, rec[3], -rec[2]))
        return callback

    def set_where(self, where: str) -> None:
        self._where = where

    def enter(self, phase: str) -> None:
        """A phase begins: a row of its own, the state that the phase's first op finds (what was
        freed before it, such as the forward's outputs before the optimizer step, is gone)."""
        self.phase = PHASES.index(phase)
        if phase == "optimizer":
            self._where = "optimizer"
        self._row("")

    def _row(self, op_name: str) -> None:
        self.op += 1
        self.ops.append(op_name)
        self.phases.append(self.phase)
        node = torch._C._current_autograd_node()
        self.where.append(self._where if node is None or self._where
                          else getattr(node, "plan_region", None) or node.name())

    def mark(self, name: str) -> None:
        self.marks.setdefault(name, self.op)

    @contextlib.contextmanager
    def paused(self):
        """Off the dispatch stack (while AOTAutograd traces a compiled region: its tracing is not
        part of the step), with ``compiling`` set for the module hooks to stand aside."""
        from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode_temporarily
        assert _get_current_dispatch_mode() is self
        self.compiling = True
        try:
            with _pop_mode_temporarily():
                yield
        finally:
            self.compiling = False

    def _counted(self, t: torch.Tensor):
        got = self._info.get(t.untyped_storage())
        return None if got is None else self.kinds[self.records[got[0]][3]]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is _PRIM_DEVICE:
            return out
        outputs = [o for o in (out if isinstance(out, (tuple, list)) else (out,))
                   if isinstance(o, torch.Tensor) and o.untyped_storage() not in self._info]
        if not outputs:
            return out  # views, in-place ops, queries: nothing new to count
        self._row(str(func))
        owned, plain = [], False
        for a in _tensors(args, kwargs):
            if a.numel() <= 1:
                continue  # scalars (a learning rate, a skip flag) decide nothing
            got = self._counted(a)
            if got is not None and got[0] in OWNED:
                owned.append((a, got[1]))
            else:
                plain = True
        if owned and not plain:
            kind = OPT_TEMP if PHASES[self.phase] == "optimizer" else COPIES
            spec = max(owned, key=lambda a: a[0].numel())[1]
        else:
            kind, spec = (TEMP if PHASES[self.phase] == "backward" else ACT), None
            for a, aspec in owned:  # a weight meets activations: SPMD all-gathers it for this op
                self.gathers.append((self.op, self.column(COPIES, aspec), a.untyped_storage().nbytes()))
        for o in outputs:
            self.track(o, kind, spec, str(func))
        return out


_PRIM_DEVICE = torch.ops.prim.device.default


def _tensors(args, kwargs):
    for a in (*args, *(kwargs or {}).values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (tuple, list)):
            yield from (t for t in a if isinstance(t, torch.Tensor))


@dataclass
class Trace:
    """One traced step: live bytes per column at every row (before a layout is applied)."""
    columns: list[tuple]          # (kind, spec) per column
    live: np.ndarray              # [rows, columns] bytes alive
    gathered: np.ndarray          # [rows, columns] bytes all-gathered by that row's op
    phases: np.ndarray            # [rows]
    ops: list[str]
    where: list[str]
    records: list[list]
    marks: dict[str, int]
    source: Optional[np.ndarray] = None   # row of the traced step each row repeats (deepened traces)
    # FSDP2 (train.py's training.fsdp): the bytes of parameters it holds whole while a step runs,
    # whatever the op: the root's (embedding, head: not resharded) and two blocks' (the one running,
    # the next prefetched). Counted at every row, so at the optimizer step it is an upper bound.
    unsharded: float = 0.0

    @classmethod
    def from_recorder(cls, r: _Recorder) -> "Trace":
        r.closed = True
        n, k = r.op + 2, len(r.classes)
        live = np.zeros((n, k))
        if r.deltas:
            row, col, d = (np.array(x) for x in zip(*r.deltas))
            np.add.at(live, (row, col), d)
        live = np.cumsum(live, axis=0)
        gathered = np.zeros((n, k))
        if r.gathers:
            row, col, d = (np.array(x) for x in zip(*r.gathers))
            np.add.at(gathered, (row, col), d)
        phases = np.array(r.phases + [r.phase])
        return cls(list(r.kinds), live, gathered, phases, r.ops + [""], r.where + [""], r.records,
                   dict(r.marks))

    def deepen(self, n_layers: int, per_layer: np.ndarray) -> "Trace":
        """This trace of a 3-block model as the trace of one with ``n_layers`` blocks.

        The rows are cut into segments at the block boundaries the trace marked (each block's
        forward, and its backward, which runs in reverse); the middle block's segments are repeated
        for every middle block. Every storage the middle block creates is created again in each
        copy and freed where its original is freed relative to its block (in the same block's
        backward, the next block's forward, ...) or, if that is outside the blocks (the end of
        autocast, ``zero_grad``), at that same point; the weights and optimiser state of the added
        blocks (``per_layer`` per column) are there throughout. Exact when the blocks run the same
        ops, as model.py's do (tested against direct traces).
        """
        m, n, L = self.marks, len(self.live), n_layers
        fw = [m["forward 0"], m["forward 1"], m["forward 2"], m["forward end"]]
        src = [("pre", None, 0, fw[0] + 1)] + [("f", k, fw[k] + 1, fw[k + 1] + 1) for k in range(3)]
        if "backward 0" in m:
            bw = [m["backward top"], m["backward 2"], m["backward 1"], m["backward 0"]]
            src.append(("mid", None, fw[3] + 1, bw[0] + 1))
            src += [("b", 2 - i, bw[i] + 1, bw[i + 1] + 1) for i in range(3)]
            src.append(("rest", None, bw[3] + 1, n))
        else:
            src.append(("rest", None, fw[3] + 1, n))
        new_blocks = {0: [0], 1: list(range(1, L - 1)), 2: [L - 1]}
        start, source = {}, []                      # (kind, new block) -> first row; rows' origin
        for kind, k, lo, hi in src:
            blocks = [None] if k is None else new_blocks[k] if kind == "f" else new_blocks[k][::-1]
            for blk in blocks:
                start[(kind, blk)] = (len(source), hi - lo)
                source.extend(range(lo, hi))
        source = np.array(source)
        bounds = [lo for _, _, lo, _ in src]

        def segment(row):  # called for every storage of every copied block: bisect, not a numpy call
            return src[bisect.bisect_right(bounds, row) - 1]

        def place(row, origin):
            """The new row of source ``row``, for a storage made in block ``origin`` (old, new)."""
            kind, k, lo, _ = segment(row)
            if k is None:
                blk = None
            elif isinstance(origin, str):  # made outside the blocks: the middle block nearest to it
                blk = {0: 0, 1: 1 if origin == "pre" else L - 2, 2: L - 1}[k]
            else:  # made in a block: the block as far from it as in the trace
                blk = min(max(origin[1] + k - origin[0], 0), L - 1)
            first, length = start[(kind, blk)]
            return first + min(row - lo, length - 1)

        # A middle-block storage freed past the trace's last block (a block's output that lives
        # until the next block is done) is freed as far from its block as the same storage of the
        # block with two after it (block 0 forward, block 2 backward), unless that one, too, is freed
        # outside the blocks (autocast's weight copies at the end of the forward).
        made: dict[tuple, list[int]] = {}
        for i, rec in enumerate(self.records):
            kind, k, _, _ = segment(rec[0])
            made.setdefault((kind, k), []).append(i)
        twin = {}
        for mid, ref in ((("f", 1), ("f", 0)), (("b", 1), ("b", 2))):
            if len(made.get(mid, [])) == len(made.get(ref, [])):
                twin.update(zip(made.get(mid, []), made.get(ref, [])))

        def free_place(i, row, origin):
            kind, k, lo, _ = segment(row)
            if k is not None or i not in twin or isinstance(origin, str):
                return place(row, origin)
            ref_row = self.records[twin[i]][1]
            if ref_row == math.inf:
                return place(row, origin)
            rkind, rk, rlo, _ = segment(ref_row)
            ref_origin = segment(self.records[twin[i]][0])[1]
            if rk is None:
                return place(row, origin)
            target = origin[1] + rk - ref_origin
            if not 0 <= target < L:
                return place(row, origin)
            first, length = start[(rkind, target)]
            return first + min(ref_row - rlo, length - 1)

        deltas = []
        for i, (alloc, free, nbytes, col, *_, history) in enumerate(self.records):
            kind, k, _, _ = segment(alloc)
            for blk in ([None] if k is None else new_blocks[k]):
                origin = (k, blk) if k is not None else kind
                spans = [alloc, *(r for r, _ in history), free]
                cols = [c for _, c in history] + [col]
                for lo, hi, c in zip(spans, spans[1:], cols):
                    deltas.append((place(lo, origin), c, nbytes))
                    if hi != math.inf:
                        deltas.append((free_place(i, hi, origin) if hi == free else place(hi, origin), c, -nbytes))
        live = np.zeros((len(source), len(self.columns)))
        row, col, d = (np.array(x) for x in zip(*deltas))
        np.add.at(live, (row, col), d)
        live = np.cumsum(live, axis=0) + (L - TRACED_BLOCKS) * per_layer
        names = {"blocks.1": f"blocks.1-{L - 2}", f"blocks.{TRACED_BLOCKS - 1}": f"blocks.{L - 1}"}
        where = [re.sub(r"blocks\.\d+", lambda w: names.get(w.group(0), w.group(0)), self.where[i])
                 for i in source]
        return dataclasses.replace(self, live=live, gathered=self.gathered[source], phases=self.phases[source],
                                   ops=[self.ops[i] for i in source], where=where, source=source)

    def with_optimizer(self, step: "Trace") -> "Trace":
        """This deepened trace with its optimizer phase replaced by ``step``'s, the optimizer step
        alone on the full-depth model (``_trace(optimizer_only=True)``): the deepened trace updates
        the three traced blocks' parameters only, and an update's temporaries grow with depth
        (Muon orthogonalises the matrices of one shape stacked over every layer). ``step``'s
        changes to the memory are added to the state this trace reaches as its optimizer phase
        begins; that needs no activations."""
        opt = PHASES.index("optimizer")
        first, step_first = int(np.argmax(self.phases == opt)), int(np.argmax(step.phases == opt))
        columns = self.columns + [c for c in step.columns if c not in self.columns]
        into = [columns.index(c) for c in step.columns]

        def widen(rows):
            return np.pad(rows, ((0, 0), (0, len(columns) - len(self.columns))))

        live = np.repeat(widen(self.live[first:first + 1]), len(step.live) - step_first, axis=0)
        live[:, into] += step.live[step_first:] - step.live[step_first]
        gathered = widen(np.zeros((len(live), len(self.columns))))
        gathered[:, into] = step.gathered[step_first:]
        return dataclasses.replace(
            self, columns=columns, live=np.concatenate([widen(self.live[:first]), live]),
            gathered=np.concatenate([widen(self.gathered[:first]), gathered]),
            phases=np.concatenate([self.phases[:first], step.phases[step_first:]]),
            ops=self.ops[:first] + step.ops[step_first:], where=self.where[:first] + step.where[step_first:],
            source=np.concatenate([self.source[:first], np.full(len(live), self.source[first])]))

    def scales(self, layout: Layout) -> tuple[np.ndarray, np.ndarray]:
        """Per-column factors that turn traced bytes into one chip's bytes, and the share of a
        gathered weight that was not on the chip before its all-gather."""
        s, g = np.ones(len(self.columns)), np.zeros(len(self.columns))
        for i, (kind, spec) in enumerate(self.columns):
            if kind == COPIES and layout.mode == "fsdp2":
                continue  # made from the weights FSDP2 gathered whole (``unsharded``): whole too
            if kind in (WEIGHTS, COPIES):
                s[i] = 1.0 / layout.param_factor(spec)
                g[i] = 1.0 - s[i]
            elif kind in (GRADS, OPT, OPT_TEMP):
                s[i] = 1.0 / layout.state_factor(spec)
        return s, g

    def per_chip(self, layout: Layout) -> np.ndarray:
        s, g = self.scales(layout)
        return self.live @ s + self.gathered @ g + self.whole_params(layout)

    def whole_params(self, layout: Layout) -> float:
        """The part of ``unsharded`` not on the chip before FSDP2 gathers it (0 off FSDP2)."""
        return self.unsharded * (1.0 - 1.0 / layout.chips) if layout.mode == "fsdp2" else 0.0


# ----------------------------------------------------------------------------------------------
# Running one step on fake tensors.

def _fake_model(mcfg: ModelConfig):
    from torch._subclasses.fake_tensor import FakeTensorMode
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    with mode:
        torch.manual_seed(0)
        model = NashMHC(mcfg)
    return mode, model


def _optimizer(model, cfg: Config, layout: Layout):
    # what XLABackend.adamw_factory returns, or TorchBackend's on CUDA and CPU (the fused kernel,
    # also for Muon's AdamW groups)
    factory = AdamW if layout.entry == "xla" else fused_adamw
    return build_optimizer(model, cfg.training, factory)


def compiles(cfg: Config, layout: Layout, device: Device) -> bool:
    """Whether the traced step is the compiled one: train.py with ``training.compile`` on a GPU
    (``compile_regions``); train.py on the CPU runs eagerly whatever the config says, and
    train_xla.py is XLA's to compile."""
    return (cfg.training.compile and layout.entry == "torch" and device.compiler == "eager"
            and device.kind != "cpu")


def _compile_regions(model, rec: "_Recorder", fake_mode) -> None:
    """``training.backend.compile_regions`` for the trace: every block's forward and the loss
    replaced by what ``torch.compile`` (inductor) makes of them before its code generation.

    Each region is traced by AOTAutograd into its joint forward-backward graph with inductor's
    decompositions, and that graph is cut by inductor's own partitioner
    (``torch._inductor.compile_fx.partition_fn``: its joint-graph passes, then
    ``min_cut_rematerialization_partition``, which saves for the backward what is cheapest to keep
    and recomputes the rest there) into a forward and a backward graph; the two graphs then run
    op by op (``boxed_nop``, as the ``aot_eager_decomp_partition`` backend runs them, each value
    freed after its last use) on the fake tensors, under the recorder. So the trace sees what the
    compiled forward keeps for the backward and what the backward graph allocates, but not
    inductor's fusion of the element-wise ops inside a graph (a fused kernel never materialises
    their intermediates): within a region the temporaries are the unfused graph's, an upper bound.

    The blocks' graph is Dynamo's, as torch.compile captures it: ``torch._dynamo.export`` on the
    first block, which takes the planner's fake tensors as they are (``torch.compile`` does not: its
    backend's fake mode is not theirs, "fake mode ... from tracing context 0 doesn't match mode ...
    from fake tensor input 0", and it does not compile at all under a dispatch mode such as the
    recorder). Dynamo matters: the custom autograd Functions of the hyper-connections become part of
    the joint graph, which the partitioner may cut through (tracing the block with AOTAutograd alone
    kept 18% more for the 4-stream block than inductor does on the CPU). As in train.py, every block
    runs that one graph, its parameters the inputs. The loss, a plain function, is traced by
    AOTAutograd directly. The first call of a region captures and compiles it (off the recorder),
    then it runs."""
    import logging
    # importing inductor warns, on a machine without CUDA, that it found no CUDA runtime: not the plan's
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    from torch._dynamo.backends.debugging import boxed_nop
    from torch._functorch import config as functorch_config
    from torch._functorch.aot_autograd import aot_function
    from torch._inductor.compile_fx import partition_fn, select_decomp_table
    from torch._inductor.virtualized import V
    from torch.nn.utils.stateless import _reparametrize_module

    from .backend import REGION_CONFIG

    def region(fn):
        compiled = aot_function(fn, fw_compiler=boxed_nop, bw_compiler=boxed_nop, partition_fn=partition_fn,
                                decompositions=select_decomp_table(), keep_inference_input_mutations=True)
        ready = []

        def call(label, *args):
            with V.set_fake_mode(fake_mode), functorch_config.patch(unlift_effect_tokens=True, **REGION_CONFIG):
                if not ready:
                    with rec.paused():
                        compiled(*args)
                    ready.append(True)
                out = compiled(*args)
            if isinstance(out, list):  # AOTAutograd's runtime returns a tuple as a list; Dynamo would not
                out = tuple(out)
            for t in tree_flatten(out)[0]:  # the backward's rows are named after the region
                if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                    t.grad_fn.plan_region = f"{label} (compiled backward)"
            return out
        return call

    blocks = list(model.blocks)
    if blocks:
        first = blocks[0]
        own = {id(t): n for n, t in itertools.chain(first.named_parameters(), first.named_buffers())}
        graph = []  # Dynamo's graph of the first block: [module, its tensors' names in ``first``]

        def block_fn(state, *args):
            gm, names, _ = graph
            with _reparametrize_module(gm, dict(zip(names, state))):
                return gm(*args)

        run_block = region(block_fn)
        for k, block in enumerate(blocks):
            def forward(*args, block=block, label=f"blocks.{k}"):
                if not graph:
                    with rec.paused():
                        gm = torch._dynamo.export(types.MethodType(type(first).forward, first),
                                                  assume_static_by_default=True)(*args).graph_module
                    names = [n for n, t in itertools.chain(gm.named_parameters(), gm.named_buffers())]
                    graph[:] = [gm, names]
                    graph.append([own[id(t)] for n, t in itertools.chain(gm.named_parameters(), gm.named_buffers())])
                tensors = dict(itertools.chain(block.named_parameters(), block.named_buffers()))
                return run_block(label, tuple(tensors[n] for n in graph[2]), *args)
            block.forward = forward
    run_loss = region(model.loss_fn)
    model.loss_fn = functools.partial(run_loss, "loss")


TRACED_BLOCKS = 3  # a first, a middle and a last block: deeper models repeat the middle one


def trace_step(cfg: Config, layout: Layout, device: Device, micro_batch: Optional[int] = None,
               evaluation: bool = False, deepen: bool = True) -> Trace:
    """Trace one optimiser step (its last micro-step, with gradients already accumulating when
    ``gradient_accumulation_steps > 1``), or with ``evaluation`` one validation forward, at
    ``micro_batch`` sequences per chip (default: the layout's).

    A model deeper than three blocks is traced with three and deepened (``Trace.deepen``), its
    optimizer step traced alone at full depth (``Trace.with_optimizer``): the same numbers at a
    fraction of the time; ``deepen=False`` traces every block.
    """
    key = repr((cfg.model, cfg.data.seq_len, cfg.training, cfg.xla.scan_layers, layout.entry, device.compiler,
                compiles(cfg, layout, device), layout.gradient_buckets, micro_batch or layout.micro_batch,
                evaluation, deepen))
    if key not in _TRACES:
        if len(_TRACES) >= 16:
            _TRACES.pop(next(iter(_TRACES)))
        _TRACES[key] = _trace_step(cfg, layout, device, micro_batch, evaluation, deepen)
    return _TRACES[key]


_TRACES: dict[str, Trace] = {}  # the same step on other meshes or chips: one trace, other scales


def _trace_step(cfg, layout, device, micro_batch, evaluation, deepen) -> Trace:
    n_layers = cfg.model.n_layers
    trace = None
    if deepen and n_layers > TRACED_BLOCKS:
        small = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, n_layers=TRACED_BLOCKS))
        trace, per_layer = _trace(small, layout, device, micro_batch, evaluation, n_layers)
        needed = {f"forward {k}" for k in ("0", "1", "2", "end")}
        if not evaluation:
            needed |= {f"backward {k}" for k in ("0", "1", "2", "top")}
        trace = trace.deepen(n_layers, per_layer) if needed <= trace.marks.keys() else None
        if trace is not None and not evaluation:
            trace = trace.with_optimizer(_optimizer_trace(cfg, layout, device))
    if trace is None:
        trace = _trace(cfg, layout, device, micro_batch, evaluation)[0]
    return dataclasses.replace(trace, unsharded=_fsdp2_unsharded_bytes(cfg.model))


# What an optimiser step alone reads of the training section (build_optimizer, optimizer_step):
# its trace is the same for every batch, sequence length, accumulation, precision and schedule.
OPTIMIZER_FIELDS = ("optimizer", "learning_rate", "weight_decay", "betas", "eps", "grad_clip", "muon_lr",
                    "muon_momentum")


def _optimizer_trace(cfg: Config, layout: Layout, device: Device) -> Trace:
    """``_trace(optimizer_only=True)`` at full depth, shared by every plan of a model with the same
    parameters and optimiser (``find_levers`` tries other batches, meshes, checkpointing, loss
    chunks and stream dtypes): ``Trace.with_optimizer`` takes its changes to the memory from the
    optimizer phase on, which no input, activation or mesh enters (the scales are applied later).
    The most expensive trace of a deep model's plan."""
    with torch.device("meta"):
        params = [(n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in NashMHC(cfg.model).named_parameters()]
    key = repr((params, [getattr(cfg.training, f) for f in OPTIMIZER_FIELDS], layout.entry, layout.gradient_buckets))
    if key not in _OPTIMIZER_TRACES:
        if len(_OPTIMIZER_TRACES) >= 4:
            _OPTIMIZER_TRACES.pop(next(iter(_OPTIMIZER_TRACES)))
        _OPTIMIZER_TRACES[key] = _trace(cfg, layout, device, 1, False, optimizer_only=True)[0]
    return _OPTIMIZER_TRACES[key]


_OPTIMIZER_TRACES: dict[str, Trace] = {}


def _fsdp2_unsharded_bytes(mcfg: ModelConfig) -> float:
    """``Trace.unsharded``: the root's parameters and the two largest blocks', fp32."""
    with torch.device("meta"):
        model = NashMHC(mcfg)
    nbytes = lambda params: sum(p.numel() * 4 for p in params)  # noqa: E731
    blocks = sorted((nbytes(b.parameters()) for b in model.blocks), reverse=True)
    return float(nbytes(model.parameters()) - sum(blocks) + sum(blocks[:2]))


def _trace(cfg: Config, layout: Layout, device: Device, micro_batch: Optional[int],
           evaluation: bool, n_layers: Optional[int] = None,
           optimizer_only: bool = False) -> tuple[Trace, np.ndarray]:
    """The trace, and the bytes per column that block 1's weights, optimiser state and
    (accumulating) gradients hold. ``n_layers``: the depth of the model this trace stands for
    (it may trace fewer blocks and be deepened). ``optimizer_only``: the optimizer step alone,
    from every gradient present (``Trace.with_optimizer``).

    With ``xla.scan_layers`` (train_xla.py) the blocks run as one loop over their parameters
    stacked into ``[n_layers, ...]`` tensors (xla_backend.ScanBlocks): that stacked copy exists
    from the first block's forward to the end of the backward, and the loop's backward produces
    the stacked gradient, which exists from the top of the backward until the per-parameter
    gradients are taken from it. Both are counted as such (sharded like their parameter), the
    blocks themselves as the unrolled loop runs them (the same ops, checkpointed alike)."""
    b = micro_batch or layout.micro_batch
    T = cfg.data.seq_len
    accum = cfg.training.gradient_accumulation_steps
    mode, model = _fake_model(cfg.model)
    names = {m: n for n, m in model.named_modules()}
    blocks = {m: k for k, m in enumerate(getattr(model, "blocks", []))}
    specs = {id(p): param_partition_spec(n, p) for n, p in model.named_parameters()}
    in_block1 = {id(t) for n, t in itertools.chain(model.named_parameters(), model.named_buffers())
                 if n.startswith("blocks.1.")}
    params = [p for p in model.parameters() if p.requires_grad]
    amp = torch.bfloat16 if cfg.training.precision == "bf16" else None
    rec = _Recorder()
    per_layer: dict[int, int] = {}
    if compiles(cfg, layout, device) and not optimizer_only:
        _compile_regions(model, rec, mode)

    def count(t, kind, spec, p=None):
        col, nbytes = rec.track(t, kind, spec)
        if p is not None and id(p) in in_block1:
            per_layer[col] = per_layer.get(col, 0) + nbytes

    with mode:
        x = torch.zeros(b, T, dtype=torch.long)
        y = torch.zeros(b, T, dtype=torch.long)
        optimizer = _optimizer(model, cfg, layout)
        for p in params:  # a first step creates the optimiser state, as in training
            p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        for p in model.parameters():
            count(p, WEIGHTS, specs[id(p)], p)
        for buf in model.buffers():
            count(buf, WEIGHTS, NEVER_SHARDED, buf)
        for p, state in optimizer.state.items():
            for v in state.values():
                if torch.is_tensor(v):  # sharded like the parameter when shaped like it (XLABackend)
                    count(v, OPT, specs.get(id(p)) if v.shape == p.shape else NEVER_SHARDED, p)
        waiting = [torch.zeros(b, T, dtype=torch.long)
                   for _ in range(2 * XLA_DEVICE_PREFETCH if layout.entry == "xla" else 0)]
        for t in waiting + [x, y]:  # the batch in use, and those prefetched to the device
            count(t, INPUTS, None)
        # train.py's DDP: the reducer allocates a bucket per gradient when it is built and holds it
        # all run; backward copies each gradient into its bucket and makes p.grad a view of it
        buckets = {}
        for p in params if layout.gradient_buckets else ():
            buckets[id(p)] = torch.zeros_like(p)
            count(buckets[id(p)], GRADS, specs[id(p)], p)
        # train_xla.py with accumulation holds every gradient all run (XLABackend.keep_gradients:
        # zeroed after each update, never freed), so its evaluation runs beside them too
        held = layout.entry == "xla" and accum > 1
        if evaluation:
            model.eval()
        if (evaluation and held) or (not evaluation and (accum > 1 or optimizer_only)):
            # a middle or last micro-step, or the update alone: every gradient exists already
            for p in params:
                p.grad = buckets[id(p)] if buckets else torch.zeros_like(p)
                count(p.grad, GRADS, specs[id(p)], p)

        def accumulated(p):
            bucket = buckets.get(id(p))
            if bucket is not None and p.grad is not bucket:
                bucket.copy_(p.grad)
                p.grad = bucket
            rec.retag(p.grad, GRADS, specs[id(p)])

        hooks = [p.register_post_accumulate_grad_hook(accumulated) for p in params]
        stack: list[str] = []
        scan = layout.entry == "xla" and cfg.xla.scan_layers
        depth = n_layers or cfg.model.n_layers
        stacked: list[torch.Tensor] = []    # ScanBlocks' stacked weights, then their gradient

        def stack_block_params():
            stacked.extend(p.new_empty((depth, *p.shape)) for p in model.blocks[0].parameters())

        def enter(phase):
            if phase == "optimizer":
                stacked.clear()
            rec.enter(phase)

        def top_of_backward(grad):
            rec.mark("backward top")
            if scan:
                stack_block_params()  # the loop's stacked gradient

        def pre(module, args):
            if rec.compiling:  # AOTAutograd tracing a compiled region: not the step
                return
            stack.append(names.get(module, type(module).__name__))
            rec.set_where(stack[-1])
            k = blocks.get(module)
            if k is not None and PHASES[rec.phase] != "backward":   # not a recomputation
                if k == 0 and scan and not stacked:
                    stack_block_params()
                rec.mark(f"forward {k}")
                if args and isinstance(args[0], torch.Tensor) and args[0].requires_grad:
                    args[0].register_hook(lambda grad, k=k: rec.mark(f"backward {k}"))

        def post(module, args, out):
            if rec.compiling:
                return
            stack.pop()
            rec.set_where(stack[-1] if stack else "")
            if blocks.get(module) == len(blocks) - 1 and PHASES[rec.phase] != "backward":
                rec.mark("forward end")
                h = out[0] if isinstance(out, tuple) else out
                if isinstance(h, torch.Tensor) and h.requires_grad:
                    h.register_hook(top_of_backward)

        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
        handles = [register_module_forward_pre_hook(pre), register_module_forward_hook(post)]
        try:
            with rec, _attention_backend(device):
                if evaluation:
                    rec.enter("evaluation")
                    with torch.no_grad(), _autocast(amp):
                        loss = model(x, y).loss.float()
                    del loss
                elif optimizer_only:
                    loss = torch.zeros(())  # the step's loss, alive until the step ends
                    enter("optimizer")
                    optimizer_step(optimizer, params, loss, cfg.training.grad_clip)
                    del loss
                else:
                    training_step(model, optimizer, params, x, y, accum, amp, cfg.training.grad_clip,
                                  enter)
        finally:
            for h in hooks + handles:
                h.remove()
        trace = Trace.from_recorder(rec)
    vec = np.zeros(len(trace.columns))
    for col, nbytes in per_layer.items():
        vec[col] = nbytes
    return trace, vec


def _attention_backend(device: Device):
    """XLA has no fused attention kernel for ``scaled_dot_product_attention``: it runs the math
    (scores and probabilities materialised, as ATen's math path does); eager GPU/CPU runs use a
    fused kernel, which the CPU's choice on fake tensors stands in for."""
    import contextlib
    if device.compiler != "xla":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel(SDPBackend.MATH)


def _autocast(dtype):
    import contextlib
    return torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext()


def training_step(model, optimizer, params, x, y, accum: int, amp, grad_clip: float,
                  enter=lambda phase: None) -> None:
    """The tensors of ``training.loop.train``'s step, in its order and with its lifetimes: one
    micro-step (forward under autocast, the logits dropped, backward), then ``optimizer_step``.
    ``enter(phase)`` is called as each phase starts."""
    enter("forward")
    with _autocast(amp):
        out = model(x, y)
    out.logits = None
    enter("backward")
    (out.loss / accum).backward()
    loss = out.loss.detach().float()
    del out
    enter("optimizer")
    optimizer_step(optimizer, params, loss, grad_clip)


def optimizer_step(optimizer, params, loss, grad_clip: float) -> None:
    """The end of ``training.loop.train``'s step: clipping, the update (skipped, without a host
    sync, where the loss or the gradient norm is not finite) and ``zero_grad``."""
    grads = [p.grad for p in params if p.grad is not None]
    grad_norm = torch.nn.utils.get_total_norm(grads)
    if grad_clip > 0:
        torch.nn.utils.clip_grads_with_norm_(params, grad_clip, grad_norm)
    del grads
    ok = torch.isfinite(loss) & torch.isfinite(grad_norm)
    optimizer.found_inf = (~ok).float()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


# ----------------------------------------------------------------------------------------------
# The plan.

PARTS = (  # report lines: (label, kinds)
    ("weights (fp32)", (WEIGHTS,)),
    ("gradients", (GRADS,)),
    ("optimizer state", (OPT,)),
    ("weight copies (autocast, scan)", (COPIES,)),
    ("saved activations", (ACT,)),
    ("backward temporaries, recompute", (TEMP,)),
    ("optimizer temporaries", (OPT_TEMP,)),
    ("all-gathered weights", ("gather",)),
    ("input batches", (INPUTS,)),
)


@dataclass
class Peak:
    total: float
    parts: dict[str, float]
    phase: str
    where: str
    largest: list[tuple[float, tuple, str, str]]    # (bytes, shape, dtype, op)


def peak_of(trace: Trace, layout: Layout) -> Peak:
    per_chip = trace.per_chip(layout)
    i = int(np.argmax(per_chip))
    s, g = trace.scales(layout)
    by_kind: dict[str, float] = {}
    for (kind, _), v in zip(trace.columns, trace.live[i] * s):
        by_kind[kind] = by_kind.get(kind, 0.0) + float(v)
    by_kind["gather"] = float(trace.gathered[i] @ g) + trace.whole_params(layout)
    parts = {label: sum(by_kind.get(k, 0.0) for k in kinds) for label, kinds in PARTS}
    src = int(trace.source[i]) if trace.source is not None else i
    largest = []
    for alloc, free, nbytes, col, shape, dtype, op, _ in trace.records:
        if alloc <= src < free and trace.columns[col][0] in (ACT, TEMP, COPIES):
            largest.append((nbytes * s[col], shape, str(dtype).replace("torch.", ""), op))
    largest.sort(key=lambda r: -r[0])
    where = trace.where[i] or trace.ops[i]
    return Peak(float(per_chip[i]), parts, PHASES[int(trace.phases[i])], where, largest[:3])


@dataclass
class Plan:
    cfg: Config
    layout: Layout
    device: Device
    margin: float
    train: Peak
    evaluation: Peak

    @property
    def usable(self) -> float:
        return self.device.memory * (1.0 - self.margin)

    @property
    def peak(self) -> float:
        return max(self.train.total, self.evaluation.total)

    @property
    def fits(self) -> bool:
        return self.peak <= self.usable


def make_plan(cfg: Config, entry: str, device: Device, world_size: Optional[int] = None,
              margin: float = 0.1, layout: Optional[Layout] = None) -> tuple[Plan, Trace]:
    if entry == "xla":
        check_xla(cfg)  # what train_xla.py refuses before it starts
    layout = layout or layout_for(cfg, entry, world_size)
    if device.kind == "cpu" and layout.chips > 1:  # the processes (or PJRT CPU devices) share one host's RAM
        device = dataclasses.replace(device, memory=device.memory // layout.chips)
    train = trace_step(cfg, layout, device)
    evaluation = trace_step(cfg, layout, device, evaluation=True)
    return Plan(cfg, layout, device, margin, peak_of(train, layout), peak_of(evaluation, layout)), train


def predict_step_peak(cfg: Config, entry: str = "torch", device_kind: str = "cpu",
                      world_size: Optional[int] = None) -> float:
    """Predicted peak bytes of one training step on one chip (the number the tests check against
    a measured CPU step)."""
    device = device_for(device_kind, entry)
    layout = layout_for(cfg, entry, world_size)
    return peak_of(trace_step(cfg, layout, device), layout).total


# ----------------------------------------------------------------------------------------------
# Levers: what would make a config fit, cheapest first.

@dataclass
class Lever:
    overrides: list[str]
    why: str
    peak: float


def _with(cfg: Config, **sections) -> Config:
    """A copy of ``cfg`` with ``section={key: value}`` replaced."""
    out = cfg
    for section, values in sections.items():
        out = dataclasses.replace(out, **{section: dataclasses.replace(getattr(out, section), **values)})
    return out


def _loss_chunk_for(mcfg: ModelConfig, micro_batch: int, seq_len: int) -> int:
    """Sequence positions per cross-entropy chunk: fp32 logits of about 256 MiB per chip (a power
    of two, at most the sequence)."""
    chunk = 2 ** int(math.log2(max(1, (256 * 2 ** 20) // (4 * mcfg.vocab_size * micro_batch))))
    return max(1, min(chunk, seq_len))


def find_levers(plan: Plan, entry: str, train_trace: Trace) -> list[Lever]:
    """Apply the levers one after another, cheapest in throughput first, until the config fits;
    each lever's peak includes the ones before it."""
    cfg, layout, device = plan.cfg, plan.layout, plan.device
    out: list[Lever] = []
    peak = plan.peak
    eval_trace = trace_step(cfg, layout, device, evaluation=True)  # make_plan's (cached)

    def fits(p):
        return p <= plan.usable

    def peak_on(new_layout):  # the same steps on another layout: the same traces, other scales
        return max(peak_of(train_trace, new_layout).total, peak_of(eval_trace, new_layout).total)

    if layout.entry == "torch" and layout.mode == "ddp" and layout.chips > 1:
        # train.py's FSDP2: other traces (no DDP buckets; each block's weights gathered in turn).
        # Offered where the state is what does not fit (it lowers the peak by 5% or more), not
        # where the activations are
        fsdp_cfg = _with(cfg, training={"fsdp": True})
        fsdp_layout = layout_for(fsdp_cfg, entry, layout.chips)
        fsdp_traces = (trace_step(fsdp_cfg, fsdp_layout, device),
                       trace_step(fsdp_cfg, fsdp_layout, device, evaluation=True))
        fsdp_peak = max(peak_of(fsdp_traces[0], fsdp_layout).total, peak_of(fsdp_traces[1], fsdp_layout).total)
        if fsdp_peak <= 0.95 * peak:
            cfg, layout, (train_trace, eval_trace), peak = fsdp_cfg, fsdp_layout, fsdp_traces, fsdp_peak
            out.append(Lever(["training.fsdp=true"], f"FSDP2: weights, gradients and optimizer state sharded "
                             f"over the {layout.chips} processes (each block's weights gathered when it runs)", peak))
    if layout.mode == "spmd" and layout.mesh["data"] > 1 and not layout.zero:
        layout = dataclasses.replace(layout, zero=True)
        cfg = _with(cfg, xla={"shard_optimizer_over_data": True})
        peak = peak_on(layout)
        out.append(Lever(["xla.shard_optimizer_over_data=true"],
                         "gradients and optimizer state sharded over data x fsdp: same traffic", peak))
    steps = []
    if cfg.model.loss_chunk == 0:
        chunk = _loss_chunk_for(cfg.model, layout.micro_batch, cfg.data.seq_len)
        steps.append(({"loss_chunk": chunk}, f"model.loss_chunk={chunk}",
                      "cross-entropy in chunks: the [tokens, vocab] logits never exist in full "
                      "(+1/3 of the LM head's FLOPs)"))
    if getattr(cfg.model, "stream_dtype", None) == "fp32" and cfg.model.mhc_streams > 1:  # one stream: no streams
        steps.append(({"stream_dtype": "bf16"}, "model.stream_dtype=bf16", "bf16 residual streams"))
    if not cfg.model.activation_checkpointing:
        steps.append(({"activation_checkpointing": True}, "model.activation_checkpointing=true",
                      "recompute each block in the backward pass (~+1/3 compute)"))
    for values, override, why in steps:
        if fits(peak):
            return out
        cfg = _with(cfg, model=values)
        train_trace, eval_trace = trace_step(cfg, layout, device), trace_step(cfg, layout, device, evaluation=True)
        peak = peak_on(layout)
        out.append(Lever([override], why, peak))
    if layout.mode == "spmd":  # move chips from data to fsdp: same per-chip batch, less state per chip
        # data halves while it stays a multiple of dcn_data (it spans that many slices)
        while not fits(peak) and layout.mesh["data"] % (2 * cfg.xla.mesh.dcn_data) == 0:
            m = dict(layout.mesh, data=layout.mesh["data"] // 2, fsdp=layout.mesh["fsdp"] * 2)
            layout = dataclasses.replace(layout, mesh=m, zero=cfg.xla.shard_optimizer_over_data and m["data"] > 1)
            cfg = _with(cfg, xla={"mesh": dataclasses.replace(cfg.xla.mesh, data=m["data"], fsdp=m["fsdp"])})
            peak = peak_on(layout)
            out.append(Lever([f"xla.mesh.data={m['data']}", f"xla.mesh.fsdp={m['fsdp']}"],
                             "more FSDP sharding on the same chips", peak))
    b = layout.micro_batch
    batch, accum = cfg.training.batch_size, cfg.training.gradient_accumulation_steps
    while not fits(peak) and b % 2 == 0:  # fewer sequences per chip, more accumulation: same tokens per step
        b, batch, accum = b // 2, batch // 2, accum * 2
        cfg = _with(cfg, training={"batch_size": batch, "gradient_accumulation_steps": accum})
        layout = dataclasses.replace(layout, micro_batch=b)
        train_trace, eval_trace = trace_step(cfg, layout, device), trace_step(cfg, layout, device, evaluation=True)
        peak = peak_on(layout)
        out.append(Lever([f"training.batch_size={batch}", f"training.gradient_accumulation_steps={accum}"],
                         f"{b} sequence(s) per chip per micro-step, same tokens per step", peak))
    return out


# ----------------------------------------------------------------------------------------------
# Time and cost.

def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.1f} min"
    if seconds < 3 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def _origin(op: str) -> str:
    if op == "aten.new_empty.default":
        return "scan_layers' stack"  # _trace stands for ScanBlocks' torch.stack with new_empty
    return op.split(".")[1] if "." in op else op


def _more_chips(layout: Layout) -> str:
    """What more chips would take for this entry point, to lower the memory per chip."""
    if layout.mode == "spmd":
        return "more chips (a larger fsdp axis)"
    if layout.mode == "fsdp2":
        return "more processes (FSDP2 shards over all of them)"
    if layout.entry == "torch":
        return "more GPUs with training.fsdp=true (FSDP2 shards over them; DDP replicates everything)"
    return "train_xla.py's SPMD mode with an fsdp axis (xla.mode=spmd; ddp replicates everything)"


def format_plan(plan: Plan, mfu: float, usd_per_chip_hour: Optional[float], config_path,
                levers: Optional[list[Lever]] = None) -> str:
    cfg, layout, device = plan.cfg, plan.layout, plan.device
    t, m = cfg.training, cfg.model
    unit, div = ("GiB", GiB) if plan.usable >= 4 * GiB else ("MiB", 2 ** 20)

    def size(nbytes: float, width: int = 0) -> str:
        return f"{nbytes / div:{width}.2f}"

    with torch.device("meta"):
        meta_model = NashMHC(m)
    settings = [f"precision {t.precision}",
                f"activation checkpointing {'on' if m.activation_checkpointing else 'off'}",
                f"loss_chunk {m.loss_chunk or 'off'}"]
    if hasattr(m, "stream_dtype"):
        settings.append(f"stream_dtype {m.stream_dtype}")
    if layout.entry == "xla" and cfg.xla.scan_layers:
        settings.append("scan_layers on")
    if layout.zero and layout.mode == "spmd":
        settings.append("gradients and optimizer state over data x fsdp")
    if layout.entry == "torch":
        settings.append("torch.compile modelled (inductor's partition, not its fusion)"
                        if compiles(cfg, layout, device) else "eager step (no torch.compile)")
    peak = device.peak_flops(t.precision)
    shared = f": the host's RAM over {layout.chips}" if device.kind == "cpu" and layout.chips > 1 else ""
    lines = [f"plan for {config_path} on {device.kind} ({device.memory / GiB:.1f} GiB per chip{shared}"
             + (f", peak {peak / 1e12:.0f} TFLOP/s at precision {t.precision})" if peak else ")"),
             f"  {layout.describe()}",
             f"  {meta_model.num_params() / 1e9:.3f}B parameters; {layout.micro_batch} sequence(s) x "
             f"{cfg.data.seq_len} tokens per chip per micro-step, {t.gradient_accumulation_steps} "
             f"micro-step(s) per step",
             f"  {'; '.join(settings)}",
             "",
             f"memory per chip ({unit})          training   evaluation"]
    for label, _ in PARTS:
        a, b = plan.train.parts[label], plan.evaluation.parts[label]
        if a or b or label in ("weights (fp32)", "gradients", "optimizer state", "saved activations"):
            lines.append(f"  {label:<33}{size(a, 9)}   {size(b, 10)}")
    lines.append(f"  {'total':<33}{size(plan.train.total, 9)}   {size(plan.evaluation.total, 10)}")
    lines.append(f"  training peak: {plan.train.phase} pass, at {plan.train.where}")
    if plan.train.largest:
        big = "; ".join(f"{size(nb)} {dt}{list(shape)} from {_origin(op)}"
                        for nb, shape, dt, op in plan.train.largest)
        lines.append(f"  largest tensors there ({unit}): {big}")
    usable = plan.usable
    lines.append(f"  usable: {size(usable)} {unit} ({device.memory / GiB:.1f} GiB less a {plan.margin:.0%} "
                 f"margin for what the trace does not model)")
    lines.append("")
    if plan.fits:
        lines.append(f"fits: {size(plan.peak)} {unit} of {size(usable)} {unit} usable per chip "
                     f"({size(usable - plan.peak)} {unit} to spare)")
    else:
        lines.append(f"does not fit: {size(plan.peak)} {unit} needed per chip, {size(usable)} {unit} usable")
        if levers:
            lines.append("try, in this order (each line includes the ones above it):")
            for lev in levers:
                ok = "fits" if lev.peak <= usable else "    "
                lines.append(f"  {' '.join(lev.overrides):<62}{size(lev.peak, 9)} {unit}  {ok}  {lev.why}")
            if levers[-1].peak > usable:
                lines.append(f"  still {size(levers[-1].peak - usable)} {unit} over: {_more_chips(layout)} "
                             "or a chip with more memory")
        else:
            lines.append(f"  no lever left in the config: {_more_chips(layout)} or a chip with more memory")
    lines.append("")
    tokens_step = cfg.tokens_per_step(layout.replicas)
    steps = cfg.resolve_steps(layout.replicas)
    fpt = meta_model.flops_per_token(cfg.data.seq_len)
    budget = f" (training.total_tokens={t.total_tokens:,})" if t.max_steps is None else ""
    lines += [f"time at {mfu:.0%} MFU (model FLOPs; recomputation lowers the MFU a run reaches)",
              f"  tokens per step   {tokens_step:,}",
              f"  steps             {steps:,}{budget}",
              f"  FLOPs per token   {fpt / 1e9:.2f} GFLOP (forward + backward)"]
    peak_flops = cfg.logging.peak_flops or device.peak_flops(t.precision)
    if peak_flops:
        step_s = tokens_step * fpt / (layout.chips * peak_flops * mfu)
        chip_hours = steps * step_s / 3600 * layout.chips
        cost = f"  cost              {chip_hours:,.0f} chip-hours"
        if usd_per_chip_hour is not None:
            cost += f" = ${chip_hours * usd_per_chip_hour:,.0f} at ${usd_per_chip_hour:g} per chip-hour"
        lines += [f"  step time         {_duration(step_s)}",
                  f"  time to budget    {_duration(steps * step_s)} on {layout.chips} chip(s)", cost]
    else:
        lines.append("  no peak FLOP/s known for this device: set logging.peak_flops for time and cost")
    return "\n".join(lines)


def run_plan(cfg: Config, entry: str, config_path, device_kind: Optional[str], mfu: float,
             world_size: Optional[int], usd_per_chip_hour: Optional[float], margin: float,
             out=None) -> int:
    """Print the plan; 0 if it fits, 1 if not."""
    device = device_for(device_kind, entry)
    layout = layout_for(cfg, entry, world_size, device.kind)
    plan, train_trace = make_plan(cfg, entry, device, margin=margin, layout=layout)
    levers = None if plan.fits else find_levers(plan, entry, train_trace)
    print(format_plan(plan, mfu, usd_per_chip_hour, config_path, levers), file=out or sys.stdout)
    from .loop import settings_warnings  # what a run of this config would warn about at its start
    for line in settings_warnings(cfg, cfg.tokens_per_step(layout.replicas), None,
                                  cfg.resolve_steps(layout.replicas)):
        print(line, file=sys.stderr)
    return 0 if plan.fits else 1
