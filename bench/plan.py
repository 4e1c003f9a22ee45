"""The planner (training/plan.py) against measurements on the CPU, and the memory levers it offers.

    .venv/bin/python bench/plan.py                 # every section
    .venv/bin/python bench/plan.py --only peak     # peak, chunked_loss, zero, stream_dtype

peak: the predicted peak memory of one training step (traced on fake tensors) against the measured
peak of the same step on real tensors, for the demo model and a d_model 512 model, with and without
activation checkpointing, 1 and 4 mHC streams. "Measured" is the CPU allocator's own count:
torch.profiler's memory events (every allocation and free, with its size) over one step, after a
warm-up step, plus the bytes alive before it (weights, optimiser state, the batch).

chunked_loss: model.loss_chunk against the whole cross-entropy at once: measured peak, loss and
gradients. zero: xla.shard_optimizer_over_data on a 4-device SPMD mesh (PJRT CPU, data 2 x fsdp 2):
bytes of gradients and optimiser state per device (from the shards XLA holds) and the losses of a
few steps, against fsdp-only sharding. stream_dtype: bf16 residual streams, where model.py has them.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from model import ModelConfig, NashMHC  # noqa: E402
from training.config import Config, DataConfig, TrainingConfig  # noqa: E402
from training.backend import fused_adamw  # noqa: E402
from training.optim import AdamW, build_optimizer  # noqa: E402
from training.plan import predict_step_peak, training_step  # noqa: E402

DEMO = dict(vocab_size=2048, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=256,
            nash_scales=3, nash_window=64)
D512 = dict(vocab_size=2048, d_model=512, n_layers=2, n_heads=8, n_kv_heads=4, max_seq_len=256,
            nash_scales=3, nash_window=64)


def small_config(model: dict, batch: int = 4, seq: int = 256, **training) -> Config:
    """A training config for a one-step memory measurement (fp32, AdamW, clipping on)."""
    training = {"precision": "fp32", **training}
    return Config(model=ModelConfig(**model), data=DataConfig(seq_len=seq),
                  training=TrainingConfig(batch_size=batch, max_steps=1, **training))


def _allocations(prof) -> list:
    out, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if type(e.extra_fields).__name__ == "_ExtraFields_Allocation":
            out.append((e.start_time_ns, e.extra_fields.alloc_size))
    return sorted(out)


def live_bytes(*objs) -> int:
    """Bytes of the distinct storages behind the tensors in ``objs`` (tensors, modules, optimisers)."""
    seen, total = set(), 0

    def add(t):
        nonlocal total
        st = t.untyped_storage()
        if st.data_ptr() not in seen and st.nbytes():
            seen.add(st.data_ptr())
            total += st.nbytes()

    for obj in objs:
        if isinstance(obj, torch.nn.Module):
            for t in list(obj.parameters()) + list(obj.buffers()):
                add(t)
        elif isinstance(obj, torch.optim.Optimizer):
            for state in obj.state.values():
                for v in state.values():
                    if torch.is_tensor(v):
                        add(v)
        elif torch.is_tensor(obj):
            add(obj)
    return total


def measure_step_peak(cfg: Config, seed: int = 0, entry: str = "torch", ddp: bool = False) -> int:
    """Peak bytes of one real training step on the CPU (training.plan.training_step): what is alive
    before the step plus the highest point of the allocator's running count during it. ``entry``
    "torch" runs it as train.py does (fused AdamW, the CPU's fused attention); "xla" with what the
    XLA backend and compiler use instead (the tensor-op AdamW, attention as ATen's math path).
    ``ddp``: the model wrapped as train.py wraps it under torchrun (a process group must exist);
    what DDP allocates when it is built (its gradient buckets) counts as alive before the step.
    Built as train.py builds it, less the collectives that do nothing in one process: the
    broadcast of the weights and buffers when it is built (init_sync) and of the buffers at each
    forward (broadcast_buffers). Each copies what it sends into a new tensor that gloo's worker
    thread may free, out of the profiler's sight (it follows only this thread): counted as alive,
    that copy added the weights' size to ``held`` (or the buffers' to the step) in some runs and
    not others. In a larger group both copies are gone before the step's peak."""
    import contextlib

    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(seed)
    model = NashMHC(cfg.model)
    params = [p for p in model.parameters() if p.requires_grad]
    factory = AdamW if entry == "xla" else fused_adamw   # train.py's on CPU/CUDA (Muon's AdamW groups too)
    optimizer = build_optimizer(model, cfg.training, factory)
    def attention():
        return sdpa_kernel(SDPBackend.MATH) if entry == "xla" else contextlib.nullcontext()
    g = torch.Generator().manual_seed(seed)
    shape = (cfg.training.batch_size, cfg.data.seq_len)
    x = torch.randint(0, cfg.model.vocab_size, shape, generator=g)
    y = torch.randint(0, cfg.model.vocab_size, shape, generator=g)
    amp = torch.bfloat16 if cfg.training.precision == "bf16" else None
    accum = cfg.training.gradient_accumulation_steps
    held, net = 0, model
    if ddp:
        from torch.nn.parallel import DistributedDataParallel as DDP
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            net = DDP(model, gradient_as_bucket_view=True, init_sync=False, broadcast_buffers=False)
        held = sum(size for _, size in _allocations(prof))
    with attention():
        training_step(net, optimizer, params, x, y, accum, amp, cfg.training.grad_clip)  # state exists
    del optimizer.found_inf  # (would be freed during the measured step, allocated before it)
    if accum > 1 and ddp:  # a middle or last micro-step: the gradients are views of the buckets
        with attention():
            (net(x, y).loss / accum).backward()
    elif accum > 1:
        for p in params:
            p.grad = torch.zeros_like(p)
    grads = [] if ddp else [p.grad for p in params if p.grad is not None]
    before = held + live_bytes(model, optimizer, x, y, *grads)
    with attention(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                           profile_memory=True) as prof:
        training_step(net, optimizer, params, x, y, accum, amp, cfg.training.grad_clip)
    running = highest = 0
    for _, size in _allocations(prof):
        running += size
        highest = max(highest, running)
    return before + highest


def section_peak(args) -> list[dict]:
    rows = []
    for name, model in (("demo", DEMO), ("d_model 512", D512)):
        for streams in (1, 4):
            for ckpt in (False, True):
                cfg = small_config(dict(model, mhc_streams=streams, activation_checkpointing=ckpt))
                predicted = predict_step_peak(cfg)
                measured = measure_step_peak(cfg)
                rows.append(dict(model=name, streams=streams, checkpointing=ckpt, predicted=predicted,
                                 measured=measured, ratio=predicted / measured))
    print("\n### Predicted vs measured peak of one training step (CPU, fp32, batch 4 x seq 256)\n")
    print("| model | streams | checkpointing | predicted (MiB) | measured (MiB) | predicted / measured |")
    print("|---|---:|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['streams']} | {'on' if r['checkpointing'] else 'off'} | "
              f"{r['predicted'] / 2**20:.1f} | {r['measured'] / 2**20:.1f} | {r['ratio']:.3f} |")
    return rows


def loss_and_grads(cfg: Config, seed: int = 0):
    torch.manual_seed(seed)
    model = NashMHC(cfg.model)
    g = torch.Generator().manual_seed(seed + 1)
    shape = (cfg.training.batch_size, cfg.data.seq_len)
    x = torch.randint(0, cfg.model.vocab_size, shape, generator=g)
    y = torch.randint(0, cfg.model.vocab_size, shape, generator=g)
    y[0, :7] = -1  # some ignored targets
    loss = model(x, y).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def section_chunked_loss(args) -> list[dict]:
    rows = []
    base = dict(D512, vocab_size=16384, mhc_streams=4)
    ref_loss, ref_grads = loss_and_grads(small_config(base))
    ref_peak = measure_step_peak(small_config(base))
    for chunk in (0, 64, 100):  # positions: 4 x 64 tokens per chunk, and chunks that do not divide 256
        cfg = small_config(dict(base, loss_chunk=chunk))
        loss, grads = loss_and_grads(cfg)
        err = max(float(((grads[n] - ref_grads[n]).abs().max() / ref_grads[n].abs().max().clamp_min(1e-30)))
                  for n in grads)
        peak = ref_peak if chunk == 0 else measure_step_peak(cfg)
        rows.append(dict(loss_chunk=chunk, loss=float(loss), loss_diff=abs(float(loss - ref_loss)),
                         max_rel_grad_diff=err, measured_peak=peak, predicted_peak=predict_step_peak(cfg),
                         ratio_to_unchunked=peak / ref_peak))
    print("\n### Chunked cross-entropy (d_model 512, vocab 16384, batch 4 x seq 256 = 1024 tokens, fp32)\n")
    print("| loss_chunk | loss | abs. loss diff | max rel. grad diff | measured peak (MiB) | predicted (MiB) | peak / unchunked |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['loss_chunk'] or 'off'} | {r['loss']:.6f} | {r['loss_diff']:.2e} | {r['max_rel_grad_diff']:.2e} | "
              f"{r['measured_peak'] / 2**20:.1f} | {r['predicted_peak'] / 2**20:.1f} | {r['ratio_to_unchunked']:.3f} |")
    return rows


def section_stream_dtype(args) -> list[dict]:
    if "stream_dtype" not in ModelConfig.__dataclass_fields__:
        print("\n### stream_dtype: not in this model.py (nothing to measure)")
        return []
    rows = []
    for dtype in ("fp32", "bf16"):
        cfg = small_config(dict(D512, mhc_streams=4, stream_dtype=dtype))
        rows.append(dict(stream_dtype=dtype, measured=measure_step_peak(cfg), predicted=predict_step_peak(cfg),
                         loss=float(loss_and_grads(cfg)[0])))
    print("\n### stream_dtype (d_model 512, 4 streams, batch 4 x seq 256)\n")
    print("| stream_dtype | loss | measured peak (MiB) | predicted (MiB) |")
    print("|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['stream_dtype']} | {r['loss']:.6f} | {r['measured'] / 2**20:.1f} | {r['predicted'] / 2**20:.1f} |")
    return rows


ZERO_MODEL = dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32,
                  mhc_streams=2, nash_scales=2, nash_window=8)


def zero_config(over_data: bool) -> Config:
    """The SPMD run of the zero section: data 2 x fsdp 2 on 4 CPU devices, global batch 8 x 32."""
    cfg = small_config(ZERO_MODEL, batch=8, seq=32)
    xla = dataclasses.replace(cfg.xla, mode="spmd", shard_optimizer_over_data=over_data,
                              mesh=dataclasses.replace(cfg.xla.mesh, data=2, fsdp=2, tp=1))
    return dataclasses.replace(cfg, xla=xla)


def spmd_zero_run(over_data: bool) -> dict:
    """One forward and backward through the XLA backend's own SPMD set-up (prepare_model,
    prepare_optimizer, batches, reduce_gradients; PJRT CPU with CPU_NUM_DEVICES=4, in this process):
    the loss, every gradient's norm, and the bytes device 0 holds of the weights, the gradients and
    the optimiser state. (Whole runs with this sharding against one device: tests/test_train_xla.py.)"""
    import torch_xla.core.xla_model as xm
    from torch_xla.distributed.spmd.xla_sharding import wrap_as_sharded_tensor

    from training.xla_backend import XLABackend

    import tempfile
    cfg = zero_config(over_data)
    # The backend's launch check compares the data's identity (meta.json) across hosts; there is
    # one host and no data here: an empty meta.json stands for it.
    data_dir = tempfile.mkdtemp()
    Path(data_dir, "meta.json").write_text("{}")
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, dir=data_dir))
    backend = XLABackend(cfg)
    torch.manual_seed(0)
    model = backend.prepare_model(NashMHC(cfg.model), cfg)
    opt = build_optimizer(model, cfg.training, backend.adamw_factory())
    opt.init_state()
    backend.prepare_optimizer(opt)
    g = torch.Generator().manual_seed(1)
    batches = backend.batches([tuple(torch.randint(0, cfg.model.vocab_size, (8, 32), generator=g)
                                     for _ in range(2))])
    x, y = next(batches)
    loss = model(x, y).loss
    loss.backward()
    backend.reduce_gradients(opt)
    backend.sync()
    xm.wait_device_ops()
    backend.close_batches(batches)
    import shutil
    shutil.rmtree(data_dir)

    def device0(tensors) -> int:
        return sum(sh.data.numel() * sh.data.element_size()
                   for sh in (wrap_as_sharded_tensor(t).local_shards[0] for t in tensors))

    state = [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.ndim]
    return dict(loss=float(loss.detach().cpu()),
                grad_norms=[float(p.grad.detach().norm().cpu()) for p in model.parameters()],
                param_bytes=device0(list(model.parameters())),
                grad_bytes=device0([p.grad for p in model.parameters()]), state_bytes=device0(state))


def zero_runs() -> list[dict]:
    """spmd_zero_run for fsdp-only and data x fsdp sharding, in one child process with 4 CPU devices."""
    import subprocess
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4", "OMP_NUM_THREADS": "1",
           "TF_CPP_MIN_LOG_LEVEL": "3"}
    out = subprocess.run([sys.executable, __file__, "--zero-child"], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def section_zero(args) -> list[dict]:
    rows = zero_runs()
    print("\n### Gradients and optimizer state over data x fsdp (SPMD, 4 CPU devices: data 2 x fsdp 2)\n")
    print("| sharding | loss | gradient norms: max diff / largest | weights / device (KiB) | gradients / device (KiB) | optimizer state / device (KiB) |")
    print("|---|---:|---:|---:|---:|---:|")
    ref = rows[0]["grad_norms"]
    for r in rows:
        name = "data x fsdp (ZeRO-2)" if r["over_data"] else "fsdp only"
        diff = max(abs(a - b) for a, b in zip(r["grad_norms"], ref)) / max(ref)
        print(f"| {name} | {r['loss']:.6f} | {diff:.1e} | {r['param_bytes'] / 1024:.1f} | "
              f"{r['grad_bytes'] / 1024:.1f} | {r['state_bytes'] / 1024:.1f} |")
    return rows


SECTIONS = {"peak": section_peak, "chunked_loss": section_chunked_loss, "zero": section_zero,
            "stream_dtype": section_stream_dtype}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=list(SECTIONS), action="append")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--zero-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.zero_child:
        print(json.dumps([dict(over_data=z, **spmd_zero_run(z)) for z in (False, True)]))
        return 0
    torch.set_num_threads(1)
    results = {name: SECTIONS[name](args) for name in (args.only or SECTIONS)}
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
