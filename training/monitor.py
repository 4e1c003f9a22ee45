"""Logging for the master process: a tqdm bar, metrics.jsonl, TensorBoard and (optionally) W&B.

Every other process gets a ``Monitor`` whose methods do nothing, so the loop calls it unguarded.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

# Dense bf16 peak FLOP/s of one device, for MFU. Matched by substring of the device name.
PEAK_FLOPS = {
    "H200": 989e12, "H100": 989e12, "H800": 989e12, "GH200": 989e12, "A100": 312e12, "A800": 312e12,
    "L40S": 362e12, "L4": 121e12, "A10G": 70e12, "RTX 4090": 165e12, "RTX 3090": 71e12, "V100": 125e12,
    "TPU v6": 918e12, "TPU v5p": 459e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v4": 275e12,
}


# What torch_xla 2.9's ``xm.xla_device_kind()`` returns on each TPU generation, and the dense bf16
# peak FLOP/s of one chip (one PJRT device; v4 and v5p chips are megacore). Matched exactly:
# "TPU v5" is a v5p, which a substring match would confuse with "TPU v5 lite" (v5e).
TPU_DEVICE_KINDS = {
    "TPU v4": ("v4", 275e12),
    "TPU v5 lite": ("v5e", 197e12),
    "TPU v5": ("v5p", 459e12),
    "TPU v6 lite": ("v6e", 918e12),
}


def peak_flops_for(device_name: str) -> float | None:
    """Dense bf16 peak FLOP/s of one device: a TPU by its exact ``xla_device_kind``, a GPU by name."""
    kind = TPU_DEVICE_KINDS.get(" ".join(device_name.split()))
    if kind is not None:
        return kind[1]
    for key in sorted(PEAK_FLOPS, key=len, reverse=True):
        if key.lower() in device_name.lower():
            return PEAK_FLOPS[key]
    return None


def info(msg: str) -> None:
    """A line for the user, on stderr so it never mixes with a tqdm bar's redraws."""
    try:
        from tqdm import tqdm
        tqdm.write(msg, file=sys.stderr)
    except ImportError:
        print(msg, file=sys.stderr, flush=True)


def _continue_metrics(path: Path, start_step: int) -> None:
    """Make metrics.jsonl continue at ``start_step``.

    Resuming from a checkpoint at step k: lines past k describe steps that will run again, so they
    are dropped (the file is rewritten atomically). Starting from step 0 over an old file: the old
    file is kept under a new name, never mixed with the new run.
    """
    if not path.exists():
        return
    if start_step == 0:
        aside = path.with_name(f"metrics.{time.strftime('%Y%m%d-%H%M%S')}.jsonl")
        os.replace(path, aside)
        info(f"warning: starting from step 0: the previous {path.name} is kept as {aside.name}")
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= start_step:
                kept.append(line)
        except ValueError:  # a line cut by a crash
            continue
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


class Monitor:
    def __init__(self, cfg, run_dir: Path, enabled: bool, total_steps: int, start_step: int):
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self.bar = None
        self.tb = None
        self.wandb = None
        self.jsonl = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        _continue_metrics(self.run_dir / "metrics.jsonl", start_step)
        self.jsonl = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        lc = cfg.logging
        if lc.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(str(self.run_dir / "tb"), purge_step=start_step or None)
            except ImportError:
                info("warning: tensorboard is not installed; logging.tensorboard ignored")
        if lc.wandb.enabled:
            try:
                import wandb
                os.environ.setdefault("WANDB_SILENT", "true")
                self.wandb = wandb.init(project=lc.wandb.project, entity=lc.wandb.entity,
                                        name=lc.wandb.run_name or self.run_dir.name, mode=lc.wandb.mode,
                                        dir=str(self.run_dir), config=cfg.to_dict(), resume="allow")
            except ImportError:
                info("warning: wandb is not installed (pip install wandb); logging.wandb ignored")
        if lc.progress_bar:
            from tqdm import tqdm
            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True,
                            file=sys.stderr, smoothing=0.1)

    def log(self, step: int, metrics: dict) -> None:
        """One JSON line, TensorBoard scalars and W&B, for one step's host-side metrics."""
        if not self.enabled:
            return
        clean = {"step": step}
        for k, v in metrics.items():
            clean[k] = v if not isinstance(v, float) or math.isfinite(v) else str(v)
        clean["time"] = round(time.time(), 3)
        self.jsonl.write(json.dumps(clean) + "\n")
        for k, v in metrics.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                if self.tb is not None:
                    self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=step)
        if self.bar is not None and "loss" in metrics:
            post = {"loss": f"{metrics['loss']:.4f}", "lr": f"{metrics.get('lr', 0):.2e}"}
            if "tokens_per_sec" in metrics:
                post["tok/s"] = f"{metrics['tokens_per_sec']:.0f}"
            if "eval_loss" in metrics:
                post["val"] = f"{metrics['eval_loss']:.4f}"
            self.bar.set_postfix(post, refresh=False)

    def advance(self, step: int) -> None:
        if self.bar is not None:
            self.bar.update(step - self.bar.n)

    def close(self) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.jsonl is not None:
            self.jsonl.close()
