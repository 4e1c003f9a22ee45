"""The PyTorch/XLA backend: the only module that imports ``torch_xla``.

Two modes (``xla.mode``):

- ``ddp``: one process per TPU core/chip (``xmp.spawn``), each with its own replica of the model;
  ``DistributedSampler`` shards, ``MpDeviceLoader`` uploads, ``xm.reduce_gradients`` all-reduces,
  then the *reduced* gradient is clipped and the optimiser steps.
- ``spmd``: one process drives every device through a ``data x fsdp x tp`` mesh. Parameters are
  sharded FSDP-style over ``fsdp`` and tensor-parallel over ``tp``; the batch is sharded over
  ``data`` and ``fsdp``; XLA's SPMD partitioner inserts the collectives. ``batch_size`` is global.

Host syncs happen only in step closures at log intervals; values are copied with ``.cpu()`` (a
transfer), never ``.item()`` on a device tensor (which would show up as an ``aten::`` fallback).
"""
from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
import torch_xla.distributed.parallel_loader as pl
import torch_xla.runtime as xr
from torch import nn

from .backend import Backend, load_optimizer_state
from .checkpoint import fsync_dir
from .monitor import peak_flops_for
from .optim import AdamW
from .sharding import param_partition_spec, state_partition_spec


def xla_counters() -> dict:
    """Compilations, CPU fallbacks (``aten::`` counters) and device-to-host transfers so far."""
    fallbacks = sorted(n for n in met.counter_names() if n.startswith("aten::"))
    transfers = met.metric_data("TransferFromDeviceTime")
    return {
        "compilations": int(met.counter_value("UncachedCompile") or 0),
        "cached_compilations": int(met.counter_value("CachedCompile") or 0),
        "cpu_fallbacks": len(fallbacks),
        "fallback_ops": {n: int(met.counter_value(n)) for n in fallbacks},
        "device_to_host_transfers": int(transfers[0]) if transfers else 0,
        "executions": int(met.counter_value("ExecuteComputation") or 0),
    }


class _DeviceBatches:
    """Batches uploaded to the device by a background thread: torch_xla's ``ParallelLoader``, as
    ``MpDeviceLoader`` uses it, with a ``close`` that stops the prefetching."""

    def __init__(self, iterable, device, **kw):
        self._loader = pl.ParallelLoader(iterable, [device], **kw)
        self._it = self._loader.per_device_loader(device)

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._it)

    def close(self) -> None:
        self._loader.close()


class XLABackend(Backend):
    name = "xla"

    def __init__(self, cfg):
        self.cfg = cfg
        self.spmd = cfg.xla.mode == "spmd"
        self.mesh = None
        if self.spmd:
            xr.use_spmd()
        self._init_cache(cfg.xla.compile_cache)
        self.device = torch_xla.device()
        if self.spmd:
            import torch_xla.distributed.spmd as xs
            self.xs = xs
            n = xr.global_runtime_device_count()
            m = cfg.xla.mesh
            if m.data * m.fsdp * m.tp != n:
                raise ValueError(f"xla.mesh: data x fsdp x tp = {m.data} x {m.fsdp} x {m.tp} = "
                                 f"{m.data * m.fsdp * m.tp}, but there are {n} devices")
            self.mesh = xs.Mesh(np.arange(n), (m.data, m.fsdp, m.tp), ("data", "fsdp", "tp"))
            self.world_size, self.rank, self.is_master = 1, 0, xr.process_index() == 0
            self.n_devices = n
        else:
            self.world_size = xr.world_size()
            self.rank = xr.global_ordinal()
            self.is_master = self.rank == 0  # the global master: one writer across hosts
            self.n_devices = self.world_size
        # Cross-process decisions (stop signals) are taken at log intervals: a rendezvous costs
        # a host round trip, which the step never pays.
        self.signal_check_interval = cfg.logging.interval
        self._specs: dict[int, tuple] = {}
        self._grad_hooks: dict[int, object] = {}

    def _init_cache(self, cache: str | None) -> None:
        if not cache:
            return
        if xr.device_type() == "CPU":
            # PJRT CPU cannot deserialise executables: a cache would only add a warning per graph.
            return
        sub = "spmd" if self.spmd else f"ordinal_{xr.global_ordinal()}"
        path = Path(cache).expanduser() / sub
        path.mkdir(parents=True, exist_ok=True)
        try:
            xr.initialize_cache(str(path), readonly=False)
        except RuntimeError as e:  # already initialised in this process (tests, notebooks)
            if "already" not in str(e).lower():
                raise

    # -- set-up ------------------------------------------------------------------------------
    def prepare_model(self, model: nn.Module, cfg) -> nn.Module:
        if cfg.model.activation_checkpointing:
            import torch_xla.utils.checkpoint as xcp
            model.checkpoint_fn = xcp.checkpoint
        model = model.to(self.device)  # NashMHC._apply re-ties the embedding and LM head on XLA
        assert not cfg.model.tie_embeddings or model.lm_head.weight is model.tok_emb.weight
        if self.spmd:
            for name, p in model.named_parameters():
                spec = param_partition_spec(name, p)
                if spec is not None and id(p) not in self._specs:
                    self.xs.mark_sharding(p, self.mesh, spec)
                    self._specs[id(p)] = spec
        return model

    def adamw_factory(self):
        return AdamW  # no fused kernel on XLA: the tensor-op AdamW, same state layout

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """SPMD: shard the optimiser state like its parameter (FSDP), and with
        ``xla.shard_optimizer_over_data`` over data x fsdp, the gradients too (ZeRO-2)."""
        if not self.spmd:
            return
        over_data = self.cfg.xla.shard_optimizer_over_data and self.cfg.xla.mesh.data > 1
        for group in optimizer.param_groups:
            for p in group["params"]:
                spec = state_partition_spec(self._specs.get(id(p)), over_data) or (None,) * p.ndim
                for v in optimizer.state[p].values():
                    if torch.is_tensor(v) and v.shape == p.shape and v.device == p.device and v.ndim:
                        self.xs.mark_sharding(v, self.mesh, spec)
                if over_data and id(p) in self._specs and id(p) not in self._grad_hooks:
                    # Annotate each gradient as autograd stores it: XLA then reduce-scatters it
                    # over data x fsdp instead of all-reducing it over data, and it stays that way
                    # between accumulation micro-steps.
                    self._grad_hooks[id(p)] = p.register_post_accumulate_grad_hook(
                        functools.partial(self._shard_grad, spec=spec))

    def _shard_grad(self, param: torch.Tensor, spec: tuple) -> None:
        self.xs.mark_sharding(param.grad, self.mesh, spec)

    def batches(self, iterable):
        kw = {}
        if self.spmd:
            kw["input_sharding"] = self.xs.ShardingSpec(self.mesh, (("data", "fsdp"), None))
        return _DeviceBatches(iterable, self.device, **kw)

    def close_batches(self, batches) -> None:
        batches.close()

    # -- the step ----------------------------------------------------------------------------
    def reduce_gradients(self, optimizer) -> None:
        if not self.spmd and self.world_size > 1:
            xm.reduce_gradients(optimizer)

    def sync(self) -> None:
        torch_xla.sync()

    def mean_across(self, t: torch.Tensor) -> torch.Tensor:
        if self.spmd or self.world_size == 1:
            return t
        return xm.all_reduce(xm.REDUCE_SUM, t, scale=1.0 / self.world_size)

    def on_host(self, fn: Callable[[dict], None], tensors: dict) -> None:
        def closure(values):
            fn({k: float(v.cpu()) for k, v in values.items()})
        xm.add_step_closure(closure, args=(tensors,))

    def any_process(self, flag: bool) -> bool:
        if self.spmd or self.world_size == 1:
            return flag
        return bool(xm.mesh_reduce("nash_mhc_flag", int(flag), max))

    def barrier(self) -> None:
        if not self.spmd and self.world_size > 1:
            xm.rendezvous("nash_mhc_barrier")

    # -- checkpoints -------------------------------------------------------------------------
    def model_state(self, model: nn.Module) -> dict:
        # Device tensors: xm.save moves them to the host on the writing process only. In SPMD
        # a sharded tensor comes back whole, so the file is consolidated and loads in train.py.
        return {k: v.detach() for k, v in self.unwrap(model).state_dict().items()}

    def optimizer_state(self, optimizer) -> dict:
        return optimizer.state_dict()

    def load_optimizer_state(self, optimizer, state: dict) -> None:
        load_optimizer_state(optimizer, state)
        self.prepare_optimizer(optimizer)  # loaded state arrives unsharded: shard it again

    def save(self, obj: dict, path: Path) -> None:
        """Every process calls xm.save (a collective); the global master writes a temporary
        file, which it then fsyncs and renames."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
        xm.save(obj, str(tmp), master_only=True, global_master=True)
        if self.is_master:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
            fsync_dir(path.parent)
        self.barrier()

    # -- reporting ---------------------------------------------------------------------------
    def device_name(self) -> str:
        kind = xr.device_type() or "XLA"
        try:
            attrs = xm.get_device_attributes() if hasattr(xm, "get_device_attributes") else {}
        except Exception:
            attrs = {}
        desc = attrs.get("device_kind") if isinstance(attrs, dict) else None
        mode = f"spmd mesh {tuple(self.mesh.mesh_shape)}" if self.spmd else "ddp"
        return f"{desc or kind} ({self.n_devices} device(s), {mode})"

    def peak_flops(self) -> float | None:
        if xr.device_type() == "TPU":
            return peak_flops_for(f"TPU {self.device_name()}")
        return None

    def log_extras(self) -> dict:
        c = xla_counters()
        return {"xla_compilations": c["compilations"], "xla_cpu_fallbacks": c["cpu_fallbacks"],
                "xla_transfers": c["device_to_host_transfers"]}

    def finish(self, run_dir: Path, log: Callable[[str], None]) -> None:
        torch_xla.sync()
        c = xla_counters()
        if self.is_master:
            run_dir = Path(run_dir)
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "xla_metrics.json").write_text(json.dumps(c, indent=2) + "\n")
            (run_dir / "xla_metrics_report.txt").write_text(met.metrics_report())
        log(f"xla: {c['compilations']} compilations, {c['cpu_fallbacks']} CPU fallbacks "
            f"({', '.join(c['fallback_ops']) or 'none'}), {c['device_to_host_transfers']} "
            f"device-to-host transfers; details in {Path(run_dir) / 'xla_metrics.json'}")
