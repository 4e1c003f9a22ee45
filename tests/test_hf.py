"""Hugging Face interop (export_hf.py, modeling_nash_mhc.py, training/hf.py), checked against
transformers' own classes and lm-evaluation-harness.

Checkpoints are built in-process (a tiny model moved away from its initialisation, so every gate,
bias and temperature matters) in the trainers' checkpoint format, on the stdlib test corpus's
tokenizer. Logits are compared in fp32 to 1e-4 (observed: ~1e-6 for Llama, 0 for the remote code,
which runs model.py itself).
"""
import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml

import export_hf
from prepare_data import as_document_encoder
from model import ModelConfig, NashMHC
from training.checkpoint import (FORMAT_VERSION, CheckpointError, atomic_torch_save, checkpoint_path,
                                 load_checkpoint)
from training.config import Config, ConfigError, DataConfig, TrainingConfig, config_from_dict

from helpers import ENV, ROOT, losses, metrics, tiny_config

TINY = dict(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, dropout=0.0)
BASELINE = dict(mhc_streams=1, nash_scales=1, nash_window=0)
NASH = dict(mhc_streams=2, mhc_lite=False, nash_scales=3, nash_compression=4, nash_window=16, nash_pool="learned")
NASH_LITE = dict(mhc_streams=3, mhc_lite=True, nash_scales=2, nash_window=8, aggregation="convex",
                 tie_embeddings=False)


def make_run(run_dir, data_dir, step=7, seed=0, tokenizer_sha256=None, **model):
    """A run directory with one checkpoint as the trainers write it; returns the model."""
    cfg = Config(model=ModelConfig(**{**TINY, **model}), data=DataConfig(dir=str(data_dir), seq_len=32),
                 training=TrainingConfig(max_steps=step))
    torch.manual_seed(seed)
    m = NashMHC(cfg.model).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * (0.5 if p.ndim < 2 else 0.05))
    atomic_torch_save({"format_version": FORMAT_VERSION, "model": m.state_dict(), "optimizer": {},
                       "step": step, "tokens_seen": 0, "rng": {},
                       "data": {"epoch": 0, "offset": 0, **({"tokenizer_sha256": tokenizer_sha256} if tokenizer_sha256
                                                            else {})},
                       "config": cfg.to_dict(), "trainer": "test"}, checkpoint_path(run_dir, step))
    return m


def export(*args) -> int:
    return export_hf.main([str(a) for a in args])


def one_error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("export_hf.py: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def nash_export(tmp_path_factory, stdlib_data):
    tmp = tmp_path_factory.mktemp("nash")
    model = make_run(tmp / "run", stdlib_data, **NASH)
    assert export(tmp / "run", tmp / "hf") == 0
    return model, tmp / "hf"


def tokens(n_rows, length, vocab=512, seed=1):
    return torch.randint(0, vocab, (n_rows, length), generator=torch.Generator().manual_seed(seed))


def until_eos(row, eos):
    row = list(row)
    return row[:row.index(eos) + 1] if eos in row else row


@pytest.mark.parametrize("name", ["demo_baseline.yaml", "small_gpu_baseline.yaml"])
def test_the_shipped_baseline_configs_are_plain_llamas(name):
    """The ablation baselines are the standard transformer (full causal attention: no window), so
    they export as LlamaForCausalLM. They had a sliding window (64, 256) before."""
    from training.config import load_config
    from training.hf import llama_incompatibility
    assert llama_incompatibility(load_config(ROOT / "configs" / name).model) is None


@pytest.mark.parametrize("hf_name, field, value", [
    ("hidden_size", "d_model", 64), ("num_hidden_layers", "n_layers", 3), ("num_attention_heads", "n_heads", 2),
    ("num_key_value_heads", "n_kv_heads", 1), ("max_position_embeddings", "max_seq_len", 128),
    ("rms_norm_eps", "norm_eps", 1e-6), ("tie_word_embeddings", "tie_embeddings", False),
])
def test_the_remote_code_config_takes_llama_names(hf_name, field, value):
    """NashMHCConfig answers to transformers' usual names (LlamaConfig's: what generation code,
    lm-eval and vLLM read) for model.py's fields, set and read."""
    from transformers import LlamaConfig

    from modeling_nash_mhc import NashMHCConfig
    assert hasattr(LlamaConfig(), hf_name)
    cfg = NashMHCConfig(**{hf_name: value})
    assert getattr(cfg.model_config(), field) == value == getattr(cfg, hf_name)
    assert getattr(NashMHCConfig.from_dict(cfg.to_dict()), hf_name) == value

def test_a_window_that_covers_every_sequence_is_plain_llama():
    """Scale 0's window of max_seq_len keys sees every earlier token of any sequence the model
    takes: full causal attention, exported as plain Llama; one key less is a sliding window."""
    from model import ModelConfig
    from training.hf import llama_incompatibility
    base = dict(vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, max_seq_len=64,
                mhc_streams=1, nash_scales=1)
    assert llama_incompatibility(ModelConfig(**base, nash_window=64)) is None
    assert llama_incompatibility(ModelConfig(**base, nash_window=0)) is None
    assert llama_incompatibility(ModelConfig(**base, nash_window=63)) == "nash_window=63"

def test_baseline_exports_as_plain_llama(tmp_path, stdlib_data, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaForCausalLM
    from tokenizers import Tokenizer

    ours = make_run(tmp_path / "run", stdlib_data, step=5, **BASELINE)
    newest = make_run(tmp_path / "run", stdlib_data, step=7, seed=1, rope_theta=50000.0, dropout=0.1, **BASELINE)
    (tmp_path / "run" / "ckpt_00000009.pt").write_bytes(b"truncated")  # newest file, corrupt: skipped
    (tmp_path / "run" / "metrics.jsonl").write_text(
        '{"step": 5, "loss": 4.0, "eval_loss": 3.5}\n{"step": 7, "loss": 3.0, "eval_loss": 3.25}\n{"step": 7, "lo')
    out = tmp_path / "hf"
    assert export(tmp_path / "run", out, "--max-shard-size", "150KB") == 0
    err = capsys.readouterr().err
    assert "ckpt_00000009.pt" in err and "ckpt_00000007.pt" in err and "LlamaForCausalLM" in err
    # Llama has no dropout of ours: said, not dropped silently (the outputs below are the same)
    assert "export_hf.py: warning: model.dropout=0.1 has no place in LlamaForCausalLM" in err, err
    assert not list(out.glob("*.py"))  # no remote code
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and "auto_map" not in config and config["dtype"] == "float32"
    assert config["rope_parameters"]["rope_theta"] == config["rope_theta"] == 50000.0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded above --max-shard-size

    hf = AutoModelForCausalLM.from_pretrained(out)  # no trust_remote_code
    assert type(hf) is LlamaForCausalLM and hf.dtype == torch.float32
    x = tokens(2, 64)
    with torch.no_grad():
        assert (hf(x).logits - newest(x).logits).abs().max() <= 1e-4
        assert (hf(x).logits - ours(x).logits).abs().max() > 1e-2  # it is the newest checkpoint
    prompt = tokens(1, 20, seed=2)
    got = hf.generate(prompt, max_new_tokens=40, do_sample=False)  # with transformers' KV cache
    assert until_eos(got[0, 20:].tolist(), 0) == until_eos(newest.generate(prompt, 40, temperature=0)[0, 20:].tolist(), 0)

    tok = AutoTokenizer.from_pretrained(out)
    text = "def f(x):\n    return x + 1\n"
    assert tok(text)["input_ids"] == Tokenizer.from_file(str(stdlib_data / "tokenizer.json")).encode(text).ids
    meta = json.loads((stdlib_data / "meta.json").read_text())
    # a literal end-of-text in a text is text, as in the training documents (never the id itself)
    text = "x = '<|endoftext|>'\n"
    ids = tok(text)["input_ids"]
    assert meta["eos_id"] not in ids and tok.decode(ids) == text
    assert ids == as_document_encoder(Tokenizer.from_file(str(stdlib_data / "tokenizer.json"))).encode(text).ids
    gen = GenerationConfig.from_pretrained(out)
    assert tok.eos_token_id == config["eos_token_id"] == gen.eos_token_id == meta["eos_id"]
    assert tok.pad_token_id == config["pad_token_id"] == gen.pad_token_id == meta["pad_id"]
    check_model_card(out, remote=False, step=7, val_loss="3.2500")


def check_model_card(out, remote: bool, step: int, val_loss: str | None = None):
    """README.md is a model card the Hub reads (huggingface_hub parses its metadata) and says how
    to load the export, with trust_remote_code exactly when it needs it."""
    from huggingface_hub import ModelCard

    card = ModelCard.load(out / "README.md")
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "text-generation"
    assert "nash-mhc-toolkit" in card.data.tags   # what --overwrite takes for an earlier export
    assert ("trust_remote_code=True" in card.text) == remote
    flag = ", trust_remote_code=True" if remote else ""   # AutoTokenizer reads auto_map too (it asked)
    assert f"at step {step}" in card.text and f"AutoTokenizer.from_pretrained(\"{out.name}\"{flag})" in card.text
    assert (f"validation loss {val_loss} at this step" in card.text) if val_loss else "validation loss" not in card.text


@pytest.mark.parametrize("arch", [NASH, NASH_LITE], ids=["nash-mhc-sinkhorn", "mhc-lite-convex-untied"])
def test_nash_mhc_exports_with_remote_code(tmp_path, stdlib_data, arch, request):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if arch is NASH:
        ours, out = request.getfixturevalue("nash_export")
    else:
        # trained with activation checkpointing: a memory setting of the run, which the export
        # leaves off (transformers' activation_checkpointing_enable() turns it on)
        ours, out = make_run(tmp_path / "run", stdlib_data, **arch, activation_checkpointing=True), tmp_path / "hf"
        assert export(tmp_path / "run", out) == 0
        ours.config.activation_checkpointing = False
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "nash_mhc" and config["auto_map"] == export_hf.AUTO_MAP
    assert config["activation_checkpointing"] is False
    for name in ("model.py", "modeling_nash_mhc.py"):  # the repository's code, verbatim
        assert (out / name).read_bytes() == (ROOT / name).read_bytes()
    check_model_card(out, remote=True, step=7)
    hf = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    assert type(hf).__name__ == "NashMHCForCausalLM" and hf.config.model_config().to_dict() == ours.config.to_dict()
    assert not hf.is_activation_checkpointing
    # LlamaConfig's names for what model.py derives
    assert (hf.config.head_dim, hf.config.intermediate_size, hf.config.hidden_act) == \
        (ours.config.head_dim, ours.config.ffn_hidden, "silu")
    x = tokens(2, 50)  # not a multiple of the coarsest block: padded inside, as in training
    with torch.no_grad():
        assert (hf(x).logits - ours(x).logits).abs().max() <= 1e-4
        labels = x.clone()
        want = F.cross_entropy(ours(x).logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
        assert torch.allclose(hf(x, labels=labels).loss, want, atol=1e-5)  # transformers' shifted loss

    # greedy decoding, past max_seq_len (64): the context is cropped as NashMHC.generate crops it
    prompt = tokens(1, 40, seed=3)
    got = hf.generate(prompt, max_new_tokens=40, do_sample=False)
    assert until_eos(got[0, 40:].tolist(), 0) == until_eos(ours.generate(prompt, 40, temperature=0)[0, 40:].tolist(), 0)
    # a padded batch: every row continues as it does alone. The export's tokenizer pads on the left
    # (generate appends to the end of every row: after right padding it would read a pad's logits)
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.padding_side == "left" and tok.model_max_length == 64
    # named in the file: transformers 4.x's default also returns token_type_ids, which generate refuses
    named = json.loads((out / "tokenizer_config.json").read_text())["model_input_names"]
    assert named == ["input_ids", "attention_mask"]
    texts = ["import os\nimport sys\n", "def main():\n    return"]
    batch = tok(texts, return_tensors="pt", padding=True)
    assert (batch["attention_mask"] == 0).any()
    got = hf.generate(**batch, max_new_tokens=12, do_sample=False)
    for i, text in enumerate(texts):
        alone = ours.generate(torch.tensor([tok(text)["input_ids"]]), 12, temperature=0)[0, -12:]
        assert until_eos(got[i, -12:].tolist(), 0) == until_eos(alone.tolist(), 0)
    assert len(tok("x = 1\n" * 60, truncation=True)["input_ids"]) == 64


def test_a_moved_export_loads_in_a_process_that_never_saw_the_repository(tmp_path, nash_export):
    """What a user does with an export: copy it elsewhere and load it in a fresh process, with no
    repository on the path and a model.py of the user's own in the working directory. transformers
    imports the export's own model.py, never the user's, and the logits are the checkpoint's; an
    export whose model.py fails to import says so (before, the wrapper fell back to whatever
    "model" module the path held). The copy's directory name is no identifier: transformers names
    the module after it, and model.py's op names are made from the module's (before, such a copy
    failed to load)."""
    import shutil

    ours, out = nash_export
    good, broken = tmp_path / "elsewhere" / "my copy+é", tmp_path / "elsewhere" / "broken"
    shutil.copytree(out, good)
    shutil.copytree(out, broken)
    with open(broken / "model.py", "a") as f:
        f.write("\nraise ImportError('the export model.py cannot import')\n")
    work = tmp_path / "work"
    work.mkdir()
    (work / "model.py").write_text("raise RuntimeError('the user model.py was imported')\n")
    x = tokens(2, 50)
    torch.save(x, tmp_path / "x.pt")
    script = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        f"try:\n    AutoModelForCausalLM.from_pretrained({str(broken)!r}, trust_remote_code=True)\n"
        "except ImportError as e:\n    print('broken:', e)\n"
        f"hf = AutoModelForCausalLM.from_pretrained({str(good)!r}, trust_remote_code=True).eval()\n"
        "print('module:', type(hf.model).__module__)\n"
        f"with torch.no_grad():\n    torch.save(hf(torch.load({str(tmp_path / 'x.pt')!r})).logits, "
        f"{str(tmp_path / 'logits.pt')!r})\n")
    env = {k: v for k, v in ENV.items() if k != "PYTHONPATH"}
    env["HF_MODULES_CACHE"] = str(tmp_path / "modules")
    r = subprocess.run([sys.executable, "-c", script], cwd=work, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "broken: the export model.py cannot import" in r.stdout, r.stdout
    assert "module: transformers_modules." in r.stdout, r.stdout
    with torch.no_grad():
        assert (torch.load(tmp_path / "logits.pt", weights_only=True) - ours(x).logits).abs().max() <= 1e-4


def test_remote_code_model_in_transformers_workflows(tmp_path, nash_export):
    """What transformers users do with a loaded model: a checkpoint missing some parameters (or a
    config that adds some) gets model.py's initialisation for those and keeps the rest;
    activation_checkpointing_enable() recomputes the blocks (same loss and gradients);
    resize_token_embeddings() grows the (tied) vocabulary; attn_implementation="sdpa" and
    return_dict=False are taken, what the model cannot give is refused."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    ours, out = nash_export
    part = tmp_path / "part"
    part.mkdir()
    for f in out.iterdir():
        (part / f.name).write_bytes(f.read_bytes())
    weights = load_file(part / "model.safetensors")
    dropped = ["model.blocks.0.attn.wq.weight", "model.blocks.1.attn.log_tau", "model.blocks.0.hc_ffn.b_res"]
    save_file({k: v for k, v in weights.items() if k not in dropped}, part / "model.safetensors",
              metadata={"format": "pt"})
    hf = AutoModelForCausalLM.from_pretrained(part, trust_remote_code=True).eval()
    fresh = NashMHC(ours.config)  # model.py's initialisation
    got, want = hf.state_dict(), fresh.state_dict()
    for key in dropped:
        name = key[len("model."):]
        if got[key].ndim == 2:
            assert got[key].std().item() == pytest.approx(want[name].std().item(), rel=0.2)
        else:
            assert torch.equal(got[key], want[name])  # a constant initialisation
    for name, value in ours.state_dict().items():  # the loaded parameters are the checkpoint's
        if f"model.{name}" not in dropped:
            assert torch.equal(got[f"model.{name}"], value), name
    x = tokens(2, 40)
    assert torch.isfinite(hf(x).logits).all()

    hf = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).train()
    grads = []
    for checkpointing in (False, True):
        if checkpointing:  # transformers 5.x's name (gradient_checkpointing_enable, deprecated, calls the same)
            assert not hf.is_activation_checkpointing
            hf.activation_checkpointing_enable()
            # transformers' own reading of it (Trainer and PEFT ask it), as well as ours
            assert hf.model.config.activation_checkpointing and hf.is_activation_checkpointing
            with pytest.raises(ValueError, match="every_n_layers=2: Nash-MHC checkpoints every block"):
                hf.activation_checkpointing_enable(every_n_layers=2)  # transformers' option: not ignored
        hf.zero_grad()
        loss = hf(x, labels=x).loss
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in hf.parameters()]))
    assert torch.equal(grads[0][0], grads[1][0])
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads[0][1], grads[1][1]))

    hf = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, attn_implementation="sdpa").eval()
    with torch.no_grad():
        assert torch.equal(hf(x, return_dict=False)[0], hf(x).logits)
        assert torch.equal(hf(x, position_ids=torch.arange(40).expand(2, 40)).logits, hf(x).logits)
        for ignored in ({"output_hidden_states": True}, {"position_ids": torch.arange(1, 41).expand(2, 40)}):
            with pytest.raises(ValueError, match="NashMHCForCausalLM"):  # an error, not silently ignored
                hf(x, **ignored)
        for asked in ("output_hidden_states", "output_attentions"):  # through generate() too, not None
            with pytest.raises(ValueError, match="NashMHCForCausalLM"):
                hf.generate(x[:1, :8], max_new_tokens=2, return_dict_in_generate=True, **{asked: True})
    hf.resize_token_embeddings(600)
    assert hf.config.vocab_size == hf.model.config.vocab_size == 600
    assert hf.model.lm_head.weight is hf.model.tok_emb.weight and hf.model.tok_emb.num_embeddings == 600
    with torch.no_grad():
        logits = hf(torch.cat([x, torch.full((2, 1), 599)], dim=1)).logits
    assert logits.shape == (2, 41, 600)
    assert (logits[:, :40, :512] - ours(x).logits).abs().max() <= 1e-4  # the old vocabulary as before


def test_bf16_export(tmp_path, stdlib_data):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    ours = make_run(tmp_path / "run", stdlib_data, **NASH)
    assert export(tmp_path / "run" / "ckpt_00000007.pt", tmp_path / "hf", "--dtype", "bf16") == 0
    with safe_open(tmp_path / "hf" / "model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True, dtype=torch.float32)
    x = tokens(2, 64)
    with torch.no_grad():
        rounded = ours.to(torch.bfloat16).float()  # the exported weights, in fp32
        rounded.init_buffers()  # rotary tables in fp32, as from_pretrained builds them
        ref = rounded(x).logits
        assert (hf(x).logits - ref).abs().max() <= 1e-4
        # loaded as saved (transformers 5 keeps the checkpoint's dtype), it runs in bf16
        low = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True)
        assert low.dtype == torch.bfloat16
        logits = low(x).logits
        assert logits.dtype == torch.bfloat16
        assert (logits.float() - ref).abs().max() <= 0.03 * ref.abs().max()


TRAINER = """
import json, sys
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments
from modeling_nash_mhc import NashMHCConfig, NashMHCForCausalLM

config, out = json.loads(sys.argv[1]), sys.argv[2]
torch.manual_seed(0)
model = NashMHCForCausalLM(NashMHCConfig(**config))
x = torch.randint(0, config["vocab_size"], (4, 24), generator=torch.Generator().manual_seed(1))
with torch.no_grad():
    true = model(input_ids=x, labels=x).loss.item()
seen = {}

class Logged(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        if "loss" in logs:
            seen.setdefault(args.gradient_accumulation_steps, []).append(logs["loss"])

for accumulate in (1, 2, 4):
    args = TrainingArguments(output_dir=f"{out}/ga{accumulate}", max_steps=1, learning_rate=0.0,
                             per_device_train_batch_size=4 // accumulate,
                             gradient_accumulation_steps=accumulate, logging_steps=1, report_to=[],
                             save_strategy="no", use_cpu=True, disable_tqdm=True, optim="sgd")
    Trainer(model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in x],
            callbacks=[Logged()]).train()
print(json.dumps({"true": true, "seen": seen}))
"""


def test_hf_trainer_loss_is_the_token_mean_with_gradient_accumulation(tmp_path):
    """transformers' Trainer sees ``**kwargs`` in our forward, so it passes the token count of all
    accumulated micro-batches and does not divide the loss by the accumulation steps itself: the
    loss it logs (learning rate 0) is the batch's mean loss however the batch is split. In its own
    process with USE_TORCH_XLA=0: in this one torch_xla is imported, and the Trainer would pick an
    XLA device (what a TPU user gets; the CPU path is what this test is about)."""
    r = subprocess.run([sys.executable, "-c", TRAINER, json.dumps({**TINY, **NASH_LITE}), str(tmp_path)],
                       cwd=ROOT, env={**ENV, "USE_TORCH_XLA": "0"}, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["seen"] == {str(a): [pytest.approx(got["true"], rel=1e-4)] for a in (1, 2, 4)}, got


def test_export_from_a_sharded_checkpoint(tmp_path, stdlib_data, capsys):
    """A DCP directory (what FSDP2 and SPMD runs write), found in its run directory and read by
    training.checkpoint's one loader: the same files as from the same weights in a .pt file."""
    from safetensors.torch import load_file
    from training.backend import TorchBackend
    from training.checkpoint import Checkpointer, rng_state
    from training.optim import build_optimizer

    ours = make_run(tmp_path / "file", stdlib_data, **NASH_LITE)
    ckpt = load_checkpoint(checkpoint_path(tmp_path / "file", 7))
    backend = TorchBackend("cpu")
    backend.checkpoint_format = "dcp"  # DCP in one process: no group
    opt = build_optimizer(ours, config_from_dict(ckpt["config"]).training, backend.adamw_factory())
    meta = {k: ckpt[k] for k in ("format_version", "step", "tokens_seen", "data", "config", "trainer")}
    saved = Checkpointer(tmp_path / "run", keep=1, backend=backend, log=lambda m: None).save(
        {**meta, "rng": rng_state(), "nonfinite": {"total": 0}}, ours, opt, "test")
    assert saved.is_dir() and saved == checkpoint_path(tmp_path / "run", 7, sharded=True)

    assert export(tmp_path / "run", tmp_path / "hf") == 0
    assert saved.name in capsys.readouterr().err
    assert export(tmp_path / "file", tmp_path / "hf_file") == 0
    got, want = (load_file(tmp_path / d / "model.safetensors") for d in ("hf", "hf_file"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert (tmp_path / "hf" / "config.json").read_text() == (tmp_path / "hf_file" / "config.json").read_text()


@pytest.mark.parametrize("model_rows", [520, 300])
def test_vocabulary_mapping(tmp_path, stdlib_data, capsys, model_rows):
    """Model rows above the tokenizer's (rounded up): kept, said; below (another tokenizer):
    padded with zero rows up to the tokenizer's ids, said."""
    from transformers import AutoModelForCausalLM

    ours = make_run(tmp_path / "run", stdlib_data, **{**BASELINE, "vocab_size": model_rows, "tie_embeddings": False})
    assert export(tmp_path / "run", tmp_path / "hf") == 0
    err = capsys.readouterr().err
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert hf.config.vocab_size == max(model_rows, 512)
    x = tokens(2, 32, vocab=min(model_rows, 512))
    with torch.no_grad():
        a, b = hf(x).logits, ours(x).logits
    assert (a[..., :model_rows] - b).abs().max() <= 1e-4
    # transformers' generate, as sample.py: never an id no text encodes to or no row was trained for
    trained = min(model_rows, 512)
    assert hf.generation_config.suppress_tokens == list(range(trained, max(model_rows, 512)))
    torch.manual_seed(0)
    out = hf.generate(x[:, :4], do_sample=True, top_k=0, max_new_tokens=16, output_scores=True,
                      return_dict_in_generate=True)
    assert out.scores and all(bool((s[:, trained:] == float("-inf")).all() and s[:, :trained].isfinite().all())
                              for s in out.scores)
    if model_rows > 512:
        assert "rows 512-519 are padding" in err
    else:
        assert "rows 300-511 are added as zeros" in err and "warning" in err
        assert torch.equal(a[..., 300:], torch.zeros_like(a[..., 300:]))
        assert torch.equal(hf.model.embed_tokens.weight[300:], torch.zeros(212, 64))


def test_a_tokenizer_without_a_pad_token_pads_with_end_of_text(tmp_path, stdlib_data):
    """An imported tokenizer often has only an end-of-text token (Llama's): the export pads with
    it, as its generation config says, so the README's batched use works; a left-padded batch
    generates what each prompt does alone."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(["def main():\n    return 0\n", "import os\nimport sys\n"] * 50, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    make_run(tmp_path / "run", stdlib_data, **BASELINE)
    assert export(tmp_path / "run", tmp_path / "hf", "--tokenizer", tmp_path / "tok") == 0
    hf_tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert hf_tok.pad_token == "<|endoftext|>" and hf_tok.pad_token_id == hf.generation_config.pad_token_id
    prompts = ["def main():\n    return", "import"]
    batch = hf_tok(prompts, return_tensors="pt", padding=True)
    assert batch["attention_mask"][1, 0] == 0  # padded on the left
    together = hf.generate(**batch, max_new_tokens=5, do_sample=False)[:, batch["input_ids"].shape[1]:]
    for row, prompt in zip(together, prompts):
        alone = hf.generate(**hf_tok([prompt], return_tensors="pt"), max_new_tokens=5, do_sample=False)
        assert row.tolist() == alone[0, -5:].tolist(), prompt


def other_tokenizer(folder):
    """A byte-level BPE of the same size as stdlib_data's, trained on other text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(["SELECT * FROM t WHERE x = 1;\n"] * 50, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder


def test_the_export_ships_the_tokenizer_the_model_was_trained_with(tmp_path, stdlib_data, capsys):
    """The checkpoint records its data's tokenizer.json sha256: a data.dir that holds another
    tokenizer now is refused (the export was written with it, with at most a "may not be"
    warning); one given with --tokenizer is said in a warning and exported."""
    import shutil
    data = tmp_path / "data"
    shutil.copytree(stdlib_data, data)
    sha = json.loads((data / "meta.json").read_text())["tokenizer_sha256"]
    make_run(tmp_path / "run", data, tokenizer_sha256=sha, **BASELINE)
    assert export(tmp_path / "run", tmp_path / "hf1", "--no-verify") == 0
    assert "sha256" not in capsys.readouterr().err
    other_tokenizer(tmp_path / "other")
    assert export(tmp_path / "run", tmp_path / "hf2", "--tokenizer", tmp_path / "other", "--no-verify") == 0
    assert (f"warning: --tokenizer {tmp_path / 'other'}: its tokenizer.json (sha256 " in capsys.readouterr().err)
    shutil.copy(tmp_path / "other" / "tokenizer.json", data / "tokenizer.json")
    assert export(tmp_path / "run", tmp_path / "hf3", "--no-verify") == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith(f"export_hf.py: error: {data}: its tokenizer.json (sha256 ") and line.endswith(
        f"is not byte for byte the one the checkpoint was trained with ({sha[:12]}...): pass --tokenizer DIR "
        "holding the model's tokenizer")
    assert not (tmp_path / "hf3").exists()


def test_weights_from_a_hugging_face_directory_carry_its_tokenizer(tmp_path, stdlib_data, llama_dir, monkeypatch):
    """checkpoint.init_from (or --import) of a directory with a tokenizer.json records its sha256,
    so data of another tokenizer is refused as for a training checkpoint (it trained on)."""
    import shutil

    from training.data import check_same_tokenizer
    from training.hf import load_initial_weights
    hf_dir, _ = llama_dir
    meta = json.loads((stdlib_data / "meta.json").read_text())
    shutil.copy(stdlib_data / "tokenizer.json", hf_dir / "tokenizer.json")
    path, init = load_initial_weights(hf_dir)
    check_same_tokenizer(init, meta, path, stdlib_data)   # prepare_data.py --tokenizer HF_DIR: same bytes
    other_tokenizer(hf_dir)
    _, init = load_initial_weights(hf_dir)
    with pytest.raises(ConfigError, match="was trained on data of another tokenizer"):
        check_same_tokenizer(init, meta, path, stdlib_data)
    assert export("--import", hf_dir, tmp_path / "init.pt") == 0
    ckpt = torch.load(tmp_path / "init.pt", weights_only=True)
    assert ckpt["data"] == init["data"] and len(init["data"]["tokenizer_sha256"]) == 64
    # --import=~/llama: the shell leaves that ~ alone; the tokenizer is found all the same
    monkeypatch.setenv("HOME", str(tmp_path))
    assert export(f"--import=~/{hf_dir.name}", "~/init2.pt") == 0
    assert torch.load(tmp_path / "init2.pt", weights_only=True)["data"] == init["data"]


def test_overwrite_never_replaces_a_model_directory_transformers_wrote(tmp_path, stdlib_data, llama_dir, capsys):
    """--overwrite replaces an earlier export only. A directory save_pretrained wrote (the Llama
    an import read, with a Hub model card) holds only names an export writes too; it is refused by
    its card, which lacks the tag every export's card carries, and nothing in it changes."""
    hf_dir, _ = llama_dir
    (hf_dir / "README.md").write_text("---\nlibrary_name: transformers\ntags:\n- llama\n---\n\n# mine\n")
    before = {p.name: p.read_bytes() for p in hf_dir.iterdir()}
    make_run(tmp_path / "run", stdlib_data, **BASELINE)
    assert export(tmp_path / "run" / "ckpt_00000007.pt", hf_dir, "--overwrite") == 2
    assert "README.md has no 'nash-mhc-toolkit' tag" in one_error_line(capsys.readouterr().err)
    assert {p.name: p.read_bytes() for p in hf_dir.iterdir()} == before
    assert not list(tmp_path.glob(".llama*"))


def test_import_overwrite_replaces_an_earlier_checkpoint_only(tmp_path, llama_dir, capsys, monkeypatch):
    """--import OUT.pt --overwrite replaces a checkpoint (an earlier import); a file of anything
    else at OUT (here a data shard: a mistyped path) is refused in one line and left as it was,
    and so is OUT when the disk fills during the write."""
    from training import checkpoint
    hf_dir, _ = llama_dir
    out = tmp_path / "init.pt"
    assert export("--import", hf_dir, out) == 0
    first = out.read_bytes()

    def full_disk(obj, path):   # what torch's writer raises when the disk is full
        with open(path, "wb") as f:
            f.write(b"PK\x03\x04 half")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing "
                           "file data/3: file write failed")
    with monkeypatch.context() as m:
        m.setattr(checkpoint.torch, "save", full_disk)
        assert export("--import", hf_dir, out, "--overwrite") == 2
    assert one_error_line(capsys.readouterr().err) == (
        f"export_hf.py: error: {out}: cannot write ([enforce fail at inline_container.cc:672] . "
        "PytorchStreamWriter failed writing file data/3: file write failed)")
    assert out.read_bytes() == first
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != hf_dir.name) == ["init.pt"]   # no temporary left
    assert export("--import", hf_dir, out) == 2
    assert one_error_line(capsys.readouterr().err).endswith(f"{out}: exists (pass --overwrite to replace it)")
    assert export("--import", hf_dir, tmp_path, "--overwrite") == 2   # a directory is never OUT.pt
    assert one_error_line(capsys.readouterr().err).endswith(
        f"{tmp_path}: is a directory (give the file to write, e.g. {tmp_path / 'model.pt'})")
    assert export("--import", hf_dir, out, "--overwrite") == 0 and load_checkpoint(out)["step"] == 0
    shard = tmp_path / "train_000.npy"
    np.save(shard, np.arange(10, dtype=np.uint16))
    before = shard.read_bytes()
    assert export("--import", hf_dir, shard, "--overwrite") == 2
    assert one_error_line(capsys.readouterr().err).endswith(
        f"{shard}: not a checkpoint (its bytes are not torch.save's zip format); "
        "--overwrite replaces a checkpoint only")
    assert shard.read_bytes() == before


@pytest.mark.parametrize("tokenizer_class", ["PreTrainedTokenizerFast", "LlamaTokenizerFast"])
def test_an_imported_tokenizer_that_adds_a_bos_encodes_in_the_export_as_in_training(tmp_path, stdlib_data,
                                                                                   tokenizer_class):
    """A Llama-style tokenizer adds a BOS by a template (tokenizer.json's post-processor, or
    add_bos_token for Llama's class); prepare_data.py and sample.py encode without special
    tokens. The export encodes as they do, long prompts cut on the left as sample.py cuts them,
    and the template is gone from its tokenizer.json only."""
    from tokenizers import Tokenizer, processors
    from transformers import AutoTokenizer

    import prepare_data

    (tmp_path / "tok").mkdir()
    tok = Tokenizer.from_file(str(stdlib_data / "tokenizer.json"))
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|endoftext|> $A", pair="<|endoftext|> $A <|endoftext|> $B:1",
                                      special_tokens=[("<|endoftext|>", tok.token_to_id("<|endoftext|>"))])])
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": tokenizer_class, "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
         "add_bos_token": True}))
    text = "def main():\n    return 0\n"
    assert tok.encode(text).ids[0] == 0  # the template adds the BOS
    make_run(tmp_path / "run", stdlib_data, **BASELINE)
    assert export(tmp_path / "run", tmp_path / "hf", "--tokenizer", tmp_path / "tok") == 0
    spec = prepare_data.TokenizerSpec.load(str(tmp_path / "tok"))
    hf_tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    trained = spec.tokenizer.encode(text, add_special_tokens=False).ids
    assert hf_tok(text)["input_ids"] == trained and trained[0] != 0
    long = text * 20
    assert hf_tok(long, truncation=True)["input_ids"] == spec.tokenizer.encode(long, add_special_tokens=False).ids[-64:]
    exported = json.loads((tmp_path / "hf" / "tokenizer.json").read_text())
    assert exported["post_processor"] == {"type": "Sequence", "processors": [
        json.loads(tok.to_str())["post_processor"]["processors"][0]]}
    assert {k: v for k, v in exported.items() if k != "post_processor"} == \
        {k: v for k, v in json.loads(tok.to_str()).items() if k != "post_processor"}
    # the export as checkpoint.init_from on the data prepared with the original tokenizer: its
    # tokenizer.json bytes differ, its token ids do not (it was refused as another tokenizer); on
    # data prepared with the export's own tokenizer too, and on other data still refused
    from training.data import check_same_tokenizer
    from training.hf import load_initial_weights
    path, init = load_initial_weights(tmp_path / "hf")
    exported_sha = hashlib.sha256((tmp_path / "hf" / "tokenizer.json").read_bytes()).hexdigest()
    for data_sha in (hashlib.sha256(spec.json_text.encode()).hexdigest(), exported_sha):
        check_same_tokenizer(init, {"tokenizer_sha256": data_sha}, path, "data")
    with pytest.raises(ConfigError, match="was trained on data of another tokenizer"):
        check_same_tokenizer(init, json.loads((stdlib_data / "meta.json").read_text()), path, stdlib_data)


def test_refusals_are_one_line_and_touch_nothing(tmp_path, stdlib_data, capsys, monkeypatch):
    make_run(tmp_path / "run", stdlib_data, **BASELINE)
    good = tmp_path / "run" / "ckpt_00000007.pt"
    out = tmp_path / "hf"

    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[:5000])
    assert export(truncated, out) == 2
    assert "truncated.pt: not a loadable checkpoint" in one_error_line(capsys.readouterr().err)

    ckpt = load_checkpoint(good)
    ckpt["config"]["model"]["mhc_fancy"] = 3  # a model.py that does not know this architecture
    atomic_torch_save(ckpt, tmp_path / "future.pt")
    assert export(tmp_path / "future.pt", out) == 2
    assert "unknown architecture" in one_error_line(capsys.readouterr().err)

    ckpt = load_checkpoint(good)
    ckpt["model"]["blocks.0.attn.extra"] = torch.zeros(3)
    atomic_torch_save(ckpt, tmp_path / "extra.pt")
    assert export(tmp_path / "extra.pt", out) == 2
    assert "blocks.0.attn.extra" in one_error_line(capsys.readouterr().err)

    (tmp_path / "empty").mkdir()
    assert export(tmp_path / "empty", out) == 2
    assert "no checkpoint in this run directory" in one_error_line(capsys.readouterr().err)

    # an export whose logits are 1% off (its final norm, as a new tensor: the others are the
    # reference's own) fails the verification: refused, nothing written
    build = export_hf.build_hf_model

    def one_percent_off(*args, **kwargs):
        hf = build(*args, **kwargs)
        hf.model.norm.weight = torch.nn.Parameter(hf.model.norm.weight.detach() * 1.01)
        return hf

    monkeypatch.setattr(export_hf, "build_hf_model", one_percent_off)
    assert export(good, out) == 2
    assert "export refused" in one_error_line(capsys.readouterr().err)
    monkeypatch.undo()
    assert not out.exists() and not list(tmp_path.glob(".hf.partial-*"))

    out.mkdir()
    (out / "notes.txt").write_text("mine")
    for extra in ([], ["--overwrite"]):  # a directory that is not an earlier export is never replaced
        assert export(good, out, *extra) == 2
        one_error_line(capsys.readouterr().err)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    assert export(good, tmp_path / "hf2") == 0 and export(good, tmp_path / "hf2") == 2
    assert export(good, tmp_path / "hf2", "--overwrite") == 0
    # an export with a file of someone else's beside it (or any directory with a config.json):
    # not replaced, nothing deleted
    (tmp_path / "hf2" / "NOTES.md").write_text("mine")
    capsys.readouterr()
    assert export(good, tmp_path / "hf2", "--overwrite") == 2
    assert "holds 'NOTES.md', which an export does not write" in one_error_line(capsys.readouterr().err)
    assert (tmp_path / "hf2" / "NOTES.md").read_text() == "mine"
    (tmp_path / "hf2" / "NOTES.md").unlink()
    # OUT_DIR a link to an earlier export: the export replaces the directory it points to
    (tmp_path / "link").symlink_to(tmp_path / "hf2")
    assert export(good, tmp_path / "link", "--overwrite") == 0
    assert (tmp_path / "link").is_symlink() and (tmp_path / "hf2" / "config.json").is_file()
    assert not list(tmp_path.glob(".link*")) and not list(tmp_path.glob(".hf2*"))
    # the data directory re-prepared since the checkpoint (its meta.json differs): said, since its
    # tokenizer goes into the export
    ckpt = load_checkpoint(good)
    ckpt["data"]["fingerprint"] = "0" * 64
    atomic_torch_save(ckpt, tmp_path / "moved.pt")
    capsys.readouterr()
    assert export(tmp_path / "moved.pt", tmp_path / "hf3") == 0
    assert "saved while training on other data (meta.json differs): the tokenizer of" in capsys.readouterr().err


def test_pickled_code_is_refused_from_the_command_line(tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    evil = tmp_path / "evil.pt"
    torch.save({"format_version": FORMAT_VERSION, "model": {}, "x": Evil()}, evil)
    r = subprocess.run([sys.executable, "export_hf.py", str(evil), str(tmp_path / "hf")], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and not marker.exists() and not (tmp_path / "hf").exists()
    assert "evil.pt: not a loadable checkpoint" in one_error_line(r.stderr)


@pytest.fixture
def llama_dir(tmp_path):
    """A checkpoint transformers itself writes: LlamaForCausalLM(...).save_pretrained."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.1,
                      rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                      bos_token_id=0, eos_token_id=0)
    hf = LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path / "llama")
    return tmp_path / "llama", hf


def first_batch_loss(hf, data_dir, seq_len=32, batch_size=4, seed=7):
    """transformers' model's loss on the batch a fresh run trains on first (tests/helpers.tiny_config)."""
    from training.data import DataStream, TokenWindows

    x, y = next(DataStream(TokenWindows(data_dir, "train", seq_len), batch_size, 1, 0, seed))
    with torch.no_grad():
        return F.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten()).item()


def test_import_llama_then_train_and_resume(tmp_path, stdlib_data, llama_dir, capsys):
    from training import loop
    from training.backend import TorchBackend
    from training.config import load_config
    from training.hf import llama_names

    hf_dir, hf = llama_dir
    init = tmp_path / "init.pt"
    assert export("--import", hf_dir, init) == 0
    printed = capsys.readouterr().out
    ckpt = load_checkpoint(init)
    names = llama_names(2)
    hf_sd = hf.state_dict()
    assert set(ckpt["model"]) == set(names)
    for ours_name, hf_name in names.items():  # the weights, exactly
        assert torch.equal(ckpt["model"][ours_name], hf_sd[hf_name]), ours_name
    model_section = yaml.safe_load(printed[printed.index("model:"):])["model"]
    assert model_section == ckpt["config"]["model"] and model_section["rope_theta"] == 500000.0
    assert (model_section["norm_eps"], model_section["max_seq_len"]) == (1e-6, 64)   # not the defaults
    # the model section alone: the schema's defaults for the rest (data.dir data/stdlib, a learning
    # rate) made sample.py and an export take whatever tokenizer data/stdlib held, and the card
    # describe a training that never was
    assert list(ckpt["config"]) == ["model"]
    assert export(init, tmp_path / "exported") == 2
    assert one_error_line(capsys.readouterr().err).endswith(f"{init}: no data.dir in the stored config; "
                                                            "pass --tokenizer DIR")
    assert export(init, tmp_path / "exported", "--tokenizer", stdlib_data) == 0
    exported = json.loads((tmp_path / "exported" / "config.json").read_text())
    assert (exported["rms_norm_eps"], exported["max_position_embeddings"]) == (1e-6, 64)
    card = (tmp_path / "exported" / "README.md").read_text()
    assert f"- none by this toolkit: the weights of `export_hf.py --import {hf_dir}`" in card
    assert "learning rate" not in card
    capsys.readouterr()
    ours = NashMHC(ModelConfig(**model_section)).eval()
    ours.load_state_dict(ckpt["model"])
    x = tokens(2, 64)
    with torch.no_grad():
        assert (ours(x).logits - hf(x).logits).abs().max() <= 1e-4

    def config(run, *overrides):
        (tmp_path / run).mkdir(exist_ok=True)
        path = tiny_config(tmp_path / run, stdlib_data)
        tree = yaml.safe_load(path.read_text())
        tree["model"] = model_section
        path.write_text(yaml.safe_dump(tree))
        return load_config(path, ["evaluation.interval=0", "checkpoint.interval=2", *overrides])

    want = first_batch_loss(hf, stdlib_data)
    for run, source in (("from_pt", init), ("from_hf_dir", hf_dir)):
        cfg = config(run, "training.max_steps=4", f"checkpoint.init_from={source}")
        assert loop.train(cfg, TorchBackend("cpu")) == 0
        assert f"initial weights from {source}" in capsys.readouterr().err
        first = losses(tmp_path / run / "run")
        assert abs(first[1] - want) <= 1e-5 * want, (first[1], want)  # step 1 ran on the Llama weights

    # resume: the run's own checkpoint wins over init_from, and the steps come out the same
    run_dir = tmp_path / "from_pt" / "run"
    before = losses(run_dir)
    (run_dir / "ckpt_00000004.pt").unlink()
    cfg = config("from_pt", "training.max_steps=4", f"checkpoint.init_from={init}")
    assert loop.train(cfg, TorchBackend("cpu")) == 0
    err = capsys.readouterr().err
    assert "resumed from" in err and "ckpt_00000002.pt" in err and "initial weights" not in err
    assert [m["step"] for m in metrics(run_dir)] == [1, 2, 3, 4]
    after = losses(run_dir)
    for step in (3, 4):
        assert abs(after[step] - before[step]) <= 1e-6 * before[step], step

    # another architecture than the weights': refused, naming the field
    cfg = config("other", "checkpoint.resume=none", "model.d_model=32", f"checkpoint.init_from={init}")
    with pytest.raises(CheckpointError, match="model.d_model: 64 -> 32"):
        loop.train(cfg, TorchBackend("cpu"))
    # the file holds weights only: resuming from it is refused with a pointer to init_from
    cfg = config("from_pt", f"checkpoint.resume={init}")
    with pytest.raises(CheckpointError, match="init_from"):
        loop.train(cfg, TorchBackend("cpu"))


def test_import_tied_llama(tmp_path):
    from safetensors import safe_open
    from transformers import LlamaConfig, LlamaForCausalLM

    from training.hf import load_initial_weights

    torch.manual_seed(1)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=96, num_hidden_layers=1,
                                      num_attention_heads=2, max_position_embeddings=32,
                                      tie_word_embeddings=True, initializer_range=0.2)).eval()
    hf.save_pretrained(tmp_path / "llama")
    with safe_open(tmp_path / "llama" / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys()  # transformers writes tied weights once
    path, init = load_initial_weights(tmp_path / "llama")
    model = NashMHC(ModelConfig(**init["config"]["model"])).eval()
    model.load_state_dict(init["model"])
    assert model.config.tie_embeddings and model.config.n_kv_heads == 2
    assert torch.equal(model.lm_head.weight, hf.lm_head.weight)
    x = tokens(2, 32, vocab=300)
    with torch.no_grad():
        assert (model(x).logits - hf(x).logits).abs().max() <= 1e-4


def test_import_refuses_what_the_baseline_cannot_represent(tmp_path, llama_dir, capsys):
    hf_dir, _ = llama_dir
    cfg = json.loads((hf_dir / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    for key, value, expect in (("mlp_bias", True, "mlp_bias"), ("hidden_act", "gelu", "hidden_act"),
                               ("attention_bias", True, "attention_bias=true"),
                               ("head_dim", 2 * cfg["hidden_size"] // heads,   # Gemma-style wide heads
                                f"head_dim={2 * cfg['hidden_size'] // heads} x num_attention_heads={heads} "
                                f"!= hidden_size={cfg['hidden_size']}"),
                               ("rope_parameters", {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                                "rope_type")):
        (hf_dir / "config.json").write_text(json.dumps({**cfg, key: value}))
        assert export("--import", hf_dir, tmp_path / "x.pt") == 2
        assert expect in one_error_line(capsys.readouterr().err)
    # shapes other than config.json's: each tensor named with both shapes (transformers' own
    # error pointed at a report its muted logging never printed)
    (hf_dir / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 192}))
    assert export("--import", hf_dir, tmp_path / "x.pt") == 2
    assert "'model.layers.0.mlp.down_proj.weight [64, 160] in the file, [64, 192] by config.json'" in \
        one_error_line(capsys.readouterr().err)
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    from safetensors.torch import load_file, save_file
    weights = load_file(hf_dir / "model.safetensors")
    save_file({k: v for k, v in weights.items() if k != "model.layers.1.mlp.up_proj.weight"},
              hf_dir / "model.safetensors", metadata={"format": "pt"})
    assert export("--import", hf_dir, tmp_path / "x.pt") == 2  # transformers would fill it in at random
    assert "model.layers.1.mlp.up_proj.weight" in one_error_line(capsys.readouterr().err)
    (hf_dir / "model.safetensors").unlink()
    assert export("--import", hf_dir, tmp_path / "x.pt") == 2
    assert "safetensors" in one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "x.pt").exists()


def test_import_never_runs_code_from_the_directory(tmp_path, llama_dir, capsys, monkeypatch):
    """A config.json with an auto_map names Python in its directory: transformers offers to import
    it (a prompt on a terminal). --import and checkpoint.init_from read Llama only, never with
    remote code: a user answering yes runs nothing, and each case is one line."""
    import builtins

    from training.checkpoint import CheckpointError
    from training.hf import load_initial_weights

    monkeypatch.setattr(builtins, "input", lambda *a, **k: "y")  # whoever is asked says yes
    hf_dir, _ = llama_dir
    ran = tmp_path / "ran"
    (hf_dir / "evil.py").write_text(f"open({str(ran)!r}, 'w').write('ran')\n"
                                    "from transformers import LlamaConfig as EvilConfig\n")
    cfg = json.loads((hf_dir / "config.json").read_text())
    for model_type in ("evil", "llama"):
        (hf_dir / "config.json").write_text(json.dumps(
            {**cfg, "model_type": model_type, "auto_map": {"AutoConfig": "evil.EvilConfig"}}))
        if model_type == "evil":
            assert export("--import", hf_dir, tmp_path / "x.pt") == 2
            assert "model_type 'evil'; only Llama-architecture" in one_error_line(capsys.readouterr().err)
            with pytest.raises(CheckpointError, match="model_type 'evil'"):
                load_initial_weights(hf_dir)
        else:  # a Llama with an auto_map: imported as Llama, the auto_map ignored
            assert export("--import", hf_dir, tmp_path / "x.pt") == 0
        assert not ran.exists()
    (hf_dir / "config.json").write_text("[1, 2]")
    assert export("--import", hf_dir, tmp_path / "y.pt") == 2
    assert "config.json: not a JSON object" in one_error_line(capsys.readouterr().err)


LM_EVAL_DOCS = [
    ("import os\nimport", [" sys", " json", " re", " hello"], 0),
    ("def main():\n    return", [" None", " 0", " self", " x"], 1),
    ("class Foo(object):\n    def", [" __init__", " run", " bar"], 0),
    ("for i in", [" range(10):", " items:", " x"], 2),
    ("if __name__ ==", [" '__main__':", " 1:", " None:"], 0),
    ("    raise", [" ValueError", " KeyError(key)", " e"], 1),
    ("from collections import", [" OrderedDict", " deque", " namedtuple", " os"], 3),
    ("        self.", ["assertEqual(", "x = 1", "_lock"], 2),
    ("except", [" Exception:", " KeyError:", ":"], 0),
    ("    @", ["property", "staticmethod", "classmethod"], 1),
]


def test_lm_eval_accuracy_matches_our_ranking(tmp_path, nash_export):
    """lm-eval's Python API on the exported remote-code model, with a local multiple-choice task;
    its accuracy is the share of documents whose gold choice our own model ranks first."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager
    from tokenizers import Tokenizer

    ours, out = nash_export
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"context": c, "choices": ch, "gold": g}) + "\n"
                            for c, ch, g in LM_EVAL_DOCS))
    (tmp_path / "task.yaml").write_text(yaml.safe_dump({
        "task": "nash_mhc_local_mc", "dataset_path": "json", "test_split": "test",
        "dataset_kwargs": {"data_files": {"test": str(docs)}, "cache_dir": str(tmp_path / "cache")},
        "output_type": "multiple_choice", "doc_to_text": "{{context}}", "doc_to_choice": "{{choices}}",
        "doc_to_target": "gold", "target_delimiter": "",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]}))
    result = lm_eval.simple_evaluate(
        model="hf", model_args={"pretrained": str(out), "trust_remote_code": True, "dtype": "float32",
                                "device": "cpu"},
        tasks=["nash_mhc_local_mc"], task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
        batch_size=4, log_samples=True, bootstrap_iters=0)
    acc = result["results"]["nash_mhc_local_mc"]["acc,none"]

    # ours: sum of log p(choice | context), the choice's tokens being those of context + choice
    # after the context's (lm-eval's split for causal models)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    correct, ours_ll = 0, {}
    for i, (context, choices, gold) in enumerate(LM_EVAL_DOCS):
        ctx = tok.encode(context).ids
        scores = []
        for choice in choices:
            cont = tok.encode(context + choice).ids[len(ctx):]
            ids = torch.tensor([ctx + cont])
            with torch.no_grad():
                logp = F.log_softmax(ours(ids[:, :-1]).logits.float(), dim=-1)[0, len(ctx) - 1:]
            scores.append(logp.gather(-1, torch.tensor(cont)[:, None]).sum().item())
        ours_ll[i] = scores
        top = max(range(len(choices)), key=scores.__getitem__)
        assert sorted(scores)[-1] - sorted(scores)[-2] > 1e-3  # no near-tie to make the ranking fragile
        correct += top == gold
    assert 0 < correct < len(LM_EVAL_DOCS)  # a ranking that is neither all right nor all wrong
    assert acc == pytest.approx(correct / len(LM_EVAL_DOCS), abs=1e-12)
    for sample in result["samples"]["nash_mhc_local_mc"]:
        theirs = [ll for ll, _ in sample["filtered_resps"]]
        assert theirs == pytest.approx(ours_ll[sample["doc_id"]], abs=1e-4)
