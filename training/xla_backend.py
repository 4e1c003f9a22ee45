"""The PyTorch/XLA backend: the only module that imports ``torch_xla``.

Two modes (``xla.mode``):

- ``ddp``: one process per TPU core/chip (``xmp.spawn``), each with its own replica of the model;
  ``DistributedSampler`` shards, ``MpDeviceLoader`` uploads, ``xm.reduce_gradients`` all-reduces,
  then the *reduced* gradient is clipped and the optimiser steps.
- ``spmd``: one process drives every device through a ``data x fsdp x tp`` mesh. Parameters are
  sharded FSDP-style over ``fsdp`` and tensor-parallel over ``tp``; the batch is sharded over
  ``data`` and ``fsdp``; XLA's SPMD partitioner inserts the collectives. ``batch_size`` is global.

Every step traces two graphs whatever the accumulation and the log interval (the micro-step and
the update); the device loader's sync ends each micro-step. A log line's values reach the host as
one vector, copied with ``.cpu()`` (one transfer, never ``.item()``, which would show up as an
``aten::`` fallback) in an asynchronous step closure: the loop does not wait for it.

Several processes (SPMD over hosts, or ddp with one process per chip) join ONE gloo process group
with ``init_method='xla://'`` (rank = host in SPMD, = ordinal in ddp). Everything the processes
decide together goes through it, host-side (``training.distributed.HostGroup``: no device sync,
no rendezvous): the set-up checks (the mesh, the SPMD batch, the data and the config every host
has: ``training.launch``) refuse a launch with one line before anything compiles; stop after
SIGTERM or non-finite steps is decided about once a second and at log steps
(``loop.decision_interval``). SPMD checkpoints are DCP directories written with torch_xla's
``SPMDSavePlanner`` over a second gloo group (the writer thread's): each host writes only its own
shards (a shard several hosts hold, once, by one of them: ``balanced_save_planner``), nothing is
gathered. ddp checkpoints are single files by the master.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import json
import os
import re
import threading
import warnings
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
from torch.nn import functional as F

from .backend import Backend
from .checkpoint import optimizer_state_by_name, parameter_names
from .config import ConfigError, check_xla
from .distributed import HostGroup, group_timeout, init_gloo, new_gloo_group
from .monitor import peak_flops_for
from .optim import AdamW, Muon
from .sharding import BATCH, activation_partition_spec, param_partition_spec, state_partition_spec


class XLAAdamW(AdamW):
    """training.optim's AdamW (same state layout, same sync-free skip) whose update is torch_xla's
    fused AdamW op (``_xla_adam_optimizer_step_``, what ``torch_xla.amp.syncfree.AdamW`` calls):
    one traced node per parameter instead of ~25 tensor ops, several of which (``lerp_``,
    ``addcmul_``, ``sqrt_``) torch_xla traces through PyTorch's Python decompositions. Tracing the
    update is host time on every step: 222 -> 8.6 ms for the demo model's 85 parameters on PJRT
    CPU (``bench/xla.py optimizer configs/demo.yaml``). The op is torch.optim.AdamW's formula
    (``sqrt(v) / sqrt(1 - beta2^t) + eps``, decoupled decay), skips the update and the state where
    ``found_inf`` is not 0, and takes ``lr`` as device data, so a new learning rate is not a new
    graph. Parameters that are not fp32 (the op computes in the parameter's dtype), or a tensor
    ``lr``, take the tensor-op update."""

    def _adamw_step(self, group, ps, found_inf) -> None:
        lr = group["lr"]
        if isinstance(lr, torch.Tensor) or any(p.dtype != torch.float32 for p in ps):
            return super()._adamw_step(group, ps, found_inf)
        beta1, beta2 = group["betas"]
        no_amsgrad = torch.empty(0, device=ps[0].device)
        for p in ps:
            st = self._state(p, group)
            torch_xla._XLAC._xla_adam_optimizer_step_(
                found_inf, st["step"], p, p.grad, st["exp_avg"], st["exp_avg_sq"], no_amsgrad,
                beta1, beta2, lr, group["weight_decay"], group["eps"], False, False, True)


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


def balanced_save_planner():
    """torch_xla's ``SPMDSavePlanner`` whose shards held by several hosts (the parameters, with
    ``data`` across hosts; the optimiser state too without ``shard_optimizer_over_data``) are
    written by one of them each, spread by size (torch's ``dedup_save_plans``). torch_xla 2.9's own
    dedup gives every such shard to the first plan: host 0 wrote all of them (a whole copy of the
    parameters), and the save took as long as host 0's share. Once deduplicated here, its dedup finds
    nothing more to do."""
    import torch_xla.experimental.distributed_checkpoint as xc
    from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans

    class BalancedSPMDSavePlanner(xc.SPMDSavePlanner):
        def create_global_plan(self, all_plans):
            return super().create_global_plan(dedup_save_plans(all_plans))

    return BalancedSPMDSavePlanner()


def build_mesh(m) -> "xs.Mesh":
    """The SPMD ``data x fsdp x tp`` mesh of ``xla.mesh`` over every device of the job.

    On TPU the devices are laid out by the physical topology (torch_xla's ``HybridMesh``; the
    data axis spans ``dcn_data`` slices over the data-center network), so each ``tp`` group is a
    set of neighbouring chips; it is then checked to lie within one host. Elsewhere (PJRT CPU,
    GPU) devices follow runtime ordinals. Every error is one line naming the key.
    """
    import torch_xla.distributed.spmd as xs

    n = xr.global_runtime_device_count()   # = data x fsdp x tp (config.check_xla)
    axes, shape = ("data", "fsdp", "tp"), (m.data, m.fsdp, m.tp)
    if xr.device_type() != "TPU":
        if m.dcn_data > 1:
            raise ConfigError(f"xla.mesh.dcn_data={m.dcn_data}: multi-slice meshes need TPU slices "
                              f"(the devices here are {xr.device_type()})")
        return xs.Mesh(np.arange(n), shape, axes)
    slices = len({a.get("slice_index", 0) for a in xr.global_runtime_device_attributes()})
    if slices != m.dcn_data:
        raise ConfigError(f"xla.mesh.dcn_data={m.dcn_data}, but this job runs on {slices} TPU slice(s)")
    ici = (m.data // m.dcn_data, m.fsdp, m.tp)
    try:
        mesh = xs.HybridMesh(ici_mesh_shape=ici, axis_names=axes,
                             dcn_mesh_shape=(m.dcn_data, 1, 1) if m.dcn_data > 1 else None)
    except (ValueError, NotImplementedError, AssertionError) as e:
        raise ConfigError(f"xla.mesh: the per-slice mesh data x fsdp x tp = {ici[0]} x {ici[1]} x "
                          f"{ici[2]} does not fit the slice's chip topology "
                          f"({' '.join(str(e).split())})") from None
    return mesh


def tp_problem(mesh, m) -> str:
    """This host's part of the check that every ``tp`` group lies within one host ("" if it
    does; on TPU only). Each host sees its own devices, so the hosts decide together."""
    if mesh is None or m.tp == 1 or xr.device_type() != "TPU":
        return ""
    local = {int(d.split(":")[-1]) for d in torch_xla._XLAC._xla_get_runtime_devices()}
    split = tp_groups_across_hosts(mesh.get_logical_mesh(), local)
    if not split:
        return ""
    return (f"xla.mesh.tp={m.tp}: the tensor-parallel group of devices {split[0]} spans hosts "
            f"({len(local)} devices per host); keep tp within one host")


def tp_groups_across_hosts(device_mesh: np.ndarray, local: set[int]) -> list[list[int]]:
    """The tensor-parallel groups (the mesh's last axis) that mix this host's devices (``local``)
    with other hosts': every host checks its own, so together they check every group."""
    groups = np.asarray(device_mesh).reshape(-1, np.asarray(device_mesh).shape[-1]).tolist()
    return [g for g in groups if 0 < sum(d in local for d in g) < len(g)]


def jax_usable() -> bool:
    """Whether torch_xla can call into JAX here (jax and torchax import). torch_xla's scan needs
    it in SPMD: 2.9 shards the scan's backward like its forward with jax's shard_alike
    (``scan.py``, through ``xb.call_jax``). A package that is found but does not import (a
    torchax build that wants flax: torch_xla 2.9's own copy) counts as absent, as torch_xla itself
    counts it."""
    from torch_xla._internal.jax_workarounds import maybe_get_jax, maybe_get_torchax
    return maybe_get_jax(log=False) is not None and maybe_get_torchax() is not None


def scan_problem(cfg) -> str:
    """xla.scan_layers in SPMD needs JAX (``jax_usable``)."""
    if not cfg.xla.scan_layers or jax_usable():
        return ""
    return ("xla.scan_layers=true in xla.mode=spmd needs JAX and torchax (torch_xla's scan shards "
            "its backward with jax): pip install 'torch_xla[pallas]==2.9.0', then pip install --no-deps "
            "--force-reinstall torchax==0.0.7, or set "
            "xla.scan_layers=false")


def _recompute_all_partition(joint_module, joint_inputs, *, num_fwd_outputs, **kw):
    """A ``scan`` partition with torch.utils.checkpoint's policy: the forward keeps only the
    layer's inputs for the backward, which recomputes everything else. Every forward op is tagged
    MUST_RECOMPUTE for AOTAutograd's min-cut partitioner, which then can save nothing but the
    inputs (the residual carried into the layer and the layer's parameter slices)."""
    from functorch.compile import min_cut_rematerialization_partition
    from torch.utils.checkpoint import CheckpointPolicy

    for node in joint_module.graph.nodes:
        if node.op == "call_function" and "recompute" not in node.meta:
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            node.meta["ac_graph_id"] = 0  # one checkpointed region: the whole layer
    return min_cut_rematerialization_partition(joint_module, joint_inputs,
                                               num_fwd_outputs=num_fwd_outputs, **kw)


class ScanBlocks:
    """``NashMHC.blocks_fn`` for ``xla.scan_layers``: the blocks run as one XLA While loop whose
    body is one block, so the compiled graph (and its compile time) does not grow with depth.

    This is what torch_xla's ``scan_layers`` does (stack every block's parameters, call the first
    block on each slice with ``torch.func.functional_call``, ``scan`` over the slices), written
    against ``scan`` itself because a Block is not a carry-to-carry layer: it also takes the
    rotary tables and the attention masks, which travel as per-layer inputs that are not
    differentiated (in the carry they would be), and it returns detached stats, which are summed
    in the carry (``scan``'s stacked outputs must be differentiable). The scanned function is
    cached per train/eval mode, checkpointing, grad and autocast state, so ``scan``'s trace cache
    never mixes them.
    """

    def __init__(self, n_stats: int):
        self.n_stats = n_stats  # length of the stats vector each block returns
        self._fns: dict[tuple, Callable] = {}

    def _layer_fn(self, block: nn.Module, checkpoint: bool) -> Callable:
        key = (id(block), block.training, checkpoint, torch.is_grad_enabled(),
               torch.is_autocast_enabled("xla"), torch.get_autocast_dtype("xla"))
        fn = self._fns.get(key)
        if fn is None:
            with_stats = self.n_stats > 0

            def fn(carry, x):
                h, total = carry if with_stats else (carry, None)
                weights, cos, sin, masks = x
                h, stats = torch.func.functional_call(block, weights, (h, cos, sin, masks), strict=True)
                return ((h, total + stats) if with_stats else h), None

            self._fns[key] = fn
        return fn

    def __call__(self, blocks, h, cos, sin, masks, checkpoint: bool):
        from functorch.compile import default_partition
        from torch_xla.experimental.scan import scan

        n = len(blocks)
        per_block = [dict(itertools.chain(b.named_parameters(), b.named_buffers())) for b in blocks]
        weights = {k: torch.stack([w[k] for w in per_block]) for k in per_block[0]}
        xs = (weights, *(x.expand(n, *x.shape) for x in (cos, sin)),
              {k: m.expand(n, *m.shape) for k, m in masks.items()})
        carry = (h, h.new_zeros(self.n_stats, dtype=torch.float32)) if self.n_stats else h
        partition = _recompute_all_partition if checkpoint else default_partition
        carry, _ = scan(self._layer_fn(blocks[0], checkpoint), carry, xs, partition_fn=partition,
                        is_fn_pure=True)
        if not self.n_stats:
            return carry, h.new_zeros(0, dtype=torch.float32)
        return carry[0], carry[1] / n


# Shardings by key, for ``_annotated``: torch_xla's ``mark_sharding_with_gradients`` passes its
# mesh as a string and rebuilds it at every call, and each rebuilt mesh stays in
# ``Mesh.get_op_sharding``'s unbounded lru_cache (torch_xla 2.9): a new entry per annotation and
# step, thousands per step at the 3B config. Keyed here, every call reuses the backend's mesh.
_SHARDINGS: dict[str, tuple] = {}


def _sharding_key(mesh, spec: tuple) -> str:
    key = f"{id(mesh)}:{spec}"
    _SHARDINGS.setdefault(key, (mesh, spec))
    return key


@torch.library.custom_op("nash_mhc::annotated", mutates_args=())
def _annotated(t: torch.Tensor, key: str, grad_key: str) -> torch.Tensor:
    """``t`` annotated with the sharding ``_SHARDINGS[key]`` for XLA's partitioner, and its
    gradient with ``_SHARDINGS[grad_key]``. A custom op, as torch_xla's ``_aot_mark_sharding``,
    so that scan's AOTAutograd trace keeps it."""
    import torch_xla.distributed.spmd as xs

    mesh, spec = _SHARDINGS[key]
    return xs.annotate_custom_sharding(t.clone(), mesh, spec).global_tensor


@_annotated.register_fake
def _(t, key, grad_key):
    return torch.empty_like(t)


def _annotated_setup(ctx, inputs, output):
    ctx.grad_key = inputs[2]


_annotated.register_autograd(lambda ctx, g: (_annotated(g, ctx.grad_key, ctx.grad_key), None, None),
                             setup_context=_annotated_setup)


class _WholeTableEmbedding(nn.Embedding):
    """An SPMD embedding (``XLABackend._shard_activations``, with ZeRO-2) whose lookup reads the
    whole table, gathered over the mesh as FSDP gathers any weight, and whose table gradient is
    annotated with the table's own split: each device scatters its own tokens' gradient rows into
    a table of partial sums, which XLA reduces onto that split. Left to GSPMD, with ZeRO-2's
    gradient split over data x fsdp (``_shard_grad``), the scatter followed that split by
    vocabulary rows and gathered every token's id and gradient row onto every device: the global
    batch x d_model per step (tests/test_xla_at_scale.py). The cost: one whole fp32 table of
    partial gradient sums per device, reduced each micro-step."""

    table_keys: tuple[str, str]      # ``_annotated``'s keys: the table replicated; its own split

    def forward(self, ids):
        table = _annotated(self.weight, *self.table_keys)
        return F.embedding(ids, table, self.padding_idx, self.max_norm, self.norm_type,
                           self.scale_grad_by_freq, self.sparse)


class SinkhornLoop:
    """``HyperConnection.sinkhorn_iterate`` on XLA: Sinkhorn-Knopp's ``iters`` rounds of row then
    column normalisation as one XLA While loop, and its backward as a second one, where the
    model's own form is 2 x ``iters`` unrolled normalisations and as many backward steps.

    The maths and the backward of ``model._SinkhornIterations``: each step is ``q = p / s`` with
    ``s = sum(p) + eps`` over the normalised dim; the forward loop keeps only the normalisers
    ``s`` (``[iters, n, 1, N]`` and ``[iters, 1, n, N]``) and the result, and the backward loop
    walks the steps in reverse, ``g <- (g - sum(g * q)) / s`` and ``q <- q * s`` (undoing the
    division recovers each step's ``q``). torch_xla's ``scan`` would differentiate one round
    with AOTAutograd instead, which keeps every round's input and output (5x the memory of the
    normalisers) and, in SPMD, needs JAX to shard that backward. Both loops here are torch_xla's
    scan loop without its autograd (``scan._scan_impl_pytree``, torch_xla 2.9), so neither needs
    JAX and the loop runs in every mode. tests/test_model_xla.py compares it with the eager form.
    """

    _bodies: dict[float, tuple[Callable, Callable]] = {}

    def __call__(self, p: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
        return _SinkhornScan.apply(p, iters, eps)

    @classmethod
    def bodies(cls, eps: float) -> tuple[Callable, Callable]:
        """The loop bodies for ``eps``, made once (``_scan_impl_pytree`` lowers them again at every
        call, two per hyper-connection per step; the step's graph is compiled once all the same)."""
        if eps not in cls._bodies:

            def forward(q, _):                     # q [n, n, N], rows on dim 1
                rows = q.sum(dim=1, keepdim=True) + eps
                q = q / rows
                cols = q.sum(dim=0, keepdim=True) + eps
                return q / cols, (rows, cols)

            def backward(carry, norms):            # one round, last step first
                (q, g), (rows, cols) = carry, norms
                g = (g - (g * q).sum(dim=0, keepdim=True)) / cols
                q = q * cols
                g = (g - (g * q).sum(dim=1, keepdim=True)) / rows
                return (q * rows, g), None

            cls._bodies[eps] = (forward, backward)
        return cls._bodies[eps]


class _SinkhornScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, p, iters: int, eps: float):
        from torch_xla.experimental.scan import _scan_impl_pytree

        forward, _ = SinkhornLoop.bodies(eps)
        q, (rows, cols) = _scan_impl_pytree(forward, p, p.new_zeros(iters))
        ctx.eps = eps
        ctx.save_for_backward(q, rows, cols)
        return q

    @staticmethod
    def backward(ctx, g):
        from torch_xla.experimental.scan import _scan_impl_pytree

        q, rows, cols = ctx.saved_tensors
        _, backward = SinkhornLoop.bodies(ctx.eps)
        (_, g), _ = _scan_impl_pytree(backward, (q, g), (rows, cols), reverse=True)
        return g, None, None


class _DeviceBatches:
    """Batches uploaded to the device by a background thread: torch_xla's ``ParallelLoader``, as
    ``MpDeviceLoader`` uses it, with a ``close`` that stops the prefetching.

    The host batches are read in the loader's thread (up to ~24 ahead), where a ``ConfigError``
    of the stream (a token id past the vocabulary) would end the thread and the stream with a
    traceback. It is kept instead with the place of the batch it spoiled (``_standing_in``), and
    raised here, on the training thread, when that place comes up, in place of its stand-in: the
    loop then skips that step on every process and agrees on the stop (``Trainer.train_step``), as
    with the torch backends' batches. (Raised at the next call, it came ~20 batches early and took
    a good batch with it, and the stand-in was later trained on as if it were that batch.)"""

    def __init__(self, iterable, device, **kw):
        self._errors: list = []      # (place, error), appended by the loader's thread
        self._taken = 0
        self._loader = pl.ParallelLoader(_standing_in(iterable, self._errors), [device], **kw)
        self._it = self._loader.per_device_loader(device)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            batch = next(self._it)
        except StopIteration:
            if self._errors:   # the stream ended at an error with nothing to stand in for it
                raise self._errors.pop(0)[1] from None
            raise
        place, self._taken = self._taken, self._taken + 1
        if self._errors and self._errors[0][0] == place:   # recorded before its stand-in was queued
            raise self._errors.pop(0)[1]
        return batch

    def close(self) -> None:
        self._loader.close()


def _standing_in(iterable, errors: list):
    """``iterable``'s batches; one it refuses with a ``ConfigError`` is recorded in ``errors`` as
    ``(its place, the error)`` and replaced by the batch before it (or the stream's
    ``placeholder()``), so the device batches keep their count, shapes and input sharding."""
    it, last = iter(iterable), None
    for place in itertools.count():
        try:
            batch = next(it)
        except StopIteration:
            return
        except ConfigError as e:
            errors.append((place, e))
            if last is None and not hasattr(iterable, "placeholder"):
                return
            batch = last if last is not None else iterable.placeholder()
        last = batch
        yield batch


def tpu_master_address(spmd: bool) -> str:
    """The address of process 0's TPU host, as torch_xla's ``xla://`` rendezvous finds it: the TPU
    metadata server's list of this slice's workers, and in SPMD an all-gather of every process's
    address over the devices (TPU device ids do not follow worker ids). torch_xla 2.9 skips that
    gather when this slice has one worker and answers "localhost": on a multi-slice job of
    one-host slices (2 x v6e-8) every other host then waited for a store on its own machine for
    ``training.dist_timeout_s``. There the gather is made with this host's address from the
    metadata server (GKE, whose environment stands in for it, runs multi-slice on multi-host
    slices only: torch_xla's answer stands there)."""
    from torch_xla._internal import tpu
    if not (spmd and xr.process_count() > 1 and len(tpu.get_worker_ips()) == 1) or tpu._using_env_vars():
        return tpu.discover_master_worker_ip()
    own = tpu._get_metadata("worker-network-endpoints").split(",")[0].split(":")[2]  # "hostname:uid:ip"
    return tpu._spmd_find_master_ip(own)


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
            self.world_size, self.rank, self.is_master = 1, 0, xr.process_index() == 0
            m = cfg.xla.mesh
            self.batch_split = f"data {m.data} x fsdp {m.fsdp}"
        else:
            self.world_size = xr.world_size()
            self.rank = xr.global_ordinal()
            self.is_master = self.rank == 0  # the global master: one writer across hosts
        # One gloo group over every process (world = hosts in SPMD, ordinals in ddp; its TCP store
        # is on host 0: MASTER_ADDR or the TPU metadata, MASTER_PORT, default 12355), made once:
        # the launch checks, the loop's decisions and checkpoint I/O all go through it.
        self.processes = xr.process_count() if self.spmd else self.world_size
        # The checks with the devices. With several processes a failure is this process's
        # problem in the launch agreement below, not a raise: a host that ended here would leave
        # the others waiting for it in the group's rendezvous (gloo's 30 minutes).
        problem = ""
        try:
            # train_xla.py's launcher checked the config alone before spawning; here with the devices
            check_xla(cfg, xr.global_runtime_device_count() if self.spmd else None)
            if self.spmd:
                import torch_xla.distributed.spmd as xs
                self.xs = xs
                self.mesh = build_mesh(cfg.xla.mesh)
                problem = tp_problem(self.mesh, cfg.xla.mesh) or scan_problem(cfg)
        except ConfigError as e:
            if self.processes == 1:
                raise
            problem = str(e)
        if not self.spmd and self.processes > 1 and xr.addressable_runtime_device_count() > 1:
            # xmp.spawn runs the replicas of a process with several devices (PJRT CPU with
            # CPU_NUM_DEVICES > 1, TPU v2/v3 cores) as threads of it: every thread would make the
            # gloo group below in one process, and they deadlock there for ever
            raise ConfigError(f"xla.mode=ddp: each process here has {xr.addressable_runtime_device_count()} "
                              f"{xr.device_type()} devices, whose replicas torch_xla runs as threads of one "
                              "process, which ddp mode does not support: use xla.mode=spmd (one process "
                              "over every device) or xla.nprocs=1")
        if self.processes > 1:
            import torch.distributed as dist
            from torch_xla.distributed import xla_backend as _xla_pg  # noqa: F401  (registers xla://)
            self.made_group = not dist.is_initialized()  # a caller's group stays the caller's
            self._host_rendezvous(cfg.training.dist_timeout_s)
            self.host = HostGroup(new_gloo_group(cfg.training.dist_timeout_s))
            self.ckpt_group = new_gloo_group(cfg.training.dist_timeout_s)  # the checkpoint writer's thread has its own
        self.checkpoint_format = "dcp" if self.spmd else "file"
        # Several processes (hosts, or chips in ddp mode) decide about once a second and at log
        # steps (loop.decision_interval): a per-step gloo all-reduce across a pod would cost
        # milliseconds and hold the hosts, which trace ahead of the device, in step every step.
        # One process looks after every step.
        self.decides_every_step = self.processes == 1
        # Before anything compiles: every process's data, config and problems, decided together
        # (training.launch); all refuse with the same one-line error, or none does. No backend is
        # returned then, for the caller to shut down: its groups are destroyed here.
        try:
            self.agree_at_launch(cfg, problem)
        except BaseException:
            self.shutdown()
            raise
        self._specs: dict[int, tuple] = {}
        self._grad_hooks: dict[int, object] = {}
        # Log lines run in torch_xla's asynchronous step closures; wait_host() waits for them.
        self._host_pending = 0
        self._host_done = threading.Condition()
        self._host_error: BaseException | None = None

    def _host_rendezvous(self, timeout_s: float | None) -> None:
        """The gloo group's rendezvous: torch_xla's ``xla://`` one (TCP store on host 0: MASTER_ADDR,
        or on TPU the first worker from the metadata server; MASTER_PORT, default 12355; rank =
        host in SPMD, ordinal in ddp), with the store made here, because torch_xla 2.9's handler
        makes it without the timeout it is given: hosts that started over 5 minutes apart always
        failed (torch's TCPStore default), whatever ``training.dist_timeout_s`` said, with a
        DistStoreError traceback. The handler's other stores (torchelastic's agent store, the
        dummy store) are left to it."""
        import torch.distributed as dist
        if dist.is_initialized():
            return
        env = os.environ
        if dist.is_torchelastic_launched() or env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" or (
                env.get("TORCH_DIST_INIT_BARRIER") == "0" and env.get("XLA_USE_DUMMY_STORE") == "1"):
            init_gloo("xla://", timeout_s)
            return
        host = env.get("MASTER_ADDR") or (tpu_master_address(self.spmd) if xr.device_type() == "TPU"
                                          else "localhost")
        port_text = env.get("MASTER_PORT") or "12355"
        if not (port_text.isdigit() and 0 < int(port_text) < 65536):
            raise ConfigError(f"MASTER_PORT={port_text!r} in the environment: expected a port number, "
                              "1 to 65535")
        port = int(port_text)
        timeout = group_timeout(timeout_s) or dist.constants.default_pg_timeout   # gloo's 30 minutes
        rank, world = (xr.process_index(), xr.process_count()) if self.spmd else (self.rank, self.world_size)
        try:
            store = dist.TCPStore(host, port, xr.process_count(), is_master=xr.process_index() == 0,
                                  timeout=timeout)
            init_gloo("", timeout_s, store=store, rank=rank, world_size=world)
        except (dist.DistError, RuntimeError) as e:
            why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(f"the hosts' rendezvous at {host}:{port} (MASTER_ADDR:MASTER_PORT) failed after "
                              f"{timeout.total_seconds():.0f} s ({why}): every host must start within "
                              "training.dist_timeout_s of host 0, which must be reachable") from None

    def _init_cache(self, cache: str | None) -> None:
        if not cache:
            return
        if xr.device_type() == "CPU":
            # PJRT CPU cannot deserialise executables: a cache would only add a warning per graph.
            return
        # one directory per process: hosts whose cache is on shared storage never write the
        # same entries at once (a SPMD process per host, a ddp process per chip)
        if re.match(r"[A-Za-z][A-Za-z0-9+.-]*://", cache):
            # Path("gs://b/c") is the relative gs:/b/c: each host would cache in its own working
            # directory while the user believed the cache shared
            warnings.warn(f"xla.compile_cache={cache}: a URL, where torch_xla's cache is a directory "
                          "(a local disk, or a bucket mounted with gcsfuse); compiling without a "
                          "persistent cache")
            return
        sub = f"spmd_{xr.process_index()}" if self.spmd else f"ordinal_{xr.global_ordinal()}"
        path = Path(cache).expanduser() / sub
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            # before the hosts can agree on anything (this runs before the gloo group): an
            # optimisation that cannot be had is a warning, not a stop on this host alone
            warnings.warn(f"xla.compile_cache={cache}: cannot create {path} ({e.strerror or e}); "
                          "compiling without a persistent cache")
            return
        try:
            xr.initialize_cache(str(path), readonly=False)
        except AssertionError as e:  # torch_xla 2.9 asserts: already initialised (tests, notebooks)
            if "already" not in str(e).lower():
                raise

    # -- set-up ------------------------------------------------------------------------------
    def prepare_model(self, model: nn.Module, cfg) -> nn.Module:
        if cfg.model.activation_checkpointing or cfg.model.loss_chunk:
            # torch.utils.checkpoint looks for a torch.xla device module, which does not exist:
            # torch_xla's checkpoint for the blocks and for the cross-entropy chunks.
            import torch_xla.utils.checkpoint as xcp
            model.checkpoint_fn = xcp.checkpoint
        if cfg.xla.scan_layers:
            model.blocks_fn = ScanBlocks(len(model.stat_names))
        else:
            # Sinkhorn as one loop; not in a scanned block (the layer's graph exists once there already)
            loop = SinkhornLoop()
            for m in model.modules():
                if hasattr(m, "sinkhorn_iterate"):
                    m.sinkhorn_iterate = loop
        model = model.to(self.device)  # NashMHC._apply re-ties the embedding and LM head on XLA
        assert not cfg.model.tie_embeddings or model.lm_head.weight is model.tok_emb.weight
        if self.spmd:
            for name, p in model.named_parameters():
                spec = param_partition_spec(name, p)
                if spec is not None and id(p) not in self._specs:
                    self.xs.mark_sharding(p, self.mesh, spec)
                    self._specs[id(p)] = spec
            self._shard_activations(model)
        return model

    def _shard_activations(self, model: nn.Module) -> None:
        """Constrain the activations into and out of every Linear (mHC's projections too), out of
        the embedding, into and out of every block, and mHC's coefficient logits to the batch's
        sharding, forward and backward (``activation_partition_spec``, ``_annotated``), and with
        ZeRO-2 look tokens up in the embedding's whole table (``_WholeTableEmbedding``).
        bench/optimizer.py ``--only activations`` (data 2 x fsdp 2) and ``--only tp``: see the
        README's "Compilation and host syncs on XLA"."""
        keys: dict[tuple, str] = {}   # traced every step: the spec and its key worked out once

        def constrain(t: torch.Tensor, module: str, output: bool) -> torch.Tensor:
            at = (module, t.ndim, output)
            if at not in keys:
                keys[at] = _sharding_key(self.mesh, activation_partition_spec(module, t.ndim, output))
            return _annotated(t, keys[at], keys[at])

        for name, m in model.named_modules():
            module = name.rsplit(".", 1)[-1]
            if type(m) is nn.Embedding and id(m.weight) in self._specs and self._over_data:
                m.__class__ = _WholeTableEmbedding      # its forward only (FSDP2's fully_shard swaps classes too)
                m.table_keys = (_sharding_key(self.mesh, (None,) * m.weight.ndim),
                                _sharding_key(self.mesh, self._specs[id(m.weight)]))
            if isinstance(m, nn.Linear):
                m.register_forward_pre_hook(
                    lambda _, args, module=module: (constrain(args[0], module, False), *args[1:]))
            if isinstance(m, (nn.Linear, nn.Embedding)):
                m.register_forward_hook(lambda _, args, out, module=module: constrain(out, module, True))
            if hasattr(m, "annotate_logits"):   # mHC's coefficients (model.HyperConnection)
                m.annotate_logits = lambda t: constrain(t, "", True)
        for block in getattr(model, "blocks", ()):
            block.register_forward_pre_hook(lambda _, args: (constrain(args[0], "", False), *args[1:]))
            block.register_forward_hook(lambda _, args, out: (constrain(out[0], "", True), *out[1:]))

    def adamw_factory(self):
        return XLAAdamW

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """SPMD: shard the optimiser state and the gradients like their parameter (FSDP), and
        with ``xla.shard_optimizer_over_data`` over data x fsdp (ZeRO-2); replicated parameters'
        gradients whole; Muon orthogonalises whole matrices
        (``_lay_out_by_matrix``)."""
        if not self.spmd:
            return
        if isinstance(optimizer, Muon):
            optimizer.lay_out_by_matrix = self._lay_out_by_matrix
        for group in optimizer.param_groups:
            for p in group["params"]:
                spec = self._state_spec(p)
                for v in optimizer.state[p].values():
                    if torch.is_tensor(v) and v.shape == p.shape and v.device == p.device and v.ndim:
                        self.xs.mark_sharding(v, self.mesh, spec)
                if p.ndim and id(p) not in self._grad_hooks:
                    # Annotate each gradient as autograd stores it, like its optimiser state. A
                    # sharded weight's: XLA reduce-scatters it (over data x fsdp with ZeRO-2) and it
                    # stays sharded between accumulation micro-steps; left to GSPMD's propagation
                    # since the activations are annotated, every one came out whole on each device
                    # (fsdp 4: 4x the gradient memory, an all-reduce instead of a reduce-scatter).
                    # A replicated parameter's (gates, norms, biases, per-head temperatures):
                    # whole, one all-reduce; left to GSPMD, some came out split (log_tau by heads
                    # over tp) and the update gathered each.
                    self._grad_hooks[id(p)] = p.register_post_accumulate_grad_hook(
                        functools.partial(self._shard_grad, spec=spec))

    @property
    def _over_data(self) -> bool:
        return self.cfg.xla.shard_optimizer_over_data and self.cfg.xla.mesh.data > 1

    def _state_spec(self, p: torch.Tensor) -> tuple:
        """The partition spec of ``p``'s gradient and optimiser state (training/sharding.py)."""
        return state_partition_spec(self._specs.get(id(p)), self._over_data) or (None,) * p.ndim

    def _lay_out_by_matrix(self, stack: torch.Tensor, params: list, back: bool = False):
        """Shard a stack ``[L, rows, cols]`` of ``params``' updates by matrix: its layer dimension
        over every mesh axis their state is sharded over, the matrices whole (Muon's Newton-Schulz;
        XLA pads L up to a multiple of the devices). Split by rows over fsdp, the matrices made XLA
        all-reduce a Gram product at each Newton-Schulz iteration (8 matrices of 512 x 256 on
        fsdp 4, the update alone: 5 all-reduces of the whole [8, 256, 256] product; by matrix, two
        all-to-alls). bench/optimizer.py --only spmd, a training step of 8 layers at d_model 512
        on fsdp 4: 386 MB of collective results per device instead of 1,273, 1.59 s instead of
        2.69 (README, "Compilation and host syncs on XLA").

        ``back``: the orthogonalised stack, returned laid out like the matrices' state (each matrix
        split as its weight's state is), in one resharding. Taken apart by matrix from the layout
        by matrix, each matrix went whole to every device first where the state is split over more
        than fsdp (ZeRO-2's data x fsdp, tp): XLA's "involuntary full rematerialization"."""
        if back:
            spec = (None, *self._state_spec(params[0]))
            return self.xs.annotate_custom_sharding(stack, self.mesh, spec).global_tensor
        used = {a for p in params for axis in self._state_spec(p) if axis
                for a in (axis if isinstance(axis, tuple) else (axis,))}
        axes = tuple(a for a in ("fsdp", "data", "tp") if a in used)   # the state's order (sharding.py)
        if axes:
            self.xs.mark_sharding(stack, self.mesh, (axes, None, None))
        return stack

    def _shard_grad(self, param: torch.Tensor, spec: tuple) -> None:
        self.xs.mark_sharding(param.grad, self.mesh, spec)

    def batches(self, iterable):
        kw = {}
        if self.spmd:
            kw["input_sharding"] = self.xs.ShardingSpec(self.mesh, (BATCH, None))
        return _DeviceBatches(iterable, self.device, **kw)

    def close_batches(self, batches) -> None:
        batches.close()

    # -- the step ----------------------------------------------------------------------------
    def keep_gradients(self, params, accumulation: int) -> bool:
        if accumulation == 1:
            return False  # gradients freed after each update: no buffer held during the forward
        for p in params:
            p.grad = torch.zeros_like(p)
            if self.spmd and id(p) in self._specs:
                self.xs.mark_sharding(p.grad, self.mesh, self._state_spec(p))
        return True

    def reduce_gradients(self, optimizer) -> None:
        if not self.spmd and self.world_size > 1:
            xm.reduce_gradients(optimizer)

    def sync(self) -> None:
        torch_xla.sync()

    def mean_across(self, t: torch.Tensor) -> torch.Tensor:
        if self.spmd or self.world_size == 1:
            return t
        return xm.all_reduce(xm.REDUCE_SUM, t, scale=1.0 / self.world_size)

    def on_host(self, fn: Callable[..., None], values: torch.Tensor, *args) -> None:
        """``fn(numbers, *args)`` in an asynchronous step closure: after the next sync, a
        background thread waits for ``values`` (one device-to-host transfer) and calls ``fn``,
        while the loop traces the next step. Closures run one at a time, in order."""
        self._raise_host_error()

        def closure(v):
            try:
                fn(v.cpu().tolist(), *args)
            except BaseException as e:  # raised in the loop's thread by the next on_host/wait_host
                self._host_error = self._host_error or e
            finally:
                with self._host_done:
                    self._host_pending -= 1
                    self._host_done.notify_all()

        with self._host_done:
            self._host_pending += 1
        xm.add_step_closure(closure, args=(values,), run_async=True)

    def wait_device(self) -> None:
        """The device's queued graphs done (XLA runs them asynchronously): evaluation's and a
        save's time is then theirs, not the step's before or after them."""
        xm.wait_device_ops()

    def wait_host(self) -> None:
        if self._host_pending:
            torch_xla.sync()  # closures start at a sync; a queued one must not wait forever
        with self._host_done:
            self._host_done.wait_for(lambda: self._host_pending == 0)
        self._raise_host_error()

    def _raise_host_error(self) -> None:
        if self._host_error is not None:
            e, self._host_error = self._host_error, None
            raise e

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
        return balanced_save_planner() if self.spmd else None

    def dcp_load_planner(self):
        import torch_xla.experimental.distributed_checkpoint as xc
        return xc.SPMDLoadPlanner() if self.spmd else None

    def load_full_state(self, model, optimizer, model_state, optim_state) -> None:
        if self.spmd:
            return self._load_full_state_by_shard(model, optimizer, model_state, optim_state)
        # copy_ into a sharded parameter keeps its sharding; the optimiser's loaded state arrives
        # as new unsharded tensors: shard it again. It must also look to the traced update as a
        # fresh run's state does, device data made on the device: torch's load_state_dict leaves
        # "step" on the CPU (the first update then moved it inside its graph) and the rest as
        # host copies, so the first update after a resume was one graph and every later one
        # another: a compilation after warm-up on every resume from a file.
        super().load_full_state(model, optimizer, model_state, optim_state)
        for group in optimizer.param_groups:
            for p in group["params"]:
                st = optimizer.state[p]
                for k, v in list(st.items()):
                    if torch.is_tensor(v):
                        st[k] = (v.to(p.device, torch.float32) if k == "step" else v.to(p.device)).clone()
        # and on the device before it is sharded: the sync returns before the copies exist, and
        # mark_sharding on one that does not yet ("Data does not present on any device") failed
        # the resume, now and then (3 in 10 on a 4-device mesh)
        torch_xla.sync()
        xm.wait_device_ops()
        self.prepare_optimizer(optimizer)

    def _load_full_state_by_shard(self, model, optimizer, model_state, optim_state) -> None:
        """SPMD: a whole CPU state (a file of train.py or of ddp mode) into the live model and
        optimiser state, which are already placed and sharded: each device receives its own shard
        of each tensor, as torch_xla's SPMDLoadPlanner loads a DCP checkpoint. ``copy_`` and
        ``load_state_dict`` upload every tensor whole to every device first (until the next sync:
        the whole fp32 model and both AdamW moments on each chip, where the 3B config keeps a
        quarter of them), and the optimiser's would also be new tensors to shard again."""
        raw = self.unwrap(model)
        torch_xla.sync()  # the fresh state as device data, whose shards' places the loads read
        xm.wait_device_ops()
        live = raw.state_dict(keep_vars=True)
        if set(live) != set(model_state):
            raise RuntimeError(f"the checkpoint's model has other tensors than this one: missing "
                               f"{sorted(set(live) - set(model_state))[:3]}, unexpected "
                               f"{sorted(set(model_state) - set(live))[:3]}")
        with torch.no_grad():
            for name, t in live.items():
                self._load_by_shard(t, model_state[name], name)
            saved = optimizer_state_by_name(raw, optimizer, optim_state)["state"]
            names = parameter_names(raw)
            for group in optimizer.param_groups:
                for p in group["params"]:
                    state, name = optimizer.state[p], names[id(p)]
                    for key, value in saved.get(name, {}).items():
                        if key not in state or not torch.is_tensor(value):
                            raise RuntimeError(f"the checkpoint's optimiser keeps {key!r} for {name}, which "
                                               "this run's does not (another training.optimizer?)")
                        self._load_by_shard(state[key], value, f"{name} ({key})")
        torch_xla.sync()
        xm.wait_device_ops()

    def _load_by_shard(self, dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
        """The CPU tensor ``src`` into the device tensor ``dst``, keeping its sharding: a sharded
        ``dst`` gets each local device's shard alone (``load_local_shards_``), a replicated one
        ``src`` whole (which it holds on every device anyway)."""
        if src.shape != dst.shape:
            raise RuntimeError(f"{name}: the checkpoint's is {tuple(src.shape)}, this model's {tuple(dst.shape)}")
        src = src.to(dst.dtype)
        if src.ndim == 0:  # a step count: one number, filled in on the device
            dst.fill_(src.item())
            return
        wrapped, xs = self.xs.wrap_if_sharded(dst), self.xs
        if not isinstance(wrapped, xs.XLAShardedTensor) or wrapped.sharding_type == xs.ShardingType.REPLICATED:
            dst.copy_(src)
            return
        shards = wrapped.local_shards  # this process's devices' shards, on the host (their old values)
        for shard in shards:
            shard.unpadded_data = src[tuple(shard.indices)]
        wrapped.load_local_shards_(shards)

    def load_sharded_state(self, model, optimizer, path, param_groups, reader) -> None:
        """SPMDLoadPlanner loads each process's shards in place, into the parameters and the
        optimiser state already placed and sharded for this mesh (any mesh: DCP reshards)."""
        # Materialise the freshly created optimiser state first: the planner reads each tensor's
        # shard layout from its device data (a pending zeros_like has none yet).
        torch_xla.sync()
        xm.wait_device_ops()
        self._dcp_load(model, optimizer, reader)

    # -- reporting ---------------------------------------------------------------------------
    @property
    def n_devices(self) -> int:
        return xr.global_runtime_device_count() if self.spmd else self.world_size

    @functools.cached_property
    def tpu_kind(self) -> str | None:
        """"TPU v4", "TPU v5 lite", ... (``xm.xla_device_kind``'s names); None off TPU. In SPMD the
        default device is the virtual SPMD:0, which has no kind: the slice's accelerator type
        (TPU_ACCELERATOR_TYPE or the TPU VM's metadata) names the generation instead."""
        if xr.device_type() != "TPU":
            return None
        if not self.spmd:
            return xm.xla_device_kind()
        from .plan import DEVICES, tpu_accelerator_type, tpu_generation
        accel = tpu_accelerator_type()
        kind = accel and tpu_generation(accel)
        return DEVICES[kind].name if kind else f"TPU ({accel or 'unknown accelerator type'})"

    def device_name(self) -> str:
        kind = self.tpu_kind or xr.device_type() or "XLA"
        mode = f"spmd mesh {tuple(self.mesh.mesh_shape)}" if self.spmd else "ddp"
        return f"{kind} ({self.n_devices} device(s), {mode})"

    def seed_rng(self, seed: int) -> None:
        # the XLA device's own generator (torch.manual_seed does not reach it): a host-side value
        # that the next graph takes as a parameter, as it does after every sync, so nothing recompiles
        xm.set_rng_state(seed, self.device)

    def peak_flops(self, precision: str = "bf16") -> float | None:
        """Dense bf16 peak of one chip, from the device kind ("TPU v4", "TPU v5 lite", ...)."""
        return peak_flops_for(self.tpu_kind, precision) if self.tpu_kind else None

    def log_extras(self) -> dict:
        c = xla_counters()
        return {"xla_compilations": c["compilations"], "xla_cpu_fallbacks": c["cpu_fallbacks"],
                "xla_transfers": c["device_to_host_transfers"]}

    def start_profile(self, folder: Path, name: str) -> None:
        """torch_xla's profiler (XProf): the host's tracing and compiling, and the device's
        execution (each ``torch_xla.sync`` is a StepMarker), into
        ``folder/<process>_<name>/plugins/profile/<time>/<host>.xplane.pb`` (and a
        ``.trace.json.gz``): TensorBoard's profile plugin on that directory shows it. A
        scope around a step is none here: ``torch_xla.sync`` refuses to run inside one."""
        import torch_xla.debug.profiler as xp
        who = f"process{xr.process_index()}" if self.spmd else f"rank{self.rank}"
        path = folder / f"{who}_{name}"
        xp.start_trace(str(path))
        self._profile = path

    def profile_scope(self, name: str):
        return contextlib.nullcontext()

    def stop_profile(self) -> Path:
        import torch_xla.debug.profiler as xp
        xm.wait_device_ops()  # the profiled steps' device work, queued after their sync, into the trace
        path, self._profile = self._profile, None
        xp.stop_trace()
        return path

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
