#!/usr/bin/env python3
"""Export a checkpoint to the Hugging Face format, or import Llama weights to start a run from.

    python export_hf.py runs/demo hf/demo                        # a run's newest checkpoint
    python export_hf.py runs/demo/ckpt_00001000.pt hf/demo --dtype bf16
    python export_hf.py --import path/to/llama init.pt           # then checkpoint.init_from=init.pt

Export: CHECKPOINT is a ckpt_*.pt file, a sharded checkpoint directory, or a run directory (its
newest checkpoint that loads). OUT_DIR gets model.safetensors (shards and
model.safetensors.index.json above --max-shard-size), config.json, generation_config.json, the
tokenizer files of the run's data directory and a model card (README.md: the architecture, the
training run, how to load it).
  - The baseline architecture (1 mHC stream, 1 attention scale, no window) is a plain
    LlamaForCausalLM: AutoModelForCausalLM.from_pretrained(OUT_DIR), vLLM and friends load it.
  - Every other architecture is NashMHCForCausalLM, remote code: OUT_DIR holds
    modeling_nash_mhc.py (a thin transformers wrapper) and a copy of model.py, named by
    config.json's auto_map: AutoModelForCausalLM.from_pretrained(OUT_DIR, trust_remote_code=True).
Before OUT_DIR appears, the written files are loaded back with transformers and their logits
compared with the checkpoint's own model (--no-verify skips this). The export is built under a
temporary name next to OUT_DIR and renamed into place; an existing OUT_DIR is replaced only with
--overwrite, and only if it is an earlier export.

Import: HF_DIR is a local Llama-architecture checkpoint (config.json and safetensors). OUT.pt holds
its weights as a Nash-MHC baseline (exactly: the same tensors under our names) and the model
section a run config needs; `checkpoint.init_from` starts a run from it (or from HF_DIR itself).
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import re
import secrets
import shutil
import signal
import sys
from pathlib import Path

import torch
import yaml

from prepare_data import MODEL_INPUT_NAMES, TOKENIZER_FILES, DataError, TokenizerSpec, install
from training.checkpoint import FORMAT_VERSION, CheckpointError, check_checkpoint_out, write_checkpoint_file
from training.config import Config, ConfigError
from training.data import tokenizer_difference, unverified_tokenizer_warning
from training.hf import (SAME_IDS_AS, from_llama_state_dict, llama_incompatibility, load_llama,
                         load_training_checkpoint, max_logit_difference, model_from_checkpoint, model_holding,
                         probe_tokens, to_llama_config, to_llama_state_dict, tokenizer_record)
from training.monitor import log_dir_owner

# transformers takes seconds to import: it is imported where it is used, after the input is checked

PROG = "export_hf.py"
ROOT = Path(__file__).resolve().parent
REMOTE_CODE = ("modeling_nash_mhc.py", "model.py")  # copied verbatim into a remote-code export
AUTO_MAP = {"AutoConfig": "modeling_nash_mhc.NashMHCConfig",
            "AutoModelForCausalLM": "modeling_nash_mhc.NashMHCForCausalLM"}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TOLERANCE = 1e-4  # max |logit difference|, relative to max(1, max |logit|)


class ExportError(Exception):
    """Bad input: reported as one line, no traceback."""


# tokenizers' post-processors that add special tokens around every encoding (a BOS, a CLS)
ADDING_POST_PROCESSORS = ("TemplateProcessing", "BertProcessing", "RobertaProcessing")


def _without_added_tokens(post):
    """A tokenizer.json ``post_processor`` without the parts that add special tokens (None if
    nothing is left)."""
    if not isinstance(post, dict) or post.get("type") in ADDING_POST_PROCESSORS:
        return None
    if post.get("type") == "Sequence":
        kept = [q for q in map(_without_added_tokens, post.get("processors") or []) if q is not None]
        return {**post, "processors": kept} if kept else None
    return post


def export_tokenizer_files(spec: TokenizerSpec, max_seq_len: int) -> dict[str, bytes]:
    """The data's tokenizer files for an export, encoding as training did (prepare_data.py and
    sample.py add no special tokens: an imported tokenizer's template, a Llama-3 BOS say, is left
    out of tokenizer.json and add_bos_token/add_eos_token are off), its tokenizer_config.json set
    for the model: padding on the left (generate() appends to every row's end, so right padding
    would put pad tokens in the middle of a row) and truncation on the left too (sample.py keeps a
    long prompt's last tokens), model_max_length = the model's max_seq_len (truncation=True then
    cuts where the model stops; the default is no limit), split_special_tokens on (a literal
    "<|endoftext|>" in a text is text, as in the training documents: prepare_data.py's
    ``as_document_encoder``), the model's inputs named (``MODEL_INPUT_NAMES``), and a tokenizer
    without a pad token (an imported one, e.g. Llama's) padding with its end-of-text token, as the
    exported generation config does: without one, ``tokenizer(texts, padding=True)`` is an error."""
    files = dict(spec.hf_files)
    tok = json.loads(spec.json_text)
    post = _without_added_tokens(tok.get("post_processor"))
    config = json.loads(files["tokenizer_config.json"])
    if post != tok.get("post_processor"):
        tok["post_processor"] = post
        files["tokenizer.json"] = json.dumps(tok, ensure_ascii=False, indent=2).encode()
        # the same token ids as the file the data was prepared with (no special tokens are added
        # there): checkpoint.init_from of this export goes on with that data (tokenizer_record)
        config[SAME_IDS_AS] = hashlib.sha256(spec.json_text.encode()).hexdigest()
    else:
        files["tokenizer.json"] = spec.json_text.encode()
    config.update(padding_side="left", truncation_side="left", model_max_length=max_seq_len,
                  add_bos_token=False, add_eos_token=False, split_special_tokens=True,
                  model_input_names=list(MODEL_INPUT_NAMES))
    if spec.pad is None and not config.get("pad_token"):
        config["pad_token"] = spec.eos
        specials = json.loads(files.get("special_tokens_map.json", b"null"))
        if isinstance(specials, dict) and not specials.get("pad_token"):
            files["special_tokens_map.json"] = (json.dumps({**specials, "pad_token": spec.eos}, indent=2) + "\n").encode()
    files["tokenizer_config.json"] = (json.dumps(config, indent=2) + "\n").encode()
    return files


def validation_loss(where: Path, step, ckpt: dict) -> float | None:
    """The validation loss logged at ``step`` in the run's metrics.jsonl, if that file is there and
    has it: beside the checkpoint, or in the run's logging.dir when that directory says it holds
    this run's logs (a relative one is looked up from here; a moved checkpoint has none)."""
    log_dir = ((ckpt.get("config") or {}).get("logging") or {}).get("dir")
    folder = where.parent
    if isinstance(log_dir, str) and log_dir:
        folder = Path(log_dir).expanduser()
        if log_dir_owner(folder) != str(where.parent.resolve()):
            return None
    path = folder / "metrics.jsonl"
    found = None
    try:
        with path.open() as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # a line cut by a kill
                if isinstance(rec, dict) and rec.get("step") == step and isinstance(rec.get("eval_loss"), (int, float)):
                    found = float(rec["eval_loss"])
    except OSError:
        return None
    return found


def model_card(name: str, model, ckpt: dict, where: Path, why_remote: str | None, rows: int, dtype: str) -> str:
    """README.md of an export: the Hub's metadata (huggingface_hub's ModelCardData) and what a
    reader needs: what the model is, what it was trained on and how far, and how to load it."""
    from huggingface_hub import ModelCardData

    cfg, stored = model.config, ckpt.get("config") or {}
    data, training = stored.get("data") or {}, stored.get("training") or {}
    step, tokens = ckpt.get("step"), ckpt.get("tokens_seen")
    llama = why_remote is None
    meta = ModelCardData(library_name="transformers", pipeline_tag="text-generation",
                         tags=(["llama"] if llama else ["nash-mhc", "custom_code"]) + [EXPORT_TAG])
    if llama:
        kind = "A Llama-architecture transformer (the Nash-MHC toolkit's baseline: one residual stream, full causal attention)"
        load = f'AutoModelForCausalLM.from_pretrained("{name}")'
        tok_load = f'AutoTokenizer.from_pretrained("{name}")'
        code = ("It loads as `LlamaForCausalLM`, without remote code. Its `generate` does not crop the "
                f"context to the {cfg.max_seq_len} tokens the model was built for, as the toolkit's "
                "sample.py does: a `max_new_tokens` that takes it past them runs at positions never "
                "trained.")
    else:
        kind = "A Nash-MHC transformer"
        load = f'AutoModelForCausalLM.from_pretrained("{name}", trust_remote_code=True)'
        # AutoTokenizer reads config.json's auto_map too: without the flag it asks on a terminal
        tok_load = f'AutoTokenizer.from_pretrained("{name}", trust_remote_code=True)'
        code = ("It loads with remote code: `modeling_nash_mhc.py` and `model.py` in this directory "
                f"(read them before `trust_remote_code=True`; not a Llama because {why_remote}).")
    residual = ("one residual stream" if cfg.mhc_streams == 1 else
                f"{cfg.mhc_streams} mHC residual streams ({'mHC-lite' if cfg.mhc_lite else 'Sinkhorn'} mixing)")
    attention = ("full causal attention" if cfg.nash_scales == 1 and not cfg.nash_window else
                 f"{cfg.nash_scales} attention scale(s) (compression {cfg.nash_compression}, window "
                 f"{cfg.nash_window or 'none'}, {cfg.aggregation} fusion)")
    loss = validation_loss(where, step, ckpt)
    rows_note = f" ({rows - cfg.vocab_size} padding rows past the model's {cfg.vocab_size})" if rows > cfg.vocab_size else ""
    lines = [
        f"# {name}", "",
        f"{kind}, {model.num_params() / 1e6:.2f}M parameters, exported from `{where.name}` at step {step}"
        + (f" ({tokens:,} training tokens)." if isinstance(tokens, int) else "."), "",
        "## Use", "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f"tok = {tok_load}",
        f"model = {load}",
        'out = model.generate(**tok(["def main():"], return_tensors="pt"), max_new_tokens=32)',
        "print(tok.decode(out[0]))",
        "```", "",
        f"{code} The tokenizer pads on the left (for batched `generate`) and truncates at "
        f"{cfg.max_seq_len} tokens, the longest context the model was built for.", "",
        "## Architecture", "",
        "| | |", "|---|---|",
        f"| layers | {cfg.n_layers} |",
        f"| width | {cfg.d_model} (feed-forward {cfg.ffn_hidden}, SwiGLU) |",
        f"| heads | {cfg.n_heads} query, {cfg.n_kv_heads} key/value, {cfg.head_dim} each, RoPE theta {cfg.rope_theta:g} |",
        f"| residual | {residual} |",
        f"| attention | {attention} |",
        f"| vocabulary | {rows}{rows_note}, embeddings {'tied' if cfg.tie_embeddings else 'untied'} |",
        f"| context | {cfg.max_seq_len} tokens |",
        f"| weights | {dtype} |", "",
        "## Training", "",
        *([f"- data: `{Path(str(data.get('dir', '?'))).name}` (prepare_data.py shards), windows of "
           f"{data.get('seq_len', '?')} tokens",
           f"- optimiser: {training.get('optimizer', '?')}, peak learning rate {training.get('learning_rate', '?')}, "
           f"{training.get('precision', '?')} precision",
           f"- step {step}" + (f", {tokens:,} tokens" if isinstance(tokens, int) else "")
           + (f"; validation loss {loss:.4f} at this step (perplexity {math.exp(min(loss, 50.0)):.2f})"
              if loss is not None else "")]
          if data or training else  # a checkpoint of `--import`: weights made elsewhere
          [f"- none by this toolkit: the weights of `{ckpt.get('trainer', '?')}`"]), "",
        "## Limitations", "",
        "A pre-training checkpoint, evaluated only by its loss on held-out text of its training "
        "corpus: no instruction tuning, no safety filtering; what it writes reflects that data.", "",
    ]
    return f"---\n{meta.to_yaml()}\n---\n\n" + "\n".join(lines)


def say(msg: str) -> None:
    print(f"{PROG}: {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------
# Export


# What an export writes: transformers' config, generation config and weights (one file or shards
# and their index), the tokenizer files, and the remote code
EXPORT_FILES = re.compile(r"README\.md|config\.json|generation_config\.json|model(-\d{5}-of-\d{5})?\.safetensors|"
                          r"model\.safetensors\.index\.json|"
                          + "|".join(re.escape(name) for name in (*TOKENIZER_FILES, *REMOTE_CODE)))


# The model card's tag that marks a directory as this script's export (as transformers' Trainer
# tags its cards generated_from_trainer): the names of the files alone are those of any directory
# transformers' save_pretrained writes, such as the Llama an --import read its weights from
EXPORT_TAG = "nash-mhc-toolkit"


def _export_tags(card: Path) -> list:
    from huggingface_hub.repocard import metadata_load

    try:
        tags = (metadata_load(card) or {}).get("tags") if card.is_file() else None
    except (OSError, UnicodeDecodeError, ValueError, yaml.YAMLError):
        return []
    return tags if isinstance(tags, list) else []


def check_out_dir(out: Path, overwrite: bool) -> None:
    """Before any work: OUT_DIR is new or empty, or (with --overwrite) an earlier export: its model
    card carries ``EXPORT_TAG`` and it holds nothing but what an export writes, so replacing it
    deletes no one else's files."""
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise ExportError(f"{out}: directory is not empty; pass --overwrite to replace an earlier export")
        if not (out / "config.json").is_file():
            raise ExportError(f"{out}: holds no config.json, so it is not an earlier export; refusing to replace it")
        if EXPORT_TAG not in _export_tags(out / "README.md"):
            raise ExportError(f"{out}: its README.md has no {EXPORT_TAG!r} tag, which every export of "
                              f"{PROG} carries, so it is not an earlier export; refusing to replace it")
        for name in sorted(p.name for p in out.iterdir()):
            if not EXPORT_FILES.fullmatch(name):
                raise ExportError(f"{out}: holds {name!r}, which an export does not write; refusing to replace it")


def tokenizer_spec(tok_dir: Path):
    """prepare_data.py's reading of a tokenizer directory: tokenizer.json, its special tokens and
    the transformers files to write beside it."""
    if not (tok_dir / "tokenizer.json").is_file():
        raise ExportError(f"{tok_dir}: no tokenizer.json (the run's data directory moved? pass --tokenizer DIR)")
    try:
        return TokenizerSpec.load(str(tok_dir))
    except DataError as e:
        raise ExportError(str(e).replace("--tokenizer ", "", 1)) from None


def vocabulary(model_rows: int, spec) -> tuple[int, list[str]]:
    """The exported vocabulary size and the lines that say how tokenizer ids map onto it."""
    rows = max(model_rows, spec.vocab_size)
    lines = []
    if spec.vocab_size < model_rows:
        lines.append(f"vocabulary: {model_rows} model rows, {spec.vocab_size} tokenizer ids: rows "
                     f"{spec.vocab_size}-{model_rows - 1} are padding no text encodes to")
    elif spec.vocab_size > model_rows:
        lines.append(f"warning: the tokenizer has {spec.vocab_size} ids, the model {model_rows} rows: "
                     f"rows {model_rows}-{spec.vocab_size - 1} are added as zeros (never trained; their "
                     "logits are 0). Was this checkpoint trained with another tokenizer?")
    else:
        lines.append(f"vocabulary: {rows} ids, the tokenizer's and the model's")
    bos = "bos = eos" if spec.bos == spec.eos else f"bos {spec.bos!r} = {spec.bos_id}"
    pad = (f"pad {spec.pad!r} = {spec.pad_id}" if spec.pad is not None
           else f"no pad token: pad_token_id = eos ({spec.eos_id}) for batched generation")
    lines.append(f"special tokens: eos {spec.eos!r} = {spec.eos_id}, {bos}, {pad}")
    return rows, lines


def padded_state_dict(model, rows: int) -> dict:
    """The model's state dict with the vocabulary matrices padded with zero rows up to ``rows``
    (tied embeddings stay one tensor)."""
    sd = dict(model.state_dict())
    extra = rows - model.config.vocab_size
    if extra > 0:
        emb = torch.cat([sd["tok_emb.weight"], sd["tok_emb.weight"].new_zeros(extra, model.config.d_model)])
        sd["lm_head.weight"] = emb if model.config.tie_embeddings else \
            torch.cat([sd["lm_head.weight"], sd["lm_head.weight"].new_zeros(extra, model.config.d_model)])
        sd["tok_emb.weight"] = emb
    return sd


def build_hf_model(model, sd: dict, rows: int, spec):
    """The transformers model holding ``sd``: LlamaForCausalLM for the baseline, else the
    remote-code wrapper. Built on the meta device, then given the checkpoint's tensors."""
    from transformers import GenerationConfig, LlamaForCausalLM

    cfg = model.config
    pad = spec.pad_id if spec.pad_id is not None else spec.eos_id
    ids = dict(bos_token_id=spec.bos_id, eos_token_id=spec.eos_id, pad_token_id=spec.pad_id)
    if llama_incompatibility(cfg) is None:
        with torch.device("meta"):
            hf = LlamaForCausalLM(to_llama_config(cfg, rows, **ids))
        hf.load_state_dict(to_llama_state_dict(sd, cfg), strict=True, assign=True)
        hf.config.rope_theta = cfg.rope_theta  # also where transformers 4.x (and tools on it) read it
        use_cache = True
    else:
        from modeling_nash_mhc import NashMHCConfig, NashMHCForCausalLM

        # activation checkpointing is the run's memory setting, not the model's: an export loads
        # without it, as a Llama export does (activation_checkpointing_enable() turns it on)
        hf_cfg = NashMHCConfig(**dataclasses.replace(cfg, vocab_size=rows, activation_checkpointing=False).to_dict(),
                               **ids)
        hf_cfg.auto_map = dict(AUTO_MAP)
        with torch.device("meta"):
            hf = NashMHCForCausalLM(hf_cfg)
        hf.model.load_state_dict(sd, strict=True, assign=True)
        use_cache = False
    hf.tie_weights()
    # As sample.py: no id past the model's trained rows or the tokenizer's ids (padding rows, which
    # no text encodes to).
    untrained = list(range(min(cfg.vocab_size, spec.vocab_size), rows))
    hf.generation_config = GenerationConfig(bos_token_id=spec.bos_id, eos_token_id=spec.eos_id,
                                            pad_token_id=pad, use_cache=use_cache,
                                            **({"suppress_tokens": untrained} if untrained else {}))
    return hf


def check_tokenizer(ckpt: dict, tok_dir: Path, given: bool) -> None:
    """The tokenizer to ship against the one the checkpoint was trained with: the data.dir's
    holding another one now is refused (every token id would decode to other text); one given
    with --tokenizer is said in a warning (an earlier export's tokenizer.json, rewritten without
    its post-processor, differs in bytes and not in tokens)."""
    differs = tokenizer_difference(ckpt, tok_dir / "tokenizer.json")
    if differs is None:
        return
    if not given:
        raise ExportError(f"{tok_dir}: {differs}: pass --tokenizer DIR holding the model's tokenizer")
    say(f"warning: --tokenizer {tok_dir}: {differs}; exported as given")


def export(args) -> str:
    # the directory itself, not a link to it or ".": the export is renamed into its place
    out = Path(os.path.realpath(Path(args.out).expanduser()))
    check_out_dir(out, args.overwrite)
    where, ckpt = load_training_checkpoint(args.checkpoint, warn=say)
    model = model_from_checkpoint(ckpt, where)
    cfg = model.config
    try:
        data_dir = Path(ckpt["config"]["data"]["dir"]).expanduser()
    except (KeyError, TypeError):
        data_dir = None
    if args.tokenizer is None and data_dir is None:
        raise ExportError(f"{where}: no data.dir in the stored config; pass --tokenizer DIR")
    tok_dir = Path(args.tokenizer).expanduser() if args.tokenizer else data_dir
    changed = args.tokenizer is None and unverified_tokenizer_warning(ckpt, data_dir)
    if changed:
        say(changed)
    check_tokenizer(ckpt, tok_dir, given=args.tokenizer is not None)
    spec = tokenizer_spec(tok_dir)
    rows, vocab_lines = vocabulary(cfg.vocab_size, spec)
    why_remote = llama_incompatibility(cfg)
    kind = "LlamaForCausalLM" if why_remote is None else f"NashMHCForCausalLM, remote code ({why_remote})"
    say(f"{where} (step {ckpt.get('step', '?')}): {model.num_params() / 1e6:.2f}M parameters -> {kind}")
    if why_remote is None and cfg.dropout > 0:
        say(f"warning: model.dropout={cfg.dropout} has no place in LlamaForCausalLM (no dropout on the "
            "embedding or the sub-layer outputs): the same outputs in inference; fine-tuned in "
            "transformers, it trains without dropout")
    for line in vocab_lines:
        say(line)
    step = ckpt.get("step")
    card = model_card(out.name, model, ckpt, where, why_remote, rows, args.dtype)
    del ckpt

    from transformers import LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    dtype = DTYPES[args.dtype]
    hf = build_hf_model(model, padded_state_dict(model, rows), rows, spec).to(dtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.with_name(f".{out.name}.partial-{os.getpid()}-{secrets.token_hex(4)}")
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        hf.save_pretrained(staging, max_shard_size=args.max_shard_size)
        del hf
        for name, data in export_tokenizer_files(spec, model.config.max_seq_len).items():
            (staging / name).write_bytes(data)
        (staging / "README.md").write_text(card)
        if why_remote is not None:
            for name in REMOTE_CODE:
                shutil.copyfile(ROOT / name, staging / name)
        umask = os.umask(0)
        os.umask(umask)
        for f in staging.iterdir():
            f.chmod(0o666 & ~umask)  # safetensors writes its files 0600: readable as every other file
            with open(f, "rb+") as fh:
                os.fsync(fh.fileno())
        check = ""
        if not args.no_verify:
            if why_remote is None:
                loaded = LlamaForCausalLM.from_pretrained(staging, dtype=torch.float32)
            else:
                from modeling_nash_mhc import NashMHCForCausalLM
                loaded = NashMHCForCausalLM.from_pretrained(staging, dtype=torch.float32)
            if loaded.config.vocab_size != rows:
                raise ExportError(f"{staging}: config.json says vocab_size={loaded.config.vocab_size}, not {rows}")
            reference = model.to(dtype).float()  # the exported weights, computed in fp32 as `loaded` is
            reference.init_buffers()  # derived in fp32, as from_pretrained derives them
            diff, scale = max_logit_difference(reference, loaded.eval(), probe_tokens(cfg.vocab_size, cfg.max_seq_len))
            if not diff <= TOLERANCE * max(1.0, scale):
                raise ExportError(f"the exported model's logits differ from the checkpoint's by {diff:.3g} "
                                  f"(max |logit| {scale:.3g}): export refused")
            check = f"; transformers' logits match ours to {diff:.1e}"
        # rename into place, replacing an earlier export only with --overwrite, checked again now
        install(staging, out, args.overwrite, lambda: check_out_dir(out, True), str(out),
                say=lambda m: say(f"warning: {m}"))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    weights = sorted(p.name for p in out.glob("*.safetensors"))
    size = sum((out / w).stat().st_size for w in weights)
    return (f"wrote {out}: step {step}, {len(weights)} safetensors file(s), {size / 1e6:.1f} MB "
            f"{args.dtype}{check}")


# ----------------------------------------------------------------------------------------------
# Import


def import_llama(args) -> str:
    # expanded here: a shell leaves the ~ of --import=~/llama as it is
    hf_dir, out = Path(args.import_dir).expanduser(), Path(args.paths[0]).expanduser()
    try:
        check_checkpoint_out(out, args.overwrite)
    except CheckpointError as e:
        raise ExportError(str(e)) from None
    cfg, hf = load_llama(hf_dir)
    model = model_holding(cfg, from_llama_state_dict(hf.state_dict(), cfg))[0].eval()
    diff, scale = max_logit_difference(model, hf, probe_tokens(cfg.vocab_size, cfg.max_seq_len))
    if not diff <= TOLERANCE * max(1.0, scale):
        raise ExportError(f"{hf_dir}: our logits differ from transformers' by {diff:.3g} "
                          f"(max |logit| {scale:.3g}): import refused")
    del hf
    # The model section alone: the schema's defaults of the others (data.dir data/stdlib, a
    # learning rate, a precision) would pass for this checkpoint's training, and sample.py and an
    # export would take the tokenizer of whatever data/stdlib holds here instead of asking for it.
    run_config = {"model": Config(model=cfg).to_dict()["model"]}
    write_checkpoint_file({
        "format_version": FORMAT_VERSION,
        "model": model.state_dict(),   # weights only: start a run from it with checkpoint.init_from
        "config": run_config,
        "step": 0,
        "trainer": f"{PROG} --import {hf_dir}",
        **({"data": record} if (record := tokenizer_record(hf_dir)) else {}),
    }, out)
    section = yaml.safe_dump({"model": run_config["model"]}, sort_keys=False).rstrip()
    data = (f"prepare_data.py --tokenizer {hf_dir}" if (hf_dir / "tokenizer.json").is_file()
            else "prepare_data.py --tokenizer with this model's tokenizer")
    return (f"wrote {out}: a Nash-MHC baseline with the {model.num_params() / 1e6:.2f}M weights of "
            f"{hf_dir} (logits match transformers' to {diff:.1e}).\nStart a run from it with "
            f"checkpoint.init_from={out}, data from {data}, and this model section:\n{section}")


# ----------------------------------------------------------------------------------------------
# Command line


def shard_size(text: str) -> int:
    """Bytes from "5GB", "500MB", "200KB" (decimal units, as transformers counts them)."""
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
    try:
        value = float(text[:-2]) * units[text[-2:].upper()]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"not a size such as 5GB or 500MB: {text!r}") from None
    if not value >= 1:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return int(value)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of usage + message
        raise ExportError(f"{message} (see --help)")


def main(argv: list[str] | None = None) -> int:
    ap = _Parser(prog=PROG, description=__doc__.split("\n\n")[0],
                 epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+", metavar="PATH", help="CHECKPOINT OUT_DIR (export), or OUT.pt (--import)")
    ap.add_argument("--import", dest="import_dir", metavar="HF_DIR",
                    help="import a local Llama checkpoint directory into OUT.pt instead of exporting")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                    help="weights in the export (default fp32: exactly the checkpoint's)")
    ap.add_argument("--max-shard-size", type=shard_size, default="5GB", metavar="SIZE",
                    help="split model.safetensors above this size, with an index (default 5GB)")
    ap.add_argument("--tokenizer", metavar="DIR",
                    help="tokenizer directory (default: the data.dir of the checkpoint's config)")
    ap.add_argument("--overwrite", action="store_true", help="replace an earlier export (or an earlier checkpoint at OUT.pt)")
    ap.add_argument("--no-verify", action="store_true",
                    help="skip loading the export back and comparing its logits with ours")
    try:
        args = ap.parse_args(argv)
        if args.import_dir is None and len(args.paths) != 2:
            raise ExportError("give CHECKPOINT OUT_DIR (see --help)")
        if args.import_dir is not None and len(args.paths) != 1:
            raise ExportError("--import HF_DIR takes one more argument, OUT.pt (see --help)")
        if args.import_dir is None:
            args.checkpoint, args.out = args.paths
        summary = import_llama(args) if args.import_dir is not None else export(args)
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    except Exception as e:
        if not isinstance(e, (ExportError, CheckpointError, ConfigError, DataError, OSError)):
            raise
        msg = " ".join(str(e).split()) if not isinstance(e, OSError) or not e.filename else \
            f"{e.filename}: {e.strerror}"
        print(f"{PROG}: error: {msg}", file=sys.stderr)
        return 2
    print(summary, flush=True)
    return 0


def _terminate(signum, frame):
    raise KeyboardInterrupt  # a scheduler's SIGTERM: remove the staging directory as for Ctrl+C


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _terminate)
    # transformers imports accelerate, which imports torch_xla: without a PJRT device named it warns
    # that it defaults to the CPU. The export runs on the CPU and touches no XLA device.
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    sys.exit(main())
