"""model.py under torch_xla (PJRT CPU): no aten:: fallbacks, same numbers as eager CPU, bf16 autocast.

torch_xla runs in a subprocess, so PJRT_DEVICE is set before it is imported and this process stays clean.
"""
import os

import pytest

from helpers import once_per_session, script_report

pytestmark = pytest.mark.xla

SCRIPT = r"""
import json, sys
import torch
import torch_xla
import torch_xla.debug.metrics as met
import torch_xla.utils.checkpoint as xla_checkpoint
from model import ModelConfig, NashMHC
from tests.helpers import shaken

def fallbacks():   # aten:: ops run on the CPU, and einsums torch_xla decomposed instead of lowering
    return sorted(c for c in met.counter_names() if c.startswith("aten::") or c == "EinsumFallback")

dev = torch_xla.device()
report = {}
# Few Sinkhorn iterations and one layer keep the graphs (and their compile time) small; which ops
# are traced does not depend on either.
configs = {
    "nash-mhc": (dict(nash_window=8, nash_scales=3, nash_compression=2, nash_pool="learned",
                      activation_checkpointing=True), (False, True)),
    "lite-convex": (dict(nash_window=0, nash_scales=4, nash_compression=2, mhc_lite=True,
                         aggregation="convex"), (False,)),
    # the XLA backend's Sinkhorn as one loop (training.xla_backend.SinkhornLoop), against eager CPU
    "sinkhorn-loop": (dict(nash_window=8, nash_scales=3, nash_compression=2, mhc_lite=False), (False,)),
    # model.attend's written-out form (XLA) against SDPA (CPU), on the other masks: the window's
    # chunks with right padding (48 tokens, window 5) and its dense form (48 tokens, window 32)
    "window-chunked-pad": (dict(mhc_streams=1, nash_window=5, nash_scales=3, nash_compression=2,
                                aggregation="mean"), (False,)),
    "window-dense": (dict(mhc_streams=1, nash_window=32, nash_scales=2, nash_compression=2), (False,)),
}
for name, (kw, precisions) in configs.items():
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=64,
                      sinkhorn_iters=3, **kw)
    torch.manual_seed(0)
    model = shaken(NashMHC(cfg))   # away from init, where H_res is nearly the identity and tau 1
    idx, tgt = torch.randint(0, 64, (2, 45)), torch.randint(0, 64, (2, 45))
    cpu = model(idx, tgt)
    cpu.loss.backward()
    cpu_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    model.to(dev)
    model.checkpoint_fn = xla_checkpoint.checkpoint   # what the XLA backend may use
    if name == "sinkhorn-loop":
        from training.xla_backend import SinkhornLoop
        looped = [m for m in model.modules() if hasattr(m, "sinkhorn_iterate")]
        assert len(looped) == 2 * cfg.n_layers   # every hyper-connection runs the loop
        for m in looped:
            m.sinkhorn_iterate = SinkhornLoop()
    r = {"tied": model.lm_head.weight is model.tok_emb.weight}
    for amp in precisions:
        met.clear_all()
        with torch.autocast("xla", dtype=torch.bfloat16, enabled=amp):
            out = model(idx.to(dev), tgt.to(dev))
        out.loss.backward()
        torch_xla.sync()
        key = "bf16" if amp else "fp32"
        r[key] = {"fallbacks": fallbacks(), "loss": out.loss.item(), "cpu_loss": cpu.loss.item(),
                  "logits_dtype": str(out.logits.dtype),
                  "finite_grads": all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()),
                  "metrics_finite": all(bool(torch.isfinite(v)) for v in out.metrics.values())}
        if not amp:   # each parameter's, relative to its largest gradient entry (at least 1e-3)
            r[key]["max_grad_diff"] = max((p.grad.cpu() - cpu_grads[n]).abs().max().item()
                                          / max(cpu_grads[n].abs().max().item(), 1e-3)
                                          for n, p in model.named_parameters())
        model.zero_grad(set_to_none=True)
    report[name] = r

# The XLA backend's Sinkhorn loop alone, against autograd of the plain iterations (float64, CPU),
# on a random positive matrix and a random upstream gradient: in a model its gradient reaches
# H_res only through small numbers
from training.xla_backend import SinkhornLoop
g = torch.Generator().manual_seed(0)
p0 = torch.rand(4, 4, 50, generator=g, dtype=torch.float64) + 0.1
up = torch.randn(4, 4, 50, generator=g, dtype=torch.float64)
ref = p0.clone().requires_grad_(True)
q = ref
for _ in range(5):
    q = q / (q.sum(dim=1, keepdim=True) + 1e-6)   # rows (dim 1), then columns, as model.sinkhorn_knopp
    q = q / (q.sum(dim=0, keepdim=True) + 1e-6)
(q * up).sum().backward()
px = p0.float().to(dev).requires_grad_(True)
qx = SinkhornLoop()(px, 5, 1e-6)
(qx * up.float().to(dev)).sum().backward()
torch_xla.sync()
report["sinkhorn_loop_alone"] = {
    "forward": ((qx.cpu().double() - q.detach()).abs().max() / q.detach().abs().max()).item(),
    "backward": ((px.grad.cpu().double() - ref.grad).abs().max() / ref.grad.abs().max()).item()}
# model.opaque_einsum, attention's product, and its two gradients: each one HLO dot whose batch
# dimensions are B and the key/value heads (not a bmm over their merged product)
import re
from model import opaque_einsum
q = torch.randn(2, 3, 2, 5, 4, device=dev, requires_grad=True)
k = torch.randn(2, 3, 7, 4, device=dev, requires_grad=True)
s = opaque_einsum("bhgtd,bhsd->bhgts", q, k)
hlo = torch_xla._XLAC._get_xla_tensors_hlo([s, *torch.autograd.grad(s.sum(), (q, k))])
report["opaque_einsum_dots"] = re.findall(r" dot\(.*?lhs_batch_dims=(\{[0-9,]*\})", hlo)
print("REPORT " + json.dumps(report))
"""


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    pytest.importorskip("torch_xla")
    # os.environ carries tests/conftest.py's fast-compile XLA_FLAGS (LLVM without optimisation passes)
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "1", "TF_CPP_MIN_LOG_LEVEL": "3",
           "OMP_NUM_THREADS": "1"}
    # one report for the session: make test's workers each run some of the tests below
    return once_per_session(tmp_path_factory, "model_xla_report", lambda _: script_report(SCRIPT, env=env, timeout=600))


@pytest.mark.parametrize("name", ["nash-mhc", "lite-convex", "sinkhorn-loop", "window-chunked-pad", "window-dense"])
def test_forward_backward_without_fallbacks_matches_cpu(report, name):
    r = report[name]
    assert r["tied"]  # moving to the XLA device keeps lm_head tied to tok_emb
    fp32 = r["fp32"]
    assert fp32["fallbacks"] == []
    assert abs(fp32["loss"] - fp32["cpu_loss"]) < 1e-5
    assert fp32["max_grad_diff"] < 1e-4 and fp32["finite_grads"] and fp32["metrics_finite"]


def test_opaque_einsum_is_one_dot_with_batch_and_heads_as_batch_dimensions(report):
    """The forward and both gradients of the attention's product reach torch_xla's own einsum
    lowering: three dots batched over (B, Hkv), where a decomposed einsum would be a bmm over
    their merged product (the merge that made GSPMD gather heads split over tp)."""
    assert report["opaque_einsum_dots"] == ["{0,1}"] * 3, report["opaque_einsum_dots"]


def test_the_xla_sinkhorn_loop_is_the_plain_iterations_and_their_gradient(report):
    r = report["sinkhorn_loop_alone"]
    assert r["forward"] < 1e-6 and r["backward"] < 1e-5, r


def test_bf16_autocast_without_fallbacks(report):
    bf16 = report["nash-mhc"]["bf16"]
    assert bf16["fallbacks"] == []
    assert bf16["logits_dtype"] == "torch.bfloat16"
    assert bf16["finite_grads"] and bf16["metrics_finite"]
    assert abs(bf16["loss"] - bf16["cpu_loss"]) < 0.02
