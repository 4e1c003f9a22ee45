"""Helpers shared by the trainer tests: a tiny config on the stdlib test corpus, metrics readers,
and subprocess runners."""
import fcntl
import hashlib
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PJRT_DEVICE": "CPU"}
ENV.pop("CPU_NUM_DEVICES", None)


def tiny_config(tmp_path: Path, data_dir: Path, **over) -> Path:
    cfg = {
        "model": {"vocab_size": 512, "d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
                  "max_seq_len": 64, "mhc_streams": 2, "nash_scales": 2, "nash_compression": 4,
                  "nash_window": 16, "dropout": 0.0},
        "data": {"dir": str(data_dir), "seq_len": 32, "num_workers": 0},
        "training": {"batch_size": 4, "max_steps": 20, "learning_rate": 3e-3, "warmup_steps": 4,
                     "precision": "fp32", "seed": 7, "device": "cpu"},
        "evaluation": {"interval": 10, "steps": 2},
        "checkpoint": {"dir": str(tmp_path / "run"), "interval": 5, "keep": 2},
        "logging": {"interval": 1, "tensorboard": False, "progress_bar": False},
    }
    for key, value in over.items():
        section, k = key.split(".", 1)
        cfg.setdefault(section, {})[k] = value
    p = tmp_path / "cfg.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def once_per_session(tmp_path_factory, name: str, make):
    """``make(directory)``'s result (JSON), computed once in a test session: by the first
    pytest-xdist worker to ask, under a file lock, and read from the session's shared temporary
    directory by every other worker (``make test``'s two workers each run some of the tests that
    read it). A ``make`` that fails leaves no result, so the next asker tries again, in a directory
    of its own."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's directory, holding each worker's own
    work, result = root / f"once-{name}", root / f"once-{name}.json"
    with open(root / f"once-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not result.exists():
            shutil.rmtree(work, ignore_errors=True)  # a failed attempt's: never resumed or reused
            work.mkdir()
            value = make(work)
            result.with_suffix(".tmp").write_text(json.dumps(value))
            result.with_suffix(".tmp").replace(result)
        return json.loads(result.read_text())


def shared_run(tmp_path_factory, script: str, data_dir: Path, **over) -> tuple[Path, str]:
    """``script`` (train.py, train_xla.py) on ``tiny_config(**over)``, run once in the session
    for every test that only reads it: (its run directory, its stderr). ``data_dir`` is the
    session's ``stdlib_data``, the same path in every worker."""
    def make(d: Path) -> list:
        r = run([script, str(tiny_config(d, data_dir, **over))])
        assert r.returncode == 0, r.stderr[-3000:]
        return [str(d / "run"), r.stderr]
    key = json.dumps([script, str(data_dir), over], sort_keys=True).encode()
    name = f"{Path(script).stem}-{hashlib.sha1(key).hexdigest()[:12]}"  # the same in every worker
    run_dir, stderr = once_per_session(tmp_path_factory, name, make)
    return Path(run_dir), stderr


def metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def losses(run_dir: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in metrics(run_dir)}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing holds now, for a rendezvous that a test's processes make
    (MASTER_PORT). Drawn below the kernel's ephemeral range: every outgoing connection (gloo's, in a
    test running alongside) takes its local port from that range, so a port released here could go
    to one of those before the test's process binds it; below it only another test drawing the
    same port in the same instant could take it."""
    try:
        first_ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        first_ephemeral = 49152  # IANA's range (macOS)
    draw = random.SystemRandom()  # not the tests' seeded generator: two xdist workers draw apart
    for _ in range(200):
        port = draw.randrange(10000, max(first_ephemeral, 10001))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError("no free TCP port below the ephemeral range on 127.0.0.1")


def spawn_two(fn, args: tuple, timeout: float = 300) -> None:
    """``fn(rank, *args)`` in two processes (torch.multiprocessing.spawn), which must end within
    ``timeout`` s: one that hangs (in a collective whose partner never came) is killed and fails
    the test in one line naming it, instead of at pytest's 900 s limit with both still running.
    A process that raised fails it with its traceback, as spawn does."""
    import torch.multiprocessing as mp
    ctx = mp.spawn(fn, args=args, nprocs=2, join=False)
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=max(0.0, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            hung = [rank for rank, p in enumerate(ctx.processes) if p.is_alive()]
            for p in ctx.processes:
                p.kill()
                p.join()
            raise AssertionError(f"{fn.__name__}: process(es) {hung} still running after {timeout:.0f} s")


def run(args, env=None, **kw):
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env or ENV, capture_output=True,
                          text=True, timeout=600, **kw)


def in_process(main, args, capsys):
    """A command line's ``main(argv)`` called in this process, for what a subprocess would tell
    apart only by the seconds it takes to start Python and torch again: ``returncode``, ``stdout``
    and ``stderr`` as ``subprocess.run`` gives them (argparse's exit 2, ``sys.exit("message")``'s 1
    with the message on stderr)."""
    import types
    try:
        rc, said = main([str(a) for a in args]), ""
    except SystemExit as e:
        rc, said = (e.code, "") if isinstance(e.code, int) or e.code is None else (1, f"{e.code}\n")
    out = capsys.readouterr()
    return types.SimpleNamespace(returncode=rc or 0, stdout=out.out, stderr=out.err + said)


def script_report(script: str, *args, env: dict, timeout: float = 300) -> dict:
    """Run ``script`` (Python source) in a process of its own with this repository on its path;
    it prints its findings last, as one line ``REPORT <json>``: returned as a dict."""
    r = subprocess.run([sys.executable, "-c", script, *map(str, args)], cwd=ROOT, capture_output=True,
                       text=True, timeout=timeout, env={**env, "PYTHONPATH": str(ROOT)})
    lines = [s for s in r.stdout.splitlines() if s.startswith("REPORT ")]
    assert r.returncode == 0 and lines, r.stderr[-3000:]
    return json.loads(lines[-1][len("REPORT "):])


def shaken(model, seed: int = 0):
    """``model`` (returned) moved away from its initialisation's symmetries, in place: every
    parameter of at most one dimension (norm gains around 1, the hyper-connections' gates and
    biases, the heads' log temperatures, the pooling logits) drawn at random, and the value
    projections x10. At init H_res is the identity up to exp(-8) (H_res and its transpose give the
    same numbers), every head's temperature is 1 and the scales' outputs are nearly equal (the
    game's weights stay near uniform): a form that transposed H_res, gave every head one
    temperature or scaled the Gram matrix wrongly would compute init's numbers all the same."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g).to(p.dtype)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * noise)
            elif name.endswith("log_tau"):
                p.copy_(0.5 * noise)
            elif p.ndim <= 1:
                p.copy_(noise)
            elif name.endswith("wv.weight"):
                p.mul_(10.0)
    return model


def wait_for_file(path: Path, proc, timeout=300) -> None:
    """Block until ``path`` exists; an AssertionError if ``proc`` ends first."""
    t0 = time.time()
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (exit {proc.returncode}) before {path} appeared")
        if time.time() - t0 > timeout:
            raise TimeoutError(f"{path} did not appear in {timeout} s")
        time.sleep(0.05)


def patched_script(tmp_path: Path, patch: str, args) -> Path:
    """A script that runs ``python SCRIPT ARGS...`` (``args[0]``: train.py or train_xla.py) after
    ``patch``, Python source executed first in the same process: to make something happen at an
    exact point of a run (a signal during the final save, at a given step, a failure on one rank)
    without depending on timing. Runs under torchrun too."""
    script = tmp_path / "patched_run.py"
    script.write_text(f"import runpy, sys\nsys.path.insert(0, {str(ROOT)!r})\n{patch}\n"
                      f"sys.argv = {[str(a) for a in args]!r}\n"
                      f"runpy.run_path({str(ROOT / args[0])!r}, run_name='__main__')\n")
    return script


def patched_env(tmp_path: Path, patch: str) -> dict:
    """``ENV`` in which every Python interpreter runs ``patch`` at start-up (a ``sitecustomize``):
    for worker processes that a launcher starts fresh (train_xla.py's xmp.spawn), which
    ``patched_script``'s patch does not reach."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(f"import sys\nsys.path.insert(0, {str(ROOT)!r})\n{patch}")
    return {**ENV, "PYTHONPATH": os.pathsep.join(p for p in (str(site), ENV.get("PYTHONPATH")) if p)}


def run_patched(tmp_path: Path, patch: str, args, env=None):
    """``patched_script`` run in a fresh interpreter."""
    return subprocess.run([sys.executable, str(patched_script(tmp_path, patch, args))], cwd=ROOT,
                          env=env or ENV, capture_output=True, text=True, timeout=600)


def wait_for_a_signal_at_step(step: int, marker: Path, rank: str | None = None) -> str:
    """A ``patched_script`` patch: as optimiser step ``step`` starts (1-based), the process (only
    torchrun's RANK ``rank``, if given) creates ``marker`` and waits until a stop signal has reached
    it. A test sends the signal from outside once ``marker`` exists (``wait_for_file``): the run
    stops at that step whatever the machine's load, through the real delivery path (a launcher
    that forwards the signal, a signal to one worker)."""
    only = f' and os.environ.get("RANK") == "{rank}"' if rank is not None else ""
    return ("import os, time\nfrom pathlib import Path\nfrom training.loop import STOP, Trainer\n"
            "train_step = Trainer.train_step\n"
            "def train_step_waiting_for_a_signal(self, lr):\n"
            f"    if self.state.step == {step - 1}{only}:\n"
            f"        Path({str(marker)!r}).touch()\n"
            "        give_up = time.monotonic() + 300\n"
            "        while not STOP.requested and time.monotonic() < give_up:\n"
            "            time.sleep(0.01)\n"
            "    return train_step(self, lr)\n"
            "Trainer.train_step = train_step_waiting_for_a_signal\n")


def sigterm_during_step(step: int, rank: str | None = None, name: str = "SIGTERM") -> str:
    """A ``patched_script`` patch: the process (only torchrun's RANK ``rank``, if given) sends
    itself SIGTERM (or the signal ``name``) as optimiser step ``step`` starts (1-based), from
    inside the run."""
    only = f' and os.environ.get("RANK") == "{rank}"' if rank is not None else ""
    return ("import os, signal\nfrom training.loop import Trainer\ntrain_step = Trainer.train_step\n"
            "def train_step_with_a_signal(self, lr):\n"
            f"    if self.state.step == {step - 1}{only}:\n"
            f"        os.kill(os.getpid(), signal.{name})\n"
            "    return train_step(self, lr)\n"
            "Trainer.train_step = train_step_with_a_signal\n")
