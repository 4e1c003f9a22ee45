"""The device-specific part of training, as a small interface.

The shared loop (``training.loop``) asks a backend where tensors live, how gradients are reduced,
when the device synchronises, how values reach the host, how processes agree, and how checkpoint
state is gathered, copied to the host and loaded. This file holds the interface and the PyTorch
backend of ``train.py`` (one CUDA/MPS/CPU device, DDP under ``torchrun``, or FSDP2 with
``training.fsdp``). The XLA backend lives in ``training/xla_backend.py``, the only place that
imports ``torch_xla``.

Agreement across processes (``any_process``, ``all_equal``) goes through
``self.host``, a ``training.distributed.HostGroup`` on a gloo group: host-side, no device sync.
``agree_at_launch`` (``training.launch``) is the first use of it, once the group exists and
before any model is built: every process's data, config and launch problems, decided together.

Checkpoints (``training.checkpoint.Checkpointer`` drives them): ``checkpoint_format`` says which
form this backend writes ("file": one ``ckpt_*.pt`` by the master; "dcp": a DCP directory, every
process writing its shards over ``self.ckpt_group``). ``checkpoint_state`` gives the live state by
parameter name (``torch.distributed.checkpoint.state_dict.get_state_dict``), ``stage`` copies it
to the host, ``load_full_state`` loads a whole CPU state, ``load_sharded_state`` reads a DCP
directory into the live (sharded) state.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import sys
import warnings
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from .checkpoint import keep_hyperparameters, optimizer_state_by_name
from .distributed import HostGroup, group_timeout, new_gloo_group
from .launch import agree_at_launch
from .monitor import peak_flops_for


class Backend:
    """What the loop needs from a device. Subclasses override what differs."""

    name = "base"
    device: torch.device
    world_size: int = 1   # data-parallel replicas (sampler shards)
    rank: int = 0         # this process's replica index
    is_master: bool = True
    # Whether the stop decision (a signal on any process) is taken after every step: one tiny
    # host-side all-reduce per step, which torchrun's 30 s between passing a signal on and
    # SIGKILL needs. The XLA backend with several processes decides at log steps instead.
    decides_every_step: bool = True
    # How one global batch of ``batch_size`` sequences is split over devices when it is not one
    # batch per replica: SPMD's "data 2 x fsdp 2" (the start-up line says so); None otherwise.
    batch_split: str | None = None

    # -- set-up ------------------------------------------------------------------------------
    def autocast_dtype(self, precision: str) -> torch.dtype | None:
        return torch.bfloat16 if precision == "bf16" else None

    # autocast's cache of weight casts (TorchBackend turns it off under FSDP2)
    autocast_cache: bool = True

    def autocast(self, dtype: torch.dtype | None):
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=dtype, cache_enabled=self.autocast_cache)

    def new_model(self, build: Callable[[], nn.Module]) -> nn.Module:
        """The model ``build()`` makes, as this process holds it until ``prepare_model``: in host
        memory, initialised (the same on every process: the same seed)."""
        return build()

    def prepare_model(self, model: nn.Module, cfg) -> nn.Module:
        """Move (and wrap, shard or compile) the model; returns what the loop calls forward on."""
        return model.to(self.device)

    def adamw_factory(self):
        """The AdamW implementation for this device (see training.optim)."""
        return None

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Place or shard optimiser state (SPMD); a no-op elsewhere."""

    def keep_gradients(self, params: list[torch.Tensor], accumulation: int) -> bool:
        """Whether gradient buffers live across steps (zeroed after each update, never freed), so
        that every micro-step adds into existing buffers; if so, they are created here. XLA does
        with accumulation: a micro-step that creates the gradients would be another graph."""
        return False

    def batches(self, iterable: Iterable) -> Iterator:
        """An iterator of batches already on the device."""
        return OnDevice(iterable, self.device, non_blocking=True)

    def close_batches(self, batches: Iterator) -> None:
        """Stop an iterator from ``batches`` (background prefetching, if any)."""

    # -- the step ----------------------------------------------------------------------------
    def no_sync(self, model: nn.Module, last_micro_step: bool):
        """Skip the gradient all-reduce on accumulation micro-steps (DDP)."""
        return contextlib.nullcontext()

    def reduce_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """All-reduce gradients across replicas, if backward did not already."""

    def sync(self) -> None:
        """End of a step: let the device run what was traced (XLA); a no-op elsewhere."""

    def mean_across(self, t: torch.Tensor) -> torch.Tensor:
        """Mean of a tensor over replicas (the logged metrics, and the loss the skip decision reads)."""
        return t

    def grad_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The global L2 norm of the (reduced) gradients, as a plain tensor."""
        return self.whole(torch.nn.utils.get_total_norm(grads))

    def whole(self, t: torch.Tensor) -> torch.Tensor:
        """A value as one plain tensor: a DTensor (FSDP2: a norm, a statistic of sharded
        parameters) becomes its full value; anything else stays as it is."""
        return _full(t)

    def on_host(self, fn: Callable[..., None], values: torch.Tensor, *args) -> None:
        """Call ``fn(numbers, *args)`` with the vector ``values`` as a list of Python floats (one
        device-to-host transfer), once it is computed."""
        fn(values.tolist(), *args)

    def wait_host(self) -> None:
        """Return once every ``on_host`` call has run (XLA runs them in the background)."""

    # -- agreement across processes (host-side: a gloo all-reduce, never a device sync) -------
    host: HostGroup = HostGroup()   # one process unless a subclass makes a group
    ckpt_group = None               # the gloo group of checkpoint I/O (None: one process)
    made_group: bool = False        # whether this backend initialised the default process group

    def any_process(self, *flags: bool):
        """For each flag: true on every process if it is true on any. One host-side all-reduce
        for all the flags together (every process must call it at the same point); one flag
        gives a bool, several a tuple. Used for every decision that must be the same everywhere:
        stop after a SIGTERM that reached one process, stop after non-finite steps."""
        out = self.host.any(flags)
        return out[0] if len(flags) == 1 else out

    def max_across(self, *values: int) -> tuple[int, ...]:
        """Each integer's largest value over the processes (one host-side all-reduce; every
        process calls it at the same point)."""
        return self.host.max(values)

    def all_equal(self, text: str) -> bool:
        """Is ``text`` (a hash of meta.json, a checkpoint name, ...) the same on every process?
        One host-side all-reduce; every process gets the same answer."""
        return self.host.all_equal(text)

    def agree_at_launch(self, cfg, problem: str = "") -> None:
        """The launch agreement (``training.launch.agree_at_launch``): the data (meta.json's
        fingerprint, after ``check_data`` on every process), the resolved config and ``problem``
        (what this process found wrong at set-up, "" if nothing), gathered from every process;
        a ``ConfigError`` with the same one-line verdict on every process, or none. Called once,
        by every process, right after the host group exists and before the model is built
        (train.py after making its ``TorchBackend``; ``XLABackend.__init__``)."""
        agree_at_launch(self.host, cfg, problem)

    # -- checkpoints -------------------------------------------------------------------------
    checkpoint_format = "file"      # or "dcp" (see training.checkpoint)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return getattr(model, "module", model)         # DDP

    def checkpoint_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """The live state, keyed by parameter name: ``{"model": {...}, "optimizer": {"state":
        {name: {...}}, "param_groups": [...]}}`` (``get_state_dict``: sharded DTensors under FSDP2,
        device tensors on XLA; no copies)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict
        msd, osd = get_state_dict(self.unwrap(model), optimizer)
        return {"model": msd, "optimizer": osd}

    def stage(self, state: dict, sharded: bool) -> dict | None:
        """A host copy of ``checkpoint_state`` that training may run on from (the device-to-host
        copy happens here, at the step). Single-file form: the whole state, on the master only
        (``None`` elsewhere). DCP form: each process's own shards."""
        if sharded:
            from torch.distributed.checkpoint.staging import BlockingAsyncStager
            if getattr(self, "_stager", None) is None:  # pinned, reused buffers on CUDA
                self._stager = BlockingAsyncStager(cache_staged_state_dict=self.device.type == "cuda")
            return self._stager.stage(state)
        return _to_cpu(state) if self.is_master else None

    def dcp_save_planner(self):
        return None  # DCP's default planner

    def dcp_load_planner(self):
        return None

    def load_full_state(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                        model_state: dict, optim_state: dict) -> None:
        """Load a whole CPU state (a file, or a DCP directory consolidated) into the live model
        and optimiser; this run's hyperparameters are kept."""
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
        raw = self.unwrap(model)
        raw.load_state_dict(model_state)
        with keep_hyperparameters(optimizer):
            set_optimizer_state_dict(raw, optimizer, optimizer_state_by_name(raw, optimizer, optim_state))

    def _dcp_load(self, model: nn.Module, optimizer: torch.optim.Optimizer, reader) -> dict:
        """DCP-load this process's part of the model and optimiser state (as ``checkpoint_state``
        lays it out) through this backend's planner and group; returns the filled state."""
        import torch.distributed.checkpoint as dcp
        state = self.checkpoint_state(model, optimizer)
        target = {"model": state["model"], "optimizer": {"state": state["optimizer"]["state"]}}
        with warnings.catch_warnings():  # one process: "loading in a single process" is the point
            if self.ckpt_group is None:
                warnings.simplefilter("ignore", UserWarning)
            dcp.load(target, storage_reader=reader, planner=self.dcp_load_planner(),
                     process_group=self.ckpt_group, no_dist=self.ckpt_group is None)
        return target

    def load_sharded_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, path: Path,
                           param_groups: list, reader) -> None:
        """Read a DCP directory into the live state, each process its own part (any mesh or
        world size: DCP reshards), then hand it to the model and optimiser."""
        from torch.distributed.checkpoint.state_dict import set_state_dict
        target = self._dcp_load(model, optimizer, reader)
        with keep_hyperparameters(optimizer):
            set_state_dict(self.unwrap(model), optimizer, model_state_dict=target["model"],
                           optim_state_dict={"state": target["optimizer"]["state"],
                                             "param_groups": param_groups})

    def seed_rng(self, seed: int) -> None:
        """Seed the generator the step's random draws (dropout) come from: torch's default
        generators here (CPU, and CUDA/MPS through ``torch.manual_seed``). Host-side only."""
        torch.manual_seed(seed)

    # -- reporting ---------------------------------------------------------------------------
    @property
    def n_devices(self) -> int:
        """Devices one step runs on, over all replicas (MFU's denominator)."""
        return self.world_size

    def device_name(self) -> str:
        return str(self.device)

    def peak_flops(self, precision: str = "bf16") -> float | None:
        """Dense peak FLOP/s of one device for a run in ``precision`` (MFU's), if known."""
        return None

    def log_extras(self) -> dict:
        """Host-side numbers added to every metrics line (XLA: compile counters; CUDA: memory)."""
        return {}

    def wait_device(self) -> None:
        """Wait for the work queued on the device (CUDA), so that host time measures it: around
        evaluation, whose time is left out of the training throughput. A no-op elsewhere."""

    def finish(self, run_dir: Path, log: Callable[[str], None]) -> None:
        """End of the run (XLA writes its compile metrics here)."""

    # -- profiling (logging.profile_start) ------------------------------------------------------
    _profile = None

    def start_profile(self, folder: Path, name: str) -> None:
        """Start a trace of this process's host and device work: torch.profiler (CPU, and CUDA's
        kernels on a GPU), written by ``stop_profile`` as ``folder/rank<R>_<name>.json``, a
        Chrome trace (chrome://tracing, Perfetto, TensorBoard)."""
        from torch.profiler import ProfilerActivity, profile
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        prof = profile(activities=activities)
        prof.start()
        self._profile = (prof, folder / f"rank{self.rank}_{name}.json")

    def profile_scope(self, name: str):
        """A named range in the trace (a step), or nothing when no trace runs."""
        return torch.profiler.record_function(name) if self._profile is not None else contextlib.nullcontext()

    def stop_profile(self) -> Path:
        """Stop the trace (after the device's queued work) and write it; returns where."""
        prof, path = self._profile
        self._profile = None
        prof.stop()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        prof.export_chrome_trace(str(tmp))
        os.replace(tmp, path)
        return path

    def shutdown(self) -> None:
        """Destroy the process groups this backend made: the default group (and every group with
        it) if it initialised it; else only its own gloo groups, so a caller's group (a test's, a
        notebook's, a launcher's) stays usable."""
        if not (dist.is_available() and dist.is_initialized()):
            return
        if self.made_group:
            dist.destroy_process_group()
        else:
            for group in (self.host.group, self.ckpt_group):
                if group is not None:
                    dist.destroy_process_group(group)
        self.host, self.ckpt_group, self.made_group = HostGroup(), None, False


class OnDevice:
    """``iterable``'s ``(x, y)`` batches moved to ``device`` (through pinned memory with ``pin``,
    asynchronously with ``non_blocking``, which defaults to ``pin``).
    An error one batch raises (the stream's ``ConfigError`` for a token id past the vocabulary)
    passes through, and the next call goes on with the next batch, as the stream itself does: a
    generator here ended at the error, so the loop's next micro-batch found the stream over."""

    def __init__(self, iterable: Iterable, device: torch.device, pin: bool = False, non_blocking: bool | None = None):
        self._it, self.device, self.pin = iter(iterable), device, pin
        self.non_blocking = pin if non_blocking is None else non_blocking

    def __iter__(self) -> "OnDevice":
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = next(self._it)
        if self.pin:
            x, y = x.pin_memory(), y.pin_memory()
        return x.to(self.device, non_blocking=self.non_blocking), y.to(self.device, non_blocking=self.non_blocking)


def fused_adamw(groups, **kw):
    """train.py's optimiser factory on CUDA and the CPU: torch's AdamW with its fused kernel."""
    return torch.optim.AdamW(groups, fused=True, **kw)


fused_adamw.fused = True   # Muon's AdamW groups take the same kernel (training.optim)


def compile_regions(model: nn.Module) -> None:
    """``torch.compile`` every transformer block's forward and the loss (fullgraph), in place, as
    torchtitan does.

    The blocks run one code object on the same shapes, so Dynamo compiles the first and the others
    reuse its graph: the warm-up is one block's, whatever ``n_layers``. Compiling the whole model
    unrolls every layer into one graph instead (bench/model.py, 4 layers: 17x the baseline's
    warm-up for Nash-MHC, whose block is the larger). The loss (``model.lm_loss``) is a second,
    small graph (not ``model.loss_chunk``'s chunks, which stay eager): eager, its fp32 copy of the
    [tokens, vocab] logits, the softmax and their backward are separate passes over the step's
    largest activation, which inductor fuses (bench/gpu.py variants on an H100, small_gpu's shape,
    batch 16 x 1024: the baseline's step 44.7 -> 36.9 ms, Nash-MHC's 97.3 -> 88.1 ms). Only
    ``forward`` is replaced: the modules, their parameter names and any DDP/FSDP hooks stay as they
    are and run eagerly, as do the embedding, the stream collapse and the LM head's product. Static
    shapes: a training run's never change, and a new one (an evaluation batch) compiles its own graph.
    """
    for block in model.blocks:
        block.forward = compile_region(block.forward)
    model.loss_fn = compile_region(model.loss_fn)


# AOTAutograd traces a compiled region's backward under the autocast state its forward ran in
# (torch 2.9's ``backward_pass_autocast = "same_as_forward"``). Eager autograd runs the backward of
# an op in the dtypes its forward used, whatever autocast says then; so under bf16 autocast the
# products the model keeps in fp32 on purpose (``autocast(enabled=False)``: mHC's coefficient
# projection, mHC-lite's mixture of permutations) had fp32 backward products in eager PyTorch and
# bf16 ones in the compiled blocks: the projection's weight gradient rounded to bf16 in every GPU
# run. "off" is eager's rule, and the default PyTorch itself is moving to (pytorch#153044).
REGION_CONFIG = {"backward_pass_autocast": "off"}


def compile_region(fn: Callable) -> Callable:
    """``torch.compile(fn)`` (fullgraph, static shapes) whose backward follows eager's dtypes
    (``REGION_CONFIG``). The setting is read when a call traces a graph, so every call runs under it."""
    from torch._functorch import config as functorch_config

    compiled = torch.compile(fn, fullgraph=True, dynamic=False)

    def region(*args, **kwargs):
        with functorch_config.patch(REGION_CONFIG):
            return compiled(*args, **kwargs)
    return region


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory in the process's heap: a fixed mmap threshold of 32
    MiB and a trim threshold of 1 GiB. By default glibc gives the free top of its heap back to the
    kernel once it passes the trim threshold (twice the mmap threshold, which follows the largest
    block freed so far, up to 32 MiB), and maps and unmaps every block above the mmap threshold. A
    CPU training step frees its activations together, far more than that: with the defaults most of
    its memory went back to the kernel every step and was faulted in again, page by page, the next
    (40 blocks of 4 MiB: 160 MiB faulted in again each round; tuned, none after the first).
    bench/model.py's eager step at issue 13's shape, two pairs of runs: Nash-MHC 4-13% faster, the
    baseline 3-7%. Blocks above 32 MiB, and a free heap top above 1 GiB, still go back.

    False where glibc's malloc is not the process's allocator: no glibc (macOS, musl), or jemalloc
    or tcmalloc preloaded (PyTorch's CPU tuning guide recommends them; they keep freed memory
    themselves, and glibc's ``mallopt`` would succeed on a heap no one uses)."""
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc, process = ctypes.CDLL("libc.so.6"), ctypes.CDLL(None)
        mallopt, ours, used = libc.mallopt, libc.malloc, process.malloc
    except (OSError, AttributeError):
        return False
    if ctypes.cast(ours, ctypes.c_void_p).value != ctypes.cast(used, ctypes.c_void_p).value:
        return False   # another malloc is first in the process's symbol lookup (LD_PRELOAD)
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(mallopt(m_mmap_threshold, 32 << 20)) and bool(mallopt(m_trim_threshold, 1 << 30))


def native_cpu_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU computes bf16 natively, as Linux's ``cpuinfo`` says: x86's ``avx512_bf16``
    or ``amx_bf16`` flags, or Arm's ``bf16`` feature (Graviton3, Neoverse V1/N2 and later). False
    where the file cannot be read (macOS)."""
    try:
        with open(cpuinfo) as f:
            line = next((ln for ln in f if ln.startswith(("flags", "Features"))), "")
    except OSError:
        return False
    return bool({"avx512_bf16", "amx_bf16", "bf16"} & set(line.partition(":")[2].split()))


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor (FSDP2 metrics and norms) as the whole tensor; anything else as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def launch_env() -> tuple[int, int, int | None]:
    """``(RANK, WORLD_SIZE, LOCAL_RANK)`` as torchrun sets them (LOCAL_RANK None where a launcher
    left it out), or a ValueError naming the variable that is not a usable value."""
    def number(name: str) -> int | None:
        value = os.environ.get(name)
        if value is None:
            return None
        try:
            n = int(value)
        except ValueError:
            n = -1
        if n < 0:
            raise ValueError(f"{name}={value!r} in the environment: expected a whole number >= 0 "
                             "(torchrun sets it)")
        return n

    rank, world, local = number("RANK"), number("WORLD_SIZE"), number("LOCAL_RANK")
    if world < 1 or rank >= world:
        raise ValueError(f"RANK={rank}, WORLD_SIZE={world} in the environment: a rank is one of "
                         "0 .. WORLD_SIZE - 1 (torchrun sets both)")
    return rank, world, (local if local is not None or world > 1 else 0)


class TorchBackend(Backend):
    """One CUDA/MPS/CPU device, or one process of a ``torchrun`` job (nccl on GPU, gloo on CPU):
    DDP, or FSDP2 with ``fsdp=True`` (``fully_shard`` per block and at the root: parameters,
    gradients and optimizer state sharded over the processes; DCP checkpoints)."""

    name = "torch"

    def __init__(self, device: str = "auto", fsdp: bool = False, timeout_s: float | None = None,
                 cpu_malloc: str = "default"):
        self.distributed = "RANK" in os.environ and "WORLD_SIZE" in os.environ
        if self.distributed:
            self.rank, self.world_size, self.local_rank = launch_env()
        else:
            self.rank, self.world_size, self.local_rank = 0, 1, 0
        self.is_master = self.rank == 0
        if cpu_malloc not in ("tuned", "default"):
            raise ValueError(f"training.cpu_malloc={cpu_malloc!r}: expected tuned or default")
        self.device = self._pick_device(device)
        # training.cpu_malloc; process-wide, so set here by the process's one backend
        self.malloc_tuned = self.device.type == "cpu" and cpu_malloc == "tuned" and keep_freed_memory()
        if self.device.type == "cuda":
            # the current device for everything that takes the default (pinned memory's context,
            # nccl, bf16 support): one process, training.device=cuda:1, must not touch GPU 0
            torch.cuda.set_device(self.device)
        if self.distributed:
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            self.made_group = made = not dist.is_initialized()  # a caller (a test, a notebook) may have made it
            if made:
                dist.init_process_group(backend=backend, rank=self.rank, world_size=self.world_size,
                                        device_id=self.device if self.device.type == "cuda" else None,
                                        timeout=group_timeout(timeout_s))
            try:  # host-side groups: decisions in the loop's thread, checkpoint I/O in the writer's
                self.host = HostGroup(new_gloo_group(timeout_s))
                self.ckpt_group = new_gloo_group(timeout_s)
            except BaseException:
                if made:   # no backend is returned to shut it down
                    dist.destroy_process_group()
                raise
        self.fsdp = fsdp and self.distributed and self.world_size > 1
        if fsdp and not self.fsdp:
            print("warning: training.fsdp shards over torchrun processes; with one process the "
                  "model is trained unsharded", file=sys.stderr)
        self.checkpoint_format = "dcp" if self.fsdp else "file"
        # Under FSDP2, autocast's cache of bf16 weight casts would keep every block's gathered
        # weights, cast, until the forward ends (FSDP2 frees its own copy after each block): a
        # bf16 copy of the whole model per GPU. Without the cache a weight is cast where it is used.
        self.autocast_cache = not self.fsdp

    def _pick_device(self, want: str) -> torch.device:
        if want == "auto":
            if torch.cuda.is_available():
                want = "cuda"
            elif getattr(torch.backends, "mps", None) and torch.backends.mps.is_available() \
                    and not self.distributed:
                want = "mps"
            else:
                want = "cpu"
        try:
            dev = torch.device(want)
        except RuntimeError:  # "gpu", "cuda:x": the config check says so first; callers may not check
            raise ValueError(f"training.device={want!r}: expected auto, cuda, cuda:N, mps or cpu") from None
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"training.device={want!r}: CUDA is not available on this machine")
            if dev.index is not None and self.distributed and self.world_size > 1:
                raise ValueError(f"training.device={want!r} under torchrun with {self.world_size} processes "
                                 "would put them all on one GPU: use cuda (each process takes the GPU of "
                                 "its LOCAL_RANK)")
            if dev.index is None:
                if self.local_rank is None:
                    raise ValueError(f"training.device={want!r} under a launcher of {self.world_size} "
                                     "processes that set RANK and WORLD_SIZE but not LOCAL_RANK, which "
                                     "picks each process's GPU: set it (torchrun does; under Slurm, "
                                     "LOCAL_RANK=$SLURM_LOCALID)")
                dev = torch.device("cuda", self.local_rank)
            if dev.index >= torch.cuda.device_count():
                raise ValueError(
                    f"training.device={want!r}: this machine has {torch.cuda.device_count()} GPU(s), "
                    + (f"and torchrun started this process as LOCAL_RANK {self.local_rank} (more processes "
                       "per node than GPUs: --nproc_per_node)" if want in ("cuda", "auto") else
                       f"no cuda:{dev.index}"))
        elif dev.type == "mps" and not torch.backends.mps.is_available():
            raise ValueError(f"training.device={want!r}: MPS is not available on this machine")
        elif dev.type == "mps" and self.distributed and self.world_size > 1:
            raise ValueError(f"training.device={want!r} under torchrun with {self.world_size} processes: "
                             "gloo carries no MPS tensors; one process trains on MPS, several on cpu")
        elif dev.type not in ("cpu", "cuda", "mps"):
            raise ValueError(f"training.device={want!r}: expected auto, cuda, cuda:N, mps or cpu")
        return dev

    def new_model(self, build: Callable[[], nn.Module]) -> nn.Module:
        """FSDP2: rank 0 alone builds the model in host memory (its initial weights, or the
        ``checkpoint.init_from`` weights loaded into it, are every rank's); the others build it on
        the meta device, and ``prepare_model`` gives each its shards of rank 0's tensors. Every
        rank holding the whole fp32 model was 12.6 GiB of host memory per GPU for the 3B config."""
        if self.fsdp and self.rank != 0:
            with torch.device("meta"):
                return build()
        return build()

    def autocast_dtype(self, precision: str) -> torch.dtype | None:
        if precision != "bf16":
            return None
        if self.device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
            warnings.warn(f"{torch.cuda.get_device_name(self.device)} does not support bf16: training "
                          "in fp32 (set training.precision=fp32 to silence this)")
            return None
        if self.device.type == "mps":
            warnings.warn("bf16 autocast is not reliable on MPS: training in fp32")
            return None
        if self.device.type == "cpu" and not native_cpu_bf16():
            warnings.warn("this CPU has no native bf16 (x86 AVX512-BF16/AMX, Arm BF16): bf16 autocast is "
                          "emulated and many times slower than fp32; set training.precision=fp32")
        return torch.bfloat16

    def prepare_model(self, model: nn.Module, cfg) -> nn.Module:
        if self.device.type == "cuda":
            # fp32 matmuls: TF32 in an fp32 run (the peak its MFU is counted against). Under bf16
            # autocast the matmuls left in fp32 are the ones kept there on purpose (the mHC
            # coefficients and the stream mixing, whose products of n numbers would otherwise
            # round the residual streams to TF32's 10-bit mantissa at every write): IEEE fp32.
            # The legacy flag, although 2.9 warns: after its new ``fp32_precision`` API, the legacy
            # getters that inductor still calls (``allow_tf32``, ``get_float32_matmul_precision``) raise.
            torch.backends.cuda.matmul.allow_tf32 = cfg.training.precision == "fp32"
        if self.fsdp:
            # FSDP2: one all-gather/reduce-scatter unit per block; the root holds the embedding,
            # the (tied) LM head, the final norm and the stream collapse. Sharded on the meta
            # device (rank 0's tensors wait on the host in ``whole``), then each rank allocates
            # its shards on its device and receives them from rank 0, one tensor at a time: no
            # device ever holds the whole model. The mesh is this backend's device and
            # processes: fully_shard's default takes the machine's accelerator, which would move
            # a training.device=cpu model to the GPU. The last block keeps its gathered weights
            # from its forward to its backward, which comes right after the loss (as torchtitan
            # does; FSDP2 does so for the root itself): one all-gather of a block fewer per step,
            # no more memory at the peak the planner counts (the root and two blocks gathered).
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard
            whole = model.state_dict() if self.rank == 0 else {}
            model.to("meta")
            mesh = init_device_mesh(self.device.type, (self.world_size,))
            for i, block in enumerate(model.blocks):
                fully_shard(block, mesh=mesh, reshard_after_forward=i < len(model.blocks) - 1)
            fully_shard(model, mesh=mesh)
            model.to_empty(device=self.device)
            set_model_state_dict(model, whole, options=StateDictOptions(full_state_dict=True,
                                                                        broadcast_from_rank0=True))
            del whole
            model.init_buffers()  # the derived buffers are not in a state dict
        else:
            model = model.to(self.device)
        if cfg.training.compile:
            if self.device.type == "cuda":
                compile_regions(model)
            else:
                print("warning: training.compile is used on CUDA only; running eagerly", file=sys.stderr)
        if self.distributed and not self.fsdp:
            from torch.nn.parallel import DistributedDataParallel as DDP
            ids = [self.device.index] if self.device.type == "cuda" else None
            # the gradients are views into DDP's buckets: without it, the buckets are a second copy.
            # No buffer broadcast before every forward: the model's buffers (RoPE tables, mHC's
            # constants) are computed, the same on every rank, and never change.
            model = DDP(model, device_ids=ids, gradient_as_bucket_view=True, broadcast_buffers=False)
        return model

    def adamw_factory(self):
        if self.device.type in ("cuda", "cpu"):
            return fused_adamw
        return None  # MPS: the tensor-op AdamW of training.optim

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """DDP replicas hold the same all-reduced gradients: Muon's Newton-Schulz work is shared
        among them (each a share of every shape's matrices, one all-gather) instead of repeated on
        each. FSDP2 shares it by the matrices' shards already (``training.optim.orthogonalised``)."""
        from .optim import Muon
        if isinstance(optimizer, Muon) and self.distributed and not self.fsdp and self.world_size > 1:
            optimizer.spread_over = dist.group.WORLD

    def batches(self, iterable):
        return OnDevice(iterable, self.device, pin=self.device.type == "cuda")

    def no_sync(self, model: nn.Module, last_micro_step: bool):
        # FSDP2 reduce-scatters every micro-step: the accumulated gradient stays sharded.
        if self.distributed and not self.fsdp and not last_micro_step:
            return model.no_sync()
        return contextlib.nullcontext()

    def load_full_state(self, model, optimizer, model_state, optim_state) -> None:
        if not self.fsdp:
            return super().load_full_state(model, optimizer, model_state, optim_state)
        # Every rank holds the whole CPU state; each keeps its shards of it.
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
        with keep_hyperparameters(optimizer):
            set_state_dict(model, optimizer, model_state_dict=model_state,
                           optim_state_dict=optimizer_state_by_name(model, optimizer, optim_state),
                           options=StateDictOptions(full_state_dict=True))

    def mean_across(self, t: torch.Tensor) -> torch.Tensor:
        if not self.distributed:
            return t
        t = t.detach().clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t / self.world_size

    def device_name(self) -> str:
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else self.device.type
        notes = []
        if self.malloc_tuned:
            notes.append("glibc malloc keeps freed memory")
        if self.fsdp:
            notes.append(f"FSDP2 over {self.world_size} processes")
        return f"{name} ({'; '.join(notes)})" if notes else name

    def peak_flops(self, precision: str = "bf16") -> float | None:
        if self.device.type == "cuda":
            return peak_flops_for(torch.cuda.get_device_name(self.device), precision)
        return None

    def wait_device(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def log_extras(self) -> dict:
        """On CUDA, this process's memory since the last line (then the peaks start afresh):
        the most its tensors held (``mem_peak_gib``) and the most the caching allocator reserved
        (``mem_reserved_gib``, what the GPU had in use)."""
        if self.device.type != "cuda":
            return {}
        gib = 2 ** 30
        extras = {"mem_peak_gib": torch.cuda.max_memory_allocated(self.device) / gib,
                  "mem_reserved_gib": torch.cuda.max_memory_reserved(self.device) / gib}
        torch.cuda.reset_peak_memory_stats(self.device)
        return extras
