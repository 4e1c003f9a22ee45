"""train.py end to end on CPU: exact resume after SIGTERM, DDP global-batch equivalence, NaN
handling, metrics and checkpoints. Tiny fp32 models on the stdlib test corpus."""
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import (ENV, ROOT, in_process, losses, metrics, patched_env, patched_script, run, run_patched,
                     shared_run, sigterm_during_step, tiny_config, wait_for_a_signal_at_step, wait_for_file)
from training.checkpoint import list_checkpoints
from training.data import data_fingerprint


def test_trains_logs_and_checkpoints(tmp_path, stdlib_data, capsys, monkeypatch):
    """train.py's run, then sample.py on its checkpoints: the first and the ASCII-console runs as
    a user's command lines, the many others in this process (``in_process``)."""
    import sample
    from model import NashMHC
    sample_cli = lambda args: in_process(sample.main, args, capsys)  # noqa: E731
    cfg = tiny_config(tmp_path, stdlib_data)
    r = run(["train.py", str(cfg)])
    assert r.returncode == 0, r.stderr[-3000:]
    rows = metrics(tmp_path / "run")
    assert [m["step"] for m in rows] == list(range(1, 21))
    for key in ("loss", "lr", "grad_norm", "tokens_seen", "tokens_per_sec"):
        assert all(key in m for m in rows), key
    assert rows[-1]["tokens_seen"] == 20 * 4 * 32
    evals = [m for m in rows if "eval_loss" in m]
    assert [m["step"] for m in evals] == [10, 20]
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"] < 6.3  # ln(512) = 6.24 at init
    ckpts = sorted(p.name for p in (tmp_path / "run").glob("ckpt_*.pt"))
    assert ckpts == ["ckpt_00000015.pt", "ckpt_00000020.pt"]  # keep: 2
    ck = torch.load(tmp_path / "run" / ckpts[-1], weights_only=True)
    assert ck["step"] == 20 and ck["config"]["training"]["max_steps"] == 20
    assert (ck["data"]["epoch"], ck["data"]["offset"]) == (0, 20 * 4)   # 80 of the data's thousands of samples
    assert ck["data"]["fingerprint"] == data_fingerprint(json.loads((stdlib_data / "meta.json").read_text()))
    assert "config (resolved)" in r.stderr and "effective batch" in r.stderr
    if __import__("platform").libc_ver()[0] == "glibc":   # training.cpu_malloc's default, on the CPU
        assert "device: cpu (glibc malloc keeps freed memory) x 1 replica(s)" in r.stderr
    # sample.py finds the newest checkpoint and the tokenizer through the stored config
    r = run(["sample.py", str(tmp_path / "run"), "--prompt", "def ", "--max-new-tokens", "20",
             "--num-samples", "2"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("----- sample") == 2 and r.stdout.count("def ") >= 2
    assert "ckpt_00000020.pt" in r.stderr
    # a console that cannot show a character gets its escape, not a traceback
    r = run(["sample.py", str(tmp_path / "run"), "--prompt", "# é", "--max-new-tokens", "2", "--num-samples", "1"],
            env={**ENV, "PYTHONIOENCODING": "ascii"})
    assert r.returncode == 0 and "\n# \\xe9" in r.stdout, r.stderr[-2000:]
    r = sample_cli([str(tmp_path / "nothing-here")])
    assert r.returncode == 2 and "Traceback" not in r.stderr and "nothing-here" in r.stderr
    # temperature 0 is greedy: every sample is the same continuation
    r = sample_cli([str(tmp_path / "run"), "--temperature", "0", "--top-k", "0", "--max-new-tokens", "8"])
    assert r.returncode == 0, r.stderr[-2000:]
    first, second = r.stdout.split("----- sample 2 -----")
    assert first.split("\n", 1)[1] == second.split("\n", 1)[1]
    # --top-k 1 samples among one token: the greedy continuation at any temperature (and
    # without the k, temperature 1.5 gives another: the check can tell them apart)
    greedy = r.stdout
    hot = [str(tmp_path / "run"), "--temperature", "1.5", "--max-new-tokens", "8"]
    assert sample_cli(hot + ["--top-k", "1"]).stdout == greedy
    assert sample_cli(hot + ["--top-k", "0"]).stdout != greedy
    for flag, value, said in (("--top-k", "-5", "must be at least"), ("--num-samples", "0", "must be at least"),
                              ("--temperature", "inf", "must be finite in fp32"),
                              ("--temperature", "1e39", "must be finite in fp32")):
        r = sample_cli([str(tmp_path / "run"), flag, value])
        assert r.returncode == 2 and "Traceback" not in r.stderr and f"{flag} {said}" in r.stderr, r.stderr
    bad_tok = tmp_path / "bad.json"
    bad_tok.write_text("{not json")
    for args, said in ((["--device", "gpu"], "--device gpu: expected cpu, cuda, cuda:N or mps"),
                       (["--device", "cuda:7"], "--device cuda:7: no such CUDA device here"),
                       (["--tokenizer", str(bad_tok)], f"{bad_tok}: not a tokenizers JSON file")):
        r = sample_cli([str(tmp_path / "run"), *args])
        assert r.returncode == 2 and "Traceback" not in r.stderr and said in r.stderr, (args, r.stderr[-2000:])
    # --tokenizer takes a directory holding tokenizer.json (a data directory, an HF export)
    r = sample_cli([str(tmp_path / "run"), "--tokenizer", str(stdlib_data), "--max-new-tokens", "4"])
    assert r.returncode == 0 and r.stdout.count("----- sample") == 2, r.stderr[-2000:]
    # one line, not a traceback: a prompt that is not UTF-8, a tokenizer with more ids than the
    # model has rows, weights that do not fit the stored config
    from tokenizers import Tokenizer
    from training.checkpoint import atomic_torch_save
    big = Tokenizer.from_file(str(stdlib_data / "tokenizer.json"))
    big.add_tokens([f"<extra{i}>" for i in range(600)])
    big.save(str(tmp_path / "big.json"))
    odd = dict(ck, model={**ck["model"], "blocks.0.extra": torch.zeros(2)})
    atomic_torch_save(odd, tmp_path / "odd.pt")
    for args, said in ((["--prompt", "caf\udce9"], "--prompt: not valid UTF-8 text"),
                       (["--tokenizer", str(tmp_path / "big.json")], "but the model has 512 rows"),
                       ([], "weights and stored config disagree")):
        r = sample_cli([str(tmp_path / ("odd.pt" if not args else "run")), *args])
        assert r.returncode == 2 and "Traceback" not in r.stderr and said in r.stderr, (args, r.stderr[-2000:])
    # a sample ends at <|endoftext|> (the end of a document), as transformers' generate ends an
    # exported model's; --ignore-eos prints on (generate patched to emit one mid-way)
    eos = big.token_to_id("<|endoftext|>")
    monkeypatch.setattr(NashMHC, "generate", lambda self, idx, n, **kw: torch.cat(
        [idx, torch.tensor([[65, eos, 66, 67]] * len(idx))], 1))
    prompt = big.encode("def ").ids
    for extra, tail in (([], [65, eos]), (["--ignore-eos"], [65, eos, 66, 67])):
        r = sample_cli([tmp_path / "run", "--prompt", "def ", *extra])
        assert r.returncode == 0, r.stderr[-2000:]
        want = big.decode(prompt + tail, skip_special_tokens=False)
        assert r.stdout.split("----- sample 2 -----\n")[1] == want + "\n", (r.stdout, want)
    # the prompt is encoded as prepare_data.py encodes a document: a literal "<|endoftext|>" in it
    # is text, as in every training document, not the end-of-text id
    prompts = []
    monkeypatch.setattr(NashMHC, "generate", lambda self, idx, n, **kw: prompts.append(idx[0].tolist()) or idx)
    text = "x = '<|endoftext|>'\n"
    r = sample_cli([tmp_path / "run", "--prompt", text, "--num-samples", "1"])
    assert r.returncode == 0, r.stderr[-2000:]
    got, = prompts
    as_text = Tokenizer.from_file(str(stdlib_data / "tokenizer.json"))
    as_text.encode_special_tokens = True
    assert got == as_text.encode(text, add_special_tokens=False).ids and eos not in got
    # the end of text is the tokenizer's own (an imported one's eos_token in tokenizer_config.json,
    # as prepare_data.py reads it), not always <|endoftext|>; an empty prompt starts from it
    imported = tmp_path / "imported"
    imported.mkdir()
    (imported / "tokenizer.json").write_bytes((stdlib_data / "tokenizer.json").read_bytes())
    (imported / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|pad|>"}))
    pad = big.token_to_id("<|pad|>")
    monkeypatch.setattr(NashMHC, "generate", lambda self, idx, n, **kw: torch.cat(
        [idx, torch.tensor([[65, eos, pad, 67]] * len(idx))], 1))
    r = sample_cli([tmp_path / "run", "--prompt", "", "--tokenizer", imported])
    monkeypatch.undo()
    assert r.returncode == 0, r.stderr[-2000:]
    want = big.decode([65, eos, pad], skip_special_tokens=False)  # the start token is not the prompt's
    assert r.stdout.split("----- sample 2 -----\n")[1] == want + "\n", (r.stdout, want)
    # weights a diverged run saved, a seed numpy/torch cannot take: one line each; a prompt past
    # the context is said to be cropped
    nan = {k: v.clone() for k, v in ck["model"].items()}
    nan["blocks.0.attn.q.weight" if "blocks.0.attn.q.weight" in nan else next(iter(nan))].fill_(float("nan"))
    atomic_torch_save(dict(ck, model=nan), tmp_path / "nan.pt")
    for args, said in (([str(tmp_path / "nan.pt")], "non-finite weights in"),
                       ([str(tmp_path / "run"), "--seed", str(2 ** 64)], "--seed must be in [0, 2**63)")):
        r = sample_cli([*args, "--max-new-tokens", "2"])
        assert r.returncode == 2 and "Traceback" not in r.stderr and said in r.stderr, (args, r.stderr[-2000:])
    r = sample_cli([str(tmp_path / "run"), "--prompt", "x = 1\n" * 40, "--max-new-tokens", "2"])
    assert r.returncode == 0 and "; the model sees its last 64 (model.max_seq_len)" in r.stderr, r.stderr[-2000:]
    assert "the run trained on 32-token windows (data.seq_len)" in r.stderr
    # the data directory re-prepared since the checkpoint (meta.json differs): its tokenizer is
    # checked as export_hf.py checks it, against the sha256 the checkpoint records - the same
    # bytes pass without a word, other ones are refused (each id would print as other text), or
    # said when given with --tokenizer; a checkpoint too old to record one gets the warning
    sha = ck["data"]["tokenizer_sha256"]
    assert sha == json.loads((stdlib_data / "meta.json").read_text())["tokenizer_sha256"]
    atomic_torch_save(dict(ck, data={**ck["data"], "fingerprint": "0" * 64}), tmp_path / "moved.pt")
    r = sample_cli([str(tmp_path / "moved.pt"), "--max-new-tokens", "2"])
    assert r.returncode == 0 and "warning" not in r.stderr, r.stderr[-2000:]
    atomic_torch_save(dict(ck, data={**ck["data"], "tokenizer_sha256": "f" * 64}), tmp_path / "other.pt")
    r = sample_cli([str(tmp_path / "other.pt"), "--max-new-tokens", "2"])
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stdout == "", r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1] == (f"sample.py: error: {stdlib_data}: its tokenizer.json (sha256 {sha[:12]}...) is "
                                "not byte for byte the one the checkpoint was trained with (ffffffffffff...): pass --tokenizer "
                                "with the model's tokenizer"), r.stderr
    r = sample_cli([str(tmp_path / "other.pt"), "--tokenizer", str(stdlib_data), "--max-new-tokens", "2"])
    assert r.returncode == 0 and f"warning: --tokenizer {stdlib_data}: its tokenizer.json (sha256 " in r.stderr
    old = dict(ck, data={k: v for k, v in ck["data"].items() if k != "tokenizer_sha256"} | {"fingerprint": "0" * 64})
    atomic_torch_save(old, tmp_path / "old.pt")
    r = sample_cli([str(tmp_path / "old.pt"), "--max-new-tokens", "2"])
    assert r.returncode == 0 and ("saved while training on other data (meta.json differs): the tokenizer of "
                                  f"{stdlib_data} may not be the model's") in r.stderr, r.stderr[-2000:]


def test_exact_resume_after_sigterm(tmp_path, stdlib_data):
    ref_dir, cut_dir = tmp_path / "ref", tmp_path / "cut"
    ref_dir.mkdir(), cut_dir.mkdir()
    cfg_ref = tiny_config(ref_dir, stdlib_data, **{"checkpoint.interval": 0})
    cfg_cut = tiny_config(cut_dir, stdlib_data, **{"checkpoint.interval": 0})
    r = run(["train.py", str(cfg_ref)])
    assert r.returncode == 0, r.stderr[-3000:]
    at6 = tmp_path / "at-step-6"
    script = patched_script(tmp_path, wait_for_a_signal_at_step(6, at6), ["train.py", cfg_cut])
    proc = subprocess.Popen([sys.executable, str(script)], cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_file(at6, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert max(losses(cut_dir / "run")) == 6 and (cut_dir / "run" / "ckpt_00000006.pt").exists(), err[-3000:]
    assert "SIGTERM received" in err
    r = run(["train.py", str(cfg_cut)])  # resume: auto
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from" in r.stderr
    ref, cut = losses(ref_dir / "run"), losses(cut_dir / "run")
    assert sorted(cut) == list(range(1, 21))
    for step in range(1, 21):
        assert abs(ref[step] - cut[step]) <= 1e-6, (step, ref[step], cut[step])
    # and the resumed run's end state is the uninterrupted one's: where the data stands, the tokens
    # trained on, the weights (a position counted from step 0 instead of from the resume passed)
    ref_ck, cut_ck = (torch.load(d / "run" / "ckpt_00000020.pt", weights_only=True) for d in (ref_dir, cut_dir))
    assert cut_ck["data"] == ref_ck["data"] and cut_ck["tokens_seen"] == ref_ck["tokens_seen"] == 20 * 4 * 32
    for k, v in ref_ck["model"].items():
        torch.testing.assert_close(cut_ck["model"][k], v, rtol=1e-5, atol=1e-7, msg=k)


TORCHRUN = str(Path(sys.executable).parent / "torchrun")
needs_torchrun = pytest.mark.skipif(not Path(TORCHRUN).exists(), reason="torchrun not installed")


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory, stdlib_data) -> Path:
    """The run directory of 20 steps of train.py in one process with the global batch (4): what
    DDP and FSDP2 runs of 2 processes x batch 2 must reproduce (one run in the session)."""
    return shared_run(tmp_path_factory, "train.py", stdlib_data)[0]   # the twins' train.py run


@pytest.fixture(scope="module")
def one_process(one_process_run) -> dict[int, float]:
    return losses(one_process_run)


def same_grad_norms(run_dir: Path, reference: Path, rel: float) -> None:
    """Every step's logged gradient norm (the reduced gradient's, as clipped) is the reference's."""
    a, b = ({m["step"]: m["grad_norm"] for m in metrics(d) if "grad_norm" in m} for d in (reference, run_dir))
    assert sorted(a) == sorted(b) and a, (sorted(a), sorted(b))
    for step in a:
        assert abs(a[step] - b[step]) <= rel * a[step], (step, a[step], b[step])


def torchrun(cfg, *overrides, env=None, **kw):
    return subprocess.Popen([TORCHRUN, "--standalone", "--nproc_per_node=2", "train.py", str(cfg),
                             "training.batch_size=2", *overrides], cwd=ROOT, env=env or ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


@needs_torchrun
def test_ddp_two_processes_match_one_process_with_twice_the_batch(tmp_path, stdlib_data, one_process,
                                                                   one_process_run):
    cfg = tiny_config(tmp_path, stdlib_data, **{"checkpoint.interval": 0})
    proc = torchrun(cfg)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0 and "2 replica(s)" in err, err[-3000:]
    b = losses(tmp_path / "run")
    assert sorted(one_process) == sorted(b) == list(range(1, 21))
    for step in b:
        assert abs(one_process[step] - b[step]) <= 1e-4 * abs(one_process[step]), step
    same_grad_norms(tmp_path / "run", one_process_run, 1e-4)   # the replicas' mean gradient


@needs_torchrun
@pytest.mark.slow
def test_fsdp2_two_processes_match_one_process_with_twice_the_batch(tmp_path, stdlib_data, one_process,
                                                                     one_process_run):
    """FSDP2 (parameters, gradients, AdamW state sharded over 2 processes) trains like one
    process with the global batch; its checkpoints are committed DCP directories."""
    cfg = tiny_config(tmp_path, stdlib_data, **{"training.fsdp": True, "checkpoint.interval": 10,
                                                "checkpoint.keep": 5})
    proc = torchrun(cfg)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert "FSDP2 over 2 processes" in err
    b = losses(tmp_path / "run")
    assert sorted(b) == list(range(1, 21))
    for step in b:  # fp32: only the order of the gradient sums differs
        assert abs(one_process[step] - b[step]) <= 1e-5 * abs(one_process[step]), step
    same_grad_norms(tmp_path / "run", one_process_run, 1e-4)   # the norm of the sharded gradients, whole
    run_dir = tmp_path / "run"
    for name in ("ckpt_00000010", "ckpt_00000020"):
        files = sorted(p.name for p in (run_dir / name).iterdir())
        assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", "checkpoint.json"], files


@needs_torchrun
@pytest.mark.slow
def test_fsdp2_muon_matches_one_process(tmp_path, stdlib_data):
    """Muon under FSDP2 trains like Muon in one process with the global batch: its matrices are
    sharded DTensors there, which the Newton-Schulz batch of each shape stacks and indexes
    (DTensor has no rule for unbind or _foreach_lerp: a step that used them failed only here)."""
    over = {"training.optimizer": "muon", "training.max_steps": 8, "checkpoint.interval": 0}
    (tmp_path / "one").mkdir(), (tmp_path / "two").mkdir()
    r = run(["train.py", str(tiny_config(tmp_path / "one", stdlib_data, **over))])
    assert r.returncode == 0, r.stderr[-3000:]
    proc = torchrun(tiny_config(tmp_path / "two", stdlib_data, **{**over, "training.fsdp": True}))
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0 and "FSDP2 over 2 processes" in err, err[-3000:]
    a, b = losses(tmp_path / "one" / "run"), losses(tmp_path / "two" / "run")
    assert sorted(a) == sorted(b) == list(range(1, 9))
    for step in a:  # fp32: only the order of the gradient sums differs
        assert abs(a[step] - b[step]) <= 1e-5 * abs(a[step]), (step, a[step], b[step])
    # DDP: the replicas share the Newton-Schulz work (each a share of the matrices, one all-gather)
    (tmp_path / "ddp").mkdir()
    shared = ("import os\nfrom training import optim\nreal = optim._orthogonalised_by_share\n"
              "def by_share(m, steps, group):\n"
              f"    open(os.path.join({str(tmp_path)!r}, 'shared' + os.environ['RANK']), 'w').close()\n"
              "    return real(m, steps, group)\n"
              "optim._orthogonalised_by_share = by_share\n")
    proc = torchrun(tiny_config(tmp_path / "ddp", stdlib_data, **over), env=patched_env(tmp_path, shared))
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert (tmp_path / "shared0").exists() and (tmp_path / "shared1").exists()
    c = losses(tmp_path / "ddp" / "run")
    for step in a:
        assert abs(a[step] - c[step]) <= 1e-5 * abs(a[step]), (step, a[step], c[step])


ORTHOGONALISE_SHARDS = f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from training.optim import newton_schulz, orthogonalised
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (2,))
torch.manual_seed(0)
for shape in [(3, 10, 6), (3, 6, 10), (2, 7, 7)]:  # Muon's stacks of FSDP2 shards: dim 1; 7 rows: uneven
    whole = torch.randn(shape)
    stack = distribute_tensor(whole, mesh, [Shard(1)])
    with CommDebugMode() as comms:
        o = orthogonalised(stack, 5)
    # two all-to-alls (whole matrices over the processes, and back); gloo makes each an all-gather
    assert comms.get_total_counts() == 2, (shape, comms.get_comm_counts())
    assert o.placements == stack.placements and o.to_local().shape == stack.to_local().shape, shape
    assert torch.equal(o.full_tensor(), newton_schulz(whole)), shape
# DDP replicas: each orthogonalises its share of the same stack, one all-gather gives all of it
# (3 matrices over 2 processes: the second share is one matrix and a zero pad)
for shape in [(3, 10, 6), (1, 6, 10), (4, 7, 7)]:
    whole = torch.randn(shape)
    assert torch.equal(orthogonalised(whole, 5, spread=dist.group.WORLD), newton_schulz(whole)), shape
open(f"{{sys.argv[1]}}/ok{{dist.get_rank()}}", "w").close()
dist.destroy_process_group()
"""


@needs_torchrun
def test_muon_orthogonalises_fsdp2_shards_as_whole_matrices(tmp_path):
    """Under FSDP2 Muon's stack of one shape's matrices is a DTensor split by rows: it is
    orthogonalised as whole matrices, a share of the stack on each process, in two collectives
    (counted by DTensor's CommDebugMode), and each process keeps its rows of exactly the whole
    stack's Newton-Schulz. Run on the row shards, DTensor's rules redistribute at each of
    Newton-Schulz's 15 products (bench/optimizer.py)."""
    run_on_two_processes(ORTHOGONALISE_SHARDS, tmp_path)


def run_on_two_processes(script_text: str, tmp_path: Path, *args: str) -> None:
    """``script_text`` under torchrun, 2 gloo processes, given ``tmp_path`` (and ``args``): each
    must exit 0 and leave ``ok<RANK>`` there (its checks passed)."""
    script = tmp_path / "script.py"
    script.write_text(script_text)
    r = subprocess.run([TORCHRUN, "--standalone", "--nproc_per_node=2", str(script), str(tmp_path), *args], cwd=ROOT,
                       env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "ok0").exists() and (tmp_path / "ok1").exists(), r.stdout


FSDP2_BUILD = f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
import torch, torch.distributed as dist
from types import SimpleNamespace
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from model import ModelConfig, NashMHC
from training.backend import TorchBackend
backend = TorchBackend("cpu", fsdp=True)
rank = backend.rank
for over in ({{}}, {{"tie_embeddings": False, "mhc_lite": False}}):
    cfg = ModelConfig(vocab_size=96, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, **over)
    torch.manual_seed(1234)
    built = backend.new_model(lambda: NashMHC(cfg))
    held = {{p.device.type for p in built.parameters()}}
    assert held == ({{"cpu"}} if rank == 0 else {{"meta"}}), (rank, held)
    torch.manual_seed(1234)
    ref = NashMHC(cfg)  # what one process builds
    model = backend.prepare_model(built, SimpleNamespace(training=SimpleNamespace(precision="fp32", compile=False)))
    local = sum(p.to_local().numel() for p in model.parameters())
    assert local < 0.6 * ref.num_params(), (rank, local, ref.num_params())  # its shards only
    whole = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    assert whole.keys() == ref.state_dict().keys()
    for k, v in ref.state_dict().items():
        assert torch.equal(whole[k], v), (rank, k)
    assert (model.lm_head.weight is model.tok_emb.weight) == cfg.tie_embeddings
    idx = torch.randint(0, 96, (2, 64), generator=torch.Generator().manual_seed(7))
    gathers, all_gather = [], dist.all_gather_into_tensor  # FSDP2's, called through the module
    dist.all_gather_into_tensor = lambda *a, **k: gathers.append(1) or all_gather(*a, **k)
    got, want = model(idx, idx).loss, ref(idx, idx).loss  # the derived buffers (RoPE, mHC's) too
    assert torch.allclose(got, want, rtol=1e-5, atol=0), (rank, got, want)
    got.backward()
    dist.all_gather_into_tensor = all_gather
    # each block and the root gathered for the forward, the blocks but the last again for the
    # backward (the root and the last block keep theirs from the forward to the backward)
    assert len(gathers) == 2 * cfg.n_layers, (rank, len(gathers))
    want.backward()  # the same batch on both ranks: their mean gradient is one process's
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(p.grad.full_tensor(), q.grad, rtol=1e-4, atol=1e-7), (rank, name)
open(f"{{sys.argv[1]}}/ok{{rank}}", "w").close()
dist.destroy_process_group()
"""


@needs_torchrun
def test_fsdp2_ranks_past_0_build_no_weights_and_receive_their_shards(tmp_path):
    """Under FSDP2 rank 0 alone builds the model in host memory; the other ranks build it on the
    meta device, and after prepare_model every rank holds only its shards, which together are
    exactly one process's initial weights (tied and untied heads, mHC-lite and Sinkhorn), with
    the derived buffers made (the loss and the gradients match). Every rank used to build the
    whole fp32 model. A step gathers each block's weights twice but the last block's once (it
    keeps them from its forward to its backward, as torchtitan does): 2 x n_layers all-gathers,
    2 x n_layers + 1 before."""
    run_on_two_processes(FSDP2_BUILD, tmp_path)


COMPILED_OVER_PROCESSES = f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
import torch, torch.distributed as dist
import torch._dynamo
from types import SimpleNamespace
from torch._dynamo.utils import counters
from model import ModelConfig, NashMHC
from training.backend import TorchBackend, compile_regions
fsdp = sys.argv[2] == "fsdp"
backend = TorchBackend("cpu", fsdp=fsdp)
rank = backend.rank
cfg = ModelConfig(vocab_size=96, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)
runs = {{}}
for compiled in (False, True):
    torch.manual_seed(1234)
    model = backend.new_model(lambda: NashMHC(cfg))
    # where prepare_model compiles on CUDA with training.compile: after fully_shard, before DDP
    if compiled and not fsdp:
        compile_regions(model)
    model = backend.prepare_model(model, SimpleNamespace(training=SimpleNamespace(precision="fp32", compile=False)))
    if compiled and fsdp:
        compile_regions(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(7 + rank)
    runs[compiled] = []
    for step in range(4):
        torch._dynamo.config.error_on_recompile = compiled and step >= 1  # warm: the first step's graphs
        idx = torch.randint(0, 96, (2, 64), generator=data)
        loss = model(idx, idx).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        runs[compiled].append(loss.item())
assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])  # one block's, the loss's
for a, b in zip(runs[False], runs[True]):
    assert abs(a - b) <= 1e-5 * abs(a), (rank, runs)
open(f"{{sys.argv[1]}}/ok{{rank}}", "w").close()
dist.destroy_process_group()
"""


@needs_torchrun
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fsdp", "ddp"])
def test_compiled_blocks_under_fsdp2_and_ddp_train_as_eager_and_compile_once(tmp_path, mode):
    """train.py's GPU path of training.compile over processes, checked on CPU (gloo, inductor):
    FSDP2's hooks around blocks whose forward is compiled (compile_regions after fully_shard), or
    DDP around them: two graphs (one block's, reused by the other; the loss), no recompilation
    after the first step (FSDP2 gathers and frees the weights around every call), and the losses
    of the eager model from the same weights."""
    run_on_two_processes(COMPILED_OVER_PROCESSES, tmp_path, mode)


@needs_torchrun
@pytest.mark.slow
def test_fsdp2_init_from_is_read_by_rank_0_alone(tmp_path, stdlib_data):
    """checkpoint.init_from under FSDP2: rank 0 reads and checks the weights and the other ranks
    receive their shards of them (here rank 1 cannot read the file at all), and the run trains as
    one process from the same weights with the global batch does."""
    over = {"training.max_steps": 3, "checkpoint.interval": 0, "evaluation.interval": 0}
    for name in ("source", "one", "two"):
        (tmp_path / name).mkdir()
    r = run(["train.py", str(tiny_config(tmp_path / "source", stdlib_data, **over))])
    assert r.returncode == 0, r.stderr[-3000:]
    init = f"checkpoint.init_from={tmp_path / 'source' / 'run'}"
    r = run(["train.py", str(tiny_config(tmp_path / "one", stdlib_data, **over)), init])
    assert r.returncode == 0, r.stderr[-3000:]
    script = patched_script(tmp_path, RANK_1_CANNOT_READ, [
        "train.py", tiny_config(tmp_path / "two", stdlib_data, **{**over, "training.fsdp": True}), init,
        "training.batch_size=2"])
    proc = subprocess.run([TORCHRUN, "--standalone", "--nproc_per_node=2", str(script)], cwd=ROOT,
                          env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "FSDP2 over 2 processes" in proc.stderr, proc.stderr[-3000:]
    a, b = losses(tmp_path / "one" / "run"), losses(tmp_path / "two" / "run")
    assert sorted(a) == sorted(b) == [1, 2, 3]
    for step in a:  # fp32: only the order of the gradient sums differs
        assert abs(a[step] - b[step]) <= 1e-5 * abs(a[step]), (step, a[step], b[step])
    assert a[1] < losses(tmp_path / "source" / "run")[1] - 0.1  # the same first batch, trained weights


def same_window_data(d: Path, seq_len: int) -> Path:
    """A data directory (meta.json and one shard per split, as prepare_data.py lays them out)
    whose every window of ``seq_len + 1`` tokens is the same: tokens with period ``seq_len``."""
    import numpy as np
    d.mkdir()
    tokens = np.tile((np.arange(seq_len) * 37 + 5) % 512, 64).astype(np.uint16)
    splits = {}
    for split in ("train", "val"):
        np.save(d / f"{split}_00000.npy", tokens)
        splits[split] = {"tokens": len(tokens), "shards": [{"file": f"{split}_00000.npy", "tokens": len(tokens)}]}
    (d / "meta.json").write_text(json.dumps({"vocab_size": 512, "dtype": "uint16", "splits": splits}))
    return d


@needs_torchrun
def test_ddp_replicas_draw_their_own_dropout_masks(tmp_path):
    """Every window of the data is the same, so each replica of a 2-process DDP run computes what
    one process does, and the logged step-1 loss (the replicas' mean) is one process's loss unless
    the replicas draw different dropout masks. They must (before, every rank seeded its generator
    alike and drew rank 0's masks); without dropout the losses agree, which checks the data.
    (The second pair's config says xla.mode: spmd, whose batch_size is global: train.py warns
    that its own is per process.)"""
    data = same_window_data(tmp_path / "data", 32)
    step1 = {}
    for dropout in (0.0, 0.3):
        over = {"model.dropout": dropout, "training.max_steps": 1, "evaluation.interval": 0,
                "checkpoint.interval": 0, "xla.mode": "spmd" if dropout else "ddp"}
        one, two = tmp_path / f"one{dropout}", tmp_path / f"two{dropout}"
        one.mkdir(), two.mkdir()
        r = run(["train.py", str(tiny_config(one, data, **over)), "training.batch_size=2"])
        assert r.returncode == 0 and "xla.mode is spmd" not in r.stderr, r.stderr[-3000:]  # one process
        proc = torchrun(tiny_config(two, data, **over))
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0 and "2 replica(s)" in err, err[-3000:]
        warned = ("warning: the config's xla.mode is spmd, where training.batch_size=2 is the global batch; "
                  "here it is per process: 2 processes train 2x as many sequences per step") in err
        assert warned == bool(dropout), err[-3000:]
        step1[dropout] = losses(one / "run")[1], losses(two / "run")[1]
    a, b = step1[0.0]
    assert abs(a - b) <= 1e-6 * a, step1
    a, b = step1[0.3]
    assert abs(a - b) > 1e-5 * a, step1  # the masks differ: here 5e-4


def _worker_pid(torchrun_pid: int, rank: int) -> int:
    """The pid of a torchrun worker, found by the RANK in its environment."""
    for child in Path(f"/proc/{torchrun_pid}/task/{torchrun_pid}/children").read_text().split():
        env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in env:
            return int(child)
    raise AssertionError(f"no worker with RANK={rank}")


@needs_torchrun
@pytest.mark.slow
def test_fsdp2_sigterm_to_one_rank_stops_all_then_resumes_on_one_process_and_on_xla(
        tmp_path, stdlib_data, one_process):
    """SIGTERM reaching rank 1 only: both ranks stop at the same step (one host-side decision)
    and save one committed checkpoint, asynchronously written. It resumes exactly on 1 process
    (2 -> 1 reshard), whose single-file checkpoint resumes exactly in train_xla.py."""
    pytest.importorskip("torch_xla")
    cfg = tiny_config(tmp_path, stdlib_data, **{"training.fsdp": True, "checkpoint.interval": 3,
                                                "checkpoint.async": True, "evaluation.interval": 0})
    run_dir, at6 = tmp_path / "run", tmp_path / "at-step-6"
    script = patched_script(tmp_path, wait_for_a_signal_at_step(6, at6, rank="1"),
                            ["train.py", cfg, "training.batch_size=2"])
    proc = subprocess.Popen([TORCHRUN, "--standalone", "--nproc_per_node=2", str(script)], cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_file(at6, proc)
    os.kill(_worker_pid(proc.pid, 1), signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    stopped = max(losses(run_dir))
    assert stopped == 6, f"the run did not stop at the step the signal came in (stopped at {stopped})"
    # rank 1 got the signal, rank 0 (the master, which logs) learnt it from the decision
    assert "SIGTERM received" in err and f"stopped at step {stopped} after a stop signal on another" in err
    ckpts = [s for s, _ in list_checkpoints(run_dir)]
    assert ckpts[-1] == stopped and (run_dir / f"ckpt_{stopped:08d}" / "checkpoint.json").exists()
    # one process, the global batch, a single-file checkpoint every step
    r = run(["train.py", str(cfg), "training.fsdp=false", "training.batch_size=4",
             "checkpoint.interval=1", "checkpoint.keep=30", "checkpoint.async=false"])
    assert r.returncode == 0 and f"resumed from {run_dir / f'ckpt_{stopped:08d}'}" in r.stderr, r.stderr[-3000:]
    then = stopped + 2
    # ... and train_xla.py from its step stopped+2
    xla_dir = tmp_path / "xla"
    r = run(["train_xla.py", str(cfg), "training.fsdp=false", "training.batch_size=4",
             f"checkpoint.dir={xla_dir}", f"checkpoint.resume={run_dir / f'ckpt_{then:08d}.pt'}"])
    assert r.returncode == 0 and "resumed from" in r.stderr, r.stderr[-3000:]
    got, xla = losses(run_dir), losses(xla_dir)
    assert sorted(got) == list(range(1, 21)) and sorted(xla) == list(range(then + 1, 21))
    for step in range(1, 21):
        assert abs(got[step] - one_process[step]) <= 1e-5 * one_process[step], step
    for step in xla:  # the XLA CPU kernels differ from ATen's at the last bits
        assert abs(xla[step] - one_process[step]) <= 1e-5 * one_process[step], step


def _train_poisoned(tmp_path, stdlib_data, monkeypatch, poison, saves_every: int = 0, **over):
    """loop.train on CPU with ``poison(model, out, micro_step)`` applied to every training forward's
    output (1-based micro-steps), no evaluation and a save every ``saves_every`` steps (0: none);
    returns its exit code."""
    from training import loop
    from training.backend import TorchBackend
    from training.config import load_config

    calls = {"n": 0}

    class Poisoned(loop.NashMHC):
        def forward(self, idx, targets=None):
            out = super().forward(idx, targets)
            if self.training and targets is not None:
                calls["n"] += 1
                out = poison(self, out, calls["n"])
            return out

    monkeypatch.setattr(loop, "NashMHC", Poisoned)
    cfg = load_config(tiny_config(tmp_path, stdlib_data, **over),
                      ["evaluation.interval=0", f"checkpoint.interval={saves_every}"])
    return loop.train(cfg, TorchBackend("cpu"))


def test_nonfinite_steps_are_skipped_then_the_run_stops(tmp_path, stdlib_data, monkeypatch):
    """Losses that turn NaN after step 4: updates skipped, step 4's weights saved, exit 3."""
    from training import loop
    from training.backend import TorchBackend
    from training.config import load_config

    def nan_after_4(model, out, n):
        if n > 4:
            out.loss = out.loss * float("nan")
        return out

    code = _train_poisoned(tmp_path, stdlib_data, monkeypatch, nan_after_4, **{"training.max_nonfinite_steps": 3})
    assert code == 3
    rows = metrics(tmp_path / "run")
    # steps 5, 6 and 7 skipped: the third in a row stops the run there, with one save
    assert [r["step"] for r in rows] == list(range(1, 8))
    assert [r["nonfinite_skipped"] for r in rows] == [0, 0, 0, 0, 1, 2, 3]
    assert [p.name for p in (tmp_path / "run").glob("ckpt_*.pt")] == ["ckpt_00000007.pt"]
    ck = torch.load(tmp_path / "run" / "ckpt_00000007.pt", weights_only=True)
    # what it holds is step 4's state: the weights of a run that ended there
    monkeypatch.undo()
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    ref_cfg = load_config(tiny_config(ref_dir, stdlib_data, **{"training.max_steps": 4}),
                          ["evaluation.interval=0", "checkpoint.interval=0"])
    assert loop.train(ref_cfg, TorchBackend("cpu")) == 0
    ref = torch.load(ref_dir / "run" / "ckpt_00000004.pt", weights_only=True)
    assert ck["model"].keys() == ref["model"].keys()
    for k, v in ck["model"].items():
        assert torch.equal(v, ref["model"][k]), k


def _train_overflowing_at_update_5(tmp_path, stdlib_data, monkeypatch, saves_every: int = 0, **over) -> int:
    """``_train_poisoned`` whose 5th update makes a weight Inf from finite gradients (as if it had
    overflowed): every later loss is NaN, and training.max_nonfinite_steps=2 stops the run at 7."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    updates = []

    def overflow_at_5(optimizer, args, kwargs):
        updates.append(1)
        if len(updates) == 5:
            with torch.no_grad():
                optimizer.param_groups[0]["params"][0].fill_(float("inf"))

    hook = register_optimizer_step_post_hook(overflow_at_5)
    try:
        return _train_poisoned(tmp_path, stdlib_data, monkeypatch, lambda model, out, n: out, saves_every,
                               **{"training.max_nonfinite_steps": 2, **over})
    finally:
        hook.remove()


def test_weights_an_update_made_nan_are_not_saved_at_the_non_finite_stop(tmp_path, stdlib_data, monkeypatch,
                                                                          capsys):
    """An update that made the weights Inf from finite gradients (an overflow): every later loss is
    NaN and the run stops, as it should. Saved, those weights would have replaced (by rotation) a
    checkpoint worth resuming from, under a line that said it held "the last good weights". Nothing
    is saved, and the line says why and what to do."""
    code = _train_overflowing_at_update_5(tmp_path, stdlib_data, monkeypatch)
    err = capsys.readouterr().err
    assert code == 3 and "the weights themselves are NaN/Inf" in err and "nothing was saved" in err, err[-3000:]
    assert [r["nonfinite_skipped"] for r in metrics(tmp_path / "run")] == [0, 0, 0, 0, 0, 1, 2]
    assert not list((tmp_path / "run").glob("ckpt_*"))


def test_a_save_in_flight_is_finished_at_a_non_finite_stop_that_saves_nothing(tmp_path, stdlib_data, monkeypatch,
                                                                                capsys):
    """checkpoint.async: step 4's save (finite weights) is still being written when an overflowed
    update ends the run, which saves nothing new. Returning without waiting for it, the process
    exited with the writer's daemon thread and the checkpoint worth resuming from was lost (here
    the write is held until the trainer waits, so without that wait it never lands)."""
    import threading

    from training import checkpoint

    waited = threading.Event()
    real_wait, real_save = checkpoint.Checkpointer.wait, checkpoint.atomic_torch_save

    def wait(self, quiet=False):
        if self._thread is not None:   # for the save being written (each save first waits for none)
            waited.set()
        return real_wait(self, quiet)

    def held_save(obj, path):   # a large model's write to slow storage
        waited.wait(timeout=60)
        real_save(obj, path)

    monkeypatch.setattr(checkpoint.Checkpointer, "wait", wait)
    monkeypatch.setattr(checkpoint, "atomic_torch_save", held_save)
    code = _train_overflowing_at_update_5(tmp_path, stdlib_data, monkeypatch, saves_every=4,
                                          **{"checkpoint.async": True})
    err = capsys.readouterr().err
    assert code == 3 and "nothing was saved" in err, err[-3000:]
    assert [p.name for p in (tmp_path / "run").glob("ckpt_*")] == ["ckpt_00000004.pt"]
    assert torch.load(tmp_path / "run" / "ckpt_00000004.pt", weights_only=True)["step"] == 4


def test_scattered_nonfinite_steps_do_not_stop_the_run(tmp_path, stdlib_data, monkeypatch):
    """training.max_nonfinite_steps counts non-finite steps in a row: two at steps 3 and 5 with a
    limit of 2 are skipped and the run trains to its end (a running total would stop it at 5)."""
    def nan_at_3_and_5(model, out, n):
        if n in (3, 5):
            out.loss = out.loss * float("nan")
        return out

    code = _train_poisoned(tmp_path, stdlib_data, monkeypatch, nan_at_3_and_5,
                           **{"training.max_nonfinite_steps": 2, "training.max_steps": 8})
    rows = metrics(tmp_path / "run")
    assert code == 0 and [r["step"] for r in rows] == list(range(1, 9))
    assert [r["nonfinite_skipped"] for r in rows] == [0, 0, 1, 1, 2, 2, 2, 2]


def test_a_nonfinite_gradient_under_a_finite_loss_is_skipped(tmp_path, stdlib_data, monkeypatch):
    """An overflow in the backward alone (the loss finite, one gradient inf) skips the update as a
    non-finite loss does: applied, it made every weight NaN and every later loss with them."""
    def inf_gradient_at_3(model, out, n):
        if n == 3:
            handle = []
            def once(g):
                handle[0].remove()
                return torch.full_like(g, float("inf"))
            handle.append(model.tok_emb.weight.register_hook(once))
        return out

    code = _train_poisoned(tmp_path, stdlib_data, monkeypatch, inf_gradient_at_3, **{"training.max_steps": 6})
    rows = metrics(tmp_path / "run")
    assert code == 0 and all(math.isfinite(r["loss"]) for r in rows), rows
    assert [r["nonfinite_skipped"] for r in rows] == [0, 0, 1, 1, 1, 1]


def test_gradients_are_clipped_to_grad_clip_before_the_update(tmp_path, stdlib_data, monkeypatch):
    """training.grad_clip: the optimiser steps with gradients whose global norm is at most the bound,
    while the logged grad_norm is the norm before clipping (here above it every step)."""
    from training import loop
    from training.backend import TorchBackend
    from training.config import load_config

    norms, step = [], torch.optim.AdamW.step

    def recording_step(self, *args, **kwargs):
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        norms.append(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item())
        return step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", recording_step)
    cfg = load_config(tiny_config(tmp_path, stdlib_data, **{"training.max_steps": 4, "training.grad_clip": 1e-3}),
                      ["evaluation.interval=0", "checkpoint.interval=0"])
    assert loop.train(cfg, TorchBackend("cpu")) == 0
    logged = [m["grad_norm"] for m in metrics(tmp_path / "run")]
    assert len(norms) == len(logged) == 4
    assert all(n <= 1e-3 * (1 + 1e-4) for n in norms), norms
    assert all(g > 1e-2 for g in logged), logged


def test_the_last_step_evaluates_and_saves_where_the_data_stands(tmp_path, stdlib_data):
    """15 steps, evaluation every 10, 2 micro-batches per step: evaluations at 10 and at the last
    step (15, not a multiple), and the final checkpoint's data position past 15 x 2 batches of 4."""
    from training import loop
    from training.backend import TorchBackend
    from training.config import load_config

    cfg = load_config(tiny_config(tmp_path, stdlib_data, **{"training.max_steps": 15,
                                                            "training.gradient_accumulation_steps": 2}),
                      ["evaluation.interval=10", "checkpoint.interval=0"])
    assert loop.train(cfg, TorchBackend("cpu")) == 0
    rows = metrics(tmp_path / "run")
    assert [m["step"] for m in rows if "eval_loss" in m] == [10, 15]
    ck = torch.load(tmp_path / "run" / "ckpt_00000015.pt", weights_only=True)
    assert (ck["data"]["epoch"], ck["data"]["offset"]) == (0, 15 * 2 * 4)
    assert ck["tokens_seen"] == rows[-1]["tokens_seen"] == 15 * 2 * 4 * 32


def test_a_run_outlives_the_terminal_it_was_started_from(tmp_path, stdlib_data):
    """A pod run started over ssh whose session ends (both pipes closed before the run writes a
    line here): it trains to the end, saves and exits 0, its metrics intact (it died at its next
    progress line with BrokenPipeError, exit 1, no checkpoint, the other hosts waiting for it)."""
    cfg = tiny_config(tmp_path, stdlib_data, **{"logging.progress_bar": True})
    p = subprocess.Popen([sys.executable, "train.py", str(cfg), "training.max_steps=6"], cwd=ROOT, env=ENV,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()
    p.stderr.close()
    assert p.wait(timeout=600) == 0
    assert sorted(f.name for f in (tmp_path / "run").glob("ckpt_*")) == ["ckpt_00000005.pt", "ckpt_00000006.pt"]
    assert [m["step"] for m in metrics(tmp_path / "run") if "loss" in m] == [1, 2, 3, 4, 5, 6]


def test_sample_never_picks_an_id_past_the_tokenizers_vocabulary(tmp_path, stdlib_data):
    """A model vocabulary rounded up past the tokenizer's (640 rows, 512 tokens): sample.py samples
    among the tokenizer's ids only, even where the rows past it are as likely (temperature 1e30:
    every allowed id alike); the extra rows map to no text."""
    cfg = tiny_config(tmp_path, stdlib_data, **{"training.max_steps": 2, "checkpoint.interval": 0,
                                                "evaluation.interval": 0})
    r = run(["train.py", str(cfg), "model.vocab_size=640"])
    assert r.returncode == 0, r.stderr[-3000:]
    spy = ("import model\n"
           "generate = model.NashMHC.generate\n"
           "def spied(self, *args, **kwargs):\n"
           "    out = generate(self, *args, **kwargs)\n"
           "    print('GENERATED', int(out.max()), kwargs.get('vocab_limit'), flush=True)\n"
           "    return out\n"
           "model.NashMHC.generate = spied\n")
    r = run_patched(tmp_path, spy, ["sample.py", str(tmp_path / "run"), "--temperature", "1e30",
                                    "--num-samples", "4", "--max-new-tokens", "32", "--ignore-eos"])
    assert r.returncode == 0, r.stderr[-3000:]
    (line,) = [s for s in r.stdout.splitlines() if s.startswith("GENERATED")]
    highest, limit = map(int, line.split()[1:])
    assert limit == 512 and highest < 512

def test_resume_refuses_a_different_architecture(tmp_path, stdlib_data):
    cfg = tiny_config(tmp_path, stdlib_data, **{"training.max_steps": 2})
    assert run(["train.py", str(cfg)]).returncode == 0
    r = run(["train.py", str(cfg), "model.d_model=128", "training.max_steps=4"])
    assert r.returncode == 2 and "model.d_model: 64 -> 128" in r.stderr and "Traceback" not in r.stderr


# A model statistic that depends on the batch's data alone: the mean token id of the batch
# (the model's own statistics hardly depend on the data at the tiny model's start).
BATCH_TOKEN_MEAN = """
import model
_forward = model.NashMHC.forward
def forward(self, idx, targets=None):
    out = _forward(self, idx, targets)
    out.metrics["batch_token_mean"] = idx.float().mean()
    return out
model.NashMHC.forward = forward
"""


def test_gradient_accumulation_matches_the_larger_batch(tmp_path, stdlib_data):
    """batch b x 2 micro-steps = batch 2b in one step: same data, same mean loss, same update, and
    the same model statistics (those of the whole batch, not of its last micro-batch)."""
    one, acc = tmp_path / "one", tmp_path / "acc"
    one.mkdir(), acc.mkdir()
    over = {"checkpoint.interval": 0, "evaluation.interval": 0, "training.max_steps": 8}
    r = run_patched(one, BATCH_TOKEN_MEAN, ["train.py", tiny_config(one, stdlib_data, **over), "training.batch_size=4"])
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_patched(acc, BATCH_TOKEN_MEAN, ["train.py", tiny_config(acc, stdlib_data, **over), "training.batch_size=2",
                                            "training.gradient_accumulation_steps=2"])
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = losses(one / "run"), losses(acc / "run")
    assert sorted(a) == sorted(b) == list(range(1, 9))
    for s in a:
        assert abs(a[s] - b[s]) <= 1e-5 * abs(a[s]), (s, a[s], b[s])
    # the same gradient: its norm as logged (and so as clipped; AdamW alone hides a gradient
    # scaled by the micro-steps, which grad_clip then cuts that many times harder)
    for x, y in zip(metrics(one / "run"), metrics(acc / "run"), strict=True):
        assert abs(x["grad_norm"] - y["grad_norm"]) <= 1e-4 * x["grad_norm"], (x["step"], x, y)
        # the model's statistics (token means) of the whole batch, not of the last micro-batch
        model_stats = [k for k in x if k.startswith(("nash_", "mhc_", "batch_"))]
        assert len(model_stats) >= 6 and "batch_token_mean" in model_stats and set(model_stats) <= set(y), (x, y)
        for k in model_stats:
            assert abs(x[k] - y[k]) <= 1e-4 * abs(x[k]) + 1e-6, (x["step"], k, x[k], y[k])


def test_tensorboard_and_wandb_offline(tmp_path, stdlib_data):
    pytest.importorskip("wandb")
    cfg = tiny_config(tmp_path, stdlib_data, **{"training.max_steps": 3, "checkpoint.interval": 0,
                                                "evaluation.interval": 0})
    env = {**ENV, "WANDB_DIR": str(tmp_path), "WANDB_MODE": "offline"}
    r = run(["train.py", str(cfg), "logging.tensorboard=true", "logging.wandb.enabled=true",
             "logging.wandb.mode=offline"], env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(tmp_path / "run" / "tb"))
    events.Reload()
    # every step's loss, as metrics.jsonl has it (TensorBoard stores float32)
    logged = {m["step"]: m["loss"] for m in metrics(tmp_path / "run")}
    assert {e.step: e.value for e in events.Scalars("loss")} == pytest.approx(logged, rel=1e-6)
    assert sorted(logged) == [1, 2, 3]
    assert list((tmp_path / "run").rglob("offline-run-*"))   # its records: tests/test_training_core.py


def test_metrics_continue_cleanly_after_a_crash_and_a_fresh_start(tmp_path, stdlib_data):
    """Lines logged after the last checkpoint are redone on resume (not duplicated); a run from
    step 0 in a used directory keeps the old metrics aside instead of appending to them."""
    cfg = tiny_config(tmp_path, stdlib_data, **{"training.max_steps": 6, "checkpoint.interval": 3,
                                                "evaluation.interval": 0})
    assert run(["train.py", str(cfg)]).returncode == 0
    run_dir = tmp_path / "run"
    (run_dir / "ckpt_00000006.pt").unlink()  # as if the run died after step 6 was logged
    r = run(["train.py", str(cfg)])
    assert r.returncode == 0 and "resumed from" in r.stderr
    assert [m["step"] for m in metrics(run_dir)] == [1, 2, 3, 4, 5, 6]
    # a run that does not continue the newest checkpoint is refused while checkpoints lie past
    # its start: its saves would overwrite some of them, and auto would take the rest for its own
    ckpts = sorted(run_dir.glob("ckpt_*.pt"))
    for resume, start in (("none", 0), (str(ckpts[0]), 3)):
        r = run(["train.py", str(cfg), f"checkpoint.resume={resume}"])
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
        assert (f"{run_dir} holds {len(ckpts) - (start > 0)} checkpoint(s) past step {start} (newest "
                f"{ckpts[-1].name}) that checkpoint.resume={resume} would overwrite") in r.stderr
        assert sorted(run_dir.glob("ckpt_*.pt")) == ckpts and [m["step"] for m in metrics(run_dir)] == [1, 2, 3, 4, 5, 6]
    for p in ckpts:  # moved away: now the directory's metrics are all that is left of the old run
        p.unlink()
    r = run(["train.py", str(cfg), "checkpoint.resume=none"])
    assert r.returncode == 0 and "is kept as metrics." in r.stderr
    assert [m["step"] for m in metrics(run_dir)] == [1, 2, 3, 4, 5, 6]
    assert len(list(run_dir.glob("metrics.*.jsonl"))) == 1


def test_the_same_command_with_a_resume_path_goes_on_after_a_stop(tmp_path, stdlib_data):
    """checkpoint.resume=PATH (a continuation of another run's checkpoint), stopped after its own
    save at step 6 and started again with the same command (a requeued job): it goes on from its
    own step 6, as the stop line says, where it was refused for the checkpoints past PATH's step 3.
    Its later steps are the uninterrupted run's."""
    over = {"training.max_steps": 9, "checkpoint.interval": 3, "checkpoint.keep": 3, "evaluation.interval": 0}
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    assert run(["train.py", str(tiny_config(tmp_path / "a", stdlib_data, **over))]).returncode == 0
    start = tmp_path / "a" / "run" / "ckpt_00000003.pt"
    command = ["train.py", str(tiny_config(tmp_path / "b", stdlib_data, **over)), f"checkpoint.resume={start}"]
    r = run(command)
    assert r.returncode == 0, r.stderr[-2000:]
    run_dir = tmp_path / "b" / "run"
    whole = losses(run_dir)
    (run_dir / "ckpt_00000009.pt").unlink()   # as if the job was stopped after step 6's save
    r = run(command)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert (f"checkpoint.resume={start}: ckpt_00000006.pt in {run_dir} was saved by a run started from it; "
            "going on from there (step 6)") in r.stderr
    again = losses(run_dir)
    assert sorted(again) == sorted(whole) == list(range(4, 10))
    for step in (7, 8, 9):
        assert again[step] == pytest.approx(whole[step], rel=1e-6), (step, again[step], whole[step])


def test_logging_dir_holds_the_logs_across_a_resume_and_the_export_reads_them(tmp_path, stdlib_data):
    """logging.dir (e.g. a local disk while checkpoint.dir is a gcsfuse bucket, which uploads a
    file only when it is closed): metrics.jsonl and TensorBoard go there,
    checkpoint.dir holds only the checkpoints; a resumed run redoes its lines there, and the
    exported model card still finds the run's validation loss."""
    import export_hf
    logs = tmp_path / "local" / "logs"
    cfg = tiny_config(tmp_path, stdlib_data, **{"training.max_steps": 6, "checkpoint.interval": 3,
                                                "evaluation.interval": 3, "logging.dir": str(logs),
                                                "logging.tensorboard": True})
    assert run(["train.py", str(cfg)]).returncode == 0
    run_dir = tmp_path / "run"
    assert sorted(p.name for p in run_dir.iterdir()) == [".lock", "ckpt_00000003.pt", "ckpt_00000006.pt"]
    assert list((logs / "tb").glob("events.out.tfevents.*"))
    logged = metrics(logs)
    (run_dir / "ckpt_00000006.pt").unlink()  # as if the run died after step 6 was logged
    r = run(["train.py", str(cfg)])
    assert r.returncode == 0 and "resumed from" in r.stderr, r.stderr[-2000:]
    assert [m["step"] for m in metrics(logs)] == [m["step"] for m in logged]
    assert not (run_dir / "metrics.jsonl").exists()
    val = [m["eval_loss"] for m in metrics(logs) if m["step"] == 6 and "eval_loss" in m]
    assert len(val) == 1
    assert export_hf.main([str(run_dir), str(tmp_path / "hf")]) == 0
    assert f"validation loss {val[0]:.4f} at this step" in (tmp_path / "hf" / "README.md").read_text()

    # another run pointed at these logs is refused at start (a resume there would truncate them),
    # and the export reads no loss from logs that say they are another run's
    before = (logs / "metrics.jsonl").read_text()
    r = run(["train.py", str(cfg), f"checkpoint.dir={tmp_path / 'other'}"])
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert f"logging.dir={logs} holds the logs of the run in {run_dir.resolve()}: give each run" in r.stderr
    assert (logs / "metrics.jsonl").read_text() == before
    (logs / "log_owner.json").write_text(json.dumps({"checkpoint_dir": str(tmp_path / "other")}))
    assert export_hf.main([str(run_dir), str(tmp_path / "hf2")]) == 0
    assert "validation loss" not in (tmp_path / "hf2" / "README.md").read_text()


@pytest.mark.parametrize("given, says", [(" ", "logging.dir is empty"), ("afile", "cannot write there")])
def test_a_logging_dir_that_cannot_be_used_is_one_line(tmp_path, stdlib_data, given, says):
    (tmp_path / "afile").write_text("")
    path = str(tmp_path / given) if given.strip() else given
    r = run(["train.py", str(tiny_config(tmp_path, stdlib_data)), f"logging.dir={path}"])
    assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert not list((tmp_path / "run").glob("ckpt_*")) and (tmp_path / "afile").read_text() == ""


def test_resume_on_other_data_says_so(tmp_path, stdlib_data):
    """A checkpoint records which data it was trained on (meta.json's identity); resuming on other
    data (re-prepared, another corpus) is allowed, and said, since the sample offset then points
    into another order."""
    import prepare_data
    cfg = tiny_config(tmp_path, stdlib_data, **{"training.max_steps": 2, "checkpoint.interval": 0,
                                                "evaluation.interval": 0})
    assert run(["train.py", str(cfg)]).returncode == 0
    r = run(["train.py", str(cfg), "training.max_steps=3"])
    assert r.returncode == 0 and "resumed from" in r.stderr and "other data" not in r.stderr
    other = tmp_path / "other"
    src = tmp_path / "src"
    src.mkdir()
    for n in range(20):  # documents are files: enough of them for a validation split
        (src / f"m{n}.py").write_text("".join(f"def f{i}(x):\n    return x * {i + n}\n" for i in range(150)))
    assert prepare_data.main(["--input", str(src), "--tokenizer", str(stdlib_data), "--val-fraction", "0.05",
                              "--out", str(other)]) == 0
    r = run(["train.py", str(cfg), "training.max_steps=4", f"data.dir={other}"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert ("warning: the checkpoint was saved while training on other data (meta.json differs): "
            f"data.dir={other} holds other data now") in r.stderr
    # the same data cut into windows of another length: the sample offset means other tokens too
    assert "data.seq_len" not in r.stderr
    r = run(["train.py", str(cfg), "training.max_steps=5", f"data.dir={other}", "data.seq_len=16"])
    assert r.returncode == 0 and "warning: data.seq_len 32 -> 16: the data position" in r.stderr, r.stderr[-2000:]
    assert "training.seed" not in r.stderr
    # another seed: the epoch's order (drawn from the seed) changes under the saved position
    r = run(["train.py", str(cfg), "training.max_steps=6", f"data.dir={other}", "data.seq_len=16", "training.seed=8"])
    assert r.returncode == 0 and "warning: training.seed 7 -> 8: epoch 0 is drawn in another order" in r.stderr, \
        r.stderr[-2000:]
    # data of another tokenizer: every token id stands for other text. Refused in one line, for a
    # resume and for init_from, and nothing is touched
    retok = tmp_path / "retok"
    assert prepare_data.main(["--input", str(src), "--vocab-size", "300", "--val-fraction", "0.05",
                              "--out", str(retok)]) == 0
    before = sorted(p.name for p in (tmp_path / "run").iterdir())
    for extra in (["training.max_steps=6"], ["checkpoint.resume=none", f"checkpoint.init_from={tmp_path / 'run'}",
                                             f"checkpoint.dir={tmp_path / 'fresh'}"]):
        r = run(["train.py", str(cfg), f"data.dir={retok}", *extra])
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
        assert "was trained on data of another tokenizer" in r.stderr and f"data.dir={retok}" in r.stderr
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == before


def test_resume_from_another_run_directory_takes_its_newest_checkpoint(tmp_path, stdlib_data):
    a = tiny_config(tmp_path, stdlib_data, **{"training.max_steps": 4, "checkpoint.interval": 2,
                                              "evaluation.interval": 0})
    assert run(["train.py", str(a)]).returncode == 0
    r = run(["train.py", str(a), f"checkpoint.dir={tmp_path / 'b'}", f"checkpoint.resume={tmp_path / 'run'}",
             "training.max_steps=6"])
    assert r.returncode == 0 and f"resumed from {tmp_path / 'run' / 'ckpt_00000004.pt'} at step 4" in r.stderr
    assert [m["step"] for m in metrics(tmp_path / "b")] == [5, 6]
    r = run(["train.py", str(a), f"checkpoint.dir={tmp_path / 'c'}", f"checkpoint.resume={tmp_path}"])
    assert r.returncode == 2 and "no committed checkpoint in this run directory" in r.stderr


SIGTERM_IN_FINAL_SAVE = """
import os, signal
from training.checkpoint import Checkpointer
save = Checkpointer.save
def save_with_a_signal(self, *args, **kw):
    os.kill(os.getpid(), signal.SIGTERM)
    return save(self, *args, **kw)
Checkpointer.save = save_with_a_signal
"""


def test_a_signal_during_the_final_save_does_not_cut_it_short(tmp_path, stdlib_data):
    """A SIGTERM that arrives while the last checkpoint is written (a scheduler repeating its
    signal, a launcher passing on one the process already had) finds the stop handler still
    there: the save completes and the run exits 0. Before, the default handlers were back by
    then, and SIGTERM killed the process mid-save."""
    cfg = tiny_config(tmp_path, stdlib_data, **{"training.max_steps": 3, "checkpoint.interval": 0,
                                                "evaluation.interval": 0})
    r = run_patched(tmp_path, SIGTERM_IN_FINAL_SAVE, ["train.py", cfg])
    assert r.returncode == 0 and "SIGTERM received" in r.stderr, r.stderr[-3000:]
    assert [p.name for p in (tmp_path / "run").glob("ckpt_*")] == ["ckpt_00000003.pt"]


SIGTERM_IN_SAVE_OF_STEP_4 = """
import os, signal
from training.checkpoint import Checkpointer
save = Checkpointer.save
def save_with_a_signal(self, meta, *args, **kw):
    if meta["step"] == 4:
        os.kill(os.getpid(), signal.SIGTERM)
    return save(self, meta, *args, **kw)
Checkpointer.save = save_with_a_signal
"""


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_stop_during_a_periodic_save_ends_the_run_on_that_save(tmp_path, stdlib_data, async_save):
    """A SIGTERM that arrives while a periodic checkpoint is written stops the run at that step,
    with that checkpoint as its last: before, the run took one more step and saved again, which
    doubled the time a preempted run needs before the launcher's SIGKILL."""
    cfg = tiny_config(tmp_path, stdlib_data, **{"training.max_steps": 10, "checkpoint.interval": 4,
                                                "checkpoint.async": async_save, "evaluation.interval": 0,
                                                "logging.interval": 5})
    r = run_patched(tmp_path, SIGTERM_IN_SAVE_OF_STEP_4, ["train.py", cfg])
    assert r.returncode == 0 and "stopped at step 4 after SIGTERM" in r.stderr, r.stderr[-3000:]
    assert [p.name for p in (tmp_path / "run").glob("ckpt_*")] == ["ckpt_00000004.pt"]
    assert r.stderr.count("saved ") == 1, r.stderr[-3000:]


SIGTERM_WHILE_RESTORING = """
import os, signal
from training.checkpoint import Checkpointer
restore = Checkpointer.restore
def restore_with_a_signal(self, *args, **kw):
    os.kill(os.getpid(), signal.SIGTERM)
    return restore(self, *args, **kw)
Checkpointer.restore = restore_with_a_signal
"""


def test_a_hang_up_stops_and_saves_and_under_nohup_is_ignored(tmp_path, stdlib_data):
    """A terminal's hang-up (the ssh session of a run started without nohup ended) stops the run
    at that step with a save, exit 0; it used to kill it with nothing saved. Started under nohup,
    the run ignores it and trains to the end."""
    over = {"training.max_steps": 6, "checkpoint.interval": 0, "evaluation.interval": 0}
    for name, prefix in (("tty", []), ("nohup", ["nohup"])):
        (tmp_path / name).mkdir()
        script = patched_script(tmp_path / name, sigterm_during_step(3, name="SIGHUP"),
                                ["train.py", tiny_config(tmp_path / name, stdlib_data, **over)])
        r = subprocess.run([*prefix, sys.executable, str(script)], cwd=ROOT, env=ENV, capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        saved = sorted(p.name for p in (tmp_path / name / "run").glob("ckpt_*"))
        if name == "tty":
            assert "SIGHUP received" in r.stderr and "stopped at step 3 after SIGHUP" in r.stderr, r.stderr[-3000:]
            assert saved == ["ckpt_00000003.pt"] and max(losses(tmp_path / name / "run")) == 3
        else:
            assert "SIGHUP" not in r.stderr and saved == ["ckpt_00000006.pt"], r.stderr[-3000:]


def test_a_stop_during_start_up_exits_cleanly_before_training(tmp_path, stdlib_data):
    """A SIGTERM while a resumed run loads its checkpoint (start-up: before the training loop)
    is a stop like any other: exit 0 with one line, nothing trained or saved. Before, the stop
    handler was not there yet and the signal killed the process (exit -15)."""
    over = {"checkpoint.interval": 0, "evaluation.interval": 0}
    r = run(["train.py", str(tiny_config(tmp_path, stdlib_data, **over)), "training.max_steps=3"])
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_patched(tmp_path, SIGTERM_WHILE_RESTORING, ["train.py", tiny_config(tmp_path, stdlib_data, **over),
                                                        "training.max_steps=6"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "stopped before step 4 after SIGTERM: nothing new to save" in r.stderr, r.stderr[-3000:]
    assert [p.name for p in (tmp_path / "run").glob("ckpt_*")] == ["ckpt_00000003.pt"]
    assert max(losses(tmp_path / "run")) == 3


CLOSING_THE_LOGS_FAILS = """
from training.monitor import Monitor
def close(self):
    raise RuntimeError("closing the logs failed")
Monitor.close = close
"""


def test_an_error_while_closing_the_logs_still_stops_the_data_workers(tmp_path, stdlib_data):
    """The loop's clean-up runs each step even when one before it fails: an error from the
    logs' close left the DataLoader workers running, which ignore SIGTERM, and the process then
    waited for them at exit for ever."""
    cfg = tiny_config(tmp_path, stdlib_data, **{"training.max_steps": 2, "data.num_workers": 1,
                                                "checkpoint.interval": 0, "evaluation.interval": 0})
    r = run_patched(tmp_path, CLOSING_THE_LOGS_FAILS, ["train.py", cfg])  # a hang fails by its timeout
    assert r.returncode == 1 and "RuntimeError: closing the logs failed" in r.stderr, r.stderr[-3000:]


def test_the_error_a_run_stops_on_is_reported_even_when_closing_the_logs_fails_too(tmp_path, stdlib_data):
    """A save's CheckpointError at step 5 is the run's one-line error (exit 2) when the logs' close
    then fails as well: that failure is a warning line above it, not the exception the run ends
    with (it was: a traceback of the close's error, the save's reason only in its context)."""
    patch = CLOSING_THE_LOGS_FAILS + (
        "import training.loop\n"
        "from training.checkpoint import CheckpointError\n"
        "def save(self, reason, wait=False):\n"
        "    raise CheckpointError(f'checkpoint.dir: the disk is full at step {self.state.step} (a stand-in)')\n"
        "training.loop.Trainer.save = save\n")
    cfg = tiny_config(tmp_path, stdlib_data, **{"data.num_workers": 1, "evaluation.interval": 0})
    r = run_patched(tmp_path, patch, ["train.py", cfg])
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert lines[-1] == "train.py: error: checkpoint.dir: the disk is full at step 5 (a stand-in)", lines[-3:]
    assert lines[-2] == ("warning: stopping after the error below, closing the logs and data also failed: "
                         "RuntimeError: closing the logs failed"), lines[-3:]


def test_init_from_takes_the_weights_of_a_run_with_another_optimizer(tmp_path, stdlib_data):
    """checkpoint.init_from loads weights only, so the optimizer of the run they come from does
    not matter (fine-tuning with AdamW from a Muon run was refused as if resuming); resuming with
    another optimizer still is refused."""
    (tmp_path / "muon").mkdir(), (tmp_path / "adamw").mkdir()
    over = {"training.max_steps": 2, "checkpoint.interval": 0, "evaluation.interval": 0}
    r = run(["train.py", str(tiny_config(tmp_path / "muon", stdlib_data, **over)), "training.optimizer=muon"])
    assert r.returncode == 0, r.stderr[-3000:]
    source = tmp_path / "muon" / "run"
    r = run(["train.py", str(tiny_config(tmp_path / "adamw", stdlib_data, **over)), f"checkpoint.init_from={source}"])
    assert r.returncode == 0 and f"initial weights from {source / 'ckpt_00000002.pt'}" in r.stderr, r.stderr[-3000:]
    r = run(["train.py", str(tiny_config(tmp_path / "muon", stdlib_data, **over)), "training.max_steps=4"])
    assert r.returncode == 2 and "training.optimizer 'muon' -> 'adamw'" in r.stderr, r.stderr[-3000:]


def test_a_checkpoint_dir_that_cannot_be_written_is_one_line(tmp_path, stdlib_data):
    """One process too: a file in the way of checkpoint.dir is refused before training, in one
    line naming the key (it was a traceback from the metrics log), and the file is left as it was."""
    blocker = tmp_path / "a_file"
    blocker.write_text("mine")
    r = run(["train.py", str(tiny_config(tmp_path, stdlib_data)), f"checkpoint.dir={blocker / 'run'}"])
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"train.py: error: checkpoint.dir={blocker / 'run'}: cannot write"), last
    assert blocker.read_text() == "mine"


RANK_1_CANNOT_READ = """
import os
from training import checkpoint, hf
if os.environ.get("RANK") == "1":
    def unreadable(path, warn=None):
        raise checkpoint.CheckpointError(f"{path}: unreadable here")
    checkpoint.peek_checkpoint = hf.load_training_checkpoint = unreadable
"""


@needs_torchrun
@pytest.mark.parametrize("key", ["checkpoint.resume", "checkpoint.init_from"])
def test_a_checkpoint_one_process_cannot_read_stops_every_process_in_one_line(tmp_path, stdlib_data, key):
    """checkpoint.resume=PATH (or init_from) that loads on rank 0 but not on rank 1 (a host
    without the file): both processes exit 2 with the reason in one line. Before, rank 1 raised
    alone and rank 0 died in the next collective with a gloo traceback."""
    source = tmp_path / "source"
    source.mkdir()
    r = run(["train.py", str(tiny_config(source, stdlib_data, **{"training.max_steps": 2}))])
    assert r.returncode == 0, r.stderr[-3000:]
    ckpt = source / "run" / "ckpt_00000002.pt"
    cfg = tiny_config(tmp_path, stdlib_data, **{"training.max_steps": 4})
    script = patched_script(tmp_path, RANK_1_CANNOT_READ,
                            ["train.py", cfg, f"{key}={ckpt}", "training.batch_size=2"])
    proc = subprocess.run([TORCHRUN, "--standalone", "--nproc_per_node=2", str(script)], cwd=ROOT,
                          env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    # each process says it (their lines may interleave on the shared pipe)
    assert proc.stderr.count(f"train.py: error: {ckpt}: unreadable here") == 2, proc.stderr[-3000:]
    assert f"{ckpt}: unreadable here (on another process)" in proc.stderr
    assert "gloo" not in proc.stderr and "Connection closed" not in proc.stderr, proc.stderr[-3000:]


UNLOADABLE_TENSORS = """
from training.backend import TorchBackend
def load_full_state(self, *args):
    raise RuntimeError("storage bytes do not decode")
TorchBackend.load_full_state = load_full_state
"""


def test_a_checkpoint_whose_tensors_do_not_load_is_one_line(tmp_path, stdlib_data):
    """A checkpoint that passes the start-up checks but whose tensors fail to load (unreadable
    shard contents, a state that does not fit) is refused in one line naming it: it was a
    traceback from deep inside DCP or load_state_dict."""
    cfg = tiny_config(tmp_path, stdlib_data, **{"training.max_steps": 2, "checkpoint.interval": 0,
                                                "evaluation.interval": 0})
    assert run(["train.py", str(cfg)]).returncode == 0
    r = run_patched(tmp_path, UNLOADABLE_TENSORS, ["train.py", cfg, "training.max_steps=4"])
    ckpt = tmp_path / "run" / "ckpt_00000002.pt"
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1] == (
        f"train.py: error: {ckpt}: cannot be loaded (RuntimeError: storage bytes do not decode); "
        "move it out of checkpoint.dir (resume: auto then takes the one before it)")
    # one outside checkpoint.dir (resume: PATH): moving it out of checkpoint.dir is no advice
    r = run_patched(tmp_path, UNLOADABLE_TENSORS, ["train.py", cfg, "training.max_steps=4", f"checkpoint.resume={ckpt}",
                                                   f"checkpoint.dir={tmp_path / 'elsewhere'}"])
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == (
        f"train.py: error: {ckpt}: cannot be loaded (RuntimeError: storage bytes do not decode); "
        "check that it is whole and still there, or resume from another checkpoint"), r.stderr[-3000:]


@needs_torchrun
def test_ddp_processes_stop_together_at_the_step_after_a_signal(tmp_path, stdlib_data):
    """A SIGTERM that reaches one torchrun worker during step 3 stops both after step 3, not at
    the next log step (10): the decision is one host-side all-reduce after every step, so a save
    starts well inside the 30 s torchrun gives its workers before SIGKILL."""
    cfg = tiny_config(tmp_path, stdlib_data, **{"training.max_steps": 20, "logging.interval": 10,
                                                "checkpoint.interval": 0, "evaluation.interval": 0})
    script = patched_script(tmp_path, sigterm_during_step(3, rank="1"),
                            ["train.py", cfg, "training.batch_size=2"])
    proc = subprocess.run([TORCHRUN, "--standalone", "--nproc_per_node=2", str(script)], cwd=ROOT,
                          env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "stopped at step 3 after a stop signal on another process" in proc.stderr, proc.stderr[-3000:]
    assert [p.name for p in (tmp_path / "run").glob("ckpt_*")] == ["ckpt_00000003.pt"]


def _both_stop_with(tmp_path, cfg, patch: str, reason: str) -> None:
    """train.py under torchrun (2 gloo processes), ``patch`` run first in each (it fails something
    on RANK 1 only): both processes stop with ``reason``, rank 0 saying it came from another; no
    worker traceback (torchrun prints its own for a failed worker)."""
    script = patched_script(tmp_path, "import os\nfrom training import data\n"
                                      "from training.config import ConfigError\n" + patch,
                            ["train.py", cfg, "training.batch_size=2"])
    proc = subprocess.run([TORCHRUN, "--standalone", "--nproc_per_node=2", str(script)], cwd=ROOT,
                          env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0 and "]: Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.count(f"train.py: error: {reason}") == 2, proc.stderr[-3000:]
    assert f"train.py: error: {reason} (on another process)" in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "run").exists() or not list((tmp_path / "run").glob("ckpt_*"))  # no save


@needs_torchrun
def test_a_shard_one_process_cannot_open_stops_every_process_with_its_reason(tmp_path, stdlib_data):
    """The launch agreement compares meta.json; the shards are opened by each process after it. A
    shard one host cannot open (missing or damaged on its disk) stopped that process in one line
    and left the other with a traceback from its next collective; now both stop with the reason."""
    cfg = tiny_config(tmp_path, stdlib_data, **{"training.max_steps": 2, "evaluation.interval": 0})
    _both_stop_with(tmp_path, cfg, "real = data.TokenWindows.__init__\n"
                                   "def init(self, d, split, *a, **k):\n"
                                   "    if os.environ.get('RANK') == '1' and split == 'val':\n"
                                   "        raise ConfigError(f'{d}/val_00000.npy: cannot open shard (rank 1 cannot)')\n"
                                   "    real(self, d, split, *a, **k)\n"
                                   "data.TokenWindows.__init__ = init\n",
                    f"{stdlib_data}/val_00000.npy: cannot open shard (rank 1 cannot)")


@needs_torchrun
@pytest.mark.parametrize("accum, bad_step", [(1, 3), (2, 2)])
def test_a_bad_batch_on_one_process_stops_every_process_with_its_reason(tmp_path, stdlib_data, accum, bad_step):
    """A batch holding a token id past the vocabulary (a corrupt shard) is found by the process
    that reads it; stopping there alone left the other in the step's collectives (a traceback over
    gloo, a wait over nccl). The batch is replaced, the step skipped on every process (the skip is
    decided on the replicas' mean loss), and all stop at the next decision with its reason. With
    accumulation the bad batch is a step's first micro-batch: the device-batch iterator must go on
    to the next one (a generator ended at the error: "the data loader stopped", and a traceback)."""
    cfg = tiny_config(tmp_path, stdlib_data, **{"training.max_steps": 8, "logging.interval": 1,
                                                "evaluation.interval": 0, "checkpoint.interval": 0,
                                                "training.gradient_accumulation_steps": accum})
    _both_stop_with(tmp_path, cfg, "real, calls = data.DataStream.__next__, [0]\n"
                                   "def nxt(self):\n"
                                   "    batch = real(self)\n"
                                   "    calls[0] += 1\n"
                                   "    if os.environ.get('RANK') == '1' and calls[0] == 3:\n"
                                   "        raise ConfigError('train_00000.npy: token 5 is id 9999, not below "
                              "the vocabulary')\n"
                                   "    return batch\n"
                                   "data.DataStream.__next__ = nxt\n",
                    "train_00000.npy: token 5 is id 9999, not below the vocabulary")
    lines = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(1, bad_step + 1)), lines   # stopped at the decision after it
    assert math.isfinite(lines[-2]["loss"]) and lines[-1]["loss"] == "nan"      # that step skipped, on
    assert (lines[-2]["nonfinite_skipped"], lines[-1]["nonfinite_skipped"]) == (0, 1)  # every process


# train_xla.py's processes decide together only at agreed steps and log steps
# (Backend.decides_every_step False): here at log steps only.
DECIDING_AT_LOG_STEPS = ("from training.backend import TorchBackend\n"
                         "from training import loop\n"
                         "TorchBackend.decides_every_step = False\n"
                         "loop.decision_interval = lambda seconds, log_interval: log_interval\n")


@pytest.mark.parametrize("decides, save_every, bad_batch, saved", [
    ("every step", 1, 3, ["ckpt_00000001.pt", "ckpt_00000002.pt"]),
    ("at log steps", 2, 4, ["ckpt_00000002.pt"]),
])
def test_a_step_with_a_refused_batch_is_never_saved(tmp_path, stdlib_data, decides, save_every, bad_batch, saved):
    """A periodic save at the step of a batch some process could not use ran before the decision
    that stops on it, and committed that step's state (on XLA SPMD across hosts the step can be
    skipped on the refusing host's chips only: a mixed state). The decision comes first now: the
    run stops with the error, and the last checkpoint is the step before; also where processes
    decide only at log steps (every 8 here), as train_xla.py's do: a save is a decision too."""
    cfg = tiny_config(tmp_path, stdlib_data, **{"training.max_steps": 8,
                                                "logging.interval": 4 if decides == "every step" else 8,
                                                "evaluation.interval": 0, "checkpoint.interval": save_every})
    r = run_patched(tmp_path, (DECIDING_AT_LOG_STEPS if decides == "at log steps" else "")
                    + "from training import data\n"
                      "from training.config import ConfigError\n"
                      "real, calls = data.DataStream.__next__, [0]\n"
                      "def nxt(self):\n"
                      "    calls[0] += 1\n"
                      f"    if calls[0] == {bad_batch}:\n"
                      "        raise ConfigError('train_00000.npy: token 5 is id 9999, not below the vocabulary')\n"
                      "    return real(self)\n"
                      "data.DataStream.__next__ = nxt\n", ["train.py", str(cfg)])
    assert r.returncode == 2 and "token 5 is id 9999" in r.stderr.splitlines()[-1], r.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "run").glob("ckpt_*")) == saved


def test_a_save_between_log_steps_counts_the_steps_skipped_since_the_last_log(tmp_path, stdlib_data):
    """The checkpoint's count of non-finite (skipped) steps came from the log lines only: a save
    at step 3 with a step skipped at 2 and logs every 4 recorded 0, and the resumed run's
    nonfinite_skipped stayed 1 short for good."""
    cfg = tiny_config(tmp_path, stdlib_data, **{"training.max_steps": 4, "logging.interval": 4,
                                                "evaluation.interval": 0, "checkpoint.interval": 3})
    nan_at_step_2 = ("from training import loop\n"
                     "calls = [0]\n"
                     "class Poisoned(loop.NashMHC):\n"
                     "    def forward(self, idx, targets=None):\n"
                     "        out = super().forward(idx, targets)\n"
                     "        if self.training and targets is not None:\n"
                     "            calls[0] += 1\n"
                     "            if calls[0] == 2:\n"
                     "                out.loss = out.loss * float('nan')\n"
                     "        return out\n"
                     "loop.NashMHC = Poisoned\n")
    r = run_patched(tmp_path, nan_at_step_2, ["train.py", str(cfg)])
    assert r.returncode == 0, r.stderr[-3000:]
    ckpt = torch.load(tmp_path / "run" / "ckpt_00000003.pt", weights_only=True)
    assert ckpt["nonfinite"] == {"total": 1}
    assert metrics(tmp_path / "run")[-1]["nonfinite_skipped"] == 1
    # the count goes on in the resumed run (from step 4's checkpoint; nothing non-finite now)
    r = run(["train.py", str(cfg), "training.max_steps=6"])
    assert r.returncode == 0 and "resumed from" in r.stderr, r.stderr[-3000:]
    assert [(m["step"], m["nonfinite_skipped"]) for m in metrics(tmp_path / "run")][-1] == (6, 1)


def test_a_stop_signal_with_the_last_step_ends_a_complete_run(tmp_path, stdlib_data):
    """SIGTERM as the last step starts: that step runs and the run is complete, so it ends as done
    (the final save, the "done" line with the validation loss), not as stopped (before: a save for
    the signal and "resume with the same command", which then said the run was done)."""
    cfg = tiny_config(tmp_path, stdlib_data, **{"training.max_steps": 4, "checkpoint.interval": 0})
    r = run_patched(tmp_path, sigterm_during_step(4), ["train.py", str(cfg)])
    assert r.returncode == 0 and "SIGTERM received" in r.stderr, r.stderr[-3000:]
    assert "done: 4 steps" in r.stderr and "final val loss" in r.stderr, r.stderr[-3000:]
    assert "resume with the same command" not in r.stderr and "(final;" in r.stderr, r.stderr[-3000:]
    assert [m["step"] for m in metrics(tmp_path / "run")] == [1, 2, 3, 4]
    assert sorted(p.name for p in (tmp_path / "run").glob("ckpt_*")) == ["ckpt_00000004.pt"]


def test_a_token_budget_resumed_with_another_batch_keeps_its_budget_and_its_schedule(tmp_path, stdlib_data):
    """training.total_tokens on resume: the steps left are the tokens left in steps of the new size,
    and the cosine goes on from the tokens trained on. Before, max_steps was the whole budget in
    new steps counted from step 0 again: half the batch at step 8 of 16 trained 24 more steps, 1.5x
    the budget, with the learning rate back up where it had been at step 3."""
    over = {"training.max_steps": None, "training.total_tokens": 16 * 128, "checkpoint.interval": 8,
            "evaluation.interval": 0, "training.warmup_steps": 2}
    cfg = tiny_config(tmp_path, stdlib_data, **over)
    r = run_patched(tmp_path, sigterm_during_step(8), ["train.py", str(cfg)])  # saved at step 8
    assert r.returncode == 0 and "16 steps (training.total_tokens=2,048)" in r.stderr, r.stderr[-3000:]
    r = run(["train.py", str(cfg), "training.batch_size=2"])
    assert r.returncode == 0 and "resumed from" in r.stderr, r.stderr[-3000:]
    recs = metrics(tmp_path / "run")
    assert [m["step"] for m in recs] == list(range(1, 25))          # 8 of 128 tokens, then 16 of 64
    assert recs[-1]["tokens_seen"] == 2048
    lrs = [m["lr"] for m in recs]
    assert all(a >= b for a, b in zip(lrs[2:], lrs[3:]))             # one cosine across the resume
    assert lrs[-1] == pytest.approx(0.1 * 3e-3)                      # down to min_lr at the end
    # step for step: the first run's schedule, then the one of a run in steps of 64 tokens that
    # has trained 1024 (16 of its steps) at the resume, 32 in all
    from training.optim import lr_at
    expected = [lr_at(s, 16, 3e-3, 2, 0.1) for s in range(8)] + [lr_at(s + 8, 32, 3e-3, 2, 0.1) for s in range(8, 24)]
    assert lrs == pytest.approx(expected, rel=1e-6)


def test_a_wsd_run_extended_from_its_stable_part_goes_on_as_if_planned(tmp_path, stdlib_data):
    """training.schedule=wsd: the peak, then the last decay_ratio of the steps decaying to
    min_lr_ratio at the last. Stopped in its stable part (16 steps planned, saved at 6) and resumed
    with 24, the run has the rates of a 24-step run from the start: what WSD is for. The
    checkpoints at multiples of checkpoint.keep_every stay besides the newest (checkpoint.keep 1)."""
    over = {"training.max_steps": 16, "checkpoint.interval": 2, "checkpoint.keep": 1,
            "checkpoint.keep_every": 4, "evaluation.interval": 0,
            "training.warmup_steps": 2, "training.schedule": "wsd", "training.decay_ratio": 0.25,
            "training.decay_shape": "1-sqrt"}
    cfg = tiny_config(tmp_path, stdlib_data, **over)
    r = run_patched(tmp_path, sigterm_during_step(6), ["train.py", str(cfg)])  # saved at step 6
    assert r.returncode == 0 and "ckpt_00000006" in r.stderr, r.stderr[-3000:]
    r = run(["train.py", str(cfg), "training.max_steps=24"])
    assert r.returncode == 0 and "resumed from" in r.stderr, r.stderr[-3000:]
    lrs = [m["lr"] for m in metrics(tmp_path / "run")]
    from training.optim import lr_at
    assert lrs == pytest.approx([lr_at(s, 24, 3e-3, 2, 0.1, "wsd", 0.25, "1-sqrt") for s in range(24)], rel=1e-6)
    assert lrs[1:18] == pytest.approx([3e-3] * 17, rel=1e-6) and lrs[-1] == pytest.approx(3e-4, rel=1e-6)
    from training.checkpoint import list_checkpoints
    assert [s for s, _ in list_checkpoints(tmp_path / "run")] == [4, 8, 12, 16, 20, 24]


def test_a_profile_traces_the_steps_it_names_and_changes_nothing_else(tmp_path, stdlib_data):
    """logging.profile_start=3, profile_steps=2: torch.profiler's Chrome trace of steps 3 and 4
    (each a named range holding the model's ops), written when step 4 ends and said in the log;
    the losses are those of the same run without it."""
    over = {"training.max_steps": 6, "evaluation.interval": 0, "checkpoint.interval": 0}
    runs = {}
    for name, profile in (("plain", {}), ("profiled", {"logging.profile_start": 3, "logging.profile_steps": 2})):
        (tmp_path / name).mkdir()
        cfg = tiny_config(tmp_path / name, stdlib_data, **over, **profile)
        r = run(["train.py", str(cfg)])
        assert r.returncode == 0, r.stderr[-3000:]
        runs[name] = (tmp_path / name / "run", r.stderr)
    run_dir, log = runs["profiled"]
    path = run_dir / "profile" / "rank0_steps3-4.json"
    assert f"profiler trace of steps 3-4: {path}" in log
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no temporary left
    assert not (runs["plain"][0] / "profile").exists()
    events = json.loads(path.read_text())["traceEvents"]
    steps = {e["name"]: e for e in events if e.get("name", "").startswith("step ")}
    assert sorted(steps) == ["step 3", "step 4"]
    for e in steps.values():  # the step's forward and backward inside its range
        inside = {o["name"] for o in events if o.get("ph") == "X" and o.get("tid") == e["tid"]
                  and e["ts"] <= o["ts"] and o["ts"] + o.get("dur", 0) <= e["ts"] + e["dur"]}
        assert {"aten::linear", "aten::scaled_dot_product_attention"} <= inside, sorted(inside)[:50]
        assert any(n.startswith("autograd::engine::evaluate_function") for n in inside)
    assert losses(run_dir) == losses(runs["plain"][0])


RANK_0_DISK_FULL = """
import errno, os, pathlib
mkdir = pathlib.Path.mkdir
def full(self, *args, **kwargs):
    if os.environ.get("RANK") == "0" and self.name == "ckpt_00000002":
        raise OSError(errno.ENOSPC, "No space left on device", str(self))
    return mkdir(self, *args, **kwargs)
pathlib.Path.mkdir = full
"""



RANK_1_WRITES_ON_A_FULL_DISK = """
import errno, os
from torch.distributed.checkpoint import FileSystemWriter
write_data = FileSystemWriter.write_data
def full(self, plan, planner):
    if os.environ.get("RANK") == "1":
        raise OSError(errno.ENOSPC, "No space left on device")
    return write_data(self, plan, planner)
FileSystemWriter.write_data = full
"""


ASYNC_SAVE_FAILS_AT_STEP_6 = """
import errno, threading, time
from training import checkpoint
from training.loop import Trainer
save, go = checkpoint.atomic_torch_save, threading.Event()
def full(obj, path):   # step 6's save fails once step 8 has begun, whatever the machine's load
    if "ckpt_00000006" in str(path):
        go.wait(300)
        raise OSError(errno.ENOSPC, "No space left on device")
    return save(obj, path)
checkpoint.atomic_torch_save = full
train_step = Trainer.train_step
def step_once_the_save_failed(self, lr):
    if self.state.step == 7:   # step 8 begins: let the save fail, and wait until it has
        go.set()
        give_up = time.monotonic() + 300
        while not self.checkpointer.failed() and time.monotonic() < give_up:
            time.sleep(0.01)
    return train_step(self, lr)
Trainer.train_step = step_once_the_save_failed
"""


def test_a_failed_asynchronous_save_stops_the_run_at_the_next_decision(tmp_path, stdlib_data):
    """checkpoint.async: the writer thread's failure (a full disk at step 6's save) is taken at the
    next decision, after step 8, with its reason in one line; it had waited for the next save
    (step 9 here, an interval later: hours of training on a large run), and a SIGTERM in between
    ended the run with that error and no save."""
    cfg = tiny_config(tmp_path, stdlib_data, **{"training.max_steps": 12, "checkpoint.interval": 3,
                                                "checkpoint.async": True, "evaluation.interval": 0})
    r = run_patched(tmp_path, ASYNC_SAVE_FAILS_AT_STEP_6, ["train.py", str(cfg)])
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "saving a checkpoint failed ([Errno 28] No space left on device" in r.stderr
    assert [m["step"] for m in metrics(tmp_path / "run")] == list(range(1, 9))
    assert sorted(p.name for p in (tmp_path / "run").glob("ckpt_*")) == ["ckpt_00000003.pt"]


@needs_torchrun
def test_a_sharded_save_whose_shards_fail_says_why_and_leaves_no_shards(tmp_path, stdlib_data):
    """A DCP save that fails while the shards are written (rank 1's disk is full): every process
    stops with the failing process's error and the space left, in one line (it was DCP's
    "CheckpointException ranks:dict_keys([1])"), and the master deletes the partial directory at
    once (it stayed until the next start, keeping a full disk full)."""
    cfg = tiny_config(tmp_path, stdlib_data, **{"training.fsdp": True, "training.max_steps": 4,
                                                "checkpoint.interval": 2})
    script = patched_script(tmp_path, RANK_1_WRITES_ON_A_FULL_DISK, ["train.py", cfg, "training.batch_size=2"])
    proc = subprocess.run([TORCHRUN, "--standalone", "--nproc_per_node=2", str(script)], cwd=ROOT,
                          env=ENV, capture_output=True, text=True, timeout=300)
    workers = proc.stderr.split("ChildFailedError")[0]
    want = (f"train.py: error: {tmp_path / 'run'}: saving a checkpoint failed (process 1: [Errno 28] "
            "No space left on device; ")
    assert proc.returncode != 0 and workers.count(want) == 2, proc.stderr[-3000:]
    assert workers.count("MiB free on its disk)") == 2
    assert not (tmp_path / "run" / "ckpt_00000002").exists()

@needs_torchrun
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_sharded_save_that_fails_on_the_master_stops_every_process(tmp_path, stdlib_data, async_save):
    """FSDP2's DCP save: the master makes the checkpoint directory, then all write. When that
    failed (a full disk), the master went on to report the error while the others waited for it
    in a barrier: every process hung until gloo's 30-minute timeout, deaf to SIGTERM. Now every
    process stops with the reason in one line, and nothing half-made is left."""
    cfg = tiny_config(tmp_path, stdlib_data, **{"training.fsdp": True, "training.max_steps": 4,
                                                "checkpoint.interval": 2, "checkpoint.async": async_save})
    script = patched_script(tmp_path, RANK_0_DISK_FULL, ["train.py", cfg, "training.batch_size=2"])
    proc = subprocess.run([TORCHRUN, "--standalone", "--nproc_per_node=2", str(script)], cwd=ROOT,
                          env=ENV, capture_output=True, text=True, timeout=300)
    want = f"{tmp_path / 'run' / 'ckpt_00000002'}: cannot make the checkpoint directory (No space left on device)"
    workers = proc.stderr.split("ChildFailedError")[0]  # then torchrun's own report of the exit codes
    assert proc.returncode != 0 and workers.count("Traceback") <= 1, proc.stderr[-3000:]  # torchrun's
    assert workers.count(f"train.py: error: {want}") == 2, proc.stderr[-3000:]  # both, the other "(on another process)"
    assert f"{want} (on another process)" in workers and "exitcode  : 2" in proc.stderr
    assert not (tmp_path / "run" / "ckpt_00000002").exists()
