#!/usr/bin/env python3
"""Prepare a pre-training corpus once: train (or reuse) a byte-level BPE tokenizer, write token shards.

    python prepare_data.py --input corpus/ --glob '*.txt' --vocab-size 32768 --out data/corpus

The output directory is what the trainers read (`data.dir`):

    tokenizer.json, tokenizer_config.json, special_tokens_map.json
        the tokenizer; `transformers.AutoTokenizer.from_pretrained(dir)` loads it offline.
    train_00000.npy, ..., val_00000.npy, ...
        1-D token-id arrays (uint16 when the vocabulary fits, else uint32). The shards of a split are
        consecutive pieces of one stream in which every document is followed by the end-of-text id.
    meta.json
        vocabulary, dtype, special ids, per-split documents/tokens/shards (with sha256), the inputs and
        the command. Written last: a directory without meta.json is not a finished one.

The directory is built next to `--out` under a hidden temporary name and renamed into place when
complete, so an interrupted or failed run never leaves anything that looks finished, and an existing
output (replaced only with `--overwrite`) stays intact until the new one is ready.
"""
from __future__ import annotations

import argparse
import codecs
import errno
import fnmatch
import hashlib
import json
import mmap
import os
import re
import secrets
import shlex
import shutil
import signal
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

PROG = "prepare_data.py"
FORMAT_VERSION = 1
SHARD_DTYPES = ("uint16", "uint32")  # a shard's ids: uint16 when the vocabulary fits (training.data reads these)
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
N_BYTES = 256  # the byte-level alphabet: every byte has its own token
DEFAULT_VOCAB_SIZE = 32768
# The largest --vocab-size: ids are stored as uint32, and the BPE trainer allocates for the whole
# vocabulary up front (a --vocab-size of 1G aborted inside it with a Rust panic)
MAX_VOCAB_SIZE = 1 << 24
RECORD_KINDS = {".jsonl": "json", ".json": "json", ".ndjson": "json", ".parquet": "parquet"}
JSON_LINES = {".jsonl", ".ndjson"}  # read line by line here; .json and .parquet through datasets
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
MODEL_INPUT_NAMES = ("input_ids", "attention_mask")   # what the tokenizer files' AutoTokenizer returns
BATCH_BYTES = 1 << 20  # text per encode_batch call: large enough to keep both cores busy
BATCH_DOCS = 4096
# A document longer than this (characters) is encoded in pieces of about this size, a few at a time:
# whole, the tokenizer holds ~200 bytes per byte of text (an 11 MB file peaked at 2.5 GB)
PIECE_CHARS = 1 << 20
# A document longer than this (characters) is split between the splits: its last --val-fraction,
# cut after a line end, is a val document and the rest a train one, so one large file (the
# classic input.txt) gives both. Shorter documents go to one split whole, chosen by their content.
SPLIT_CHARS = 1 << 20
# A plain-text file larger than this (bytes) is never held whole: it is checked, sampled and encoded
# READ_BYTES at a time, from disk each time (read whole, memory grew by ~7 MB per MB of the file:
# bench/prepare_data.py). Over 4 x SPLIT_CHARS, so every such file is split between train and val.
STREAM_BYTES = 64 << 20
READ_BYTES = 8 << 20
RECORD_BATCH = 1024  # records read at a time from json/parquet/datasets


EXAMPLES = """examples:
  # the Python standard library as a toy corpus: what make demo prepares for configs/demo.yaml
  python prepare_data.py --input /usr/lib/python3.11 --glob '*.py' --exclude site-packages \\
      --vocab-size 2048 --val-fraction 0.01 --out data/stdlib
  # JSON lines with the text under "content"; the tokenizer of an earlier run
  python prepare_data.py --input shards/ --glob '*.jsonl' --text-column content \\
      --tokenizer data/stdlib --out data/more
  # a hub dataset, streamed, for a smoke run
  python prepare_data.py --dataset HuggingFaceFW/fineweb-edu --dataset-config sample-10BT \\
      --max-tokens 50M --vocab-size 32768 --out data/fineweb-smoke
  # after copying a prepared directory to another machine: every file against meta.json
  python prepare_data.py --verify data/stdlib
"""


class DataError(Exception):
    """Bad input or arguments: reported as one line, no traceback."""


def one_line(exc: BaseException) -> str:
    """The first non-empty line of an exception message, for errors raised by other libraries."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return (lines[0] if lines else type(exc).__name__)[:300]


def warn(msg: str) -> None:
    print(f"{PROG}: warning: {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------
# Command line


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of usage + message
        raise DataError(f"{message} (see --help)")


def size(text: str) -> int:
    """A positive integer, optionally with a decimal k/M/G suffix: 300M = 300_000_000."""
    mult = {"k": 10**3, "m": 10**6, "g": 10**9}.get(text[-1:].lower(), 1)
    try:
        value = int(text[:-1] if mult > 1 else text) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return value


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = _Parser(prog=PROG, description=__doc__.split("\n\n")[0], epilog=EXAMPLES,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_argument_group("inputs (any mix)")
    src.add_argument("--input", nargs="+", action="extend", default=[], metavar="PATH", type=os.path.expanduser,
                     help="files or directories (recursed in sorted order). A plain-text file is one "
                          "document; .jsonl/.json/.parquet files give one document per record")
    src.add_argument("--glob", action="append", default=[], metavar="PATTERN",
                     help="keep only files found in directories that match (repeatable). A pattern "
                          "with '/' matches the path relative to the input directory, else the name")
    src.add_argument("--exclude", action="append", default=[], metavar="PATTERN",
                     help="skip files and whole directories found in directories that match "
                          "(repeatable, same rule as --glob), e.g. --exclude site-packages")
    src.add_argument("--text-column", default="text", metavar="COL",
                     help="record field holding the text (default: text)")
    src.add_argument("--dataset", metavar="NAME",
                     help="a `datasets` dataset, streamed: a hub name, a local dataset directory, or a "
                          "directory written by Dataset.save_to_disk")
    src.add_argument("--dataset-config", metavar="C", help="the dataset's configuration name")
    src.add_argument("--split", default="train", metavar="SPLIT", help="the dataset split to read (default: train)")
    src.add_argument("--max-docs", type=size, metavar="N", help="stop after N documents")
    src.add_argument("--max-tokens", type=size, metavar="N",
                     help="stop once N tokens are written (whole documents, the last may overshoot; a "
                          "plain-text file over 64 MiB stops within its 8 MiB block)")
    tok = p.add_argument_group("tokenizer")
    tok.add_argument("--vocab-size", type=size, metavar="V",
                     help=f"train a byte-level BPE with V tokens, specials included "
                          f"(default {DEFAULT_VOCAB_SIZE})")
    tok.add_argument("--tokenizer-sample-bytes", type=size, metavar="N",
                     help="train the tokenizer on the first N bytes of text (default 300M)")
    tok.add_argument("--tokenizer", metavar="PATH", type=os.path.expanduser,
                     help="reuse a tokenizer (tokenizer.json or a local HF tokenizer directory) "
                          "instead of training one")
    out = p.add_argument_group("output")
    # ~ expanded here too: the shell leaves it in --out=~/data, which data.dir: ~/data then missed
    out.add_argument("--out", metavar="DIR", type=os.path.expanduser, help="output directory (required)")
    out.add_argument("--overwrite", action="store_true",
                     help="replace an existing output directory (only if it holds nothing but a "
                          "previous prepare_data.py output)")
    out.add_argument("--shard-tokens", type=size, default=100_000_000, metavar="N",
                     help="at most N tokens per shard (default 100M)")
    out.add_argument("--val-fraction", type=float, default=0.005, metavar="F",
                     help="fraction of the documents in the val split, and the share of each "
                          "document over 1M characters (its end) that goes there (default 0.005)")
    out.add_argument("--seed", type=int, default=0, metavar="S", help="seed of the train/val split (default 0)")
    chk = p.add_argument_group("checking")
    chk.add_argument("--verify", metavar="DIR", type=os.path.expanduser,
                     help="check a prepared directory against its meta.json and write nothing: every "
                          "shard's size, dtype, sha256 and token ids, and the tokenizer's sha256 "
                          "(after a copy: a partial or corrupted file trains silently otherwise)")
    args = p.parse_args(argv)

    if args.verify is not None:
        given = [f for f, v in (("--input", args.input), ("--dataset", args.dataset), ("--out", args.out)) if v]
        if given:
            raise DataError(f"--verify checks a prepared directory and writes nothing: it takes no {', '.join(given)}")
        return args
    if args.out is None:
        raise DataError("the following arguments are required: --out (see --help)")
    if not args.input and not args.dataset:
        raise DataError("no inputs: give --input PATH ... and/or --dataset NAME")
    if args.dataset is not None and Path(args.dataset).is_file():  # else a hub name: ~30 s of retries
        raise DataError(f"--dataset {args.dataset}: is a file; --dataset takes a hub name or a dataset "
                        f"directory, a local file is an --input")
    if not 0.0 < args.val_fraction < 1.0:
        raise DataError(f"--val-fraction {args.val_fraction} must be between 0 and 1 (exclusive)")
    if args.tokenizer is not None:
        for flag in ("vocab_size", "tokenizer_sample_bytes"):
            if getattr(args, flag) is not None:
                raise DataError(f"--{flag.replace('_', '-')} cannot be combined with --tokenizer "
                                f"(the given tokenizer fixes the vocabulary)")
    else:
        if args.vocab_size is None:
            args.vocab_size = DEFAULT_VOCAB_SIZE
        if args.tokenizer_sample_bytes is None:
            args.tokenizer_sample_bytes = 300_000_000
        minimum = N_BYTES + 2
        if args.vocab_size < minimum:
            raise DataError(f"--vocab-size {args.vocab_size} is below the {N_BYTES} byte tokens + 2 "
                            f"special tokens ({minimum})")
        if args.vocab_size > MAX_VOCAB_SIZE:
            raise DataError(f"--vocab-size {args.vocab_size} is above the largest supported, "
                            f"{MAX_VOCAB_SIZE} (2**24)")
    return args


# ---------------------------------------------------------------------------------------------------
# Inputs


def _matches(rel: str, patterns: list[str]) -> bool:
    name = rel.rsplit("/", 1)[-1]
    return any(fnmatch.fnmatchcase(rel if "/" in pat else name, pat) for pat in patterns)


def find_files(inputs: list[str], globs: list[str], excludes: list[str],
               out: Path | None = None) -> list[tuple[str, list[Path]]]:
    """Per --input: the files it names, in a deterministic (sorted) order, each file at most once.

    --glob and --exclude filter what is found by walking directories; a file named on the command
    line is always read. The output directory `out` (a real path) is never walked into.
    """
    seen: set[Path] = set()
    found = []
    for given in inputs:
        root = Path(given)
        if root.is_file():
            candidates = [root]
        elif root.is_dir():
            candidates = []
            # A link to a directory outside the input is walked like a directory (a link to a
            # file always was read); one to a directory inside it is not: that one is walked
            # under its own name, where --exclude and --glob see it. Each real directory once,
            # so a loop of links ends.
            real_root = os.path.realpath(root)
            walked: set[str] = set()

            def unreadable(e: OSError, given=given):
                raise DataError(f"--input {given}: cannot list {e.filename} ({e.strerror or e})")

            for dirpath, dirnames, filenames in os.walk(root, onerror=unreadable, followlinks=True):
                real = os.path.realpath(dirpath)
                if real in walked:
                    warn(f"skipping {dirpath}: it leads to {real}, which is read already")
                    dirnames[:] = []
                    continue
                walked.add(real)
                rel_dir = Path(dirpath).relative_to(root).as_posix()
                prefix = "" if rel_dir == "." else rel_dir + "/"
                keep = []
                for d in sorted(dirnames):
                    target = os.path.realpath(os.path.join(dirpath, d))
                    if _matches(prefix + d, excludes) or target == str(out):
                        continue
                    leftover = rf"\.{re.escape(out.name)}\.(partial|old)-\d+-[0-9a-f]+" if out is not None else None
                    if leftover and os.path.dirname(target) == str(out.parent) and \
                            re.fullmatch(leftover, os.path.basename(target)):
                        continue  # what a killed run of this output left beside it (install())
                    if os.path.islink(os.path.join(dirpath, d)) and \
                            (target == real_root or target.startswith(real_root + os.sep)):
                        continue
                    keep.append(d)
                dirnames[:] = keep
                for name in sorted(filenames):
                    rel = prefix + name
                    if (not globs or _matches(rel, globs)) and not _matches(rel, excludes):
                        candidates.append(Path(dirpath, name))
        elif root.exists():
            raise DataError(f"--input {given}: not a file or directory")
        else:
            raise DataError(f"--input {given}: no such file or directory")
        files = []
        for path in candidates:
            if not path.is_file():  # a broken link, a socket...
                warn(f"skipping {path}: not a regular file")
                continue
            key = path.resolve()
            if key not in seen:
                seen.add(key)
                files.append(path)
        found.append((given, files))
    return found


def _import_datasets():
    import datasets

    # Failures become one-line errors of ours; datasets would also log them, and draw progress bars.
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    return datasets


class LargeText:
    """A plain-text file over STREAM_BYTES: one document, never held whole. Each pass (the UTF-8
    check, the tokenizer sample, the encoding) reads it from disk READ_BYTES at a time; its size
    is taken once, so a file that grows meanwhile is read as it was."""

    def __init__(self, path: Path):
        self.path = path
        self.size = path.stat().st_size

    def _cannot(self, e: OSError) -> DataError:
        return DataError(f"{self.path}: cannot read ({e.strerror or one_line(e)})")

    def utf8_problem(self) -> str | None:
        """What is wrong with it as UTF-8, worded as for a file read whole, or None."""
        decoder = codecs.getincrementaldecoder("utf-8")()
        at = 0  # bytes read before this block
        try:
            with open(self.path, "rb") as f:
                while True:
                    raw = f.read(min(READ_BYTES, self.size - at))
                    held = decoder.getstate()[0]  # the start of a character the last block cut
                    try:
                        decoder.decode(raw, final=not raw)
                    except UnicodeDecodeError as e:
                        return (f"not valid UTF-8 (byte {e.object[e.start]:#04x} at offset "
                                f"{at - len(held) + e.start})")
                    if not raw:
                        return None
                    at += len(raw)
        except OSError as e:
            raise self._cannot(e) from None

    def _mapped(self, fn: Callable[[mmap.mmap], int]) -> int:
        try:
            with open(self.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                return fn(m)
        except OSError as e:
            raise self._cannot(e) from None

    def boundary(self, at: int) -> int:
        """The start of the character at byte ``at`` (``at`` itself at the end of the file)."""
        return self._mapped(lambda m: char_start(m, at)) if at < self.size else self.size

    def val_cut(self, val_fraction: float) -> int:
        """Where its val part begins (``val_cut``), found without reading the rest of the file."""
        return self._mapped(lambda m: val_cut(m, self.size, val_fraction))

    def texts(self, start: int, end: int, size: int) -> Iterator[str]:
        """Bytes [start, end) (both at character starts) as text: pieces of about ``size``
        characters cut as ``text_pieces`` cuts (for ``pieces_are_exact`` tokenizers, the same
        tokens as the whole)."""
        decoder = codecs.getincrementaldecoder("utf-8")()
        rest = ""
        try:
            with open(self.path, "rb") as f:
                f.seek(start)
                left = end - start
                while left > 0:
                    raw = f.read(min(READ_BYTES, left))
                    if not raw:
                        raise DataError(f"{self.path}: the file shrank while it was read ({self.size:,} bytes before)")
                    left -= len(raw)
                    rest += decoder.decode(raw, final=left == 0)
                    # every cut found is one of the whole text's: a cut needs only the
                    # characters around it, and those are all in ``rest``
                    *whole, rest = text_pieces(rest, size)
                    yield from whole
        except OSError as e:
            raise self._cannot(e) from None
        if rest:
            yield rest


class Corpus:
    """The documents of all inputs, in a fixed order: files (sorted) first, then the dataset.

    `documents()` can be iterated more than once (the tokenizer sample, then the full pass). Empty
    documents are dropped; files that are not UTF-8 are skipped with a warning naming them.
    """

    def __init__(self, files: list[Path], dataset: str | None, dataset_config: str | None,
                 split: str, text_column: str, max_docs: int | None):
        self.files, self.dataset, self.dataset_config = files, dataset, dataset_config
        self.split, self.text_column, self.max_docs = split, text_column, max_docs
        self.skipped: dict[str, str] = {}  # path -> reason
        self.empty = 0
        self._warned: set[str] = set()
        self._utf8: dict[Path, str | None] = {}  # a LargeText's UTF-8 check: what is wrong, or None

    def _warn_once(self, msg: str) -> None:
        if msg not in self._warned:
            self._warned.add(msg)
            warn(msg)

    def documents(self) -> Iterator[tuple[str, bytes] | tuple[LargeText, None]]:
        """Yields (text, its UTF-8 bytes) for every non-empty document, at most --max-docs; a
        plain-text file over STREAM_BYTES as (LargeText, None)."""
        self.empty = 0
        n = 0
        for text, data in self._all():
            if not text:
                self.empty += 1
                continue
            yield text, data
            n += 1
            if self.max_docs is not None and n >= self.max_docs:
                return

    def _all(self) -> Iterator[tuple[str, bytes]]:
        for path in self.files:
            kind = RECORD_KINDS.get(path.suffix.lower())
            try:  # an error of read() names no file (/proc/self/mem: "Input/output error")
                if kind is None and path.stat().st_size > STREAM_BYTES:
                    large = LargeText(path)
                    if path not in self._utf8:  # once: the sample and the encoding pass both come here
                        self._utf8[path] = large.utf8_problem()
                    if self._utf8[path] is not None:
                        self.skipped[str(path)] = self._utf8[path]
                        self._warn_once(f"skipping {path}: {self.skipped[str(path)]}")
                        continue
                    yield large, None
                elif kind is None:
                    data = path.read_bytes()
                    try:
                        text = data.decode("utf-8")
                    except UnicodeDecodeError as e:
                        self.skipped[str(path)] = f"not valid UTF-8 (byte {data[e.start]:#04x} at offset {e.start})"
                        self._warn_once(f"skipping {path}: {self.skipped[str(path)]}")
                        continue
                    yield text, data
                elif path.suffix.lower() in JSON_LINES:
                    yield from self._json_lines(path)
                elif path.stat().st_size > 0:  # an empty records file holds no documents (datasets refuses it)
                    yield from self._records(str(path), self._open_records(path, kind))
            except OSError as e:
                raise DataError(f"{path}: cannot read ({e.strerror or one_line(e)})") from None
        if self.dataset is not None:
            yield from self._records(f"--dataset {self.dataset}", self._open_dataset())

    def _json_lines(self, path: Path) -> Iterator[tuple[str, bytes]]:
        """The records of a JSON-lines file, one line at a time with Python's json: pyarrow (through
        datasets) refuses the whole file for one record with an escaped lone surrogate and
        counts its rows from 0; here such a record is skipped with a warning, and a line that is
        not a JSON object is an error naming its line. Blank lines are no records. A record
        without the text column is an empty document; a file in which no record of the first
        RECORD_BATCH lines has it is an error (a wrong --text-column, found early)."""
        col, found, columns = self.text_column, False, None
        with open(path, "rb") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except ValueError as e:  # JSONDecodeError, or UnicodeDecodeError: not UTF-8
                    raise DataError(f"{path}: line {line_no} is not a JSON record ({one_line(e)})") from None
                if not isinstance(rec, dict):
                    raise DataError(f"{path}: line {line_no} is a JSON {type(rec).__name__}, not a record (object)")
                found = found or col in rec
                columns = columns or list(rec)
                if not found and line_no >= RECORD_BATCH:
                    break
                doc = self._record_text(str(path), f"line {line_no}", rec.get(col))
                if doc is not None:
                    yield doc
        if columns is not None and not found:
            raise DataError(f"{path}: no text column {col!r} (columns: {', '.join(columns)}); use --text-column")

    def _record_text(self, where: str, which: str, text) -> tuple[str, bytes] | None:
        """(text, its UTF-8 bytes) of one record's text field, None for one skipped with a warning."""
        if text is None:
            text = ""
        if not isinstance(text, str):
            raise DataError(f"{where}: column {self.text_column!r} holds {type(text).__name__}, "
                            f"not text ({which})")
        try:
            return text, text.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate from a JSON escape
            self._warn_once(f"skipping {which} of {where}: not valid Unicode (a lone surrogate)")
            return None

    @staticmethod
    def _open_records(path: Path, kind: str):
        import glob

        datasets = _import_datasets()
        try:
            # data_files is a pattern: a name with [, * or ? would match other files (or none)
            return datasets.load_dataset(kind, data_files=glob.escape(str(path)), split="train", streaming=True)
        except Exception as e:  # datasets raises many types; the message is what the user needs
            raise DataError(f"{path}: cannot read records: {one_line(e)}") from None

    def _open_dataset(self):
        datasets = _import_datasets()
        name, local = self.dataset, Path(self.dataset)
        if not local.exists() and (local.is_absolute() or name.startswith(("./", "../", "~"))):
            raise DataError(f"--dataset {name}: no such directory")
        saved = local.is_dir() and any((local / f).is_file() for f in
                                       ("dataset_info.json", "state.json", "dataset_dict.json"))
        try:
            if saved:  # written by save_to_disk: memory-mapped Arrow, read in batches
                ds = datasets.load_from_disk(str(local))
                if isinstance(ds, datasets.DatasetDict):
                    if self.split not in ds:
                        raise DataError(f"--dataset {name}: no split {self.split!r} "
                                        f"(splits: {', '.join(ds)})")
                    ds = ds[self.split]
                return ds
            return datasets.load_dataset(name, self.dataset_config, split=self.split, streaming=True)
        except DataError:
            raise
        except Exception as e:
            raise DataError(f"--dataset {name}: {one_line(e)}") from None

    def _records(self, where: str, ds) -> Iterator[tuple[str, bytes]]:
        col = self.text_column
        columns = ds.column_names
        if columns is not None and col not in columns:
            raise DataError(f"{where}: no text column {col!r} (columns: {', '.join(columns)}); "
                            f"use --text-column")
        try:
            if columns is not None and len(columns) > 1:
                ds = ds.select_columns([col])
            batches = iter(ds.iter(batch_size=RECORD_BATCH))
            row = 0
            while True:
                try:
                    batch = next(batches)
                except StopIteration:
                    return
                if col not in batch:
                    raise DataError(f"{where}: no text column {col!r} (columns: {', '.join(batch)}); "
                                    f"use --text-column")
                for text in batch[col]:
                    row += 1
                    doc = self._record_text(where, f"record {row}", text)
                    if doc is not None:
                        yield doc
        except DataError:
            raise
        except Exception as e:
            raise DataError(f"{where}: cannot read records: {one_line(e)}") from None


# ---------------------------------------------------------------------------------------------------
# Tokenizer


def train_tokenizer(texts: Iterator[str], vocab_size: int, show_progress: bool):
    """Byte-level BPE: every byte is a token, so any text encodes, and decoding gives it back exactly
    (no normaliser; ByteLevel pre-tokenizer without a prefix space; ByteLevel decoder)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN, PAD_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=show_progress)
    tok.train_from_iterator(texts, trainer)
    return tok


def _token_name(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, {"content": ...} or null."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class TokenizerSpec:
    """tokenizer.json text, its special tokens, and the transformers files to write beside it."""

    def __init__(self, json_text: str, tokenizer, eos: str, bos: str | None, pad: str | None,
                 hf_files: dict[str, bytes] | None = None, source: str = "trained"):
        self.json_text, self.tokenizer, self.source = json_text, tokenizer, source
        self.ignored: list[str] = []  # settings of the file that encoding leaves off (truncation, padding)
        self.eos, self.bos, self.pad = eos, bos, pad
        self.eos_id = self._id(eos)
        self.bos_id = self._id(bos) if bos is not None else None
        self.pad_id = self._id(pad) if pad is not None else None
        vocab = self.tokenizer.get_vocab(with_added_tokens=True)
        # get_vocab_size() is the contract; a tokenizer with holes in its ids still keeps every id
        # below vocab_size.
        self.vocab_size = max(self.tokenizer.get_vocab_size(with_added_tokens=True), max(vocab.values()) + 1)
        self.hf_files = hf_files if hf_files is not None else self._hf_files()

    def _id(self, token: str) -> int:
        i = self.tokenizer.token_to_id(token)
        if i is None:
            raise DataError(f"--tokenizer {self.source}: special token {token!r} is not in the vocabulary")
        return i

    def _hf_files(self) -> dict[str, bytes]:
        # Written by hand rather than by transformers' save_pretrained, whose output depends on the
        # installed version (5.x names a class 4.x cannot load, and rewrites tokenizer.json). These
        # two files load with AutoTokenizer in transformers 4.x and 5.x.
        specials = {k: v for k, v in (("bos_token", self.bos), ("eos_token", self.eos),
                                      ("pad_token", self.pad)) if v is not None}
        # split_special_tokens: a literal "<|endoftext|>" in a text is text, as in the documents
        # (as_document_encoder), not the end-of-text id that only ever stood between them
        # model_input_names: what a tokenizer call returns; transformers 4.x's default adds
        # token_type_ids, which generate(**tokenizer(text)) refuses for a causal LM
        config = {"tokenizer_class": "PreTrainedTokenizerFast", **specials, "clean_up_tokenization_spaces": False,
                  "add_bos_token": False, "add_eos_token": False, "split_special_tokens": True,
                  "model_input_names": list(MODEL_INPUT_NAMES)}
        return {"tokenizer_config.json": (json.dumps(config, indent=2) + "\n").encode(),
                "special_tokens_map.json": (json.dumps(specials, indent=2) + "\n").encode()}

    @classmethod
    def trained(cls, tokenizer) -> "TokenizerSpec":
        from tokenizers import Tokenizer

        json_text = tokenizer.to_str(pretty=True)
        # Encode with exactly what is saved.
        return cls(json_text, Tokenizer.from_str(json_text), EOS_TOKEN, EOS_TOKEN, PAD_TOKEN)

    @staticmethod
    def _check_covers_text(given: str, tokenizer) -> None:
        """A tokenizer that cannot encode some text drops it without a word (a byte-level BPE that
        lacks some of the 256 byte characters, a BPE with no unknown token and no byte fallback): refused
        or warned here, before any work, as is one that cannot encode at all."""
        from tokenizers import pre_tokenizers
        try:
            tokenizer.encode("probe: x = 1\n", add_special_tokens=False)
        except Exception as e:
            raise DataError(f"--tokenizer {given}: cannot encode text ({one_line(e)})") from None
        cfg = json.loads(tokenizer.to_str())
        model, pre = cfg.get("model") or {}, cfg.get("pre_tokenizer") or {}
        byte_level = pre.get("type") == "ByteLevel" or any(
            p.get("type") == "ByteLevel" for p in pre.get("pretokenizers") or [] if isinstance(p, dict))
        if byte_level:
            vocab = tokenizer.get_vocab(with_added_tokens=False)
            missing = sorted(c for c in pre_tokenizers.ByteLevel.alphabet() if c not in vocab)
            if missing:
                raise DataError(f"--tokenizer {given}: a byte-level tokenizer whose vocabulary lacks {len(missing)} "
                                f"of the 256 byte characters (e.g. {missing[0]!r}): text with those bytes "
                                "would be dropped without a trace")
        elif model.get("type") == "BPE" and model.get("unk_token") is None and not model.get("byte_fallback"):
            warn(f"--tokenizer {given}: a BPE with neither an unknown token nor byte fallback drops every "
                 "character it has no token for, without a trace")

    @classmethod
    def load(cls, given: str) -> "TokenizerSpec":
        """A tokenizer.json file, or a directory holding one (and maybe the transformers files)."""
        path = Path(given)
        if path.is_dir():
            folder, file = path, path / "tokenizer.json"
            if not file.is_file():
                raise DataError(f"--tokenizer {given}: no tokenizer.json in this directory")
        elif path.is_file():
            folder, file = (path.parent if path.name == "tokenizer.json" else None), path
        else:
            raise DataError(f"--tokenizer {given}: no such file or directory")
        from tokenizers import Tokenizer

        try:
            json_text = file.read_text(encoding="utf-8")
            tokenizer = Tokenizer.from_str(json_text)
        except Exception as e:  # UnicodeDecodeError, or the Rust parser's error
            raise DataError(f"--tokenizer {given}: not a tokenizers JSON file ({one_line(e)})") from None
        # a tokenizer.json saved with truncation or padding on applies them to every encode():
        # every document cut to the length, or padded with pad ids. Documents are encoded whole
        # (transformers turns both off unless a call asks for them, so the file stays as it is)
        ignored = [what for what, on in (("truncation", tokenizer.truncation), ("padding", tokenizer.padding)) if on]
        tokenizer.no_truncation()
        tokenizer.no_padding()
        if getattr(tokenizer.model, "dropout", None):  # BPE dropout: random merges, other shards each run
            ignored.append(f"BPE dropout ({tokenizer.model.dropout})")
            tokenizer.model.dropout = None
            json_text = tokenizer.to_str(pretty=True)  # saved without it (transformers would apply it)
        cls._check_covers_text(given, tokenizer)

        hf_files: dict[str, bytes] = {}
        specials: dict[str, str | None] = {}
        if folder is not None:
            for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the config wins
                f = folder / name
                if f.is_file():
                    hf_files[name] = f.read_bytes()
                    try:
                        cfg = json.loads(hf_files[name])
                    except ValueError as e:
                        raise DataError(f"--tokenizer {given}: {f} is not JSON ({e})") from None
                    if not isinstance(cfg, dict):
                        raise DataError(f"--tokenizer {given}: {f} is not a JSON object of settings "
                                        f"(it holds a {type(cfg).__name__})")
                    for key in ("eos_token", "bos_token", "pad_token"):
                        if _token_name(cfg.get(key)) is not None:
                            specials[key] = _token_name(cfg.get(key))
        known = tokenizer.token_to_id
        eos = specials.get("eos_token") or (EOS_TOKEN if known(EOS_TOKEN) is not None else None)
        if eos is None:
            raise DataError(f"--tokenizer {given}: no end-of-text token (no {EOS_TOKEN!r} and no "
                            f"eos_token in a tokenizer_config.json beside it)")
        pad = specials.get("pad_token") or (PAD_TOKEN if known(PAD_TOKEN) is not None else None)
        if "tokenizer_config.json" not in hf_files:
            hf_files = None  # write our own, from the specials found
        spec = cls(json_text, tokenizer, eos, specials.get("bos_token") or eos, pad, hf_files, given)
        spec.ignored = ignored
        return spec


# ---------------------------------------------------------------------------------------------------
# Output


class _HashingWriter:
    def __init__(self, f):
        self.f, self.sha = f, hashlib.sha256()

    def write(self, data) -> int:
        self.sha.update(data)
        return self.f.write(data)


def write_atomic(path: Path, data: bytes | np.ndarray) -> str:
    """Write bytes or a .npy array under a temporary name, fsync, rename; return the file's sha256."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        w = _HashingWriter(f)
        if isinstance(data, np.ndarray):
            np.lib.format.write_array(w, data, allow_pickle=False)
        else:
            w.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return w.sha.hexdigest()


class ShardWriter:
    """One split's token stream, cut into shards of exactly `shard_tokens` tokens (the last: fewer).
    The ids go straight into one shard-sized buffer, written and refilled: a list of pending
    arrays joined when full held each shard twice at that moment."""

    def __init__(self, folder: Path, split: str, dtype, shard_tokens: int):
        self.folder, self.split, self.dtype, self.shard_tokens = folder, split, dtype, shard_tokens
        self.buffer: np.ndarray | None = None  # made at the first id: untouched pages cost nothing anyway
        self.n_pending = 0
        self.shards: list[dict] = []
        self.documents = 0
        self.tokens = 0

    def add(self, ids: list[int] | np.ndarray, documents: int) -> None:
        """Append token ids (already eos-terminated documents)."""
        if len(ids) == 0:
            return
        if isinstance(ids, np.ndarray) and int(ids.max()) > np.iinfo(self.dtype).max:
            raise OverflowError(f"token id {int(ids.max())} does not fit {np.dtype(self.dtype).name}")
        arr = np.asarray(ids, dtype=self.dtype)  # a list: raises if an id does not fit the dtype
        self.documents += documents
        self.tokens += arr.size
        start = 0
        while start < arr.size:
            n = min(arr.size - start, self.shard_tokens - self.n_pending)
            self._room(self.n_pending + n)
            self.buffer[self.n_pending:self.n_pending + n] = arr[start:start + n]
            self.n_pending += n
            start += n
            if self.n_pending == self.shard_tokens:
                self._write(self.buffer)
                self.n_pending = 0

    def _room(self, need: int) -> None:
        """A buffer of at least ``need`` tokens, grown as the shard is (doubling, up to
        shard_tokens): a small corpus with a large --shard-tokens holds what it has, not a whole
        shard's worth (--shard-tokens 20G: 37 GiB at once, after the tokenizer's training)."""
        have = 0 if self.buffer is None else self.buffer.size
        if need <= have:
            return
        size = min(self.shard_tokens, max(need, 2 * have, 1 << 20))
        try:
            grown = np.empty(size, dtype=self.dtype)
        except MemoryError:
            mib = size * np.dtype(self.dtype).itemsize / 2 ** 20
            raise DataError(f"--shard-tokens {self.shard_tokens:,}: a shard is held in memory until it is "
                            f"written, and {mib:,.0f} MiB for {size:,} tokens could not be allocated: lower "
                            "--shard-tokens") from None
        if self.n_pending:
            grown[:self.n_pending] = self.buffer[:self.n_pending]
        self.buffer = grown

    def close(self) -> dict:
        if self.n_pending:
            self._write(self.buffer[:self.n_pending])
        self.buffer, self.n_pending = None, 0
        return {"documents": self.documents, "tokens": self.tokens, "shards": self.shards}

    def _write(self, arr: np.ndarray) -> None:
        name = f"{self.split}_{len(self.shards):05d}.npy"
        sha = write_atomic(self.folder / name, arr)
        self.shards.append({"file": name, "tokens": int(arr.size), "sha256": sha})


def split_hasher(seed: int):
    return hashlib.blake2b(digest_size=8, key=hashlib.sha256(str(seed).encode()).digest())


def split_key(hasher, data: bytes) -> float:
    """A document's place in [0, 1), from its content and the seed (in `hasher`): identical documents
    always land in the same split, so val never holds a verbatim copy of a train document. A
    document is in val when its key is below --val-fraction."""
    h = hasher.copy()
    h.update(data)
    return int.from_bytes(h.digest(), "little") / 2.0**64


def check_out(out: Path, given: str, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {given}: is a file, not a directory")
    if not out.is_dir():
        # made at the end, beside where it goes: a place it cannot be made is said now, not after
        # the tokenizer's training
        above = out.absolute().parent
        while not above.exists() and above != above.parent:
            above = above.parent
        if not above.is_dir():
            raise DataError(f"--out {given}: {above} is a file, not a directory")
        try:  # permissions, a read-only mount, /proc: what os.access cannot tell root
            os.rmdir(tempfile.mkdtemp(prefix=f".{out.name}.probe-", dir=above))
        except OSError as e:
            raise DataError(f"--out {given}: cannot create it in {above} ({e.strerror or one_line(e)})") from None
        return
    if os.path.ismount(out):  # found only at the end otherwise: "Device or resource busy"
        raise DataError(f"--out {given}: is a mount point, which cannot be renamed onto (the output is "
                        f"built beside it and renamed into place); give a directory inside it")
    entries = sorted(p.name for p in out.iterdir())
    if not entries:
        return
    if not overwrite:
        raise DataError(f"--out {given}: directory is not empty ({len(entries)} entries); "
                        f"pass --overwrite to replace it")
    ours = set(TOKENIZER_FILES) | {"meta.json"}
    for name in entries:  # shards are train_00000.npy, val_00000.npy, ... (train_notes.npy is not one)
        if not (name in ours or re.fullmatch(r"(train|val)_\d{5,}\.npy", name)):
            raise DataError(f"--out {given}: holds {name!r}, which {PROG} does not write; "
                            f"refusing to replace the directory")
    # names alone would pass a tokenizer that save_pretrained wrote, or a lone shard: an output of
    # this script is installed whole, its meta.json saying so
    try:
        made_by = json.loads((out / "meta.json").read_text()).get("created_by")
    except (OSError, ValueError, AttributeError):
        made_by = None
    if made_by != PROG:
        raise DataError(f"--out {given}: has no meta.json written by {PROG}, so it is not an earlier "
                        f"output; refusing to replace the directory")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def install(staging: Path, out: Path, overwrite: bool, recheck: Callable[[], None], name: str,
            say: Callable[[str], None] = warn) -> None:
    """Put the finished staging directory at `out` (called `name` in messages), replacing an old
    output there only with `overwrite`. What is at `out` may have changed since the caller's check
    at start (another run finished there, a user's files): without `overwrite` it is never replaced
    (a rename onto a non-empty directory fails; onto an empty one it replaces it), with it
    `recheck` (the caller's content check) runs again first. Shared with export_hf.py."""
    _fsync_dir(staging)
    old = None
    if overwrite:
        recheck()
    try:  # the set-aside inside: an interrupt right after it still puts the old output back
        if overwrite and out.is_dir() and any(out.iterdir()):
            old = out.with_name(f".{out.name}.old-{os.getpid()}-{secrets.token_hex(4)}")
            os.rename(out, old)
        os.rename(staging, out)
    except BaseException as e:
        if old is not None and old.exists():
            os.rename(old, out)
        if isinstance(e, OSError) and e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            found = "a non-empty directory" if out.is_dir() else "a file"
            raise DataError(f"{name}: {found} appeared there while this run worked; left as it is "
                            f"(pass --overwrite to replace an earlier output)") from None
        raise
    # The new output is in place: the install is done whatever happens from here (an interrupt
    # or an error while deleting the old output leaves a directory to remove, nothing else).
    try:
        if old is not None:
            shutil.rmtree(old)
        _fsync_dir(out.parent)
    except BaseException as e:
        why = "interrupted" if isinstance(e, KeyboardInterrupt) else one_line(e)
        if old is not None and old.exists():
            say(f"{name} is complete, but deleting the previous output failed ({why}): remove {old}")
        else:
            say(f"{name} is complete, but syncing {out.parent} failed ({why})")


# ---------------------------------------------------------------------------------------------------
# The pipeline


def _batches(docs: Iterator[tuple[str, bytes | None, str | None, bool]]) -> Iterator[tuple[list[str], list[tuple]]]:
    """(texts, each text's (bytes, split, ends)) of about BATCH_BYTES of text or BATCH_DOCS documents."""
    texts, rest, nbytes = [], [], 0
    for text, data, split, ends in docs:
        texts.append(text)
        rest.append((data, split, ends))
        nbytes += len(data) if data is not None else len(text)
        if nbytes >= BATCH_BYTES or len(texts) >= BATCH_DOCS:
            yield texts, rest
            texts, rest, nbytes = [], [], 0
    if texts:
        yield texts, rest


def char_start(data, at: int) -> int:
    """The start of the UTF-8 character that byte ``at`` of ``data`` (bytes or a map) is in."""
    while at > 0 and data[at] & 0xC0 == 0x80:  # a continuation byte, 10xxxxxx
        at -= 1
    return at


def val_cut(data, n: int, val_fraction: float) -> int:
    """Where the val part of a document of ``n`` UTF-8 bytes begins: after the last line end in
    its last 2 x ``val_fraction`` of the bytes but not in the last ``val_fraction``; none there:
    at the character that holds the byte ``val_fraction`` of them from the end."""
    want = max(1, round(val_fraction * n))
    nl = data.rfind(b"\n", max(0, n - 2 * want), n - want)
    return nl + 1 if nl != -1 else char_start(data, n - want)


def split_large(docs: Iterator[tuple[str, bytes] | tuple[LargeText, None]], val_fraction: float,
                exact: bool = True, source: str = "") -> Iterator[tuple[str, bytes | None, str | None, bool]]:
    """(text, its bytes, its split, whether it ends a document) for every document: split None
    (chosen later from its content) for one of at most SPLIT_CHARS characters; a longer one is
    two documents, its last `val_fraction` (``val_cut``) for val and the rest for train. A
    LargeText's two parts come in pieces (bytes None), only the last of each ending its document:
    of about READ_BYTES characters, which the encoder cuts again with the same tokens; with a
    tokenizer for which that is not ``exact`` (`source`, say), of about PIECE_CHARS characters,
    said in a warning: whole, the file's text and its encoding would take ~230 bytes of memory
    per byte of the file."""
    for text, data in docs:
        if isinstance(text, LargeText):
            if not exact:
                warn(f"{text.path} ({text.size / 2 ** 20:,.0f} MiB) is encoded in pieces of ~{PIECE_CHARS:,} "
                     f"characters cut at blanks and punctuation: --tokenizer {source} is not this script's "
                     "byte-level BPE, so its tokens at the cuts may differ from the whole file's")
            size = READ_BYTES if exact else PIECE_CHARS
            cut = text.val_cut(val_fraction)
            for split, start, end in (("val", cut, text.size), ("train", 0, cut)):  # val first, as below
                pieces = text.texts(start, end, size)
                piece = next(pieces)
                for after in pieces:
                    yield piece, None, split, False
                    piece = after
                yield piece, None, split, True
            continue
        if len(text) <= SPLIT_CHARS:
            yield text, data, None, True
            continue
        cut = val_cut(data, len(data), val_fraction)
        tail = data[cut:].decode()
        yield tail, None, "val", True  # first: --max-tokens stops only after the train part
        yield text[:len(text) - len(tail)], None, "train", True


# Where GPT-2's pre-tokenizer pattern always starts a pre-token, whatever surrounds the text:
# - before the last character of a whitespace run that a non-blank follows (the run's start is one
#   pre-token, ``\s+(?!\S)``, and its last character stands alone or, a space, opens " word");
#   Python's \s takes in every character the pattern's \s does, so \S here is never blank there;
# - before an ASCII letter or digit after ASCII punctuation other than "'" (no pre-token holds a
#   letter or digit and a punctuation mark; "'" would start a contraction, 's 't 're ...).
PIECE_CUT = re.compile(r"(?=[ \t\r\n]\S)|(?<=[(){}\[\],;:\"=<>])(?=[A-Za-z0-9])")


def text_pieces(text: str, size: int | None = None) -> Iterator[str]:
    r"""``text`` in pieces of about ``size`` characters, each cut at the first ``PIECE_CUT`` past
    ``size``: before the last blank of a run that a non-blank follows ("a.\n|\nb", "x\r|\ny",
    "a| b", "a  | b"), or between punctuation and a letter or digit ('{"|key"': a file that is one
    long line of JSON). None past ``size``: the rest stays whole.

    A byte-level pre-tokenizer (GPT-2's pattern) starts a pre-token at every such cut, so the
    pieces' tokens, one after the other, are the whole text's: pieces change memory, not tokens.
    ``pieces_are_exact`` says which tokenizers that holds for."""
    size = size or PIECE_CHARS
    start, n = 0, len(text)
    while n - start > size:
        cut = PIECE_CUT.search(text, start + size)
        if cut is None:
            break
        yield text[start:cut.start()]
        start = cut.start()
    yield text[start:]


def pieces_are_exact(tokenizer) -> bool:
    """Whether ``text_pieces`` leaves this tokenizer's tokens as they are: no normaliser, a
    ByteLevel pre-tokenizer with its regex and without a prefix space, and no added tokens but
    special ones (what this script trains; a document's special tokens are text,
    ``as_document_encoder``). Others (a Metaspace "▁" before each piece's first word; an added
    token "    ", which is matched in the text before pre-tokenization and which a cut before
    the last blank of a run splits) encode long documents whole, and a file over STREAM_BYTES in
    pieces whose tokens may differ at the cuts (``split_large``)."""
    cfg = json.loads(tokenizer.to_str())
    pre = cfg.get("pre_tokenizer") or {}
    return (cfg.get("normalizer") is None and pre.get("type") == "ByteLevel"
            and pre.get("use_regex", True) and not pre.get("add_prefix_space", False)
            and all(t.get("special") for t in cfg.get("added_tokens") or []))


def _sample(docs: Iterator[tuple[str, bytes] | tuple[LargeText, None]], limit: int, stats: dict) -> Iterator[str]:
    """The first `limit` bytes of text (the last document cut short, at a character boundary),
    long documents in pieces (the trainer counts pre-tokens, which pieces keep); counts them in
    stats."""
    for text, data in docs:
        large = isinstance(text, LargeText)
        size, left = (text.size if large else len(data)), limit - stats["sample_bytes"]
        last = size >= left
        # cut short: at the start of the character the limit falls in (no character cut in two)
        end = size if not last or left >= size else text.boundary(left) if large else char_start(data, left)
        stats["sample_documents"] += 1
        stats["sample_bytes"] += end
        if large:
            yield from text.texts(0, end, PIECE_CHARS)
        else:
            yield from text_pieces(text if end == size else data[:end].decode())
        if last:
            return


def prepare(args: argparse.Namespace, argv: list[str]) -> str:
    t0 = time.time()
    out = Path(os.path.realpath(args.out))  # a symlink to a directory: replace the directory
    check_out(out, args.out, args.overwrite)  # before any work: an existing directory is never touched
    inputs = find_files(args.input, args.glob, args.exclude, out)
    files = [f for _, fs in inputs for f in fs]
    if not files and args.dataset is None:
        raise DataError(f"no input files in {', '.join(args.input)}"
                        + (f" matching --glob {' '.join(args.glob)}" if args.glob else ""))
    corpus = Corpus(files, args.dataset, args.dataset_config, args.split, args.text_column, args.max_docs)
    interactive = sys.stderr.isatty()

    if args.tokenizer is not None:
        spec = TokenizerSpec.load(args.tokenizer)
        if spec.ignored:
            warn(f"--tokenizer {args.tokenizer}: its tokenizer.json turns on {' and '.join(spec.ignored)}; "
                 "ignored here: every document is encoded whole, the same way every time")
        tokenizer_meta = {"source": args.tokenizer}
    else:
        tokenizer_meta = {"source": "trained", "vocab_size_requested": args.vocab_size,
                          "sample_documents": 0, "sample_bytes": 0}
        trained = train_tokenizer(_sample(corpus.documents(), args.tokenizer_sample_bytes, tokenizer_meta),
                                  args.vocab_size, interactive)
        if tokenizer_meta["sample_documents"] == 0:
            raise DataError(_no_documents(corpus))
        spec = TokenizerSpec.trained(trained)
        if spec.vocab_size < args.vocab_size:
            warn(f"the tokenizer has {spec.vocab_size} tokens, fewer than --vocab-size "
                 f"{args.vocab_size}: its {tokenizer_meta['sample_bytes']:,}-byte sample has no more "
                 f"pairs to merge")
    dtype = np.dtype(SHARD_DTYPES[0] if spec.vocab_size <= 1 << 16 else SHARD_DTYPES[1])

    created = [p for p in [out.parent, *out.parent.parents] if not p.exists()]
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.with_name(f".{out.name}.partial-{os.getpid()}-{secrets.token_hex(4)}")
    staging.mkdir()
    try:
        tokenizer_sha = write_atomic(staging / "tokenizer.json", spec.json_text.encode())
        for name, data in spec.hf_files.items():
            write_atomic(staging / name, data)
        splits = encode_corpus(corpus, spec, dtype, staging, args, interactive)
        meta = {
            "format_version": FORMAT_VERSION,
            "vocab_size": spec.vocab_size,
            "dtype": np.dtype(dtype).name,
            "eos_id": spec.eos_id, "bos_id": spec.bos_id, "pad_id": spec.pad_id,
            "eos_token": spec.eos, "bos_token": spec.bos, "pad_token": spec.pad,
            "tokenizer_file": "tokenizer.json", "tokenizer_sha256": tokenizer_sha,
            "tokenizer": tokenizer_meta,
            "splits": splits,
            "seed": args.seed, "val_fraction": args.val_fraction, "shard_tokens": args.shard_tokens,
            "max_docs": args.max_docs, "max_tokens": args.max_tokens,
            "inputs": [{"path": given, "files": len(fs)} for given, fs in inputs]
                      + ([{"dataset": args.dataset, "config": args.dataset_config, "split": args.split,
                           "text_column": args.text_column}] if args.dataset else []),
            "skipped_files": [{"path": p, "reason": r} for p, r in corpus.skipped.items()],
            "empty_documents_dropped": corpus.empty,
            "command": shlex.join([PROG, *argv]),
            "created_by": PROG,
        }
        write_atomic(staging / "meta.json", (json.dumps(meta, indent=2) + "\n").encode())
        install(staging, out, args.overwrite, lambda: check_out(out, args.out, True), f"--out {args.out}")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        for p in created:  # the parents this run made, innermost first
            try:
                p.rmdir()
            except OSError:
                break
        raise

    tr, va = splits["train"], splits["val"]
    elapsed = time.time() - t0
    tokens = tr["tokens"] + va["tokens"]
    shards = lambda n: f"{n} shard" + ("s" if n != 1 else "")
    return (f"{PROG}: wrote {args.out}: train {tr['documents']:,} docs {tr['tokens']:,} tokens "
            f"({shards(len(tr['shards']))}), val {va['documents']:,} docs {va['tokens']:,} tokens "
            f"({shards(len(va['shards']))}); vocab {spec.vocab_size} ({np.dtype(dtype).name}); "
            f"{elapsed:.1f} s, {tokens / max(elapsed, 1e-9):,.0f} tokens/s")


def _no_documents(corpus: Corpus) -> str:
    held = [f"{corpus.empty} empty document(s)"] if corpus.empty else []
    if corpus.skipped:
        held.append(f"{len(corpus.skipped)} unreadable file(s), skipped (the warnings above say why)")
    return f"no documents: the inputs hold {' and '.join(held) or 'no records'}"


def as_document_encoder(tokenizer):
    """``tokenizer`` set to encode as documents are encoded here (and sample.py's prompt): raw
    text, so a literal "<|endoftext|>" in one is text, not a document boundary."""
    tokenizer.encode_special_tokens = True
    return tokenizer


def encode_corpus(corpus: Corpus, spec: TokenizerSpec, dtype, folder: Path,
                  args: argparse.Namespace, interactive: bool) -> dict:
    """Encode every document and route it to train or val; returns meta.json's "splits"."""
    from tqdm import tqdm

    encoder = as_document_encoder(spec.tokenizer)
    eos = spec.eos_id
    hasher = split_hasher(args.seed)
    writers = {s: ShardWriter(folder, s, dtype, args.shard_tokens) for s in ("train", "val")}
    # One document per split is held back, with its identical copies (one key: they must stay
    # together): the train document closest to the val threshold and the val document farthest
    # from it. At the end they move if a split would otherwise be empty.
    reserve: dict[str, tuple[float, list] | None] = {"train": None, "val": None}
    assigned = {"train": 0, "val": 0}
    total_tokens = 0
    stop = False

    exact = pieces_are_exact(encoder)
    at_once = max(1, min(8, os.cpu_count() or 1))  # pieces encoded together: one per core

    def encode(texts):
        """Each text's ids: a list, or for a long text encoded in pieces an array."""
        try:
            return _encode(texts)
        except Exception as e:  # the Rust side's error (an unknown unk token, say): one line, not a traceback
            raise DataError(f"--tokenizer {spec.source}: cannot encode a document ({one_line(e)})") from None

    def _encode(texts):
        long = {i for i, t in enumerate(texts) if len(t) > PIECE_CHARS} if exact else set()
        short = [t for i, t in enumerate(texts) if i not in long]
        encoded = iter(encoder.encode_batch_fast(short, add_special_tokens=False))
        out = []
        for i, text in enumerate(texts):
            if i not in long:
                out.append(next(encoded).ids)
                continue
            parts, pieces = [], text_pieces(text)
            while batch := [piece for _, piece in zip(range(at_once), pieces)]:
                parts += [np.array(e.ids, dtype=np.uint32)
                          for e in encoder.encode_batch_fast(batch, add_special_tokens=False)]
            out.append(np.concatenate(parts))
        return out

    def consume(rest, encoded):
        nonlocal total_tokens, stop
        flat = {"train": [], "val": []}  # runs of ids: lists, and the arrays of long documents
        ndocs = {"train": 0, "val": 0}
        done = 0
        for (data, part_of, ends), ids in zip(rest, encoded):
            # a large document's train part follows its val part: --max-tokens keeps them together
            stop = (args.max_tokens is not None and part_of != "val"
                    and total_tokens + len(ids) + 1 >= args.max_tokens)
            whole = ends or stop  # a document counts once: at its end, or where the run stops
            if whole:  # where the run stops inside a document, its last part ends as a document does
                if isinstance(ids, np.ndarray):
                    ids = np.append(ids, np.uint32(eos))
                else:
                    ids.append(eos)
            total_tokens += len(ids)
            done += whole
            if part_of is not None:  # a part of a large document: its split is fixed, never held back
                split, out = part_of, [ids]
            else:
                key = split_key(hasher, data)
                split = "val" if key < args.val_fraction else "train"
                held = reserve[split]
                if held is not None and key == held[0]:
                    held[1].append(ids)
                    out = []
                elif held is None or (key < held[0] if split == "train" else key > held[0]):
                    reserve[split] = (key, [ids])
                    out = held[1] if held is not None else []
                else:
                    out = [ids]
            assigned[split] += whole
            for ids in out:
                runs = flat[split]
                if isinstance(ids, list) and runs and isinstance(runs[-1], list):
                    runs[-1].extend(ids)
                else:
                    runs.append(ids if isinstance(ids, np.ndarray) else list(ids))
                ndocs[split] += whole  # a held document is always whole
            if stop:
                break
        for split, runs in flat.items():
            for k, run in enumerate(runs):
                writers[split].add(run, ndocs[split] if k == 0 else 0)
        return done

    bar = tqdm(desc="encoding", unit="doc", disable=not interactive, dynamic_ncols=True)
    t0 = time.time()
    with ThreadPoolExecutor(max_workers=1) as pool:  # encode batch k+1 while storing batch k
        pending = None
        for texts, rest in _batches(split_large(corpus.documents(), args.val_fraction, exact, spec.source)):
            job = (rest, pool.submit(encode, texts))
            if pending is not None:
                bar.update(consume(pending[0], pending[1].result()))
            pending = job
            bar.set_postfix_str(f"{total_tokens / max(time.time() - t0, 1e-9) / 1e6:.2f}M tok/s",
                                refresh=False)
            if stop:
                break
        if pending is not None and not stop:
            bar.update(consume(pending[0], pending[1].result()))
    bar.close()

    n_docs = assigned["train"] + assigned["val"]
    if n_docs == 0:
        raise DataError(_no_documents(corpus))
    held = {split: reserve[split][1] if reserve[split] is not None else [] for split in reserve}
    moves = {"train": "train", "val": "val"}
    if assigned["val"] == 0 and assigned["train"] > len(held["train"]):  # train keeps a document
        moves["train"] = "val"
    elif assigned["train"] == 0:
        moves["val"] = "train"
    for split, dest in moves.items():
        for ids in held[split]:
            writers[dest].add(ids, 1)
    # train.py needs both splits: an empty one is an error here, not after the work of a run there
    if writers["val"].documents == 0:
        why = (f"the corpus is one document of {writers['train'].tokens:,} tokens, and only documents over "
               f"{SPLIT_CHARS:,} characters are split between train and val" if n_docs == 1 else
               "the documents are copies of one text (identical documents share a split)")
        limits = [f"--max-tokens {args.max_tokens:,}" if stop else None,
                  f"--max-docs {args.max_docs:,}" if args.max_docs is not None and n_docs >= args.max_docs else None]
        if any(limits):  # the corpus may hold more: the limit cut it short
            raise DataError(f"the val split would be empty: {' and '.join(filter(None, limits))} stopped the "
                            f"corpus at {n_docs:,} document(s) ({why}); raise the limit")
        raise DataError(f"the val split would be empty: {why}; give more documents (several files, "
                        "or JSON-lines records, one per document)")
    share = writers["val"].tokens / (writers["val"].tokens + writers["train"].tokens)
    if share > 3 * args.val_fraction and share > args.val_fraction + 0.02:  # not the chance of a few documents
        warn(f"the val split holds {share:.1%} of the tokens, far more than --val-fraction "
             f"{args.val_fraction}: documents of at most {SPLIT_CHARS:,} characters go to a split whole, "
             f"and there are few ({n_docs:,}); more, smaller documents give a closer split")
    return {split: w.close() for split, w in writers.items()}


# ---------------------------------------------------------------------------------------------------
# Verification of a prepared directory (--verify)

VERIFY_CHUNK = 8 << 20


def _verify_shard(path: Path, tokens: int, sha256: str, dtype: np.dtype, vocab_size: int) -> str | None:
    """What is wrong with one shard against its meta.json entry, or None. One pass over the file:
    the sha256 of its bytes and the largest token id, a chunk at a time (bounded memory)."""
    if not path.is_file():
        return "missing"
    with open(path, "rb") as f:
        try:
            fmt = np.lib.format
            version = fmt.read_magic(f)
            header = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
            shape, _, found = header(f)
        except ValueError as e:
            return f"not a .npy array ({one_line(e)})"
        offset = f.tell()
        if found != dtype or len(shape) != 1:
            return f"a {found} array of shape {shape}; meta.json says 1-D {dtype.name}"
        if shape[0] != tokens:
            return f"{shape[0]:,} tokens; meta.json says {tokens:,}"
        size = os.fstat(f.fileno()).st_size
        if size != offset + tokens * dtype.itemsize:
            return f"{size:,} bytes, the header says {offset + tokens * dtype.itemsize:,} (an incomplete copy?)"
        f.seek(0)
        digest = hashlib.sha256(f.read(offset))
        largest, chunk = -1, VERIFY_CHUNK - VERIFY_CHUNK % dtype.itemsize
        while data := f.read(chunk):
            digest.update(data)
            largest = max(largest, int(np.frombuffer(data, dtype=dtype).max()))
    if digest.hexdigest() != sha256:
        return "sha256 differs from meta.json (changed, or corrupted in a copy)"
    if largest >= vocab_size:
        return f"token id {largest} is past the vocabulary ({vocab_size} tokens)"
    return None


def verify(folder: Path) -> tuple[list[str], str]:
    """Check a prepared directory against its meta.json: (problems, one per file, "FILE: what"; a
    summary line). Shards are checked by a few threads (hashing and numpy release the GIL)."""
    meta_path = folder / "meta.json"
    try:
        meta = json.loads(meta_path.read_text())
        vocab_size, dtype = meta["vocab_size"], np.dtype(meta["dtype"])
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):  # Infinity parses as a float
            raise DataError(f"{meta_path}: vocab_size is {vocab_size!r}, not a number of tokens")
        if meta["dtype"] not in SHARD_DTYPES:  # what prepare() writes, and the trainers read
            raise DataError(f"{meta_path}: dtype {meta['dtype']!r}: shards hold token ids as "
                            f"{' or '.join(SHARD_DTYPES)}")
        shards = [(folder / sh["file"], int(sh["tokens"]), str(sh["sha256"]))
                  for split in ("train", "val") for sh in meta["splits"][split]["shards"]]
        tokenizer = (folder / meta["tokenizer_file"], str(meta["tokenizer_sha256"]))
    except OSError as e:
        raise DataError(f"--verify {folder}: cannot read {meta_path} ({e.strerror or one_line(e)})") from None
    except (ValueError, KeyError, TypeError, OverflowError) as e:
        raise DataError(f"{meta_path}: not a prepare_data.py meta.json ({type(e).__name__}: {one_line(e)})") from None
    t0 = time.time()
    problems = []
    path, sha = tokenizer
    if not path.is_file():
        problems.append(f"{path}: missing")
    elif hashlib.sha256(path.read_bytes()).hexdigest() != sha:
        problems.append(f"{path}: sha256 differs from meta.json (another tokenizer: the shards' ids mean other text)")
    interactive = sys.stderr.isatty()
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1, max(1, len(shards)))) as pool:
        results = pool.map(lambda e: _verify_shard(*e, dtype, vocab_size), shards)
        for i, ((path, _, _), problem) in enumerate(zip(shards, results), 1):
            if problem is not None:
                problems.append(f"{path}: {problem}")
            if interactive:
                print(f"\r{PROG}: verified {i}/{len(shards)} shards", end="", file=sys.stderr, flush=True)
    if interactive:
        print(file=sys.stderr)
    tokens = sum(t for _, t, _ in shards)
    nbytes = sum(p.stat().st_size for p, _, _ in shards if p.is_file())
    elapsed = time.time() - t0
    return problems, (f"{len(shards)} shards, {tokens:,} tokens, {nbytes / 1e6:,.1f} MB and the tokenizer "
                      f"in {elapsed:.1f} s")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    try:
        args = parse_args(argv)
        if args.verify is not None:
            problems, summary = verify(Path(args.verify))
            for problem in problems:
                print(f"{PROG}: {problem}", file=sys.stderr)
            if problems:
                print(f"{PROG}: error: {args.verify}: {len(problems)} file(s) do not match meta.json; "
                      f"checked {summary}", file=sys.stderr)
                return 1
            print(f"{PROG}: verified {args.verify}: {summary}: all match meta.json", flush=True)
            return 0
        summary = prepare(args, argv)
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    except DataError as e:
        print(f"{PROG}: error: {one_line(e)}", file=sys.stderr)
        return 2
    except OSError as e:
        where = f": {e.filename}" if e.filename else ""
        print(f"{PROG}: error: {e.strerror or one_line(e)}{where}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; nothing was written", file=sys.stderr)
        return 130
    print(summary, flush=True)
    return 0


def _terminate(signum, frame):
    raise KeyboardInterrupt  # clean up the staging directory as for Ctrl+C


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _terminate)
    # a terminal's hang-up too, unless started under nohup: the staging directory (as large as the
    # output) was left behind
    if hasattr(signal, "SIGHUP") and signal.getsignal(signal.SIGHUP) != signal.SIG_IGN:
        signal.signal(signal.SIGHUP, _terminate)
    sys.exit(main())
