"""Optimisers and the learning-rate schedule.

Every optimiser here can skip an update without a host sync: before ``step()`` the loop sets
``optimizer.found_inf`` to a 0-dim float tensor (1.0: skip this update). That is the convention of
PyTorch's fused AdamW (the attribute GradScaler uses), which we use on CPU and CUDA; ``AdamW`` below
is the same algorithm in plain tensor ops with the same state layout (``step``, ``exp_avg``,
``exp_avg_sq`` per parameter), for devices without a fused kernel (MPS; on XLA its subclass
``training.xla_backend.XLAAdamW`` runs torch_xla's fused op instead), so checkpoints move freely
between the trainers. ``Muon`` orthogonalises the momentum of 2-D hidden matrices and runs AdamW on
the rest.
"""
from __future__ import annotations

import functools
import math

import torch
from torch import nn
from torch.optim.adam import adam as torch_adam   # the functional form of torch.optim.Adam(W)


def lr_at(step: float, max_steps: float, peak: float, warmup: int, min_ratio: float,
          schedule: str = "cosine", decay_ratio: float = 0.2, decay_shape: str = "linear") -> float:
    """Linear warmup to ``peak`` over ``warmup`` steps, then the decay to ``min_ratio * peak``.

    ``cosine``: a cosine from the end of the warmup to the last step, ``max_steps - 1``: step for
    step torch's ``SequentialLR`` of ``LambdaLR((s + 1) / warmup)`` and
    ``CosineAnnealingLR(T_max=max_steps - warmup - 1, eta_min)``.
    ``wsd`` (warmup-stable-decay): the peak until the last ``decay_ratio`` of the steps (at least
    one, none in the warmup), which decay as ``decay_shape`` (linear, 1-sqrt, cosine) to the
    minimum at the last step: after the warmup (the cosine's, above; transformers' rises from
    ``min_ratio``), step for step transformers' ``get_wsd_schedule`` with one decay step fewer (it
    reaches the minimum one step past its decay). A run extended from a checkpoint of
    its stable part goes on as if the longer run had been planned.

    ``step`` counts from 0 (the first update uses ``lr_at(0)``, never 0); it may be fractional
    (``Trainer.schedule_shift``: a token budget resumed with other tokens per step); between
    warmup - 1 and warmup the rate is the peak, never above it.
    """
    if warmup > 0 and step < warmup:
        return peak * min(1.0, (step + 1) / warmup)
    if schedule == "cosine":
        progress = min(1.0, (step - warmup) / max(1, max_steps - warmup - 1))
        shape = "cosine"
    else:
        start = max(warmup, max_steps - max(1, round(decay_ratio * max_steps)))
        span = max_steps - 1 - start  # 0: the one decay step is the last, at the minimum
        progress = min(1.0, max(0.0, step - start) / span) if span > 0 else float(step >= start)
        shape = decay_shape
    factor = {"linear": lambda p: 1.0 - p, "1-sqrt": lambda p: 1.0 - math.sqrt(p),
              "cosine": lambda p: 0.5 * (1.0 + math.cos(math.pi * p))}[shape](progress)
    return peak * (min_ratio + (1.0 - min_ratio) * factor)


def split_params(model: nn.Module) -> tuple[list, list, list]:
    """(matrices, embeddings_and_head, vectors) among trainable parameters, each tied tensor once.

    Matrices (every other 2-D weight: the blocks' and the stream collapse's projection) get weight
    decay (and Muon); embeddings, the LM head, norms, biases, mHC gates and static biases and other
    scalars get none.
    """
    embed_ids = set()
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            embed_ids.add(id(module.weight))
    head = getattr(model, "lm_head", None)
    if head is not None:
        embed_ids.add(id(head.weight))
    seen, matrices, embeds, vectors = set(), [], [], []
    for _, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        if id(p) in embed_ids:
            embeds.append(p)
        elif p.ndim >= 2:
            matrices.append(p)
        else:
            vectors.append(p)
    return matrices, embeds, vectors


def _found_inf(opt: torch.optim.Optimizer, device: torch.device) -> torch.Tensor:
    f = getattr(opt, "found_inf", None)
    if f is None:
        return torch.zeros((), device=device)
    return f.to(device=device, dtype=torch.float32).reshape(())


@torch.no_grad()
def _adamw_update(params, grads, exp_avgs, exp_avg_sqs, steps, *, lr, beta1, beta2, eps,
                  weight_decay, found_inf):
    """One AdamW update in tensor ops; a no-op (state included) where ``found_inf`` is 1."""
    keep = 1.0 - found_inf
    skip = found_inf > 0
    for p, g, m, v, step in zip(params, grads, exp_avgs, exp_avg_sqs, steps):
        g = torch.where(skip, torch.zeros_like(g), g).to(m.dtype)
        step.add_(keep)
        t = step.clamp(min=1.0)
        m.lerp_(g, (1.0 - beta1) * keep)
        v.mul_(1.0 - (1.0 - beta2) * keep).addcmul_(g, g, value=1.0 - beta2)
        bc1 = 1.0 - beta1 ** t
        bc2 = 1.0 - beta2 ** t
        denom = (v / bc2).sqrt_().add_(eps)
        p.mul_(1.0 - lr * weight_decay * keep)
        p.sub_((lr * keep / bc1) * m / denom)


class AdamW(torch.optim.Optimizer):
    """AdamW with a sync-free skip (``found_inf``), state-compatible with ``torch.optim.AdamW``.
    ``fused=True`` runs torch's fused kernel (CPU, CUDA) for the update; otherwise the tensor ops
    of ``_adamw_update``."""

    fused = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      amsgrad=False, maximize=False, foreach=None,
                                      capturable=False, differentiable=False, fused=None))

    def _state(self, p, group):
        st = self.state[p]
        if not st:
            st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        elif st["step"].device != p.device:  # a checkpoint from a non-fused optimiser keeps it on CPU
            st["step"] = st["step"].to(p.device, torch.float32)
        return st

    def init_state(self) -> None:
        """Create every parameter's state now (SPMD shards it like the parameter)."""
        for group in self.param_groups:
            for p in group["params"]:
                self._state(p, group)

    def _adamw_step(self, group, ps, found_inf) -> None:
        states = [self._state(p, group) for p in ps]
        beta1, beta2 = group["betas"]
        moments = ([p.grad for p in ps], [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states])
        if self.fused:
            # torch.optim.AdamW(fused=True)'s own update, with the same skip: one kernel for the
            # group where the tensor ops below are ~13 per parameter, each through DTensor under
            # FSDP2 (bench/optimizer.py, d_model 512, 8 layers, 2 gloo processes: Muon's step
            # 1.83 -> 1.72 s)
            torch_adam(ps, *moments, [], [s["step"] for s in states], fused=True,
                       found_inf=found_inf, decoupled_weight_decay=True, amsgrad=False, beta1=beta1,
                       beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                       maximize=False)
            return
        _adamw_update(ps, *moments, [s["step"] for s in states],
                      lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                      weight_decay=group["weight_decay"], found_inf=found_inf)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            ps = [p for p in group["params"] if p.grad is not None]
            if ps:
                self._adamw_step(group, ps, _found_inf(self, ps[0].device))


def newton_schulz(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Approximately orthogonalise a matrix, or each matrix of a batch ``[..., m, n]`` (the quintic
    iteration of Muon, in fp32; each matrix is first divided by its own Frobenius norm)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.float()
    transposed = x.shape[-2] > x.shape[-1]
    if transposed:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        s = x @ x.mT
        x = a * x + (b * s + c * s @ s) @ x
    return x.mT if transposed else x


def orthogonalised(m: torch.Tensor, steps: int, lay_out=None, spread=None) -> torch.Tensor:
    """``newton_schulz`` of a stack of matrices ``[L, rows, cols]``, laid out by whole matrices
    where the matrices are sharded: Newton-Schulz multiplies whole matrices, and on row shards
    every one of its 15 products needs a collective.

    A DTensor (train.py's FSDP2: every layer's matrix of one shape, each split by rows over the
    processes) is redistributed to whole matrices, L / processes of them on each process (one
    all-to-all), orthogonalised there and sent back (one all-to-all). On the row shards, DTensor's
    rules issued 136 collectives per optimiser step for a 4-layer model under 2-process FSDP2, and
    10x the bytes (bench/optimizer.py). ``lay_out(t)`` is a backend's annotation of the same
    layout (XLA SPMD: the layer dimension sharded over the matrices' mesh axes), applied to the
    stack and to the result, which ``lay_out(t, back=True)`` returns laid out as the stack came:
    XLA then moves whole matrices instead of all-reducing a Gram product at each iteration. ``spread``: the process group of DDP replicas, which all hold the
    same stack (the gradients are all-reduced): each orthogonalises its share of the matrices
    and one all-gather gives every replica all of them, instead of each doing all the work."""
    if spread is not None:
        return _orthogonalised_by_share(m, steps, spread)
    if lay_out is not None:
        lay_out(m)
        o = newton_schulz(m, steps)
        lay_out(o)
        return lay_out(o, back=True)
    if not hasattr(m, "full_tensor"):
        return newton_schulz(m, steps)
    from torch.distributed.tensor import DTensor, Replicate, Shard
    mesh, placements = m.device_mesh, m.placements
    by_matrix = [Shard(0)] + [Replicate()] * (mesh.ndim - 1)
    mine = newton_schulz(m.redistribute(mesh, by_matrix).to_local(), steps)
    return DTensor.from_local(mine, mesh, by_matrix, run_check=False, shape=m.shape,
                              stride=m.stride()).redistribute(mesh, placements)


def _orthogonalised_by_share(m: torch.Tensor, steps: int, group) -> torch.Tensor:
    """``newton_schulz`` of the stack ``m [L, rows, cols]`` that every process of ``group`` holds,
    each computing ceil(L / processes) of the matrices (zero matrices pad the last share: their
    Newton-Schulz is zero), then one all-gather."""
    import torch.distributed as dist
    world, rank, count = dist.get_world_size(group), dist.get_rank(group), m.shape[0]
    share = -(-count // world)
    mine = newton_schulz(m[rank * share:(rank + 1) * share], steps)
    if mine.shape[0] < share:   # the last shares: fewer matrices, or none
        mine = torch.cat([mine, mine.new_zeros(share - mine.shape[0], *mine.shape[1:])])
    out = mine.new_empty(share * world, *mine.shape[1:])
    dist.all_gather_into_tensor(out, mine.contiguous(), group=group)
    return out[:count]


class Muon(AdamW):
    """Muon on groups with ``use_muon=True`` (2-D matrices), AdamW on the others.

    Muon: Nesterov momentum, orthogonalised by Newton-Schulz, scaled by sqrt(max(1, rows/cols)),
    decoupled weight decay (``torch.optim.Muon``'s algorithm, with Newton-Schulz in fp32 where torch
    runs it in bf16). Skips the whole update (state included) where ``found_inf`` is 1.
    ``lay_out_by_matrix(stack, params, back=False)``, set by a backend whose matrices are sharded
    by annotation (XLA SPMD), lays a stack of ``params``' updates out by whole matrices, and with
    ``back`` returns it laid out like their state again (``orthogonalised``); ``spread_over``, set by a backend of DDP replicas (train.py under
    torchrun), is their process group, over which each shape's Newton-Schulz work is shared.

    Matrices of one shape (the same projection in every layer) are orthogonalised together, as one
    batch: a few large products instead of many small ones, and on XLA a trace per shape, not per
    matrix; the momentum and the update are foreach ops, and the factors they share computed once
    (``bench/xla.py optimizer configs/demo.yaml training.optimizer=muon``, PJRT CPU: 108 -> 46 ms
    of host time per update, 166 -> 103 ms for the whole update). One shape at a time: the
    memory it takes beyond the per-matrix form is that shape's matrices' updates and Newton-Schulz
    temporaries (n_layers of them), not the whole model's.
    """

    def __init__(self, param_groups, lr=0.02, momentum=0.95, betas=(0.9, 0.95), eps=1e-8,
                 weight_decay=0.0, ns_steps=5, fused=False):
        defaults = dict(lr=lr, momentum=momentum, betas=betas, eps=eps, weight_decay=weight_decay,
                        ns_steps=ns_steps, use_muon=False)
        torch.optim.Optimizer.__init__(self, param_groups, defaults)
        self.lay_out_by_matrix = None
        self.spread_over = None
        self.fused = fused   # the AdamW groups through torch's fused kernel (CPU, CUDA)

    def _state(self, p, group):
        if not group["use_muon"]:
            return super()._state(p, group)
        st = self.state[p]
        if not st:
            st["momentum_buffer"] = torch.zeros_like(p)
        return st

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            ps = [p for p in group["params"] if p.grad is not None]
            if not ps:
                continue
            found_inf = _found_inf(self, ps[0].device)
            if not group["use_muon"]:
                self._adamw_step(group, ps, found_inf)
                continue
            keep = 1.0 - found_inf
            skip = found_inf > 0
            mu, lr, wd = group["momentum"], group["lr"], group["weight_decay"]
            # the factors every matrix shares, once (on XLA each op is traced, per matrix or not)
            momentum_keep, decay = 1.0 - (1.0 - mu) * keep, 1.0 - lr * wd * keep
            by_shape: dict[tuple, list] = {}
            for p in ps:
                by_shape.setdefault(tuple(p.shape), []).append(p)
            for shape, same in by_shape.items():   # one shape's updates alive at a time
                bufs = [self._state(p, group)["momentum_buffer"] for p in same]
                grads = [torch.where(skip, 0.0, p.grad) for p in same]
                torch._foreach_mul_(bufs, momentum_keep)
                torch._foreach_add_(bufs, grads, alpha=1.0 - mu)           # lerp towards g
                # Nesterov; one lerp per matrix (FSDP2's DTensor has no rule for _foreach_lerp)
                lay_out = self.lay_out_by_matrix and functools.partial(self.lay_out_by_matrix, params=same)
                o = orthogonalised(torch.stack([g.lerp(b, mu) for g, b in zip(grads, bufs)]), group["ns_steps"],
                                   lay_out, self.spread_over)
                del grads
                o = o * (lr * max(1.0, shape[0] / shape[1]) ** 0.5 * keep)
                torch._foreach_mul_(same, decay)
                torch._foreach_sub_(same, [o[i].to(p.dtype) for i, p in enumerate(same)])  # DTensor: no unbind


def build_optimizer(model: nn.Module, tcfg, adamw_factory=None) -> torch.optim.Optimizer:
    """The optimiser the config asks for, with weight decay on matrices only.

    ``adamw_factory(groups, **kw)`` lets a backend choose the AdamW implementation (torch's fused
    kernel on CPU/CUDA, training.xla_backend.XLAAdamW on XLA); all share one state layout. A factory
    that subclasses ``AdamW`` also updates Muon's AdamW groups; one marked ``fused`` (torch's fused
    AdamW) has Muon run them through that kernel.
    """
    matrices, embeds, vectors = split_params(model)
    if tcfg.optimizer == "muon":
        groups = [
            {"params": matrices, "use_muon": True, "lr": tcfg.muon_lr, "weight_decay": tcfg.weight_decay},
            {"params": embeds + vectors, "use_muon": False, "lr": tcfg.learning_rate, "weight_decay": 0.0},
        ]
        muon = Muon
        if isinstance(adamw_factory, type) and issubclass(adamw_factory, AdamW) and adamw_factory is not AdamW:
            # a backend's own AdamW update (XLA: torch_xla's fused op) for Muon's AdamW groups too
            muon = type("Muon" + adamw_factory.__name__, (Muon, adamw_factory), {})
        opt = muon(groups, lr=tcfg.muon_lr, momentum=tcfg.muon_momentum, betas=tcfg.betas, eps=tcfg.eps,
                   fused=getattr(adamw_factory, "fused", False))
    else:
        groups = [{"params": matrices, "weight_decay": tcfg.weight_decay},
                  {"params": embeds + vectors, "weight_decay": 0.0}]
        factory = adamw_factory or AdamW
        opt = factory(groups, lr=tcfg.learning_rate, betas=tcfg.betas, eps=tcfg.eps)
    for g in opt.param_groups:
        g["base_lr"] = g["lr"]  # the schedule scales every group from its own peak
    return opt


def set_lr(opt: torch.optim.Optimizer, factor: float) -> None:
    """Set every group's learning rate to ``factor`` x its peak (``base_lr``).

    A factor of exactly 0 (the last step of a cosine to ``min_lr_ratio: 0``) is set as 1e-30: an
    update that moves no weight larger than ~1e-22 (fp32 rounding absorbs it), lr 0's update in
    practice. torch_xla makes a scalar 0 a graph constant, and gives equal scalars one graph
    parameter: lr 0 would compile a new update graph for the last step (and with Muon, both
    groups at 0 share a parameter, another graph). Scaled from a common nonzero factor, the
    groups' rates stay as distinct from each other as at every other step."""
    factor = factor or 1e-30
    for g in opt.param_groups:
        lr = g["base_lr"] * factor
        if isinstance(g["lr"], torch.Tensor):
            g["lr"].fill_(lr)
        else:
            g["lr"] = lr
