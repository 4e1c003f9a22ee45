"""Muon's optimiser step over sharded matrices: collectives, bytes and time per step, under
train.py's FSDP2 and under train_xla.py's SPMD (fsdp, and ZeRO-2); the layout of SPMD's ZeRO-2
optimiser state; and SPMD's activations, annotated with the batch's split or left to XLA's
propagation.

    .venv/bin/python bench/optimizer.py                          # d_model 512, 8 layers, 7 repeats, all
    .venv/bin/python bench/optimizer.py --only spmd --d-model 256 --layers 4 --repeats 5
    .venv/bin/python bench/optimizer.py --only zero --d-model 256 --layers 4 --repeats 5
    .venv/bin/python bench/optimizer.py --only muon_zero --d-model 128 --layers 4 --repeats 5
    .venv/bin/python bench/optimizer.py --only activations,zero --d-model 256 --layers 4 --batch 2 --seq 256 --repeats 5
    .venv/bin/python bench/optimizer.py --only tp --d-model 256 --layers 4 --batch 2 --seq 256 --repeats 5 --model-root /tmp/before [--scan-layers]

fsdp2:

Under FSDP2 every matrix is a DTensor split by rows over the processes, and Muon's Newton-Schulz
is a product of whole matrices (training/optim.py). Four forms of the same update, side by side in
one run on the CPU (gloo, ``--procs`` processes started here, the real ``TorchBackend`` with
``training.fsdp``, ``build_optimizer`` with ``training.optimizer=muon``):

- ``by_matrix``: what the optimiser does (``training.optim.orthogonalised``): each shape's stack
  goes to whole matrices, a share of the layers on each process (an all-to-all), is orthogonalised
  there and comes back (an all-to-all). torch 2.9 runs an all-to-all of CPU tensors as an
  all-gather and a slice, so on gloo its bytes are those of two all-gathers; on GPUs (nccl) each
  process receives about 2 / processes of the stack;
- ``gathered``: each shape's stack gathered whole (one all-gather) and orthogonalised whole on
  every process: the fewest collectives, every process doing all the work;
- ``per_product``: Newton-Schulz on the row shards themselves, with DTensor's redistributions at
  each of its products (the form before ``orthogonalised``);
- ``tensor_op_adamw``: by_matrix, with Muon's AdamW groups (embeddings, norms, gates, biases)
  updated in training.optim's tensor ops (~13 per parameter, each through DTensor) instead of
  torch's fused AdamW kernel, which the CPU and CUDA backends give Muon.

Four models with the same weights and the same batch take a step each in turn, ``--repeats`` times
(interleaved, after one step each that is not timed). Per form: the collectives of one step and the
bytes they deliver to process 0 (counted below DTensor, on the functional collectives it issues),
the median time of a step on process 0 (from a barrier to a barrier), and the largest difference
of each form's weights from by_matrix's after the first step (same weights, same gradients:
rounding only, which Newton-Schulz amplifies in a matrix's small singular directions).

spmd: train_xla.py's backend (``XLABackend``, ``xla.mode=spmd``, a mesh of ``--devices`` PJRT CPU
devices over fsdp, in a process of its own), two models and their Muon, each training step
(forward, backward, update) one graph as in train_xla.py without accumulation: ``by_matrix`` (what
the backend does: each stack annotated with its layer dimension sharded,
``XLABackend._lay_out_by_matrix``) against ``per_product`` (the stack left to XLA's sharding
propagation: the matrices split by rows). Per form: the collectives of the partitioned step graph
(XLA's own dump after optimisation; the forward's and backward's are the same in both) and the
bytes of their results on one device, and the median time of a step (trace and execution).

ddp: train.py's DDP replicas (``--procs`` processes, gloo), Muon's Newton-Schulz shared among them
(each a share of every shape's matrices, one all-gather: what ``TorchBackend.prepare_optimizer``
sets) against every replica doing all of it; the median optimiser step, interleaved.

zero: train_xla.py's backend with ``xla.shard_optimizer_over_data`` (ZeRO-2) on a data 2 x fsdp
``--devices / 2`` mesh of PJRT CPU devices (in a process of its own), AdamW, the Trainer's two
graphs per step (forward and backward; the update). ``fsdp_major``: the state's and gradients'
sharded dimension split over ``("fsdp", "data")`` (training/sharding.py), each device's piece
within its own shard of the parameter; ``data_major``: split over ``("data", "fsdp")``, as before.
Two models with the same weights, steps interleaved (two untimed). Per form and graph: the
collectives and their result bytes on one device; the median step time; the largest weight
difference between the forms after all steps.

muon_zero: the zero section's mesh and graphs with Muon: ``back`` (what the backend does: each
shape's orthogonalised stack laid out like its state again in one resharding before the update
takes it apart by matrix, ``XLABackend._lay_out_by_matrix(..., back=True)``) against ``sliced``
(taken apart straight from the layout by matrix, as before: XLA's partitioner warns of an
"involuntary full rematerialization" per matrix, each made whole on every device first).
Measured as the zero section's forms.

activations: the same mesh, AdamW (ZeRO-2 as by default): ``constrained`` (what the backend does: the
activations into and out of every Linear, out of the embedding and around every block annotated
with the batch's split, ``XLABackend._shard_activations``) against ``propagated`` (no annotation:
GSPMD's propagation chooses). Measured as the zero section's forms.

tp: train_xla.py's backend on an fsdp ``--devices / 2`` x tp 2 mesh (Megatron's layout: attention
heads and FFN features split over tp), AdamW, the Trainer's two graphs per step: ``this`` (this
checkout's model) and, with ``--model-root DIR``, ``root`` (DIR's model.py, loaded as bench/model.py
loads it), measured as the zero section's forms: what a change to the model does to the
partitioned graph; with ``--scan-layers`` the blocks run as one scan loop (``xla.scan_layers``),
whose body is what GSPMD partitions. (XLA compiles a graph once: where a form's graph is the same
as an earlier form's, as the update's is when only the model changed, it is reported as such.)

The XLA sections' batch (``--batch`` per device x ``--devices`` sequences of ``--seq`` tokens) is
split over data x fsdp, as train_xla.py's loader splits it (their figures before the activations
section came from a batch every device held whole).

Prints one JSON object as the last line of stdout (gloo writes its connection lines there first):
``{"fsdp2": ..., "ddp": ..., "spmd": ..., "zero": ..., "activations": ..., "tp": ...}``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

FORMS = ("by_matrix", "gathered", "per_product", "tensor_op_adamw")
XLA_SECTIONS = ("spmd", "zero", "muon_zero", "activations", "tp")


class Collectives(TorchDispatchMode):
    """Counts the collectives issued on this process and the bytes of their results. DTensor ops
    are let through (NotImplemented) so that the mode sees the collectives they turn into."""

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        name = func._overloadpacket.__name__
        if func.namespace in ("_c10d_functional", "c10d") and not name.startswith("wait"):
            self.counts[name] += 1
            self.bytes += sum(t.numel() * t.element_size() for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_config(args, module=None, tp: int = 1):
    """The benchmark's model: ``--d-model`` wide, ``--layers`` deep, heads of 64, kv heads of 128,
    their counts rounded up to multiples of ``tp`` (tensor parallelism splits whole heads:
    ``config.check_xla``) and the heads' to a multiple of the kv heads' (``module``: the model.py
    to take the config class from; this checkout's by default)."""
    if module is None:
        import model as module
    kv = -(-max(1, args.d_model // 128) // tp) * tp
    heads = -(-max(1, args.d_model // 64) // kv) * kv
    return module.ModelConfig(vocab_size=4096, d_model=args.d_model, n_layers=args.layers,
                              n_heads=heads, n_kv_heads=kv, max_seq_len=args.seq)


def model_and_optimizer(backend, cfg, args, module=None, tp: int = 1):
    """The benchmark's model (the same weights every call; ``module``'s NashMHC, this checkout's
    by default; ``tp``: ``model_config``'s) on ``backend`` and its optimiser."""
    from training.optim import build_optimizer
    if module is None:
        import model as module
    torch.manual_seed(0)
    model = backend.prepare_model(module.NashMHC(model_config(args, module, tp)), cfg)
    return model, build_optimizer(model, cfg.training, backend.adamw_factory())


def _on_xla(backend, cfg, args, module=None, tp: int = 1):
    """``model_and_optimizer`` on the XLA backend, its optimiser state made and placed as the
    Trainer does (``init_state``, ``prepare_optimizer``)."""
    model, opt = model_and_optimizer(backend, cfg, args, module, tp)
    opt.init_state()
    backend.prepare_optimizer(opt)
    return model, opt


def _worker(rank: int, world: int, port: int, args, out_file: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import training.optim as optim
    from training.backend import TorchBackend
    from training.config import load_config
    from training.optim import newton_schulz

    cfg = load_config(None, ["training.max_steps=1", "training.optimizer=muon", "training.fsdp=true"])
    backend = TorchBackend("cpu", fsdp=True)
    vocab = model_config(args).vocab_size
    forms = {}
    for form in FORMS:
        forms[form] = model_and_optimizer(backend, cfg, args)
    forms["tensor_op_adamw"][1].fused = False
    def gathered(m, steps, lay_out=None, spread=None):
        from torch.distributed.tensor import DTensor, Replicate
        whole = [Replicate()] * m.device_mesh.ndim
        return DTensor.from_local(newton_schulz(m.full_tensor(), steps), m.device_mesh, whole,
                                  run_check=False).redistribute(m.device_mesh, m.placements)

    implementations = {"by_matrix": optim.orthogonalised, "gathered": gathered,
                       # DTensor's rules at each product
                       "per_product": lambda m, steps, lay_out=None, spread=None: newton_schulz(m, steps),
                       "tensor_op_adamw": optim.orthogonalised}
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, vocab, (args.batch, args.seq), generator=g)
    times: dict = {form: [] for form in FORMS}
    comms: dict = {}
    for r in range(args.repeats + 1):
        for form in FORMS:
            model, opt = forms[form]
            opt.zero_grad(set_to_none=True)
            model(x, x).loss.backward()
            optim.orthogonalised = implementations[form]
            dist.barrier()
            if r == 0:  # not timed: the count, and a first step (state created) for every form
                with Collectives() as c:
                    opt.step()
                comms[form] = {"collectives": sum(c.counts.values()), "by_kind": dict(c.counts),
                               "bytes_received": c.bytes}
                continue
            t0 = time.perf_counter()
            opt.step()
            dist.barrier()
            times[form].append(time.perf_counter() - t0)
        if r == 0:  # one step from the same weights and gradients: the forms' rounding only
            diff = {f: max((a.full_tensor() - b.full_tensor()).abs().max().item() for a, b in
                           zip(forms["by_matrix"][0].parameters(), forms[f][0].parameters())) for f in FORMS[1:]}
    optim.orthogonalised = implementations["by_matrix"]
    if rank == 0:
        muon = sum(p.numel() for grp in forms["by_matrix"][1].param_groups if grp["use_muon"] for p in grp["params"])
        median = {f: statistics.median(times[f]) for f in FORMS}
        result = {"d_model": args.d_model, "layers": args.layers, "processes": world, "repeats": args.repeats,
                  "muon_matrix_values": muon,
                  "forms": {f: {**comms[f], "step_ms": 1e3 * median[f]} for f in FORMS},
                  "step_time_over_by_matrix": {f: median[f] / median["by_matrix"] for f in FORMS[1:]},
                  "first_step_max_weight_difference_from_by_matrix": diff}
        Path(out_file).write_text(json.dumps(result))
    dist.destroy_process_group()


def _ddp_worker(rank: int, world: int, port: int, args, out_file: str) -> None:
    """train.py's DDP (``TorchBackend`` without fsdp): Muon's Newton-Schulz shared among the replicas
    (``shared``: what ``prepare_optimizer`` sets, each a share of every shape's matrices and one
    all-gather) against every replica doing all of it (``every_replica``, before); the same
    weights and batch, interleaved; the median optimiser step on process 0 and the largest weight
    difference after one step."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from training.backend import TorchBackend
    from training.config import load_config

    cfg = load_config(None, ["training.max_steps=1", "training.optimizer=muon"])
    backend = TorchBackend("cpu")
    vocab = model_config(args).vocab_size
    forms = {}
    for form in ("shared", "every_replica"):
        model, opt = model_and_optimizer(backend, cfg, args)
        backend.prepare_optimizer(opt)
        forms[form] = (model, opt)
    assert forms["shared"][1].spread_over is not None
    forms["every_replica"][1].spread_over = None
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, vocab, (args.batch, args.seq), generator=g)
    times: dict = {form: [] for form in forms}
    for r in range(args.repeats + 1):
        for form, (model, opt) in forms.items():
            opt.zero_grad(set_to_none=True)
            model(x, x).loss.backward()
            dist.barrier()
            t0 = time.perf_counter()
            opt.step()
            dist.barrier()
            if r > 0:  # the first: state created, not timed
                times[form].append(time.perf_counter() - t0)
        if r == 0:
            diff = max((a - b).abs().max().item() for a, b in
                       zip(forms["shared"][0].parameters(), forms["every_replica"][0].parameters()))
    if rank == 0:
        median = {f: statistics.median(times[f]) for f in forms}
        Path(out_file).write_text(json.dumps({
            "d_model": args.d_model, "layers": args.layers, "processes": world, "repeats": args.repeats,
            "step_ms": {f: 1e3 * median[f] for f in forms},
            "every_replica_over_shared": median["every_replica"] / median["shared"],
            "first_step_max_weight_difference": diff}))
    dist.destroy_process_group()


# One instruction of an HLO dump: its result type (an array, a scalar ``f32[]`` or a tuple of
# arrays, as an all-to-all's) and its op.
_HLO_OP = re.compile(r"^\s*(?:ROOT )?%?[\w.-]+ = (\([^()]*\)|\w+\[[\d,]*\](?:\{[^}]*\})?) ([\w-]+)\(", re.M)
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
_COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "reduce-scatter", "collective-permute")
_BYTES = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
          "s8": 1, "u8": 1, "pred": 1}


def collective_results(text: str) -> list[tuple[str, list[tuple[str, str]]]]:
    """Each collective of an HLO dump ``text`` after optimisation: its kind and its results on one
    device, ``(dtype, dims)`` each (an asynchronous pair once, at its start, by its last result)."""
    found = []
    for rtype, op in _HLO_OP.findall(text):
        kind = op.removesuffix("-start")
        if kind in _COLLECTIVES:
            arrays = _ARRAY.findall(rtype)
            found.append((kind, arrays[-1:] if op.endswith("-start") else arrays))
    return found


def _collectives(texts) -> dict:
    """The collectives of HLO dumps ``texts`` after optimisation, by kind, and the bytes of their
    results on one device (``collective_results``)."""
    found: Counter = Counter()
    nbytes = 0
    for text in texts:
        for kind, arrays in collective_results(text):
            found[kind] += 1
            for dtype, dims in arrays:
                n = 1
                for d in filter(None, dims.split(",")):
                    n *= int(d)
                nbytes += n * _BYTES.get(dtype, 4)
    return {"collectives": sum(found.values()), "by_kind": dict(found), "result_bytes_per_device": nbytes}


def _xla_backend(args, overrides: list[str], tp: int = 1):
    """An XLA section's ``XLABackend`` (this process: PJRT_DEVICE=CPU, CPU_NUM_DEVICES and XLA_FLAGS
    set by main), its config, and the directory XLA dumps its graphs into. The config's model is
    the benchmark's (``model_config(args, tp=tp)``), so the backend's launch checks see it."""
    from training.config import load_config
    from training.xla_backend import XLABackend

    dump = os.environ["XLA_FLAGS"].split("--xla_dump_to=")[1].split()[0]
    data = Path(dump).parent / "data"
    data.mkdir()
    (data / "meta.json").write_text(json.dumps({"vocab_size": 4096}))  # read by the launch check only
    model = [f"model.{k}={json.dumps(v)}" for k, v in model_config(args, tp=tp).to_dict().items()]
    cfg = load_config(None, ["training.max_steps=1", "xla.mode=spmd", f"data.dir={data}", f"data.seq_len={args.seq}",
                             f"training.batch_size={args.batch * args.devices}", *model, *overrides])
    return XLABackend(cfg), cfg, dump


def _spmd(args) -> dict:
    """The spmd section, in this process (PJRT_DEVICE=CPU, CPU_NUM_DEVICES and XLA_FLAGS set by main)."""
    backend, cfg, dump = _xla_backend(args, ["training.optimizer=muon", "xla.mesh.data=1", f"xla.mesh.fsdp={args.devices}"])
    forms = {}
    for form in ("by_matrix", "per_product"):
        model, opt = _on_xla(backend, cfg, args)
        if form == "per_product":
            opt.lay_out_by_matrix = None
        forms[form] = (model, opt)
    # the second step compiles a graph of its own too: the first one also creates the optimiser
    # state (no sync after init_state, which the Trainer has), and the parameters and state it
    # updates without a sharding annotation come back annotated as replicated: other inputs
    out = _timed_steps(forms, _batch(backend, args), args, dump, {"step": _whole_step})
    ms = {f: v["step_ms"] for f, v in out["forms"].items()}
    return {"d_model": args.d_model, "layers": args.layers, "devices": args.devices, "repeats": args.repeats,
            "forms": {f: {**v["step"], "step_ms": v["step_ms"], "compiled_while_timed": v["compiled_while_timed"]}
                      for f, v in out["forms"].items()},
            "per_product_over_by_matrix": ms["per_product"] / ms["by_matrix"],
            "max_weight_difference_after_all_steps": out["max_weight_difference_after_all_steps"]}


def _batch(backend, args):
    """The benchmark's token batch on the device, split over data x fsdp as train_xla.py's loader
    splits it (``XLABackend.batches``)."""
    from training.sharding import BATCH
    x = torch.randint(0, model_config(args).vocab_size, (args.batch * args.devices, args.seq),
                      generator=torch.Generator().manual_seed(0)).to(backend.device)
    backend.xs.mark_sharding(x, backend.mesh, (BATCH, None))
    return x


def _whole_step(model, opt, x):             # the spmd section: a training step as one graph
    opt.zero_grad(set_to_none=True)
    model(x, x).loss.backward()
    opt.step()


def _forward_backward(model, opt, x):       # the Trainer's micro-step graph
    model(x, x).loss.backward()


def _update(model, opt, x):                 # the Trainer's update graph
    opt.step()
    opt.zero_grad(set_to_none=True)


TRAINER_GRAPHS = {"forward_backward": _forward_backward, "update": _update}


def _timed_steps(forms: dict, x, args, dump: str, graphs: dict) -> dict:
    """``forms`` ({name: (model, optimiser)}) each taking a step as ``graphs`` ({name: fn(model,
    opt, x)}, each traced and synced: one graph each), interleaved, two untimed: per form and graph
    the collectives (the graph compiled in the untimed steps), the median step time, the graphs
    compiled while timed; the largest weight difference between the first two forms at the end."""
    import glob

    import torch_xla
    import torch_xla.core.xla_model as xm

    times, comms, late = {f: [] for f in forms}, {f: {} for f in forms}, {f: 0 for f in forms}
    warmup = 2
    for r in range(warmup + args.repeats):
        for form, (model, opt) in forms.items():
            t0 = time.perf_counter()
            for graph, step in graphs.items():
                seen = set(glob.glob(f"{dump}/*after_optimizations.txt"))
                step(model, opt, x)
                torch_xla.sync()
                new = set(glob.glob(f"{dump}/*after_optimizations.txt")) - seen
                if r < warmup and new:   # compiled here: the last one compiled is this graph's
                    comms[form][graph] = _collectives(Path(f).read_text() for f in new)
                late[form] += r >= warmup and bool(new)
            xm.wait_device_ops()
            if r >= warmup:
                times[form].append(time.perf_counter() - t0)
    for f in forms:   # XLA compiles a graph once: a form whose graph another form compiled has none of its own
        comms[f] = {g: comms[f].get(g, "the same graph as an earlier form's") for g in graphs}
    out = {"forms": {f: {**comms[f], "step_ms": 1e3 * statistics.median(times[f]),
                         "compiled_while_timed": late[f]} for f in forms}}
    if len(forms) > 1:
        a, b = (forms[f][0] for f in list(forms)[:2])
        out["max_weight_difference_after_all_steps"] = max(
            (p.cpu() - q.cpu()).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))
    return out


def _data_x_fsdp(args, section: str, overrides: list[str]):
    """``_xla_backend`` on a data 2 x fsdp ``--devices / 2`` mesh (an even ``--devices``)."""
    if args.devices % 2:
        sys.exit(f"bench/optimizer.py: --only {section} needs an even --devices (data 2 x fsdp devices/2), "
                 f"got {args.devices}")
    return _xla_backend(args, ["xla.mesh.data=2", f"xla.mesh.fsdp={args.devices // 2}", *overrides])


def _trainer_graphs_side_by_side(forms: dict, backend, args, dump: str) -> dict:
    """The two ``forms``' Trainer graphs timed side by side (``_timed_steps``), with the shape
    measured and the second form's step time over the first's."""
    import torch_xla

    torch_xla.sync()
    out = _timed_steps(forms, _batch(backend, args), args, dump, TRAINER_GRAPHS)
    ours, other = forms
    return {"d_model": args.d_model, "layers": args.layers, "devices": args.devices,
            "batch": args.batch * args.devices, "seq": args.seq, "repeats": args.repeats, **out,
            f"{other}_over_{ours}": out["forms"][other]["step_ms"] / out["forms"][ours]["step_ms"]}


def _zero(args) -> dict:
    """The zero section, in this process (PJRT_DEVICE=CPU, CPU_NUM_DEVICES and XLA_FLAGS set by main)."""
    import training.xla_backend as xb

    backend, cfg, dump = _data_x_fsdp(args, "zero", ["training.optimizer=adamw",
                                                     "xla.shard_optimizer_over_data=true"])
    ours = xb.state_partition_spec
    forms = {}
    for form in ("fsdp_major", "data_major"):
        if form == "data_major":   # the state's specs are taken while the optimiser is prepared
            xb.state_partition_spec = lambda spec, over: spec and tuple(
                ("data", "fsdp") if a == ("fsdp", "data") else a for a in ours(spec, over))
        try:
            model, opt = _on_xla(backend, cfg, args)
        finally:
            xb.state_partition_spec = ours
        forms[form] = (model, opt)
    return _trainer_graphs_side_by_side(forms, backend, args, dump)


def _muon_zero(args) -> dict:
    """The muon_zero section, in this process (PJRT_DEVICE=CPU, CPU_NUM_DEVICES and XLA_FLAGS set by main)."""
    backend, cfg, dump = _data_x_fsdp(args, "muon_zero", ["training.optimizer=muon",
                                                          "xla.shard_optimizer_over_data=true"])
    forms = {}
    for form in ("back", "sliced"):
        model, opt = _on_xla(backend, cfg, args)
        if form == "sliced":
            by_matrix = opt.lay_out_by_matrix
            opt.lay_out_by_matrix = lambda stack, params, back=False: stack if back else by_matrix(stack, params)
        forms[form] = (model, opt)
    return _trainer_graphs_side_by_side(forms, backend, args, dump)


def _activations(args) -> dict:
    """The activations section, in this process (PJRT_DEVICE=CPU, CPU_NUM_DEVICES and XLA_FLAGS set by main)."""
    backend, cfg, dump = _data_x_fsdp(args, "activations", ["training.optimizer=adamw"])
    forms = {}
    for form in ("constrained", "propagated"):
        if form == "propagated":
            backend._shard_activations = lambda model: None
        model, opt = _on_xla(backend, cfg, args)
        forms[form] = (model, opt)
    del backend._shard_activations     # the class's again
    return _trainer_graphs_side_by_side(forms, backend, args, dump)


def _tp(args) -> dict:
    """The tp section, in this process (PJRT_DEVICE=CPU, CPU_NUM_DEVICES and XLA_FLAGS set by main)."""
    import torch_xla

    if args.devices % 2:
        sys.exit(f"bench/optimizer.py: --only tp needs an even --devices (fsdp devices/2 x tp 2), got {args.devices}")
    backend, cfg, dump = _xla_backend(args, ["training.optimizer=adamw", f"xla.mesh.fsdp={args.devices // 2}",
                                             "xla.mesh.tp=2", f"xla.scan_layers={str(args.scan_layers).lower()}"],
                                      tp=2)
    modules = {"this": None}
    if args.model_root:
        from bench.model import model_module
        modules["root"] = model_module(args, "root:nash-mhc")[0]
    forms = {}
    for form, module in modules.items():
        model, opt = _on_xla(backend, cfg, args, module, tp=2)
        forms[form] = (model, opt)
    torch_xla.sync()
    out = _timed_steps(forms, _batch(backend, args), args, dump, TRAINER_GRAPHS)
    ms = {f: v["step_ms"] for f, v in out["forms"].items()}
    return {"d_model": args.d_model, "layers": args.layers, "devices": args.devices, "model_root": args.model_root,
            "batch": args.batch * args.devices, "seq": args.seq, "repeats": args.repeats, **out,
            **({"root_over_this": ms["root"] / ms["this"]} if "root" in ms else {})}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--devices", type=int, default=4,
                    help="spmd: PJRT CPU devices, all on fsdp; zero and activations: data 2 x fsdp the rest; "
                         "tp: fsdp the rest x tp 2")
    ap.add_argument("--only", default="fsdp2,ddp,spmd,zero,muon_zero,activations,tp",
                    help="sections, comma-separated: fsdp2, ddp, spmd, zero, muon_zero, activations, tp")
    ap.add_argument("--scan-layers", action="store_true", help="tp: the blocks as one scan loop (xla.scan_layers)")
    ap.add_argument("--model-root", metavar="DIR",
                    help="tp: also another checkout's model.py (as bench/model.py --model-root), side by side")
    # an XLA section's child process
    ap.add_argument("--xla-here", choices=XLA_SECTIONS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    sections = ("fsdp2", "ddp", *XLA_SECTIONS)
    unknown = [s for s in args.only.split(",") if s not in sections]
    if unknown:
        ap.error(f"--only {args.only}: no section {', '.join(unknown)} (sections: {', '.join(sections)})")
    small = [f"--{k.replace('_', '-')}" for k in ("d_model", "layers", "procs", "batch", "seq", "repeats", "devices")
             if getattr(args, k) < 1]
    if small:
        ap.error(f"{', '.join(small)} must be at least 1")
    if (args.model_root or args.scan_layers) and "tp" not in args.only.split(","):
        ap.error("--model-root and --scan-layers are the tp section's: add tp to --only")
    if args.model_root and not (Path(args.model_root) / "model.py").is_file():
        ap.error(f"--model-root {args.model_root}: no model.py there")
    if args.xla_here:
        print(json.dumps({"spmd": _spmd, "zero": _zero, "muon_zero": _muon_zero, "activations": _activations,
                          "tp": _tp}[args.xla_here](args)))
        return 0
    import subprocess
    import tempfile
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        if "fsdp2" in args.only.split(","):
            out = os.path.join(tmp, "result.json")
            mp.spawn(_worker, args=(args.procs, _free_port(), args, out), nprocs=args.procs)
            result["fsdp2"] = json.loads(Path(out).read_text())
        if "ddp" in args.only.split(","):
            out = os.path.join(tmp, "ddp.json")
            mp.spawn(_ddp_worker, args=(args.procs, _free_port(), args, out), nprocs=args.procs)
            result["ddp"] = json.loads(Path(out).read_text())
        for section in XLA_SECTIONS:
            if section not in args.only.split(","):
                continue
            env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(args.devices),
                   # the caller's XLA flags (tests' fast compile, a user's own) and the dump
                   "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={tmp}/{section}/hlo "
                                "--xla_dump_hlo_as_text".strip()}
            os.makedirs(f"{tmp}/{section}")
            r = subprocess.run([sys.executable, __file__, "--xla-here", section,
                                *(argv if argv is not None else sys.argv[1:])], env=env, capture_output=True, text=True)
            if r.returncode:
                sys.exit(f"bench/optimizer.py: the {section} section failed:\n{r.stderr[-3000:]}")
            result[section] = json.loads(r.stdout.strip().splitlines()[-1])
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
