"""Nash-MHC for Hugging Face transformers: a thin wrapper around model.py.

export_hf.py writes this file and a verbatim copy of model.py next to config.json, and names them
in config.json's ``auto_map``, so an exported directory loads with

    AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)

The wrapper adds no maths: ``NashMHCForCausalLM.model`` is model.py's ``NashMHC`` and its weights
are the training checkpoint's, under a ``model.`` prefix. ``NashMHCConfig`` holds model.py's
``ModelConfig`` fields as they are (with the standard transformers names mapped onto them).

There is no KV cache: every generated token recomputes the context, cropped to ``max_seq_len``
exactly as ``NashMHC.generate`` does, so greedy decoding gives the same tokens.
"""
from __future__ import annotations

import importlib

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

try:
    from transformers import PreTrainedConfig
except ImportError:  # transformers 4.x
    from transformers import PretrainedConfig as PreTrainedConfig

if __package__:  # an exported directory: transformers imports this file from a package holding model.py
    from .model import ModelConfig, NashMHC
else:  # the repository (export_hf.py, the tests): model.py is a module beside this file. Not in a
    # fallback for an ImportError, which would hide one raised inside the export's own model.py
    # behind whatever "model" module a user's path holds; and not `from model import`, which
    # transformers' check of a remote-code file's imports would take for a package it needs
    _model = importlib.import_module("model")
    ModelConfig, NashMHC = _model.ModelConfig, _model.NashMHC


class NashMHCConfig(PreTrainedConfig):
    """model.py's ``ModelConfig`` fields (checked by it) plus the special token ids."""

    model_type = "nash_mhc"
    attribute_map = {
        "hidden_size": "d_model",
        "num_hidden_layers": "n_layers",
        "num_attention_heads": "n_heads",
        "num_key_value_heads": "n_kv_heads",
        "max_position_embeddings": "max_seq_len",
        "rms_norm_eps": "norm_eps",
        "tie_word_embeddings": "tie_embeddings",
    }

    def __init__(self, bos_token_id=None, eos_token_id=None, pad_token_id=None, use_cache=False, **kwargs):
        fields = ModelConfig().to_dict()
        for key in list(kwargs):
            name = self.attribute_map.get(key, key)
            if name in fields:
                fields[name] = kwargs.pop(key)
        ModelConfig.from_dict(fields)  # the model's own checks: one line naming the field
        super().__init__(**kwargs)
        for name, value in fields.items():
            setattr(self, name, value)
        self.bos_token_id, self.eos_token_id, self.pad_token_id = bos_token_id, eos_token_id, pad_token_id
        self.use_cache = use_cache  # there is no KV cache

    def model_config(self) -> ModelConfig:
        return ModelConfig.from_dict({name: getattr(self, name) for name in ModelConfig().to_dict()})

    # LlamaConfig's names of what model.py derives, for tools that read them (read only)
    @property
    def head_dim(self) -> int:
        return self.model_config().head_dim

    @property
    def intermediate_size(self) -> int:
        return self.model_config().ffn_hidden

    @property
    def hidden_act(self) -> str:
        return "silu"  # SwiGLU's gate


class NashMHCForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = NashMHCConfig
    base_model_prefix = "model"
    _no_split_modules = ["Block"]
    _tied_weights_keys = {"model.lm_head.weight": "model.tok_emb.weight"}  # when tie_embeddings
    supports_gradient_checkpointing = True
    _supports_sdpa = True  # model.py's attention is torch's scaled_dot_product_attention

    def __init__(self, config: NashMHCConfig):
        super().__init__(config)
        self.model = NashMHC(config.model_config())
        self.gradient_checkpointing = bool(config.activation_checkpointing)
        self.post_init()

    @torch.no_grad()
    def _init_weights(self, module):
        """transformers calls this for each module with parameters it did not load (from_pretrained
        builds the model on the meta device): NashMHC's own initialisation of that module (a
        ParameterList is its owner's), keeping any parameter of it that was loaded. The derived
        buffers are rebuilt with NashMHC itself."""
        if isinstance(module, NashMHC):
            module.init_buffers()
            return
        # module -> name, built once for the from_pretrained walk over every module (per call it was
        # quadratic in the modules); again when a module is new (resize_token_embeddings)
        names = self.__dict__.get("_module_names")
        if names is None or (module not in names and not isinstance(module, nn.ParameterList)):
            names = self.__dict__["_module_names"] = {m: name for name, m in self.model.named_modules()}
        if isinstance(module, nn.ParameterList):
            module = next((m for m in names if any(c is module for c in m.children())), None)
        if module not in names:
            return
        loaded = {p: p.detach().clone() for p in module.parameters() if getattr(p, "_is_hf_initialized", False)}
        self.model.init_module(names[module], module)
        for p, value in loaded.items():
            p.copy_(value)

    def _set_gradient_checkpointing(self, enable: bool = True, gradient_checkpointing_func=None,
                                    every_n_layers: int = 1, **kwargs):
        """activation_checkpointing_enable() (4.x: gradient_checkpointing_enable()): model.py's
        activation checkpointing of every block, with transformers' checkpoint function.
        ``gradient_checkpointing`` is the attribute transformers' ``is_activation_checkpointing``
        (``is_gradient_checkpointing``) looks for on the modules."""
        if enable and every_n_layers != 1:
            raise ValueError(f"every_n_layers={every_n_layers}: Nash-MHC checkpoints every block or none "
                             "(every_n_layers=1)")
        self.model.config.activation_checkpointing = self.config.activation_checkpointing = enable
        self.gradient_checkpointing = enable
        if enable and gradient_checkpointing_func is not None:
            self.model.checkpoint_fn = gradient_checkpointing_func

    def get_input_embeddings(self):
        return self.model.tok_emb

    def set_input_embeddings(self, value: nn.Embedding):
        """resize_token_embeddings(): the new table, and the vocabulary size model.py reads."""
        self.model.tok_emb = value
        self.model.config.vocab_size = self.config.vocab_size = value.num_embeddings
        if self.config.tie_embeddings:
            self.model.lm_head.weight = value.weight

    def get_output_embeddings(self):
        return self.model.lm_head

    def set_output_embeddings(self, value: nn.Linear):
        self.model.lm_head = value

    def forward(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
                labels: torch.LongTensor | None = None, **kwargs) -> CausalLMOutput:
        """Logits ``[B, T, vocab]``; ``labels`` give transformers' shifted causal-LM loss.

        ``attention_mask`` may mark padding on either side of each row. The model has no padding
        mask: right padding cannot change a causal model's earlier outputs, so right-padded (or
        unpadded) batches run as one; a batch with left padding runs row by row on each row's own
        tokens (positions then start at 0 as they do in training), and padded positions get
        zero logits. What the model cannot give is an error, not ignored: ``inputs_embeds``, a
        KV cache, hidden states, and ``position_ids`` other than each row's 0, 1, 2, ...
        """
        for name in ("inputs_embeds", "past_key_values"):
            if kwargs.get(name) is not None:
                raise ValueError(f"NashMHCForCausalLM does not take {name}")
        if kwargs.get("output_hidden_states") or kwargs.get("output_attentions"):
            raise ValueError("NashMHCForCausalLM returns no hidden states or attentions (its residual is "
                             "mhc_streams streams per layer; model.py's NashMHC.trunk gives the final one)")
        position_ids = kwargs.get("position_ids")
        if position_ids is not None and not torch.equal(
                position_ids, torch.arange(input_ids.shape[1], device=position_ids.device).expand_as(position_ids)):
            raise ValueError("NashMHCForCausalLM takes no position_ids: positions are 0, 1, 2, ... in each "
                             "row's own tokens (packed sequences are not supported)")
        if attention_mask is None:
            logits = self.model(input_ids).logits
        else:
            mask = attention_mask.bool()
            lengths = mask.sum(dim=1)
            right_padded = torch.equal(mask, torch.arange(mask.shape[1], device=mask.device) < lengths[:, None])
            if right_padded:
                logits = self.model(input_ids).logits
            else:
                logits = None
                for b in range(input_ids.shape[0]):
                    keep = mask[b].nonzero().flatten()
                    if keep.numel() == 0:
                        continue
                    start, stop = int(keep[0]), int(keep[-1]) + 1
                    if stop - start != keep.numel():
                        # generate() after right padding: the next token would be read off a pad
                        raise ValueError("attention_mask must be one run of ones per row; for generate(), pad "
                                         "on the left (the exported tokenizer's padding_side)")
                    row = self.model(input_ids[b:b + 1, start:stop]).logits[0]
                    if logits is None:
                        logits = row.new_zeros(*input_ids.shape, row.shape[-1])
                    logits[b, start:stop] = row
                if logits is None:
                    raise ValueError("attention_mask masks every token")
        loss = None
        if labels is not None:
            # num_items_in_batch: the Trainer's token count over all accumulated micro-batches (a sum
            # divided by it, not a mean): without it, gradient accumulation would scale the loss.
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size,
                                      num_items_in_batch=kwargs.get("num_items_in_batch"))
        if kwargs.get("return_dict") is False:
            return (logits,) if loss is None else (loss, logits)
        return CausalLMOutput(loss=loss, logits=logits)

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        """The whole context at every step (no KV cache), cropped to max_seq_len as in NashMHC.generate.
        Outputs asked of generate() go on to forward(), which refuses those the model cannot give."""
        n = self.config.max_seq_len
        inputs = {"input_ids": input_ids[:, -n:]}
        if attention_mask is not None:
            inputs["attention_mask"] = attention_mask[:, -n:]
        for flag in ("output_hidden_states", "output_attentions"):
            if kwargs.get(flag):
                inputs[flag] = kwargs[flag]
        return inputs

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # generate() must not build a KV cache this model would ignore
