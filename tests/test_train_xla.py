"""train_xla.py on PJRT CPU: twin consistency with train.py, SPMD meshes, compile/fallback health,
exact resume, and checkpoints that move between the trainers. Every run is a subprocess, so
PJRT_DEVICE/CPU_NUM_DEVICES are set before torch_xla is imported."""
import json
import shutil
import signal
import subprocess
import sys

import pytest

from helpers import (ENV, ROOT, losses, metrics, patched_env, run, run_patched, script_report, shared_run,
                     sigterm_during_step, tiny_config, wait_for_a_signal_at_step, wait_for_file)

pytest.importorskip("torch_xla")
pytestmark = pytest.mark.xla


def close(a: dict, b: dict, rel: float, steps=None):
    steps = steps or sorted(a)
    assert set(steps) <= set(a) and set(steps) <= set(b), (sorted(a), sorted(b))
    for s in steps:
        assert abs(a[s] - b[s]) <= rel * abs(b[s]), (s, a[s], b[s])


# Sinkhorn's H_res (mhc_lite false) runs on XLA as two While loops of the backend's own
# (xla_backend.SinkhornLoop), eagerly as model.py's unrolled iterations: the same training.
@pytest.mark.parametrize("over", [{}, {"model.mhc_lite": False}], ids=["mhc_lite", "sinkhorn"])
def test_twins_give_the_same_losses(tmp_path_factory, stdlib_data, over):
    runs = {}
    for script in ("train_xla.py", "train.py"):   # the session's runs of these configs (shared_run)
        runs[script], err = shared_run(tmp_path_factory, script, stdlib_data, **over)
        assert ("mhc_lite: false" in err) == bool(over), err[-3000:]   # the config it ran
    close(losses(runs["train_xla.py"]), losses(runs["train.py"]), 1e-3, steps=list(range(1, 21)))
    if not over:
        assert "no TPU found: using PJRT_DEVICE=CPU" not in run(["train_xla.py", "--help"]).stderr


# data 2: gradients and optimiser state over data x fsdp (xla.shard_optimizer_over_data, on by
# default); the second mesh also takes the cross-entropy in chunks of 12 of the 32 positions
# (model.loss_chunk), against train.py's whole cross-entropy.
@pytest.mark.parametrize("mesh, loss_chunk", [((2, 2, 1), 0), ((1, 2, 2), 12)])
def test_spmd_mesh_matches_one_device(tmp_path, tmp_path_factory, stdlib_data, mesh, loss_chunk):
    spmd = tmp_path / "spmd"
    spmd.mkdir()
    over = {"training.batch_size": 8, "evaluation.interval": 0, "checkpoint.interval": 0}
    one_run = shared_run(tmp_path_factory, "train.py", stdlib_data, **over)[0]   # both meshes' reference
    d, f, t = mesh
    r = run(["train_xla.py", str(tiny_config(spmd, stdlib_data, **over)), "xla.mode=spmd",
             f"xla.mesh.data={d}", f"xla.mesh.fsdp={f}", f"xla.mesh.tp={t}", f"model.loss_chunk={loss_chunk}"],
            env={**ENV, "CPU_NUM_DEVICES": "4"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"4 device(s), spmd mesh ({d}, {f}, {t})) | model" in r.stderr    # no "x 1 replica(s)"
    # the batch is global in SPMD, split over data x fsdp, not 8 per replica
    assert f"effective batch: 8 global (split over data {d} x fsdp {f}) x 1 accumulation = 8 sequences" in r.stderr
    close(losses(spmd / "run"), losses(one_run), 1e-3, steps=list(range(1, 21)))
    # the consolidated checkpoint loads in train.py: resume it there for 2 more steps
    r = run(["train.py", str(spmd / "cfg.yaml"), "training.max_steps=22"])
    assert r.returncode == 0 and "resumed from" in r.stderr, r.stderr[-3000:]


def test_a_profile_traces_device_execution_and_compiles_nothing_new(tmp_path, stdlib_data):
    """logging.profile_start on train_xla.py: torch_xla's XProf trace (TensorBoard's profile
    plugin layout) of steps 4 and 5, holding their step markers and the device's executions;
    the run compiles and computes exactly what it does without it."""
    over = {"training.max_steps": 7, "evaluation.interval": 0, "checkpoint.interval": 0, "logging.interval": 1}
    runs = {}
    for name, profile in (("plain", {}), ("profiled", {"logging.profile_start": 4, "logging.profile_steps": 2})):
        (tmp_path / name).mkdir()
        r = run(["train_xla.py", str(tiny_config(tmp_path / name, stdlib_data, **over, **profile))])
        assert r.returncode == 0, r.stderr[-3000:]
        runs[name] = (tmp_path / name / "run", r.stderr)
    run_dir, log = runs["profiled"]
    folder = run_dir / "profile" / "rank0_steps4-5"
    assert f"profiler trace of steps 4-5: {folder}" in log
    [trace] = folder.glob("plugins/profile/*/*.trace.json.gz")
    assert list(trace.parent.glob("*.xplane.pb"))
    import gzip
    names = [e.get("name") for e in json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]]
    assert names.count("StepMarker") >= 2 and "PjRtCpuExecutable::ExecuteHelper" in names
    plain, profiled = (metrics(r) for r in (runs["plain"][0], run_dir))
    assert [m["xla_compilations"] for m in profiled] == [m["xla_compilations"] for m in plain]
    # the trace's writing is left out of the next line's time once: a log line whose asynchronous
    # closure ran after the writing had it subtracted twice, down to the 1e-9 s floor (1.3e11 tok/s)
    assert all(m["step_time"] > 1e-6 for m in profiled if "step_time" in m), profiled
    assert losses(run_dir) == losses(runs["plain"][0])


def test_spmd_muon_matches_one_device(tmp_path, stdlib_data):
    """Muon over an fsdp x tp mesh (its matrices sharded; the Newton-Schulz batch of each shape
    stacks them) trains like Muon in train.py on one device. Its last step, at learning rate 0
    (min_lr_ratio 0), compiles nothing new: 0 would be a graph constant to torch_xla, and the
    two groups' rates, both 0, one shared graph parameter."""
    one, spmd = tmp_path / "one", tmp_path / "spmd"
    one.mkdir(), spmd.mkdir()
    over = {"training.optimizer": "muon", "training.max_steps": 8, "evaluation.interval": 4,
            "checkpoint.interval": 0, "training.min_lr_ratio": 0.0}
    r = run(["train.py", str(tiny_config(one, stdlib_data, **over))])
    assert r.returncode == 0, r.stderr[-3000:]
    r = run(["train_xla.py", str(tiny_config(spmd, stdlib_data, **over)), "xla.mode=spmd", "xla.mesh.data=1",
             "xla.mesh.fsdp=2", "xla.mesh.tp=2"], env={**ENV, "CPU_NUM_DEVICES": "4"})
    assert r.returncode == 0, r.stderr[-3000:]
    close(losses(spmd / "run"), losses(one / "run"), 1e-3, steps=list(range(1, 9)))
    compiles = {m["step"]: m["xla_compilations"] for m in metrics(spmd / "run")}
    assert compiles[5] == compiles[7] == compiles[8], compiles


def test_spmd_mesh_must_cover_the_devices(tmp_path, stdlib_data):
    r = run(["train_xla.py", str(tiny_config(tmp_path, stdlib_data)), "xla.mode=spmd", "xla.mesh.fsdp=3"],
            env={**ENV, "CPU_NUM_DEVICES": "4"})
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "xla.mesh: data x fsdp x tp = 1 x 3 x 1 = 3, but there are 4 devices" in r.stderr


def test_bf16_no_recompilation_no_fallbacks_and_it_learns(tmp_path, stdlib_data):
    """30 bf16 steps with evaluation and checkpoints every 10/5: the compile count after warm-up
    (step 10) never grows, no aten:: fallbacks, and the validation loss falls as with train.py."""
    x, t = tmp_path / "xla", tmp_path / "torch"
    x.mkdir(), t.mkdir()
    over = {"training.precision": "bf16", "training.max_steps": 30, "checkpoint.interval": 5}
    r = run(["train_xla.py", str(tiny_config(x, stdlib_data, **over))])
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {m["step"]: m for m in metrics(x / "run")}
    assert rows[10]["xla_compilations"] == rows[20]["xla_compilations"] == rows[30]["xla_compilations"]
    assert all(m["xla_cpu_fallbacks"] == 0 for m in rows.values())
    health = json.loads((x / "run" / "xla_metrics.json").read_text())
    assert health["cpu_fallbacks"] == 0 and health["compilations"] == rows[30]["xla_compilations"]
    assert "CompileTime" in (x / "run" / "xla_metrics_report.txt").read_text()
    assert f"{health['compilations']} compilations, 0 CPU fallbacks" in r.stderr
    # learning, as with train.py in bf16
    r = run(["train.py", str(tiny_config(t, stdlib_data, **over))])
    assert r.returncode == 0, r.stderr[-3000:]
    ev_x = [m["eval_loss"] for m in metrics(x / "run") if "eval_loss" in m]
    ev_t = [m["eval_loss"] for m in metrics(t / "run") if "eval_loss" in m]
    assert ev_x[-1] < ev_x[0] - 0.3 and ev_t[-1] < ev_t[0] - 0.3
    assert abs(ev_x[-1] - ev_t[-1]) < 0.05 * ev_t[-1]


def test_exact_resume_after_sigterm(tmp_path, tmp_path_factory, stdlib_data):
    cut = tmp_path / "cut"
    cut.mkdir()
    over = {"checkpoint.interval": 0}
    # uninterrupted, saving every 5 steps (the twins' run): the saves change no loss either
    ref = shared_run(tmp_path_factory, "train_xla.py", stdlib_data)[0]
    cfg, at6 = tiny_config(cut, stdlib_data, **over), tmp_path / "at-step-6"
    # through xmp.spawn's pool, as on a TPU host (PJRT CPU's one replica runs in the launcher)
    pool = "import training.launch\ntraining.launch.one_pjrt_cpu_device = lambda: False\n"
    proc = subprocess.Popen([sys.executable, "train_xla.py", str(cfg)], cwd=ROOT,
                            env=patched_env(tmp_path, pool + wait_for_a_signal_at_step(6, at6)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_file(at6, proc)
    proc.send_signal(signal.SIGTERM)  # to the launcher: it forwards to the xmp.spawn worker
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    stopped = max(losses(cut / "run"))
    assert stopped == 6 and (cut / "run" / "ckpt_00000006.pt").exists(), err[-3000:]
    r = run(["train_xla.py", str(cfg)])
    assert r.returncode == 0 and "resumed from" in r.stderr, r.stderr[-3000:]
    a, b = losses(ref), losses(cut / "run")
    assert sorted(b) == list(range(1, 21))
    for s in range(1, 21):
        assert abs(a[s] - b[s]) <= 1e-6, (s, a[s], b[s])


@pytest.mark.parametrize("trainer", ["train.py", "train_xla.py"])
def test_resume_with_dropout_is_exact(tmp_path, stdlib_data, trainer):
    """A resumed run draws the dropout masks an uninterrupted one draws: every step seeds the
    generator (the XLA device's own on XLA) from training.seed, the replica and the step, and the
    DataLoader draws its worker seed from its own generator. On XLA the per-step seed is a graph
    parameter: no step after the first compiles anything, in the resumed run too (its optimiser
    state, loaded from the file, was not device data as a fresh one's: one more update graph),
    and not the last, whose learning rate is exactly 0 (min_lr_ratio 0: torch_xla makes a 0
    scalar a graph constant)."""
    over = {"model.dropout": 0.1, "training.max_steps": 8, "checkpoint.interval": 4, "checkpoint.keep": 5,
            "evaluation.interval": 4, "training.min_lr_ratio": 0.0}
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    ref.mkdir(), cut.mkdir()
    r = run([trainer, str(tiny_config(ref, stdlib_data, **over))])
    assert r.returncode == 0, r.stderr[-3000:]
    (cut / "run").mkdir()
    shutil.copy(ref / "run" / "ckpt_00000004.pt", cut / "run" / "ckpt_00000004.pt")
    r = run([trainer, str(tiny_config(cut, stdlib_data, **over))])
    assert r.returncode == 0 and "resumed from" in r.stderr, r.stderr[-3000:]
    a, b = losses(ref / "run"), losses(cut / "run")
    assert sorted(b) == [5, 6, 7, 8]
    for s in b:
        assert abs(a[s] - b[s]) <= 1e-6, (s, a[s], b[s])
    if trainer == "train_xla.py":
        compiles = {m["step"]: m["xla_compilations"] for m in metrics(ref / "run")}
        assert compiles[1] == compiles[2] == compiles[3] and compiles[5] == compiles[7] == compiles[8], compiles
        resumed = {m["step"]: m["xla_compilations"] for m in metrics(cut / "run")}
        assert resumed[5] == resumed[6] == resumed[7], resumed  # step 8 compiles the evaluation


def test_xla_launch_and_end_decisions(tmp_path, stdlib_data):
    """ddp mode on a process with several devices (PJRT CPU with CPU_NUM_DEVICES=4; TPU v2/v3)
    is one line: torch_xla runs those replicas as threads, and each made the gloo group in the
    same process, a deadlock that ignored SIGTERM. A run whose loss stops being finite at its
    last steps exits 3 with the non-finite save: on XLA the loop's last decision came before the
    host read the last steps' values, and the run ended "done" (exit 0, a NaN final loss)."""
    r = run(["train_xla.py", str(tiny_config(tmp_path, stdlib_data)), "xla.mode=ddp", "training.max_steps=2"],
            env={**ENV, "CPU_NUM_DEVICES": "4"})
    assert r.returncode == 2, r.stderr[-3000:]
    assert "xla.mode=ddp: each process here has 4 CPU devices" in r.stderr and "Traceback" not in r.stderr
    r = run(["train_xla.py", str(tiny_config(tmp_path, stdlib_data)), "training.max_steps=3",
             "training.learning_rate=1e30", "training.weight_decay=0", "training.warmup_steps=0",
             "training.max_nonfinite_steps=2",
             "evaluation.interval=0", "checkpoint.interval=0", "logging.interval=1"])
    assert r.returncode == 3 and "NaN/Inf for 2 steps in a row" in r.stderr, r.stderr[-3000:]
    assert "non-finite loss" in r.stderr and "done:" not in r.stderr


# Resumed from train.py's file into an SPMD mesh, the model and both AdamW moments are loaded
# shard by shard into the state the mesh laid out (copy_ and load_state_dict uploaded each
# tensor whole to every device first: the whole fp32 state per chip, a 3B run's OOM)
SHARDED_AFTER_RESUME = r"""
import json
import torch_xla
import torch_xla.debug.metrics as met
from training import checkpoint
restore = checkpoint.Checkpointer.restore
def specs(model, optimizer):
    out = {}
    for name, p in model.named_parameters():
        out[name] = torch_xla._XLAC._get_xla_sharding_spec(p)
        for key, value in optimizer.state[p].items():
            out[f"{name} {key}"] = torch_xla._XLAC._get_xla_sharding_spec(value)
    return out
def uploaded():   # bytes sent from the host to the devices so far (torch_xla's "OutboundData")
    data = met.metric_data("OutboundData")
    return data[1] if data else 0
def reporting(self, path, peeked, model, optimizer):
    fresh, before = specs(model, optimizer), uploaded()
    restore(self, path, peeked, model, optimizer)
    whole = sum(t.numel() * t.element_size() for p in model.parameters()
                for t in [p, *optimizer.state[p].values()])
    print("SHARDING " + json.dumps([fresh, specs(model, optimizer), (uploaded() - before) / whole]), flush=True)
checkpoint.Checkpointer.restore = reporting
"""


@pytest.mark.parametrize("first, second", [("train_xla.py", ["train.py"]), ("train.py", ["train_xla.py"]),
                                           ("train.py", ["train_xla.py", "xla.mode=spmd", "xla.mesh.fsdp=4"])],
                         ids=["xla-to-torch", "torch-to-xla", "torch-to-spmd"])
def test_checkpoints_move_between_trainers(tmp_path, stdlib_data, first, second):
    """Step 10 of one trainer's run, resumed by the other, continues the same curve (in an SPMD
    mesh: each 2-D weight and its moments sharded as the mesh lays them out, none whole)."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    over = {"checkpoint.interval": 10, "checkpoint.keep": 5}
    r = run([first, str(tiny_config(a, stdlib_data, **over))])
    assert r.returncode == 0, r.stderr[-3000:]
    (b / "run").mkdir()
    shutil.copy(a / "run" / "ckpt_00000010.pt", b / "run" / "ckpt_00000010.pt")
    spmd = "xla.mode=spmd" in second
    cfg = tiny_config(b, stdlib_data, **over)
    if spmd:
        r = run_patched(b, SHARDED_AFTER_RESUME, [second[0], cfg, *second[1:]],
                        env={**ENV, "CPU_NUM_DEVICES": "4"})
    else:
        r = run([*second[:1], str(cfg), *second[1:]])
    assert r.returncode == 0 and "resumed from" in r.stderr, r.stderr[-3000:]
    close(losses(b / "run"), losses(a / "run"), 1e-3, steps=list(range(11, 21)))
    if spmd:
        [line] = [ln for ln in r.stdout.splitlines() if ln.startswith("SHARDING ")]
        fresh, loaded, uploaded = json.loads(line[len("SHARDING "):])
        same = {k: v or "{replicated}" for k, v in fresh.items()}   # unannotated: replicated once computed
        assert {k: v or "{replicated}" for k, v in loaded.items()} == same, loaded
        assert sum("devices=[4" in spec for key, spec in loaded.items() if key.endswith("exp_avg")) >= 10, loaded
        # each device got its shards: 1.11x the state's bytes here (the replicated norms and gates
        # go to all 4 devices), where whole tensors to every device and a reshard sent 5.0x
        assert uploaded < 1.5, uploaded
        compiles = {m["step"]: m["xla_compilations"] for m in metrics(b / "run")}
        assert len({compiles[step] for step in range(12, 20)}) == 1, compiles   # none after warm-up


# Prints, for every 2-D weight a DCP load reads, the largest share of it one read covers.
LARGEST_READS = r"""
import json, math
from training import checkpoint
safe_reader = checkpoint.safe_reader
def reporting_reader(path):
    reader = safe_reader(path)
    read_data = reader.read_data
    def read_and_report(plan, planner):
        sizes, shares = planner.metadata.state_dict_metadata, {}
        for item in plan.items:
            fqn = item.storage_index.fqn
            if fqn.startswith("model.") and len(sizes[fqn].size) == 2:
                share = math.prod(item.lengths) / math.prod(sizes[fqn].size)
                shares[fqn] = max(shares.get(fqn, 0.0), share)
        print("READS " + json.dumps(shares), flush=True)
        return read_data(plan, planner)
    reader.read_data = read_and_report
    return reader
checkpoint.safe_reader = reporting_reader
"""


@pytest.mark.slow
def test_spmd_checkpoint_reshards_exactly(tmp_path, stdlib_data):
    """An SPMD run on mesh (2, 2, 1) saves DCP directories (each process its shards, a commit
    marker); step 5's resumes on mesh (1, 4, 1) and on one device (consolidated on load) and
    both continue the same losses. The mesh (1, 4, 1) reads each weight a device's quarter at a
    time (torch_xla's SPMD load planner: a host reads what its devices hold), not whole (DCP's
    default planner: every host reads and holds every tensor)."""
    over = {"training.batch_size": 8, "training.max_steps": 10, "evaluation.interval": 0,
            "checkpoint.interval": 5, "checkpoint.keep": 5}
    env4 = {**ENV, "CPU_NUM_DEVICES": "4"}
    a = tmp_path / "a"
    a.mkdir()
    r = run(["train_xla.py", str(tiny_config(a, stdlib_data, **over)), "xla.mode=spmd",
             "xla.mesh.data=2", "xla.mesh.fsdp=2"], env=env4)
    assert r.returncode == 0, r.stderr[-3000:]
    ckpt = a / "run" / "ckpt_00000005"
    assert (ckpt / "checkpoint.json").is_file() and (ckpt / ".metadata").is_file()
    ref = losses(a / "run")
    reporting = {**patched_env(tmp_path, LARGEST_READS), "CPU_NUM_DEVICES": "4"}
    for name, args, env in (("fsdp4", ["xla.mode=spmd", "xla.mesh.fsdp=4"], reporting), ("one", [], ENV)):
        d = tmp_path / name
        d.mkdir()
        r = run(["train_xla.py", str(tiny_config(d, stdlib_data, **over)), *args,
                 f"checkpoint.resume={ckpt}"], env=env)
        assert r.returncode == 0 and f"resumed from {ckpt}" in r.stderr, r.stderr[-3000:]
        got = losses(d / "run")
        assert sorted(got) == list(range(6, 11)), sorted(got)
        close(got, ref, 1e-5, steps=list(range(6, 11)))  # fp32; only reduction orders differ
        if name == "fsdp4":
            largest = {}
            for ln in r.stdout.splitlines():
                if ln.startswith("READS "):
                    for k, share in json.loads(ln[len("READS "):]).items():
                        largest[k] = max(largest.get(k, 0.0), share)
            # the projections and the embedding (mHC's small phi matrices split unevenly: padded)
            split = {k: v for k, v in largest.items() if k.endswith((
                "wq.weight", "wk.weight", "wv.weight", "wo.weight", "w1.weight", "w2.weight", "w3.weight",
                "tok_emb.weight"))}
            assert len(split) >= 8 and all(v <= 0.25 for v in split.values()), largest


@pytest.mark.parametrize("args", [["train.py"], ["train_xla.py", "xla.mode=spmd"]])
def test_one_process_stops_at_the_step_after_a_signal(tmp_path, stdlib_data, args):
    """One process needs no agreement with others, so it acts on a SIGTERM at the end of the step
    it arrived in, not at the next log step (here 10): step 3. train_xla.py in SPMD mode (one
    process per host; the 3B config's) waited for the log step before."""
    over = {"training.max_steps": 20, "logging.interval": 10, "checkpoint.interval": 0,
            "evaluation.interval": 0}
    cfg = tiny_config(tmp_path, stdlib_data, **over)
    r = run_patched(tmp_path, sigterm_during_step(3), [args[0], cfg, *args[1:]])
    assert r.returncode == 0 and "stopped at step 3 after SIGTERM" in r.stderr, r.stderr[-3000:]
    assert [p.stem for p in (tmp_path / "run").glob("ckpt_*")] == ["ckpt_00000003"]  # a file or a DCP directory


BAD_THIRD_BATCH = """
from training import data
from training.config import ConfigError
real, calls = data.DataStream.__next__, [0]
def nxt(self):
    batch = real(self)
    calls[0] += 1
    if calls[0] == 3:
        raise ConfigError("train_00000.npy: token 5 is id 9999, not below the vocabulary")
    return batch
data.DataStream.__next__ = nxt
"""


@pytest.mark.parametrize("mode", ["ddp", "spmd"])
def test_a_bad_batch_read_in_the_loader_thread_is_one_agreed_stop(tmp_path, stdlib_data, mode):
    """On XLA the host batches are read in torch_xla's loader thread: a batch refused there (a
    token id past the vocabulary) ended the thread and the stream with two tracebacks, and no
    decision was shared. It reaches the training thread now: the step is skipped, and the run
    stops at the next decision with the reason in one line, as train.py does."""
    cfg = tiny_config(tmp_path, stdlib_data, **{"training.max_steps": 8, "logging.interval": 1,
                                                "evaluation.interval": 0, "checkpoint.interval": 0})
    r = run(["train_xla.py", str(cfg), f"xla.mode={mode}"], env=patched_env(tmp_path, BAD_THIRD_BATCH))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    # (ddp here: the replica runs in the launcher's process, which says it once)
    assert "\ntrain_xla.py: error: train_00000.npy: token 5 is id 9999, not below the vocabulary\n" in r.stderr
    # the loader reads ahead, but the error comes up at the refused batch's place: step 3 is the
    # skipped one (it had been whichever step came after the loader's read, and a good batch lost)
    lines = metrics(tmp_path / "run")
    assert lines[-1]["loss"] == "nan" and lines[-1]["nonfinite_skipped"] == 1, lines
    assert all(m["loss"] != "nan" for m in lines[:-1]) and lines[-1]["step"] == 3, lines


DEVICE_BATCHES = r"""
import json, torch, torch_xla
from training.config import ConfigError
from training.xla_backend import _DeviceBatches

class Stream:   # batch i is all i; batches 5 and 9 are refused
    def __init__(self):
        self.i = 0
    def __iter__(self):
        return self
    def __next__(self):
        i, self.i = self.i, self.i + 1
        if i == 14:
            raise StopIteration
        if i in (5, 9):
            raise ConfigError(f"bad batch {i}")
        return torch.full((2, 4), i), torch.full((2, 4), i)
    def placeholder(self):
        return torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long)

got = []
batches = _DeviceBatches(Stream(), torch_xla.device())
while True:
    try:
        got.append(int(next(batches)[0][0, 0].cpu()))
    except ConfigError as e:
        got.append(str(e))
    except StopIteration:
        break
batches.close()
print("REPORT " + json.dumps(got))
"""


def test_a_refused_batch_is_raised_in_its_own_place_whatever_the_loader_read_ahead():
    """torch_xla's loader thread reads ~24 batches ahead: a refused batch's error is raised when
    its place comes up, instead of its stand-in, and every good batch arrives in order (it was
    raised at the next call, early, with a good batch dropped and the stand-in trained on later)."""
    got = script_report(DEVICE_BATCHES, env={**ENV, "PJRT_DEVICE": "CPU"})
    assert got == [0, 1, 2, 3, 4, "bad batch 5", 6, 7, 8, "bad batch 9", 10, 11, 12, 13]


SIGTERM_DURING_SET_UP = """
import os, signal
from training import xla_backend
init = xla_backend.XLABackend.__init__
def init_with_a_signal(self, cfg):
    os.kill(os.getpid(), signal.SIGTERM)
    init(self, cfg)
xla_backend.XLABackend.__init__ = init_with_a_signal
"""


def test_one_in_process_worker_keeps_the_default_signal_handlers_outside_the_loop(tmp_path, stdlib_data):
    """xla.nprocs=1 runs the worker in the launcher's process, so there is nobody to pass a
    signal on to: a SIGTERM during set-up ends the process as it ends train.py's (nothing to
    save yet). The launcher's forwarding handler swallowed it, and the run trained on."""
    cfg = tiny_config(tmp_path, stdlib_data, **{"training.max_steps": 3})
    r = run_patched(tmp_path, SIGTERM_DURING_SET_UP, ["train_xla.py", cfg, "xla.nprocs=1"])
    assert r.returncode == -signal.SIGTERM, r.stderr[-3000:]
    assert not list((tmp_path / "run").glob("ckpt_*"))


# xmp.spawn's pool as torch_xla 2.9's run_multiprocess builds it, with two replica processes
# (PJRT CPU gives one process, so the multi-process case is this stand-in): replica 1 fails at
# start, replica 0 trains on into a collective that waits for replica 1 for ever (a sleep),
# where a SIGTERM does not reach it.
PEER_FAILS = """
import concurrent.futures, multiprocessing, sys, time
sys.path.insert(0, {root!r})
import train_xla
from training.loop import main

class NoDevice:
    def __init__(self, cfg):
        pass
    def shutdown(self):
        pass

READY = {ready!r}  # replica 0 has its stop handlers: replica 1 fails only then (the pool's SIGTERM
                  # would otherwise end a replica still starting up, and there would be none to stop)

def replica(index, cfg):
    import os, training.launch, training.xla_backend
    from training.loop import STOP
    STOP.install()  # as train_xla.py's workers: SIGTERM asks for a stop, it does not end the process
    training.xla_backend.XLABackend = NoDevice
    training.launch.one_pjrt_cpu_device = lambda: False   # a spawned worker, as on a TPU host
    def train(cfg, backend):
        if index == 1:
            while not os.path.exists(READY):
                time.sleep(0.05)
            raise ValueError("data: shard 3 is unreadable")
        open(READY, "w").close()
        time.sleep(600)
    train_xla.train = train
    train_xla._worker(index, cfg)

def spawn(fn, args=(), nprocs=None):
    with concurrent.futures.ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(replica, range(2), [args[0]] * 2))

if __name__ == "__main__":
    import torch_xla.distributed.xla_multiprocessing as xmp
    xmp.spawn = spawn
    import training.launch
    training.launch.one_pjrt_cpu_device = lambda: False   # the pool, which PJRT CPU's one replica skips
    train_xla.WORKER_GRACE_S = 1.0
    sys.exit(main([{cfg!r}], train_xla.run, "train_xla.py", entry="xla"))
"""


def test_a_failed_replica_stops_the_others(tmp_path, stdlib_data):
    """A spawned replica that fails ends its process, and the launcher stops the replicas that
    wait for it: before, its error went back to the pool, which reports nothing until every
    replica has returned, and the others waited in a collective for ever (this run timed out)."""
    script = tmp_path / "peer_fails.py"
    script.write_text(PEER_FAILS.format(root=str(ROOT), cfg=str(tiny_config(tmp_path, stdlib_data)),
                                        ready=str(tmp_path / "replica0.ready")))
    r = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=ENV, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "train_xla.py: error: [process 1] data: shard 3 is unreadable" in r.stderr
    # (the killed process may leave the pool's semaphores to the resource tracker, which warns after)
    assert ("train_xla.py: error: a worker process ended with exit code 2 (its error is above); 1 other(s) "
            "stopped after 1 s") in r.stderr.splitlines(), r.stderr[-3000:]


def test_what_the_backend_cannot_run_is_refused_once_before_spawning(tmp_path, stdlib_data):
    """scan_layers with dropout: one line from the launcher (it came from every worker, and then
    once more as the launcher's report of their exit)."""
    r = run(["train_xla.py", str(tiny_config(tmp_path, stdlib_data)), "xla.scan_layers=true", "model.dropout=0.1"])
    errors = [ln for ln in r.stderr.splitlines() if "error:" in ln]
    assert r.returncode == 2 and len(errors) == 1 and "model.dropout=0.1" in errors[0], r.stderr[-3000:]


SEVERAL_HOSTS = r"""
import json, os
from torch_xla._internal import tpu
import train_xla

out = {}
for device, workers, slices in (("TPU", 1, None), ("TPU", 4, None), ("CPU", 4, None), ("TPU", 1, "2"),
                                ("TPU", 1, "1"), ("CPU", 1, "2")):
    os.environ["PJRT_DEVICE"] = device
    os.environ.pop("MEGASCALE_NUM_SLICES", None)
    if slices:  # what the multi-slice runtime is given on every host
        os.environ["MEGASCALE_NUM_SLICES"] = slices
    tpu.num_tpu_workers = lambda: workers   # the slice's worker count, from the TPU metadata
    out[f"{device} {workers} {slices}"] = train_xla._several_hosts(None)
print("REPORT " + json.dumps(out))
"""


PJRT_DEVICES = r"""
import json, os
from types import SimpleNamespace
from torch_xla._internal import tpu
import train_xla
from training.config import ConfigError

out = {}
# (PJRT_DEVICE, libtpu, chips on the PCI bus as torch_xla counts them, TPU device nodes, mode)
for value, libtpu, chips, nodes, mode in (
        ("CPU", False, 0, False, "ddp"), ("cpu", False, 0, False, "ddp"), ("GPU", False, 0, False, "ddp"),
        ("TPU", False, 4, True, "ddp"), ("TPU", True, 0, False, "ddp"), ("TPU", True, 0, True, "spmd"),
        ("TPU", True, 0, False, "spmd"), ("TPU", True, 4, True, "ddp"), ("TPU_C_API", True, 4, True, "ddp"),
        ("XPU", False, 0, False, "ddp")):
    os.environ["PJRT_DEVICE"] = value
    train_xla._libtpu_found = lambda: libtpu
    train_xla._tpu_device_nodes = lambda: nodes
    tpu.num_available_chips = lambda: chips
    cfg = SimpleNamespace(xla=SimpleNamespace(mode=mode, nprocs=None))
    key = f"{value} {libtpu} {chips} {nodes} {mode}"
    try:
        train_xla._check_pjrt_device(cfg)
        out[key] = None
    except ConfigError as e:
        out[key] = str(e)
print("REPORT " + json.dumps(out))
"""


def test_a_pjrt_device_torch_xla_cannot_run_is_one_line_naming_it(tmp_path, stdlib_data):
    """PJRT_DEVICE=cpu was a worker's bare ``KeyError: 'cpu'`` said to have a traceback above it
    (none was), TPU without libtpu a traceback, TPU without a chip ``max_workers must be greater
    than 0``: each is now one line naming PJRT_DEVICE, before anything starts. xmp.spawn counts
    the chips (a process each), so only ddp mode needs one found on the PCI bus; one process (SPMD)
    needs the TPU's device nodes (libtpu finds chips newer than torch_xla's PCI table), and
    without them was torch_xla's traceback."""
    out = script_report(PJRT_DEVICES, env=ENV)
    no_libtpu = ("PJRT_DEVICE=TPU, but libtpu (pip install torch_xla[tpu]) is not installed here; on a machine "
                 "without that device use PJRT_DEVICE=CPU (or unset it: train_xla.py finds the device)")
    assert out.pop("cpu False 0 False ddp").endswith("; did you mean CPU?")
    assert out.pop("GPU False 0 False ddp").startswith(
        "PJRT_DEVICE=GPU: torch_xla has no device of that name (here: CPU, ")
    # a plugin's device whose library is not here (torch_xla lists XPU): was a traceback from libxpu.so
    assert out.pop("XPU False 0 False ddp").startswith("PJRT_DEVICE=XPU, but torch_xla's XPU plugin cannot load "
                                                       "here (libxpu.so: cannot open shared object file")
    assert out == {"CPU False 0 False ddp": None, "TPU False 4 True ddp": no_libtpu,
                   "TPU True 0 False ddp": "PJRT_DEVICE=TPU, but this machine has no TPU chip (torch_xla finds none "
                                           "on its PCI bus); on a machine without a TPU use PJRT_DEVICE=CPU",
                   "TPU True 0 True spmd": None,
                   "TPU True 0 False spmd": "PJRT_DEVICE=TPU, but this machine has no TPU device (no /dev/accel* or "
                                            "/dev/vfio/N); on a machine without a TPU use PJRT_DEVICE=CPU",
                   "TPU True 4 True ddp": None, "TPU_C_API True 4 True ddp": None}
    r = run(["train_xla.py", str(tiny_config(tmp_path, stdlib_data))], env={**ENV, "PJRT_DEVICE": "cpu"})
    assert r.returncode == 2 and r.stderr.splitlines() == [
        "train_xla.py: error: PJRT_DEVICE=cpu: torch_xla has no device of that name (here: "
        + r.stderr.split("(here: ")[1].split(")")[0] + "); did you mean CPU?"], r.stderr[-3000:]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("pjrt, devices, mode, nprocs, spawns", [
    ("CPU", None, "ddp", None, False), ("CPU", "1", "ddp", None, False),   # torch_xla's pool: one process
    ("CPU", "4", "ddp", None, True),     # its replicas as threads, which the backend refuses in one line
    ("TPU", None, "ddp", None, True), ("TPU", None, "ddp", 1, False), ("TPU", None, "spmd", None, False),
    ("CPU", "4", "spmd", None, False)])
def test_ddp_on_one_cpu_device_runs_in_the_launchers_process(monkeypatch, pjrt, devices, mode, nprocs, spawns):
    """xmp.spawn on PJRT CPU starts one process for one replica: Python, torch and torch_xla a
    second time for what the launcher's process can run itself (train_xla.py with xla.nprocs 1)."""
    from types import SimpleNamespace

    import train_xla
    monkeypatch.setenv("PJRT_DEVICE", pjrt)
    if devices is None:
        monkeypatch.delenv("CPU_NUM_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CPU_NUM_DEVICES", devices)
    assert train_xla._spawns(SimpleNamespace(xla=SimpleNamespace(mode=mode, nprocs=nprocs))) is spawns


MASTER_ADDRESS = r"""
import json
import torch_xla.runtime as xr
from torch_xla._internal import tpu
from training.xla_backend import tpu_master_address

xr.use_spmd()
out = {}
tpu.discover_master_worker_ip = lambda: "discovered"   # torch_xla's answer (a one-host slice: localhost)
tpu._using_env_vars = lambda: False
tpu._get_metadata = lambda key: {"worker-network-endpoints": "t1v-n-1-w-0:2f7a:127.0.0.9"}[key]
for hosts, workers in ((1, 1), (2, 1), (2, 4)):
    xr.process_count = lambda: hosts
    tpu.get_worker_ips = lambda: ["localhost"] if workers == 1 else [f"10.0.0.{i}" for i in range(workers)]
    out[f"spmd {hosts} {workers}"] = tpu_master_address(True)
out["ddp 2 1"] = tpu_master_address(False)
tpu._using_env_vars = lambda: True                     # GKE: no metadata server (multi-host slices only)
out["spmd 2 1 gke"] = tpu_master_address(True)
print("REPORT " + json.dumps(out))
"""


def test_a_multi_slice_job_of_one_host_slices_finds_process_0s_host():
    """torch_xla 2.9 answers "localhost" for the rendezvous host when the slice has one worker,
    also when other slices' hosts are in the job (2 x v6e-8): every other host waited for a store
    on its own machine. There the address is torch_xla's own all-gather of every process's
    address over the devices (run here for real on a 4-device mesh, where process 0 is this one),
    fed this host's address from the TPU metadata; elsewhere torch_xla's answer stands."""
    out = script_report(MASTER_ADDRESS, env={**ENV, "CPU_NUM_DEVICES": "4"})
    assert out == {"spmd 1 1": "discovered", "spmd 2 1": "127.0.0.9", "spmd 2 4": "discovered",
                   "ddp 2 1": "discovered", "spmd 2 1 gke": "discovered"}


def test_only_a_pod_slice_launches_its_hosts_together():
    """A failed data check waits for the other hosts' verdict only on a multi-host TPU slice or
    a multi-slice job (whose slices may be one host each: 2 x v6e-8); a single-host TPU VM, or
    PJRT CPU, refuses alone at once."""
    out = script_report(SEVERAL_HOSTS, env=ENV)
    assert out == {"TPU 1 None": False, "TPU 4 None": True, "CPU 4 None": False, "TPU 1 2": True,
                   "TPU 1 1": False, "CPU 1 2": False}
