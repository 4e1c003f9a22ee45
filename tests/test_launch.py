"""The launch agreement (training/launch.py): every process of a job checks its data, its config
and its launch problems together, before any work, and all refuse with the same one-line error
(exit 2) or none does. Pure verdicts first, then two real gloo processes, then two torchrun
"nodes" (``--nnodes=2``, one process each, on this machine) given different command lines."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ENV, ROOT, free_port, spawn_two, tiny_config
from training.config import ConfigError, load_config
from training.launch import (PER_HOST_KEYS, agree_at_launch, config_difference, config_items, config_text,
                             configs_differ, launch_entry, launch_verdict, under_torchrun)
from training.loop import main

TORCHRUN = str(Path(sys.executable).parent / "torchrun")
needs_torchrun = pytest.mark.skipif(not Path(TORCHRUN).exists(), reason="torchrun not installed")


# -- verdicts, no processes ----------------------------------------------------------------------

def test_launch_verdict_takes_problems_first_then_the_data():
    same = launch_entry("abc", "{}", "")
    assert launch_verdict([same, same], "/d") is None
    assert launch_verdict([same, same, launch_entry("xyz", "{}", "")], "/d").startswith(
        "data.dir: /d/meta.json describes other data on process(es) 2 than on process 0: every host")
    problem = launch_entry("", "{}", "data.dir: /x does not exist (run prepare_data.py first)")
    assert launch_verdict([same, problem, launch_entry("xyz", "{}", "")], "/d") == \
        "data.dir: /x does not exist (run prepare_data.py first) (found by process 1)"
    assert launch_verdict([problem], "/d") == "data.dir: /x does not exist (run prepare_data.py first)"
    # a problem of several lines travels as one; a config that differs is not the data's verdict
    assert launch_verdict([launch_entry("a", "{}", "one\ntwo"), same], "/d") == "one two (found by process 0)"
    assert launch_verdict([same, launch_entry("abc", '{"a":1}', "")], "/d") is None


def test_configs_differ_gives_the_size_of_the_second_gather():
    a, b = '{"k":1}', '{"k":1000}'
    assert configs_differ([launch_entry("f", a, "")] * 3) == 0
    assert configs_differ([launch_entry("f", a, ""), launch_entry("f", b, "")]) == len(b)


def test_config_difference_names_the_first_keys_the_values_and_the_processes():
    a = {"training.learning_rate": 0.001, "checkpoint.interval": 5, "model.d_model": 64}
    b = {**a, "training.learning_rate": 0.002}
    assert config_difference([a, a]) is None
    assert config_difference([a, b]) == (
        "config differs between processes: training.learning_rate is 0.001 on process 0 and 0.002 "
        "on process 1; every process must run the same config file and overrides")
    c = {**b, "checkpoint.interval": 3, "model.d_model": 32}
    assert config_difference([a, a, c, {**a, "training.learning_rate": 0.1}], shown=1) == (
        "config differs between processes: training.learning_rate is 0.001 on processes 0, 1, 0.002 "
        "on process 2 and 0.1 on process 3 (and 2 more key(s): checkpoint.interval, ...); every "
        "process must run the same config file and overrides")
    d = {**a, "logging.wandb.run_name": "x"}  # a key one process has and another lacks
    assert config_difference([a, d]).startswith(
        'config differs between processes: logging.wandb.run_name is (not set) on process 0 and "x" on process 1')


def test_the_per_host_keys_are_left_out_and_every_other_key_is_compared(tmp_path, stdlib_data):
    cfg = tiny_config(tmp_path, stdlib_data)
    base = load_config(cfg, [])
    assert {"data.dir", "checkpoint.dir"} <= set(PER_HOST_KEYS)
    assert not set(PER_HOST_KEYS) & set(config_items(base))
    elsewhere = load_config(cfg, ["data.dir=/mnt/other", "checkpoint.dir=/mnt/ckpt", "data.num_workers=4",
                                  "xla.compile_cache=/tmp/cache"])
    assert config_text(elsewhere) == config_text(base)
    for over in ("training.learning_rate=0.002", "checkpoint.interval=3", "training.fsdp=true",
                 "checkpoint.resume=none", "logging.interval=7"):
        assert config_text(load_config(cfg, [over])) != config_text(base), over


class ScriptedHost:
    """A HostGroup of this process (rank 0) and others whose configs are given: each gather
    returns what every process would send (the others computed from their own config)."""

    def __init__(self, others, fingerprint):
        self.others, self.fingerprint, self.gathers = others, fingerprint, 0
        self.size = 1 + len(others)

    def all_gather_text(self, text, size=1024):
        self.gathers += 1
        if self.gathers == 1:
            return [text] + [launch_entry(self.fingerprint, config_text(c), "") for c in self.others]
        return [text] + [config_text(c) for c in self.others]


def test_agree_at_launch_with_scripted_processes(tmp_path, stdlib_data):
    from training.data import data_fingerprint
    fp = data_fingerprint(json.loads((stdlib_data / "meta.json").read_text()))
    cfg = tiny_config(tmp_path, stdlib_data)
    mine = load_config(cfg, [])
    host = ScriptedHost([load_config(cfg, ["checkpoint.dir=/elsewhere"])], fp)
    agree_at_launch(host, mine)                 # per-host paths may differ: one gather, no error
    assert host.gathers == 1
    host = ScriptedHost([load_config(cfg, ["training.learning_rate=0.002"])], fp)
    with pytest.raises(ConfigError, match=r"^config differs between processes: training.learning_rate "
                                          r"is 0.003 on process 0 and 0.002 on process 1;"):
        agree_at_launch(host, mine)
    assert host.gathers == 2
    missing = load_config(cfg, [f"data.dir={tmp_path / 'none'}"])  # check_data fails here: said by all
    with pytest.raises(ConfigError, match=rf"^data.dir: {tmp_path / 'none'} does not exist .* \(found by process 0\)$"):
        agree_at_launch(ScriptedHost([mine], fp), missing)



@pytest.mark.parametrize("env, together", [
    ({"RANK": "0", "WORLD_SIZE": "2"}, True), ({"RANK": "1", "WORLD_SIZE": "8"}, True),
    ({"RANK": "0", "WORLD_SIZE": "1"}, False),     # torchrun --nproc_per_node=1: checks its data alone
    ({"WORLD_SIZE": "2"}, False), ({}, False), ({"RANK": "0", "WORLD_SIZE": "two"}, False),
])
def test_train_py_is_launched_together_only_among_several_torchrun_processes(monkeypatch, env, together):
    for key in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert under_torchrun() is together

def test_one_process_has_nothing_to_agree_on_but_its_own_problem(tmp_path):
    """A single process compares nothing (main ran check_data before its backend was made;
    benchmarks make backends over stand-in data directories): only its own problem is said."""
    from training.distributed import HostGroup
    cfg = load_config(None, ["training.max_steps=1", f"data.dir={tmp_path / 'stand-in'}"])
    agree_at_launch(HostGroup(), cfg)
    with pytest.raises(ConfigError, match=r"^xla.mesh: too big$"):
        agree_at_launch(HostGroup(), cfg, "xla.mesh: too big")


def test_main_checks_the_data_first_in_one_process_and_together_when_launched_together(tmp_path, stdlib_data, capsys):
    """One process: check_data's error before any backend is made, exit 2 (as before). One of
    several processes (torchrun's, a pod's hosts): the backend is made, and its launch agreement
    says the error on every process."""
    cfg = tiny_config(tmp_path, stdlib_data, **{"data.dir": str(tmp_path / "none")})
    made = []

    def make_backend(c):
        made.append(c)
        raise ConfigError("from the launch agreement")

    assert main([str(cfg)], make_backend, "train.py") == 2 and made == []
    assert capsys.readouterr().err.strip() == \
        f"train.py: error: data.dir: {tmp_path / 'none'} does not exist (run prepare_data.py first)"
    assert main([str(cfg)], make_backend, "train.py", launched_together=lambda c: False) == 2 and made == []
    capsys.readouterr()
    assert main([str(cfg)], make_backend, "train.py", launched_together=lambda c: True) == 2 and len(made) == 1
    assert capsys.readouterr().err.strip() == "train.py: error: from the launch agreement"


# -- found unpinned by mutation testing of launch.py ------------------------------------------------

def test_config_items_hold_every_key_but_the_four_per_host_ones(tmp_path):
    """The launch agreement compares every key but the per-host ones."""
    cfg = load_config(tiny_config(tmp_path, tmp_path), [])

    def flat(tree, prefix=""):
        for k, v in tree.items():
            if isinstance(v, dict):
                yield from flat(v, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}"

    documented = {"data.dir", "checkpoint.dir", "xla.compile_cache", "data.num_workers"}
    assert set(PER_HOST_KEYS) == documented
    assert set(config_items(cfg)) == set(flat(cfg.to_dict())) - documented
    # the seed draws every epoch's order: hosts with other seeds would train on overlapping samples
    other = load_config(tiny_config(tmp_path, tmp_path), ["training.seed=8"])
    assert config_difference([config_items(cfg), config_items(other)]).startswith(
        "config differs between processes: training.seed is 7 on process 0 and 8 on process 1")


def test_a_key_set_to_null_on_one_process_and_absent_on_another_is_a_difference():
    """Processes running other versions of the code: one has a key (default null) the other lacks.
    Their config digests differ, and the verdict must name the key, not let the launch go on."""
    a = {"training.learning_rate": 0.001}
    b = {**a, "logging.wandb.run_name": None}
    assert config_difference([a, b]) == (
        "config differs between processes: logging.wandb.run_name is (not set) on process 0 and null on "
        "process 1; every process must run the same config file and overrides")


def test_the_verdict_is_the_first_problem_by_rank():
    same = launch_entry("abc", "{}", "")
    entries = [same, launch_entry("", "{}", "problem one"), launch_entry("", "{}", "problem two")]
    assert launch_verdict(entries, "/d") == "problem one (found by process 1)"


# -- two gloo processes --------------------------------------------------------------------------

def _agree(rank, store, cfgs, out_dir):
    import torch.distributed as dist
    from training.distributed import HostGroup, new_gloo_group
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        agree_at_launch(HostGroup(new_gloo_group()), load_config(cfgs[rank][0], cfgs[rank][1]))
        res = {"ok": True}
    except ConfigError as e:
        res = {"error": str(e)}
    (Path(out_dir) / f"{rank}.json").write_text(json.dumps(res))
    dist.destroy_process_group()


def test_two_processes_reach_the_same_verdict(tmp_path, stdlib_data):
    """Over a real gloo group: one process with another learning rate and data.dir missing on
    the other; both get the same line (the problem first), then with the data there, the
    config's difference."""
    cfg = str(tiny_config(tmp_path, stdlib_data))
    cases = {"missing": [(cfg, []), (cfg, [f"data.dir={tmp_path / 'none'}", "training.learning_rate=0.002"])],
             "config": [(cfg, []), (cfg, ["training.learning_rate=0.002"])]}
    want = {"missing": f"data.dir: {tmp_path / 'none'} does not exist (run prepare_data.py first) (found by process 1)",
            "config": "config differs between processes: training.learning_rate is 0.003 on process 0 and 0.002 "
                      "on process 1; every process must run the same config file and overrides"}
    for name, cfgs in cases.items():
        out = tmp_path / name
        out.mkdir()
        spawn_two(_agree, (str(out / "store"), cfgs, str(out)))
        assert [json.loads((out / f"{r}.json").read_text()) for r in (0, 1)] == [{"error": want[name]}] * 2


# -- two torchrun nodes --------------------------------------------------------------------------

def two_nodes(tmp_path: Path, cfg: Path, node_args: list[list[str]], timeout: float = 240) -> list[tuple[int, str]]:
    """``torchrun --nnodes=2 --nproc_per_node=1 train.py CFG ARGS`` as two nodes on this machine,
    node I with ``node_args[I]``: each node's (exit code, stderr). A node that has not ended after
    ``timeout`` s (one waiting for the other in the rendezvous) fails the test."""
    port = free_port()
    procs, logs = [], []
    for node, args in enumerate(node_args):
        log = tmp_path / f"node{node}.log"
        logs.append(log)
        with open(log, "w") as f:
            procs.append(subprocess.Popen(
                [TORCHRUN, "--nnodes=2", "--nproc_per_node=1", f"--node_rank={node}",
                 "--master_addr=127.0.0.1", f"--master_port={port}", "train.py", str(cfg), *args],
                cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=f))
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [(code, log.read_text()) for code, log in zip(codes, logs)]


def assert_both_refuse(results, line: str) -> None:
    for node, (code, err) in enumerate(results):
        workers = err.split("failed (exitcode")[0]  # then torchrun's own report and traceback
        assert code != 0 and "exitcode  : 2" in err, (node, err[-3000:])
        assert workers.count(f"train.py: error: {line}") == 1 and "Traceback" not in workers, (node, err[-3000:])


@needs_torchrun
def test_nodes_with_another_config_refuse_together(tmp_path, stdlib_data):
    """Node 1 with another learning rate and checkpoint interval: it hung both at the first save
    (its save's collective met node 0's stop all-reduce), or let the replicas diverge."""
    cfg = tiny_config(tmp_path, stdlib_data, **{"training.max_steps": 4})
    results = two_nodes(tmp_path, cfg, [[], ["training.learning_rate=0.002", "checkpoint.interval=3"]])
    assert_both_refuse(results, "config differs between processes: training.learning_rate is 0.003 on "
                                "process 0 and 0.002 on process 1 (and 1 more key(s): checkpoint.interval); "
                                "every process must run the same config file and overrides")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@needs_torchrun
def test_nodes_with_other_data_refuse_together(tmp_path, stdlib_data):
    """Node 1's data.dir holds other data (another shard checksum in its meta.json): it trained
    silently on it (with FSDP and another val size, evaluation hung). Each node's own data.dir
    path may differ: only the data's identity is compared."""
    other = tmp_path / "other_data"
    shutil.copytree(stdlib_data, other)
    meta = json.loads((other / "meta.json").read_text())
    meta["splits"]["train"]["shards"][0]["sha256"] = "0" * 64
    (other / "meta.json").write_text(json.dumps(meta))
    cfg = tiny_config(tmp_path, stdlib_data, **{"training.max_steps": 4})
    results = two_nodes(tmp_path, cfg, [[], [f"data.dir={other}"]])
    for node, data in enumerate((stdlib_data, other)):  # each names its own directory
        assert_both_refuse([results[node]], f"data.dir: {data}/meta.json describes other data on process(es) 1 "
                                            "than on process 0: every host must train on the same prepared data")


@needs_torchrun
def test_a_node_without_its_data_stops_every_node_at_once(tmp_path, stdlib_data):
    """check_data failing on node 1 only: node 1 exited at once and node 0 waited for it in the
    rendezvous for 30 minutes. Now both say it, exit 2."""
    cfg = tiny_config(tmp_path, stdlib_data, **{"training.max_steps": 4})
    missing = tmp_path / "not_copied_here"
    results = two_nodes(tmp_path, cfg, [[], [f"data.dir={missing}"]])
    assert_both_refuse(results, f"data.dir: {missing} does not exist (run prepare_data.py first) (found by process 1)")


def test_the_lists_of_keys_and_processes_end_in_dots_only_when_something_is_left_out():
    a = {"training.learning_rate": 0.001, "checkpoint.interval": 5, "model.d_model": 64}
    two = {**a, "training.learning_rate": 0.002, "checkpoint.interval": 3}
    assert config_difference([a, two], shown=1).endswith(
        "(and 1 more key(s): checkpoint.interval); every process must run the same config file and overrides")
    same, other = launch_entry("abc", "{}", ""), launch_entry("xyz", "{}", "")
    assert "process(es) 1, 2, 3, 4, 5, 6, 7, 8 than" in launch_verdict([same] + [other] * 8, "/d")
    assert "process(es) 1, 2, 3, 4, 5, 6, 7, 8, ... than" in launch_verdict([same] + [other] * 9, "/d")


def test_the_problem_a_process_brings_comes_before_its_data_check(tmp_path, stdlib_data):
    """agree_at_launch's ``problem`` (the backend's own finding, e.g. its share of the mesh
    checks) is the verdict; check_data's error on the same process does not replace it."""
    from training.data import data_fingerprint
    fp = data_fingerprint(json.loads((stdlib_data / "meta.json").read_text()))
    cfg = tiny_config(tmp_path, stdlib_data)
    missing = load_config(cfg, [f"data.dir={tmp_path / 'none'}"])
    with pytest.raises(ConfigError, match=r"^xla.mesh: 8 devices, 4 here \(found by process 0\)$"):
        agree_at_launch(ScriptedHost([load_config(cfg, [])], fp), missing, problem="xla.mesh: 8 devices, 4 here")
