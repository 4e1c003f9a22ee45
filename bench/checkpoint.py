"""What a checkpoint step costs the training loop: synchronous against asynchronous saves.

    .venv/bin/python bench/checkpoint.py                       # d_model 512, 8 layers, 5 repeats
    .venv/bin/python bench/checkpoint.py --d-model 256 --layers 4 --repeats 3

For each form (``file``: one ckpt_*.pt by the master; ``dcp``: a torch.distributed.checkpoint
directory, here written by one process) and each mode (``checkpoint.async`` false/true) it times,
through the real ``training.checkpoint.Checkpointer`` and ``TorchBackend`` on the CPU:

- ``blocked_s``: how long ``Checkpointer.save`` holds the loop, i.e. what the checkpoint step
  adds to a step (sync: stage + write + commit; async: the host copy only);
- ``total_s``: until the save is written and committed (``save`` then ``wait``).

Saves alternate form by form and mode by mode inside each repeat (interleaved, so that machine
load affects every variant alike), after one untimed round (one-time costs: DCP's imports, the
first thread); figures are medians over repeats, and ``async_over_sync`` is the ratio of the
medians of blocked time. Prints one JSON object.

``--resume-processes N``: instead, what resuming from one single-file checkpoint costs the host's
memory when N processes read it at once (every DDP rank does): each loads it as the trainers do
(``training.checkpoint.load_checkpoint``, memory-mapped) or with a plain ``torch.load``, touches
every tensor, and reports its private and proportional (PSS) memory from /proc (Linux).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from model import ModelConfig, NashMHC  # noqa: E402
from training.backend import TorchBackend  # noqa: E402
from training.checkpoint import Checkpointer, rng_state  # noqa: E402
from training.config import load_config  # noqa: E402
from training.optim import build_optimizer  # noqa: E402


def trained_state(d_model: int, layers: int):
    """A model and AdamW after one step (the moments exist: the full state a checkpoint holds),
    the CPU backend, and checkpoint metadata as the loop writes it."""
    torch.manual_seed(0)
    cfg = load_config(None, ["training.max_steps=1"])
    model = NashMHC(ModelConfig(vocab_size=8192, d_model=d_model, n_layers=layers,
                                n_heads=max(1, d_model // 64), n_kv_heads=max(1, d_model // 128),
                                max_seq_len=256))
    backend = TorchBackend("cpu")
    opt = build_optimizer(model, cfg.training, backend.adamw_factory())
    x = torch.randint(0, 8192, (1, 64))
    model(x, x).loss.backward()
    opt.step()
    meta = {"format_version": 2, "step": 0, "tokens_seen": 0, "data": {"epoch": 0, "offset": 0},
            "rng": rng_state(), "nonfinite": {"total": 0}, "config": cfg.to_dict(), "trainer": "torch"}
    return model, opt, backend, meta


def checkpoint_step_times(d_model: int = 512, layers: int = 8, repeats: int = 5) -> dict:
    model, opt, backend, meta = trained_state(d_model, layers)
    n_values = sum(p.numel() for p in model.parameters())
    variants = [(form, mode) for form in ("file", "dcp") for mode in ("sync", "async")]
    times: dict = {v: {"blocked_s": [], "total_s": []} for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        step = 0
        for round_ in range(repeats + 1):   # the first round untimed: one-time costs (DCP's imports, threads)
            for form, mode in variants:
                step += 1
                backend.checkpoint_format = form
                ck = Checkpointer(Path(tmp) / f"{form}_{mode}", keep=1, backend=backend,
                                  log=lambda m: None, async_save=mode == "async")
                t0 = time.perf_counter()
                ck.save({**meta, "step": step}, model, opt, "bench")
                t1 = time.perf_counter()
                ck.wait()
                t2 = time.perf_counter()
                if round_:
                    times[(form, mode)]["blocked_s"].append(t1 - t0)
                    times[(form, mode)]["total_s"].append(t2 - t0)
    out = {"model_values": n_values, "state_mb": round(n_values * 3 * 4 / 2**20, 1),
           "repeats": repeats, "torch_threads": torch.get_num_threads()}
    for (form, mode), t in times.items():
        out[f"{form}_{mode}"] = {k: round(statistics.median(v), 4) for k, v in t.items()}
    for form in ("file", "dcp"):
        out[f"{form}_async_over_sync"] = round(out[f"{form}_async"]["blocked_s"]
                                               / out[f"{form}_sync"]["blocked_s"], 3)
    return out


_HOLDER = """
import sys, torch
from training.checkpoint import load_checkpoint
path, how = sys.argv[1], sys.argv[2]
if how == "nothing":  # the interpreter and torch alone
    ckpt = {"model": {}, "optimizer": {"state": {}}}
elif how == "load_checkpoint":  # as the trainers resume
    ckpt = load_checkpoint(path)
else:
    ckpt = torch.load(path, weights_only=True)
total = sum(float(t.float().sum()) for t in ckpt["model"].values())  # every weight read
total += sum(float(v.float().sum()) for s in ckpt["optimizer"]["state"].values() for v in s.values())
print("loaded", flush=True)
sys.stdin.readline()  # measured once every process has read the file (a page is shared once two map it)
mem = {}
for line in open("/proc/self/smaps_rollup"):
    key, _, value = line.partition(":")
    if key in ("Pss", "Private_Clean", "Private_Dirty", "Shared_Clean"):
        mem[key] = int(value.split()[0]) / 1024
print(round(mem["Private_Clean"] + mem["Private_Dirty"], 1), round(mem["Pss"], 1), flush=True)
sys.stdin.read()  # held until every process has measured
"""


def resume_memory(processes: int, d_model: int, layers: int) -> dict:
    """Private and PSS MiB per process, N processes holding one checkpoint file at once, read by
    ``load_checkpoint`` and by a plain ``torch.load``, against a process that loads nothing."""
    import subprocess

    model, opt, backend, meta = trained_state(d_model, layers)
    meta["step"] = 1
    root = str(Path(__file__).resolve().parents[1])
    out: dict = {"processes": processes}
    with tempfile.TemporaryDirectory() as tmp:
        ck = Checkpointer(Path(tmp), keep=1, backend=backend, log=lambda m: None, async_save=False)
        ck.save(meta, model, opt, "bench")
        path = next(Path(tmp).glob("ckpt_*.pt"))
        out["file_mib"] = round(path.stat().st_size / 2**20, 1)
        del model, opt
        for how in ("nothing", "load_checkpoint", "torch.load"):
            procs = [subprocess.Popen([sys.executable, "-c", _HOLDER, str(path), how], cwd=root, text=True,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE) for _ in range(processes)]
            for p in procs:
                if p.stdout.readline().strip() != "loaded":
                    raise RuntimeError(f"a process loading {path} failed (its error is above)")
            for p in procs:
                p.stdin.write("\n")
                p.stdin.flush()
            rows = [tuple(map(float, p.stdout.readline().split())) for p in procs]
            for p in procs:
                p.communicate("")
            out[how] = {"private_mib": round(statistics.median(r[0] for r in rows), 1),
                        "pss_mib": round(statistics.median(r[1] for r in rows), 1)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--resume-processes", type=int, metavar="N",
                    help="instead: host memory of N processes resuming from one checkpoint file at once")
    args = ap.parse_args()
    for flag, value in (("--d-model", args.d_model), ("--layers", args.layers), ("--repeats", args.repeats),
                        ("--resume-processes", args.resume_processes)):
        if value is not None and value < 1:
            ap.error(f"{flag} must be at least 1, got {value}")
    if args.resume_processes:
        print(json.dumps(resume_memory(args.resume_processes, args.d_model, args.layers), indent=1))
        return 0
    print(json.dumps(checkpoint_step_times(args.d_model, args.layers, args.repeats), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
