"""The shared training core, piece by piece: schedule, config, data order, optimisers, checkpoints."""
import functools
import json
import math
import os
import pickle
import re
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from training.checkpoint import (FORMAT_VERSION, CheckpointError, atomic_torch_save, checkpoint_path,
                                 find_resume, list_checkpoints, load_checkpoint, rotate)
from training.config import ConfigError, check_data, check_xla, load_config, schema_markdown
from training.data import DataStream, ResumableSampler, TokenWindows
from training.optim import (AdamW, Muon, _orthogonalised_by_share, build_optimizer, lr_at, newton_schulz, set_lr,
                            split_params)

ROOT = Path(__file__).resolve().parents[1]


# -- schedule --------------------------------------------------------------------------------

@settings(deadline=None)  # the first example builds torch's schedulers
@given(peak=st.floats(1e-5, 1.0), warmup=st.integers(0, 50), extra=st.integers(1, 500),
       ratio=st.floats(0.0, 1.0))
def test_schedule_is_torchs_warmup_then_cosine(peak, warmup, extra, ratio):
    """Step for step torch's SequentialLR of a linear warmup and CosineAnnealingLR, which reaches
    min_lr_ratio x peak at the run's last step (max_steps - 1)."""
    total = warmup + extra
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=peak)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, extra - 1), eta_min=ratio * peak)
    if warmup:
        ramp = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / warmup)
        sched = torch.optim.lr_scheduler.SequentialLR(opt, [ramp, cosine], milestones=[warmup])
    else:
        sched = cosine
    for s in range(total):
        ours = lr_at(s, total, peak, warmup, ratio)
        assert ours == pytest.approx(opt.param_groups[0]["lr"], rel=1e-9, abs=1e-12 * peak), s
        assert ours > 0 or (s == total - 1 and extra > 1 and ratio * peak == 0)  # never 0 before the end
        opt.step()
        sched.step()
    if extra > 1:
        assert lr_at(total - 1, total, peak, warmup, ratio) == pytest.approx(ratio * peak, abs=1e-12)


@given(peak=st.floats(1e-5, 1.0), warmup=st.integers(0, 50), extra=st.integers(1, 500),
       ratio=st.floats(0.0, 1.0), at=st.floats(0.0, 1.0))
@example(peak=3e-3, warmup=2, extra=3, ratio=0.1, at=0.375)  # step 1.5 of 5: was 1.25 x the peak
def test_schedule_never_exceeds_its_peak_at_fractional_steps(peak, warmup, extra, ratio, at):
    """A token budget resumed with more tokens per step reads the schedule between steps
    (Trainer.schedule_shift): there too the rate is between min_lr_ratio x peak (or the warmup's
    start) and the peak, and never decreases during the warmup."""
    total = warmup + extra
    step = at * (total - 1)
    lr = lr_at(step, total, peak, warmup, ratio)
    assert 0 < lr <= peak or (lr == 0 and ratio == 0)
    if step + 0.25 < warmup:
        assert lr <= lr_at(step + 0.25, total, peak, warmup, ratio)


@given(peak=st.floats(1e-5, 1.0), warmup=st.integers(0, 30), extra=st.integers(1, 300),
       decay_ratio=st.floats(0.01, 1.0), ratio=st.floats(0.0, 1.0),
       shape=st.sampled_from(["linear", "1-sqrt", "cosine"]))
@example(peak=1e-3, warmup=0, extra=10, decay_ratio=0.01, ratio=0.1, shape="linear")  # one decay step
@example(peak=1e-3, warmup=8, extra=2, decay_ratio=1.0, ratio=0.0, shape="1-sqrt")   # decay overlaps warmup
def test_wsd_schedule_is_transformers_get_wsd_schedule(peak, warmup, extra, decay_ratio, ratio, shape):
    """schedule=wsd after its warmup, step for step transformers' get_wsd_schedule with the same
    stable part and one decay step fewer (it reaches the minimum one step past its decay; ours at
    the run's last step); the warmup is the cosine's (torch's LambdaLR above)."""
    from transformers.optimization import get_wsd_schedule
    total = warmup + extra
    decay = max(1, round(decay_ratio * total))
    stable = max(warmup, total - decay) - warmup
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=peak)
    hf = get_wsd_schedule(opt, num_warmup_steps=warmup, num_stable_steps=stable,
                          num_decay_steps=total - 1 - warmup - stable, decay_type=shape, min_lr_ratio=ratio)
    for s in range(total):
        ours = lr_at(s, total, peak, warmup, ratio, "wsd", decay_ratio, shape)
        if s >= warmup:
            assert ours == pytest.approx(opt.param_groups[0]["lr"], rel=1e-9, abs=1e-12 * peak), s
        else:
            assert ours == lr_at(s, total, peak, warmup, ratio)
        opt.step()
        hf.step()
    assert lr_at(total - 1, total, peak, warmup, ratio, "wsd", decay_ratio, shape) == pytest.approx(ratio * peak)
    # a longer run planned from the start has the same rates up to this one's decay
    for s in range(warmup + stable):
        assert lr_at(s, 3 * total, peak, warmup, ratio, "wsd", decay_ratio / 3, shape) == \
            lr_at(s, total, peak, warmup, ratio, "wsd", decay_ratio, shape)


# -- config ----------------------------------------------------------------------------------

def write(tmp_path, text, name="c.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_train_xla_names_the_train_py_settings_it_ignores():
    from training.config import xla_ignores
    assert xla_ignores(load_config(None, ["training.max_steps=1", "training.compile=true"])) == []
    lines = xla_ignores(load_config(None, ["training.max_steps=1", "training.fsdp=true", "training.device=cuda"]))
    assert [line.split(" ")[0] for line in lines] == ["training.fsdp=true", "training.device=cuda"]
    # an SPMD mesh in ddp mode (xla.mode forgotten): whole replicas, nothing sharded
    assert xla_ignores(load_config(None, ["training.max_steps=1", "xla.mode=spmd", "xla.mesh.fsdp=4"])) == []
    assert xla_ignores(load_config(None, ["training.max_steps=1", "xla.mesh.fsdp=4", "xla.mesh.tp=2"])) == [
        "xla.mesh.fsdp=4, xla.mesh.tp=2: the SPMD mesh, and xla.mode is ddp, where every process trains a whole "
        "replica (set xla.mode=spmd to shard; ignored here)"]


def test_config_unknown_key_suggests_closest(tmp_path):
    p = write(tmp_path, "training:\n  lerning_rate: 0.1\n  max_steps: 3\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert "training.lerning_rate" in msg and "training.learning_rate" in msg and "\n" not in msg


def test_config_unknown_section(tmp_path):
    with pytest.raises(ConfigError, match="unknown key 'trainig'.*'training'"):
        load_config(write(tmp_path, "trainig: {}\n"))


@pytest.mark.parametrize("text, match", [
    ("training: {max_steps: 3, batch_size: 'big'}", "training.batch_size: expected an integer"),
    ("training: {max_steps: 3, batch_size: 0}", "training.batch_size=0"),
    ("training: {max_steps: 3, precision: fp16}", "training.precision: 'fp16' is not one of"),
    ("training: {max_steps: 3, betas: [0.9]}", "training.betas"),
    ("training: {max_steps: 3, compile: 'yes'}", "training.compile: expected true or false"),
    ("training: {max_steps: 3, eps: 0}", "training.eps=0.0 must be at least 1e-30"),
    # positive, but 0 in fp32's update: a gradient entry of exactly 0 made NaN weights
    ("training: {max_steps: 3, eps: 1.0e-50}", "training.eps=1e-50 must be at least 1e-30"),
    ("training: {max_steps: 3, muon_lr: -0.1}", "training.muon_lr=-0.1 must be positive"),
    ("training: {max_steps: 3, muon_momentum: 1}", "training.muon_momentum=1.0 must be in"),
    ("training: {max_steps: 3}\nlogging: {peak_flops: -1}", "logging.peak_flops=-1.0 must be a positive"),
    ("training: {max_steps: 3}\ndata: {seq_len: 4096}", "data.seq_len=4096 is above model.max_seq_len"),
    ("training: {}", "exactly one of training.max_steps and training.total_tokens"),
    ("training: {max_steps: 3}\nmodel: {d_model: 100, n_heads: 3}", "model.d_model"),
    ("training: {max_steps: 3, seed: 18446744073709551616}", r"training.seed: 18446744073709551616 is out of range "
                                                             r"\(\|value\| < 2\*\*63\)"),
    ("training: {max_steps: 3, seed: -1}", r"training.seed=-1 must be in \[0, 2\*\*63\)"),
    # YAML 1.1 reads 1:30 as 90 (base 60); lists and mappings show as written, not as objects
    ("training: {max_steps: 3, learning_rate: 1:30}", "training.learning_rate: 1:30 is the base-60 number 90 in YAML 1.1"),
    ("training: {max_steps: 3, betas: [0.9, 0.95, 0.99]}", r"got \[0.9, 0.95, 0.99\]$"),
    ("training: {max_steps: {steps: 10}}", r"training.max_steps: expected int or null, got \{'steps': 10\}$"),
    ("logging: {wandb: {mode: off}}\ntraining: {max_steps: 3}", "logging.wandb.mode: 'off' is not one of"),
    ("training: {max_steps: 3}\nxla: {mode: DDP}",
     r"xla.mode: 'DDP' is not one of 'ddp', 'spmd' \(did you mean 'ddp'\?\)$"),
    ("training: {max_steps: 3, device: gpu}", "training.device='gpu': expected auto, cuda, cuda:N, mps or cpu"),
    ("training: {max_steps: 3, device: 'cuda:abc'}", "training.device='cuda:abc': expected"),
    ("training: {max_steps: 3, dist_timeout_s: 0}", "training.dist_timeout_s=0.0 must be a positive number of seconds"),
    # (as the key's help says: interval 0 evaluates at the end only; nothing turns evaluation off)
    ("training: {max_steps: 3}\nevaluation: {steps: 0}",
     r"evaluation.steps=0 must be at least 1 \(evaluation.interval=0: only at the end of the run\)$"),
    ("training: {max_steps: 3}\nevaluation: {interval: -1}", r"evaluation.interval=-1 must be >= 0 \(0: only at the end\)$"),
    # every other bound the schema checks (none of these had a case: removing a check passed)
    ("training: {max_steps: 3, grad_clip: -1}", r"training.grad_clip=-1.0 must be >= 0$"),
    ("training: {max_steps: 3, min_lr_ratio: 1.5}", r"training.min_lr_ratio=1.5 must be in \[0, 1\]$"),
    ("training: {max_steps: 3, warmup_steps: -1}", r"training.warmup_steps=-1 must be >= 0$"),
    ("training: {max_steps: 3}\ncheckpoint: {keep_every: -5}", r"checkpoint.keep_every=-5 must be >= 0 \(0: none\)$"),
    ("training: {max_steps: 3}\nlogging: {profile_start: -1}", r"logging.profile_start=-1 must be >= 0 \(0: no profile\)$"),
    ("training: {max_steps: 3}\nlogging: {profile_steps: 0}", r"logging.profile_steps=0 must be at least 1$"),
    ("training: {max_steps: 3, decay_ratio: 0}", r"training.decay_ratio=0.0 must be in \(0, 1\]$"),
    ("training: {max_steps: 3, decay_ratio: 1.5}", r"training.decay_ratio=1.5 must be in \(0, 1\]$"),
    ("training: {max_steps: 3, decay_shape: sqrt}",
     r"training.decay_shape: 'sqrt' is not one of 'linear', '1-sqrt', 'cosine' \(did you mean '1-sqrt'\?\)$"),
    ("training: {max_steps: 3, weight_decay: -0.1}", r"training.weight_decay=-0.1 must be >= 0$"),
    ("training: {max_steps: 3, betas: [0.9, 1.0]}", r"training.betas=\[0.9, 1.0\] must be in \[0, 1\)$"),
    ("training: {max_steps: 3, learning_rate: 0}", r"training.learning_rate=0.0 must be positive$"),
    ("training: {max_steps: 3, max_nonfinite_steps: 0}", r"training.max_nonfinite_steps=0 must be at least 1$"),
    ("training: {max_steps: 3, gradient_accumulation_steps: 0}",
     r"training.gradient_accumulation_steps=0 must be at least 1$"),
    ("training: {max_steps: 0}", r"training.max_steps=0 must be at least 1$"),
    ("training: {max_steps: null, total_tokens: 0}", r"training.total_tokens=0 must be at least 1$"),
    ("training: {max_steps: 3}\ncheckpoint: {keep: 0}", r"checkpoint.keep=0 must be at least 1$"),
    ("training: {max_steps: 3}\ncheckpoint: {interval: -5}", r"checkpoint.interval=-5 must be >= 0$"),
    ("training: {max_steps: 3}\nlogging: {interval: 0}", r"logging.interval=0 must be at least 1$"),
    ("training: {max_steps: 3}\nlogging: {dir: ' '}", r"logging.dir is empty"),
    ("training: {max_steps: 3}\nxla: {mesh: {tp: 0}}", r"xla.mesh axes must be at least 1$"),
    ("training: {max_steps: 3}\ndata: {num_workers: -1}", r"data.num_workers=-1 must be >= 0$"),
    # a fraction for a whole number is refused, never truncated (8.0 is 8)
    ("training: {max_steps: 3, batch_size: 7.9}", r"training.batch_size: expected an integer, got 7.9$"),
    ("training: {max_steps: 1.5}", r"training.max_steps: expected int or null, got 1.5$"),
])
def test_config_bad_values_name_the_key(tmp_path, text, match):
    with pytest.raises(ConfigError, match=match) as e:
        load_config(write(tmp_path, text))
    assert "\n" not in str(e.value)


def test_a_data_dir_that_cannot_be_read_is_a_config_error():
    """Path.is_dir() raises for some errors (a dead gcsfuse mount's ENOTCONN, EACCES, a name too
    long): a traceback on that host that skipped the launch agreement, the others left waiting."""
    from training.config import check_data
    long = "/tmp/" + "d" * 300
    with pytest.raises(ConfigError) as e:
        check_data(load_config(None, ["training.max_steps=1", f"data.dir={long}"]))
    assert str(e.value) == f"data.dir: cannot read {long} (File name too long)"


def test_a_relative_data_dir_that_is_not_there_names_the_working_directory(tmp_path, monkeypatch):
    """The usual cause of a missing relative data.dir is the directory the run was started in."""
    from training.config import check_data
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        check_data(load_config(None, ["training.max_steps=1", "data.dir=data/none"]))
    assert str(e.value) == (f"data.dir: data/none does not exist, relative to the working directory {tmp_path} "
                            "(run prepare_data.py first)")


def test_settings_that_do_nothing_are_said():
    """Legal settings that change nothing in this config, or not what they say, get a warning line
    at start: a window not below the sequence (full attention), bf16 streams without streams, a
    token budget below one step."""
    from training.loop import settings_warnings
    base = ["training.max_steps=1", "data.seq_len=64", "model.max_seq_len=64"]
    assert settings_warnings(load_config(None, base + ["model.nash_window=16"]), 256) == []
    said = settings_warnings(load_config(None, [
        "training.total_tokens=100", "data.seq_len=64", "model.max_seq_len=64", "model.nash_window=64",
        "model.mhc_streams=1", "model.stream_dtype=bf16"]), 256)
    assert [w.split(":")[1].strip() for w in said] == [
        "model.nash_window=64 is not below data.seq_len=64", "model.stream_dtype=bf16 applies to mHC's streams, and "
        "model.mhc_streams=1 has none", "training.total_tokens=100 is less than one step's 256 tokens"]
    # two scales' Nash game is their mean (checked against aggregation: mean, weights shared)
    said = settings_warnings(load_config(None, base + ["model.nash_window=16", "model.nash_scales=2"]), 256)
    assert [w.split(":")[1].strip() for w in said] == ["model.aggregation=nash with model.nash_scales=2 is the mean "
                                                       "of the two scales"]
    assert settings_warnings(load_config(None, base + ["model.nash_window=16", "model.nash_scales=2",
                                                       "model.aggregation=mean"]), 256) == []
    from model import ModelConfig, NashMHC
    torch.manual_seed(0)
    two = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, nash_scales=2,
                      nash_window=8)
    nash, mean = NashMHC(two).eval(), NashMHC(ModelConfig(**{**two.to_dict(), "aggregation": "mean"})).eval()
    mean.load_state_dict(nash.state_dict(), strict=False)
    x = torch.randint(0, 64, (2, 50))
    with torch.no_grad():
        assert torch.equal(nash(x).logits, mean(x).logits)
    # a model vocabulary more than twice the data's: most of the embedding never sees a token
    vocab = ["model.vocab_size=4096", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=4",
             "model.nash_window=16"]
    assert settings_warnings(load_config(None, base + vocab), 256, data_vocab=2048) == []
    said = settings_warnings(load_config(None, base + vocab + ["data.dir=d"]), 256, data_vocab=2000)
    assert said == ["warning: model.vocab_size=4,096 is 2.0x the data's vocabulary (2,000 in d): 2,096 token "
                    "ids never occur (0.1M weights trained only towards zero probability); set model.vocab_size "
                    "to the data's (or a multiple of 64 just above it)"]
    # warmup that leaves no decay: the whole run, or all of it but one step at the peak (lr_at)
    from training.optim import lr_at
    for steps, warmup, said in ((10, 10, "is not below the run's 10 steps: "),
                                (10, 12, "is not below the run's 10 steps: "),
                                (10, 9, "leaves one of the run's 10 steps after warmup, at the peak "),
                                (10, 8, None), (1, 0, None)):
        got = settings_warnings(load_config(None, base + ["model.nash_window=16", f"training.warmup_steps={warmup}"]),
                                256, max_steps=steps)
        assert len(got) == (said is not None) and all(
            w.startswith(f"warning: training.warmup_steps={warmup} {said}") for w in got), got
        rates = [lr_at(i, steps, 1.0, warmup, 0.1) for i in range(steps)]
        never_decays = all(b >= a for a, b in zip(rates, rates[1:]))
        assert never_decays == (said is not None or steps == 1), rates
    # wsd decays its last step to the floor after such a warmup: nothing to say
    wsd = base + ["model.nash_window=16", "training.warmup_steps=9", "training.schedule=wsd"]
    assert settings_warnings(load_config(None, wsd), 256, max_steps=10) == []
    assert lr_at(9, 10, 1.0, 9, 0.1, "wsd") == pytest.approx(0.1)
    # milestones that no save lands on except at the common multiple
    for every, said in ((1000, []), (1200, ["warning: checkpoint.keep_every=1200 is not a multiple of "
                                            "checkpoint.interval=500: the checkpoints kept are those at "
                                            "multiples of 6,000"])):
        cfg = load_config(None, base + ["model.nash_window=16", "training.warmup_steps=2",
                                        "checkpoint.interval=500", f"checkpoint.keep_every={every}"])
        assert settings_warnings(cfg, 256, max_steps=10) == said
    # a profile that starts past the run's end
    for start, said in ((10, []), (11, ["warning: logging.profile_start=11 is past the run's 10 steps: "
                                        "nothing is profiled"])):
        cfg = load_config(None, base + ["model.nash_window=16", "training.warmup_steps=2", f"logging.profile_start={start}"])
        assert settings_warnings(cfg, 256, max_steps=10) == said


def test_a_changed_architecture_is_refused_in_the_config_file_spelling():
    """Resuming with another architecture names each changed key with its values as one writes them
    in YAML (true/false, not Python's True/False); dropout and friends may change."""
    from training.loop import check_resume_compatible
    saved = load_config(None, ["training.max_steps=1", "model.mhc_lite=true", "model.dropout=0.0"])
    ckpt = {"config": saved.to_dict()}
    now = load_config(None, ["training.max_steps=1", "model.mhc_lite=false", "model.n_layers=3",
                             "model.dropout=0.1"])
    with pytest.raises(CheckpointError) as e:
        check_resume_compatible(now, ckpt, Path("ck.pt"))
    assert str(e.value) == (f"ck.pt: model config differs from the checkpoint's (model.n_layers: "
                            f"{saved.model.n_layers} -> 3; model.mhc_lite: true -> false)")
    check_resume_compatible(load_config(None, ["training.max_steps=1", "model.mhc_lite=true",
                                               "model.dropout=0.1"]), ckpt, Path("ck.pt"))
    # the same weights spelled another way: an export to Llama and back (--import) writes the
    # SwiGLU width as another ffn_mult / ffn_multiple_of, and mHC's and the fusion's settings mean
    # nothing with one stream and one scale (init_from with the run's own config was refused)
    base = ["training.max_steps=1", "model.d_model=128", "model.n_heads=4", "model.n_kv_heads=2",
            "model.mhc_streams=1", "model.nash_scales=1", "model.nash_window=0"]
    ckpt = {"config": load_config(None, base + ["model.ffn_mult=2.67", "model.ffn_multiple_of=32"]).to_dict()}
    check_resume_compatible(load_config(None, base + ["model.ffn_mult=2.75", "model.ffn_multiple_of=16",
                                                      "model.mhc_lite=false", "model.sinkhorn_iters=5",
                                                      "model.aggregation=mean", "model.nash_iters=1"]),
                            ckpt, Path("ck.pt"))
    with pytest.raises(CheckpointError, match=r"\(model.ffn_hidden: 352 -> 384\)$"):
        check_resume_compatible(load_config(None, base + ["model.ffn_mult=3.0"]), ckpt, Path("ck.pt"))


def test_config_overrides_are_typed(tmp_path):
    p = write(tmp_path, "training: {max_steps: 3}\n")
    cfg = load_config(p, ["training.learning_rate=1e-3", "training.betas=[0.8,0.9]",
                          "logging.wandb.enabled=true", "training.max_steps=7", "data.dir=/x"])
    assert cfg.training.learning_rate == 1e-3 and cfg.training.betas == (0.8, 0.9)
    assert cfg.logging.wandb.enabled is True and cfg.training.max_steps == 7 and cfg.data.dir == "/x"
    with pytest.raises(ConfigError, match="training.max_steps: expected int or null"):
        load_config(p, ["training.max_steps=many"])
    with pytest.raises(ConfigError, match="unknown key 'training.max_stpes'"):
        load_config(p, ["training.max_stpes=1"])
    # in order: of a key given twice the last wins, a section's mapping included (README)
    cfg = load_config(p, ["training.max_steps=5", "training={max_steps: 6, seed: 2}", "training.max_steps=8"])
    assert cfg.training.max_steps == 8 and cfg.training.seed == 2
    assert load_config(p, ["training.max_steps=8", "training={max_steps: 6}"]).training.max_steps == 6


@pytest.mark.parametrize("overrides, where", [
    (["training.max_steps="], "command line"),                       # the file holds max_steps: 3
    (["training.lerning_rate=1e-3"], "command line"),
    (["data.seq_len=4096"], "command line"),                          # a cross-field check
    (["model.n_heads=7"], "command line"),      # one whose message names the file's d_model, not the key
    (["training.learning_rate=1e-3"], "file"),                        # a good override; the file's error
])
def test_config_errors_say_whether_the_file_or_the_command_line_set_the_value(tmp_path, overrides, where):
    """An error about a value an override set names the command line, not the YAML file (which
    does not hold it), also where the message names the file's value rather than the key; one the
    file alone fails with names the file."""
    p = write(tmp_path, "training: {max_steps: 3}\nmodel: {d_model: 100}\n" if where == "file"
              else "training: {max_steps: 3}\n")
    with pytest.raises(ConfigError) as e:
        load_config(p, overrides)
    msg = str(e.value)
    assert msg.startswith(f"command line (over {p}): " if where == "command line" else f"{p}: "), msg
    # a file that leaves a key to the command line, or holds another error of its own: an error the
    # overrides made still names the command line
    for text in ("model: {d_model: 128}\n", "training: {max_steps: 3}\ncheckpoint: {keep: 0}\n"):
        p = write(tmp_path, text)
        with pytest.raises(ConfigError, match=rf"^command line \(over {re.escape(str(p))}\): model.d_model=128 "
                                              "is not divisible by n_heads=7$"):
            load_config(p, ["training.max_steps=10", "model.n_heads=7"])


def test_string_keys_take_an_override_as_written(tmp_path):
    # YAML would read 0100 as the octal 64, 2024_01 as 202401 and on as true: a checkpoint
    # directory or run name given on the command line is the text typed, never a number
    p = write(tmp_path, "training: {max_steps: 3}\n")
    cfg = load_config(p, ["checkpoint.dir=0100", "logging.wandb.run_name=2024_01", "data.dir=on"])
    assert (cfg.checkpoint.dir, cfg.logging.wandb.run_name, cfg.data.dir) == ("0100", "2024_01", "on")
    cfg = load_config(p, ["logging.wandb.run_name=null", "training.max_steps=0x10", "checkpoint.dir='0100'",
                          "data.dir=!!str 0200"])
    assert cfg.logging.wandb.run_name is None and cfg.training.max_steps == 16 and cfg.checkpoint.dir == "0100"
    assert cfg.data.dir == "0200"  # a YAML tag is YAML's reading, as in a config file
    with pytest.raises(ConfigError, match=r"^override model=5: model is a section: set its keys \(model.vocab_size=...\) "
                                          r"or give a mapping \(model=\{vocab_size: ...\}\)$"):
        load_config(None, ["model=5", "training.max_steps=3"])
    # a '#' in a path is part of it (YAML would cut a comment off); quoted text is YAML's
    cfg = load_config(p, ["checkpoint.dir=runs/lr sweep #3", "logging.wandb.run_name='a #1'"])
    assert (cfg.checkpoint.dir, cfg.logging.wandb.run_name) == ("runs/lr sweep #3", "a #1")
    # text YAML reads as a mapping or a list is text for a text key; a list or mapping key
    # (training.betas, a section) keeps YAML's reading, and a later override goes into a mapping
    cfg = load_config(p, ["logging.wandb.run_name=sweep: lr 3e-4", "checkpoint.dir=- x", "data.dir=[a, b]",
                          "training.betas=[0.8, 0.9]", "xla.mesh={fsdp: 2}", "xla.mesh.tp=2"])
    assert (cfg.logging.wandb.run_name, cfg.checkpoint.dir, cfg.data.dir) == ("sweep: lr 3e-4", "- x", "[a, b]")
    assert cfg.training.betas == (0.8, 0.9) and (cfg.xla.mesh.fsdp, cfg.xla.mesh.tp) == (2, 2)
    with pytest.raises(ConfigError, match=r"training.betas: expected a list of 2 values .*, got \{'x': 1\}$"):
        load_config(p, ["training.betas=x: 1"])
    # inside a section's mapping the same, as in a config file (it was YAML's reading there: a
    # checkpoint directory 64, a base-60 max_steps 90 taken silently, a duplicate key's last value)
    cfg = load_config(p, ["checkpoint={dir: 0100}", "logging.wandb={run_name: 2024_01}", "data={dir: on}"])
    assert (cfg.checkpoint.dir, cfg.logging.wandb.run_name, cfg.data.dir) == ("0100", "2024_01", "on")
    assert load_config(p, ["logging={wandb: {run_name: 0x10}}"]).logging.wandb.run_name == "0x10"
    for override, message in (("training={max_steps: 0100}", "training.max_steps: 0100 is the octal number 64"),
                              ("training={max_steps: 1:30}", "training.max_steps: 1:30 is the base-60 number 90"),
                              ("training={max_steps: 5, max_steps: 6}", r"override 'training=\{max_steps: 5, "
                               r"max_steps: 6\}': duplicate key 'max_steps' in the mapping$")):
        with pytest.raises(ConfigError, match=message):
            load_config(p, [override])


def test_what_a_config_would_take_silently_or_as_a_traceback_is_one_line(tmp_path):
    """Found by a review of config.py: a section's mapping replaced the file's section (the keys it
    left out went back to their defaults); a YAML tag that does not construct, an integer past
    int64, an empty path (the working directory), an octal 0100 (64), a decay product >= 1 (the
    weights zeroed or flipped each step) and a Nash temperature whose first step overflows were
    taken, or failed later as a traceback or a NaN loss."""
    p = write(tmp_path, "training: {max_steps: 3, batch_size: 2, warmup_steps: 1}\n")
    t = load_config(p, ["training={max_steps: 5}", "xla.mesh={fsdp: 2}", "xla={mesh: {tp: 2}}"])
    assert (t.training.max_steps, t.training.batch_size, t.training.warmup_steps) == (5, 2, 1)  # merged
    assert (t.xla.mesh.fsdp, t.xla.mesh.tp) == (2, 2)
    bad = {"training.max_steps=!!int 1e3": r"override 'training.max_steps=!!int 1e3': YAML cannot read '!!int 1e3' "
                                            r"\(invalid literal for int\(\) with base 10: '1e3'\)",
           "training.learning_rate=!!float": r"override 'training.learning_rate=!!float': YAML cannot read",
           "training.batch_size=100000000000000000000": r".*training.batch_size: 100000000000000000000 is out of "
                                                        r"range \(\|value\| < 2\*\*63\)",
           "checkpoint.dir=": r".*checkpoint.dir is empty: give a path$",
           "checkpoint.resume= ": r".*checkpoint.resume is empty: give a path \(or auto, or none\)$",
           "checkpoint.init_from=": r".*checkpoint.init_from is empty",
           "data.dir=": r".*data.dir is empty",
           "training.max_steps=0100": r".*training.max_steps: 0100 is the octal number 64 in YAML 1.1; write the "
                                      r"number without its leading zero$",
           "training.weight_decay=1000": r".*training.weight_decay=1000.0 x training.learning_rate=0.003 is 3: the "
                                         r"decay would zero or flip the weights",
           "model.nash_tau=1e-10": r".*model.nash_tau=1e-10 must be in \[0.001, 1000\]$"}
    for override, message in bad.items():
        with pytest.raises(ConfigError, match="^" + message):
            load_config(p, [override])
    with pytest.raises(ConfigError, match=r".*training.weight_decay=60.0 x training.muon_lr=0.02 is 1.2"):
        load_config(p, ["training.optimizer=muon", "training.weight_decay=60"])
    assert load_config(p, ["training.weight_decay=60"]).training.weight_decay == 60  # AdamW's lr: 0.18
    muon = ["training.optimizer=muon", "training.learning_rate=0.05", "training.weight_decay=25"]
    assert load_config(p, muon).training.weight_decay == 25  # Muon's AdamW group is not decayed
    assert load_config(p, ["training.max_steps=08", "checkpoint.dir=0100"]).training.max_steps == 8  # not octal
    with pytest.raises(ConfigError, match=r"invalid YAML \(a tagged value: could not convert string to float: 'abc'\)$"):
        load_config(write(tmp_path, "training: {max_steps: 3, learning_rate: !!float abc}\n", name="tag.yaml"))


def test_string_keys_in_a_file_are_the_text_written(tmp_path):
    """The same in a config file: a plain scalar YAML reads as a number or a boolean is, for a
    string key, the text in the file; number keys still read numbers (and 1e9, which YAML 1.1
    leaves a string without a dot)."""
    p = write(tmp_path, "training: {total_tokens: 2.5e9, batch_size: 1e1, warmup_steps: 0x10}\n"
                        "data: {dir: 0100}\ncheckpoint: {dir: 1_000}\n"
                        "logging: {wandb: {run_name: 2024-01-05, entity: yes, enabled: yes}}\n")
    cfg = load_config(p)
    assert (cfg.training.total_tokens, cfg.training.batch_size, cfg.training.warmup_steps) == (2_500_000_000, 10, 16)
    assert (cfg.data.dir, cfg.checkpoint.dir) == ("0100", "1_000")
    assert (cfg.logging.wandb.run_name, cfg.logging.wandb.entity, cfg.logging.wandb.enabled) == ("2024-01-05", "yes", True)
    # a self-referencing anchor is YAML PyYAML reads: the error is the unknown key, in one line
    with pytest.raises(ConfigError, match="unknown key 'x'"):
        load_config(write(tmp_path, "x: &x [*x]\ntraining: {max_steps: 3}\n", name="loop.yaml"))
    assert load_config(p, ["training.total_tokens=null", "training.max_steps=1e3"]).training.max_steps == 1000
    with pytest.raises(ConfigError, match="training.max_steps: expected int or null, got '1.5e3x'"):
        load_config(p, ["training.total_tokens=null", "training.max_steps=1.5e3x"])


@pytest.mark.parametrize("text, line, key", [
    ("training: {max_steps: 3}\ntraining: {batch_size: 2}\n", 2, "training"),
    ("training:\n  max_steps: 3\n  batch_size: 2\n  max_steps: 4\n", 4, "max_steps"),
])
def test_a_key_given_twice_is_an_error_naming_the_line(tmp_path, text, line, key):
    """PyYAML keeps the last of two equal keys without a word: half a section would vanish."""
    p = write(tmp_path, text)
    with pytest.raises(ConfigError, match=f"^{p}: line {line} invalid YAML \\(duplicate key '{key}'\\)$"):
        load_config(p)


def test_config_that_is_not_text_is_one_line(tmp_path):
    p = tmp_path / "ckpt.pt"
    p.write_bytes(b"\x80\x93\x94 binary")
    with pytest.raises(ConfigError, match=f"^{p}: not a YAML config \\(not UTF-8 text\\)$"):
        load_config(p)


def test_total_tokens_gives_steps(tmp_path):
    cfg = load_config(write(tmp_path, "training: {total_tokens: 1000000, batch_size: 4, "
                                      "gradient_accumulation_steps: 2}\ndata: {seq_len: 128}\n"))
    assert cfg.resolve_steps(replicas=2) == 1000000 // (4 * 2 * 2 * 128)
    # resumed at step 100 of 488 with half the replicas: the tokens left, in steps of the new size
    assert cfg.resolve_steps(replicas=1, step=100, tokens_seen=100 * 2048) == 100 + (1000000 - 204800) // 1024
    assert cfg.resolve_steps(replicas=2, step=488, tokens_seen=488 * 2048) == 488  # done


def test_config_data_checks(tmp_path, stdlib_data):
    p = write(tmp_path, f"training: {{max_steps: 3}}\ndata: {{dir: {tmp_path / 'nope'}}}\n")
    with pytest.raises(ConfigError, match="data.dir: .*nope does not exist"):
        check_data(load_config(p))
    cfg = load_config(p, [f"data.dir={stdlib_data}", "model.vocab_size=100"])
    with pytest.raises(ConfigError, match="model.vocab_size=100 is smaller than the data's vocabulary"):
        check_data(cfg)
    # a meta.json that cannot be read (an I/O error; another user's file): one line, not a traceback
    (tmp_path / "eio").mkdir()
    (tmp_path / "eio" / "meta.json").symlink_to("/proc/self/mem")
    with pytest.raises(ConfigError, match=f"data.dir: cannot read {tmp_path / 'eio' / 'meta.json'} "):
        check_data(load_config(p, [f"data.dir={tmp_path / 'eio'}"]))


@pytest.mark.parametrize("edit, match", [
    ({"splits": {"train": 5}}, "splits.train is 5, not an object"),
    ({"splits": None}, "splits is None, not an object of splits"),
    ({"vocab_size": math.inf}, "vocab_size is inf, not a number of tokens"),
    ({"vocab_size": "many"}, "vocab_size is 'many', not a number of tokens"),
])
def test_malformed_meta_json_is_one_line_naming_the_key(tmp_path, stdlib_data, edit, match):
    """Keys of the wrong type raised AttributeError, TypeError or OverflowError (Infinity)."""
    import shutil
    shutil.copytree(stdlib_data, tmp_path / "data")
    meta = json.loads((tmp_path / "data" / "meta.json").read_text())
    (tmp_path / "data" / "meta.json").write_text(json.dumps({**meta, **edit}))
    cfg = load_config(write(tmp_path, "training: {max_steps: 3}\n"), [f"data.dir={tmp_path / 'data'}"])
    with pytest.raises(ConfigError, match=f"^{tmp_path / 'data' / 'meta.json'}: {match}$"):
        check_data(cfg)


def test_cli_config_error_is_one_line(tmp_path):
    p = write(tmp_path, "training:\n  max_steps: 3\n  batch_sise: 2\n")
    r = subprocess.run([sys.executable, "train.py", str(p)], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "training.batch_sise" in lines[0] and "training.batch_size" in lines[0]


def test_readme_config_reference_is_current():
    readme = (ROOT / "README.md").read_text()
    assert schema_markdown() in readme, "README config reference is stale: run `python -m training.docs`"


# -- data order ------------------------------------------------------------------------------

class Range(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor([i]), torch.tensor([i])


def ids(batch):
    return batch[0][:, 0].tolist()


@given(n=st.integers(8, 200), b=st.integers(1, 4), seed=st.integers(0, 100))
@settings(max_examples=25, deadline=None)
def test_two_replicas_see_the_global_batch_of_one(n, b, seed):
    one = DataStream(Range(n), 2 * b, 1, 0, seed)
    r0, r1 = (DataStream(Range(n), b, 2, r, seed) for r in (0, 1))
    for _ in range(2 * one.batches_per_epoch + 1):  # across an epoch boundary
        assert sorted(ids(next(one))) == sorted(ids(next(r0)) + ids(next(r1)))


@given(n=st.integers(10, 120), b=st.integers(1, 5), k=st.integers(0, 60), seed=st.integers(0, 9),
       replicas=st.sampled_from([1, 2]))
@settings(max_examples=30, deadline=None)
def test_stream_resumes_at_the_exact_sample(n, b, k, seed, replicas):
    """Stop after k batches, resume from the recorded position: the same batches follow."""
    ref = [DataStream(Range(n), b, replicas, r, seed) for r in range(replicas)]
    if n // replicas * replicas < b * replicas:
        return
    for _ in range(k):
        for s in ref:
            next(s)
    pos = ref[0].advance(0, 0, k)
    assert pos == (ref[0].epoch, ref[0].offset) or ref[0].remaining(ref[0].offset) == 0
    resumed = [DataStream(Range(n), b, replicas, r, seed) for r in range(replicas)]
    for s in resumed:
        s.set_position(*pos)
    for _ in range(7):
        for a, c in zip(ref, resumed):
            assert ids(next(a)) == ids(next(c))


def test_resume_on_another_replica_count():
    """A position written by 2 replicas resumes on 1 at the same global sample."""
    n, b, seed = 64, 4, 3
    two = [DataStream(Range(n), b, 2, r, seed) for r in (0, 1)]
    for _ in range(3):
        for s in two:
            next(s)
    pos = two[0].advance(0, 0, 3)
    nxt = sorted(ids(next(two[0])) + ids(next(two[1])))
    one = DataStream(Range(n), 2 * b, 1, 0, seed)
    one.set_position(*pos)
    assert sorted(ids(next(one))) == nxt


def test_sampler_epochs_are_seeded_permutations():
    s = ResumableSampler(Range(50), 1, 0, seed=5)
    s.set_position(0, 0)
    e0 = list(s)
    s.set_position(1, 0)
    e1 = list(s)
    assert sorted(e0) == sorted(e1) == list(range(50)) and e0 != e1
    # from the start of an epoch, torch's DistributedSampler's order (ours keeps it as int32)
    from torch.utils.data import DistributedSampler
    for replicas in (1, 3):
        for rank in range(replicas):
            ours = ResumableSampler(Range(50), replicas, rank, seed=5)
            ours.set_position(2, 0)
            theirs = DistributedSampler(Range(50), replicas, rank, shuffle=True, seed=5, drop_last=True)
            theirs.set_epoch(2)
            assert list(ours) == list(theirs) and all(type(i) is int for i in ours)


def test_token_windows_match_shards(stdlib_data):
    ds = TokenWindows(stdlib_data, "train", 64)
    x, y = ds[len(ds) - 1]
    assert x.shape == y.shape == (64,) and torch.equal(x[1:], y[:-1])
    assert int(x.max()) < ds.vocab_size


def _damaged_copy(src, dst, damage):
    import shutil
    shutil.copytree(src, dst)
    shard = sorted(dst.glob("train_*.npy"))[0]
    damage(shard, dst / "meta.json")
    return shard


def _as_npz(shard):
    with open(shard, "wb") as f:  # a file object: np.savez would add .npz to a path
        np.savez(f, np.zeros(10, np.uint16))


@pytest.mark.parametrize("damage, match", [
    (lambda shard, meta: os.truncate(shard, 1000), "{shard}: cannot open shard"),
    (lambda shard, meta: os.truncate(shard, 0), "{shard}: cannot open shard \\(an empty file\\)"),
    (lambda shard, meta: shard.unlink(), "{shard}: cannot open shard"),
    (lambda shard, meta: np.save(shard, np.zeros(10, np.int64)), "{shard}: int64\\[10\\] does not match meta.json"),
    (lambda shard, meta: np.save(shard, np.zeros((2, 5), np.uint16)), "{shard}: uint16\\[2, 5\\] does not match meta.json"),
    (lambda shard, meta: np.save(shard, np.uint16(5)), "{shard}: uint16\\[\\] does not match meta.json"),
    (lambda shard, meta: _as_npz(shard),
     "{shard}: cannot open shard \\(a .npz archive, not one .npy array\\)"),
    (lambda shard, meta: meta.write_text(json.dumps({**json.loads(meta.read_text()), "dtype": "int32"})),
     "{meta}: dtype 'int32': shards hold token ids as uint16 or uint32"),
    (lambda shard, meta: meta.write_text('{"vocab_size": 512}'), "{meta}: unreadable meta.json \\(KeyError"),
])
def test_damaged_data_is_one_line_naming_the_file(tmp_path, stdlib_data, damage, match):
    shard = _damaged_copy(stdlib_data, tmp_path / "data", damage)
    with pytest.raises(ConfigError, match=match.format(shard=shard, meta=tmp_path / "data" / "meta.json")) as e:
        TokenWindows(tmp_path / "data", "train", 64)
    assert "\n" not in str(e.value)


def test_train_py_with_a_damaged_shard_exits_2_in_one_line(tmp_path, stdlib_data):
    shard = _damaged_copy(stdlib_data, tmp_path / "data", lambda shard, meta: os.truncate(shard, 1000))
    r = subprocess.run([sys.executable, "train.py", "configs/demo.yaml", f"data.dir={tmp_path / 'data'}",
                        f"checkpoint.dir={tmp_path / 'run'}", "training.max_steps=2"],
                       cwd=ROOT, capture_output=True, text=True)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and "Warning" not in ln]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert lines[-1] == f"train.py: error: {shard}: cannot open shard (mmap length is greater than file size)"


def _foreign_ids(shard, meta):
    """The shard's header and size kept, one token past the vocabulary: what a shard written with
    another tokenizer (or a flipped bit) looks like to every check made at load."""
    arr = np.load(shard, mmap_mode="r+")
    arr[777] = json.loads(meta.read_text())["vocab_size"] + 5
    arr.flush()


def test_a_token_id_past_the_vocabulary_is_one_line_naming_shard_and_position(tmp_path, stdlib_data):
    """It loaded, then failed inside the model (an index error; on CUDA a device-side assert)."""
    shard = _damaged_copy(stdlib_data, tmp_path / "data", _foreign_ids)
    meta = json.loads((tmp_path / "data" / "meta.json").read_text())
    ds = TokenWindows(tmp_path / "data", "train", 64)
    want = (f"{shard}: token 777 is id {meta['vocab_size'] + 5}, not below meta.json's vocab_size "
            f"{meta['vocab_size']}")
    errors = []
    for rank in (0, 1):  # one epoch on each of two replicas: the window is one replica's
        stream = DataStream(ds, batch_size=8, num_replicas=2, rank=rank, seed=3)
        try:
            for _ in range(stream.batches_per_epoch):
                next(stream)
        except ConfigError as e:
            errors.append(str(e))
    assert len(errors) == 1 and errors[0].startswith(want) and "\n" not in errors[0], errors

    def everywhere(shard, meta):  # every train window holds one
        for path in shard.parent.glob("train_*.npy"):
            arr = np.load(path, mmap_mode="r+")
            arr[::50] = json.loads(meta.read_text())["vocab_size"]
            arr.flush()

    _damaged_copy(stdlib_data, tmp_path / "data2", everywhere)
    r = subprocess.run([sys.executable, "train.py", "configs/demo.yaml", f"data.dir={tmp_path / 'data2'}",
                        f"checkpoint.dir={tmp_path / 'run'}", "training.max_steps=2", "model.n_layers=1"],
                       cwd=ROOT, capture_output=True, text=True)
    last = [ln for ln in r.stderr.splitlines() if ln.strip()][-1]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert re.fullmatch(r"train\.py: error: .*/data2/train_\d+\.npy: token \d+ is id \d+, not below "
                        r"meta\.json's vocab_size \d+: .*", last), last
    assert not (tmp_path / "run").exists() or not list((tmp_path / "run").glob("ckpt_*"))


def test_a_token_id_past_the_vocabulary_in_the_evaluation_batches_stops_the_start(tmp_path, stdlib_data):
    """The evaluation's batches are the same every time: their ids are checked once at start
    (evaluation runs the model's collectives under FSDP2, where a process stopping alone in it
    would leave the others waiting), so the run stops before its first step, in one line."""
    import shutil
    shutil.copytree(stdlib_data, tmp_path / "data")
    shard = sorted((tmp_path / "data").glob("val_*.npy"))[0]
    _foreign_ids(shard, tmp_path / "data" / "meta.json")
    r = subprocess.run([sys.executable, "train.py", "configs/demo.yaml", f"data.dir={tmp_path / 'data'}",
                        f"checkpoint.dir={tmp_path / 'run'}", "training.max_steps=2", "model.n_layers=1",
                        "data.seq_len=64", "training.batch_size=2"],
                       cwd=ROOT, capture_output=True, text=True)
    last = [ln for ln in r.stderr.splitlines() if ln.strip()][-1]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert last.startswith(f"train.py: error: {shard}: token 777 is id "), last
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


_MANY_SHARDS = """
import json, os, resource, sys
import numpy as np
from training.data import OPEN_SHARDS, TokenWindows

d, limit = sys.argv[1], int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_NOFILE, (limit, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
ds = TokenWindows(d, "train", 8)
meta = json.load(open(os.path.join(d, "meta.json")))
windows = [np.load(os.path.join(d, sh["file"]))[k * 8:k * 8 + 9]
           for sh in meta["splits"]["train"]["shards"] for k in range((sh["tokens"] - 1) // 8)]
order = np.random.default_rng(0).permutation(len(ds))  # random access: the cache keeps evicting
same = all(np.array_equal(np.concatenate([x.numpy(), y[-1:].numpy()]), windows[i]) for i in order.tolist()
           for x, y in [ds[i]])
print("REPORT " + json.dumps({"samples": len(ds), "same": same, "open_maps": len(ds._maps),
                              "cap": OPEN_SHARDS, "fds": len(os.listdir("/proc/self/fd"))}))
"""


def test_many_shards_do_not_run_out_of_file_descriptors(tmp_path):
    """Every shard stayed memory-mapped, each map holding a file descriptor: under the usual limit
    of 1,024 a split of ~1,000 shards (100B tokens at the default shard size) failed at start with
    "Too many open files". Shards are now checked at start and mapped when read, a bounded number
    at a time: 600 shards under a limit of 128, read in random order, give exactly the windows of
    the files."""
    from helpers import ENV, script_report

    d = tmp_path / "data"
    d.mkdir()
    rng = np.random.default_rng(1)
    shards = []
    for i in range(600):
        name = f"train_{i:05d}.npy"
        np.save(d / name, rng.integers(0, 300, size=int(rng.integers(9, 40)), dtype=np.uint16))
        shards.append({"file": name, "tokens": int(np.load(d / name).size)})
    (d / "meta.json").write_text(json.dumps({"vocab_size": 300, "dtype": "uint16", "eos_id": 0,
                                             "splits": {"train": {"shards": shards}, "val": {"shards": []}}}))
    report = script_report(_MANY_SHARDS, d, 128, env=ENV)
    assert report["same"] and report["samples"] == sum((s["tokens"] - 1) // 8 for s in shards)
    assert report["open_maps"] == report["cap"] and report["fds"] < 128


def test_shards_short_against_seq_len_warn_of_the_unused_tokens(tmp_path):
    """Windows do not cross shard boundaries: 400-token shards with seq_len 256 leave 36% of the
    tokens unread."""
    d = tmp_path / "data"
    d.mkdir()
    for i in range(3):
        np.save(d / f"train_{i:05d}.npy", np.arange(400, dtype=np.uint16))
    shards = [{"file": f"train_{i:05d}.npy", "tokens": 400} for i in range(3)]
    (d / "meta.json").write_text(json.dumps({"vocab_size": 400, "dtype": "uint16",
                                             "splits": {"train": {"shards": shards}}}))
    assert TokenWindows(d, "train", 256).unused_warning("train") == (
        "warning: 36% of the train split's tokens are in no window: windows of data.seq_len + 1 = 257 "
        "tokens do not cross shard boundaries, and its shards hold 400 tokens on average; prepare the "
        "data with a larger --shard-tokens, or use a shorter data.seq_len")
    assert TokenWindows(d, "train", 133).unused_warning("train") is None  # 3 windows a shard read all 400
    # a shard's c windows read c x seq_len + 1 tokens: 100-token shards with seq_len 89 leave 10%
    # unread, not 11% (the warning is for more than a tenth)
    for i in range(3):
        np.save(d / f"train_{i:05d}.npy", np.arange(100, dtype=np.uint16))
    (d / "meta.json").write_text(json.dumps({"vocab_size": 400, "dtype": "uint16", "splits": {"train": {
        "shards": [dict(s, tokens=100) for s in shards]}}}))
    assert TokenWindows(d, "train", 89).unused_warning("train") is None
    assert TokenWindows(d, "train", 88).unused_warning("train").startswith("warning: 11% of the train split")


def test_a_dataset_pickles_without_its_shards(stdlib_data):
    """A DataLoader worker started by spawn or forkserver receives the dataset pickled: memmaps
    pickle as a copy of all their data (the whole split, per worker, per epoch); the shards are
    mapped again in the worker instead."""
    import pickle
    ds = TokenWindows(stdlib_data, "train", 64)
    ds[0], ds[len(ds) - 1]  # maps in the cache are left out too
    blob = pickle.dumps(ds)
    assert len(blob) < 20_000 < sum(ds.lengths) * ds.dtype.itemsize
    back = pickle.loads(blob)
    for i in (0, len(ds) // 2, len(ds) - 1):
        assert all(torch.equal(a, b) for a, b in zip(back[i], ds[i]))
    stream = DataStream(ds, batch_size=4, num_replicas=1, rank=0, seed=0, num_workers=1)
    stream.loader_kwargs["multiprocessing_context"] = "spawn"
    x, y = next(stream)
    stream.close()
    assert torch.equal(x[:, 1:], y[:, :-1])


@pytest.mark.parametrize("want, distributed, gpus, error", [
    ("cuda", (2, 1), 2, None),                                       # LOCAL_RANK 1's GPU
    ("cuda", (4, 3), 2, "has 2 GPU(s), and torchrun started this process as LOCAL_RANK 3"),
    ("cuda:0", (2, 1), 2, "under torchrun with 2 processes would put them all on one GPU"),
    ("cuda:1", None, 2, None),
    ("cuda:5", None, 2, "has 2 GPU(s), no cuda:5"),
])
def test_gpu_choice_under_torchrun(monkeypatch, want, distributed, gpus, error):
    """train.py's device on a (simulated) GPU machine: an explicit cuda:N under torchrun put every
    process on that GPU (NCCL failed with a traceback); more processes or a higher index than the
    machine's GPUs failed deep in torch.cuda.set_device. Now one line each, naming the key."""
    from training.backend import TorchBackend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    b = TorchBackend.__new__(TorchBackend)  # the device choice alone: no process group, no GPU
    b.distributed = distributed is not None
    b.world_size, b.local_rank = distributed or (1, 0)
    if error is None:
        dev = b._pick_device(want)
        assert dev.type == "cuda" and dev.index == (b.local_rank if want == "cuda" else int(want[5:]))
    else:
        with pytest.raises(ValueError, match=re.escape(error)) as e:
            b._pick_device(want)
        assert str(e.value).startswith(f"training.device={want!r}")


@pytest.mark.parametrize("env, error", [
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' in the environment: expected a whole number >= 0"),
    ({"RANK": "0", "WORLD_SIZE": "-2"}, "WORLD_SIZE='-2' in the environment"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "one"}, "LOCAL_RANK='one' in the environment"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2, WORLD_SIZE=2 in the environment: a rank is one of"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "RANK=0, WORLD_SIZE=0 in the environment"),
])
def test_a_launcher_environment_that_names_no_process_is_one_line_naming_the_variable(monkeypatch, env, error):
    """RANK, WORLD_SIZE and LOCAL_RANK from a launcher other than torchrun (srun, mpirun, a script):
    a value that is not a process of the job was int()'s message without the variable's name, or
    (a rank past the world size) a process group that waited for a process that never comes."""
    from training.backend import TorchBackend

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=re.escape(error)):
        TorchBackend("cpu")


def test_a_device_a_launcher_cannot_place_is_one_line(monkeypatch):
    """Several processes on a GPU machine whose launcher set no LOCAL_RANK (torchrun sets it; srun
    does not) all took GPU 0; several on MPS, whose tensors gloo cannot carry, failed deep in DDP."""
    from training.backend import TorchBackend, launch_env

    for key, value in {"RANK": "1", "WORLD_SIZE": "8", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert launch_env() == (1, 8, None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    b = TorchBackend.__new__(TorchBackend)  # the device choice alone: no process group, no GPU
    b.distributed, (_, b.world_size, b.local_rank) = True, launch_env()
    with pytest.raises(ValueError, match="set RANK and WORLD_SIZE but not LOCAL_RANK"):
        b._pick_device("cuda")
    assert b._pick_device("cpu").type == "cpu"
    with pytest.raises(ValueError, match="gloo carries no MPS tensors"):
        b._pick_device("mps")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    assert launch_env() == (0, 1, 0)   # one process: GPU 0 (or training.device's)


def test_a_rendezvous_that_fails_is_one_line_naming_the_address(tmp_path, stdlib_data):
    """train.py as rank 0 of 2 whose MASTER_PORT another program holds: torch's DistNetworkError
    was a traceback; now one line with the address, exit 2."""
    import socket

    from helpers import ENV, ROOT, tiny_config
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        env = {**ENV, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port)}
        r = subprocess.run([sys.executable, "train.py", str(tiny_config(tmp_path, stdlib_data)),
                            "training.dist_timeout_s=30"], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    line, = [ln for ln in r.stderr.splitlines() if "error" in ln]
    assert line.startswith(f"train.py: error: the processes could not form their group (MASTER_ADDR=127.0.0.1, "
                           f"MASTER_PORT={port}): "), line


# -- optimisers ------------------------------------------------------------------------------

def _params(seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(6, 5, generator=g) * scale),
            torch.nn.Parameter(torch.randn(5, generator=g) * scale)]


def _grads(ps, step, scale=1.0):
    g = torch.Generator().manual_seed(100 + step)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g) * scale


OURS = {  # this project's optimisers, on _params: AdamW, and Muon on the matrix (AdamW for the vector)
    "adamw": lambda ps: AdamW(ps, lr=1e-2, weight_decay=0.1),
    "muon": lambda ps: Muon([{"params": ps[:1], "use_muon": True}, {"params": ps[1:], "use_muon": False}],
                            lr=1e-2, weight_decay=0.1),
    "muon_fused": lambda ps: Muon([{"params": ps[:1], "use_muon": True}, {"params": ps[1:], "use_muon": False}],
                                  lr=1e-2, weight_decay=0.1, fused=True),
}


def test_loaded_step_follows_this_runs_fused_flag():
    """A checkpoint of training.optim.AdamW (train_xla.py, MPS; its groups say fused=None) loaded
    into this run's torch AdamW(fused=True): ``load_state_dict`` leaves ``step`` on the CPU by the
    saved flag, where the fused kernel on a GPU refuses it; ``keep_hyperparameters`` puts it on the
    parameter's device (here ``meta`` stands for the GPU), fp32, as torch's rule does for fused."""
    from training.checkpoint import keep_hyperparameters

    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 0.5)
    saved = AdamW([p], lr=1e-3)
    saved.step()
    state = saved.state_dict()
    assert state["param_groups"][0]["fused"] is None and state["state"][0]["step"].device.type == "cpu"
    q = torch.nn.Parameter(torch.ones(3, device="meta"))
    mine = torch.optim.AdamW([q], lr=1e-3)
    mine.param_groups[0]["fused"] = True     # this run's flag (the fused kernel has no meta device)
    with keep_hyperparameters(mine):
        mine.load_state_dict(state)
    step = mine.state[q]["step"]
    assert mine.param_groups[0]["fused"] is True
    assert step.device.type == "meta" and step.dtype == torch.float32
    assert mine.state[q]["exp_avg"].device.type == "meta"


def test_adamw_matches_torch_and_shares_its_state_layout():
    a, b = _params(), _params()
    ours = AdamW([{"params": a[:1], "weight_decay": 0.1}, {"params": a[1:], "weight_decay": 0.0}],
                 lr=1e-2, betas=(0.9, 0.95))
    ref = torch.optim.AdamW([{"params": b[:1], "weight_decay": 0.1}, {"params": b[1:], "weight_decay": 0.0}],
                            lr=1e-2, betas=(0.9, 0.95), fused=True)
    for step in range(5):
        _grads(a, step), _grads(b, step)
        ours.step(), ref.step()
    for p, q in zip(a, b):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    # state dicts load across implementations and continue identically
    ours2 = AdamW([{"params": b[:1], "weight_decay": 0.1}, {"params": b[1:], "weight_decay": 0.0}],
                  lr=1e-2, betas=(0.9, 0.95))
    ours2.load_state_dict(ref.state_dict())
    _grads(a, 9), _grads(b, 9)
    ours.step(), ours2.step()
    for p, q in zip(a, b):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def _a_skipped_step(opt, ps) -> None:
    """A step with found_inf set (NaN gradients under a GradScaler), then the flag cleared."""
    for p in ps:
        p.grad = torch.full_like(p, float("nan"))
    opt.found_inf = torch.ones(())
    opt.step()
    opt.found_inf = torch.zeros(())


@pytest.mark.parametrize("make", [*OURS.values(),
                                  lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True)])
def test_found_inf_skips_the_update_and_the_state(make):
    """A step with found_inf set (inf/NaN gradients under a GradScaler) leaves every parameter and
    every parameter's state (moments, momentum buffers, step counts) bitwise as it was."""
    ps = _params()
    opt = make(ps)
    _grads(ps, 0)
    opt.step()
    before = [p.detach().clone() for p in ps]

    def state():  # keyed by (parameter, name): every parameter's state, not one per name
        return {(i, k): v.clone() for i, p in enumerate(ps) for k, v in opt.state[p].items() if torch.is_tensor(v)}

    state_before = state()
    assert {i for i, _ in state_before} == set(range(len(ps)))
    _a_skipped_step(opt, ps)
    for p, q in zip(ps, before):
        assert torch.equal(p, q)
    state_after = state()
    assert state_after.keys() == state_before.keys()
    for k, v in state_before.items():
        assert torch.equal(state_after[k], v), k
    _grads(ps, 1)
    opt.step()
    assert all(torch.isfinite(p).all() for p in ps) and not torch.equal(ps[0], before[0])


@pytest.mark.parametrize("seconds, interval", [
    (12.0, 1), (1.0, 1), (0.3, 3), (0.05, 10), (0.001, 10), (0.0, 1), (float("nan"), 1), (float("inf"), 1),
])
def test_stop_decisions_come_about_once_a_second(seconds, interval):
    """Processes that do not decide after every step (train_xla.py, several processes) decide
    every ~1 s of steps, at least every step and at most every log interval (here 10)."""
    from training.loop import decision_interval
    assert decision_interval(seconds, 10) == interval



def test_tensor_parallel_pairs_and_zero_state_specs():
    """SPMD's partition specs (training/sharding.py), as Megatron-LM and torch's ColwiseParallel /
    RowwiseParallel split a Linear's weight [out, in]: q, k, v and the FFN's w1, w3 by output
    features (dim 0) over tp, their consumers wo and w2 by input features (dim 1), so each pair
    needs one reduction and no gather between; fsdp takes the other dimension. Other matrices are
    fsdp only, vectors replicated. The ZeRO-2 state splits the fsdp dimension fsdp-major."""
    import torch

    from training.sharding import param_partition_spec, state_partition_spec
    w, v = torch.empty(8, 8), torch.empty(8)
    for name in ("attn.wq", "attn.wk", "attn.wv", "ffn.w1", "ffn.w3"):
        assert param_partition_spec(f"blocks.3.{name}.weight", w) == ("tp", "fsdp"), name
    for name in ("attn.wo", "ffn.w2"):
        assert param_partition_spec(f"blocks.3.{name}.weight", w) == ("fsdp", "tp"), name
    for name in ("tok_emb.weight", "blocks.3.hc_attn.phi.weight", "lm_head.weight"):
        assert param_partition_spec(name, w) == ("fsdp", None), name
    assert param_partition_spec("blocks.3.attn_norm.weight", v) is None
    assert state_partition_spec(("tp", "fsdp"), True) == ("tp", ("fsdp", "data"))
    assert state_partition_spec(("fsdp", None), True) == (("fsdp", "data"), None)
    assert state_partition_spec(("tp", "fsdp"), False) == ("tp", "fsdp") and state_partition_spec(None, True) is None


def test_activation_specs_follow_the_batch_and_each_weights_tp_split():
    """SPMD activations (training/sharding.py): the batch over data x fsdp, as the loader splits
    it; the features over tp exactly where the Linear's weight puts them: out of a projection
    whose output features (weight dim 0) are split over tp, into one whose input features (dim 1)
    are. Whole everywhere else, or every tp device would compute every head's numbers."""
    import torch

    from training.sharding import activation_partition_spec, param_partition_spec
    w = torch.empty(8, 8)
    batch = ("data", "fsdp")
    for module in ("wq", "wk", "wv", "wo", "w1", "w2", "w3", "phi", "lm_head", "pool"):
        out_tp, in_tp = (param_partition_spec(f"blocks.0.attn.{module}.weight", w)[i] == "tp" for i in (0, 1))
        assert activation_partition_spec(module, 3, output=True) == (batch, None, "tp" if out_tp else None), module
        assert activation_partition_spec(module, 3, output=False) == (batch, None, "tp" if in_tp else None), module
    assert activation_partition_spec("", 4, output=False) == (batch, None, None, None)   # a block's streams
    assert activation_partition_spec("tok_emb", 3, output=True) == (batch, None, None)
    assert activation_partition_spec("wq", 1, output=False) == (None,)   # no batch dimension: whole


def test_processes_agree_on_the_step_of_the_next_stop_decision(monkeypatch):
    """should_stop's one all-reduce also agrees on when to decide next: the slowest process's
    interval. This process steps fast (~10 ms a step: every 10 steps, its log interval) and
    another slowly (every 3): both decide again 3 steps on, or the next collective would be a
    decision on one process and a training step on the other."""
    from types import SimpleNamespace

    import training.loop as loop
    from training.loop import RunState, Trainer

    monkeypatch.setattr(loop, "time", SimpleNamespace(time=lambda: 1000.0))   # the loop's clock: 10 steps in 0.1 s

    class TwoProcesses:   # max_across: the element-wise max of this process's values and the other's
        def max_across(self, *values):
            other = (False, False, -3, False, False)   # nothing to stop for; decide in 3 steps
            assert len(values) == len(other)
            return tuple(max(a, b) for a, b in zip(values, other))

    trainer = SimpleNamespace(
        state=RunState(step=20), last_decision=(999.9, 10), backend=TwoProcesses(),
        cfg=SimpleNamespace(logging=SimpleNamespace(interval=10)), stop_nonfinite=False, data_error=None,
        checkpointer=SimpleNamespace(failed=lambda: False))
    assert Trainer.should_stop(trainer) is None
    assert trainer.next_decision == 23 and trainer.last_decision[1] == 20

def test_muon_adamw_groups_match_torch_adamw():
    """Muon's AdamW groups, fused (the CPU/CUDA backends' choice) or in tensor ops, against
    torch.optim.AdamW on the same parameters; its Muon group is left out of the comparison."""
    def run(make):
        ps = _params() + [torch.nn.Parameter(torch.randn(7, generator=torch.Generator().manual_seed(5)))]
        opt = make(ps)
        for step in range(5):
            _grads(ps, step)
            opt.step()
        return ps[1:]

    ref = run(lambda ps: torch.optim.AdamW([{"params": ps[1:2], "weight_decay": 0.1}, {"params": ps[2:]}],
                                           lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0, fused=True))
    for fused in (True, False):
        got = run(lambda ps: Muon([{"params": ps[:1], "use_muon": True},
                                   {"params": ps[1:2], "weight_decay": 0.1}, {"params": ps[2:]}],
                                  lr=1e-2, betas=(0.9, 0.95), fused=fused))
        for p, q in zip(got, ref):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def _malloc_probe(*args, preload=None) -> str:
    """The last line a probe script prints, run in a process of its own (glibc's settings are
    process-wide), one thread, with no allocator settings from this environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", "LD_PRELOAD")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **({"LD_PRELOAD": preload} if preload else {}))
    r = subprocess.run([sys.executable, "-c", *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.strip().splitlines()[-1]


@pytest.mark.skipif(__import__("platform").libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_cpu_malloc_tuned_keeps_a_steps_freed_activations_in_the_heap():
    """training.cpu_malloc: a step's activations (here 40 of 4 MiB), freed together, go back to the
    kernel with glibc's defaults and are faulted in again at the next step; tuned, the process keeps
    them and the next step reuses them. Read from the kernel's resident set (its anonymous part: code
    pages the process faults in meanwhile are not the heap's), not from our code; a margin of 40 MiB
    for the rest of the process (a CI run of the whole resident set read 24 MiB)."""
    script = (
        "import sys, torch\n"
        "from training.backend import TorchBackend\n"
        "def rss():\n"
        "    return next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('RssAnon:')) >> 10\n"
        "b = TorchBackend('cpu', cpu_malloc=sys.argv[1])\n"
        "torch.ones(1)\n"
        "rises = []\n"
        "for step in range(2):\n"
        "    before = rss()\n"
        "    xs = [torch.ones(1 << 20) for _ in range(40)]\n"
        "    rises.append(rss() - before)\n"
        "    del xs\n"
        "print(b.device_name(), *rises, sep='|')\n")
    tuned = _malloc_probe(script, "tuned").split("|")
    default = _malloc_probe(script, "default").split("|")
    assert tuned[0] == "cpu (glibc malloc keeps freed memory)" and default[0] == "cpu", (tuned, default)
    assert int(tuned[1]) >= 150 and int(default[1]) >= 150, (tuned, default)   # the first step: 160 MiB
    assert int(tuned[2]) < 40 and int(default[2]) >= 120, (tuned, default)     # the second: kept, or again


@pytest.mark.skipif(__import__("platform").libc_ver()[0] != "glibc" or not __import__("shutil").which("gcc"),
                    reason="glibc, and gcc to build a preloaded malloc")
def test_cpu_malloc_leaves_a_preloaded_allocator_alone(tmp_path):
    """With another malloc preloaded (jemalloc, tcmalloc: what PyTorch's CPU guide recommends),
    glibc's mallopt still succeeds, on a heap no one uses: the backend must not claim it tuned."""
    (tmp_path / "m.c").write_text("#include <stddef.h>\nextern void *__libc_malloc(size_t);\n"
                                  "void *malloc(size_t n) { return __libc_malloc(n); }\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(tmp_path / "m.so"), str(tmp_path / "m.c")], check=True)
    script = "from training.backend import TorchBackend; print(TorchBackend('cpu', cpu_malloc='tuned').device_name())"
    assert _malloc_probe(script) == "cpu (glibc malloc keeps freed memory)"
    assert _malloc_probe(script, preload=str(tmp_path / "m.so")) == "cpu"


def test_cpu_malloc_is_checked_and_a_missing_libc_is_no_tuning(monkeypatch):
    import ctypes

    from training import backend as B

    with pytest.raises(ValueError, match=re.escape("training.cpu_malloc='tunned': expected tuned or default")):
        B.TorchBackend("cpu", cpu_malloc="tunned")

    def no_libc(name, *a, **k):
        raise OSError(f"{name}: cannot open shared object file")
    monkeypatch.setattr(ctypes, "CDLL", no_libc)
    assert B.keep_freed_memory() is False
    assert B.TorchBackend("cpu", cpu_malloc="tuned").device_name() == "cpu"


def test_cpu_backend_builds_muon_on_the_fused_kernel():
    from training.backend import TorchBackend
    cfg = load_config(None, ["training.optimizer=muon", "training.max_steps=1"])
    opt = build_optimizer(torch.nn.Linear(4, 3), cfg.training, TorchBackend("cpu").adamw_factory())
    assert isinstance(opt, Muon) and opt.fused


def test_muon_update_is_orthogonalised():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.zeros(16, 8))
    opt = Muon([{"params": [p], "use_muon": True}], lr=1.0, momentum=0.0)
    p.grad = torch.randn(16, 8)
    opt.step()
    sv = torch.linalg.svdvals(-p.detach() / math.sqrt(16 / 8))
    assert sv.min() > 0.5 and sv.max() < 1.5  # Newton-Schulz pushes singular values towards 1


def test_muon_is_torch_muon_and_batches_matrices_of_one_shape(monkeypatch):
    """Our Muon against torch.optim.Muon, with torch's loop around our fp32 Newton-Schulz: the same
    momentum, Nesterov step, shape scaling and weight decay over 4 steps, for matrices of shared
    shapes (orthogonalised as one batch here) and of their own; and our Newton-Schulz against
    torch's, which runs in bf16 (so to bf16's precision: a few parts in 100 after 5 iterations)."""
    import torch.optim._muon as torch_muon

    from training.optim import newton_schulz

    torch.manual_seed(0)
    shapes = [(16, 8), (8, 24), (16, 8), (12, 12), (16, 8), (8, 24)]
    ours_p = [torch.nn.Parameter(torch.randn(s) * 0.1) for s in shapes]
    ref_p = [torch.nn.Parameter(p.detach().clone()) for p in ours_p]
    ours = Muon([{"params": ours_p, "use_muon": True, "weight_decay": 0.1}], lr=0.02, momentum=0.9)
    ref = torch.optim.Muon(ref_p, lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=True)
    g = torch.randn(24, 8)
    o_torch = torch_muon._zeropower_via_newtonschulz(g, (3.4445, -4.7750, 2.0315), 5, 1e-7).float()
    assert (newton_schulz(g) - o_torch).norm() / o_torch.norm() < 0.03
    monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz", lambda x, coef, steps, eps: newton_schulz(x, steps))
    for _ in range(4):
        for p, q in zip(ours_p, ref_p):
            p.grad = torch.randn(p.shape)
            q.grad = p.grad.clone()
        ours.step()
        ref.step()
        for p, q in zip(ours_p, ref_p):
            torch.testing.assert_close(ours.state[p]["momentum_buffer"], ref.state[q]["momentum_buffer"],
                                       rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    batch = torch.randn(5, 16, 8)
    assert all(torch.allclose(newton_schulz(batch)[i], newton_schulz(batch[i]), rtol=1e-5, atol=1e-6)
               for i in range(5))


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
@pytest.mark.parametrize("tied", [True, False])
def test_param_groups_exclude_norms_embeddings_and_gates(optimizer, tied):
    """The embedding and the LM head (one matrix when tied; two when not, as in the 3B config)
    are neither decayed nor given Muon's orthogonalised update, like norms and gates."""
    from model import ModelConfig, NashMHC
    m = NashMHC(ModelConfig(tie_embeddings=tied))
    cfg = load_config(None, ["training.max_steps=1", f"training.optimizer={optimizer}"]).training
    opt = build_optimizer(m, cfg)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] > 0 and no_decay["weight_decay"] == 0
    assert all(p.ndim == 2 for p in decay["params"])
    for vocabulary in (m.tok_emb.weight, m.lm_head.weight):
        assert any(p is vocabulary for p in no_decay["params"])
        assert not any(p is vocabulary for p in decay["params"])
    n_all = len({id(p) for p in m.parameters()})
    assert len(decay["params"]) + len(no_decay["params"]) == n_all
    set_lr(opt, 0.5)
    if optimizer == "adamw":
        assert decay["lr"] == pytest.approx(cfg.learning_rate * 0.5)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_the_configured_optimiser_settings_reach_every_group(optimizer):
    """training.betas, eps, weight_decay, the learning rates and Muon's momentum, set to values
    that are no default (the optimiser's or the config's), are the ones each group steps with;
    Muon's AdamW group (embeddings, norms, gates) is not decayed."""
    from model import ModelConfig, NashMHC
    over = ["training.max_steps=1", f"training.optimizer={optimizer}", "training.betas=[0.8, 0.9]",
            "training.eps=1e-7", "training.weight_decay=0.3", "training.learning_rate=0.004",
            "training.muon_lr=0.03", "training.muon_momentum=0.7"]
    cfg = load_config(None, over).training
    opt = build_optimizer(NashMHC(ModelConfig(n_layers=1)), cfg)
    matrices, others = opt.param_groups
    assert len(matrices["params"]) > 0 and len(others["params"]) > 0
    assert (matrices["weight_decay"], others["weight_decay"]) == (0.3, 0.0)
    for g in opt.param_groups:
        assert (tuple(g["betas"]), g["eps"]) == ((0.8, 0.9), 1e-7)
    if optimizer == "muon":
        assert matrices["use_muon"] and not others["use_muon"]
        assert (matrices["lr"], others["lr"], matrices["momentum"]) == (0.03, 0.004, 0.7)
    else:
        assert matrices["lr"] == others["lr"] == 0.004


def test_past_vocabulary_sees_every_token_of_a_batch():
    """y is x shifted by one, so y and x's first column hold every token of a batch: an id past
    the vocabulary anywhere, the very first token included, is seen (missed, it reached the
    embedding as an index error instead of the one-line refusal)."""
    from training.data import past_vocabulary
    x = torch.arange(12).view(3, 4) % 10
    y = torch.cat([x[:, 1:], torch.full((3, 1), 5)], dim=1)
    assert not past_vocabulary((x, y), 10) and not past_vocabulary((x, y), None)
    for where in ((0, 0), (2, 0)):                # only in x: a sequence's first token
        bad = x.clone()
        bad[where] = 10
        assert past_vocabulary((bad, y), 10), where
    bad = y.clone()
    bad[1, 3] = 11
    assert past_vocabulary((x, bad), 10)


@pytest.mark.parametrize("n, batch, steps, replicas, expected", [
    (100, 3, 4, 2, 4),     # evaluation.steps batches
    (100, 5, 50, 2, 10),   # no more than the split holds (100 // (5 x 2))
    (7, 2, 3, 1, 3),
])
def test_eval_batches_are_the_first_global_batches_in_file_order(n, batch, steps, replicas, expected):
    """evaluation.steps global batches (or all the split holds), the first ones in file order, each
    replica its strided share: together exactly samples 0 .. expected x batch x replicas - 1."""
    from training.data import eval_batches
    ds, seen = Range(n), []
    for rank in range(replicas):
        got = [x.flatten().tolist() for x, _ in eval_batches(ds, batch, steps, replicas, rank)]
        assert len(got) == expected and all(len(b) == batch for b in got)
        ids = [i for b in got for i in b]
        assert ids == sorted(ids) and all(i % replicas == rank for i in ids)
        seen += ids
    assert sorted(seen) == list(range(expected * batch * replicas))


# Found unpinned by mutation testing of optim.py: each test below failed on a mutant the rest let pass.

# lr_at

@pytest.mark.parametrize("schedule", ["cosine", "wsd"])
def test_schedule_stays_at_its_floor_past_the_last_step(schedule):
    """Defensive: read past max_steps - 1 the rate stays at min_lr_ratio x peak (the cosine does
    not climb back up)."""
    floor = lr_at(99, 100, 1.0, 10, 0.1, schedule)
    assert floor == pytest.approx(0.1)
    for s in (99.5, 100, 120, 150, 199):
        assert lr_at(s, 100, 1.0, 10, 0.1, schedule) == pytest.approx(floor), s


# split_params

def test_frozen_parameters_are_in_no_group():
    """split_params takes trainable parameters only."""
    m = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    m[1].weight.requires_grad_(False)
    m[2].bias.requires_grad_(False)
    matrices, embeds, vectors = split_params(m)
    got = {id(p) for p in matrices + embeds + vectors}
    assert got == {id(p) for p in m.parameters() if p.requires_grad}
    assert [id(p) for p in matrices] == [id(m[2].weight)]
    assert [id(p) for p in vectors] == [id(m[1].bias)]


# AdamW

def test_adamw_matches_torch_where_eps_matters():
    """Gradients ~1e-6: eps (1e-8) is added to sqrt(v_hat), as torch does, not inside the root."""
    a, b = _params(), _params()
    ours = AdamW(a, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ref = torch.optim.AdamW(b, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)
    for step in range(4):
        _grads(a, step, 1e-6), _grads(b, step, 1e-6)
        ours.step(), ref.step()
    for p, q in zip(a, b):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("make", list(OURS))
def test_found_inf_on_the_very_first_step_is_a_no_op(make):
    """An overflow at step 1 (GradScaler's first steps): nothing moves, nothing becomes NaN, and
    the next step is Adam's first step (bias correction from t=1)."""
    ps, ref = _params(), _params()
    opt = OURS[make](ps)
    _a_skipped_step(opt, ps)
    for p, q in zip(ps, ref):
        assert torch.equal(p, q)
    _grads(ps, 0)
    opt.step()
    assert all(torch.isfinite(p).all() for p in ps)
    ref_opt = OURS[make](ref)
    _grads(ref, 0)
    ref_opt.step()
    for p, q in zip(ps, ref):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("make", list(OURS))
def test_parameters_without_gradients_are_left_alone(make):
    """A parameter that got no gradient (unused this step) is skipped, not a crash; the others step
    as without it."""
    ps = _params() + [torch.nn.Parameter(torch.ones(4, 3)), torch.nn.Parameter(torch.ones(3))]
    ref = _params()
    groups = lambda ps: [ps[0], ps[1]] if len(ps) == 2 else [ps[0], ps[2], ps[1], ps[3]]  # noqa: E731
    if make == "adamw":
        opt = AdamW(groups(ps), lr=1e-2, weight_decay=0.1)
    else:
        opt = Muon([{"params": [ps[0], ps[2]], "use_muon": True}, {"params": [ps[1], ps[3]], "use_muon": False}],
                   lr=1e-2, weight_decay=0.1, fused=make == "muon_fused")
    ref_opt = OURS[make](ref)
    for step in range(2):
        _grads(ps[:2], step), _grads(ref, step)
        opt.step(), ref_opt.step()
    assert torch.equal(ps[2], torch.ones(4, 3)) and torch.equal(ps[3], torch.ones(3))
    for p, q in zip(ps[:2], ref):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_a_cpu_step_count_moves_to_the_parameters_device():
    """A checkpoint's step (kept on the CPU by load_state_dict) goes to the parameter's device
    (meta standing in for a GPU), fp32, when the state is used."""
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 0.5)
    saved = AdamW([p], lr=1e-3)
    saved.step()
    q = torch.nn.Parameter(torch.ones(3, device="meta"))
    mine = AdamW([q], lr=1e-3)
    mine.load_state_dict(saved.state_dict())
    assert mine.state[q]["step"].device.type == "cpu"
    mine.init_state()
    assert mine.state[q]["step"].device.type == "meta" and mine.state[q]["step"].dtype == torch.float32


# spread over DDP replicas

@pytest.mark.parametrize("count,world", [(4, 2), (6, 3), (3, 2), (5, 4), (1, 2)])
def test_each_replica_orthogonalises_an_even_share(monkeypatch, count, world):
    """Simulated ranks: each computes at most ceil(count / world) matrices, the shares tile the
    stack without overlap, and the gathered result is newton_schulz of the stack."""
    import torch.distributed as dist

    import training.optim as optim
    torch.manual_seed(0)
    m = torch.randn(count, 6, 4)
    want = newton_schulz(m)
    computed, sent = {}, {}
    real_ns = optim.newton_schulz
    for rank in range(world):
        monkeypatch.setattr(dist, "get_world_size", lambda group: world)
        monkeypatch.setattr(dist, "get_rank", lambda group, r=rank: r)
        monkeypatch.setattr(optim, "newton_schulz",
                            lambda x, steps, r=rank: computed.setdefault(r, x.clone()) is not None and real_ns(x, steps))
        monkeypatch.setattr(dist, "all_gather_into_tensor",
                            lambda out, mine, group, r=rank: sent.setdefault(r, mine.clone()))
        _orthogonalised_by_share(m, 5, None)
    share = -(-count // world)
    assert all(x.shape[0] <= share for x in computed.values()), {r: x.shape[0] for r, x in computed.items()}
    assert sum(x.shape[0] for x in computed.values()) == count
    assert torch.equal(torch.cat([computed[r] for r in range(world) if r in computed]), m)
    assert len({x.shape for x in sent.values()}) == 1
    gathered = torch.cat([sent[r] for r in range(world)])[:count]
    torch.testing.assert_close(gathered, want, rtol=1e-6, atol=1e-7)


# build_optimizer / set_lr

@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_set_lr_scales_every_group_from_its_own_peak(optimizer):
    """Muon's matrices from muon_lr, its AdamW group from learning_rate, each x the factor."""
    cfg = load_config(None, ["training.max_steps=1", f"training.optimizer={optimizer}",
                             "training.learning_rate=0.004", "training.muon_lr=0.03"]).training
    opt = build_optimizer(torch.nn.Linear(4, 3), cfg)
    peaks = (0.03, 0.004) if optimizer == "muon" else (0.004, 0.004)
    assert tuple(g["lr"] for g in opt.param_groups) == peaks
    for factor in (0.5, 0.1):
        set_lr(opt, factor)
        for g, peak in zip(opt.param_groups, peaks):
            assert g["lr"] == pytest.approx(peak * factor)


def test_set_lr_of_zero_is_a_tiny_distinct_nonzero_rate():
    """factor 0 is set as 1e-30 x each peak: nonzero, and the groups' rates still distinct."""
    cfg = load_config(None, ["training.max_steps=1", "training.optimizer=muon",
                             "training.learning_rate=0.004", "training.muon_lr=0.03"]).training
    opt = build_optimizer(torch.nn.Linear(4, 3), cfg)
    set_lr(opt, 0.0)
    lrs = [g["lr"] for g in opt.param_groups]
    assert all(0 < lr < 1e-28 for lr in lrs) and lrs[0] != lrs[1]
    assert lrs == pytest.approx([0.03e-30, 0.004e-30])


def test_set_lr_fills_a_tensor_rate_in_place():
    """A group whose lr is a tensor (a compiled/XLA graph input) keeps that tensor."""
    p = torch.nn.Parameter(torch.ones(3, 2))
    opt = AdamW([p], lr=1e-3)
    lr = torch.tensor(2e-3)
    opt.param_groups[0]["lr"] = lr
    opt.param_groups[0]["base_lr"] = 2e-3
    set_lr(opt, 0.25)
    assert opt.param_groups[0]["lr"] is lr
    assert lr.item() == pytest.approx(5e-4)
    assert not math.isnan(lr.item())


# -- checkpoints -----------------------------------------------------------------------------

def _ckpt(step):
    return {"format_version": FORMAT_VERSION, "model": {"w": torch.full((2,), float(step))}, "step": step}


def test_rotation_keeps_the_newest(tmp_path):
    for s in (10, 20, 30, 40):
        atomic_torch_save(_ckpt(s), checkpoint_path(tmp_path, s))
        rotate(tmp_path, keep=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [30, 40]
    assert not list(tmp_path.glob(".*tmp*"))


def test_rotation_keeps_milestones_besides_the_newest(tmp_path):
    """checkpoint.keep_every: a checkpoint at a multiple of it is never rotated away and is not
    one of the ``keep`` newest; the others rotate as before."""
    for s in (10, 20, 30, 40, 50, 60, 70):
        atomic_torch_save(_ckpt(s), checkpoint_path(tmp_path, s))
        rotate(tmp_path, keep=2, keep_every=30)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [30, 50, 60, 70]  # 50 and 70: the two newest
    atomic_torch_save(_ckpt(80), checkpoint_path(tmp_path, 80))
    assert rotate(tmp_path, keep=2, keep_every=30) == [checkpoint_path(tmp_path, 50)]
    assert rotate(tmp_path, keep=1, keep_every=0) == [checkpoint_path(tmp_path, s) for s in (30, 60, 70)]


def test_rotation_removes_a_linked_checkpoint_not_what_it_points_to(tmp_path):
    """A checkpoint of another run linked into this run's directory (to resume from it) is rotated
    away as a link: the other run's checkpoint keeps its files and its commit marker (through
    the link, rotation deleted that marker, and the other run's next start deleted the rest as
    an unfinished save)."""
    from training.checkpoint import MARKER
    other, run = tmp_path / "other", tmp_path / "run"
    theirs = other / "ckpt_00000010"
    theirs.mkdir(parents=True)
    (theirs / MARKER).write_text("{}")
    (theirs / "__0_0.distcp").write_bytes(b"shard")
    run.mkdir()
    (run / "ckpt_00000010").symlink_to(theirs, target_is_directory=True)
    atomic_torch_save(_ckpt(20), checkpoint_path(run, 20))
    assert rotate(run, keep=1) == [run / "ckpt_00000010"]
    assert not (run / "ckpt_00000010").exists() and sorted(p.name for p in theirs.iterdir()) == ["__0_0.distcp", MARKER]


def test_a_checkpoint_rotation_cannot_delete_is_a_warning_and_the_rest_still_go(tmp_path, monkeypatch):
    """A bucket that takes new objects but refuses deletes: the save that committed stays good,
    the run goes on with a warning (each save had stopped the run as failed), and the other old
    checkpoints are still deleted."""
    for s in (10, 20, 30, 40):
        atomic_torch_save(_ckpt(s), checkpoint_path(tmp_path, s))
    stuck, unlink = checkpoint_path(tmp_path, 10), Path.unlink

    def refuse(self, missing_ok=False):
        if self == stuck:
            raise PermissionError(1, "Operation not permitted", str(self))
        return unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", refuse)
    said = []
    assert rotate(tmp_path, keep=1, warn=said.append) == [checkpoint_path(tmp_path, 20), checkpoint_path(tmp_path, 30)]
    assert [s for s, _ in list_checkpoints(tmp_path)] == [10, 40]
    assert len(said) == 1 and said[0].startswith(f"warning: cannot delete {stuck} (checkpoint.keep=1)")
    with pytest.raises(PermissionError):
        rotate(tmp_path, keep=1)


def test_corrupt_newest_falls_back_to_previous(tmp_path):
    atomic_torch_save(_ckpt(10), checkpoint_path(tmp_path, 10))
    atomic_torch_save(_ckpt(20), checkpoint_path(tmp_path, 20))
    p = checkpoint_path(tmp_path, 20)
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])  # truncated
    warnings = []
    path, ckpt = find_resume(tmp_path, warn=warnings.append)
    assert path == checkpoint_path(tmp_path, 10) and ckpt["step"] == 10
    assert len(warnings) == 1 and "ckpt_00000020.pt" in warnings[0]


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_checkpoint_with_pickled_code_is_refused(tmp_path):
    p = checkpoint_path(tmp_path, 1)
    torch.save({"format_version": 1, "model": {}, "payload": Evil()}, p)
    with pytest.raises(CheckpointError, match="not a loadable checkpoint"):
        load_checkpoint(p)


# -- logs: metrics.jsonl and TensorBoard across resumes and fresh starts -------------------------

def _monitor(run_dir, start_step, **over):
    from training.monitor import Monitor
    cfg = load_config(None, ["training.max_steps=6", "logging.progress_bar=false", "logging.tensorboard=true",
                             *(f"{k}={v}" for k, v in over.items())])
    return Monitor(cfg, run_dir, True, 6, start_step)


def test_without_a_progress_bar_each_log_step_is_a_line(tmp_path, capsys):
    """logging.progress_bar=false (batch jobs, nohup): every log step prints what the bar would
    show and the time left (there had been no line between evaluations)."""
    m = _monitor(tmp_path, 0)
    m.log(2, {"loss": 2.5, "lr": 1e-3, "tokens_per_sec": 12345.6, "step_time": 0.5, "mfu": 0.123})
    m.log(6, {"loss": 2.25, "lr": 5e-4})
    m.close()
    assert capsys.readouterr().err.splitlines() == [
        "step 2/6 | loss 2.5000 | lr 1.00e-03 | 12,346 tok/s | MFU 12.3% | 0:00:02 left",
        "step 6/6 | loss 2.2500 | lr 5.00e-04"]


def _tb_losses(tb_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars("loss")}


def test_resumed_logs_keep_the_checkpoint_step_and_redo_the_rest(tmp_path, monkeypatch):
    """A run logs steps 1-6 and dies; its checkpoint is at step 3. The resumed run logs 4-6 again:
    metrics.jsonl and TensorBoard (as its reader purges) hold 1-3 from the first run, 4-6 from the
    second, each step once."""
    # TensorBoard reads a directory's event files in name order: time (s), host, pid, then a
    # per-process writer count. Two writers of one process in one second sort by that count, as
    # text ("10" before "9"): counts of one width keep them in the order they were made
    from tensorboard.summary.writer import event_file_writer
    monkeypatch.setattr(event_file_writer, "_global_uid", event_file_writer.AtomicCounter(100))
    m = _monitor(tmp_path, 0)
    for step in range(1, 7):
        m.log(step, {"loss": float(step)})
    m.close()
    m = _monitor(tmp_path, 3)
    for step in range(4, 7):
        m.log(step, {"loss": 10.0 * step})
    m.close()
    want = {1: 1.0, 2: 2.0, 3: 3.0, 4: 40.0, 5: 50.0, 6: 60.0}
    assert {r["step"]: r["loss"] for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())} == want
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 6
    assert _tb_losses(tmp_path / "tb") == want


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full")
def test_a_full_disk_under_the_metrics_is_one_warning_and_the_run_goes_on(tmp_path, capsys):
    """Only the master writes metrics.jsonl and TensorBoard: an OSError there (here /dev/full:
    ENOSPC on every write) was a traceback on that process alone while the others waited for it
    in their next collective. Now one warning, then no more metrics files, and no error."""
    m = _monitor(tmp_path, 0, **{"logging.tensorboard": "false"})
    m.jsonl.close()
    m.jsonl = open("/dev/full", "a", buffering=1)
    for step in (1, 2):
        m.log(step, {"loss": 1.0})
    m.close()
    err = capsys.readouterr().err
    assert err.count("warning: writing the metrics under") == 1, err
    assert f"{tmp_path} failed (No space left on device); metrics.jsonl and TensorBoard are off" in err, err
    assert m.jsonl is None


def test_fresh_starts_set_old_logs_aside_under_names_never_reused(tmp_path, monkeypatch):
    """Three runs from step 0 in one directory within the same second: each earlier run's
    metrics.jsonl and tb/ are kept under a name of their own (none overwritten, none mixed)."""
    import training.monitor as mon
    monkeypatch.setattr(mon.time, "strftime", lambda fmt, *a: "20261124-120000")
    for run in range(3):
        m = _monitor(tmp_path, 0)
        m.log(1, {"loss": float(run)})
        m.close()
    asides = sorted(p.name for p in tmp_path.glob("metrics.*.jsonl"))
    assert asides == ["metrics.20261124-120000-2.jsonl", "metrics.20261124-120000.jsonl"]
    assert sorted(json.loads((tmp_path / a).read_text())["loss"] for a in asides) == [0.0, 1.0]
    assert sorted(p.name for p in tmp_path.glob("tb.*")) == ["tb.20261124-120000", "tb.20261124-120000-2"]
    assert _tb_losses(tmp_path / "tb") == {1: 2.0}


def test_a_resumed_run_logs_to_the_same_wandb_run(tmp_path, monkeypatch):
    """W&B's resume="allow" needs the run's id: the run directory keeps it. Resumed: the same run;
    from step 0: a new one."""
    import types
    fake, ids = types.ModuleType("wandb"), []

    def init(**kw):
        ids.append((kw["id"], kw["resume"]))
        return types.SimpleNamespace(log=lambda *a, **k: None, finish=lambda: None, define_metric=lambda *a, **k: None)
    fake.init = init
    monkeypatch.setitem(sys.modules, "wandb", fake)
    for start in (0, 3, 6, 0):
        _monitor(tmp_path, start, **{"logging.wandb.enabled": "true"}).close()
    assert ids[0] == ids[1] == ids[2] and ids[3][0] != ids[0][0] and {r for _, r in ids} == {"allow"}
    assert (tmp_path / "wandb_run_id").read_text().strip() == ids[3][0]


def test_a_wandb_that_cannot_start_is_a_warning_not_a_traceback(tmp_path, monkeypatch, capsys):
    import types
    fake = types.ModuleType("wandb")

    def init(**kw):
        raise RuntimeError("api_key not configured (no-tty). call wandb.login(key=[your_api_key])\nmore")
    fake.init = init
    monkeypatch.setitem(sys.modules, "wandb", fake)
    m = _monitor(tmp_path, 0, **{"logging.wandb.enabled": "true"})
    m.log(1, {"loss": 1.0})
    m.close()
    err = capsys.readouterr().err
    assert "warning: wandb.init failed (api_key not configured (no-tty). call wandb.login(key=[your_api_key]));" \
           " logging.wandb is off for this run" in err and "more" not in err
    assert m.wandb is None and len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 1


def test_a_wandb_or_tensorboard_failing_is_a_warning_and_the_run_logs_on(tmp_path, monkeypatch, capsys):
    """W&B's service dying mid-run (ConnectionResetError from log, and again from finish) ended the
    run with a traceback and no save; a tensorboard that fails to import with a TypeError (a
    protobuf mismatch) was a traceback at start. Each is one warning; metrics.jsonl goes on."""
    import types
    fake, calls = types.ModuleType("wandb"), []

    def log(*a, **k):
        calls.append(a)
        if len(calls) >= 2:
            raise ConnectionResetError("Connection lost")

    def finish(*a, **k):
        raise ConnectionResetError("Connection lost")
    defined = []
    fake.init = lambda **kw: types.SimpleNamespace(log=log, finish=finish,
                                                   define_metric=lambda *a, **k: defined.append((a, k)))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    board = types.ModuleType("torch.utils.tensorboard")

    def writer(*a, **k):
        raise TypeError("Descriptors cannot be created directly.\nIf this call came from a _pb2.py file")
    board.SummaryWriter = writer
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", board)
    m = _monitor(tmp_path, 0, **{"logging.wandb.enabled": "true", "logging.tensorboard": "true"})
    for step in (1, 2, 3):
        m.log(step, {"loss": 1.0})
    m.close()
    err = capsys.readouterr().err
    assert "warning: tensorboard cannot start (Descriptors cannot be created directly.); " \
           "logging.tensorboard ignored" in err
    assert err.count("warning: wandb failed (Connection lost); logging.wandb is off for the rest of this run") == 1
    assert len(calls) == 2 and m.wandb is None and m.tb is None
    # steps are a metric of their own (a resumed run's re-run steps were dropped by W&B's step)
    assert calls[0] == ({"loss": 1.0, "trainer/step": 1},) and defined == [
        (("trainer/step",), {}), (("*",), {"step_metric": "trainer/step"})]
    assert [json.loads(ln)["step"] for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


def test_a_lost_reader_silences_the_stream_and_a_full_disk_loses_one_line():
    """stdout/stderr once survive_a_lost_terminal wraps them: a write that finds the reader gone
    (EPIPE: the ssh session ended) sends everything after it to /dev/null, without raising; any
    other error (ENOSPC under `> train.log`) loses that write only."""
    import errno

    from training.monitor import _LostTerminalSafe

    class Stream:   # no descriptor, as under a test's capture: /dev/null is opened instead
        def __init__(self, fail):
            self.fail, self.got = fail, []

        def write(self, text):
            if self.fail:
                e, self.fail = self.fail, None
                raise OSError(e, os.strerror(e))
            self.got.append(text)
            return len(text)

        def flush(self):
            pass

        def fileno(self):
            raise OSError(errno.EBADF, "no descriptor")

    full, gone = Stream(errno.ENOSPC), Stream(errno.EPIPE)
    for stream in (full, gone):
        wrapped = _LostTerminalSafe(stream)
        assert wrapped.write("lost\n") == 5 and wrapped.write("next\n") == 5
        wrapped.flush()
    assert full.got == ["next\n"] and gone.got == []


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA L40", 181e12), ("NVIDIA L40S", 362e12), ("NVIDIA L4", 121e12),
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H100 NVL", 835e12),
    ("NVIDIA GH200 480GB", 989e12), ("NVIDIA A100-SXM4-80GB", 312e12), ("Tesla V100-SXM2-16GB", 15.7e12),
    ("Tesla V100S-PCIE-32GB", 16.4e12), ("Tesla T4", 8.1e12), ("NVIDIA A10", 125e12), ("NVIDIA A10G", 70e12),
    ("NVIDIA A100X", 312e12), ("NVIDIA H200", 989e12), ("NVIDIA H200 NVL", 835e12), ("NVIDIA H20", 148e12),
    ("NVIDIA B200", 2250e12), ("NVIDIA GB200", 2500e12), ("NVIDIA H800", 989e12), ("NVIDIA H800 PCIe", 756e12),
    ("Tesla V100-PCIE-32GB", 14e12),
    ("NVIDIA RTX A4000", None), ("AMD Instinct MI300X", None),
])
def test_gpu_peaks_match_whole_words_of_the_device_name(name, peak):
    """torch.cuda.get_device_name's strings: "L4" is not the L40's, the PCIe and NVL H100s are not
    the SXM part; unknown GPUs have no peak (MFU is left out, logging.peak_flops sets it)."""
    from training.monitor import peak_flops_for
    assert peak_flops_for(name) == peak


@pytest.mark.parametrize("name, bf16, fp32", [
    ("NVIDIA A100-SXM4-80GB", 312e12, 156e12), ("NVIDIA H100 80GB HBM3", 989e12, 494.5e12),
    ("NVIDIA L4", 121e12, 60.5e12), ("Tesla V100-SXM2-16GB", 15.7e12, 15.7e12),
    ("Tesla V100-PCIE-32GB", 14e12, 14e12), ("Tesla T4", 8.1e12, 8.1e12),
    ("TPU v4", 275e12, 275e12), ("TPU v5 lite", 197e12, 197e12), ("TPU v5", 459e12, 459e12),
    ("TPU v6 lite", 918e12, 918e12),
])
def test_peak_follows_the_training_precision(name, bf16, fp32):
    """MFU of an fp32 run is against the peak its matmuls run at: TF32 on Ampere and later GPUs
    (train.py enables it; half the bf16 peak, as NVIDIA's data sheets give it: A100 156 TFLOP/s),
    fp32 on V100/T4, and one bf16 pass on TPU (XLA's default matmul precision)."""
    from training.monitor import peak_flops_for
    assert (peak_flops_for(name, "bf16"), peak_flops_for(name, "fp32")) == (bf16, fp32)


GRAVITON2 = ("fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop "
             "asimddp ssbs")


@pytest.mark.parametrize("line, native", [
    ("flags\t\t: fpu vme de pse tsc msr sse sse2 avx avx2 avx512f avx512bw avx512vl avx512_vnni", False),
    ("flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni", True),          # Cooper Lake, Zen 4
    ("flags\t\t: fpu sse2 avx2 avx512f amx_bf16 amx_tile amx_int8", True),        # Sapphire Rapids
    (f"Features\t: {GRAVITON2}", False),
    (f"Features\t: {GRAVITON2} sve svebf16 i8mm bf16 dgh rng", True),             # Graviton3
    ("processor\t: 0", False),                                                     # no flags line
])
def test_native_cpu_bf16_reads_x86_flags_and_arm_features(tmp_path, line, native, monkeypatch):
    """The bf16-on-CPU warning's test: x86's flags and Arm's features (an aarch64 machine with
    BF16 was warned that its bf16 is emulated); no cpuinfo (macOS) is not native."""
    import warnings
    from training import backend as B
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nmodel name\t: a CPU\n{line}\n\n")
    assert B.native_cpu_bf16(str(info)) is native
    assert B.native_cpu_bf16(str(tmp_path / "none")) is False
    monkeypatch.setattr(B, "native_cpu_bf16", lambda: native)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        assert B.TorchBackend("cpu").autocast_dtype("bf16") is torch.bfloat16
    assert [str(w.message).startswith("this CPU has no native bf16") for w in said] == ([] if native else [True])


def test_one_ctrl_c_delivered_twice_is_one_stop_and_a_later_one_exits(monkeypatch):
    """A terminal's Ctrl+C reaches a worker from its process group and again from the launcher
    (torchrun passes SIGINT on, so does train_xla.py): that is one request to stop and save. A
    SIGINT more than SAME_INTERRUPT_S later exits at once; a SIGTERM never does."""
    import signal

    from training import loop

    exits = []
    monkeypatch.setattr(loop.os, "_exit", exits.append)
    now = [1000.0]
    stop = loop.StopRequested(clock=lambda: now[0])
    stop._handle(signal.SIGINT, None)
    now[0] += 0.05
    stop._handle(signal.SIGINT, None)
    assert stop.requested and stop.signal_name == "SIGINT" and exits == []
    now[0] += 5.0
    stop._handle(signal.SIGTERM, None)
    assert exits == []
    stop._handle(signal.SIGINT, None)
    assert exits == [130]


def test_a_hang_up_is_a_stop_unless_the_process_was_started_ignoring_it():
    """SIGHUP (the terminal of an ssh session that ended; torchrun passes it on to its workers)
    asks for a stop and a save like SIGTERM: by default it killed the run without a save. A
    process started under nohup (SIGHUP ignored) keeps ignoring it, and restore() puts back what
    was there."""
    import signal

    from training import loop

    before = signal.getsignal(signal.SIGHUP)
    try:
        for start, taken in ((signal.SIG_DFL, True), (signal.SIG_IGN, False)):
            signal.signal(signal.SIGHUP, start)
            stop = loop.StopRequested().install()
            assert (signal.getsignal(signal.SIGHUP) == stop._handle) is taken
            assert signal.getsignal(signal.SIGTERM) == signal.getsignal(signal.SIGINT) == stop._handle
            os.kill(os.getpid(), signal.SIGHUP)  # the handler runs in this (the main) thread
            assert stop.requested is taken and stop.signal_name == ("SIGHUP" if taken else "")
            stop.restore()
            assert signal.getsignal(signal.SIGHUP) == start
    finally:
        signal.signal(signal.SIGHUP, before)


def test_a_stop_signal_during_a_write_to_stderr_is_taken_not_a_crash(monkeypatch, capfd):
    """A signal handler runs between two bytecodes of the main thread, which may be inside a write
    to sys.stderr (a log line, tqdm's redraw). Python's buffered streams refuse a reentrant write
    (RuntimeError, raised in the main thread: the run died instead of stopping and saving), so
    the handler writes its line to the file descriptor, not through the stream."""
    import signal

    from training import loop

    stop = loop.StopRequested()

    class Stderr:  # a buffered stream, with the signal arriving in the middle of a write
        writing = False

        def write(self, text):
            if self.writing:
                raise RuntimeError("reentrant call inside <_io.BufferedWriter name='<stderr>'>")
            self.writing = True
            try:
                stop._handle(signal.SIGTERM, None)
            finally:
                self.writing = False
            return len(text)

        def flush(self):
            pass

    monkeypatch.setattr(sys, "stderr", Stderr())
    loop.info("a log line")
    assert stop.requested and stop.signal_name == "SIGTERM"
    assert "SIGTERM received: stopping at the next decision step" in capfd.readouterr().err


def test_dropout_seeds_differ_by_replica_and_step_and_repeat():
    """Each (seed, replica, step) gives its own seed, the same every time it is asked for, within
    the range every generator takes (63 bits): DDP replicas draw different masks, and a resumed
    step the masks it drew before."""
    from training.loop import step_seed

    seeds = {(s, r, k): step_seed(s, r, k) for s in (0, 7, -1, 2**63) for r in range(4) for k in range(50)}
    assert len(set(seeds.values())) == len(seeds)
    assert all(0 <= v < 2**63 for v in seeds.values())
    assert all(step_seed(*key) == v for key, v in seeds.items())


def test_data_workers_leave_stop_signals_to_the_trainer(stdlib_data):
    """A Ctrl+C, a terminal's hang-up or a process-group SIGTERM reaches the DataLoader workers
    too; they must live on until the trainer has saved and closes them (one that died ended the
    run before the save)."""
    import signal

    stream = DataStream(TokenWindows(stdlib_data, "train", 32), batch_size=4, num_replicas=1, rank=0,
                        seed=0, num_workers=1)
    x0, _ = next(stream)
    workers = stream._it._workers
    for w in workers:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            os.kill(w.pid, sig)
    for w in workers:
        w.join(timeout=1.0)
    assert all(w.is_alive() for w in workers)
    for _ in range(10):
        assert next(stream)[0].shape == x0.shape
    # a worker that died of the signals but took long to exit under load still counted as alive
    # above; the batches came after the signals, and no worker has exited
    assert all(w.exitcode is None for w in workers)
    stream.close()


def test_an_override_yaml_cannot_read_is_the_text_written():
    """A value YAML cannot parse (a flow bracket left open, a reserved first character) is, for a
    text key, the text as typed, and one '=' splits the key from the value (a run name may hold
    '=')."""
    cfg = load_config(None, ["training.max_steps=1", "checkpoint.dir=runs/{a", "logging.wandb.run_name=@night",
                             "data.dir=lr=3e-4"])
    assert (cfg.checkpoint.dir, cfg.logging.wandb.run_name, cfg.data.dir) == ("runs/{a", "@night", "lr=3e-4")
    # YAML reads '#3' as a comment (null): a text key keeps the text; only null's own words are null
    assert load_config(None, ["training.max_steps=1", "logging.wandb.run_name=#3"]).logging.wandb.run_name == "#3"


@pytest.mark.parametrize("override, match", [
    ("training.learning_rate=.inf", r"^training.learning_rate: expected a finite number, got inf$"),
    ("training.grad_clip=.nan", r"^training.grad_clip: expected a finite number, got nan$"),
    ("data.seq_len=0", r"^data.seq_len=0 must be positive$"),
    ("xla.mesh.dcn_data=3", r"^xla.mesh.dcn_data=3 does not divide xla.mesh.data=1 "),
    ("xla.nprocs=4", r"^xla.nprocs=4: torch_xla 2.9's xmp.spawn accepts only null"),
    ("training.compile=1", r"^training.compile: expected true or false, got 1$"),
    ("training.warmup_steps=1e19", r"^training.warmup_steps: expected an integer, got 1e\+19$"),
])
def test_override_values_outside_the_schema_are_refused(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, ["training.max_steps=1", override])


def test_the_bounds_the_help_allows_are_accepted():
    """min_lr_ratio 1 (no decay) and logging.peak_flops 0 (look the peak up) are in range."""
    cfg = load_config(None, ["training.max_steps=1", "training.min_lr_ratio=1", "logging.peak_flops=0"])
    assert cfg.training.min_lr_ratio == 1.0 and cfg.logging.peak_flops == 0.0


def test_an_spmd_batch_must_divide_over_data_times_fsdp():
    cfg = load_config(None, ["training.max_steps=1", "xla.mode=spmd", "xla.mesh.data=2", "xla.mesh.fsdp=4",
                             "training.batch_size=6"])
    with pytest.raises(ConfigError, match=r"^training.batch_size=6 is the global batch .* = 8 devices$"):
        check_xla(cfg)


@pytest.mark.parametrize("over, match", [
    (["xla.mesh.tp=4"], r"^xla.mesh.tp=4 does not divide model.n_kv_heads=2: .* by whole heads"),
    (["xla.mesh.tp=2", "model.n_kv_heads=1"], r"^xla.mesh.tp=2 does not divide model.n_kv_heads=1: "),
    (["xla.mesh.tp=2", "model.d_model=192", "model.n_heads=3", "model.n_kv_heads=1"],
     r"^xla.mesh.tp=2 does not divide model.n_heads=3: "),
    (["xla.mesh.tp=3", "model.d_model=192", "model.n_heads=6", "model.n_kv_heads=3"],
     r"^xla.mesh.tp=3 does not divide the FFN's hidden size 544 \(.*model.ffn_multiple_of=32\)"),
])
def test_spmd_tp_must_split_heads_and_ffn_units_whole(over, match):
    """tp splits attention by heads and the FFN by hidden units (training/sharding.py): a tp that
    cuts a head (or pads the FFN's shards) is refused before anything compiles, naming the key."""
    cfg = load_config(None, ["training.max_steps=1", "xla.mode=spmd", *over])
    with pytest.raises(ConfigError, match=match):
        check_xla(cfg)


def test_spmd_tp_that_divides_heads_and_ffn_units_is_accepted():
    for tp, over in ((2, []), (3, ["model.d_model=192", "model.n_heads=6", "model.n_kv_heads=3",
                                   "model.ffn_multiple_of=96"])):
        cfg = load_config(None, ["training.max_steps=1", "xla.mode=spmd", f"xla.mesh.tp={tp}", *over])
        assert cfg.model.ffn_hidden % tp == 0
        check_xla(cfg)   # no error
        check_xla(cfg, devices=tp)


def test_a_split_without_shards_is_refused(tmp_path, stdlib_data):
    import shutil

    shutil.copytree(stdlib_data, tmp_path / "data")
    meta = json.loads((tmp_path / "data" / "meta.json").read_text())
    meta["splits"]["val"]["shards"] = []
    (tmp_path / "data" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match=r"meta.json: no 'val' shards$"):
        check_data(load_config(None, ["training.max_steps=1", f"data.dir={tmp_path / 'data'}"]))


# === Mutation-kill tests: the progress line, metrics.jsonl's JSON, and a log line's throughput
# and MFU (hand-computed numbers; the clock patched)

# -- training/monitor.py ------------------------------------------------------------------------

def test_progress_line_time_left_in_hours_minutes_seconds():
    from training.monitor import progress_line
    # 1000 steps left x 3.7 s = 3700 s = 1 h 1 min 40 s
    line = progress_line(10, 1010, {"loss": 1.0, "lr": 1e-3, "step_time": 3.7})
    assert line.endswith(" | 1:01:40 left"), line
    # 90061 s = 25 h 1 min 1 s (hours are not wrapped at a day)
    line = progress_line(0, 90061, {"loss": 1.0, "step_time": 1.0})
    assert line.endswith(" | 25:01:01 left"), line
    # past the end: nothing left, never negative
    assert progress_line(12, 10, {"loss": 1.0, "step_time": 2.0}).endswith(" | 0:00:00 left")


def _strict_json(line: str) -> dict:
    def refuse(name):
        raise ValueError(f"not JSON: {name}")
    return json.loads(line, parse_constant=refuse)


def test_metrics_jsonl_is_strict_json_with_non_finite_values_as_strings(tmp_path):
    """metrics.jsonl must stay valid JSON for other readers (jq, JavaScript): NaN, Infinity and
    -Infinity are not JSON. Non-finite floats are written as the strings "nan", "inf", "-inf";
    finite values and non-floats unchanged."""
    from training.config import load_config
    from training.monitor import Monitor
    cfg = load_config(None, ["training.max_steps=6", "logging.progress_bar=false", "logging.tensorboard=false"])
    m = Monitor(cfg, tmp_path, True, 6, 0)
    m.log(1, {"loss": float("nan"), "grad_norm": float("inf"), "x": float("-inf"), "lr": 1e-3, "n": 3})
    m.close()
    rec = _strict_json((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert (rec["loss"], rec["grad_norm"], rec["x"]) == ("nan", "inf", "-inf")
    assert rec["lr"] == 1e-3 and rec["n"] == 3 and rec["step"] == 1


# -- training/loop.py: throughput and MFU of a log line -----------------------------------------

def _fake_trainer(monkeypatch, now, *, last_time, last_step, tokens_per_step, flops_per_token, peak, n_devices):
    from training import loop
    logged = []
    fake = types.SimpleNamespace(
        cfg=types.SimpleNamespace(training=types.SimpleNamespace(max_nonfinite_steps=3)),
        state=loop.RunState(), last_log_time=last_time, last_log_step=last_step,
        tokens_per_step=tokens_per_step, flops_per_token=flops_per_token, peak=peak,
        backend=types.SimpleNamespace(n_devices=n_devices, log_extras=lambda: {}),
        monitor=types.SimpleNamespace(log=lambda step, rec: logged.append((step, rec))),
        log_line=lambda msg: None, skipped_logged=0, stop_nonfinite=False,
        start_tokens=0, start_step=0)
    fake._count_skipped = functools.partial(loop.Trainer._count_skipped, fake)
    fake.tokens_at = functools.partial(loop.Trainer.tokens_at, fake)
    monkeypatch.setattr(loop.time, "time", lambda: now)
    return fake, logged


def test_a_log_line_reports_training_throughput_step_time_and_mfu(monkeypatch):
    """Between two log lines 5 steps ran in 100 s of which 20 s were evaluation/saving (paused):
    80 s of training, 16 s a step, 5 x 4096 / 80 = 256 tokens/s; MFU = 256 x 1e9 FLOPs/token over
    4 devices of 1e12 FLOP/s = 6.4%."""
    from training import loop
    fake, logged = _fake_trainer(monkeypatch, 1100.0, last_time=1000.0, last_step=10, tokens_per_step=4096,
                                 flops_per_token=1e9, peak=1e12, n_devices=4)
    loop.Trainer.log(fake, [2.5, 0.7, 0.0, 0.0], ["loss", "grad_norm", "_skipped", "_worst_streak"],
                     step=15, lr=1e-3, paused_s=20.0)
    (step, rec), = logged
    assert step == 15 and rec["tokens_seen"] == 15 * 4096
    assert rec["step_time"] == pytest.approx(16.0)
    assert rec["tokens_per_sec"] == pytest.approx(256.0)
    assert rec["mfu"] == pytest.approx(256.0 * 1e9 / (4 * 1e12))
    assert (fake.last_log_time, fake.last_log_step) == (1100.0, 15)


def test_replica_averaged_counters_are_whole_numbers_again_at_a_log_line(monkeypatch):
    """The skipped-step counters reach a log line averaged over the replicas, on XLA as a sum
    times float32(1/n): k equal counters over n = 244 processes come back as k - 1 ulp
    (3 -> 2.9999998). The line rounds them: a streak of 3 stops the run at max_nonfinite_steps 3
    and the run's total of skipped steps counts 3, where truncation said 2 and never stopped."""
    from training import loop
    n = 244
    averaged = (torch.tensor(3.0 * n) * torch.tensor(1.0 / n)).item()   # xm.all_reduce's scale
    assert averaged < 3.0
    fake, logged = _fake_trainer(monkeypatch, 1100.0, last_time=1000.0, last_step=10, tokens_per_step=4096,
                                 flops_per_token=1e9, peak=None, n_devices=n)
    loop.Trainer.log(fake, [float("nan"), float("nan"), averaged, averaged],
                     ["loss", "grad_norm", "_skipped", "_worst_streak"], step=13, lr=1e-3, paused_s=0.0)
    (_, rec), = logged
    assert fake.stop_nonfinite and rec["nonfinite_skipped"] == 3 and fake.state.nonfinite_total == 3


def test_an_infinite_validation_loss_has_an_infinite_perplexity(monkeypatch):
    """eval_ppl = exp(eval_loss), as large as a float goes, and inf past it (not exp(50), which
    made a diverged evaluation read as perplexity 5e21)."""
    from training import loop
    for eval_loss, ppl in ((2.0, math.exp(2.0)), (600.0, math.exp(600.0)), (float("inf"), math.inf)):
        fake, logged = _fake_trainer(monkeypatch, 1100.0, last_time=1000.0, last_step=10, tokens_per_step=4096,
                                     flops_per_token=1e9, peak=None, n_devices=1)
        loop.Trainer.log(fake, [2.5, 0.7, 0.0, 0.0, eval_loss],
                         ["loss", "grad_norm", "_skipped", "_worst_streak", "eval_loss"], step=15, lr=1e-3,
                         paused_s=0.0)
        (_, rec), = logged
        assert rec["eval_ppl"] == ppl


def test_a_resumed_run_keeps_the_metrics_lines_up_to_its_step_and_drops_what_is_no_record(tmp_path):
    """Resuming at step 2: metrics.jsonl keeps the records of steps 1 and 2 in order, and drops
    the later ones, a line cut by a crash and lines that are JSON but no record of ours (edited by
    hand or written by another tool: null, a list, a step that is not a number), rewriting the file
    in one piece; TensorBoard purges from step 3. Before, the last three were a traceback at start."""
    from training.monitor import _continue_logs
    lines = ['{"step": 1, "loss": 3.0}', '{"step": 2, "loss": 2.5}', "null", "[]", '{"step": "7"}',
             '{"step": 3, "loss": 2.0}', '{"step": 4, "lo']
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines))
    assert _continue_logs(tmp_path, 2, tensorboard=True) == 3
    assert (tmp_path / "metrics.jsonl").read_text() == lines[0] + "\n" + lines[1] + "\n"
    assert _continue_logs(tmp_path, 2, tensorboard=False) is None
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]
