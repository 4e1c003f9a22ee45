"""model.py under torch_xla (PJRT CPU): no aten:: fallbacks, same numbers as eager CPU, bf16 autocast.

torch_xla runs in a subprocess, so PJRT_DEVICE is set before it is imported and this process stays clean.
"""
import os

import pytest

from helpers import script_report

pytestmark = pytest.mark.xla

SCRIPT = r"""
import json, sys
import torch
import torch_xla
import torch_xla.debug.metrics as met
import torch_xla.utils.checkpoint as xla_checkpoint
from model import ModelConfig, NashMHC

def fallbacks():
    return sorted(c for c in met.counter_names() if c.startswith("aten::"))

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
    model = NashMHC(cfg)
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
        if not amp:
            r[key]["max_grad_diff"] = max((p.grad.cpu() - cpu_grads[n]).abs().max().item()
                                          for n, p in model.named_parameters())
        model.zero_grad(set_to_none=True)
    report[name] = r
print("REPORT " + json.dumps(report))
"""


@pytest.fixture(scope="module")
def report():
    pytest.importorskip("torch_xla")
    # os.environ carries tests/conftest.py's fast-compile XLA_FLAGS (LLVM without optimisation passes)
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "1", "TF_CPP_MIN_LOG_LEVEL": "3",
           "OMP_NUM_THREADS": "1"}
    return script_report(SCRIPT, env=env, timeout=600)


@pytest.mark.parametrize("name", ["nash-mhc", "lite-convex", "sinkhorn-loop", "window-chunked-pad", "window-dense"])
def test_forward_backward_without_fallbacks_matches_cpu(report, name):
    r = report[name]
    assert r["tied"]  # moving to the XLA device keeps lm_head tied to tok_emb
    fp32 = r["fp32"]
    assert fp32["fallbacks"] == []
    assert abs(fp32["loss"] - fp32["cpu_loss"]) < 1e-5
    assert fp32["max_grad_diff"] < 1e-5 and fp32["finite_grads"] and fp32["metrics_finite"]


def test_bf16_autocast_without_fallbacks(report):
    bf16 = report["nash-mhc"]["bf16"]
    assert bf16["fallbacks"] == []
    assert bf16["logits_dtype"] == "torch.bfloat16"
    assert bf16["finite_grads"] and bf16["metrics_finite"]
    assert abs(bf16["loss"] - bf16["cpu_loss"]) < 0.02
