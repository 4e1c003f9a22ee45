"""Checkpoints, piece by piece and in one process: both forms through one loader, commit markers,
rotation, asynchronous saves, a SIGKILL in the middle of a write, safe loading of DCP metadata,
format-1 files, consolidation, and the host-side decisions between two processes."""
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from helpers import ENV, ROOT, free_port, in_process, losses, run, spawn_two, tiny_config
import training.checkpoint as checkpoint_module
from training.checkpoint import (FORMAT_VERSION, MARKER, Checkpointer, CheckpointError, atomic_torch_save,
                                 checkpoint_digest, checkpoint_path, find_latest, find_resume, list_checkpoints,
                                 load_checkpoint, optimizer_state_by_name, peek_checkpoint, read_dcp_metadata,
                                 release_run_lock, resolve_checkpoint, rotate, rng_state)


# -- a tiny model and optimiser, saved through the real backend ----------------------------------

def _setup(sharded: bool, async_save: bool = False, run_dir: Path | None = None, keep: int = 2):
    from model import ModelConfig, NashMHC
    from training.backend import TorchBackend
    from training.config import load_config
    from training.optim import build_optimizer

    torch.manual_seed(0)
    model = NashMHC(ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1,
                                max_seq_len=16, mhc_streams=2, nash_scales=2, nash_compression=4,
                                nash_window=8))
    tcfg = load_config(None, ["training.max_steps=1"]).training
    backend = TorchBackend("cpu")
    backend.checkpoint_format = "dcp" if sharded else "file"  # DCP in one process: no group
    opt = build_optimizer(model, tcfg, backend.adamw_factory())
    x = torch.randint(0, 64, (2, 16))
    model(x, x).loss.backward()
    opt.step()
    ck = Checkpointer(run_dir, keep=keep, backend=backend, log=lambda m: None, async_save=async_save)
    return model, opt, backend, ck


def _meta(step: int) -> dict:
    from training.config import load_config
    cfg = load_config(None, ["training.max_steps=1"])
    return {"format_version": 2, "step": step, "tokens_seen": 10 * step, "data": {"epoch": 0, "offset": step},
            "rng": rng_state(), "nonfinite": {"total": 0}, "config": cfg.to_dict(), "trainer": "torch"}


def test_an_asynchronous_save_waits_for_the_one_before(tmp_path):
    """checkpoint.async keeps at most one save pending: the next save waits for it, so two writes
    never overlap and the earlier checkpoint is committed before the later one's rotation runs
    (which would take a half-written one for unfinished). The first write is slowed down so that
    an overlap, if the wait were missing, would be seen; with the wait the outcome does not depend
    on timing."""
    import threading
    run_dir = tmp_path / "run"
    model, opt, backend, ck = _setup(False, True, run_dir, keep=5)
    write, lock, busy, most = ck._write_file, threading.Lock(), [0], [0]

    def slow_write(path, obj):
        with lock:
            busy[0] += 1
            most[0] = max(most[0], busy[0])
        try:
            time.sleep(0.3)
            return write(path, obj)
        finally:
            with lock:
                busy[0] -= 1

    ck._write_file = slow_write
    ck.save(_meta(2), model, opt, "test")
    ck.save(_meta(4), model, opt, "test")
    assert checkpoint_path(run_dir, 2).exists()   # committed before the second save returned
    ck.wait()
    assert most[0] == 1 and [s for s, _ in list_checkpoints(run_dir)] == [2, 4]


def test_a_save_that_failed_on_another_process_stops_this_one_too(tmp_path, monkeypatch):
    model, opt, backend, ck = _setup(False, True, tmp_path / "run")
    ck.save(_meta(2), model, opt, "test")
    monkeypatch.setattr(backend, "any_process", lambda *flags: True)  # the master's write failed
    with pytest.raises(CheckpointError, match="saving a checkpoint failed on another process"):
        ck.wait()
    with pytest.raises(CheckpointError, match="saving a checkpoint failed on another process"):
        ck.save(_meta(4), model, opt, "test", wait=True)
    ck.wait(quiet=True)  # on an error path: no agreement asked for, nothing raised


@pytest.mark.parametrize("sharded", [False, True], ids=["file", "dcp"])
def test_a_checkpoint_of_a_newer_format_is_refused(tmp_path, sharded):
    """A checkpoint written by a newer format (a later version of this code) is refused in one line
    by every reader, not loaded and misread."""
    from training.checkpoint import FORMAT_VERSION, peek_checkpoint
    model, opt, backend, ck = _setup(sharded, run_dir=tmp_path)
    path = ck.save(_meta(2), model, opt, "test", wait=True)
    if sharded:
        marker = json.loads((path / MARKER).read_text())
        marker["format_version"] = FORMAT_VERSION + 1
        (path / MARKER).write_text(json.dumps(marker))
    else:
        ckpt = torch.load(path, weights_only=True)
        ckpt["format_version"] = FORMAT_VERSION + 1
        torch.save(ckpt, path)
    for read in (peek_checkpoint, load_checkpoint):
        with pytest.raises(CheckpointError) as e:
            read(path)
        assert str(e.value).startswith(str(path)) and "\n" not in str(e.value)
        newer = f": format_version {FORMAT_VERSION + 1} is newer than this code's {FORMAT_VERSION}"
        assert str(e.value).endswith(newer)

@pytest.mark.parametrize("sharded, async_save", [(False, False), (True, False), (True, True)])
def test_both_forms_save_and_load_the_same_dict(tmp_path, sharded, async_save):
    model, opt, backend, ck = _setup(sharded, async_save, tmp_path)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    path = ck.save(_meta(3), model, opt, "test")
    with torch.no_grad():  # training goes on while an asynchronous save is written
        for p in model.parameters():
            p.add_(1.0)
    ck.wait()
    assert path == checkpoint_path(tmp_path, 3, sharded) and list_checkpoints(tmp_path) == [(3, path)]
    if sharded:
        assert json.loads((path / MARKER).read_text())["step"] == 3
    ckpt = load_checkpoint(path)
    assert ckpt["step"] == 3 and ckpt["data"] == {"epoch": 0, "offset": 3}
    assert ckpt["model"].keys() == saved.keys()
    for k, v in saved.items():  # the state at the save, not after it
        assert torch.equal(ckpt["model"][k], v), k
    state = ckpt["optimizer"]["state"]
    assert set(state) == {n for n, _ in model.named_parameters()}  # a tied tensor once
    assert torch.equal(state["tok_emb.weight"]["exp_avg"], opt.state[model.tok_emb.weight]["exp_avg"])
    assert [g["params"] for g in ckpt["optimizer"]["param_groups"]][1][0] == "tok_emb.weight"
    assert torch.equal(ckpt["rng"]["torch"], _meta(3)["rng"]["torch"])
    # a fresh model and optimiser take it back (by parameter name) and keep their own lr
    model2, opt2, backend2, ck2 = _setup(sharded, run_dir=tmp_path)
    for g in opt2.param_groups:
        g["lr"] = 0.123
    found = ck2.find("auto")
    ck2.restore(*found, model2, opt2)
    for k, v in model2.state_dict().items():
        assert torch.equal(ckpt["model"][k], v), k
    assert torch.equal(opt2.state[model2.tok_emb.weight]["exp_avg_sq"], state["tok_emb.weight"]["exp_avg_sq"])
    assert all(g["lr"] == 0.123 for g in opt2.param_groups)


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("part, bad", [("torch", "short"), ("numpy", "short"), ("python", "short")])
def test_a_malformed_rng_state_is_refused_when_peeked_naming_the_checkpoint(tmp_path, sharded, part, bad):
    """An RNG part of the wrong size (a hand-edited or damaged checkpoint) passed the peek and
    failed in the middle of the resume with a traceback; now the peek refuses it in one line that
    names the checkpoint, and resume falls back to the previous one."""
    from training.checkpoint import peek_checkpoint

    model, opt, backend, ck = _setup(sharded, run_dir=tmp_path)
    good = ck.save(_meta(2), model, opt, "test", wait=True)
    meta = _meta(4)
    if part == "torch":
        meta["rng"]["torch"] = meta["rng"]["torch"][:100]
    elif part == "numpy":
        meta["rng"]["numpy"][1] = meta["rng"]["numpy"][1][:10]
    else:
        meta["rng"]["python"] = [3, meta["rng"]["python"][1][:5], None]
    path = ck.save(meta, model, opt, "test", wait=True)
    with pytest.raises(CheckpointError, match=f"^{path}: malformed RNG state") as e:
        peek_checkpoint(path)
    assert "\n" not in str(e.value)
    warned = []
    assert find_latest(tmp_path, warn=warned.append)[0] == good
    assert len(warned) == 1 and "malformed RNG state" in warned[0]


def test_rotation_deletes_only_older_committed_checkpoints(tmp_path):
    model, opt, backend, ck = _setup(True, run_dir=tmp_path)
    for s in (10, 20):
        ck.save(_meta(s), model, opt, "test")
    stale = checkpoint_path(tmp_path, 15, sharded=True)   # a save that never committed
    stale.mkdir()
    (stale / "__0_0.distcp").write_bytes(b"partial")
    newer = checkpoint_path(tmp_path, 40, sharded=True)   # (not older than the new commit)
    newer.mkdir()
    ck.save(_meta(30), model, opt, "test")
    assert [s for s, _ in list_checkpoints(tmp_path)] == [20, 30]  # keep: 2
    assert not stale.exists() and newer.exists()
    # at start the master removes every unfinished save, and resumes from the newest commit
    path, meta = ck.find("auto")
    assert not newer.exists() and meta["step"] == 30 and "model" not in meta


def test_uncommitted_and_corrupt_checkpoints_fall_back(tmp_path):
    model, opt, backend, ck = _setup(True, run_dir=tmp_path, keep=4)
    for s in (10, 20, 30, 40):
        ck.save(_meta(s), model, opt, "test")
    (checkpoint_path(tmp_path, 40, True) / MARKER).write_text("[]")   # 40: a marker that is no object
    (checkpoint_path(tmp_path, 30, True) / MARKER).unlink()          # 30: not committed
    shard = next(checkpoint_path(tmp_path, 20, True).glob("*.distcp"))  # 20: truncated shard
    shard.write_bytes(shard.read_bytes()[:100])
    warnings = []
    path, meta = find_latest(tmp_path, warn=warnings.append)
    assert path == checkpoint_path(tmp_path, 10, True) and meta["step"] == 10
    assert len(warnings) == 2 and "ckpt_00000040" in warnings[0] and "not an object" in warnings[0]
    assert "truncated" in warnings[1] and "ckpt_00000020" in warnings[1]
    with pytest.raises(CheckpointError, match="not committed"):
        load_checkpoint(checkpoint_path(tmp_path, 30, True))


def test_a_file_that_is_no_checkpoint_is_named_for_what_it_is(tmp_path):
    """torch.load's messages for what is not its zip format were its own (an HF export's weights:
    "mmap can only be used with files saved with ..._use_new_zipfile_serialization=True"), and a
    model directory was "no checkpoint in this run directory": each is now said for what it is."""
    from safetensors.torch import save_file

    model, opt, backend, ck = _setup(False, run_dir=tmp_path / "run")
    good = ck.save(_meta(1), model, opt, "test")
    files = {"empty.pt": b"", "text.pt": b"step: 1\n", "truncated.pt": good.read_bytes()[:2000]}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    save_file({"w": torch.zeros(2)}, tmp_path / "model.safetensors")
    said = {}
    for name in [*files, "model.safetensors"]:
        with pytest.raises(CheckpointError) as e:
            load_checkpoint(tmp_path / name)
        said[name] = str(e.value).removeprefix(f"{tmp_path / name}: not a loadable checkpoint (")
    assert said["empty.pt"] == "the file is empty)"
    assert said["text.pt"] == "its bytes are not torch.save's zip format)"
    assert said["truncated.pt"].startswith("a truncated or corrupt torch.save file: ")
    assert said["model.safetensors"].startswith("a safetensors file, weights alone: a Hugging Face model's")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"hf: a Hugging Face model directory \(config.json\), not a checkpoint"):
        resolve_checkpoint(hf)


class Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_dcp_metadata_is_refused_without_running_it(tmp_path):
    run_dir = tmp_path / "run"
    model, opt, backend, ck = _setup(True, run_dir=run_dir)
    ck.save(_meta(10), model, opt, "test")
    ck.save(_meta(20), model, opt, "test")  # keep: 2
    ckpt_dir = checkpoint_path(run_dir, 20, True)
    pwned = tmp_path / "pwned"
    with open(ckpt_dir / ".metadata", "wb") as f:
        pickle.dump(Evil(pwned), f)
    with pytest.raises(CheckpointError, match="refused to load posix.system|refused to load os.system"):
        load_checkpoint(ckpt_dir)
    warnings = []
    assert find_latest(run_dir, warn=warnings.append)[1]["step"] == 10  # resume falls back
    assert "refused" in warnings[0]
    r = run(["sample.py", str(ckpt_dir)])
    assert r.returncode == 2 and "refused" in r.stderr and "Traceback" not in r.stderr
    r = run(["-m", "training.checkpoint", "consolidate", str(ckpt_dir), str(tmp_path / "out.pt")])
    assert r.returncode == 2 and "refused" in r.stderr and not (tmp_path / "out.pt").exists()
    assert not pwned.exists()


def test_dcp_metadata_may_hold_tensor_entries_in_its_own_files_only(tmp_path):
    """Legitimate classes, bad content: a byte entry (DCP would torch.load it with
    weights_only=False) and a storage path outside the directory are refused."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata
    model, opt, backend, ck = _setup(True, run_dir=tmp_path)
    path = ck.save(_meta(1), model, opt, "test")
    good = (path / ".metadata").read_bytes()
    meta = read_dcp_metadata(path)
    meta.state_dict_metadata["payload"] = BytesStorageMetadata()
    (path / ".metadata").write_bytes(pickle.dumps(meta))
    with pytest.raises(CheckpointError, match="'payload' is not a tensor"):
        load_checkpoint(path)
    (path / ".metadata").write_bytes(good)
    meta = read_dcp_metadata(path)
    info = next(iter(meta.storage_data.values()))
    info.relative_path = "../../etc/passwd"
    (path / ".metadata").write_bytes(pickle.dumps(meta))
    with pytest.raises(CheckpointError, match="bad storage entry"):
        load_checkpoint(path)


def test_consolidate_writes_one_weights_only_file(tmp_path, capsys):
    from training.checkpoint import main as checkpoint_main
    # the first run is the command line; the others call its main in this process (the same exit
    # status and stderr; 3 s of interpreter start each, a dozen times)
    consolidate_cli = lambda args: in_process(checkpoint_main, args, capsys)  # noqa: E731
    model, opt, backend, ck = _setup(True, run_dir=tmp_path / "run")
    src = ck.save(_meta(7), model, opt, "test")
    out = tmp_path / "model.pt"
    r = run(["-m", "training.checkpoint", "consolidate", str(tmp_path / "run"), str(out)])  # the command
    assert r.returncode == 0, r.stderr[-2000:]
    one = torch.load(out, weights_only=True)
    ref = load_checkpoint(src)
    assert one["step"] == 7 and one.keys() == ref.keys()
    assert all(torch.equal(one["model"][k], v) for k, v in ref["model"].items())
    assert torch.equal(one["optimizer"]["state"]["tok_emb.weight"]["exp_avg"],
                       ref["optimizer"]["state"]["tok_emb.weight"]["exp_avg"])
    r = consolidate_cli(["consolidate", str(src), str(out)])
    assert r.returncode == 2 and "exists" in r.stderr  # never replaced silently
    r = consolidate_cli(["consolidate", str(src), str(out), "--overwrite", "--model-only"])
    assert r.returncode == 0 and "optimizer" not in torch.load(out, weights_only=True)
    r = consolidate_cli(["consolidate", str(src), str(tmp_path), "--overwrite"])
    assert r.returncode == 2 and "Traceback" not in r.stderr and f"{tmp_path}: is a directory" in r.stderr
    blocked = tmp_path / "a_file" / "model.pt"  # its parent is a file: nothing can be written there
    (tmp_path / "a_file").write_text("x")
    r = consolidate_cli(["consolidate", str(src), str(blocked)])
    assert r.returncode == 2 and "Traceback" not in r.stderr and f"{blocked}: cannot write" in r.stderr
    r = consolidate_cli(["consolidate", str(src), "/dev/null", "--overwrite"])
    assert r.returncode == 2 and "/dev/null: not a regular file" in r.stderr and Path("/dev/null").is_char_device()
    # --overwrite replaces a torch.save file only: not one of anything else (a mistyped OUT) ...
    import zipfile
    text, archive = tmp_path / "notes.txt", tmp_path / "notes.zip"
    text.write_text("mine")
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("notes/readme.txt", "mine")
    for path, what in ((text, "its bytes are not torch.save's zip format"),
                       (archive, "a zip archive torch.save did not write")):
        before = path.read_bytes()
        r = consolidate_cli(["consolidate", str(src), str(path), "--overwrite"])
        assert r.returncode == 2 and (f"{path}: not a checkpoint ({what}); --overwrite replaces a checkpoint "
                                      "only") in r.stderr, r.stderr
        assert path.read_bytes() == before
    # ... but a checkpoint it cannot load is still one: a newer format's, a copy cut short, an empty file
    newer, cut, empty = tmp_path / "newer.pt", tmp_path / "cut.pt", tmp_path / "empty.pt"
    torch.save({**ref, "format_version": FORMAT_VERSION + 1}, newer)
    cut.write_bytes(out.read_bytes()[:4096])
    empty.write_bytes(b"")
    for path in (newer, cut, empty):
        r = consolidate_cli(["consolidate", str(src), str(path), "--overwrite", "--model-only"])
        assert r.returncode == 0, r.stderr
        assert load_checkpoint(path)["step"] == 7
    foreign = tmp_path / "foreign.pt"
    for bad, said in [({"format_version": "2"}, "not a Nash-MHC checkpoint (format_version '2' is not an integer)"),
                      ({"format_version": 2}, "missing or malformed 'step'"),
                      ({**ref, "data": {"epoch": 0, "offset": "3"}}, "missing or malformed 'data' (epoch and offset)"),
                      ({**ref, "rng": None}, "missing or malformed 'rng'")]:
        torch.save({"model": {}, **bad}, foreign)
        r = consolidate_cli(["consolidate", str(foreign), str(tmp_path / "f.pt")])
        assert r.returncode == 2 and "Traceback" not in r.stderr and f"{foreign}: {said}" in r.stderr, r.stderr


# -- a SIGKILL in the middle of an asynchronous write ---------------------------------------------

# Runs train.py with checkpoint.async=true; the background write of step 10's checkpoint writes
# half its bytes and stops there (and says so in a file), as a preempted host would.
_HANG_AT_STEP_10 = textwrap.dedent("""
    import sys, threading, torch
    import training.checkpoint as c
    hung = sys.argv[1]
    real_save = torch.save
    def save(obj, f, *a, **k):
        if isinstance(obj, dict) and obj.get("step") == 10:
            real_save(obj, f, *a, **k)
            with open(f, "r+b") as fh:
                fh.truncate(fh.seek(0, 2) // 2)
            open(hung, "w").close()
            threading.Event().wait()  # the write never finishes
        return real_save(obj, f, *a, **k)
    c.torch.save = save
    sys.argv = ["train.py", *sys.argv[2:]]
    import train
    from training.loop import main
    sys.exit(main(sys.argv[1:], train.run, "train.py"))
""")


def test_sigkill_during_an_async_write_leaves_the_previous_checkpoint(tmp_path, stdlib_data):
    cfg = tiny_config(tmp_path, stdlib_data, **{"checkpoint.interval": 5, "checkpoint.async": True,
                                                "evaluation.interval": 0, "training.max_steps": 14})
    hung = tmp_path / "hung"
    proc = subprocess.Popen([sys.executable, "-c", _HANG_AT_STEP_10, str(hung), str(cfg)], cwd=ROOT,
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while not hung.exists():  # a file the hanging writer creates: no clock involved
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.communicate(timeout=60)
    run_dir = tmp_path / "run"
    before = losses(run_dir)
    assert [s for s, _ in list_checkpoints(run_dir)] == [5] and list(run_dir.glob(".ckpt_00000010.pt.tmp-*"))
    r = run(["train.py", str(cfg)])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stderr and "ckpt_00000005.pt" in r.stderr
    assert not list(run_dir.glob(".ckpt_*tmp*"))  # the unfinished write was cleaned
    after = losses(run_dir)
    assert sorted(after) == list(range(1, 15))
    for s in range(6, 11):  # redone from the step-5 checkpoint: the same steps
        assert abs(after[s] - before[s]) <= 1e-6, (s, after[s], before[s])


# -- a format-1 file (optimizer state by index) still resumes --------------------------------------

def test_format_1_checkpoints_still_resume(tmp_path, stdlib_data):
    over = {"checkpoint.interval": 4, "checkpoint.keep": 5, "evaluation.interval": 0,
            "training.max_steps": 8}
    cfg = tiny_config(tmp_path, stdlib_data, **over)
    r = run(["train.py", str(cfg)])
    assert r.returncode == 0, r.stderr[-3000:]
    run_dir = tmp_path / "run"
    ref = losses(run_dir)
    new = torch.load(run_dir / "ckpt_00000004.pt", weights_only=True)
    names = [n for g in new["optimizer"]["param_groups"] for n in g["params"]]
    index = {n: i for i, n in enumerate(names)}
    old = {**new, "format_version": 1, "optimizer": {  # what Optimizer.state_dict() gives
        "state": {index[n]: v for n, v in new["optimizer"]["state"].items()},
        "param_groups": [{**g, "params": [index[n] for n in g["params"]]}
                         for g in new["optimizer"]["param_groups"]]}}
    torch.save(old, run_dir / "ckpt_00000004.pt")
    (run_dir / "ckpt_00000008.pt").unlink()
    r = run(["train.py", str(cfg)])
    assert r.returncode == 0 and "resumed from" in r.stderr, r.stderr[-3000:]
    got = losses(run_dir)
    for s in range(5, 9):
        assert abs(got[s] - ref[s]) <= 1e-6, (s, got[s], ref[s])


# -- host-side decisions between two processes -----------------------------------------------------

def _decide(rank, store_path, out_dir):
    import torch.distributed as dist
    from training.distributed import HostGroup, new_gloo_group
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    host = HostGroup(new_gloo_group())
    res = {
        "any": host.any([rank == 1, False, True]),
        "equal": host.all_equal("meta.json v1"),
        "differ": host.all_equal(f"meta.json from rank {rank}"),
        "size": host.size,
        "max": host.max([rank, -3 - rank, 2 ** 40]),   # the next decision: -max(-interval) = min
    }
    (Path(out_dir) / f"{rank}.json").write_text(json.dumps(res))
    dist.destroy_process_group()


def test_host_group_decisions_are_the_same_everywhere(tmp_path):
    spawn_two(_decide, (str(tmp_path / "store"), str(tmp_path)))
    for rank in (0, 1):
        res = json.loads((tmp_path / f"{rank}.json").read_text())
        assert res == {"any": [True, False, True], "equal": True, "differ": False, "size": 2,
                       "max": [1, -3, 2 ** 40]}


def _shutdowns(rank, store_path, port, out_dir):
    import os
    import torch
    import torch.distributed as dist
    from training.backend import TorchBackend
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)  # the caller's
    backend = TorchBackend("cpu")
    ours = backend.ckpt_group
    res = {"made_when_there_was_one": backend.made_group, "host_size": backend.host.size}
    backend.shutdown()
    t = torch.ones(1)
    dist.all_reduce(t)                       # the caller's group still works
    res["callers_group_sum"] = t.item()
    try:
        dist.get_global_rank(ours, 0)
        res["backends_group"] = "still registered"
    except ValueError as e:
        res["backends_group"] = "destroyed" if "not registered" in str(e) else str(e)
    dist.destroy_process_group()
    backend = TorchBackend("cpu")            # no group now: it makes (and then destroys) its own
    res["made_when_there_was_none"] = backend.made_group
    backend.shutdown()
    res["initialized_after"] = dist.is_initialized()
    (Path(out_dir) / f"{rank}.json").write_text(json.dumps(res))


def test_a_backend_destroys_only_the_process_groups_it_made(tmp_path):
    """TorchBackend.shutdown: a default group that a caller (a notebook, a test, a launcher)
    initialised stays usable, only the backend's own gloo groups are destroyed; a default group
    the backend made is destroyed with every group."""
    port = free_port()
    spawn_two(_shutdowns, (str(tmp_path / "store"), port, str(tmp_path)))
    for rank in (0, 1):
        assert json.loads((tmp_path / f"{rank}.json").read_text()) == {
            "made_when_there_was_one": False, "host_size": 2, "callers_group_sum": 2.0,
            "backends_group": "destroyed", "made_when_there_was_none": True, "initialized_after": False}


def _stall(rank, port, out_dir):
    """Process 1 joins the groups, then never takes part in a collective; process 0 tries one on
    each group TorchBackend makes."""
    import os
    import time
    import torch
    import torch.distributed as dist
    from training.backend import TorchBackend
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    out = Path(out_dir)
    (out / f"ready{rank}").touch()   # both imported: the 2 s below start together, not at spawn
    for _ in range(1200):
        if (out / f"ready{1 - rank}").exists():
            break
        time.sleep(0.05)
    backend = TorchBackend("cpu", timeout_s=2)            # training.dist_timeout_s: 2
    done = out / "0.json"
    if rank == 1:
        for _ in range(600):                              # alive (its sockets open) until process 0 is done
            if done.exists():
                break
            time.sleep(0.2)
        return
    res = {}
    for name, collective in (("host decision", lambda: backend.host.max([1])),
                             ("training group", lambda: dist.all_reduce(torch.ones(1))),
                             ("checkpoint group", lambda: dist.all_reduce(torch.ones(1), group=backend.ckpt_group))):
        try:
            collective()
            res[name] = "returned"
        except RuntimeError as e:
            res[name] = str(e)
    done.write_text(json.dumps(res))
    # gloo's threads of the timed-out collectives are still joinable: the group's destructor at
    # interpreter exit then calls std::terminate (SIGABRT, 2 runs in 5 here), after the result
    # is written; leave without running it
    os._exit(0)


def test_a_process_that_stops_taking_part_fails_the_others_after_dist_timeout_s(tmp_path):
    """training.dist_timeout_s reaches every group train.py makes: a collective whose partner never
    comes raises after 2 s instead of waiting gloo's default 30 minutes (which this test's own
    limit would end as a failure)."""
    port = free_port()
    spawn_two(_stall, (port, str(tmp_path)))
    res = json.loads((tmp_path / "0.json").read_text())
    assert set(res) == {"host decision", "training group", "checkpoint group"}
    for name, said in res.items():
        assert "timed out" in said.lower() or "timeout" in said.lower(), (name, said)


def _find_in(rank, store_path, dirs, out_dir, unreadable_on=None, fmt="file", unwritable_on=None,
             resumes=("auto", "auto")):
    """Checkpointer.find(``resumes[rank]``) on two processes whose checkpoint.dir is ``dirs[rank]``;
    on process ``unreadable_on`` no checkpoint loads (a read that failed there only); on process
    ``unwritable_on`` no file can be written there (a read-only mount on one host)."""
    from types import SimpleNamespace

    import torch.distributed as dist
    import training.checkpoint as C
    from training.distributed import HostGroup, new_gloo_group
    if rank == unreadable_on:
        def peek(path):
            raise C.CheckpointError(f"{path}: truncated")
        C.peek_checkpoint = peek
    if rank == unwritable_on:
        def read_only(obj, path):
            raise OSError(30, "Read-only file system", str(path))
        C.atomic_write_json = read_only
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    host = HostGroup(new_gloo_group())
    backend = SimpleNamespace(host=host, is_master=rank == 0, checkpoint_format=fmt,
                              all_equal=host.all_equal)
    try:
        found = Checkpointer(dirs[rank], keep=1, backend=backend, log=lambda m: None).find(resumes[rank])
        res = {"found": found and str(found[0])}
    except CheckpointError as e:
        res = {"error": str(e)}
    (Path(out_dir) / f"{rank}.json").write_text(json.dumps(res))
    dist.destroy_process_group()


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "host-local"])
def test_a_checkpoint_dir_the_hosts_do_not_share_is_refused_by_all(tmp_path, shared):
    """Two hosts with a local checkpoint.dir each, both empty: they agree on 'nothing to resume',
    then every save would leave the master's directory without the other host's shards. find()
    refuses on both processes, in one line, before anything trains; a shared one passes and
    leaves no probe behind."""
    dirs = [str(tmp_path / "run")] * 2 if shared else [str(tmp_path / "host0"), str(tmp_path / "host1")]
    spawn_two(_find_in, (str(tmp_path / "store"), dirs, str(tmp_path)))
    res = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in (0, 1)]
    if shared:
        assert res == [{"found": None}] * 2
        assert [p.name for p in (tmp_path / "run").iterdir()] == [".lock"]  # the run's, no probe
    else:
        for rank in (0, 1):  # each names the directory it was given
            assert res[rank]["error"] == (
                f"checkpoint.dir={dirs[rank]}: process(es) 1 do not see the files process 0 writes there: "
                "put it on storage every host mounts (a shared filesystem or a gcsfuse bucket), at the same path")
        assert list((tmp_path / "host0").iterdir()) == [] and not (tmp_path / "host1").exists()


def test_a_second_run_on_a_checkpoint_dir_in_use_is_refused_and_touches_nothing(tmp_path, stdlib_data):
    """Launched twice, or requeued while the old job still runs: the second run's start deleted
    the first one's save in progress as unfinished. The master of a run holds a lock on the
    directory while it lives: another run is one line, exit 2, every file left as it was; once
    the first is gone the run resumes."""
    cfg = tiny_config(tmp_path, stdlib_data, **{"training.max_steps": 3, "checkpoint.interval": 3})
    assert run(["train.py", str(cfg)]).returncode == 0
    run_dir = tmp_path / "run"
    (run_dir / "ckpt_00000005").mkdir()  # another run's sharded save, still being written
    (run_dir / "ckpt_00000005" / "__0_0.distcp").write_bytes(b"shard")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys, time\n"
         "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\nfcntl.lockf(fd, fcntl.LOCK_EX)\n"
         "print('locked', flush=True)\ntime.sleep(600)", str(run_dir / ".lock")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        before = {p.name: (p.stat().st_mtime_ns, p.is_dir()) for p in run_dir.iterdir()}
        for resume in ("auto", "none"):
            r = run(["train.py", str(cfg), "training.max_steps=6", f"checkpoint.resume={resume}"])
            assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
            assert (f"checkpoint.dir={run_dir}: another run is using it (it holds {run_dir / '.lock'})"
                    in r.stderr), r.stderr[-2000:]
            assert {p.name: (p.stat().st_mtime_ns, p.is_dir()) for p in run_dir.iterdir()} == before
            assert (run_dir / "ckpt_00000005" / "__0_0.distcp").read_bytes() == b"shard"
    finally:
        holder.kill()
        holder.wait()
    r = run(["train.py", str(cfg), "training.max_steps=6"])
    assert r.returncode == 0 and "resumed from" in r.stderr and "unfinished save" in r.stderr, r.stderr[-2000:]


def test_the_run_lock_dies_with_the_master_not_with_its_forked_workers(tmp_path):
    """The master's data loader workers are forked from it. With the lock a ``flock`` (the open
    file's, which they share), a SIGKILLed master's workers held it on for seconds and an
    immediate restart was refused; the lock is now the master process's own."""
    from training.backend import TorchBackend

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    master = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from training.backend import TorchBackend
        from training.checkpoint import Checkpointer
        Checkpointer({str(run_dir)!r}, 2, TorchBackend("cpu"), log=lambda m: None)._lock_run_dir()
        worker = os.fork()
        if worker == 0:     # a data loader worker: lives on after its master
            time.sleep(600)
            os._exit(0)
        print(worker, flush=True)
        time.sleep(600)
        """)], stdout=subprocess.PIPE, text=True, env=ENV)
    worker = int(master.stdout.readline())
    try:
        with pytest.raises(CheckpointError, match="another run is using it"):   # the master holds it
            Checkpointer(run_dir, 2, TorchBackend("cpu"), log=lambda m: None)._lock_run_dir()
        master.kill()
        master.wait()
        os.kill(worker, 0)   # the worker is alive (raises if not) ...
        Checkpointer(run_dir, 2, TorchBackend("cpu"), log=lambda m: None)._lock_run_dir()  # ... and the lock is free
    finally:
        release_run_lock(run_dir)
        os.kill(worker, signal.SIGKILL)


def test_a_probe_left_by_a_killed_run_is_removed_under_the_lock(tmp_path):
    """Start-up probes of a run killed during its start are cleaned up, once the run directory's
    lock is held: before it, a second launch could delete a live run's probe (its other
    processes then refused the directory as not shared). Refused, a launch removes nothing."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / ".shared-probe-0123abcd").write_text("{}")
    model, opt, backend, ck = _setup(False, run_dir=run_dir)
    try:
        ck.find("auto")
        assert not list(run_dir.glob(".shared-probe-*"))
        (run_dir / ".shared-probe-live").write_text("{}")   # another launch's, while this run holds the lock
        child = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
            from training.backend import TorchBackend
            from training.checkpoint import Checkpointer, CheckpointError
            try:
                Checkpointer({str(run_dir)!r}, 2, TorchBackend("cpu"), log=print).find("auto")
            except CheckpointError as e:
                print("refused:", e)
            """)], cwd=ROOT, env={**ENV, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
        assert "refused:" in child.stdout and "another run is using it" in child.stdout, child.stderr[-2000:]
        assert (run_dir / ".shared-probe-live").exists()
    finally:
        release_run_lock(run_dir)


def test_a_collective_refusal_without_a_message_still_refuses():
    """``raise_together`` took an error whose text is empty for no error: nobody raised."""
    from training.distributed import HostGroup

    with pytest.raises(OSError):
        HostGroup().raise_together(OSError(), RuntimeError)
    with pytest.raises(CheckpointError):
        HostGroup().raise_together(CheckpointError(""), CheckpointError)
    HostGroup().raise_together(None, RuntimeError)


@pytest.mark.parametrize("fmt", ["file", "dcp"])
def test_hosts_resuming_from_their_own_copies_must_hold_the_same_checkpoint(tmp_path, fmt):
    """checkpoint.resume: a path on each host's own disk. Copies of one checkpoint resume; two
    different checkpoints under the same name and step (a copy of another run's) are refused on
    both processes with one line, where the names alone had agreed and the hosts trained apart."""
    model, opt, backend, _ = _setup(fmt == "dcp", run_dir=tmp_path / "a")
    backend.checkpoint_format = fmt
    name = "ckpt_00000003" + (".pt" if fmt == "file" else "")
    for d in ("a", "b"):   # two saves at step 3: the same name, other contents
        Checkpointer(tmp_path / d, keep=1, backend=backend, log=lambda m: None).save(_meta(3), model, opt, "test", wait=True)
        with torch.no_grad():
            next(model.parameters()).add_(1.0)
    copy = tmp_path / "copy" / name
    copy.parent.mkdir()
    (shutil.copytree if fmt == "dcp" else shutil.copy)(tmp_path / "a" / name, copy)
    for resumes, same in (((tmp_path / "a" / name, copy), True), ((tmp_path / "a" / name, tmp_path / "b" / name), False)):
        run_dir = tmp_path / f"run-{same}"
        spawn_two(_find_in, (str(tmp_path / f"store-{same}"), [str(run_dir)] * 2, str(tmp_path), None, fmt,
                             None, [str(r) for r in resumes]))
        res = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in (0, 1)]
        if same:
            assert [r.get("found") for r in res] == [str(r) for r in resumes]
        else:
            for rank in (0, 1):
                assert "the processes hold different contents under this name" in res[rank]["error"]
                assert str(resumes[rank]) in res[rank]["error"] and "\n" not in res[rank]["error"]


def test_checkpoints_of_which_none_loads_are_refused_not_restarted_over(tmp_path):
    """resume: auto over a run directory whose committed checkpoints all fail to load: starting
    from step 0 would save new checkpoints among them under the same names. Refused; nothing
    is deleted."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for step in (4, 8):
        (run_dir / f"ckpt_{step:08d}.pt").write_bytes(b"not a checkpoint")
    ckpt = _setup(False, run_dir=run_dir)[3]
    with pytest.raises(CheckpointError, match="holds committed checkpoints and none of them loads") as e:
        ckpt.find("auto")
    assert "\n" not in str(e.value)
    assert sorted(p.name for p in run_dir.iterdir()) == [".lock", "ckpt_00000004.pt", "ckpt_00000008.pt"]


def test_a_checkpoint_one_process_cannot_load_is_refused_by_both(tmp_path):
    """Process 1 cannot load the checkpoint process 0 resumes from: both refuse with the same
    line (one refusing alone would leave the other waiting in a collective)."""
    model, opt, backend, ck = _setup(False, run_dir=tmp_path / "run")
    ck.save(_meta(3), model, opt, "test", wait=True)
    dirs = [str(tmp_path / "run")] * 2
    spawn_two(_find_in, (str(tmp_path / "store"), dirs, str(tmp_path), 1))
    res = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in (0, 1)]
    assert res[0]["error"].startswith(f"{tmp_path / 'run'}: the processes see different checkpoints to resume from")
    assert res[1]["error"].startswith(f"{tmp_path / 'run'}: the processes see different checkpoints to resume from")
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [".lock", "ckpt_00000003.pt"]


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="Linux /proc memory accounting")
def test_processes_resuming_from_one_file_share_it():
    """Every DDP rank loads the whole single-file checkpoint; memory-mapped, the ranks of a host
    share the file's pages instead of each holding a private copy (bench/checkpoint.py
    --resume-processes: two processes, each touching every tensor, measured once both have)."""
    from bench.checkpoint import resume_memory

    r = resume_memory(2, d_model=128, layers=2)
    added = {how: r[how]["private_mib"] - r["nothing"]["private_mib"] for how in ("load_checkpoint", "torch.load")}
    assert added["torch.load"] >= 0.8 * r["file_mib"]  # the measurement sees a private copy (~0.92 measured)
    assert added["load_checkpoint"] <= 0.1 * r["file_mib"], (added, r)


@pytest.mark.parametrize("fmt", ["dcp", "file"])
def test_a_checkpoint_dir_one_process_cannot_write_is_refused_by_all_for_sharded_saves(tmp_path, fmt):
    """Sharded (DCP) saves need every process to write its own shards into checkpoint.dir: a
    process that could read the master's probe but not write there failed only at the first save,
    after training. Now every process writes (and removes) a probe of its own at the check, and
    all refuse together in one line naming the process. Single-file saves (the master writes
    alone) do not need it."""
    run_dir = str(tmp_path / "run")
    spawn_two(_find_in, (str(tmp_path / "store"), [run_dir] * 2, str(tmp_path), None, fmt, 1))
    res = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in (0, 1)]
    if fmt == "file":
        assert res == [{"found": None}] * 2
    else:
        want = (f"checkpoint.dir={run_dir}: process 1 cannot write there, and every process writes its own "
                f"shards of a sharded checkpoint: [Errno 30] Read-only file system: '{run_dir}/.shared-probe-")
        assert all(r["error"].startswith(want) and r["error"].endswith("-1'") for r in res), res
        assert res[0] == res[1]
    assert [p.name for p in (tmp_path / "run").iterdir()] == ([".lock"] if fmt == "file" else [])  # no probe


def test_an_atomic_write_fsyncs_the_temporary_file_before_the_rename(tmp_path, monkeypatch):
    """A file with a final name is complete on disk: its bytes are fsynced under the temporary
    name before the rename (without, a power loss after the rename can leave an empty or torn
    ckpt_*.pt that resume: auto takes for the newest checkpoint)."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", str(src), str(dst)))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    path = tmp_path / "ckpt_00000001.pt"
    atomic_torch_save({"x": torch.ones(3)}, path)
    renames = [e for e in events if e[0] == "replace"]
    assert len(renames) == 1 and renames[0][2] == str(path)
    tmp = renames[0][1]
    assert Path(tmp).name.startswith(".ckpt_00000001.pt.tmp-")
    assert events.index(("fsync", tmp)) < events.index(renames[0])   # the data, before the name
    assert events[-1] == ("fsync", str(tmp_path))                     # then the directory entry


def test_a_failed_atomic_write_leaves_no_temporary_file(tmp_path):
    """A write that fails (a full disk, an object torch cannot save) removes its temporary file:
    next to consolidate's OUT nothing ever cleans it up (a multi-GB file on a full disk)."""
    with pytest.raises(Exception):
        atomic_torch_save({"f": lambda: 0}, tmp_path / "model.pt")
    assert list(tmp_path.iterdir()) == []


def test_a_save_asked_to_wait_is_written_before_it_returns_even_with_async(tmp_path):
    """The last save of a run (wait=True) is written in the caller's thread and committed when
    save() returns, with checkpoint.async too: in a background daemon thread it would be lost
    when the process exits right after."""
    model, opt, backend, ck = _setup(False, True, tmp_path)
    write, threads = ck._write_file, []

    def recording_write(path, obj):
        threads.append(threading.current_thread())
        return write(path, obj)

    ck._write_file = recording_write
    path = ck.save(_meta(5), model, opt, "final", wait=True)
    assert threads == [threading.current_thread()]
    assert list_checkpoints(tmp_path) == [(5, path)]


def test_a_save_that_fails_deletes_no_older_checkpoint(tmp_path):
    """Rotation runs after the new checkpoint is committed, never before: with keep=1 a save that
    fails (a full disk) must leave the previous checkpoint, the only one to resume from."""
    model, opt, backend, ck = _setup(False, run_dir=tmp_path, keep=1)
    first = ck.save(_meta(2), model, opt, "test", wait=True)
    write = ck._write_file

    def full_disk(path, obj):
        raise OSError(28, "No space left on device")

    ck._write_file = full_disk
    with pytest.raises(CheckpointError, match="No space left on device"):
        ck.save(_meta(4), model, opt, "test", wait=True)
    assert list_checkpoints(tmp_path) == [(2, first)]
    ck._write_file = write
    second = ck.save(_meta(6), model, opt, "test", wait=True)
    assert list_checkpoints(tmp_path) == [(6, second)]   # keep: 1


def test_a_sharded_save_over_a_committed_one_of_the_same_step_uncommits_it_first(tmp_path, monkeypatch):
    """A DCP save into the directory of an earlier committed save of the same step removes that
    one first: if the new save then fails half-way, the old marker must not make the mix of old
    and new shards look committed."""
    import torch.distributed.checkpoint as dcp
    model, opt, backend, ck = _setup(True, run_dir=tmp_path)
    path = ck.save(_meta(3), model, opt, "test", wait=True)
    assert (path / MARKER).is_file()

    def dies_half_way(*args, **kwargs):
        (path / "__0_0.distcp").write_bytes(b"half")
        raise RuntimeError("the writer died")

    monkeypatch.setattr(dcp, "save", dies_half_way)
    with pytest.raises(CheckpointError, match="the writer died"):
        ck.save(_meta(3), model, opt, "test", wait=True)
    assert list_checkpoints(tmp_path) == [] and not (path / MARKER).exists()


def test_the_digest_of_a_file_tells_checkpoints_apart_by_their_tail(tmp_path):
    """checkpoint_digest reads a file's first and last ``window`` bytes: two checkpoints that
    differ only past the first window (the tensors; the zip's directory at its end records
    their CRCs) get different digests, copies the same."""
    a, b, copy = (tmp_path / d / "ckpt_00000003.pt" for d in ("a", "b", "copy"))   # one name: torch.save's
    for p in (a, b, copy):                                                          # records are named after it
        p.parent.mkdir()
    torch.save({"model": {"w": torch.zeros(4096)}}, a)
    torch.save({"model": {"w": torch.ones(4096)}}, b)
    assert a.stat().st_size == b.stat().st_size and a.read_bytes()[:256] == b.read_bytes()[:256]
    copy.write_bytes(a.read_bytes())
    assert checkpoint_digest(a, window=256) == checkpoint_digest(copy, window=256)
    assert checkpoint_digest(a, window=256) != checkpoint_digest(b, window=256)


def test_a_format_1_optimizer_state_of_another_parameter_count_is_refused(tmp_path):
    """Format 1 keys the optimiser state by index: a state saved for another number of parameters
    cannot be mapped to names and is refused in one line (it was mapped index by index onto the
    wrong parameters, or failed with an IndexError)."""
    model, opt, backend, _ = _setup(False, run_dir=tmp_path)
    state = opt.state_dict()
    assert set(optimizer_state_by_name(model, opt, state)["state"]) == {n for n, _ in model.named_parameters()}
    fewer = {"state": {i: v for i, v in state["state"].items() if i > 0},
             "param_groups": [{**state["param_groups"][0], "params": state["param_groups"][0]["params"][1:]},
                              *state["param_groups"][1:]]}
    with pytest.raises(CheckpointError, match=r"^the checkpoint's optimizer has \d+ parameters, this one \d+$"):
        optimizer_state_by_name(model, opt, fewer)


def test_a_shard_one_byte_short_is_refused_when_peeked(tmp_path):
    """read_dcp_metadata checks that every entry lies within its shard file (offset + length),
    not only that it starts there: a shard that lost its last byte is refused at the peek and
    resume: auto takes the one before, instead of failing in the middle of the restore."""
    model, opt, backend, ck = _setup(True, run_dir=tmp_path)
    good = ck.save(_meta(2), model, opt, "test", wait=True)
    path = ck.save(_meta(4), model, opt, "test", wait=True)
    for shard in path.glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[:-1])
    with pytest.raises(CheckpointError, match="missing or truncated$"):
        peek_checkpoint(path)
    warned = []
    assert find_latest(tmp_path, warn=warned.append)[0] == good and len(warned) == 1


def test_resume_auto_falls_back_past_a_newest_checkpoint_that_does_not_load(tmp_path):
    """checkpoint.resume=auto: a corrupt newest checkpoint is reported and the one before it
    resumed (the corrupt one is not a checkpoint 'ahead' of the start, as it is for a path)."""
    model, opt, backend, ck = _setup(False, run_dir=tmp_path, keep=5)
    good = ck.save(_meta(2), model, opt, "test", wait=True)
    checkpoint_path(tmp_path, 4).write_bytes(b"not a checkpoint")
    path, meta = ck.find("auto")
    assert path == good and meta["step"] == 2


def test_a_failed_dcp_save_is_said_by_its_first_failing_process(tmp_path):
    from torch.distributed.checkpoint.api import CheckpointException
    _, _, _, ck = _setup(False, run_dir=tmp_path)
    e = CheckpointException("ranks", {3: (OSError(28, "No space left on device"), None),
                                      1: (OSError(5, "Input/output error"), None)})
    assert ck._why(e).startswith("process 1: [Errno 5] Input/output error; ")


# -- what mutation testing of checkpoint.py found unpinned ---------------------------------------

def _ckpt(step):
    return {"format_version": FORMAT_VERSION, "model": {"w": torch.full((2,), float(step))}, "step": step}


def test_steps_past_eight_digits_are_ordered_by_number_not_by_name(tmp_path):
    """ckpt_100000000.pt (9 digits) is newer than ckpt_99999999.pt though it sorts before it as
    text: resume takes it, and rotation deletes the older one, not the newest."""
    for s in (99_999_999, 100_000_000):
        atomic_torch_save(_ckpt(s), checkpoint_path(tmp_path, s))
    assert [s for s, _ in list_checkpoints(tmp_path)] == [99_999_999, 100_000_000]
    assert find_latest(tmp_path, warn=lambda m: None)[1]["step"] == 100_000_000
    assert rotate(tmp_path, keep=1) == [checkpoint_path(tmp_path, 99_999_999)]
    assert [s for s, _ in list_checkpoints(tmp_path)] == [100_000_000]


def test_resolving_a_run_directory_takes_its_newest_checkpoint(tmp_path):
    """sample.py / resolve_checkpoint on a run directory: the newest committed checkpoint that
    loads, not the oldest."""
    for s in (10, 20, 30):
        atomic_torch_save(_ckpt(s), checkpoint_path(tmp_path, s))
    assert find_resume(tmp_path, warn=lambda m: None)[1]["step"] == 30
    path, ckpt = resolve_checkpoint(tmp_path, warn=lambda m: None)
    assert path == checkpoint_path(tmp_path, 30) and ckpt["step"] == 30


def _metadata_calling(tmp_path, module: str, name: str, args_pickle: bytes) -> bytes:
    """A protocol-0 pickle that calls the global module.name(*args) (hand-made: pickle would name
    torch.save by its defining module)."""
    return f"c{module}\n{name}\n(".encode() + args_pickle + b"tR."


def test_metadata_may_not_call_torch_functions(tmp_path):
    """Only dtypes of the torch namespace are admitted: a .metadata that calls torch.save (writes
    any file the user can) is refused and nothing is written."""
    model, opt, backend, ck = _setup(True, run_dir=tmp_path / "run")
    ck.save(_meta(1), model, opt, "test")
    path = ck.save(_meta(2), model, opt, "test")
    target = tmp_path / "written_by_pickle"
    (path / ".metadata").write_bytes(_metadata_calling(tmp_path, "torch", "save",
                                                       b"(dV" + b"x\nI1\ns" + f"V{target}\n".encode()))
    with pytest.raises(CheckpointError, match=r"refused to load torch\.save"):
        load_checkpoint(path)
    warned = []
    assert find_latest(tmp_path / "run", warn=warned.append)[1]["step"] == 1
    assert not target.exists()


@pytest.mark.parametrize("obj", [{}, [1, 2], torch.Size([3])], ids=["dict", "list", "size"])
def test_metadata_that_is_not_dcp_metadata_is_refused_in_one_line(tmp_path, obj):
    """A .metadata that unpickles (admitted classes) to something other than DCP's Metadata is a
    CheckpointError naming it, and resume: auto falls back; it was an AttributeError traceback."""
    model, opt, backend, ck = _setup(True, run_dir=tmp_path)
    good = ck.save(_meta(1), model, opt, "test")
    path = ck.save(_meta(2), model, opt, "test")
    (path / ".metadata").write_bytes(pickle.dumps(obj))
    with pytest.raises(CheckpointError, match="not DCP metadata$"):
        peek_checkpoint(path)
    assert find_latest(tmp_path, warn=lambda m: None)[0] == good


@pytest.mark.parametrize("field, value", [("step", True), ("data", {"epoch": 0}), ("tokens_seen", False)])
def test_a_malformed_marker_field_is_refused_and_resume_falls_back(tmp_path, field, value):
    """A marker whose step is a boolean or whose data lacks the stream offset is refused when
    peeked (before, it passed and the resume failed later, or resumed at step 1)."""
    model, opt, backend, ck = _setup(True, run_dir=tmp_path)
    good = ck.save(_meta(1), model, opt, "test")
    path = ck.save(_meta(2), model, opt, "test")
    marker = json.loads((path / MARKER).read_text())
    marker[field] = value
    (path / MARKER).write_text(json.dumps(marker))
    with pytest.raises(CheckpointError, match=f"^{path / MARKER}: missing or malformed '{field}'"):
        peek_checkpoint(path)
    assert find_latest(tmp_path, warn=lambda m: None)[0] == good


def test_deleting_a_checkpoint_uncommits_it_before_removing_its_shards(tmp_path, monkeypatch):
    """Rotation removes a DCP directory's marker first: a crash (or a bucket that stops deleting)
    half-way through the removal leaves an uncommitted directory, never a committed checkpoint
    with missing shards."""
    model, opt, backend, ck = _setup(True, run_dir=tmp_path, keep=5)
    for s in (1, 2):
        ck.save(_meta(s), model, opt, "test")
    old = checkpoint_path(tmp_path, 1, True)
    seen = []

    def dies_before_removing(path, ignore_errors=False):
        seen.append((Path(path), (Path(path) / MARKER).exists()))   # the process dies here

    monkeypatch.setattr(checkpoint_module.shutil, "rmtree", dies_before_removing)
    rotate(tmp_path, keep=1)
    assert seen == [(old, False)]
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2]


def test_resuming_from_a_path_to_the_newest_checkpoint_is_not_refused_as_ahead(tmp_path):
    """checkpoint.resume=<path of the run directory's newest checkpoint>: the same as auto, not
    a checkpoint 'past' its own step."""
    model, opt, backend, ck = _setup(False, run_dir=tmp_path, keep=5)
    ck.save(_meta(2), model, opt, "test", wait=True)
    newest = ck.save(_meta(4), model, opt, "test", wait=True)
    path, meta = ck.find(str(newest))
    assert path == newest and meta["step"] == 4
    release_run_lock(tmp_path)


def test_the_digest_of_a_dcp_directory_covers_its_metadata(tmp_path):
    """Two DCP checkpoints with the same marker but different shard layouts (.metadata) are told
    apart by checkpoint_digest."""
    model, opt, backend, ck = _setup(True, run_dir=tmp_path)
    path = ck.save(_meta(1), model, opt, "test")
    before = checkpoint_digest(path)
    meta = read_dcp_metadata(path)
    next(iter(meta.storage_data.values())).length -= 1
    (path / ".metadata").write_bytes(pickle.dumps(meta))
    assert checkpoint_digest(path) != before


def test_resuming_from_a_weights_only_checkpoint_is_refused_pointing_to_init_from(tmp_path):
    """A weights-only file (consolidate --model-only, export_hf.py --import) is no resume point:
    find refuses it in one line instead of failing later in restore with a KeyError."""
    model, opt, backend, ck = _setup(False, run_dir=tmp_path)
    path = ck.save(_meta(5), model, opt, "test", wait=True)
    full = load_checkpoint(path, with_optimizer=False)
    atomic_torch_save(full, path)
    try:
        with pytest.raises(CheckpointError, match=r"weights only .*checkpoint\.init_from$"):
            ck.find("auto")
    finally:
        release_run_lock(tmp_path)


def test_an_unfinished_save_that_cannot_be_deleted_at_start_is_a_warning(tmp_path, monkeypatch):
    """The master deletes unfinished saves at start; one that cannot be deleted (a bucket that
    takes new objects but refuses deletes) was a traceback on the master while the others waited
    for it in the resume agreement. It is never resumed from: a warning, as in rotation."""
    model, opt, backend, ck = _setup(False, run_dir=tmp_path, keep=5)
    good = ck.save(_meta(2), model, opt, "test", wait=True)
    release_run_lock(tmp_path)
    stale = tmp_path / ".ckpt_00000004.pt.tmp-123-456"  # a save killed half-way
    stale.write_bytes(b"partial")
    unlink = Path.unlink

    def refused(self, missing_ok=False):
        if self.name.startswith(".ckpt_"):
            raise PermissionError(1, "Operation not permitted", str(self))
        return unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", refused)
    said = []
    model, opt, backend, ck = _setup(False, run_dir=tmp_path, keep=5)
    ck.log = said.append
    try:
        path, meta = ck.find("auto")
    finally:
        release_run_lock(tmp_path)
    assert path == good and meta["step"] == 2 and stale.exists()
    assert said == [f"warning: cannot delete {stale} (an unfinished save): Operation not permitted; the run "
                    "goes on (it is never resumed from)"]


@pytest.mark.parametrize("field, value", [("offset", "0"), ("length", 1.5), ("length", None)])
def test_dcp_metadata_with_a_storage_extent_of_another_type_falls_back(tmp_path, field, value):
    """An admitted .metadata whose shard offset or length is no integer was a TypeError out of
    the size check, which resume: auto does not catch: a CheckpointError, and the previous
    checkpoint is taken."""
    model, opt, backend, ck = _setup(True, run_dir=tmp_path)
    good = ck.save(_meta(1), model, opt, "test")
    path = ck.save(_meta(2), model, opt, "test")
    meta = read_dcp_metadata(path)
    setattr(next(iter(meta.storage_data.values())), field, value)
    (path / ".metadata").write_bytes(pickle.dumps(meta))
    with pytest.raises(CheckpointError, match="missing or truncated"):
        peek_checkpoint(path)
    assert find_latest(tmp_path, warn=lambda m: None)[0] == good


def test_a_checkpoint_under_another_steps_name_is_skipped_with_its_reason(tmp_path):
    """The names order a run directory's checkpoints: one copied in under a later step's name
    (an older checkpoint 'restored' as the newest) was resumed from, the run's next saves sorted
    before it, and every later resume went back to it. It is skipped, saying why."""
    model, opt, backend, ck = _setup(False, run_dir=tmp_path, keep=5)
    two = ck.save(_meta(2), model, opt, "test", wait=True)
    four = ck.save(_meta(4), model, opt, "test", wait=True)
    shutil.copy(two, checkpoint_path(tmp_path, 6))
    said = []
    assert find_latest(tmp_path, warn=said.append)[0] == four
    assert resolve_checkpoint(tmp_path, warn=said.append)[0] == four
    assert said == [f"warning: {checkpoint_path(tmp_path, 6)}: holds step 2, not the 6 its name says (renamed, "
                    "or copied in under another name): rename it or move it away; trying the previous "
                    "checkpoint"] * 2
