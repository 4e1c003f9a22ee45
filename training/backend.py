"""The device-specific part of training, as a small interface.

The shared loop (``training.loop``) asks a backend where tensors live, how gradients are reduced,
when the device synchronises, how values reach the host and how checkpoints are written. This file
holds the interface and the PyTorch backend of ``train.py`` (one CUDA/MPS/CPU device, or DDP under
``torchrun``). The XLA backend lives in ``training/xla_backend.py``, the only place that imports
``torch_xla``.
"""
from __future__ import annotations

import contextlib
import os
import sys
import warnings
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from .checkpoint import atomic_torch_save
from .monitor import peak_flops_for


class Backend:
    """What the loop needs from a device. Subclasses override what differs."""

    name = "base"
    device: torch.device
    world_size: int = 1   # data-parallel replicas (sampler shards)
    rank: int = 0         # this process's replica index
    is_master: bool = True
    # Steps between host-side checks that need agreement across processes (stop signals).
    # 1 costs a tiny collective per step; XLA backends check at log intervals instead.
    signal_check_interval: int = 1

    # -- set-up ------------------------------------------------------------------------------
    def autocast_dtype(self, precision: str) -> torch.dtype | None:
        return torch.bfloat16 if precision == "bf16" else None

    def autocast(self, dtype: torch.dtype | None):
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=dtype)

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
        for x, y in iterable:
            yield x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

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
        """Mean of a tensor over replicas (logging only)."""
        return t

    def on_host(self, fn: Callable[..., None], values: torch.Tensor, *args) -> None:
        """Call ``fn(numbers, *args)`` with the vector ``values`` as a list of Python floats (one
        device-to-host transfer), once it is computed."""
        fn(values.tolist(), *args)

    def wait_host(self) -> None:
        """Return once every ``on_host`` call has run (XLA runs them in the background)."""

    def any_process(self, flag: bool) -> bool:
        """True on every process if ``flag`` is true on any (host-side agreement)."""
        return flag

    def barrier(self) -> None:
        pass

    # -- checkpoints -------------------------------------------------------------------------
    def unwrap(self, model: nn.Module) -> nn.Module:
        model = getattr(model, "module", model)        # DDP
        return getattr(model, "_orig_mod", model)      # torch.compile

    def model_state(self, model: nn.Module) -> dict:
        return {k: v.detach().to("cpu", copy=True) for k, v in self.unwrap(model).state_dict().items()}

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        return _to_cpu(optimizer.state_dict())

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        load_optimizer_state(optimizer, state)

    def save(self, obj: dict, path: Path) -> None:
        """Atomically write a checkpoint (the master writes; every process calls this)."""
        if self.is_master:
            atomic_torch_save(obj, path)
        self.barrier()

    # -- reporting ---------------------------------------------------------------------------
    @property
    def n_devices(self) -> int:
        """Devices one step runs on, over all replicas (MFU's denominator)."""
        return self.world_size

    def device_name(self) -> str:
        return str(self.device)

    def peak_flops(self) -> float | None:
        return None

    def log_extras(self) -> dict:
        """Host-side numbers added to every metrics line (XLA: compile counters)."""
        return {}

    def finish(self, run_dir: Path, log: Callable[[str], None]) -> None:
        """End of the run (XLA writes its compile metrics here)."""

    def shutdown(self) -> None:
        pass


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load moments and step counters, keeping this run's hyperparameters and implementation flags.

    ``load_state_dict`` would also restore the saved groups' settings: the learning rate and weight
    decay of the old config, and ``fused``/``foreach`` flags of the other trainer's optimiser (a
    checkpoint from train_xla.py would turn off train.py's fused kernel, and the reverse breaks).
    """
    fresh = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, mine in zip(optimizer.param_groups, fresh):
        group.update(mine)


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


class TorchBackend(Backend):
    """One CUDA/MPS/CPU device, or one process of a ``torchrun`` DDP job (nccl on GPU, gloo on CPU)."""

    name = "torch"

    def __init__(self, device: str = "auto"):
        self.distributed = "RANK" in os.environ and "WORLD_SIZE" in os.environ
        if self.distributed:
            self.rank = int(os.environ["RANK"])
            self.world_size = int(os.environ["WORLD_SIZE"])
            self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        else:
            self.rank, self.world_size, self.local_rank = 0, 1, 0
        self.is_master = self.rank == 0
        self.device = self._pick_device(device)
        if self.distributed:
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            dist.init_process_group(backend=backend, rank=self.rank, world_size=self.world_size,
                                    device_id=self.device if self.device.type == "cuda" else None)
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True

    def _pick_device(self, want: str) -> torch.device:
        if want == "auto":
            if torch.cuda.is_available():
                want = "cuda"
            elif getattr(torch.backends, "mps", None) and torch.backends.mps.is_available() \
                    and not self.distributed:
                want = "mps"
            else:
                want = "cpu"
        dev = torch.device(want)
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"training.device={want!r}: CUDA is not available on this machine")
            if dev.index is None:
                dev = torch.device("cuda", self.local_rank)
        elif dev.type == "mps" and not torch.backends.mps.is_available():
            raise ValueError(f"training.device={want!r}: MPS is not available on this machine")
        elif dev.type not in ("cpu", "cuda", "mps"):
            raise ValueError(f"training.device={want!r}: expected auto, cuda, cuda:N, mps or cpu")
        return dev

    def autocast_dtype(self, precision: str) -> torch.dtype | None:
        if precision != "bf16":
            return None
        if self.device.type == "cuda" and not torch.cuda.is_bf16_supported():
            warnings.warn(f"{torch.cuda.get_device_name(self.device)} does not support bf16: training "
                          "in fp32 (set training.precision=fp32 to silence this)")
            return None
        if self.device.type == "mps":
            warnings.warn("bf16 autocast is not reliable on MPS: training in fp32")
            return None
        flags = _cpu_flags() if self.device.type == "cpu" else ""
        if self.device.type == "cpu" and "avx512_bf16" not in flags and "amx_bf16" not in flags:
            warnings.warn("this CPU has no native bf16 (AVX512-BF16/AMX): bf16 autocast is emulated "
                          "and many times slower than fp32; set training.precision=fp32")
        return torch.bfloat16

    def prepare_model(self, model: nn.Module, cfg) -> nn.Module:
        model = model.to(self.device)
        if cfg.training.compile:
            if self.device.type == "cuda":
                model = torch.compile(model)
            else:
                print("warning: training.compile is used on CUDA only; running eagerly", file=sys.stderr)
        if self.distributed:
            from torch.nn.parallel import DistributedDataParallel as DDP
            ids = [self.device.index] if self.device.type == "cuda" else None
            model = DDP(model, device_ids=ids)
        return model

    def adamw_factory(self):
        if self.device.type in ("cuda", "cpu"):
            def fused_adamw(groups, **kw):
                return torch.optim.AdamW(groups, fused=True, **kw)
            return fused_adamw
        return None  # MPS: the tensor-op AdamW of training.optim

    def batches(self, iterable):
        pin = self.device.type == "cuda"
        for x, y in iterable:
            if pin:
                x, y = x.pin_memory(), y.pin_memory()
            yield x.to(self.device, non_blocking=pin), y.to(self.device, non_blocking=pin)

    def no_sync(self, model: nn.Module, last_micro_step: bool):
        if self.distributed and not last_micro_step:
            return model.no_sync()
        return contextlib.nullcontext()

    def mean_across(self, t: torch.Tensor) -> torch.Tensor:
        if not self.distributed:
            return t
        t = t.detach().clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t / self.world_size

    def any_process(self, flag: bool) -> bool:
        if not self.distributed:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item() > 0)

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def device_name(self) -> str:
        if self.device.type == "cuda":
            return torch.cuda.get_device_name(self.device)
        return self.device.type

    def peak_flops(self) -> float | None:
        if self.device.type == "cuda":
            return peak_flops_for(torch.cuda.get_device_name(self.device))
        return None

    def shutdown(self) -> None:
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()
