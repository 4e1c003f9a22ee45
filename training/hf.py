"""Hugging Face interop: Llama <-> Nash-MHC weights and configs, and the weights a run starts from.

The baseline architecture (1 mHC stream, 1 attention scale, no sliding window) is a Llama model:
pre-norm RMSNorm, rotary embeddings in the rotate-half layout transformers uses, grouped-query
attention, SwiGLU, no biases. Its weights map one to one (no permutation, no reshaping); every
other architecture is exported with remote code (modeling_nash_mhc.py), see export_hf.py.

Nothing here reads a pickle: training checkpoints load through ``training.checkpoint`` (weights
only), Hugging Face checkpoints only from safetensors.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path
from typing import Callable

import torch

from model import ModelConfig, NashMHC

from .checkpoint import CheckpointError, first_line, resolve_checkpoint
from .config import ConfigError, config_from_dict

# ours -> transformers' LlamaForCausalLM, per block and for the rest
_LLAMA_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn.w1.weight": "mlp.gate_proj.weight",
    "ffn.w3.weight": "mlp.up_proj.weight",
    "ffn.w2.weight": "mlp.down_proj.weight",
}
_LLAMA_TOP = {"tok_emb.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
              "lm_head.weight": "lm_head.weight"}


def llama_names(n_layers: int) -> dict[str, str]:
    """Our state-dict names -> LlamaForCausalLM's, for a baseline model of ``n_layers`` blocks."""
    names = dict(_LLAMA_TOP)
    for i in range(n_layers):
        names.update({f"blocks.{i}.{ours}": f"model.layers.{i}.{theirs}" for ours, theirs in _LLAMA_BLOCK.items()})
    return names


def llama_incompatibility(cfg: ModelConfig) -> str | None:
    """Why ``cfg`` is not a plain Llama model, or None if it is (the baseline)."""
    reasons = []
    if cfg.mhc_streams != 1:
        reasons.append(f"mhc_streams={cfg.mhc_streams}")
    if cfg.nash_scales != 1:
        reasons.append(f"nash_scales={cfg.nash_scales}")
    if 0 < cfg.nash_window < cfg.max_seq_len:  # a window covering every sequence is no window
        reasons.append(f"nash_window={cfg.nash_window}")
    return ", ".join(reasons) or None


def to_llama_config(cfg: ModelConfig, vocab_size: int, bos_token_id, eos_token_id, pad_token_id):
    """The LlamaConfig of a baseline model (``vocab_size``: the rows of the exported embedding)."""
    from transformers import LlamaConfig

    assert llama_incompatibility(cfg) is None, llama_incompatibility(cfg)
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.ffn_hidden,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, hidden_act="silu",
        max_position_embeddings=cfg.max_seq_len, initializer_range=cfg.init_std,
        rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        attention_bias=False, mlp_bias=False, attention_dropout=0.0,
        bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id)


def model_config_from_llama(hf, where: str) -> ModelConfig:
    """The baseline ModelConfig of a transformers LlamaConfig, or a CheckpointError naming what
    our model cannot represent."""
    def need(ok: bool, what: str):
        if not ok:
            raise CheckpointError(f"{where}: {what}: the Nash-MHC baseline cannot represent it")

    need(getattr(hf, "hidden_act", "silu") == "silu", f"hidden_act={hf.hidden_act!r} (SwiGLU needs 'silu')")
    need(not getattr(hf, "attention_bias", False), "attention_bias=true")
    need(not getattr(hf, "mlp_bias", False), "mlp_bias=true")
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    need(rope.get("rope_type", "default") == "default",
         f"rope_type={rope.get('rope_type')!r} (only the default rotary embedding is implemented)")
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    need(head_dim * hf.num_attention_heads == hf.hidden_size,
         f"head_dim={head_dim} x num_attention_heads={hf.num_attention_heads} != hidden_size={hf.hidden_size}")
    hidden = hf.intermediate_size
    multiple = math.gcd(hidden, 256)  # ffn_hidden = multiple * ceil(ffn_mult * d_model / multiple)
    try:
        cfg = ModelConfig(
            vocab_size=hf.vocab_size, d_model=hf.hidden_size, n_layers=hf.num_hidden_layers,
            n_heads=hf.num_attention_heads, n_kv_heads=hf.num_key_value_heads or hf.num_attention_heads,
            max_seq_len=hf.max_position_embeddings, ffn_mult=hidden / hf.hidden_size, ffn_multiple_of=multiple,
            rope_theta=float(rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0))),
            norm_eps=hf.rms_norm_eps, tie_embeddings=bool(hf.tie_word_embeddings), dropout=0.0,
            init_std=getattr(hf, "initializer_range", 0.02), mhc_streams=1, nash_scales=1, nash_window=0)
    except ValueError as e:
        raise CheckpointError(f"{where}: {e}") from None
    need(cfg.ffn_hidden == hidden, f"intermediate_size={hidden}")
    return cfg


def to_llama_state_dict(sd: dict, cfg: ModelConfig) -> dict:
    """Our baseline state dict under LlamaForCausalLM's names (the same tensors)."""
    names = llama_names(cfg.n_layers)
    if set(sd) != set(names):
        extra, missing = sorted(set(sd) - set(names)), sorted(set(names) - set(sd))
        raise CheckpointError(f"the baseline's parameters are not Llama's (unmapped {extra[:3]}, missing "
                              f"{missing[:3]}): model.py and training/hf.py disagree")
    return {names[k]: v for k, v in sd.items()}


def from_llama_state_dict(sd: dict, cfg: ModelConfig) -> dict:
    """A LlamaForCausalLM state dict under our names (the same tensors)."""
    ours = {theirs: name for name, theirs in llama_names(cfg.n_layers).items()}
    if set(sd) != set(ours):
        extra, missing = sorted(set(sd) - set(ours)), sorted(set(ours) - set(sd))
        raise CheckpointError(f"unexpected Llama parameters {extra[:3]}, missing {missing[:3]}")
    return {ours[k]: v for k, v in sd.items()}


def load_llama(path: str | Path):
    """``(ModelConfig, LlamaForCausalLM in fp32)`` of a local Llama-architecture checkpoint
    directory (config.json and safetensors: a ``.bin`` would be unpickled, so it is refused)."""
    path = Path(path).expanduser()
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path}: no config.json (not a Hugging Face checkpoint directory)")
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    # model_type first, from the JSON: transformers, given a config.json with an auto_map, would
    # offer to import that directory's Python (a prompt on a terminal); only Llama is read, and
    # never with remote code
    try:
        model_type = json.loads((path / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{path}/config.json: not a JSON object ({first_line(e)})") from None
    if model_type != "llama":
        raise CheckpointError(f"{path}: model_type {model_type!r}; only Llama-architecture "
                              "checkpoints (model_type 'llama') import")
    try:
        hf_cfg = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except Exception as e:  # bad values
        raise CheckpointError(f"{path}: config.json does not load ({first_line(e)})") from None
    cfg = model_config_from_llama(hf_cfg, str(path))
    if not any(path.glob("*.safetensors")):
        raise CheckpointError(f"{path}: no *.safetensors weights (pickled .bin checkpoints are not read)")
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        model, info = LlamaForCausalLM.from_pretrained(
            path, config=hf_cfg, dtype=torch.float32, use_safetensors=True, local_files_only=True,
            trust_remote_code=False, output_loading_info=True,
            # a tensor of another shape than config.json's is then named in the info (refused
            # below), where transformers' own error points at a report the muted logging hides
            ignore_mismatched_sizes=True)
    except Exception as e:
        raise CheckpointError(f"{path}: weights do not load ({first_line(e)})") from None
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    info["mismatched_keys"] = [f"{k} {list(a)} in the file, {list(b)} by config.json"
                               for k, a, b in info.get("mismatched_keys") or []]
    bad = {k: sorted(map(str, v))[:3] for k, v in info.items()
           if k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs") and v}
    if bad:  # transformers would fill missing weights with random values: never start from those
        raise CheckpointError(f"{path}: weights do not match config.json ({bad})")
    return cfg, model.eval()


def load_training_checkpoint(path: str | Path, warn: Callable[[str], None] = print) -> tuple[Path, dict]:
    """A checkpoint file, a checkpoint directory, or a run directory (its newest committed
    checkpoint that loads), weights and config only: ``training.checkpoint``'s one loader."""
    return resolve_checkpoint(path, warn, with_optimizer=False)


def model_from_checkpoint(ckpt: dict, where) -> NashMHC:
    """The fp32 NashMHC a training checkpoint holds; a CheckpointError if its config or weights
    are not an architecture this model.py builds."""
    try:
        cfg = config_from_dict(ckpt["config"]).model
    except (ConfigError, KeyError, TypeError) as e:
        raise CheckpointError(f"{where}: unknown architecture (stored config: {first_line(e)})") from None
    try:
        model, result = model_holding(cfg, ckpt["model"], strict=False)
    except RuntimeError as e:  # shape mismatch: torch's first line is a heading, the next ones name each tensor
        detail = next((ln.strip() for ln in str(e).splitlines() if "mismatch" in ln), first_line(e))
        raise CheckpointError(f"{where}: weights do not fit the stored config ({detail[:300]})") from None
    if result.missing_keys or result.unexpected_keys:
        raise CheckpointError(f"{where}: unknown architecture: weights and stored config disagree (missing "
                              f"{sorted(result.missing_keys)[:3]}, unexpected {sorted(result.unexpected_keys)[:3]})")
    return model.eval()


def model_holding(cfg: ModelConfig, sd: dict, strict: bool = True):
    """``(NashMHC(cfg) whose parameters are sd's tensors, load_state_dict's result)``: built on the
    meta device, so there is no random init and no second copy of the weights (an 8B import held
    two fp32 models at once), then its derived buffers made on the CPU."""
    with torch.device("meta"):
        model = NashMHC(cfg)
    result = model.load_state_dict(sd, strict=strict, assign=True)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.tok_emb.weight
    for m in model.modules():  # what is still on meta are the derived buffers
        for name, buf in list(m.named_buffers(recurse=False)):
            if buf.is_meta:
                m.register_buffer(name, torch.empty_like(buf, device="cpu"), persistent=False)
    model.init_buffers()
    return model, result


# tokenizer_config.json of an export whose tokenizer.json lost a template that adds special tokens:
# the sha256 of the tokenizer.json it encodes documents as (export_hf.export_tokenizer_files)
SAME_IDS_AS = "nash_mhc_same_ids_as_sha256"


def tokenizer_record(hf_dir: Path) -> dict | None:
    """What a checkpoint records of its data's tokenizer (``data.tokenizer_sha256``, the sha256 of
    tokenizer.json's bytes, as prepare_data.py's meta.json has it), for the weights of a Hugging
    Face directory with a tokenizer.json: ``prepare_data.py --tokenizer HF_DIR`` keeps those bytes,
    so data of that tokenizer passes ``check_same_tokenizer`` and data of another is refused."""
    f = Path(hf_dir) / "tokenizer.json"
    if not f.is_file():
        return None
    record = {"tokenizer_sha256": hashlib.sha256(f.read_bytes()).hexdigest()}
    # An export whose tokenizer.json lost a template that adds special tokens (export_hf.py) names
    # the file it encodes documents as: data prepared with either has the same token ids.
    try:
        same = json.loads((Path(hf_dir) / "tokenizer_config.json").read_text()).get(SAME_IDS_AS)
    except (OSError, ValueError, AttributeError):
        same = None
    if isinstance(same, str) and re.fullmatch(r"[0-9a-f]{64}", same):
        record["tokenizer_sha256_same_ids"] = same
    return record


def load_initial_weights(path: str | Path, warn: Callable[[str], None] = print) -> tuple[Path, dict]:
    """The weights ``checkpoint.init_from`` names, as ``(path, {"model": state_dict, "config":
    {"model": ...}})`` (and a training checkpoint's ``"data"``: what it was trained on): a Hugging
    Face Llama directory, a file written by ``export_hf.py --import``, a training checkpoint (file
    or directory) or a run directory."""
    p = Path(path).expanduser()
    if (p / "config.json").is_file():
        cfg, hf = load_llama(p)
        model, _ = model_holding(cfg, from_llama_state_dict(hf.state_dict(), cfg))
        return p, {"model": model.state_dict(), "config": {"model": cfg.to_dict()}, "data": tokenizer_record(p)}
    where, ckpt = load_training_checkpoint(p, warn)
    return where, {"model": model_from_checkpoint(ckpt, where).state_dict(), "config": ckpt["config"],
                   "data": ckpt.get("data")}


def probe_tokens(vocab_size: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    """A fixed [2, min(seq_len, 64)] batch of token ids for comparing two implementations."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (2, min(seq_len, 64)), generator=g)


@torch.no_grad()
def max_logit_difference(ours: NashMHC, theirs, tokens: torch.Tensor) -> tuple[float, float]:
    """``(max |ours - theirs|, max |ours|)`` over the logits of ``tokens`` (our vocabulary rows;
    ``theirs`` is a transformers model)."""
    a = ours(tokens).logits.float()
    b = theirs(input_ids=tokens).logits.float()[..., :a.shape[-1]]
    return float((a - b).abs().max()), float(a.abs().max())
