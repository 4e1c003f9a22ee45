"""The run configuration: one strict schema shared by train.py and train_xla.py.

A YAML file has the sections below; every key is optional and defaults to the value given here.
``python train.py CONFIG section.key=value ...`` overrides any key, typed as the schema says.
Unknown keys, wrong types and impossible values raise ``ConfigError`` with one line that names the
key (and, for a misspelt key, the closest valid one); the entry points print it and exit 2.

The ``model`` section is ``model.ModelConfig`` itself, so the model owns its own fields and checks.
"""
from __future__ import annotations

import copy
import dataclasses
import datetime
import difflib
import json
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import yaml

from model import ModelConfig, unique_key_loader


class ConfigError(ValueError):
    """A bad configuration: the message is one line naming the key or file."""


def _help(text: str, key: str | None = None, **kw) -> Any:
    """A field with its help text; ``key``: its name in YAML when that is a Python keyword."""
    return field(metadata={"help": text, **({"key": key} if key else {})}, **kw)


def _key(f: dataclasses.Field) -> str:
    """A field's name in YAML and overrides (``checkpoint.async`` is the field ``async_``)."""
    return f.metadata.get("key", f.name)


@dataclass
class DataConfig:
    dir: str = _help("directory written by prepare_data.py (meta.json, train_*.npy, val_*.npy)",
                     default="data/stdlib")
    seq_len: int = _help("tokens per training sample (a window of seq_len + 1 tokens gives inputs and "
                         "targets); at most model.max_seq_len", default=256)
    num_workers: int = _help("DataLoader worker processes per trainer process", default=1)


@dataclass
class TrainingConfig:
    batch_size: int = _help("samples per device per micro-step (global in xla.mode=spmd)", default=16)
    gradient_accumulation_steps: int = _help("micro-steps per optimiser step", default=1)
    max_steps: Optional[int] = _help("optimiser steps to run; give this or total_tokens", default=None)
    total_tokens: Optional[int] = _help(
        "token budget: steps = total_tokens / (batch_size x replicas x accumulation x seq_len)",
        default=None)
    learning_rate: float = _help("peak learning rate", default=3e-3)
    min_lr_ratio: float = _help("the decay ends at min_lr_ratio x learning_rate (at the last step)", default=0.1)
    warmup_steps: int = _help("linear warmup steps", default=100)
    schedule: Literal["cosine", "wsd"] = _help(
        "after the warmup: cosine (decays from the peak to the last step), or wsd (warmup-stable-decay: "
        "the peak until the last decay_ratio of the steps, which decay as decay_shape; a checkpoint of "
        "its stable part resumes with more steps as if they had been planned)", default="cosine")
    decay_ratio: float = _help("schedule=wsd: the share of the steps that decays, in (0, 1]", default=0.2)
    decay_shape: Literal["linear", "1-sqrt", "cosine"] = _help(
        "schedule=wsd: the decay's shape (1-sqrt: 1 - sqrt(progress), Hägele et al. 2024)", default="linear")
    weight_decay: float = _help("decoupled weight decay on matrices (not on norms, biases, "
                                "embeddings, mHC gates/biases)", default=0.1)
    betas: tuple[float, float] = _help("Adam betas", default=(0.9, 0.95))
    eps: float = _help("Adam epsilon", default=1e-8)
    grad_clip: float = _help("clip the global gradient norm to this (0 disables)", default=1.0)
    optimizer: Literal["adamw", "muon"] = _help(
        "adamw, or muon (Newton-Schulz orthogonalised momentum on 2-D hidden matrices, AdamW for the "
        "rest)", default="adamw")
    muon_lr: float = _help("learning rate of the Muon matrices (optimizer=muon)", default=0.02)
    muon_momentum: float = _help("Muon momentum (Nesterov)", default=0.95)
    precision: Literal["bf16", "fp32"] = _help(
        "bf16 autocast (fp32 master weights), or fp32 (train.py on CUDA: matmuls in TF32); bf16 falls back "
        "to fp32 with a warning where unsupported", default="bf16")
    seed: int = _help("seed for initialisation, data order and dropout (drawn per step and replica)",
                      default=1337)
    compile: bool = _help("torch.compile each block and the loss (train.py on CUDA): one block graph every "
                          "layer reuses; model.loss_chunk's chunked loss stays eager", default=False)
    device: str = _help("train.py: auto (cuda, then mps, then cpu), cuda, cuda:N, mps or cpu",
                        default="auto")
    cpu_malloc: Literal["tuned", "default"] = _help(
        "train.py on the CPU (glibc: Linux): tuned keeps freed memory in the process's heap (mmap "
        "threshold 32 MiB, trim threshold 1 GiB) where glibc's defaults give most of a step's freed "
        "activations back to the kernel and fault them in again the next step, as jemalloc or "
        "tcmalloc would (PyTorch's CPU tuning guide; with either preloaded, nothing is changed); "
        "default leaves glibc's own settings", default="tuned")
    fsdp: bool = _help("train.py under torchrun: shard parameters, gradients and optimizer state "
                       "over the processes with FSDP2 (fully_shard per block); checkpoints become "
                       "DCP directories", default=False)
    max_nonfinite_steps: int = _help(
        "stop (saving the last good state) after this many NaN/Inf steps in a row; each such step "
        "skips its update", default=5)
    dist_timeout_s: Optional[float] = _help(
        "seconds a collective between processes may wait before the run fails (torchrun's process "
        "groups, train_xla.py's host group), also the start's rendezvous: longer than any gap between "
        "collectives (the compile warm-up, loading or writing a checkpoint); null: torch's defaults, "
        "10 min with nccl, 30 with gloo",
        default=None)


@dataclass
class EvaluationConfig:
    interval: int = _help("evaluate every this many steps (0: only at the end)", default=200)
    steps: int = _help("validation batches per evaluation, each batch_size per replica x replicas sequences "
                       "(accumulation aside): the same samples at every evaluation while those stay the same",
                       default=20)


@dataclass
class CheckpointConfig:
    dir: str = _help("run directory: checkpoints (and the logs, unless logging.dir is set)", default="runs/demo")
    interval: int = _help("save every this many steps (0: only at the end and on SIGTERM)", default=500)
    keep: int = _help("complete checkpoints kept (oldest deleted first)", default=3)
    keep_every: int = _help("checkpoints at a multiple of this step are kept besides, never deleted "
                            "(0: none): milestones to evaluate later or, with training.schedule=wsd, "
                            "to start decays of other lengths from", default=0)
    resume: str = _help("auto (newest committed checkpoint in dir, if any), none, or a checkpoint "
                        "path (a ckpt_*.pt file, a ckpt_* directory, or a run directory: its newest)", default="auto")
    async_: bool = _help("copy the state to host memory at the step and write it in a background "
                         "thread while training goes on (at most one save pending)", key="async",
                         default=False)
    init_from: Optional[str] = _help(
        "a run that starts from step 0 takes its weights from here: a Hugging Face Llama directory, a "
        "file from export_hf.py --import, a checkpoint or a run directory (architecture as model:; "
        "unused when the run resumes)", default=None)


@dataclass
class WandbConfig:
    enabled: bool = _help("log to Weights & Biases (never required)", default=False)
    project: str = _help("W&B project", default="nash-mhc")
    entity: Optional[str] = _help("W&B entity (team or user)", default=None)
    run_name: Optional[str] = _help("W&B run name (default: the run directory's name)", default=None)
    mode: Literal["online", "offline", "disabled"] = _help(
        "W&B mode; offline needs no account", default="offline")


@dataclass
class LoggingConfig:
    interval: int = _help("log (and sync with the device) every this many steps", default=10)
    profile_start: int = _help(
        "trace profile_steps optimiser steps from this one (1-based; 0: none) into <logging.dir>/profile/: "
        "torch.profiler's Chrome trace per process on train.py, torch_xla's XProf trace on train_xla.py "
        "(TensorBoard's profile plugin); after warm-up, e.g. 10. Ends with a wait for the device",
        default=0)
    profile_steps: int = _help("steps in the profiler trace", default=3)
    dir: Optional[str] = _help(
        "where the master process writes metrics.jsonl, TensorBoard's tb/, W&B's files and the XLA "
        "compile metrics (null: checkpoint.dir). Set it to a local directory when checkpoint.dir is "
        "a gcsfuse bucket: gcsfuse uploads a file when it is closed, so logs there appear only at "
        "the end of the run", default=None)
    tensorboard: bool = _help("write TensorBoard event files to tb/ in logging.dir", default=True)
    progress_bar: bool = _help("tqdm progress bar on the master process", default=True)
    peak_flops: Optional[float] = _help(
        "peak FLOP/s of one device for MFU (default: looked up for known GPUs/TPUs)", default=None)
    wandb: WandbConfig = field(default_factory=WandbConfig, metadata={"help": "Weights & Biases"})


@dataclass
class MeshConfig:
    data: int = _help("data-parallel axis size (over all slices)", default=1)
    fsdp: int = _help("FSDP axis size (parameters and optimiser state sharded)", default=1)
    tp: int = _help("tensor-parallel axis size: splits attention by heads and the FFN by hidden units, so "
                    "it divides model.n_heads, model.n_kv_heads and the FFN's hidden size; kept within a host",
                    default=1)
    dcn_data: int = _help("multi-slice: how many slices the data axis spans (over the data-center "
                          "network); divides data. On TPU the mesh follows the physical topology "
                          "(torch_xla's HybridMesh)", default=1)


@dataclass
class XLAConfig:
    mode: Literal["ddp", "spmd"] = _help(
        "ddp: one process per core (xmp.spawn); spmd: one process, a data/fsdp/tp device mesh",
        default="ddp")
    mesh: MeshConfig = field(default_factory=MeshConfig,
                             metadata={"help": "SPMD mesh; data x fsdp x tp must equal the device count"})
    shard_optimizer_over_data: bool = _help(
        "spmd: shard gradients and optimiser state over data x fsdp (ZeRO-2) instead of replicating "
        "them over data: 1/data of their memory for the same traffic", default=True)
    compile_cache: Optional[str] = _help(
        "persistent XLA compilation cache directory (one subdirectory per process); empty disables",
        default="~/.cache/nash_mhc/xla")
    nprocs: Optional[int] = _help("xmp.spawn processes: null (one per core/chip; on PJRT CPU with one "
                                  "device, this process) or 1 (this process; torch_xla 2.9 accepts "
                                  "nothing else)", default=None)
    scan_layers: bool = _help("run the blocks as one compiled loop (torch_xla's scan): compile time "
                              "and graph size stop growing with model.n_layers", default=False)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig, metadata={"help": "model.ModelConfig"})
    data: DataConfig = field(default_factory=DataConfig, metadata={"help": "data"})
    training: TrainingConfig = field(default_factory=TrainingConfig, metadata={"help": "training"})
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig, metadata={"help": "evaluation"})
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig, metadata={"help": "checkpoints"})
    logging: LoggingConfig = field(default_factory=LoggingConfig, metadata={"help": "logging"})
    xla: XLAConfig = field(default_factory=XLAConfig, metadata={"help": "train_xla.py"})

    def to_dict(self) -> dict:
        return _to_plain(self)

    # -- derived quantities -------------------------------------------------------------------
    def tokens_per_step(self, replicas: int) -> int:
        """Tokens consumed by one optimiser step over all replicas."""
        t = self.training
        return t.batch_size * replicas * t.gradient_accumulation_steps * self.data.seq_len

    def resolve_steps(self, replicas: int, step: int = 0, tokens_seen: int = 0) -> int:
        """The step the run ends at: training.max_steps; or, with training.total_tokens, the steps
        that reach it from ``step`` with ``tokens_seen`` tokens already trained on (at least one in
        a fresh run). A resumed run with other tokens per step keeps its budget so."""
        t = self.training
        if t.max_steps is not None:
            return t.max_steps
        if step == 0:
            return max(1, t.total_tokens // self.tokens_per_step(replicas))
        return step + max(0, t.total_tokens - tokens_seen) // self.tokens_per_step(replicas)


# ----------------------------------------------------------------------------------------------
# Building dataclasses from plain data, strictly.

def yaml_value(v: Any) -> str:
    """A config value as a message shows it, in YAML's spelling (true, null, [1, 2]), so that it
    reads as what one writes in a config file or override, not as Python's True or None."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(yaml_value(x) for x in v) + "]"
    return repr(v)


def _to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {_key(f): _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple):
        return [_to_plain(v) for v in obj]
    return obj


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is tuple:
        return "[" + ", ".join(_type_name(a) for a in typing.get_args(tp)) + "]"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


class _Scalar:
    """A scalar as written (an override's value, or a plain YAML scalar in a config file) and YAML's
    reading of it. A string key takes the text as written: ``checkpoint.dir=0100`` is the octal 64
    to YAML, ``run_name=2024_01`` the integer 202401, ``run_name=on`` true, and in an override
    ``checkpoint.dir=runs/lr sweep #3`` is cut at the comment; on the command line a run name
    ``sweep: lr 3e-4`` or ``[ablation]`` is a mapping or a list to YAML, and text here. Quoted text
    and null keep YAML's reading, as do the lists and mappings of a config file (YAML there)."""

    _NULLS = ("~", "null", "Null", "NULL")

    def __init__(self, text: str, value: Any, quoted: bool = False):
        self.text, self.value, self.quoted = text, value, quoted

    def resolve(self, tp: Any) -> Any:
        args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
        textual = str in args or any(typing.get_origin(a) is Literal and all(isinstance(c, str) for c in
                                                                              typing.get_args(a)) for a in args)
        if not textual or self.quoted:
            return self.value
        if self.value is None and self.text.strip() in self._NULLS:
            return None
        return self.text.strip()

    def __repr__(self) -> str:  # error messages show lists and mappings as they were written
        return repr(self.value)


class _ConfigLoader(unique_key_loader()):
    """model.py's loader (PyYAML's safe loader; a key given twice in one mapping is an error), whose
    plain scalars that are not strings (numbers, booleans, dates) also keep their text, for string
    keys (``_Scalar``; keys themselves stay plain)."""

    def construct_object(self, node, deep=False):
        value = super().construct_object(node, deep)
        if isinstance(node, yaml.ScalarNode) and node.style is None and \
                isinstance(value, (bool, int, float, datetime.date)):
            return _Scalar(node.value, value)
        return value

    @staticmethod
    def _key(obj):
        return _plain(obj)

    def construct_mapping(self, node, deep=False):
        return {_plain(k): v for k, v in super().construct_mapping(node, deep).items()}


def _plain(x: Any) -> Any:
    return x.value if isinstance(x, _Scalar) else x


# YAML 1.1 reads 1:30 as 90 (base 60, PyYAML's int and float resolvers); nobody means that in a config
_SEXAGESIMAL = re.compile(r"[-+]?[0-9][0-9_]*(:[0-5]?[0-9])+(\.[0-9_]*)?")
# and 0100 as 64 (octal, PyYAML's int resolver), where 08 is 8
_OCTAL = re.compile(r"[-+]?0[0-7_]+")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp``; return it in the schema's type."""
    if isinstance(value, _Scalar):
        scalar, value = value, value.resolve(tp)
        if not scalar.quoted and value is scalar.value and isinstance(value, (int, float)) \
                and ":" in scalar.text and _SEXAGESIMAL.fullmatch(scalar.text.strip()):
            raise ConfigError(f"{key}: {scalar.text.strip()} is the base-60 number {value} in YAML 1.1; "
                              "write the number itself")
        if not scalar.quoted and value is scalar.value and type(value) is int \
                and _OCTAL.fullmatch(scalar.text.strip()):
            raise ConfigError(f"{key}: {scalar.text.strip()} is the octal number {value} in YAML 1.1; "
                              "write the number without its leading zero")
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, key)
            except ConfigError:
                pass
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            # case-blind: DDP and Spmd are one key away from ddp and spmd
            spelled = {str(c).lower(): c for c in choices}
            hint = difflib.get_close_matches(str(value).lower(), list(spelled), n=1)
            extra = f" (did you mean {spelled[hint[0]]!r}?)" if hint else ""
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(repr, choices))}{extra}")
        return value
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{key}: expected a list of {len(args)} values {_type_name(tp)}, got {value!r}")
        return tuple(_coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if dataclasses.is_dataclass(tp):
        return build(tp, value, key)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, str):  # YAML reads 1e9 (no dot) as a string
            try:
                value = int(value)
            except ValueError:
                pass
        if isinstance(value, int) and not isinstance(value, bool):
            if abs(value) >= 2**63:  # torch's and numpy's int64: past it a traceback, later
                raise ConfigError(f"{key}: {value} is out of range (|value| < 2**63)")
            return value
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
            return int(value)  # 1.5e9 in YAML is a float
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(float(value)):
                raise ConfigError(f"{key}: expected a finite number, got {value!r}")
            return float(value)
        if isinstance(value, str):  # YAML reads 3e-4 (no dot) as a string
            try:
                return _coerce(float(value), float, key)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    raise TypeError(f"unsupported schema type {tp!r} for {key}")


def build(cls: type, data: Any, prefix: str = "") -> Any:
    """Build dataclass ``cls`` from a mapping, rejecting unknown keys and wrong types."""
    where = prefix or "config"
    if isinstance(data, _Scalar):
        data = data.value
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of keys, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {_key(f): f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}.{key}" if prefix else str(key)
        if key not in fields:
            hint = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.6)
            extra = f" (did you mean '{prefix + '.' if prefix else ''}{hint[0]}'?)" if hint else ""
            valid = "" if hint else f"; valid keys: {', '.join(fields)}"
            raise ConfigError(f"unknown key '{full}'{extra}{valid}")
        kwargs[fields[key].name] = _coerce(value, hints[fields[key].name], full)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:  # __post_init__ checks (ModelConfig names its field)
        raise ConfigError(f"{where}.{e}" if prefix else str(e)) from None


def _set_path(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for i, p in enumerate(parts[:-1]):
        nxt = node.get(p)
        if nxt is None:
            nxt = node[p] = {}
        if isinstance(nxt, _Scalar) and isinstance(nxt.value, dict):  # an earlier override's mapping
            nxt = node[p] = nxt.value
        if not isinstance(nxt, dict):  # the file, or an earlier override such as training=1, made it a value
            raise ConfigError(f"override {dotted}: '{'.'.join(parts[:i + 1])}' is {nxt!r}, "
                              "not a section (set by the config file or an earlier override)")
        node = nxt
    node[parts[-1]] = value


def parse_overrides(overrides: list[str]) -> list[tuple[str, Any]]:
    out = []
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override {item!r}: expected section.key=value")
        key, raw = item.split("=", 1)
        try:
            # the config file's loader: a mapping's own values (training={max_steps: 0100}) keep
            # their text and get the file's checks, and a key given twice in it is an error
            value = _plain(yaml.load(raw, Loader=_ConfigLoader)) if raw != "" else ""
        except yaml.constructor.ConstructorError as e:
            if "duplicate key" not in str(e.problem):
                raise ConfigError(f"override {item!r}: YAML cannot read {raw!r} ({e.problem})") from None
            raise ConfigError(f"override {item!r}: {e.problem} in the mapping") from None
        except yaml.YAMLError:
            value = raw
        except (ValueError, TypeError, IndexError, AttributeError) as e:  # a tag's constructor: !!int 1e3
            from .checkpoint import first_line
            raise ConfigError(f"override {item!r}: YAML cannot read {raw!r} ({first_line(e)})") from None
        # quoted or tagged (!!str 0100): the text YAML reads, not the text as written
        quoted = raw.strip()[:1] in ("'", '"', "!") and isinstance(value, str)
        out.append((key.strip(), _Scalar(raw, value, quoted)))
    return out


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """Read a YAML config, apply ``section.key=value`` overrides, and check it (not the data)."""
    tree: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"{path}: config file not found")
        try:
            tree = yaml.load(path.read_text(encoding="utf-8"), Loader=_ConfigLoader) or {}
        except UnicodeDecodeError:
            raise ConfigError(f"{path}: not a YAML config (not UTF-8 text)") from None
        except OSError as e:
            raise ConfigError(f"{path}: cannot read the config ({e.strerror or e})") from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" line {mark.line + 1}" if mark else ""
            raise ConfigError(f"{path}:{where} invalid YAML ({getattr(e, 'problem', e)})") from None
        except (ValueError, TypeError, IndexError, AttributeError) as e:  # a tag's constructor: !!float abc
            from .checkpoint import first_line
            raise ConfigError(f"{path}: invalid YAML (a tagged value: {first_line(e)})") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"{path}: expected a mapping of sections at the top level")
    parsed = parse_overrides(list(overrides))
    file_tree = copy.deepcopy(tree) if parsed else None
    for key, value in parsed:
        _set_override(tree, key, value)
    try:
        cfg = build(Config, tree)
        check(cfg)
    except ConfigError as e:
        raise ConfigError(_where(path, file_tree, [key for key, _ in parsed], str(e))) from None
    return cfg


def _set_override(tree: dict, dotted: str, value: Any) -> None:
    """One override into the config's tree. A section's (``training={max_steps: 5}``) is a
    mapping merged key by key into what the file (or an earlier override) gave it: replacing
    the section would put every key the mapping leaves out back to its default, silently."""
    section = _section(dotted)
    if section is None:
        _set_path(tree, dotted, value)
        return
    mapping = _plain(value)
    if not isinstance(mapping, dict):
        first = _key(dataclasses.fields(section)[0])
        raise ConfigError(f"override {dotted}={getattr(value, 'text', mapping)}: {dotted} is a section: set "
                          f"its keys ({dotted}.{first}=...) or give a mapping ({dotted}={{{first}: ...}})")
    for key, sub in mapping.items():
        _set_override(tree, f"{dotted}.{key}", sub)


def _section(dotted: str) -> type | None:
    """The dataclass of the schema's section at ``dotted`` (``training``, ``xla.mesh``), or None
    for a key, or a name the schema does not have (``build`` says so, with its valid keys)."""
    node: Any = Config
    for part in dotted.split("."):
        if not dataclasses.is_dataclass(node):
            return None
        fields = {_key(f): f for f in dataclasses.fields(node) if f.init}
        if part not in fields:
            return None
        node = typing.get_type_hints(node)[fields[part].name]
    return node if dataclasses.is_dataclass(node) else None


def _where(path, file_tree: dict | None, override_keys: list[str], msg: str) -> str:
    """``msg`` with where its values were set: the config file when the file alone
    (``file_tree``) fails with this very message, else the command line - the overrides made it,
    also where a cross-field check names the file's value (``model.n_heads=3`` over a d_model of
    128) or the file leaves a key to the command line. (An override that mends the file's first
    error and so uncovers a second is named too; the message names the file's key.) No
    overrides: the file; no file: the overrides are all there is."""
    if path is None:
        return msg
    if file_tree is None:
        return f"{path}: {msg}"
    try:
        check(build(Config, file_tree))
    except ConfigError as e:
        if str(e) == msg:
            return f"{path}: {msg}"
    return f"command line (over {path}): {msg}"


def config_from_dict(tree: dict) -> Config:
    """Rebuild a resolved config (e.g. the one stored in a checkpoint)."""
    return build(Config, tree)


def check(cfg: Config) -> None:
    """Cross-field checks that need no data."""
    t, d = cfg.training, cfg.data

    def bad(msg: str) -> None:
        raise ConfigError(msg)

    if d.seq_len < 1:
        bad(f"data.seq_len={d.seq_len} must be positive")
    if d.seq_len > cfg.model.max_seq_len:
        bad(f"data.seq_len={d.seq_len} is above model.max_seq_len={cfg.model.max_seq_len}")
    if d.num_workers < 0:
        bad(f"data.num_workers={d.num_workers} must be >= 0")
    if t.batch_size < 1:
        bad(f"training.batch_size={t.batch_size} must be at least 1")
    if t.gradient_accumulation_steps < 1:
        bad(f"training.gradient_accumulation_steps={t.gradient_accumulation_steps} must be at least 1")
    if (t.max_steps is None) == (t.total_tokens is None):
        bad("give exactly one of training.max_steps and training.total_tokens")
    if t.max_steps is not None and t.max_steps < 1:
        bad(f"training.max_steps={t.max_steps} must be at least 1")
    if t.total_tokens is not None and t.total_tokens < 1:
        bad(f"training.total_tokens={t.total_tokens} must be at least 1")
    if t.learning_rate <= 0:
        bad(f"training.learning_rate={t.learning_rate} must be positive")
    if not 0 <= t.min_lr_ratio <= 1:
        bad(f"training.min_lr_ratio={t.min_lr_ratio} must be in [0, 1]")
    if t.warmup_steps < 0:
        bad(f"training.warmup_steps={t.warmup_steps} must be >= 0")
    if not 0 < t.decay_ratio <= 1:
        bad(f"training.decay_ratio={t.decay_ratio} must be in (0, 1]")
    if not 0 <= t.seed < 2**63:
        bad(f"training.seed={t.seed} must be in [0, 2**63)")
    if t.weight_decay < 0:
        bad(f"training.weight_decay={t.weight_decay} must be >= 0")
    # the decayed group is the matrices, at muon_lr with Muon (its AdamW group is not decayed)
    lr_key, lr = ("muon_lr", t.muon_lr) if t.optimizer == "muon" else ("learning_rate", t.learning_rate)
    if lr * t.weight_decay >= 1:  # decoupled decay multiplies the weights by 1 - lr x wd every step
        bad(f"training.weight_decay={t.weight_decay} x training.{lr_key}={lr} is {lr * t.weight_decay:g}: "
            "the decay would zero or flip the weights at every step (it multiplies them by 1 - lr x wd); "
            "keep the product below 1")
    if not all(0 <= b < 1 for b in t.betas):
        bad(f"training.betas={list(t.betas)} must be in [0, 1)")
    if not t.eps >= 1e-30:
        # fp32's update adds eps to sqrt(v): one below its range (or flushed as a subnormal, as
        # TPUs do) is 0 there, and a gradient entry of exactly 0 then gets 0/0 = NaN in the weights
        bad(f"training.eps={t.eps} must be at least 1e-30 (a parameter whose gradient is 0 would get 0/0)")
    if t.muon_lr <= 0:
        bad(f"training.muon_lr={t.muon_lr} must be positive")
    if not 0 <= t.muon_momentum < 1:
        bad(f"training.muon_momentum={t.muon_momentum} must be in [0, 1)")
    if t.grad_clip < 0:
        bad(f"training.grad_clip={t.grad_clip} must be >= 0")
    if not re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", t.device):
        bad(f"training.device={t.device!r}: expected auto, cuda, cuda:N, mps or cpu")
    if t.max_nonfinite_steps < 1:
        bad(f"training.max_nonfinite_steps={t.max_nonfinite_steps} must be at least 1")
    if t.dist_timeout_s is not None and not 0 < t.dist_timeout_s < math.inf:
        bad(f"training.dist_timeout_s={t.dist_timeout_s} must be a positive number of seconds (null: torch's defaults)")
    if cfg.evaluation.interval < 0:
        bad(f"evaluation.interval={cfg.evaluation.interval} must be >= 0 (0: only at the end)")
    if cfg.evaluation.steps < 1:
        bad(f"evaluation.steps={cfg.evaluation.steps} must be at least 1 (evaluation.interval=0: only at the end of the run)")
    if cfg.checkpoint.interval < 0:
        bad(f"checkpoint.interval={cfg.checkpoint.interval} must be >= 0")
    if cfg.checkpoint.keep < 1:
        bad(f"checkpoint.keep={cfg.checkpoint.keep} must be at least 1")
    if cfg.checkpoint.keep_every < 0:
        bad(f"checkpoint.keep_every={cfg.checkpoint.keep_every} must be >= 0 (0: none)")
    if cfg.logging.interval < 1:
        bad(f"logging.interval={cfg.logging.interval} must be at least 1")
    if cfg.logging.profile_start < 0:
        bad(f"logging.profile_start={cfg.logging.profile_start} must be >= 0 (0: no profile)")
    if cfg.logging.profile_steps < 1:
        bad(f"logging.profile_steps={cfg.logging.profile_steps} must be at least 1")
    c = cfg.checkpoint
    for key, value, other in (("data.dir", d.dir, ""), ("checkpoint.dir", c.dir, ""),
                              ("checkpoint.resume", c.resume, " (or auto, or none)"),
                              ("checkpoint.init_from", c.init_from, " (or null)")):
        if value is not None and not value.strip():  # the working directory, whatever it holds
            bad(f"{key} is empty: give a path{other}")
    if cfg.logging.dir is not None and not cfg.logging.dir.strip():
        bad("logging.dir is empty: give a directory, or null for checkpoint.dir")
    if cfg.logging.peak_flops is not None and not 0 <= cfg.logging.peak_flops < math.inf:
        bad(f"logging.peak_flops={cfg.logging.peak_flops} must be a positive number of FLOP/s "
            "(null or 0: looked up from the device)")
    m = cfg.xla.mesh
    if min(m.data, m.fsdp, m.tp, m.dcn_data) < 1:
        bad("xla.mesh axes must be at least 1")
    if m.data % m.dcn_data:
        bad(f"xla.mesh.dcn_data={m.dcn_data} does not divide xla.mesh.data={m.data} (the data axis "
            "spans dcn_data slices)")
    if cfg.xla.nprocs not in (None, 1):
        bad(f"xla.nprocs={cfg.xla.nprocs}: torch_xla 2.9's xmp.spawn accepts only null (one process "
            "per core/chip) or 1")


def check_xla(cfg: Config, devices: Optional[int] = None) -> None:
    """What train_xla.py cannot run, as a ConfigError: decided from the config, and with
    ``devices`` (the runtime's count; the backend knows it) whether an SPMD mesh covers them, in
    the order a user fixes them. train_xla.py's launcher (before spawning), the backend and
    ``--plan`` call it."""
    if cfg.xla.scan_layers and cfg.model.dropout > 0:
        # torch_xla 2.9's scan cannot carry the body's random masks: it fails while lowering
        # the loop ("Dynamic update slice ... PRED vs F32"), after a minute of tracing
        raise ConfigError(f"xla.scan_layers=true with model.dropout={cfg.model.dropout}: torch_xla's "
                          "scan cannot run dropout inside the scanned blocks; set model.dropout=0 "
                          "or xla.scan_layers=false")
    m = cfg.xla.mesh
    if cfg.xla.mode != "spmd":
        return
    if devices is not None and m.data * m.fsdp * m.tp != devices:
        raise ConfigError(f"xla.mesh: data x fsdp x tp = {m.data} x {m.fsdp} x {m.tp} = "
                          f"{m.data * m.fsdp * m.tp}, but there are {devices} devices")
    if cfg.training.batch_size % (m.data * m.fsdp):
        # XLA would zero-pad the batch: chips would compute padding and the loss would change
        raise ConfigError(f"training.batch_size={cfg.training.batch_size} is the global batch in "
                          f"xla.mode=spmd and must divide over xla.mesh data x fsdp = "
                          f"{m.data} x {m.fsdp} = {m.data * m.fsdp} devices")
    # tp splits wq/wk/wv and w1/w3 by output features, wo and w2 by input features
    # (training/sharding.py): by whole heads and whole hidden units only where tp divides their
    # counts. Otherwise GSPMD cuts a head's features across devices (attention then contracts a
    # sharded head_dim, a collective per layer) or pads the FFN's shards: it runs, slowly.
    mc = cfg.model
    for key, count in (("n_heads", mc.n_heads), ("n_kv_heads", mc.n_kv_heads)):
        if count % m.tp:
            raise ConfigError(f"xla.mesh.tp={m.tp} does not divide model.{key}={count}: tensor "
                              f"parallelism splits attention by whole heads (query and key/value)")
    if mc.ffn_hidden % m.tp:
        raise ConfigError(f"xla.mesh.tp={m.tp} does not divide the FFN's hidden size {mc.ffn_hidden} "
                          f"(model.ffn_mult x d_model rounded up to model.ffn_multiple_of="
                          f"{mc.ffn_multiple_of}): tensor parallelism splits it into equal parts")


def xla_ignores(cfg: Config) -> list[str]:
    """The settings of ``cfg`` that train_xla.py does not use, each as a warning line: train.py's
    that would change what train.py does (``training.compile`` is not one: XLA compiles every step
    anyway), and an SPMD mesh given to a ddp run (xla.mesh.fsdp=4 without xla.mode=spmd trained
    whole replicas, unsharded, without a word)."""
    lines = []
    mesh = {f"xla.mesh.{k}": v for k, v in dataclasses.asdict(cfg.xla.mesh).items() if v != 1}
    if cfg.xla.mode != "spmd" and mesh:
        given = ", ".join(f"{k}={v}" for k, v in mesh.items())
        lines.append(f"{given}: the SPMD mesh, and xla.mode is {cfg.xla.mode}, where every process trains a "
                     "whole replica (set xla.mode=spmd to shard; ignored here)")
    if cfg.training.fsdp:
        lines.append("training.fsdp=true is train.py's FSDP2; train_xla.py shards with xla.mode=spmd and "
                     "xla.mesh.fsdp (ignored here)")
    if cfg.training.device != "auto":
        lines.append(f"training.device={cfg.training.device} is train.py's; train_xla.py runs on the "
                     "PJRT_DEVICE's devices (ignored here)")
    return lines


def check_data(cfg: Config) -> dict:
    """Check the data directory against the config before any work; return its meta.json."""
    d = Path(cfg.data.dir).expanduser()
    meta_path = d / "meta.json"
    try:  # is_dir() raises for a dead network mount (ENOTCONN), a denied parent, a name too long
        there, has_meta = d.is_dir(), meta_path.is_file()
    except OSError as e:
        raise ConfigError(f"data.dir: cannot read {d} ({e.strerror or e})") from None
    if not there:
        rel = "" if d.is_absolute() else f", relative to the working directory {os.getcwd()}"
        raise ConfigError(f"data.dir: {d} does not exist{rel} (run prepare_data.py first)")
    if not has_meta:
        raise ConfigError(f"data.dir: {meta_path} not found (is {d} a prepare_data.py output?)")
    try:
        meta = json.loads(meta_path.read_text())
        vocab = meta["vocab_size"]
        splits = meta["splits"]
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{meta_path}: unreadable meta.json ({e})") from None
    except OSError as e:  # permissions, a network mount's I/O error
        raise ConfigError(f"data.dir: cannot read {meta_path} ({e.strerror or e})") from None
    # each key of the wrong type by name (an edited or foreign file): not a TypeError from below
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
        raise ConfigError(f"{meta_path}: vocab_size is {vocab!r}, not a number of tokens")
    if not isinstance(splits, dict):
        raise ConfigError(f"{meta_path}: splits is {splits!r}, not an object of splits")
    if vocab > cfg.model.vocab_size:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the data's "
                          f"vocabulary ({vocab} in {meta_path})")
    for split in ("train", "val"):
        if split in splits and not isinstance(splits[split], dict):
            raise ConfigError(f"{meta_path}: splits.{split} is {splits[split]!r}, not an object")
        if split not in splits or not splits[split].get("shards"):
            raise ConfigError(f"{meta_path}: no '{split}' shards")
    return meta


def schema_markdown() -> str:
    """The configuration reference (README), generated from the dataclasses above."""
    lines = ["| key | default | meaning |", "| --- | --- | --- |"]

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            key = f"{prefix}{_key(f)}"
            tp = hints[f.name]
            if dataclasses.is_dataclass(tp):
                walk(tp, key + ".")
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            default = json.dumps(_to_plain(default))
            meaning = f.metadata.get("help", "")
            choices = ""
            if typing.get_origin(tp) is Literal:
                choices = " (" + " \\| ".join(str(a) for a in typing.get_args(tp)) + ")"
            lines.append(f"| `{key}` | `{default}` | {meaning}{choices} |")

    walk(Config, "")
    return "\n".join(lines) + "\n"
