"""training/data.py piece by piece: what a shard is checked against, the ids a window and an
evaluation batch are checked for, the shard cache, the sampler's length, the data's identity
(fingerprint) and the tokenizer checks. Found unpinned by mutation testing of data.py: each test
fails on a mutant the rest of the suite let pass. Data directories are made by hand here."""
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from training import data as data_mod
from training.config import ConfigError
from training.data import (ResumableSampler, TokenWindows, check_same_tokenizer, data_change_warning,
                           data_fingerprint, eval_batches, tokenizer_difference, unverified_tokenizer_warning)


def make_data(d: Path, shards, vocab=100, dtype="uint16", meta_tokens=None, split="train"):
    """A prepared-data directory by hand: ``shards`` are arrays saved as given; meta.json says
    ``dtype`` and each shard's token count (``meta_tokens`` overrides the counts)."""
    d.mkdir(parents=True, exist_ok=True)
    entries = []
    for i, arr in enumerate(shards):
        name = f"{split}_{i:05d}.npy"
        np.save(d / name, arr)
        entries.append({"file": name, "tokens": int(arr.size) if meta_tokens is None else meta_tokens[i]})
    (d / "meta.json").write_text(json.dumps({"vocab_size": vocab, "dtype": dtype, "eos_id": 0,
                                             "splits": {split: {"shards": entries}}}))
    return d


# -- TokenWindows: what a shard is checked against -------------------------------------------------

def test_a_shard_whose_length_differs_from_meta_json_is_refused(tmp_path):
    """A valid .npy of the right dtype but another token count than meta.json records (a shard
    replaced by another file) is refused at start, naming the file."""
    d = make_data(tmp_path / "d", [np.arange(50, dtype=np.uint16)], meta_tokens=[60])
    with pytest.raises(ConfigError, match=r"train_00000\.npy: uint16\[50\] does not match meta\.json \(uint16\[60\]\)"):
        TokenWindows(d, "train", 4)


def test_a_shard_of_a_signed_dtype_of_the_same_width_is_refused(tmp_path):
    """int16 is as wide as meta.json's uint16, but its ids can be negative (an index error in the
    embedding that check_ids, which looks for ids >= vocab_size, never sees)."""
    d = make_data(tmp_path / "d", [np.arange(50, dtype=np.int16)], dtype="uint16")
    with pytest.raises(ConfigError, match=r"int16\[50\] does not match meta\.json \(uint16\[50\]\)"):
        TokenWindows(d, "train", 4)


# -- check_ids / eval_batches ----------------------------------------------------------------------

@pytest.mark.parametrize("pos, sample", [(4, 0), (12, 2)])
def test_check_ids_sees_the_last_token_of_a_window(tmp_path, pos, sample):
    """A window is seq_len + 1 tokens; its last one is a target (y) the model is trained on. An id
    past the vocabulary there (token 12: the last of the shard, in no other window) is found."""
    arr = np.arange(13, dtype=np.uint16) % 50
    arr[pos] = 100  # == vocab_size
    d = make_data(tmp_path / "d", [arr])
    ds = TokenWindows(d, "train", 4)
    assert len(ds) == 3
    with pytest.raises(ConfigError, match=rf"train_00000\.npy: token {pos} is id 100, not below"):
        ds.check_ids([sample])


def test_eval_batches_check_each_replicas_own_samples(tmp_path):
    """An id past the vocabulary in rank 1's evaluation batch stops rank 1 with the shard and the
    position, instead of handing the batch to the model."""
    arr = np.arange(40, dtype=np.uint16) % 50
    arr[6] = 100  # in sample 1 only (tokens 4..8): rank 1's first sample of 2 replicas
    ds = TokenWindows(make_data(tmp_path / "d", [arr]), "train", 4)
    assert [int(b[0].max()) < 100 for b in eval_batches(ds, 1, 2, 2, 0)] == [True, True]
    with pytest.raises(ConfigError, match=r"train_00000\.npy: token 6 is id 100"):
        list(eval_batches(ds, 1, 2, 2, 1))


# -- the shard cache is least recently used --------------------------------------------------------

def test_the_shard_cache_closes_the_least_recently_used_map(tmp_path, monkeypatch):
    monkeypatch.setattr(data_mod, "OPEN_SHARDS", 2)
    d = make_data(tmp_path / "d", [np.arange(20, dtype=np.uint16) + 10 * i for i in range(3)])
    ds = TokenWindows(d, "train", 4)  # 4 windows a shard
    for i in (0, 4, 0, 8):            # shards 0, 1, 0 again, then 2: shard 1 is the oldest use
        ds[i]
    assert list(ds._maps) == [0, 2]


def test_a_shard_rewritten_during_the_run_is_refused_when_mapped_again(tmp_path):
    """A data.dir prepared again while a run trains on it (a new file under the same name, the
    same size): the next epoch's workers mapped the new file at the old offsets and trained on it
    silently. Mapping it again now stops with the shard's name."""
    import os
    d = make_data(tmp_path / "d", [np.arange(20, dtype=np.uint16), np.arange(20, dtype=np.uint16) + 20])
    ds = TokenWindows(d, "train", 4)
    first = [ds[i][0].tolist() for i in range(len(ds))]
    ds._maps.clear()   # as in a new worker
    assert [ds[i][0].tolist() for i in range(len(ds))] == first   # the same files: mapped again
    ds._maps.clear()
    replaced = d / "train_00001.npy"
    stat = replaced.stat()
    np.save(d / "new.npy", np.arange(20, dtype=np.uint16) + 50)
    os.replace(d / "new.npy", replaced)
    os.utime(replaced, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))   # whatever the clock's resolution
    assert ds[0][0].tolist() == first[0]   # shard 0 is untouched
    with pytest.raises(ConfigError, match=r"train_00001\.npy: the shard changed since the run started"):
        ds[len(ds) - 1]
    # found in a DataLoader worker, as in training: the trainer's error is that line, not the
    # worker's traceback under "Caught ConfigError in DataLoader worker process 0"
    stream = data_mod.DataStream(ds, 8, 1, 0, seed=0, num_workers=1, shuffle=False)   # both shards
    try:
        with pytest.raises(ConfigError) as e:
            next(stream)
    finally:
        stream.close()
    assert str(e.value) == (f"{replaced}: the shard changed since the run started (data.dir prepared again, or "
                            "written to): restart the run to train on the new data")


def test_a_script_that_never_closes_its_stream_exits(tmp_path):
    """A DataStream with workers left open at exit (a user's script, a notebook cell run as a
    script): multiprocessing's exit handler sent the workers SIGTERM, which they ignore (the
    trainer's stop signals are its own), and waited for them forever. The stream now shuts its
    workers down at exit first."""
    import subprocess
    import sys

    from helpers import ENV, ROOT
    d = make_data(tmp_path / "d", [np.arange(40, dtype=np.uint16)])
    script = ("from training.data import DataStream, TokenWindows\n"
              f"stream = DataStream(TokenWindows({str(d)!r}, 'train', 4), 2, 1, 0, seed=0, num_workers=1)\n"
              "x, y = next(stream)\n"
              "print('batch', tuple(x.shape))\n")
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=ENV, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout == "batch (2, 4)\n", r.stderr[-2000:]


# -- the sampler's length is what it yields --------------------------------------------------------

@pytest.mark.parametrize("n, replicas", [(50, 1), (50, 3), (51, 4), (7, 2)])
def test_sampler_len_is_the_number_of_indices_it_yields(n, replicas):
    class Range(torch.utils.data.Dataset):
        def __len__(self):
            return n

    for rank in range(replicas):
        for start in range(0, n + 2):
            s = ResumableSampler(Range(), replicas, rank, seed=1)
            s.set_position(0, start)
            assert len(s) == len(list(s)), (rank, start)


# -- data_fingerprint: what is, and is not, the data's identity ------------------------------------

META = {"format_version": 1, "vocab_size": 512, "dtype": "uint16", "eos_id": 0, "bos_id": None, "pad_id": None,
        "tokenizer_file": "tokenizer.json", "tokenizer_sha256": "a" * 64,
        "splits": {"train": {"shards": [{"file": "train_00000.npy", "tokens": 100, "sha256": "b" * 64}]},
                   "val": {"shards": [{"file": "val_00000.npy", "tokens": 10, "sha256": "c" * 64}]}},
        "seed": 0, "inputs": [{"path": "/home/a/corpus", "files": 3}], "command": "prepare_data.py --out /a/x",
        "created_by": "prepare_data.py"}


@pytest.mark.parametrize("key, value", [("vocab_size", 513), ("dtype", "uint32"), ("eos_id", 1), ("bos_id", 2),
                                        ("pad_id", 3), ("tokenizer_sha256", "d" * 64)])
def test_every_identity_field_enters_the_fingerprint(key, value):
    assert data_fingerprint({**META, key: value}) != data_fingerprint(META)


def test_paths_commands_and_key_order_leave_the_fingerprint_as_it_is():
    """The same data prepared elsewhere (another --out, another input path) or its meta.json
    written with the keys in another order: the same fingerprint (hosts agree, no warning)."""
    moved = {**META, "command": "prepare_data.py --out /mnt/b/x", "inputs": [{"path": "/mnt/corpus", "files": 3}]}
    assert data_fingerprint(moved) == data_fingerprint(META)
    reordered = dict(reversed(list(META.items())))
    reordered["splits"] = {"val": META["splits"]["val"], "train": META["splits"]["train"]}
    assert data_fingerprint(reordered) == data_fingerprint(META)


# -- the tokenizer and data-change checks ----------------------------------------------------------

def test_data_change_warning_only_when_the_fingerprint_differs(tmp_path):
    ckpt = {"data": {"fingerprint": data_fingerprint(META)}}
    assert data_change_warning(ckpt, META, "X") is None
    assert data_change_warning(ckpt, {**META, "vocab_size": 600}, "X") == (
        "warning: the checkpoint was saved while training on other data (meta.json differs): X")
    assert data_change_warning({"data": {}}, {**META, "vocab_size": 600}, "X") is None  # older checkpoints
    (tmp_path / "meta.json").write_text(json.dumps(META))
    assert data_change_warning(ckpt, tmp_path, "X") is None


def test_check_same_tokenizer_refuses_another_and_takes_the_same_or_its_same_ids_twin():
    ckpt = {"data": {"tokenizer_sha256": "a" * 64, "tokenizer_sha256_same_ids": "e" * 64}}
    check_same_tokenizer(ckpt, {"tokenizer_sha256": "a" * 64}, "ck.pt", "/d")
    check_same_tokenizer(ckpt, {"tokenizer_sha256": "e" * 64}, "ck.pt", "/d")
    check_same_tokenizer({"data": {}}, {"tokenizer_sha256": "f" * 64}, "ck.pt", "/d")  # older checkpoints
    with pytest.raises(ConfigError, match=r"^ck\.pt was trained on data of another tokenizer"):
        check_same_tokenizer(ckpt, {"tokenizer_sha256": "f" * 64}, "ck.pt", "/d")


def test_tokenizer_difference_and_the_unverified_warning(tmp_path):
    tok = tmp_path / "tokenizer.json"
    tok.write_text("{}")
    sha = hashlib.sha256(b"{}").hexdigest()
    assert tokenizer_difference({"data": {"tokenizer_sha256": sha}}, tok) is None
    assert tokenizer_difference({"data": {"tokenizer_sha256": "f" * 64}}, tok).startswith(
        f"its tokenizer.json (sha256 {sha[:12]}...) is not byte for byte")
    assert tokenizer_difference({"data": {}}, tok) is None
    (tmp_path / "meta.json").write_text(json.dumps(META))
    moved = {"data": {"fingerprint": "0" * 64, "tokenizer_sha256": sha}}
    assert unverified_tokenizer_warning(moved, tmp_path) is None    # checked exactly instead
    old = {"data": {"fingerprint": "0" * 64}}
    assert "may not be the model's" in unverified_tokenizer_warning(old, tmp_path)


# -- a shard's byte order is the one its header says -----------------------------------------------

def test_a_big_endian_shard_reads_as_its_values(tmp_path):
    """np.load names '>u2' uint16 too, so meta.json's check passes: the windows must then be
    read in the header's byte order (native order would swap every id: 1 -> 256)."""
    arr = (np.arange(30) % 7).astype(">u2")
    ds = TokenWindows(make_data(tmp_path / "d", [arr], vocab=65535), "train", 4)
    for i in range(len(ds)):
        x, y = ds[i]
        assert x.tolist() == arr[4 * i:4 * i + 4].tolist() and y.tolist() == arr[4 * i + 1:4 * i + 5].tolist()
