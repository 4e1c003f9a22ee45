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

Several processes (SPMD over hosts, or ddp with one process per chip) join a gloo process group
with ``init_method='xla://'`` (rank = host in SPMD, = ordinal in ddp): decisions are host-side
all-reduces on it (``Backend.any_process``), and SPMD checkpoints are DCP directories written with
torch_xla's ``SPMDSavePlanner`` over a second gloo group: each host writes only its own shards
(replicated tensors once), nothing is gathered. ddp checkpoints are single files by the master.
"""
from __future__ import annotations

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

from .backend import Backend
from .distributed import HostGroup, new_gloo_group
from .monitor import peak_flops_for
from .optim import AdamW

# Column-parallel projections (output features split over tp) and row-parallel ones (input
# features split over tp), by module name (model.py's naming contract).
COLUMN_PARALLEL = ("wq", "wk", "wv", "w1", "w3")
ROW_PARALLEL = ("wo", "w2")


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


def _one_copy_per_shard(staged):
    """Keep one copy of each shard in ``_CpuShards``. A tensor sharded over one mesh axis and
    replicated over another (``fsdp`` x ``data``) has several identical local shards; torch_xla
    2.9's ``SPMDSavePlanner`` dedups write items across *and within* a process's plan by
    (name, offset), and within one plan that removes every copy: the tensor is silently missing
    from the checkpoint. One copy per offset avoids it (other hosts' copies are still deduped)."""
    from torch.utils._pytree import tree_map_only
    from torch_xla.experimental.distributed_checkpoint._helpers import _CpuShards

    def dedup(cs):
        seen, shards = set(), []
        for sh in cs.shards:
            key = tuple((i.start, i.stop) for i in sh.indices) if isinstance(sh.indices, list) else ()
            if key not in seen:
                seen.add(key)
                shards.append(sh)
        return _CpuShards(shards=shards, global_shape=cs.global_shape)

    return tree_map_only(_CpuShards, dedup, staged)


def param_partition_spec(name: str, p: torch.Tensor) -> tuple | None:
    """The SPMD partition spec of a parameter (``None``: replicated)."""
    if p.ndim != 2:
        return None  # norms, gates, biases, scalars: tiny, replicated
    module = name.split(".")[-2] if "." in name else name
    if module in COLUMN_PARALLEL:
        return ("tp", "fsdp")
    if module in ROW_PARALLEL:
        return ("fsdp", "tp")
    return ("fsdp", None)  # embeddings, mHC projections, pooling: FSDP only


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
        # Decisions in one process are checked at log intervals too (a step closure's flags are
        # known after the log step's sync).
        self.signal_check_interval = cfg.logging.interval
        self._specs: dict[int, tuple] = {}
        self.checkpoint_format = "dcp" if self.spmd else "file"
        self.processes = xr.process_count() if self.spmd else self.world_size
        if self.processes > 1:
            import torch.distributed as dist
            from torch_xla.distributed import xla_backend  # noqa: F401  (registers xla://)
            # world = hosts (SPMD) or ordinals (ddp); the TCP store is on host 0 (MASTER_ADDR /
            # the TPU metadata), port MASTER_PORT (default 12355).
            dist.init_process_group("gloo", init_method="xla://")
            self.host = HostGroup(new_gloo_group())
            self.ckpt_group = new_gloo_group()

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
        """SPMD: create the optimiser state now, sharded like its parameter (FSDP)."""
        if not self.spmd:
            return
        for group in optimizer.param_groups:
            for p in group["params"]:
                spec = self._specs.get(id(p), (None,) * p.ndim)
                for v in optimizer.state[p].values():
                    if torch.is_tensor(v) and v.shape == p.shape and v.device == p.device and v.ndim:
                        self.xs.mark_sharding(v, self.mesh, spec)

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

    # -- checkpoints -------------------------------------------------------------------------
    def stage(self, state: dict, sharded: bool) -> dict | None:
        """Device to host, now. SPMD: each process copies only its devices' shards (torch_xla's
        ``_sharded_cpu_state_dict``, what its ``CheckpointManager.save_async`` uses); nothing is
        gathered. ddp: the master copies the whole (replicated) state; the others nothing."""
        from torch_xla.experimental.distributed_checkpoint._helpers import _sharded_cpu_state_dict
        if not sharded and not self.is_master:
            return None
        torch_xla.sync()
        xm.wait_device_ops()
        staged = _sharded_cpu_state_dict(state)
        return _one_copy_per_shard(staged) if sharded else staged

    def dcp_save_planner(self):
        import torch_xla.experimental.distributed_checkpoint as xc
        return xc.SPMDSavePlanner() if self.spmd else None

    def dcp_load_planner(self):
        import torch_xla.experimental.distributed_checkpoint as xc
        return xc.SPMDLoadPlanner() if self.spmd else None

    def load_full_state(self, model, optimizer, model_state, optim_state) -> None:
        # copy_ into a sharded parameter keeps its sharding; the optimiser's loaded state arrives
        # as new unsharded tensors: shard it again.
        super().load_full_state(model, optimizer, model_state, optim_state)
        self.prepare_optimizer(optimizer)

    def load_sharded_state(self, model, optimizer, path, param_groups, reader) -> None:
        """SPMDLoadPlanner loads each process's shards in place, into the parameters and the
        optimiser state already placed and sharded for this mesh (any mesh: DCP reshards)."""
        import warnings
        import torch.distributed.checkpoint as dcp
        # Materialise the freshly created optimiser state first: the planner reads each tensor's
        # shard layout from its device data (a pending zeros_like has none yet).
        torch_xla.sync()
        xm.wait_device_ops()
        state = self.checkpoint_state(model, optimizer)
        target = {"model": state["model"], "optimizer": {"state": state["optimizer"]["state"]}}
        with warnings.catch_warnings():  # one process: "loading in a single process" is the point
            if self.ckpt_group is None:
                warnings.simplefilter("ignore", UserWarning)
            dcp.load(target, storage_reader=reader, planner=self.dcp_load_planner(),
                     process_group=self.ckpt_group, no_dist=self.ckpt_group is None)

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

    def shutdown(self) -> None:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()

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
