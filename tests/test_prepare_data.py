"""prepare_data.py: round trip, transformers compatibility, shard contract, determinism, inputs, errors."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import prepare_data
from conftest import ROOT, STDLIB, stdlib_inputs

TRICKY = {
    "crlf.txt": "line one\r\nline two\r\n\r\n",
    "specials.txt": "before <|endoftext|> middle <|pad|> after<|endoftext|>",
    "unicode.txt": "naïve café 🙂 \u0301e\u0301 漢字 \x00 nul \ufeff bom inside\n",
    "bom.txt": "\ufeffstarts with a byte order mark",
    "spaces.txt": "   \t  \n\n    ",
    "trailing.py": "def f():\n    return 1    \n\t\n",
}


# --- helpers ----------------------------------------------------------------------------------------


def meta_of(d: Path) -> dict:
    return json.loads((d / "meta.json").read_text())


def stream(d: Path, split: str) -> np.ndarray:
    shards = meta_of(d)["splits"][split]["shards"]
    if not shards:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.load(d / s["file"], mmap_mode="r") for s in shards])


def documents(d: Path, split: str) -> list[str]:
    """Decode a split back into documents, splitting its token stream at end-of-text."""
    from tokenizers import Tokenizer

    meta = meta_of(d)
    ids = stream(d, split)
    if ids.size:
        assert ids[-1] == meta["eos_id"], "a split's stream must end with end-of-text"
    cuts = np.flatnonzero(ids == meta["eos_id"])
    starts = np.concatenate([[0], cuts[:-1] + 1])
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    return tok.decode_batch([ids[a:b].tolist() for a, b in zip(starts, cuts)], skip_special_tokens=False)


def all_documents(d: Path) -> Counter:
    return Counter(documents(d, "train")) + Counter(documents(d, "val"))


def source_documents(roots, suffix=".py") -> Counter:
    """The documents a run should produce from these directories: non-empty UTF-8 files."""
    docs = Counter()
    for root in roots:
        for path in Path(root).rglob(f"*{suffix}"):
            try:
                text = path.read_bytes().decode("utf-8")
            except UnicodeDecodeError:
                continue
            if text:
                docs[text] += 1
    return docs


def snapshot(d: Path) -> dict:
    return {p.relative_to(d).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(d.rglob("*")) if p.is_file()}


def write_docs(folder: Path, docs: dict[str, str | bytes]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in docs.items():
        (folder / name).write_bytes(text if isinstance(text, bytes) else text.encode())
    return folder


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def run(*args) -> int:
    return prepare_data.main([str(a) for a in args])


# --- Done when 1: round trip ------------------------------------------------------------------------


def test_round_trip_stdlib_subset(stdlib_data):
    assert all_documents(stdlib_data) == source_documents(stdlib_inputs())


@pytest.mark.slow
def test_round_trip_large_stdlib(stdlib_data, tmp_path):
    """The standard library minus its test suite and site-packages (~14 MB, ~860 files), encoded with
    the fixture's tokenizer (training is covered elsewhere; the round trip must hold for any merges)."""
    out = tmp_path / "out"
    assert run("--input", STDLIB, "--glob", "*.py", "--exclude", "site-packages", "--exclude", "test",
               "--tokenizer", stdlib_data, "--out", out) == 0
    expected = Counter()
    for path in STDLIB.rglob("*.py"):
        rel = path.relative_to(STDLIB).parts
        if "site-packages" in rel or "test" in rel:
            continue
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue
        expected[text] += bool(text)
    expected = +expected
    assert sum(expected.values()) > 500
    assert all_documents(out) == expected


def test_round_trip_tricky_text_and_skips(tmp_path, capsys):
    src = write_docs(tmp_path / "src", {**TRICKY, "latin1.txt": "caf\xe9".encode("latin-1"),
                                        "empty.txt": ""})
    out = tmp_path / "out"
    assert run("--input", src, "--vocab-size", 300, "--out", out) == 0
    err = capsys.readouterr().err
    assert f"skipping {src / 'latin1.txt'}: not valid UTF-8" in err
    assert all_documents(out) == Counter(TRICKY.values())
    meta = meta_of(out)
    assert meta["skipped_files"] == [{"path": str(src / "latin1.txt"),
                                      "reason": "not valid UTF-8 (byte 0xe9 at offset 3)"}]
    assert meta["empty_documents_dropped"] == 1
    # A literal "<|endoftext|>" inside a document is text: exactly one end-of-text per document.
    assert sum(int((stream(out, s) == meta["eos_id"]).sum()) for s in ("train", "val")) == len(TRICKY)


@pytest.fixture(scope="module")
def fixture_tokenizer(stdlib_data):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(stdlib_data / "tokenizer.json"))
    tok.encode_special_tokens = True  # as prepare_data.py encodes documents
    return tok


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=200))
def test_any_text_round_trips_without_end_of_text(fixture_tokenizer, stdlib_data, text):
    ids = fixture_tokenizer.encode(text, add_special_tokens=False).ids
    assert fixture_tokenizer.decode(ids, skip_special_tokens=False) == text
    assert meta_of(stdlib_data)["eos_id"] not in ids
    assert all(0 <= i < 512 for i in ids)


# --- Done when 2: transformers ----------------------------------------------------------------------


def test_autotokenizer_matches_trained_tokenizer(stdlib_data):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    meta = meta_of(stdlib_data)
    hf = AutoTokenizer.from_pretrained(stdlib_data)
    tok = Tokenizer.from_file(str(stdlib_data / "tokenizer.json"))
    assert (hf.eos_token_id, hf.bos_token_id, hf.pad_token_id) == (meta["eos_id"], meta["bos_id"], meta["pad_id"])
    assert hf.eos_token == "<|endoftext|>" and hf.pad_token == "<|pad|>"
    assert len(hf) == meta["vocab_size"] == 512
    texts = sorted(source_documents([STDLIB / "json"]))[:5] + list(TRICKY.values())
    assert any("<|endoftext|>" in t for t in texts)
    tok = prepare_data.as_document_encoder(tok)  # as documents are encoded: a literal special token is text
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert hf.encode(text, add_special_tokens=False) == ids
        assert hf(text)["input_ids"] == ids  # no special tokens added by default
        assert hf.decode(ids) == text  # no clean-up of spaces
    # what a call returns, named in the file: transformers 4.x's default adds token_type_ids
    config = json.loads((stdlib_data / "tokenizer_config.json").read_text())
    assert config["model_input_names"] == list(hf(texts[0])) == ["input_ids", "attention_mask"]


# --- Done when 3: the shard contract ----------------------------------------------------------------


def test_shards_agree_with_meta(stdlib_data):
    meta = meta_of(stdlib_data)
    assert meta["format_version"] == 1 and meta["created_by"] == "prepare_data.py"
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 512
    assert meta["tokenizer_file"] == "tokenizer.json"
    assert meta["tokenizer_sha256"] == hashlib.sha256((stdlib_data / "tokenizer.json").read_bytes()).hexdigest()
    assert len(meta["splits"]["train"]["shards"]) >= 2
    for split in ("train", "val"):
        info = meta["splits"][split]
        assert info["documents"] >= 1
        for i, shard in enumerate(info["shards"]):
            path = stdlib_data / shard["file"]
            assert shard["file"] == f"{split}_{i:05d}.npy"
            arr = np.load(path, mmap_mode="r")
            assert arr.ndim == 1 and arr.dtype == np.dtype(meta["dtype"])
            assert arr.size == shard["tokens"]
            assert shard["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
            assert int(arr.max()) < meta["vocab_size"]
            if i < len(info["shards"]) - 1:
                assert arr.size == meta["shard_tokens"]
            else:
                assert 0 < arr.size <= meta["shard_tokens"]
        ids = stream(stdlib_data, split)
        assert ids.size == info["tokens"] == sum(s["tokens"] for s in info["shards"])
        assert int((ids == meta["eos_id"]).sum()) == info["documents"]
    names = {p.name for p in stdlib_data.iterdir()}
    assert names == {"meta.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                     *(s["file"] for sp in meta["splits"].values() for s in sp["shards"])}


def test_verify_finds_every_file_that_differs_from_meta(stdlib_data, tmp_path, prepare_data_cli):
    """--verify passes a prepared directory and names each file a copy got wrong (one line each,
    exit 1), reading and writing nothing else: a flipped token, a truncated shard, a missing one,
    another tokenizer, and (meta.json made to agree with the file) a token id past the vocabulary."""
    ok = prepare_data_cli("--verify", stdlib_data)
    assert ok.returncode == 0 and "all match meta.json" in ok.stdout and not ok.stderr, ok.stderr
    d = tmp_path / "copy"
    shutil.copytree(stdlib_data, d)
    meta = meta_of(d)
    train = [d / sh["file"] for sh in meta["splits"]["train"]["shards"]]
    val = d / meta["splits"]["val"]["shards"][0]["file"]
    a = np.load(train[0])
    a[len(a) // 2] ^= 1                    # one bit, same size: only the hash sees it
    np.save(train[0], a)
    with open(train[1], "r+b") as f:       # an interrupted copy
        f.truncate(os.path.getsize(train[1]) // 2)
    val.unlink()
    (d / "tokenizer.json").write_text((d / "tokenizer.json").read_text() + " ")
    before = snapshot(d)
    bad = prepare_data_cli("--verify", d)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr and not bad.stdout
    lines = bad.stderr.strip().splitlines()
    assert lines[:-1] == [f"prepare_data.py: {d / 'tokenizer.json'}: sha256 differs from meta.json "
                          "(another tokenizer: the shards' ids mean other text)",
                          f"prepare_data.py: {train[0]}: sha256 differs from meta.json (changed, or corrupted in a copy)",
                          f"prepare_data.py: {train[1]}: {os.path.getsize(train[1]):,} bytes, the header says "
                          f"{os.path.getsize(stdlib_data / train[1].name):,} (an incomplete copy?)",
                          f"prepare_data.py: {val}: missing"], lines
    assert lines[-1].startswith(f"prepare_data.py: error: {d}: 4 file(s) do not match meta.json")
    assert snapshot(d) == before
    # a shard whose ids are past the vocabulary, with a meta.json that agrees with its bytes
    shutil.rmtree(d)
    shutil.copytree(stdlib_data, d)
    a = np.load(train[0])
    a[7] = meta["vocab_size"]   # ids are 0 .. vocab_size - 1: the first one past them
    np.save(train[0], a)
    meta["splits"]["train"]["shards"][0]["sha256"] = hashlib.sha256(train[0].read_bytes()).hexdigest()
    (d / "meta.json").write_text(json.dumps(meta))
    bad = prepare_data_cli("--verify", d)
    assert bad.returncode == 1 and f"{train[0]}: token id {meta['vocab_size']} is past the vocabulary" in bad.stderr
    # ids another tool wrote as int32 (-1 padding would pass a check for ids past the vocabulary)
    shutil.rmtree(d)
    shutil.copytree(stdlib_data, d)
    (d / "meta.json").write_text(json.dumps({**meta, "dtype": "int32"}))
    bad = prepare_data_cli("--verify", d)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        f"prepare_data.py: error: {d / 'meta.json'}: dtype 'int32': shards hold token ids as uint16 or uint32"]


def test_uint32_when_the_vocabulary_does_not_fit_uint16(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update({f"x{i}": 256 + i for i in range(70_000 - 256)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    src = write_docs(tmp_path / "src", {"a.txt": "hello", "b.txt": "world"})
    out = tmp_path / "out"
    assert run("--input", src, "--tokenizer", tmp_path / "tokenizer.json", "--out", out) == 0
    meta = meta_of(out)
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == 70_001 and meta["eos_id"] == 70_000
    assert stream(out, "train").dtype == np.uint32
    assert all_documents(out) == Counter(["hello", "world"])


def test_a_tokenizer_with_unused_ids_gets_the_vocabulary_past_its_highest_id(tmp_path):
    """Ids 0-255 and <|endoftext|> at 300 (256-299 unused): the model's vocabulary must cover id
    300, i.e. 301 rows (one short, the data failed its own --verify and training its embedding)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<|endoftext|>"] = 300
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(tmp_path / "tokenizer.json"))
    src = write_docs(tmp_path / "src", {f"{i}.txt": f"doc {i} " * 5 for i in range(6)})
    out = tmp_path / "out"
    assert run("--input", src, "--tokenizer", tmp_path / "tokenizer.json", "--out", out) == 0
    meta = meta_of(out)
    assert (meta["vocab_size"], meta["eos_id"]) == (301, 300)
    assert run("--verify", out) == 0

# --- Done when 4: determinism -----------------------------------------------------------------------


def test_same_arguments_give_identical_outputs(tmp_path, prepare_data_cli):
    args = ["--input", *stdlib_inputs(("json", "collections", "concurrent")), "--glob", "*.py",
            "--vocab-size", "400", "--seed", "3", "--val-fraction", "0.1", "--shard-tokens", "30k"]
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    assert run(*args, "--out", a) == 0
    assert run(*args, "--out", b) == 0
    # The third run with the other setting of the tokenizers thread pool (the test session turns it
    # off): training and encoding do not depend on threading.
    flip = "true" if os.environ.get("TOKENIZERS_PARALLELISM", "true").lower() in ("0", "false", "off") else "false"
    proc = prepare_data_cli(*args, "--out", c, env={"TOKENIZERS_PARALLELISM": flip})
    assert proc.returncode == 0, proc.stderr
    files = sorted(p.name for p in a.iterdir())
    assert len([f for f in files if f.startswith("train_")]) >= 2
    for other in (b, c):
        assert sorted(p.name for p in other.iterdir()) == files
        for name in files:
            if name != "meta.json":
                assert (a / name).read_bytes() == (other / name).read_bytes(), name
        ma, mo = meta_of(a), meta_of(other)
        assert ma.pop("command") != mo.pop("command")  # only the --out differs
        assert ma == mo


def test_seed_chooses_the_validation_documents(tmp_path):
    src = write_docs(tmp_path / "src", {f"{i:03d}.txt": f"document number {i}\n" * (i % 7 + 1)
                                        for i in range(200)})
    val = {}
    for seed in (0, 1):
        out = tmp_path / f"seed{seed}"
        assert run("--input", src, "--vocab-size", 300, "--val-fraction", 0.2, "--seed", seed,
                   "--out", out) == 0
        val[seed] = set(documents(out, "val"))
        assert 15 <= len(val[seed]) <= 70  # ~40 of 200
        assert not val[seed] & set(documents(out, "train"))
    assert val[0] != val[1]


# --- the split invariants, on arbitrary corpora -----------------------------------------------------

corpora = st.lists(st.text(min_size=0, max_size=60), min_size=1, max_size=25)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(docs=corpora, copies=st.lists(st.integers(0, 24), max_size=8), val_fraction=st.sampled_from([0.005, 0.3, 0.9]),
       shard_tokens=st.integers(1, 50), seed=st.integers(0, 3))
def test_split_invariants(stdlib_data, docs, copies, val_fraction, shard_tokens, seed):
    """Every non-empty document lands in exactly one split, chosen by its content and the seed, so
    identical documents share a split; if a split would be empty, one document moves there with
    its copies (train: always; val: when train keeps another text)."""
    docs = docs + [docs[i % len(docs)] for i in copies]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        path = write_jsonl(tmp / "docs.jsonl", [{"text": t} for t in docs])
        out = tmp / "out"
        rc = run("--input", path, "--tokenizer", stdlib_data, "--val-fraction", val_fraction,
                 "--shard-tokens", shard_tokens, "--seed", seed, "--out", out)
        kept = [t for t in docs if t]
        if len(set(kept)) < 2:  # no documents, or copies of one text: one split would be empty
            assert rc == 2 and not out.exists()
            return
        assert rc == 0
        hasher = prepare_data.split_hasher(seed)
        key = {t: prepare_data.split_key(hasher, t.encode()) for t in kept}
        want_val = Counter(t for t in kept if key[t] < val_fraction)
        want_train = Counter(t for t in kept if key[t] >= val_fraction)
        if not want_val and len(want_train) >= 2:  # distinct texts
            moved = min(want_train, key=key.get)
            want_val[moved] = want_train.pop(moved)
        elif not want_train:
            moved = max(want_val, key=key.get)
            want_train[moved] = want_val.pop(moved)
        train, val = Counter(documents(out, "train")), Counter(documents(out, "val"))
        assert train == want_train and val == want_val and not train.keys() & val.keys()
        meta = meta_of(out)
        assert meta["empty_documents_dropped"] == len(docs) - len(kept)
        for split in ("train", "val"):
            sizes = [s["tokens"] for s in meta["splits"][split]["shards"]]
            assert all(n == shard_tokens for n in sizes[:-1]) and all(0 < n <= shard_tokens for n in sizes)


def test_a_large_document_is_split_between_train_and_val(tmp_path, monkeypatch, capsys):
    """One plain-text file (the classic input.txt) gave an empty val split, which train.py refuses.
    A document over SPLIT_CHARS gives its last --val-fraction, cut after a line end, to val and
    the rest to train; shorter documents go to one split whole, as before. A val split that
    would still be empty is an error here."""
    monkeypatch.setattr(prepare_data, "SPLIT_CHARS", 5000)
    lines = [f"line {i}: " + "word " * (i % 13) for i in range(2000)]
    text = "\n".join(lines) + "\n"
    src = write_docs(tmp_path / "src", {"big.txt": text, "small.txt": "a small document\n"})
    out = tmp_path / "out"
    assert run("--input", src, "--vocab-size", 300, "--val-fraction", 0.05, "--out", out) == 0
    val, train = documents(out, "val"), documents(out, "train")
    [tail] = [d for d in val if d != "a small document\n"]
    [head] = [d for d in train if d != "a small document\n"]
    assert head + tail == text and head.endswith("\n")
    assert 0.05 * len(text) <= len(tail) < 0.1 * len(text)
    # only a small document: no val split, one line saying why
    one = write_docs(tmp_path / "one", {"a.txt": "a small document\n"})
    capsys.readouterr()
    assert run("--input", one, "--vocab-size", 300, "--out", tmp_path / "o1") == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("prepare_data.py: error: the val split would be empty: the corpus is one document")
    assert not (tmp_path / "o1").exists()
    # four documents: one goes to val, a quarter of the tokens against --val-fraction 0.005
    four = write_docs(tmp_path / "four", {f"{i}.txt": f"document {i}\n" * 50 for i in range(4)})
    assert run("--input", four, "--vocab-size", 300, "--out", tmp_path / "o4") == 0
    assert "far more than --val-fraction 0.005" in capsys.readouterr().err
    # the same four cut to one by a limit: the limit is named, not "give more documents"
    for limit in (["--max-docs", 1], ["--max-tokens", 10]):
        assert run("--input", four, "--vocab-size", 300, *limit, "--out", tmp_path / "o5") == 2
        err = capsys.readouterr().err.splitlines()
        assert err[-1].startswith(f"prepare_data.py: error: the val split would be empty: {limit[0]} {limit[1]} "
                                  "stopped the corpus at 1 document(s)") and err[-1].endswith("raise the limit")


def _blocks_and_whole(tmp_path, monkeypatch, docs: dict, *args) -> tuple[dict[str, Path], dict[str, int]]:
    """The same run with every plain-text file read whole, and with those over 20,000 bytes read
    READ_BYTES (1,000) at a time (documents over SPLIT_CHARS, 4,000, split: every file read in
    blocks is); each run's return code in ``rcs``."""
    monkeypatch.setattr(prepare_data, "READ_BYTES", 1000)
    monkeypatch.setattr(prepare_data, "SPLIT_CHARS", 4000)
    src = write_docs(tmp_path / "src", docs)
    outs, rcs = {}, {}
    for name, limit in (("whole", 10 ** 12), ("blocks", 20_000)):
        monkeypatch.setattr(prepare_data, "STREAM_BYTES", limit)
        outs[name] = tmp_path / name
        rcs[name] = run("--input", src, "--out", outs[name], *args)
    return outs, rcs


@pytest.mark.parametrize("sample", ["all", "cut"])
def test_a_plain_text_file_over_stream_bytes_is_read_in_blocks_with_the_same_output(tmp_path, monkeypatch, sample):
    """A plain-text file over STREAM_BYTES is never held whole (1 GB whole held ~4.5 GB): it is
    checked, sampled and encoded READ_BYTES at a time. Reads that cut characters in two, pieces
    cut between them and a tokenizer sample that ends inside the file leave everything as reading
    it whole gives: the tokenizer, every shard, the splits, the sample's size."""
    monkeypatch.setattr(prepare_data, "PIECE_CHARS", 700)
    text = "".join(p.read_text(encoding="utf-8") for p in sorted((STDLIB / "json").glob("*.py")))
    text = text.replace("def ", "déf 🙂 ").replace("return", "retürn\r\n  漢字")
    data = text.encode()
    assert len(data) > 40_000 and any(data[k] & 0xC0 == 0x80 for k in range(1000, len(data), 1000))
    limit = next(k for k in range(9000, len(data)) if data[k] & 0xC0 == 0x80)  # inside a character
    reads = []
    texts = prepare_data.LargeText.texts
    monkeypatch.setattr(prepare_data.LargeText, "texts",
                        lambda self, *a: reads.append(a) or texts(self, *a))
    outs, rcs = _blocks_and_whole(tmp_path, monkeypatch,
                                  {"big.txt": text, "small.txt": "a small document\n", "other.txt": "another one\n"},
                                  "--vocab-size", 400, "--val-fraction", 0.05,
                                  *(["--tokenizer-sample-bytes", limit] if sample == "cut" else []))
    assert rcs == {"whole": 0, "blocks": 0}
    cut = prepare_data.val_cut(data, len(data), 0.05)
    end = len(data) if sample == "all" else prepare_data.char_start(data, limit)
    assert reads == [(0, end, 700), (cut, len(data), 1000), (0, cut, 1000)]  # the sample, val, train
    files = sorted(p.name for p in outs["whole"].iterdir())
    assert files == sorted(p.name for p in outs["blocks"].iterdir())
    for f in files:
        if f != "meta.json":
            assert (outs["whole"] / f).read_bytes() == (outs["blocks"] / f).read_bytes(), f
    meta = {name: meta_of(out) for name, out in outs.items()}
    assert meta["whole"]["splits"] == meta["blocks"]["splits"]
    assert meta["whole"]["tokenizer"] == meta["blocks"]["tokenizer"]
    assert meta["blocks"]["tokenizer"]["sample_bytes"] == (len(data) + 17 + 12 if sample == "all" else end)
    head, tail = data[:cut].decode(), data[cut:].decode()
    assert set(documents(outs["blocks"], "val")) >= {tail} and head in documents(outs["blocks"], "train")


def test_a_large_file_is_read_in_pieces_with_any_tokenizer(tmp_path, monkeypatch, capsys, stdlib_data):
    """A file over STREAM_BYTES, with a reused tokenizer for which pieces are not exact (here a
    normaliser): it was read whole as one text, ~230 bytes of memory per byte of the file (a
    multi-GB input.txt with a Llama tokenizer: killed). It is read in pieces of ~PIECE_CHARS
    characters, said in a warning; the text comes back whole from its two splits."""
    from tokenizers import Tokenizer, normalizers
    tok = Tokenizer.from_file(str(stdlib_data / "tokenizer.json"))
    tok.normalizer = normalizers.NFC()
    tok.save(str(tmp_path / "tokenizer.json"))
    monkeypatch.setattr(prepare_data, "STREAM_BYTES", 20_000)
    monkeypatch.setattr(prepare_data, "READ_BYTES", 1000)
    monkeypatch.setattr(prepare_data, "PIECE_CHARS", 700)
    text = "".join(p.read_text(encoding="utf-8") for p in sorted((STDLIB / "json").glob("*.py")))
    reads = []
    texts = prepare_data.LargeText.texts
    monkeypatch.setattr(prepare_data.LargeText, "texts", lambda self, *a: reads.append(a[2]) or texts(self, *a))
    src = write_docs(tmp_path / "src", {"big.txt": text, "a.txt": "one document\n", "b.txt": "and another\n"})
    out = tmp_path / "out"
    assert run("--input", src, "--tokenizer", tmp_path / "tokenizer.json", "--val-fraction", 0.05, "--out", out) == 0
    assert reads == [700, 700]   # val, then train
    warned = [ln for ln in capsys.readouterr().err.splitlines() if "warning" in ln]
    assert warned == [f"prepare_data.py: warning: {src / 'big.txt'} (0 MiB) is encoded in pieces of ~700 characters "
                      f"cut at blanks and punctuation: --tokenizer {tmp_path / 'tokenizer.json'} is not this "
                      "script's byte-level BPE, so its tokens at the cuts may differ from the whole file's"]
    tail = text.encode()[prepare_data.val_cut(text.encode(), len(text.encode()), 0.05):].decode()
    assert tail in documents(out, "val") and text[:len(text) - len(tail)] in documents(out, "train")


def test_pieces_are_not_exact_for_a_tokenizer_with_added_tokens(stdlib_data):
    """An added token that is not special ("    ", as code tokenizers have) is matched in the text
    before pre-tokenization, and a cut before the last blank of a run can split it: such a
    tokenizer's pieces are not the whole text's tokens (with a reused one, long documents were cut
    anyway), so pieces_are_exact says no."""
    from tokenizers import Tokenizer
    tok = prepare_data.as_document_encoder(Tokenizer.from_file(str(stdlib_data / "tokenizer.json")))
    assert prepare_data.pieces_are_exact(tok)
    tok.add_tokens(["    "])
    text = "def f():\n" + "        value = 1\n" * 4
    pieces = list(prepare_data.text_pieces(text, 1))
    assert len(pieces) > 4 and "".join(pieces) == text
    encode = lambda t: tok.encode(t, add_special_tokens=False).ids  # noqa: E731
    assert [i for p in pieces for i in encode(p)] != encode(text)
    assert not prepare_data.pieces_are_exact(tok)


@pytest.mark.parametrize("where", ["after the first read", "across two reads", "at the end"])
def test_a_large_file_that_is_not_utf8_is_skipped_as_a_small_one_is(tmp_path, monkeypatch, capsys, where):
    """The UTF-8 check of a file read in blocks names the same byte and offset as reading it whole,
    wherever the bad bytes fall: in a read, across two, at the end (a character cut short)."""
    good = b"a" + ("é" * 12_000).encode()  # characters start at odd offsets: 999 is the last of a read
    bad = {"after the first read": good[:2501] + b"\xff" + good[2502:],
           "across two reads": good[:999] + b"\xe2\x82x" + good[1002:],
           "at the end": good + b"\xc3"}[where]
    outs, rcs = _blocks_and_whole(tmp_path, monkeypatch,
                                  {"bad.txt": bad, "a.txt": "one document\n", "b.txt": "and another\n"},
                                  "--vocab-size", 300)
    assert rcs == {"whole": 0, "blocks": 0}
    skipped = [meta_of(out)["skipped_files"] for out in outs.values()]
    assert skipped[0] == skipped[1] and len(skipped[0]) == 1
    assert skipped[0][0]["reason"] == {"after the first read": "not valid UTF-8 (byte 0xff at offset 2501)",
                                       "across two reads": "not valid UTF-8 (byte 0xe2 at offset 999)",
                                       "at the end": "not valid UTF-8 (byte 0xc3 at offset 24001)"}[where]
    assert capsys.readouterr().err.count("skipping") == 2  # once a run, not once a pass


def test_max_tokens_stops_a_large_file_within_a_block(tmp_path, monkeypatch):
    """--max-tokens stops inside a file read in blocks, within a block of the limit (read whole,
    the file was encoded to its end whatever the limit); the part it stops in counts as a
    document and ends as one, with end-of-text."""
    text = "".join(f"line {i}: " + "word " * (i % 13) + "\n" for i in range(3000))  # ~100 KB
    outs, rcs = _blocks_and_whole(tmp_path, monkeypatch, {"big.txt": text}, "--vocab-size", 300,
                                  "--val-fraction", 0.01, "--max-tokens", 5000)
    assert rcs == {"whole": 0, "blocks": 0}
    whole, blocks = (meta_of(outs[k])["splits"] for k in ("whole", "blocks"))
    assert whole["train"]["tokens"] > 20_000  # the whole file
    assert {s: blocks[s]["documents"] for s in blocks} == {"train": 1, "val": 1}
    assert blocks["val"] == whole["val"]
    assert 5000 <= blocks["train"]["tokens"] + blocks["val"]["tokens"] < 5000 + 2 * 1000
    train = documents(outs["blocks"], "train")  # asserts the stream ends with end-of-text
    assert len(train) == 1 and text.startswith(train[0]) and len(train[0]) > 1000


# --- inputs ----------------------------------------------------------------------------------------


def test_jsonl_and_parquet_with_text_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = tmp_path / "src"
    src.mkdir()
    records = [f"record {i}: " + "word " * i for i in range(30)]
    # a record without the column (here the first) is an empty document, as one whose text is null
    write_jsonl(src / "a.jsonl", [{"n": -1}] + [{"body": t, "n": i} for i, t in enumerate(records[:20])]
                + [{"body": None, "n": 99}, {"body": "", "n": 100}])
    pq.write_table(pa.table({"body": records[20:], "n": list(range(10))}), src / "b.parquet")
    (src / "notes.txt").write_text("a plain text file is one document")
    (src / "c.jsonl").write_text("")  # no records: no documents (it stopped the run)
    out = tmp_path / "out"
    assert run("--input", src, "--text-column", "body", "--vocab-size", 300, "--out", out) == 0
    assert all_documents(out) == Counter(records + ["a plain text file is one document"])
    meta = meta_of(out)
    assert meta["empty_documents_dropped"] == 3
    assert meta["inputs"] == [{"path": str(src), "files": 4}]
    # a wrong --text-column is found within the first lines of a long file, not at its end
    write_jsonl(src / "d.jsonl", [{"body": "x"}] * (prepare_data.RECORD_BATCH + 5000))
    (src / "d.jsonl").write_text((src / "d.jsonl").read_text() + "{not json\n")
    with pytest.raises(prepare_data.DataError, match="d.jsonl: no text column 'text' \\(columns: body\\)"):
        list(prepare_data.Corpus([src / "d.jsonl"], None, None, "train", "text", None).documents())


def test_record_files_are_read_as_named_and_a_bad_record_is_skipped(tmp_path, capsys):
    """A file named with glob characters is that file (datasets took `data[1].parquet` as a
    pattern, which matched `data1.parquet`); an escaped lone surrogate skips its record with a
    warning (pyarrow refused the whole file); blank lines hold no records; a broken line is an
    error naming its line, counted from 1."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = tmp_path / "src"
    src.mkdir()
    write_jsonl(src / "data[1].jsonl", [{"text": "from the bracket jsonl"}])
    write_jsonl(src / "data1.jsonl", [{"text": "from the plain jsonl"}])
    pq.write_table(pa.table({"text": ["from the bracket parquet"]}), src / "data[1].parquet")
    pq.write_table(pa.table({"text": ["from the plain parquet"]}), src / "data1.parquet")
    (src / "lone.ndjson").write_text('{"text": "kept before"}\n\n{"text": "two \\ud800 lone"}\n{"text": "kept after"}\n')
    (src / "blank.jsonl").write_text("\n  \n")
    out = tmp_path / "out"
    assert run("--input", src, "--vocab-size", 300, "--out", out) == 0
    assert all_documents(out) == Counter(["from the bracket jsonl", "from the plain jsonl", "from the bracket parquet",
                                          "from the plain parquet", "kept before", "kept after"])
    assert f"skipping line 3 of {src / 'lone.ndjson'}: not valid Unicode" in capsys.readouterr().err
    (src / "broken.jsonl").write_text('{"text": "fine"}\n{broken\n')
    assert run("--input", src / "broken.jsonl", "--vocab-size", 300, "--out", tmp_path / "o") != 0
    assert f"{src / 'broken.jsonl'}: line 2 is not a JSON record" in capsys.readouterr().err


def test_dataset_saved_to_disk(tmp_path):
    import datasets

    texts = [f"dataset row {i}" for i in range(12)]
    datasets.Dataset.from_dict({"content": texts, "id": list(range(12))}).save_to_disk(tmp_path / "ds")
    out = tmp_path / "out"
    assert run("--dataset", tmp_path / "ds", "--text-column", "content", "--vocab-size", 300,
               "--out", out) == 0
    assert all_documents(out) == Counter(texts)
    assert meta_of(out)["inputs"] == [{"dataset": str(tmp_path / "ds"), "config": None, "split": "train",
                                       "text_column": "content"}]

    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": texts[:6]}),
                               "test": datasets.Dataset.from_dict({"text": texts[6:]})})
    dd.save_to_disk(tmp_path / "dd")
    out2 = tmp_path / "out2"
    assert run("--dataset", tmp_path / "dd", "--split", "test", "--vocab-size", 300, "--out", out2) == 0
    assert all_documents(out2) == Counter(texts[6:])


def test_dataset_local_data_directory_mixed_with_files(tmp_path):
    """A directory of data files is loaded with load_dataset(path, streaming=True)."""
    (tmp_path / "ds").mkdir()
    write_jsonl(tmp_path / "ds" / "part.jsonl", [{"text": f"streamed {i}"} for i in range(8)])
    src = write_docs(tmp_path / "src", {"one.txt": "a file document"})
    out = tmp_path / "out"
    assert run("--input", src, "--dataset", tmp_path / "ds", "--vocab-size", 300, "--out", out) == 0
    assert all_documents(out) == Counter([f"streamed {i}" for i in range(8)] + ["a file document"])


def test_glob_exclude_and_duplicate_paths(tmp_path):
    src = write_docs(tmp_path / "src", {"a.py": "a = 1\n", "b.txt": "not python"})
    write_docs(src / "skipme", {"c.py": "c = 3\n"})
    write_docs(src / "keep", {"d.py": "d = 4\n"})
    out = tmp_path / "out"
    assert run("--input", src, src / "a.py", "--glob", "*.py", "--exclude", "skipme",
               "--vocab-size", 300, "--out", out) == 0
    assert all_documents(out) == Counter(["a = 1\n", "d = 4\n"])  # a.py read once


def test_max_docs_and_max_tokens(stdlib_data, tmp_path):
    inputs = ["--input", *stdlib_inputs(("json", "collections", "concurrent")), "--glob", "*.py"]
    out = tmp_path / "docs"
    assert run(*inputs, "--max-docs", 5, "--vocab-size", 300, "--out", out) == 0
    meta = meta_of(out)
    assert meta["splits"]["train"]["documents"] + meta["splits"]["val"]["documents"] == 5
    assert meta["tokenizer"]["sample_documents"] == 5  # the tokenizer sees only those

    out = tmp_path / "tokens"
    limit = 20_000
    assert run(*inputs, "--max-tokens", limit, "--tokenizer", stdlib_data, "--out", out) == 0
    meta = meta_of(out)
    total = meta["splits"]["train"]["tokens"] + meta["splits"]["val"]["tokens"]
    # Whole documents: the last one crosses the limit (a document has at most 1 token per byte + eos).
    longest = max(len(d.encode()) + 1 for d in documents(out, "train") + documents(out, "val"))
    assert limit <= total < limit + longest


def test_tokenizer_sample_bytes_bounds_the_training_text(tmp_path, monkeypatch):
    """The first N bytes, the last document cut short: inside one large document too (only the
    documents were counted: one big file was the whole sample whatever N)."""
    src = write_docs(tmp_path / "src", {f"{i}.txt": f"{i}" + "x" * 999 for i in range(10)})
    out = tmp_path / "out"
    assert run("--input", src, "--vocab-size", 300, "--tokenizer-sample-bytes", 2500, "--out", out) == 0
    assert meta_of(out)["tokenizer"] == {"source": "trained", "vocab_size_requested": 300,
                                             "sample_documents": 3, "sample_bytes": 2500}
    monkeypatch.setattr(prepare_data, "PIECE_CHARS", 100)  # the document is sampled in pieces
    big = write_docs(tmp_path / "big", {"a.txt": "é é\n" * 2000, "b.txt": "another"})  # 6 bytes a line, 2 per é
    assert run("--input", big, "--vocab-size", 300, "--tokenizer-sample-bytes", 2500, "--out", tmp_path / "o2") == 0
    sample = meta_of(tmp_path / "o2")["tokenizer"]
    assert sample["sample_documents"] == 1 and sample["sample_bytes"] == 2499  # not half an é


def test_tokenizer_reuse(stdlib_data, tmp_path):
    from tokenizers import Tokenizer

    src = write_docs(tmp_path / "src", {"a.txt": "def reuse():\n    pass\n", "b.txt": "x = [1, 2]\n"})
    meta0 = meta_of(stdlib_data)
    for i, source in enumerate([stdlib_data, stdlib_data / "tokenizer.json"]):
        out = tmp_path / f"out{i}"
        assert run("--input", src, "--tokenizer", source, "--out", out) == 0
        meta = meta_of(out)
        assert meta["tokenizer_sha256"] == meta0["tokenizer_sha256"]  # the very same tokenizer
        assert meta["tokenizer"] == {"source": str(source)}
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            assert (out / name).read_bytes() == (stdlib_data / name).read_bytes()
        tok = Tokenizer.from_file(str(stdlib_data / "tokenizer.json"))
        assert all_documents(out) == Counter(["def reuse():\n    pass\n", "x = [1, 2]\n"])
        for split in ("train", "val"):
            ids = stream(out, split).tolist()
            docs = documents(out, split)
            assert ids == [i for d in docs for i in tok.encode(d).ids + [meta["eos_id"]]]


def test_a_tokenizer_saved_with_truncation_or_padding_encodes_whole_documents(stdlib_data, tmp_path, capsys):
    """tokenizer.json can carry truncation and padding (HF fast tokenizers save them): applied by
    encode(), they cut every document to 16 tokens, or padded it with pad ids. Ignored, with a
    warning; the file is copied as it was (transformers turns both off unless asked)."""
    from tokenizers import Tokenizer

    src = write_docs(tmp_path / "src", {"a.txt": "def reuse():\n    pass\n" * 20, "b.txt": "x = [1, 2]\n"})
    tok = Tokenizer.from_file(str(stdlib_data / "tokenizer.json"))
    want = sorted(tok.encode(d).ids for d in ("def reuse():\n    pass\n" * 20, "x = [1, 2]\n"))
    tok.enable_truncation(16)
    tok.enable_padding(pad_id=1, pad_token="<|pad|>", length=64)
    tok.save(str(tmp_path / "tokenizer.json"))
    assert run("--input", src, "--tokenizer", tmp_path / "tokenizer.json", "--out", tmp_path / "out") == 0
    assert "turns on truncation and padding; ignored here" in capsys.readouterr().err
    eos = meta_of(tmp_path / "out")["eos_id"]
    ids = stream(tmp_path / "out", "train").tolist() + stream(tmp_path / "out", "val").tolist()
    docs, cur = [], []
    for i in ids:
        if i == eos:
            docs.append(cur)
            cur = []
        else:
            cur.append(i)
    assert sorted(docs) == want


def test_a_tokenizer_that_would_drop_text_is_refused_before_any_work(stdlib_data, tmp_path, capsys):
    """A reused tokenizer that cannot encode some characters dropped them, exit 0 ('café' -> 'ca');
    one whose unknown token is not in its vocabulary failed mid-run with a Rust traceback; BPE
    dropout gave other shards on every run. Each is said in one line at load."""
    import json as _json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    src = write_docs(tmp_path / "src", {"a.txt": "café naïve 漢字 ok\n", "b.txt": "plain text\n"})
    ascii_only = Tokenizer(models.BPE())
    ascii_only.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    ascii_only.train_from_iterator(["plain ascii text only"], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"]))   # no initial_alphabet: ~15 of 256 bytes
    ascii_only.save(str(tmp_path / "ascii.json"))
    assert run("--input", src, "--tokenizer", tmp_path / "ascii.json", "--out", tmp_path / "o1") == 2
    err = capsys.readouterr().err
    assert "a byte-level tokenizer whose vocabulary lacks" in err and "would be dropped" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "o1").exists()
    # the same with ByteLevel inside a Sequence of pre-tokenizers (Llama 3's, GPT-NeoX's form)
    in_sequence = Tokenizer(models.BPE())
    in_sequence.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                         pre_tokenizers.ByteLevel(add_prefix_space=False)])
    in_sequence.train_from_iterator(["plain ascii text only 123"], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"]))
    in_sequence.save(str(tmp_path / "seq.json"))
    assert run("--input", src, "--tokenizer", tmp_path / "seq.json", "--out", tmp_path / "o1") == 2
    err = capsys.readouterr().err
    assert "a byte-level tokenizer whose vocabulary lacks" in err and not (tmp_path / "o1").exists()

    cfg = _json.loads((tmp_path / "ascii.json").read_text())
    cfg["model"]["unk_token"] = "<nope>"   # needed for the missing characters, and not in the vocabulary
    (tmp_path / "unk.json").write_text(_json.dumps(cfg))
    assert run("--input", src, "--tokenizer", tmp_path / "unk.json", "--out", tmp_path / "o2") == 2
    err = capsys.readouterr().err
    assert err.strip() == (f"prepare_data.py: error: --tokenizer {tmp_path / 'unk.json'}: cannot encode text "
                           "(Unk token `<nope>` not found in the vocabulary)")

    cfg = _json.loads((stdlib_data / "tokenizer.json").read_text())
    cfg["model"]["dropout"] = 0.5
    (tmp_path / "dropout.json").write_text(_json.dumps(cfg))
    for out in ("o3", "o4"):
        assert run("--input", src, "--tokenizer", tmp_path / "dropout.json", "--out", tmp_path / out) == 0
    assert "turns on BPE dropout (0.5); ignored here" in capsys.readouterr().err
    assert stream(tmp_path / "o3", "train").tolist() == stream(tmp_path / "o4", "train").tolist()
    assert _json.loads((tmp_path / "o3" / "tokenizer.json").read_text())["model"]["dropout"] is None


# --- output directory: overwrite, interruption ------------------------------------------------------


def test_an_out_that_cannot_be_made_is_said_before_the_tokenizer_trains(tmp_path, capsys, monkeypatch):
    """--out under a file, or where nothing can be created, failed only after the tokenizer's
    training, with an error that did not name --out."""
    src = write_docs(tmp_path / "src", {"a.txt": "text " * 50, "b.txt": "more text\n"})
    trained = []
    monkeypatch.setattr(prepare_data, "train_tokenizer", lambda *a, **k: trained.append(1))
    (tmp_path / "file").write_text("x")
    assert run("--input", src, "--vocab-size", 300, "--out", tmp_path / "file" / "sub" / "out") == 2
    assert capsys.readouterr().err.strip() == (f"prepare_data.py: error: --out {tmp_path / 'file' / 'sub' / 'out'}: "
                                               f"{tmp_path / 'file'} is a file, not a directory")
    assert run("--input", src, "--vocab-size", 300, "--out", "/proc/no/out") == 2
    assert capsys.readouterr().err.strip().startswith("prepare_data.py: error: --out /proc/no/out: cannot create "
                                                      "it in /proc (")
    assert trained == []




def test_a_shard_size_far_past_the_corpus_holds_only_the_corpus(tmp_path, monkeypatch):
    """--shard-tokens 1000G on a tiny corpus: the shard buffer was allocated whole (1.8 TiB), a
    MemoryError traceback after the tokenizer's training. It grows with the shard; the output is
    the default's. A shard that does not fit memory is one line naming the option."""
    src = write_docs(tmp_path / "src", {f"{i}.txt": f"text {i} " * 50 for i in range(6)})
    assert run("--input", src, "--vocab-size", 300, "--shard-tokens", "1000G", "--out", tmp_path / "big") == 0
    assert run("--input", src, "--vocab-size", 300, "--out", tmp_path / "default") == 0
    for f in ("train_00000.npy", "val_00000.npy", "tokenizer.json"):
        assert (tmp_path / "big" / f).read_bytes() == (tmp_path / "default" / f).read_bytes(), f
    writer = prepare_data.ShardWriter(tmp_path, "train", np.uint16, 10 ** 12)
    real_empty = np.empty
    monkeypatch.setattr(prepare_data.np, "empty",   # as if memory ran out past 1M tokens
                        lambda n, dtype: real_empty(n, dtype) if n <= 1 << 20 else np.zeros(1 << 50, np.uint8))
    writer.add(np.ones(1 << 20, np.uint16), 1)
    with pytest.raises(prepare_data.DataError, match=r"^--shard-tokens 1,000,000,000,000: a shard is held in "
                       r"memory until it is written, and 4 MiB for 2,097,152 tokens could not be "
                       r"allocated: lower --shard-tokens$"):
        writer.add(np.ones(1 << 20, np.uint16), 1)


def test_paths_given_with_a_tilde_are_the_home_directory_s(tmp_path, monkeypatch, capsys):
    """--out=~/data (one word: the shell leaves its ~) made a directory named "~" in the working
    directory, where train.py's data.dir: ~/data then looked in the home directory."""
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    cwd.mkdir()
    write_docs(home / "src", {f"{i}.txt": f"text {i} " * 50 for i in range(4)})
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    assert run("--input=~/src", "--vocab-size", 300, "--out=~/data") == 0
    assert (home / "data" / "meta.json").is_file() and not list(cwd.iterdir())
    assert run("--verify=~/data") == 0
    assert f"verified {home / 'data'}" in capsys.readouterr().out


def test_overwrite_replaces_a_previous_output(tmp_path):
    src = write_docs(tmp_path / "src", {f"{i}.txt": f"text {i} " * 50 for i in range(6)})
    out = tmp_path / "out"
    assert run("--input", src, "--vocab-size", 300, "--shard-tokens", 40, "--out", out) == 0
    many = {p.name for p in out.iterdir()}
    assert run("--input", src, "--vocab-size", 300, "--out", out, "--overwrite") == 0
    now = {p.name for p in out.iterdir()}
    assert len(now) < len(many) and "train_00001.npy" in many and "train_00001.npy" not in now
    assert all_documents(out) == Counter(f"text {i} " * 50 for i in range(6))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]  # no leftovers


def test_empty_existing_directory_is_used(tmp_path):
    src = write_docs(tmp_path / "src", {"a.txt": "alpha", "b.txt": "beta"})
    (tmp_path / "out").mkdir()
    assert run("--input", src, "--vocab-size", 300, "--out", tmp_path / "out") == 0
    assert (tmp_path / "out" / "meta.json").is_file()


def _meanwhile(monkeypatch, action):
    """Run `action` while the corpus is encoded: after check_out, before the output is installed."""
    real = prepare_data.encode_corpus

    def encode_corpus(*args, **kwargs):
        action()
        return real(*args, **kwargs)
    monkeypatch.setattr(prepare_data, "encode_corpus", encode_corpus)


def test_what_appears_at_out_meanwhile_is_never_replaced_without_overwrite(tmp_path, monkeypatch, capsys):
    """--out did not exist (or was empty) at the start; another run's output or a user's file
    that appears there before the end is left as it is: one-line error naming --out, exit 2."""
    src = write_docs(tmp_path / "src", {"a.txt": "alpha", "b.txt": "beta"})
    out = tmp_path / "out"
    _meanwhile(monkeypatch, lambda: write_docs(out, {"mine.txt": "precious"}))
    assert run("--input", src, "--vocab-size", 300, "--out", out) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"prepare_data.py: error: --out {out}: a non-empty directory appeared there while this run "
        "worked; left as it is (pass --overwrite to replace an earlier output)")
    assert snapshot(out) and [p.name for p in out.iterdir()] == ["mine.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]  # no staging left
    # an empty directory that appears meanwhile is replaced, as one there at the start is
    out2 = tmp_path / "out2"
    _meanwhile(monkeypatch, lambda: out2.mkdir())
    assert run("--input", src, "--vocab-size", 300, "--out", out2) == 0
    assert all_documents(out2) == Counter(["alpha", "beta"])


def test_overwrite_checks_the_output_again_before_replacing_it(tmp_path, monkeypatch, capsys):
    src = write_docs(tmp_path / "src", {"a.txt": "alpha", "b.txt": "beta"})
    out = tmp_path / "out"
    assert run("--input", src, "--vocab-size", 300, "--out", out) == 0
    before = snapshot(out)
    _meanwhile(monkeypatch, lambda: (out / "notes.md").write_text("mine"))
    assert run("--input", src, "--vocab-size", 300, "--out", out, "--overwrite") == 2
    assert f"--out {out}: holds 'notes.md'" in capsys.readouterr().err
    assert (out / "notes.md").read_text() == "mine"
    assert {k: v for k, v in snapshot(out).items() if k != "notes.md"} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]


def test_a_new_output_that_cannot_be_renamed_into_place_leaves_the_old_one_there(tmp_path, monkeypatch, capsys):
    """--overwrite sets the previous output aside before renaming the new one in: when that rename
    fails (an I/O error), the previous output goes back to --out, nothing else is left, exit 1."""
    import errno
    src = write_docs(tmp_path / "src", {"a.txt": "alpha", "b.txt": "beta"})
    out = tmp_path / "out"
    assert run("--input", src, "--vocab-size", 300, "--out", out) == 0
    before = snapshot(out)
    real = os.rename

    def rename(a, b):
        if ".out.partial-" in str(a) and Path(b) == out:
            raise OSError(errno.EIO, "Input/output error")
        return real(a, b)
    monkeypatch.setattr(os, "rename", rename)
    capsys.readouterr()
    assert run("--input", src, "--vocab-size", 300, "--val-fraction", 0.5, "--out", out, "--overwrite") == 1
    assert "Input/output error" in capsys.readouterr().err
    assert snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]


def test_a_failure_deleting_the_old_output_after_the_install_is_a_warning(tmp_path, monkeypatch, capsys):
    """Once the new output is renamed into place the run has succeeded: an interrupt while the
    old one is deleted leaves that directory behind, named in a warning, and exits 0."""
    src = write_docs(tmp_path / "src", {"a.txt": "alpha", "b.txt": "beta"})
    out = tmp_path / "out"
    assert run("--input", src, "--vocab-size", 300, "--out", out) == 0
    real = shutil.rmtree

    def rmtree(path, *args, **kwargs):
        if ".out.old-" in str(path):
            raise KeyboardInterrupt
        return real(path, *args, **kwargs)
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    capsys.readouterr()
    assert run("--input", src, "--vocab-size", 300, "--val-fraction", 0.5, "--out", out, "--overwrite") == 0
    err = capsys.readouterr().err
    [old] = [p for p in tmp_path.iterdir() if p.name.startswith(".out.old-")]
    assert f"--out {out} is complete, but deleting the previous output failed (interrupted): remove {old}" in err
    assert "nothing was written" not in err
    assert meta_of(out)["val_fraction"] == 0.5 and meta_of(old)["val_fraction"] == 0.005


def test_a_mount_point_as_out_is_refused_before_any_work(tmp_path, monkeypatch, capsys):
    """The output is renamed into place, and a mount point cannot be renamed onto: an empty one
    passed the start-time check and failed after all the work ("Device or resource busy")."""
    src = write_docs(tmp_path / "src", {"a.txt": "alpha", "b.txt": "beta"})
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    real = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda p: Path(p) == mnt or real(p))  # mounting needs root
    monkeypatch.setattr(prepare_data, "train_tokenizer", None)  # refused before the tokenizer is trained
    assert run("--input", src, "--vocab-size", 300, "--out", mnt) == 2
    assert capsys.readouterr().err == (f"prepare_data.py: error: --out {mnt}: is a mount point, which cannot be "
                                       "renamed onto (the output is built beside it and renamed into place); "
                                       "give a directory inside it\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mnt", "src"] and not list(mnt.iterdir())


def test_interrupted_run_leaves_nothing(tmp_path, monkeypatch):
    src = write_docs(tmp_path / "src", {f"{i}.txt": f"text {i} " * 50 for i in range(6)})
    calls = []

    def interrupt(self, arr):
        calls.append(arr.size)
        raise KeyboardInterrupt

    monkeypatch.setattr(prepare_data.ShardWriter, "_write", interrupt)
    out = tmp_path / "new" / "out"
    assert run("--input", src, "--vocab-size", 300, "--shard-tokens", 40, "--out", out) == 130
    assert calls and not (tmp_path / "new").exists()  # staging and the parents it made are removed


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGKILL])
def test_killed_run_leaves_nothing_that_looks_complete(stdlib_data, tmp_path, sig):
    """SIGTERM (preemption) or a terminal's hang-up cleans up and exits 130; SIGKILL leaves only a
    hidden staging directory without meta.json. Either way --out does not exist."""
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, str(ROOT / "prepare_data.py"), "--input", STDLIB, "--glob", "*.py",
                             "--exclude", "site-packages", "--tokenizer", stdlib_data, "--shard-tokens", "100k",
                             "--out", out], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # Wait for the first shard however long the machine takes (a fixed deadline would make the
    # test depend on its speed); the corpus takes many shards, so the run is still going then.
    while not list(tmp_path.glob(".out.partial-*/train_00000.npy")) and proc.poll() is None:
        time.sleep(0.01)
    assert proc.poll() is None, "prepare_data.py ended before its first shard was written"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert not out.exists()
    leftovers = list(tmp_path.iterdir())
    if sig != signal.SIGKILL:
        assert proc.returncode == 130 and err.strip().endswith("interrupted; nothing was written")
        assert leftovers == []
    else:
        assert [p.name.startswith(".out.partial-") for p in leftovers] == [True]
        assert not (leftovers[0] / "meta.json").exists()


def test_output_inside_an_input_directory_is_not_read(tmp_path):
    """Nor what a killed run left beside it: its hidden staging directory, or the earlier output
    set aside while the new one was installed."""
    src = write_docs(tmp_path / "src", {"a.txt": "alpha text", "b.txt": "beta text"})
    for _ in range(2):  # the second run would otherwise read the first one's shards and meta.json
        assert run("--input", src, "--vocab-size", 300, "--out", src / "data", "--overwrite") == 0
    assert all_documents(src / "data") == Counter(["alpha text", "beta text"])
    for leftover in (".data.partial-999-deadbeef", ".data.old-999-0123abcd"):
        shutil.copytree(src / "data", src / leftover)
        (src / leftover / "notes.txt").write_text("not a document")
    assert run("--input", src, "--vocab-size", 300, "--out", src / "data", "--overwrite") == 0
    assert all_documents(src / "data") == Counter(["alpha text", "beta text"])


# --- bad input: one line, non-zero exit, nothing written --------------------------------------------


def _bad_cases(tmp: Path) -> dict:
    """name -> (args, text the message must contain, existing output directory or None)."""
    ok = write_docs(tmp / "ok", {"a.txt": "some text", "b.txt": "more text"})
    empty = write_docs(tmp / "empty", {"a.txt": "", "b.txt": ""})
    nomatch = write_docs(tmp / "nomatch", {"a.txt": "text"})
    write_jsonl(tmp / "records.jsonl", [{"body": "x"}])
    (tmp / "broken.jsonl").write_text('{"text": "fine"}\n{broken\n')
    (tmp / "afile").write_text("I am a file")
    (tmp / "notatokenizer.json").write_text('{"hello": 1}')
    old = tmp / "old"  # a previous output, to be left untouched by every failure
    assert run("--input", ok, "--vocab-size", 300, "--out", old) == 0
    foreign = write_docs(tmp / "foreign", {"notes.md": "mine", "meta.json": "{}"})
    # named like a shard, but not one prepare_data.py writes: a user's file, not to be replaced
    lookalike = write_docs(tmp / "lookalike", {"train_00000.npy": "", "train_backup.npy": "mine", "meta.json": "{}"})
    # every name one this script writes, but not its output: what save_pretrained writes, a lone shard
    tokenizer_only = write_docs(tmp / "tokenizer_only", {name: (old / name).read_bytes() for name in
                                                          ("tokenizer.json", "tokenizer_config.json",
                                                           "special_tokens_map.json")})
    lone_shard = write_docs(tmp / "lone_shard", {"train_00000.npy": (old / "train_00000.npy").read_bytes()})
    infinite = tmp / "infinite"  # json reads Infinity as a float: int() of it raised OverflowError
    shutil.copytree(old, infinite)
    (infinite / "meta.json").write_text(json.dumps({**meta_of(old), "vocab_size": float("inf")}))
    listcfg = write_docs(tmp / "listcfg", {"tokenizer.json": (old / "tokenizer.json").read_bytes(),
                                           "tokenizer_config.json": "[1, 2]"})
    return {
        "no inputs": (["--out", old], "no inputs", old),
        "missing input": (["--input", tmp / "missing", "--out", tmp / "o"], str(tmp / "missing"), None),
        "no input files": (["--input", nomatch, "--glob", "*.py", "--out", tmp / "o"], "no input files", None),
        "only empty inputs": (["--input", empty, "--out", tmp / "o"], "no documents", None),
        "only empty inputs, reused tokenizer, overwrite": (
            ["--input", empty, "--tokenizer", old, "--out", old, "--overwrite"], "no documents", old),
        "unknown text column": (["--input", tmp / "records.jsonl", "--out", tmp / "o"], "'text'", None),
        "unknown text column, overwrite": (
            ["--input", tmp / "records.jsonl", "--tokenizer", old, "--out", old, "--overwrite"],
            str(tmp / "records.jsonl"), old),
        "broken jsonl": (["--input", tmp / "broken.jsonl", "--out", tmp / "o"], str(tmp / "broken.jsonl"), None),
        "vocab below bytes + specials": (["--input", ok, "--vocab-size", 257, "--out", tmp / "o"], "257", None),
        # the BPE trainer allocates for the whole vocabulary up front: it aborted with a Rust panic
        "vocab size huge": (["--input", ok, "--vocab-size", "1G", "--out", tmp / "o"], "--vocab-size 1000000000",
                            None),
        "output is a file": (["--input", ok, "--out", tmp / "afile"], str(tmp / "afile"), None),
        "existing output without --overwrite": (["--input", ok, "--out", old], "--overwrite", old),
        "overwrite a foreign directory": (["--input", ok, "--out", foreign, "--overwrite"], "notes.md", foreign),
        "overwrite a shard look-alike": (["--input", ok, "--out", lookalike, "--overwrite"], "train_backup.npy",
                                         lookalike),
        "overwrite a tokenizer directory": (["--input", ok, "--out", tokenizer_only, "--overwrite"],
                                            "has no meta.json written by prepare_data.py", tokenizer_only),
        "overwrite a lone shard": (["--input", ok, "--out", lone_shard, "--overwrite"],
                                   "has no meta.json written by prepare_data.py", lone_shard),
        "missing tokenizer": (["--input", ok, "--tokenizer", tmp / "nope", "--out", tmp / "o"],
                              str(tmp / "nope"), None),
        "not a tokenizer": (["--input", ok, "--tokenizer", tmp / "notatokenizer.json", "--out", tmp / "o"],
                            "notatokenizer.json", None),
        "tokenizer_config.json a list": (["--input", ok, "--tokenizer", listcfg, "--out", tmp / "o"],
                                         "tokenizer_config.json is not a JSON object of settings (it holds a list)",
                                         None),
        "tokenizer and vocab size": (["--input", ok, "--tokenizer", old, "--vocab-size", 512, "--out", tmp / "o"],
                                     "--vocab-size", None),
        "val fraction 0": (["--input", ok, "--val-fraction", 0, "--out", tmp / "o"], "--val-fraction", None),
        "bad size": (["--input", ok, "--shard-tokens", "lots", "--out", tmp / "o"], "lots", None),
        "no --out": (["--input", ok], "--out", None),
        "verify with --out": (["--verify", old, "--out", old], "it takes no --out", old),
        "verify a directory without meta.json": (["--verify", ok], str(ok / "meta.json"), None),
        "verify a foreign meta.json": (["--verify", foreign], "not a prepare_data.py meta.json", foreign),
        "verify an infinite vocab_size": (["--verify", infinite], "meta.json: vocab_size is inf, not a number of tokens",
                                          infinite),
        "unreadable input": (["--input", "/proc/self/mem", "--out", tmp / "o"], "/proc/self/mem: cannot read", None),
        "a file as --dataset": (["--dataset", tmp / "afile", "--out", tmp / "o"], "a local file is an --input", None),
        "missing dataset": (["--dataset", tmp / "nodataset", "--out", tmp / "o", "--vocab-size", 300],
                            "nodataset", None),
    }


def test_bad_inputs(tmp_path, prepare_data_cli):
    cases = _bad_cases(tmp_path)
    for name, (args, needle, existing) in cases.items():
        before = snapshot(existing) if existing else None
        listing = sorted(p.name for p in tmp_path.iterdir())
        proc = prepare_data_cli(*args)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode != 0, name
        assert len(lines) == 1 and lines[0].startswith("prepare_data.py: error: "), (name, proc.stderr)
        assert needle in lines[0], (name, lines[0])
        assert "Traceback" not in proc.stderr + proc.stdout, name
        assert not (tmp_path / "o").exists(), name
        assert sorted(p.name for p in tmp_path.iterdir()) == listing, name  # no staging leftovers
        if existing:
            assert snapshot(existing) == before, name


def test_linked_directories_are_read_once_and_a_link_loop_ends(tmp_path, prepare_data_cli):
    """A link to a directory outside the input is walked like a directory (a link to a file
    always was read). A link into the input itself (to a sibling, or to an ancestor: a loop) is
    not followed: that directory is read under its own name, so --exclude still applies to it.
    A loop of links outside the input ends, with a warning."""
    src = write_docs(tmp_path / "src", {"a.txt": "alpha"})
    write_docs(src / "b", {"b.txt": "beta"})
    write_docs(tmp_path / "elsewhere", {"c.txt": "gamma"})
    (src / "linked").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (tmp_path / "elsewhere" / "back").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (src / "a_to_b").symlink_to(src / "b", target_is_directory=True)
    (src / "loop").symlink_to(src, target_is_directory=True)
    proc = prepare_data_cli("--input", src, "--vocab-size", 300, "--out", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    assert all_documents(tmp_path / "out") == Counter(["alpha", "beta", "gamma"])
    assert f"skipping {src / 'linked' / 'back'}: it leads to {tmp_path / 'elsewhere'}, which is read already" \
        in proc.stderr
    proc = prepare_data_cli("--input", src, "--exclude", "b", "--vocab-size", 300, "--out", tmp_path / "out2")
    assert proc.returncode == 0, proc.stderr
    assert all_documents(tmp_path / "out2") == Counter(["alpha", "gamma"])


def test_a_directory_that_cannot_be_listed_is_an_error_not_a_gap(tmp_path, monkeypatch):
    """os.walk drops a directory it cannot list without a word: the corpus would silently lack
    it. (As root, permissions do not stop a listing: the refusal is simulated.)"""
    src = write_docs(tmp_path / "src", {"a.txt": "alpha"})
    write_docs(src / "private", {"b.txt": "beta"})
    real = os.scandir

    def scandir(path="."):
        if Path(path) == src / "private":
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)
    monkeypatch.setattr(os, "scandir", scandir)
    with pytest.raises(prepare_data.DataError, match=f"^--input {src}: cannot list {src / 'private'} "
                                                     "\\(Permission denied\\)$"):
        prepare_data.find_files([str(src)], [], [])


def test_non_utf8_file_is_skipped_by_the_cli(tmp_path, prepare_data_cli):
    src = write_docs(tmp_path / "src", {"good.py": "print('hi')\n", "binary.py": b"\x89PNG\r\n\x1a\n\x00\xff",
                                        "good2.py": "x = 2\n"})
    proc = prepare_data_cli("--input", src, "--vocab-size", 300, "--out", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    warnings = [ln for ln in proc.stderr.splitlines() if "skipping" in ln]
    assert warnings == [f"prepare_data.py: warning: skipping {src / 'binary.py'}: "
                        f"not valid UTF-8 (byte 0x89 at offset 0)"]
    assert proc.stdout.startswith("prepare_data.py: wrote ") and len(proc.stdout.splitlines()) == 1
    assert all_documents(tmp_path / "out") == Counter(["print('hi')\n", "x = 2\n"])


def test_inputs_that_are_all_skipped_or_empty_say_which(tmp_path, capsys):
    """Every input unreadable was "no documents: every input is empty (0 empty documents, 2
    unreadable files skipped)"."""
    src = write_docs(tmp_path / "src", {"a.py": b"\xff\xfe", "b.py": b"\x89PNG", "c.py": ""})
    assert run("--input", src, "--vocab-size", 300, "--out", tmp_path / "out") == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "prepare_data.py: error: no documents: the inputs hold 1 empty document(s) and 2 unreadable "
        "file(s), skipped (the warnings above say why)")
    (src / "c.py").unlink()
    assert run("--input", src, "--vocab-size", 300, "--out", tmp_path / "out") == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        "no documents: the inputs hold 2 unreadable file(s), skipped (the warnings above say why)")


# pieces of text around every kind of cut: runs of blanks the pre-tokenizer's \\s knows and ones it
# may not (\x1c, \x85, \xa0, \u2028), the contraction mark, punctuation, letters and digits in and
# out of ASCII, and what a stdlib tokenizer has merges for (indentation, blank lines, keywords)
PIECE_PARTS = [" ", "  ", "    ", "\t", "\n", "\n\n", "\r", "\r\n", "\x0b", "\x0c", "\x1c", "\x85", "\xa0",
               "\u2028", "\u3000", "'", "'s", "'re", '"', "{", "}", "[", "(", ")", ",", ":", ";", "=", "<",
               ".", "-", "_", "#", "def", "self", "return", "x", "s", "A", "0", "12", "é", "漢", "٣", "🙂"]


@settings(max_examples=400, deadline=None)
@given(text=st.lists(st.sampled_from(PIECE_PARTS), max_size=30).map("".join), size=st.integers(1, 8))
def test_text_pieces_keep_the_tokens_of_the_whole_text(stdlib_data, text, size):
    """Wherever ``text_pieces`` cuts (blank lines between paragraphs, one long line of JSON, CR-only
    line ends, indented lines: every layout, not only "x\\n|y"), the pieces encode to the whole
    text's tokens with a byte-level BPE."""
    from tokenizers import Tokenizer
    tok = prepare_data.as_document_encoder(Tokenizer.from_file(str(stdlib_data / "tokenizer.json")))
    assert prepare_data.pieces_are_exact(tok)
    pieces = list(prepare_data.text_pieces(text, size))
    assert "".join(pieces) == text
    # the pre-tokens, which hold whatever merges a tokenizer has, then the tokens of this one
    pre = tok.pre_tokenizer.pre_tokenize_str
    assert [t for p in pieces for t, _ in pre(p)] == [t for t, _ in pre(text)]
    assert [i for p in pieces for i in tok.encode(p, add_special_tokens=False).ids] == \
        tok.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("layout", ["paragraphs", "one_line_json", "cr", "indented"])
def test_long_documents_of_every_layout_are_cut(layout):
    """Layouts with no "x\\n|y" were encoded whole, ~165 bytes of memory per byte of text."""
    line = {"paragraphs": "Some words of a paragraph.\n\n", "one_line_json": '{"key": [1, 2], "k2": "v"},',
            "cr": "line of text\r", "indented": "    indented line\n"}[layout]
    if layout == "one_line_json":
        line = line.replace(" ", "")
    pieces = list(prepare_data.text_pieces(line * 2000, 1000))
    assert len(pieces) > 20 and max(map(len, pieces)) < 1100


@pytest.mark.parametrize("newline", ["\n", "\r\n"], ids=["lf", "crlf"])
def test_a_long_document_is_encoded_in_pieces_with_the_same_tokens(tmp_path, monkeypatch, newline):
    """A document longer than PIECE_CHARS is encoded (and sampled for the tokenizer) in pieces cut
    after a newline between non-blank characters (before a CRLF: a file with Windows line ends
    was never cut), which bounds memory (an 11 MB file peaked at 2.5 GB whole, 0.55 GB in
    pieces). Byte-level pre-tokenization makes such a line end a token boundary, so the
    tokenizer and the shards are byte for byte those of encoding it whole."""
    text = "".join(p.read_text(encoding="utf-8") for p in sorted((STDLIB / "json").glob("*.py")))
    text += "tail without a newline at the end\n\n   x"
    text = text.replace("\n", newline)
    src = tmp_path / "src"
    src.mkdir()
    (src / "big.txt").write_text(text * 3)
    (src / "small.txt").write_text("a short document\n")
    outs = {}
    for name, piece in (("whole", 10 ** 9), ("pieces", 2000)):
        monkeypatch.setattr(prepare_data, "PIECE_CHARS", piece)
        outs[name] = tmp_path / name
        assert run("--input", src, "--vocab-size", 400, "--val-fraction", 0.3, "--out", outs[name]) == 0
    files = sorted(p.name for p in outs["whole"].iterdir())
    assert files == sorted(p.name for p in outs["pieces"].iterdir())
    for f in files:
        if f != "meta.json":  # it records the command line, the same here, and the shards' sha256
            assert (outs["whole"] / f).read_bytes() == (outs["pieces"] / f).read_bytes(), f
    assert meta_of(outs["whole"])["splits"] == meta_of(outs["pieces"])["splits"]
    # the pieces themselves: they rebuild the text, each starts at a cut it may start at
    pieces = list(prepare_data.text_pieces(text, 2000))
    assert "".join(pieces) == text and len(pieces) > 5
    for piece, after in zip(pieces, pieces[1:]):
        assert prepare_data.PIECE_CUT.match(piece + after, len(piece)) and len(piece) >= 2000
    # a tokenizer whose pre-tokenizer adds a prefix space (Metaspace-like) is never cut
    from tokenizers import Tokenizer, models, pre_tokenizers
    other = Tokenizer(models.BPE())
    other.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    assert not prepare_data.pieces_are_exact(other)
