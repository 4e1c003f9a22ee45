"""--plan (training/plan.py): the traced memory model against measured CPU steps, its shortcuts
against direct traces, the levers (chunked cross-entropy, ZeRO-style sharding) measured for memory
and loss, the command line, and every shipped config and README slice."""
from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from bench.plan import D512, DEMO, ZERO_MODEL, measure_step_peak, small_config, zero_config, zero_runs
from model import ModelConfig, NashMHC
from training import plan as P
from training.config import load_config
from training.loop import main

ROOT = Path(__file__).resolve().parents[1]


def plan_main(capsys, *argv, entry="xla"):
    """train_xla.py / train.py ARGV in this process: (exit code, stdout, stderr)."""
    prog = "train_xla.py" if entry == "xla" else "train.py"
    code = main(list(map(str, argv)), lambda cfg: pytest.fail("--plan started training"), prog, entry)
    out = capsys.readouterr()
    return code, out.out, out.err


# -- the memory model against the allocator ------------------------------------------------------

@pytest.mark.parametrize("model", [DEMO, D512], ids=["demo", "d512"])
@pytest.mark.parametrize("streams", [1, 4])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["no-ckpt", "ckpt"])
def test_predicted_step_peak_is_the_measured_one(model, streams, checkpointing):
    """The peak of a real CPU step, counted by the allocator (torch.profiler's memory events),
    against the planner's trace of the same step on fake tensors. The issue asked for 20%; the
    trace replays the same ops with the same lifetimes and agrees within 0.05% in every case here,
    so 1% is the bound: one optimiser state tensor left out of the plan is 4-17% of the peak."""
    cfg = small_config(dict(model, mhc_streams=streams, activation_checkpointing=checkpointing))
    measured = measure_step_peak(cfg)
    predicted = P.predict_step_peak(cfg)
    assert abs(predicted / measured - 1) < 0.01, (predicted, measured)


def _saved_by_compiled_forward(cfg) -> int:
    """Bytes of the distinct storages autograd saves for the backward in a real CPU forward of
    ``cfg``'s model with train.py's ``compile_regions`` (inductor on the CPU: the blocks and the
    loss compiled, the rest eager), under bf16 autocast; the parameters, buffers and the batch,
    which exist anyway, left out. ``saved_tensors_hooks`` see what AOTAutograd's compiled function
    saves (``ctx.save_for_backward`` of the forward graph's saved outputs), as they see eager ops'."""
    from training.backend import compile_regions
    torch.manual_seed(0)
    model = NashMHC(cfg.model)
    compile_regions(model)
    x = torch.randint(0, cfg.model.vocab_size, (cfg.training.batch_size, cfg.data.seq_len))
    y = torch.randint(0, cfg.model.vocab_size, x.shape)
    there = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers(), x, y]}

    def forward():
        saved, compiled = {}, [0]

        def pack(t):
            st = t.untyped_storage()
            if st.data_ptr() not in there:
                saved[st.data_ptr()] = st.nbytes()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", torch.bfloat16):
            out = model(x, y)
        assert type(out.loss.grad_fn).__name__ == "CompiledFunctionBackward"  # the hooks saw it
        return out, sum(saved.values())
    forward()[0].loss.backward()  # the first call compiles; measure a second, as a training step
    model.zero_grad(set_to_none=True)
    return forward()[1]


@pytest.mark.parametrize("streams", [1, 4])
def test_compiled_plan_saves_what_inductor_saves(streams):
    """With training.compile train.py compiles each block and the loss (compile_regions); inductor's
    partitioner (min-cut rematerialisation) decides what the forward keeps for the backward, far
    less than eager autograd keeps. The plan (for a GPU: train.py compiles on CUDA only) runs those
    regions through AOTAutograd and the same partitioner; what it holds for the backward when the
    backward begins (activations and autocast copies: saved tensors, and a few bytes of loss and
    stats) is checked against what a real CPU forward compiled by inductor saves. The same
    partitioner on the same Dynamo graphs makes the same cut: exact for the 1-stream block; the
    4-stream one is 3.2% over (torch 2.9): a few bf16 casts of the block's weights that the plan
    holds and inductor does not, and the attention masks, bytes that scale with the weights and
    not with the batch (at small_gpu's size a fraction of a percent). 5% is allowed. The eager
    plan of the same config saves much more (the reason for this)."""
    cfg = small_config(dict(DEMO, n_layers=2, mhc_streams=streams), batch=2, seq=64, precision="bf16",
                       compile=True)
    measured = _saved_by_compiled_forward(cfg)
    device = P.device_for("h100", "torch")
    layout = P.layout_for(cfg, "torch", 1)
    assert P.compiles(cfg, layout, device)

    def held_at_backward(c):
        trace = P.trace_step(c, layout, device)
        row = int(np.argmax(trace.phases == P.PHASES.index("backward")))
        kinds = {i for i, (kind, _) in enumerate(trace.columns) if kind in (P.ACT, P.COPIES)}
        return sum(nbytes for alloc, free, nbytes, col, *_ in trace.records
                   if col in kinds and alloc <= row < free)
    planned = held_at_backward(cfg)
    assert abs(planned / measured - 1) < 0.05, (planned, measured)
    eager = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, compile=False))
    assert held_at_backward(eager) > 1.3 * planned


def test_eager_plan_is_unchanged_without_compile():
    """training.compile false (and train.py on the CPU, which never compiles) plans the eager step,
    op by op as before the compiled regions were modelled: the same trace for a GPU with compile
    off as for the CPU with it on, no compiled region in it, and the compiled plan of the same
    config is another (lower) one."""
    cfg = small_config(dict(DEMO, n_layers=2), batch=2, seq=64, precision="bf16")
    on = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, compile=True))
    gpu, cpu = P.device_for("h100", "torch"), P.device_for("cpu", "torch")
    layout = P.layout_for(cfg, "torch", 1)
    assert not P.compiles(cfg, layout, gpu) and not P.compiles(on, layout, cpu)
    assert not P.compiles(on, P.layout_for(on, "xla", 1), P.device_for("v4", "xla"))
    off_gpu, on_cpu, on_gpu = P.trace_step(cfg, layout, gpu), P.trace_step(on, layout, cpu), P.trace_step(on, layout, gpu)
    assert off_gpu.ops == on_cpu.ops and np.array_equal(off_gpu.live, on_cpu.live)
    assert not any("compiled" in w for w in off_gpu.where)
    assert any("compiled backward" in w for w in on_gpu.where)
    assert P.peak_of(on_gpu, layout).total < P.peak_of(off_gpu, layout).total
    assert P.predict_step_peak(cfg, device_kind="h100") == P.peak_of(off_gpu, layout).total


def test_xla_prediction_counts_attention_scores_as_the_math_path_makes_them():
    """For TPUs the plan runs attention as ATen's math path (what XLA lowers it to): checked on the
    CPU against a real step on that path, with the tensor-op AdamW the XLA backend uses."""
    cfg = small_config(dict(DEMO, mhc_streams=4))
    measured = measure_step_peak(cfg, entry="xla")
    predicted = P.predict_step_peak(cfg, entry="xla")
    assert abs(predicted / measured - 1) < 0.01, (predicted, measured)   # 0.09% here
    assert measured > measure_step_peak(cfg)  # the scores cost memory a fused kernel does not


@pytest.mark.parametrize("model", [dict(n_layers=8, activation_checkpointing=True),
                                   dict(n_layers=3, vocab_size=32768, tie_embeddings=False)])
def test_predicted_muon_step_peak_is_the_measured_one_at_depth(model):
    """Muon orthogonalises the matrices of one shape stacked over every layer: its update's
    temporaries grow with depth, and the plan, which traces three blocks and deepens them, traces
    the update on the full-depth model (it was 0.71 of the measured peak at eight blocks). Its
    AdamW groups (embedding, LM head) run train.py's fused kernel in both: the plan had traced
    the tensor-op AdamW, whose temporaries made the large-vocabulary step 1.41x the real one."""
    from bench import plan as bench_plan
    from training.backend import TorchBackend

    assert bench_plan.fused_adamw is TorchBackend("cpu").adamw_factory()   # measured as train.py runs
    cfg = small_config(dict(DEMO, mhc_streams=1, **model), batch=1, seq=64, optimizer="muon")
    measured = measure_step_peak(cfg)
    predicted = P.predict_step_peak(cfg)
    assert abs(predicted / measured - 1) < 0.01, (predicted, measured)


@pytest.mark.parametrize("accum", [1, 2])
def test_train_py_ddp_counts_the_gradient_buckets_from_the_start(tmp_path, accum):
    """train.py under torchrun wraps the model in DDP, whose reducer allocates a bucket per
    gradient when it is built and holds it all run (p.grad becomes a view of it): the gradients
    are there in the forward and in evaluation. Measured on a one-process gloo group, which holds
    what each process of a larger one holds; the plan counted the gradients only when they were
    made in the backward (or accumulated), and planned evaluation without them."""
    import torch.distributed as dist
    cfg = small_config(dict(DEMO, n_layers=2), batch=2, seq=64, gradient_accumulation_steps=accum)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        measured = measure_step_peak(cfg, ddp=True)
    finally:
        dist.destroy_process_group()
    assert abs(P.predict_step_peak(cfg, world_size=2) / measured - 1) < 0.01
    plan, _ = P.make_plan(cfg, "torch", P.device_for("cpu", "torch"), world_size=2)
    with torch.device("meta"):
        grads = sum(p.numel() * 4 for p in NashMHC(cfg.model).parameters())
    assert plan.train.parts["gradients"] == plan.evaluation.parts["gradients"] == grads


@pytest.mark.parametrize("accum", [1, 2])
def test_train_xla_evaluates_beside_the_gradients_it_holds(accum):
    """train_xla.py with accumulation holds every gradient buffer all run (XLABackend.keep_gradients:
    zeroed after each update, never freed), so its evaluation peak counts them (the plan had left
    them out: the 3B plan's evaluation column was 3.16 GiB short); without accumulation they are
    freed after each update."""
    cfg = load_config(str(ROOT / "configs" / "demo.yaml"), [f"training.gradient_accumulation_steps={accum}"])
    plan, _ = P.make_plan(cfg, "xla", P.device_for("v5e", "xla"))
    with torch.device("meta"):
        grads = sum(p.numel() * 4 for p in NashMHC(cfg.model).parameters())
    assert plan.evaluation.parts["gradients"] == (grads if accum > 1 else 0)
    if accum > 1:  # at the training peak too (a middle micro-step's forward); without, the peak may precede them
        assert plan.train.parts["gradients"] == grads
    # train.py on one device frees them after each update (zero_grad(set_to_none=True)), accumulating or not
    one, _ = P.make_plan(cfg, "torch", P.device_for("cpu", "torch"), world_size=1)
    assert one.evaluation.parts["gradients"] == 0


def _phases(trace, layout):
    per_chip = trace.per_chip(layout)
    return {P.PHASES[p]: per_chip[trace.phases == p] for p in set(trace.phases.tolist())}


@pytest.mark.parametrize("over", [
    dict(),
    dict(activation_checkpointing=True),
    dict(activation_checkpointing=True, gradient_accumulation_steps=2, precision="bf16"),
    dict(mhc_streams=1, loss_chunk=48, precision="bf16"),
    dict(activation_checkpointing=True, optimizer="muon"),
], ids=["plain", "ckpt", "ckpt-accum-bf16", "1-stream-chunked-bf16", "ckpt-muon"])
@pytest.mark.parametrize("evaluation", [False, True], ids=["train", "eval"])
def test_deepened_trace_equals_a_direct_trace(over, evaluation):
    """Three traced blocks stretched to eight give, op by op, the memory of tracing all eight:
    equal in the backward pass and the optimizer step (traced on the full-depth model), a few bytes
    per block apart in the forward (the blocks' stats, stacked at the end, are 20 bytes each)."""
    training = {k: over.pop(k) for k in ("gradient_accumulation_steps", "precision", "optimizer") if k in over}
    cfg = small_config(dict(DEMO, n_layers=8, **over), batch=2, seq=64, **training)
    device = P.device_for("v4", "xla")
    layout = dataclasses.replace(P.layout_for(cfg, "xla", None), mode="spmd",
                                 mesh={"data": 1, "fsdp": 2, "tp": 1})
    deep = _phases(P.trace_step(cfg, layout, device, evaluation=evaluation), layout)
    direct = _phases(P.trace_step(cfg, layout, device, evaluation=evaluation, deepen=False), layout)
    assert deep.keys() == direct.keys()
    for phase in deep:
        assert deep[phase].shape == direct[phase].shape, phase
        assert np.abs(deep[phase] - direct[phase]).max() <= (1024 if phase in ("forward", "evaluation") else 0), phase


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_plans_share_an_optimizer_trace_only_where_the_update_is_the_same(optimizer):
    """A deep model's optimizer step is traced once for every plan of a model with the same
    parameters, optimiser (``OPTIMIZER_FIELDS``) and entry: what ``build_optimizer`` reads of the
    training section is among those fields, and a plan at another batch, sequence length,
    accumulation, precision and mesh, with the levers' model settings, whose optimizer phase reuses
    the first plan's trace, equals one traced afresh."""
    read = set()

    class Reading:  # the training section, noting each field the optimiser reads
        def __init__(self, t):
            self._t = t

        def __getattr__(self, name):
            read.add(name)
            return getattr(self._t, name)

    from training.optim import build_optimizer
    cfg = small_config(dict(DEMO, n_layers=4), batch=2, seq=64, optimizer=optimizer)
    build_optimizer(NashMHC(dataclasses.replace(cfg.model, n_layers=1)), Reading(cfg.training), torch.optim.AdamW)
    assert read and read <= set(P.OPTIMIZER_FIELDS), read - set(P.OPTIMIZER_FIELDS)
    device = P.device_for("v4", "xla")
    P._TRACES.clear()
    P._OPTIMIZER_TRACES.clear()
    P.trace_step(cfg, P.layout_for(cfg, "xla", None), device)
    other = small_config(dict(DEMO, n_layers=4, activation_checkpointing=True, loss_chunk=16, stream_dtype="bf16"),
                         batch=6, seq=32, optimizer=optimizer, precision="bf16", gradient_accumulation_steps=3)
    layout = dataclasses.replace(P.layout_for(other, "xla", None), mode="spmd", mesh={"data": 1, "fsdp": 2, "tp": 1})
    shared = _phases(P.trace_step(other, layout, device), layout)["optimizer"]
    assert len(P._OPTIMIZER_TRACES) == 1
    P._TRACES.clear()
    P._OPTIMIZER_TRACES.clear()
    fresh = _phases(P.trace_step(other, layout, device), layout)["optimizer"]
    assert np.array_equal(shared, fresh)


def test_sharded_state_is_divided_and_activations_are_not():
    """On an SPMD mesh the weights, gradients and optimiser state per chip are the whole model's
    divided by the sharding rule (training/sharding.py), shard by shard; activations depend only on
    the per-chip batch."""
    cfg = small_config(dict(DEMO, n_layers=2), batch=8, seq=64)
    device = P.device_for("v4", "xla")
    with torch.device("meta"):
        model = NashMHC(cfg.model)
    one = P.Layout("xla", "spmd", {"data": 1, "fsdp": 1, "tp": 1}, 1, 1, 2, zero=False)
    many = P.Layout("xla", "spmd", {"data": 2, "fsdp": 4, "tp": 2}, 16, 1, 2, zero=True)
    trace = P.trace_step(cfg, one, device)
    a, b = P.peak_of(trace, one), P.peak_of(trace, many)
    weights = sum(p.numel() * 4 for p in model.parameters())
    from training.sharding import param_partition_spec, shard_factor, state_partition_spec
    sharded = sum(p.numel() * 4 / shard_factor(param_partition_spec(n, p), many.mesh)
                  for n, p in model.named_parameters())
    state = sum(p.numel() * 4 / shard_factor(state_partition_spec(param_partition_spec(n, p), True), many.mesh)
                for n, p in model.named_parameters())
    buffers = sum(b.numel() * 4 for b in model.buffers())
    assert a.parts["weights (fp32)"] == weights + buffers
    assert b.parts["weights (fp32)"] == pytest.approx(sharded + buffers)
    steps = 4 * sum(1 for _ in model.parameters())  # AdamW's 0-dim step counters, replicated
    assert b.parts["optimizer state"] == pytest.approx(2 * state + steps)
    for part in ("saved activations", "backward temporaries, recompute", "input batches"):
        assert a.parts[part] == b.parts[part], part
    # a weight meeting activations is all-gathered for that op: nothing to gather on one chip
    assert (trace.gathered @ trace.scales(one)[1]).max() == 0
    assert (trace.gathered @ trace.scales(many)[1]).max() > 0


def test_train_py_fsdp_divides_weights_gradients_and_state_over_the_processes():
    """train.py with training.fsdp under torchrun: FSDP2 splits every parameter on dim 0 over the
    processes, and its gradient and optimizer state with it, so those parts per GPU are the
    whole model's divided by the process count; activations are per GPU already. The plan
    counted them whole, as under DDP, and refused runs that fit."""
    cfg = small_config(dict(DEMO, n_layers=2), batch=2, seq=64, fsdp=True)
    device = P.device_for("h100", "torch")
    ddp = P.layout_for(dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, fsdp=False)),
                       "torch", 4)
    fsdp = P.layout_for(cfg, "torch", 4)
    assert (ddp.mode, fsdp.mode, fsdp.replicas) == ("ddp", "fsdp2", 4)
    assert "FSDP2 over 4 process(es)" in fsdp.describe()
    assert P.layout_for(cfg, "torch", 1).mode == "ddp"  # one process: train.py does not shard
    trace = P.trace_step(cfg, ddp, device)
    whole, split = P.peak_of(trace, ddp), P.peak_of(trace, fsdp)
    with torch.device("meta"):
        model = NashMHC(cfg.model)
    weights = sum(p.numel() * 4 for p in model.parameters())
    buffers = sum(b.numel() * 4 for b in model.buffers())
    assert whole.parts["weights (fp32)"] == weights + buffers
    assert split.parts["weights (fp32)"] == pytest.approx(weights / 4 + buffers)
    steps = 4 * len(list(model.parameters()))  # the 0-dim step counters: not sharded
    assert split.parts["optimizer state"] == pytest.approx((whole.parts["optimizer state"] - steps) / 4 + steps)
    for part in ("saved activations", "input batches"):
        assert whole.parts[part] == split.parts[part], part
    # FSDP2 holds some parameters whole while the step runs: the root's (embedding, head) and
    # the running and the prefetched block's; the rest of each is the chip's own shard
    blocks = [sum(p.numel() * 4 for p in b.parameters()) for b in model.blocks]
    held = weights - sum(blocks) + 2 * max(blocks)
    assert whole.parts["all-gathered weights"] == 0
    assert split.parts["all-gathered weights"] == pytest.approx(held * (1 - 1 / 4))
    for peak in (whole, split):   # the plan's total (what "fits" decides on) is the sum of its lines
        assert peak.total == pytest.approx(sum(peak.parts.values()), rel=1e-12)


def test_train_py_fsdp_holds_autocasts_weight_copies_whole():
    """Under FSDP2 autocast casts the weights a block's all-gather made whole, so each process holds
    whole bf16 copies, as under DDP (a 2-process gloo run of a d512 model saves 10.1 MiB of them
    on rank 0, against the 6.8 MiB of half the 2-D weights the plan counted)."""
    cfg = small_config(dict(DEMO, n_layers=2), batch=2, seq=64, fsdp=True, precision="bf16")
    ddp, fsdp = P.layout_for(cfg, "torch", 1), P.layout_for(cfg, "torch", 4)
    trace = P.trace_step(cfg, ddp, P.device_for("h100", "torch"))
    copies = [i for i, (kind, _) in enumerate(trace.columns) if kind == P.COPIES]
    end = trace.live[trace.marks["forward end"], copies]
    assert end.sum() > 0
    assert end @ trace.scales(fsdp)[0][copies] == end @ trace.scales(ddp)[0][copies]


def test_scan_layers_adds_the_stacked_block_weights_and_their_gradient():
    """xla.scan_layers stacks the blocks' weights into [n_layers, ...] tensors for the loop, and
    its backward makes their stacked gradient: the training peak grows by one to two stacked
    copies (sharded like the weights), the evaluation peak by one."""
    cfg = small_config(dict(DEMO, n_layers=5), batch=2, seq=64)
    device = P.device_for("v4", "xla")
    layout = dataclasses.replace(P.layout_for(cfg, "xla", None), mode="spmd",
                                 mesh={"data": 1, "fsdp": 2, "tp": 1})
    with torch.device("meta"):
        model = NashMHC(cfg.model)
    stacked = sum(p.numel() * 4 / layout.param_factor(P.param_partition_spec(n, p))
                  for n, p in model.named_parameters() if n.startswith("blocks."))
    scan = dataclasses.replace(cfg, xla=dataclasses.replace(cfg.xla, scan_layers=True))
    for evaluation, lo, hi in ((False, 1, 2), (True, 1, 1)):
        off = P.peak_of(P.trace_step(cfg, layout, device, evaluation=evaluation), layout).total
        on = P.peak_of(P.trace_step(scan, layout, device, evaluation=evaluation), layout).total
        assert lo * stacked - 1024 <= on - off <= hi * stacked + 1024, (evaluation, on - off, stacked)


# -- levers ------------------------------------------------------------------------------------

CE_MODEL = ModelConfig(vocab_size=97, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, max_seq_len=64,
                       mhc_streams=2, nash_scales=2, nash_window=8, tie_embeddings=False)


def _batch():
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 97, (3, 40), generator=g)
    y = torch.randint(0, 97, (3, 40), generator=g)
    y[0, :5] = -1
    y[2, 30:] = -1
    return x, y


def _loss_and_grads(mcfg: ModelConfig, train: bool = True):
    torch.manual_seed(0)
    model = NashMHC(mcfg).train(train)
    x, y = _batch()
    loss = model(x, y).loss
    if not train:
        return loss.detach(), None
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("chunk", [1, 7, 32, 120, 500])
def test_chunked_cross_entropy_is_torchs_cross_entropy(chunk):
    """Any chunk size (dividing the 40 positions or not, or larger) gives F.cross_entropy's mean over
    the targets that are not -1 on the whole logits, and the same gradients (fp32 sums in another
    order: 1e-5), in training (checkpointed chunks) and in evaluation."""
    torch.manual_seed(0)
    model = NashMHC(CE_MODEL)
    x, y = _batch()
    with torch.no_grad():
        h, _ = model.trunk(x)
        ref = F.cross_entropy(model.lm_head(h).flatten(0, 1), y.flatten(), ignore_index=-1)
    chunked = dataclasses.replace(CE_MODEL, loss_chunk=chunk)
    ref_loss, ref_grads = _loss_and_grads(CE_MODEL)
    loss, grads = _loss_and_grads(chunked)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=0)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-5, atol=1e-7, msg=name)
    torch.testing.assert_close(_loss_and_grads(chunked, train=False)[0], ref, rtol=1e-5, atol=0)


def test_chunked_cross_entropy_lowers_the_measured_peak_as_planned():
    """A vocabulary-heavy model (the 3B config's shape in small): chunked, the step's measured peak
    drops by most of the [tokens, vocab] tensors, and the plan predicts both peaks."""
    base = dict(D512, vocab_size=16384, n_layers=1, mhc_streams=4)
    whole, chunked = small_config(base), small_config(dict(base, loss_chunk=32))  # 4 x 32 tokens
    m_whole, m_chunked = measure_step_peak(whole), measure_step_peak(chunked)
    p_whole, p_chunked = P.predict_step_peak(whole), P.predict_step_peak(chunked)
    logits = 4 * 256 * 16384 * 4  # one fp32 [tokens, vocab] tensor
    assert m_whole - m_chunked > logits
    assert abs((p_whole - p_chunked) / (m_whole - m_chunked) - 1) < 0.03   # 1.3% here
    for predicted, measured in ((p_whole, m_whole), (p_chunked, m_chunked)):
        assert abs(predicted / measured - 1) < 0.01, (predicted, measured)


@pytest.mark.xla
@pytest.mark.slow  # ~40 s: two SPMD compiles on a 4-device PJRT CPU mesh
def test_optimizer_state_and_gradients_over_data_x_fsdp():
    """xla.shard_optimizer_over_data on data 2 x fsdp 2 (4 CPU devices, the XLA backend's own
    prepare_model/prepare_optimizer): the same loss and gradients as fsdp-only sharding (to 1e-5
    of the largest gradient: some gradients are rounding noise of 1e-13 at initialisation, where
    eager CPU and fsdp-only differ too), half the gradient and optimiser-state bytes per device,
    and the bytes the planner predicts for that mesh. Training runs with it on: test_train_xla.py's
    data 2 x fsdp 2 mesh against one device."""
    fsdp_only, zero = zero_runs()
    assert zero["loss"] == pytest.approx(fsdp_only["loss"], rel=1e-6)
    # The two shardings reduce the same fp32 gradients in another order (a reduce-scatter over
    # data x fsdp against a reduce-scatter over fsdp and an all-reduce over data): a difference of
    # a few ulps of the largest gradient entries. A relative tolerance alone fails on the gradients
    # that are zero in exact arithmetic at initialisation and come out as rounding noise (1e-13)
    # whose value depends on that order; the absolute floor is that rounding scale, 1e-5 of the
    # largest gradient norm (fp32 eps 1.2e-7 times a few additions, with room).
    np.testing.assert_allclose(zero["grad_norms"], fsdp_only["grad_norms"], rtol=1e-5,
                               atol=1e-5 * max(fsdp_only["grad_norms"]))
    assert zero["param_bytes"] == fsdp_only["param_bytes"]
    # every gradient laid out like its weight: left to GSPMD since the activations are annotated,
    # the sharded weights' gradients came out whole on every device (twice these bytes here)
    assert fsdp_only["grad_bytes"] == fsdp_only["param_bytes"]
    for key in ("grad_bytes", "state_bytes"):
        assert zero[key] < 0.6 * fsdp_only[key], key  # 1/2, but 1-D tensors stay replicated
    for run, over in ((fsdp_only, False), (zero, True)):
        cfg = zero_config(over)
        layout = P.layout_for(cfg, "xla", None)
        assert layout.zero == over
        peak = P.peak_of(P.trace_step(cfg, layout, P.device_for("cpu", "xla")), layout)
        assert peak.parts["weights (fp32)"] == pytest.approx(run["param_bytes"] + _buffers(cfg), rel=0.02)
        # the optimiser's step counters are 0-dim tensors the measurement leaves out
        assert peak.parts["optimizer state"] == pytest.approx(run["state_bytes"], rel=0.02)


def _buffers(cfg) -> int:
    with torch.device("meta"):
        return sum(b.numel() * b.element_size() for b in NashMHC(cfg.model).buffers())


# -- the command line --------------------------------------------------------------------------

def test_plan_of_a_config_that_does_not_fit_offers_levers_that_make_it_fit(capsys, tmp_path):
    """Exit 1, the levers in order; applying the last line's overrides gives a plan that fits, at
    the memory the lever announced."""
    cfg = ROOT / "configs" / "demo.yaml"
    code, out, _ = plan_main(capsys, cfg, "--plan", "--device-kind", "v5e", "--margin", "0.996")
    assert code == 1 and "does not fit" in out, out
    levers = [line.split() for line in out.splitlines() if line.startswith("  ") and "=" in line.split()[0]]
    assert any("model.loss_chunk" in w[0] for w in levers)
    fitting = [w for w in levers if "fits" in w]
    assert fitting, out
    overrides = [w for lever in levers[:levers.index(fitting[0]) + 1] for w in lever if "=" in w]
    unit = next(i for i, w in enumerate(fitting[0]) if w in ("GiB", "MiB"))
    announced = f"fits: {fitting[0][unit - 1]} {fitting[0][unit]} of"
    code, out, _ = plan_main(capsys, cfg, *overrides, "--plan", "--device-kind", "v5e", "--margin", "0.996")
    assert code == 0 and announced in out, (announced, out)


def test_mesh_lever_keeps_data_a_multiple_of_dcn_data():
    """Moving chips from data to fsdp stops where data would no longer span the dcn_data slices
    (it went on to data 1, a config train_xla.py refuses); every lever's overrides load."""
    over = ["xla.mode=spmd", "xla.mesh.data=8", "xla.mesh.fsdp=1", "xla.mesh.dcn_data=2",
            "training.batch_size=16"]
    cfg = load_config(ROOT / "configs" / "demo.yaml", over)
    plan, trace = P.make_plan(cfg, "xla", P.device_for("v5e", "xla"), margin=0.9999)
    levers = P.find_levers(plan, "xla", trace)
    meshes = [lev.overrides for lev in levers if lev.overrides[0].startswith("xla.mesh.data=")]
    assert meshes == [["xla.mesh.data=4", "xla.mesh.fsdp=2"], ["xla.mesh.data=2", "xla.mesh.fsdp=4"]]
    # with no data axis there is nothing to shard the state over: no such lever
    one = load_config(ROOT / "configs" / "demo.yaml", ["xla.mode=spmd", "xla.mesh.data=1", "xla.mesh.fsdp=8",
                                                        "training.batch_size=16",
                                                        "xla.shard_optimizer_over_data=false"])
    plan, trace = P.make_plan(one, "xla", P.device_for("v5e", "xla"), margin=0.9999)
    assert not plan.fits   # (margin 0.9999) so every lever is looked for
    assert not any("xla.shard_optimizer_over_data=true" in lev.overrides for lev in P.find_levers(plan, "xla", trace))
    for i in range(len(levers)):
        load_config(ROOT / "configs" / "demo.yaml", over + [o for lev in levers[:i + 1] for o in lev.overrides])


def test_each_lever_announces_the_peak_of_its_config():
    """Each lever's peak is the plan of the config with its overrides and those above it: the
    evaluation peak too is the new layout's (the optimizer-sharding and mesh levers reused the
    first layout's, which, unsharded, decided the announced peak)."""
    path = ROOT / "configs" / "demo.yaml"
    over = ["xla.mode=spmd", "xla.mesh.data=8", "xla.mesh.fsdp=1", "training.batch_size=8",
            "xla.shard_optimizer_over_data=false", "model.d_model=256", "model.vocab_size=16384"]
    device = P.device_for("v5e", "xla")
    plan, trace = P.make_plan(load_config(path, over), "xla", device, margin=0.9999)
    levers = P.find_levers(plan, "xla", trace)
    assert any(lev.overrides[0].startswith("xla.mesh.data=") for lev in levers)
    for lev in levers:
        over += lev.overrides
        replanned, _ = P.make_plan(load_config(path, over), "xla", device, margin=0.9999)
        assert lev.peak == pytest.approx(replanned.peak, rel=1e-9), lev.overrides


def test_train_py_ddp_is_offered_fsdp2_where_the_state_does_not_fit(capsys):
    """train.py under DDP holds every weight, gradient and optimizer state on every GPU: the lever
    that fits the 3B model on eight 40 GB A100s is training.fsdp=true (offered first, at the peak
    FSDP2's own plan has), not what the DDP plan used to list (bf16 streams, smaller micro-batches,
    then "a larger fsdp axis", which train.py does not have). Where the activations are what does
    not fit, it is not offered."""
    path = ROOT / "configs" / "nash_mhc_3b.yaml"
    device = P.device_for("a100-40", "torch")
    over = ["training.compile=false"]
    plan, trace = P.make_plan(load_config(path, over), "torch", device, world_size=8)
    levers = P.find_levers(plan, "torch", trace)
    assert not plan.fits and levers[0].overrides == ["training.fsdp=true"] and levers[0].peak <= plan.usable
    fsdp, _ = P.make_plan(load_config(path, over + levers[0].overrides), "torch", device, world_size=8)
    assert fsdp.fits and levers[0].peak == pytest.approx(fsdp.peak, rel=1e-9)
    code, out, _ = plan_main(capsys, ROOT / "configs" / "demo.yaml", "--plan", "--device-kind", "cpu", "--world-size",
                             "4", "model.vocab_size=32768", "training.batch_size=80", entry="torch")
    assert code == 1 and "training.fsdp=true" not in out and "model.loss_chunk=" in out, out


def test_the_cpu_plans_each_process_on_its_share_of_the_hosts_ram(capsys):
    """Processes (or PJRT CPU devices) on the CPU share one host's RAM: four of them have a
    quarter each (the plan had compared one process's peak with the whole RAM)."""
    ram = P.device_for("cpu", "torch").memory
    for entry, over in (("torch", ["--world-size", "4"]),
                        ("xla", ["xla.mode=spmd", "xla.mesh.data=4", "training.batch_size=32"])):
        cfg_over = [o for o in over if "=" in o]
        world = 4 if "--world-size" in over else None
        plan, _ = P.make_plan(load_config(ROOT / "configs" / "demo.yaml", cfg_over), entry,
                              P.device_for("cpu", entry), world_size=world)
        assert plan.device.memory == ram // 4, entry
        code, out, _ = plan_main(capsys, ROOT / "configs" / "demo.yaml", "--plan", "--device-kind", "cpu", *over,
                                 entry=entry)
        assert f"({ram // 4 / 2 ** 30:.1f} GiB per chip: the host's RAM over 4)" in out, out


def test_a_one_stream_model_is_not_offered_bf16_streams():
    """model.stream_dtype applies to mHC's streams only: with one stream the lever changes nothing."""
    cfg = load_config(ROOT / "configs" / "demo.yaml", ["model.mhc_streams=1", "model.nash_scales=1"])
    plan, trace = P.make_plan(cfg, "torch", P.device_for("a100-40", "torch"), world_size=2, margin=0.99999)
    levers = P.find_levers(plan, "torch", trace)
    assert levers and not any("stream_dtype" in o for lev in levers for o in lev.overrides)


@pytest.mark.parametrize("argv, message", [
    (["--device-kind", "v7"], "--device-kind 'v7': expected one of"),
    (["--device-kind", "h100"], "train_xla.py plans for TPUs"),
    (["--mfu", "0"], "--mfu '0': expected a value in (0, 1]"),
    (["--mfu", "fast"], "--mfu 'fast': expected a number"),
    (["--margin", "1"], "--margin '1': expected a value in [0, 1)"),
    (["--device-kind", "v4", "--world-size", "3"], "--world-size 3: the SPMD mesh"),
    (["training.batch_sise=2"], "did you mean 'training.batch_size'"),
    # what train_xla.py refuses (training.config.check_xla): the plan said it fits
    (["--device-kind", "v4", "training.batch_size=6"], "training.batch_size=6 is the global batch"),
    (["--device-kind", "v4", "model.dropout=0.1"], "xla.scan_layers=true with model.dropout=0.1"),
])
def test_plan_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    code, out, err = plan_main(capsys, ROOT / "configs" / "nash_mhc_3b.yaml", "--plan", *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and message in err, err


def test_the_plan_says_what_the_run_would_warn_about(capsys):
    """A warmup as long as the run is legal, and said when the run starts: --plan, which is read
    before starting one, said nothing of it."""
    code, out, err = plan_main(capsys, ROOT / "configs" / "demo.yaml", "training.max_steps=100",
                               "training.warmup_steps=500", "--plan", entry="torch")
    assert code == 0 and "steps             100" in out
    assert err.splitlines() == ["warning: training.warmup_steps=500 is not below the run's 100 steps: the "
                                "learning rate rises for the whole run and never decays"]


def test_plan_options_without_plan_are_refused(capsys):
    for flag, value in (("--device-kind", "v4"), ("--mfu", "0.5"), ("--margin", "0.2")):
        code, _, err = plan_main(capsys, ROOT / "configs" / "demo.yaml", flag, value)
        assert code == 2 and f"{flag} is a --plan option" in err


def test_an_unknown_flag_is_one_line_not_the_usage(capsys):
    with pytest.raises(SystemExit) as e:
        plan_main(capsys, ROOT / "configs" / "demo.yaml", "--plan", "--bogus")
    err = capsys.readouterr().err
    assert e.value.code == 2 and err == "train_xla.py: error: unrecognized arguments: --bogus (see --help)\n"


def test_an_override_written_as_a_flag_is_named_not_every_override_after_it(capsys):
    """``--training.max_steps=3``: argparse called it and every override after it unrecognised."""
    with pytest.raises(SystemExit) as e:
        plan_main(capsys, ROOT / "configs" / "demo.yaml", "--training.max_steps=3", "checkpoint.dir=x", "--plan")
    err = capsys.readouterr().err
    assert e.value.code == 2 and err == ("train_xla.py: error: --training.max_steps=3: overrides take no leading "
                                         "--: training.max_steps=3 (see --help)\n")


CONFIG_TARGETS = {  # config -> (entry, device kinds it is meant for)
    "demo.yaml": ("xla", ["v6e", "cpu"]),
    "demo_baseline.yaml": ("xla", ["v6e"]),
    "small_gpu.yaml": ("torch", ["h100", "a100"]),  # 80 GB: a 40 GB A100 needs the levers --plan lists
    "small_gpu_baseline.yaml": ("torch", ["h100"]),
    "nash_mhc_3b.yaml": ("xla", ["v4"]),
}


def test_every_shipped_config_has_a_target():
    assert sorted(p.name for p in (ROOT / "configs").glob("*.yaml")) == sorted(CONFIG_TARGETS)


@pytest.mark.parametrize("name", sorted(CONFIG_TARGETS))
def test_every_shipped_config_fits_its_target(capsys, name):
    entry, kinds = CONFIG_TARGETS[name]
    for kind in kinds:
        code, out, err = plan_main(capsys, ROOT / "configs" / name, "--plan", "--device-kind", kind, entry=entry)
        assert code == 0 and "\nfits: " in out, out + err
        for part in ("weights (fp32)", "gradients", "optimizer state", "saved activations", "input batches",
                     "tokens per step", "time to budget" if kind != "cpu" else "no peak FLOP/s"):
            assert part in out, part


README_SLICES = re.compile(r"^\| (?:\d+ × )?(v\w+)-\d+[^|]*\| (\d+) chips?[^|]*\| 3B[^|]*\| (.*) \|$", re.MULTILINE)


def test_readme_slice_table_fits_as_stated():
    """Every 3B row of the README's slice table, with the settings it states, has as many chips as
    its mesh and fits them."""
    readme = (ROOT / "README.md").read_text()
    rows = README_SLICES.findall(readme)
    assert len(rows) >= 5, rows
    for kind, chips, settings in rows:
        overrides = re.findall(r"`([\w.]+=[\w.]+)`", settings)
        cfg = load_config(ROOT / "configs" / "nash_mhc_3b.yaml", overrides)
        m = cfg.xla.mesh
        assert m.data * m.fsdp * m.tp == int(chips), (kind, overrides)
        plan, _ = P.make_plan(cfg, "xla", P.device_for(kind, "xla"))
        assert plan.fits, (kind, overrides, plan.peak / P.GiB)


def test_readme_tpu_command_for_small_gpu_fits_one_v6e_chip():
    """The README's one-host TPU line for small_gpu (v6e-1 in the slice table), as written."""
    readme = (ROOT / "README.md").read_text()
    line = next(ln for ln in readme.splitlines() if ln.startswith("python train_xla.py configs/small_gpu.yaml"))
    overrides = line.split("#")[0].split()[3:]
    plan, _ = P.make_plan(load_config(ROOT / "configs" / "small_gpu.yaml", overrides), "xla",
                          P.device_for("v6e", "xla"))
    assert plan.fits, (overrides, plan.peak / P.GiB)


def test_readme_shows_the_current_plan_of_the_3b_config(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    code, out, _ = plan_main(capsys, "configs/nash_mhc_3b.yaml", "--plan", "--device-kind", "v4")
    assert code == 0
    assert out.strip() in (ROOT / "README.md").read_text(), \
        "README's plan of the 3B config is stale: run `python -m training.docs`"


@pytest.mark.slow
def test_plan_command_line(tmp_path):
    """The real command: no device, no data directory, nothing allocated beyond the interpreter."""
    r = subprocess.run([sys.executable, "train.py", "configs/small_gpu.yaml", "--plan", "--device-kind",
                        "h100", "--world-size", "8", "--usd-per-chip-hour", "3", "data.dir=/nonexistent"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "8 replica(s)" in r.stdout and "$" in r.stdout
    steps = int(re.search(r"steps\s+([\d,]+)", r.stdout).group(1).replace(",", ""))
    assert steps == 2_500_000_000 // (32 * 4 * 1024 * 8)  # total_tokens / (batch x accumulation x seq x replicas)


@pytest.mark.parametrize("name, total, memory", [
    ("NVIDIA A100-SXM4-80GB", 85_899_345_920, {"a100": 85_899_345_920, "a100-40": 40 * 10 ** 9}),
    ("NVIDIA A100-SXM4-40GB", 42_505_273_344, {"a100": 80 * 10 ** 9, "a100-40": 42_505_273_344}),
    ("NVIDIA H100 80GB HBM3", 85_520_809_984, {"h100": 85_520_809_984, "a100": 80 * 10 ** 9}),
    ("NVIDIA GH200 480GB", 102_005_473_280, {"h200": 141 * 10 ** 9, "h100": 80 * 10 ** 9}),  # not an H200
])
def test_gpu_memory_is_the_installed_gpus_only_for_its_own_kind(monkeypatch, name, total, memory):
    """--device-kind takes the memory torch.cuda reports only when the GPU installed here is of that
    kind; another kind keeps its table memory (an A100 80GB host planning for a100-40 got 85.9 GB,
    "A100" being in both names)."""
    import types
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: name)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=0: types.SimpleNamespace(total_memory=total))
    for kind, nbytes in memory.items():
        assert P.device_for(kind, "torch").memory == nbytes, kind


@pytest.mark.parametrize("name, peak", [("NVIDIA H100 PCIe", 756e12), ("NVIDIA H100 NVL", 835e12),
                                        ("NVIDIA H100 80GB HBM3", 989e12)])
def test_the_installed_gpus_plan_counts_its_own_peak(monkeypatch, name, peak):
    """Planning for the GPU installed here takes the peak its MFU is logged with (by its name):
    an H100 PCIe's plan counted the SXM's 989 TFLOP/s, its step time and cost 24% too low."""
    import types
    from training.monitor import peak_flops_for
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: name)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=0: types.SimpleNamespace(total_memory=8e10))
    assert P.device_for("h100", "torch").peak_flops() == peak_flops_for(name) == peak


@pytest.mark.parametrize("accel, nprocs, replicas", [
    ("v4-8", None, 4), ("v5p-16", None, 8),          # the number counts TensorCores: two per chip
    ("v5litepod-16", None, 16), ("v6e-8", None, 8),  # one core per chip
    ("v6e-8", 1, 1), (None, None, 1),                # xla.nprocs=1, or no TPU here
])
def test_xla_ddp_plans_one_replica_per_chip_of_the_slice(monkeypatch, tmp_path, accel, nprocs, replicas):
    """train_xla.py in ddp mode with xla.nprocs null spawns a process per chip on every host of the
    slice: --plan counts the slice's chips from its accelerator type, as the run will."""
    monkeypatch.setattr(P, "tpu_accelerator_type", lambda: accel)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("training: {max_steps: 1}\n")
    over = [] if nprocs is None else [f"xla.nprocs={nprocs}"]
    layout = P.layout_for(load_config(cfg, over), "xla", None)
    assert layout.mode == "ddp" and layout.chips == layout.replicas == replicas
    # planned for the slice's own generation: the same; for another (--device-kind): not this slice
    kind = P.tpu_generation(accel) if accel else None
    assert P.layout_for(load_config(cfg, over), "xla", None, kind).replicas == replicas
    other = "v5p" if kind != "v5p" else "v4"
    assert P.layout_for(load_config(cfg, over), "xla", None, other).replicas == (nprocs or 1)


def test_the_micro_batch_levers_keep_the_tokens_per_step():
    """'same tokens per step': each halving of training.batch_size doubles the accumulation, and
    an odd micro-batch is not halved (6 -> 3, then no further: 3 // 2 would drop a sequence)."""
    cfg = load_config(ROOT / "configs" / "demo.yaml", ["model.mhc_streams=1", "model.nash_scales=1",
                                                        "training.batch_size=6"])
    plan, trace = P.make_plan(cfg, "torch", P.device_for("a100-40", "torch"), world_size=2, margin=0.99999)
    levers = [dict(o.split("=") for o in lev.overrides) for lev in P.find_levers(plan, "torch", trace)]
    batch = [lev for lev in levers if "training.batch_size" in lev]
    assert [lev["training.batch_size"] for lev in batch] == ["3"], levers
    for lev in batch:
        assert int(lev["training.batch_size"]) * int(lev["training.gradient_accumulation_steps"]) == \
            cfg.training.batch_size * cfg.training.gradient_accumulation_steps, lev


def test_the_levers_stop_at_the_first_that_fits():
    """A lever that makes the config fit is the last one offered: the ones after it cost
    throughput (recomputation) for nothing."""
    cfg = load_config(ROOT / "configs" / "demo.yaml")
    device = P.device_for("v5e", "xla")
    plan, trace = P.make_plan(cfg, "xla", device, margin=0.9999)
    levers = P.find_levers(plan, "xla", trace)
    assert len(levers) >= 3 and levers[1].peak < levers[0].peak, [(lev.overrides, lev.peak) for lev in levers]
    between = (levers[0].peak + levers[1].peak) / 2   # a chip on which the second lever fits, the first not
    plan, trace = P.make_plan(cfg, "xla", device, margin=1 - between / device.memory)
    got = P.find_levers(plan, "xla", trace)
    assert [lev.overrides for lev in got] == [lev.overrides for lev in levers[:2]]
    assert got[0].peak > plan.usable >= got[1].peak

