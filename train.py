"""Train a Nash-MHC transformer on one CUDA/MPS/CPU device, or with DDP or FSDP2 under torchrun.

    python train.py configs/demo.yaml [section.key=value ...]
    torchrun --nproc_per_node=8 train.py configs/small_gpu.yaml                     # DDP
    torchrun --nproc_per_node=8 train.py configs/nash_mhc_3b.yaml training.fsdp=true \\
        training.batch_size=1 training.gradient_accumulation_steps=32         # FSDP2, 1M tokens a step

batch_size is per process here (in train_xla.py's spmd mode, the 3B config's, it is global).

The XLA twin is train_xla.py: the same config, data, loop and checkpoints (see training/).
"""
import os
import sys

import torch.distributed as dist

from training.backend import TorchBackend
from training.checkpoint import first_line
from training.launch import under_torchrun
from training.loop import main, train


def run(cfg) -> int:
    try:
        backend = TorchBackend(cfg.training.device, fsdp=cfg.training.fsdp, timeout_s=cfg.training.dist_timeout_s,
                               cpu_malloc=cfg.training.cpu_malloc)
    except ValueError as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        return 2
    except dist.DistError as e:  # the rendezvous: an address that does not resolve, a port in use
        where = ", ".join(f"{k}={os.environ[k]}" for k in ("MASTER_ADDR", "MASTER_PORT") if k in os.environ)
        print(f"train.py: error: the processes could not form their group ({where}): {first_line(e)}",
              file=sys.stderr)
        return 2
    try:
        # With its host group, before the model: the data, config and check_data's verdict of
        # every process, decided together (a ConfigError: main says it, exit 2 everywhere)
        backend.agree_at_launch(cfg)
        return train(cfg, backend)
    finally:
        backend.shutdown()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], run, "train.py", launched_together=lambda cfg: under_torchrun()))
