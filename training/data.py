"""Token data: memory-mapped shards from prepare_data.py, windows of seq_len + 1 tokens, and a
seeded per-epoch order that can resume at the exact sample on any number of replicas."""
from __future__ import annotations

import hashlib
import json
import signal
import weakref
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from .config import ConfigError


# The meta.json fields that fix the token stream: the shards (with their sha256) of both splits,
# their dtype, the tokenizer and its special ids. Paths and the command that made them are left
# out, so the same data prepared or copied anywhere has the same fingerprint.
_DATA_IDENTITY = ("vocab_size", "dtype", "eos_id", "bos_id", "pad_id", "tokenizer_sha256", "splits")


def data_fingerprint(meta: dict) -> str:
    """sha256 of the identity of a prepared data directory (its meta.json); hosts of one job
    compare it at start, so none trains on other data than the rest."""
    import hashlib
    ident = {k: meta.get(k) for k in _DATA_IDENTITY}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


def data_change_warning(ckpt: dict, data: Path | dict, where: str) -> str | None:
    """A warning when a checkpoint was saved while training on other data than ``data`` (a data
    directory, or its meta.json already read) holds now: its meta.json fingerprint differs
    (re-prepared, perhaps with another tokenizer). ``where`` ends the sentence's first half: what
    the difference means to the caller. None when they agree or either is unknown."""
    saved = (ckpt.get("data") or {}).get("fingerprint")
    if saved is None:  # checkpoints of older versions
        return None
    try:
        meta = data if isinstance(data, dict) else json.loads((Path(data) / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    if saved == data_fingerprint(meta):
        return None
    return f"warning: the checkpoint was saved while training on other data (meta.json differs): {where}"


def check_same_tokenizer(ckpt: dict, meta: dict, path, data_dir) -> None:
    """A ``ConfigError`` when the checkpoint at ``path`` was trained on data of another tokenizer
    than ``data_dir``'s (its meta.json ``meta``): every token id would then stand for other text,
    and the run would train on that, or resume as if nothing changed. Other changes to the data
    (more shards, another split) are ``data_change_warning``'s. Checkpoints that record no
    tokenizer (older ones) pass."""
    data = ckpt.get("data") or {}
    saved, now = data.get("tokenizer_sha256"), meta.get("tokenizer_sha256")
    if saved and now and now not in (saved, data.get("tokenizer_sha256_same_ids")):
        raise ConfigError(f"{path} was trained on data of another tokenizer (tokenizer.json sha256 "
                          f"{saved[:12]}...) than data.dir={data_dir} holds ({now[:12]}...): its token ids "
                          "would mean other text; prepare the data with the run's tokenizer "
                          "(prepare_data.py --tokenizer DIR of the data it was trained on)")


def unverified_tokenizer_warning(ckpt: dict, data_dir: Path) -> str | None:
    """``data_change_warning`` for the decoding tools, for a checkpoint too old to record its
    tokenizer's sha256: its data.dir changed since, so its tokenizer may not be the model's. A
    checkpoint that records one is checked exactly instead (``tokenizer_difference``)."""
    if (ckpt.get("data") or {}).get("tokenizer_sha256"):
        return None
    return data_change_warning(ckpt, data_dir, f"the tokenizer of {data_dir} may not be the model's "
                               "(pass --tokenizer)")


def tokenizer_difference(ckpt: dict, tokenizer_json: Path) -> str | None:
    """For the tools that decode a checkpoint's token ids (sample.py, export_hf.py): how
    ``tokenizer_json`` differs from the tokenizer the checkpoint was trained with (its data's
    tokenizer.json sha256, recorded since fb250af), as "its tokenizer.json (sha256 ...) is not byte
    for byte the one the checkpoint was trained with (...)" (an earlier export's tokenizer.json,
    rewritten without its post-processor, differs in bytes, not in tokens); None when they are
    the same bytes, or when the checkpoint records none (older ones) or the file is missing (the
    caller says so)."""
    recorded = (ckpt.get("data") or {}).get("tokenizer_sha256")
    if not recorded or not Path(tokenizer_json).is_file():
        return None
    now = hashlib.sha256(Path(tokenizer_json).read_bytes()).hexdigest()
    if now == recorded:
        return None
    return (f"its tokenizer.json (sha256 {now[:12]}...) is not byte for byte the one the checkpoint was "
            f"trained with ({recorded[:12]}...)")


# Shards kept memory-mapped at once by one dataset in one process (each DataLoader worker has its
# own): a map holds a file descriptor, and mapping every shard ran out of them at ~1,000 shards
# under the usual limit of 1,024 (100B tokens at the default 100M tokens a shard).
OPEN_SHARDS = 32

# What a shard may hold: prepare_data.SHARD_DTYPES (the training core does not import the data
# tool), ids that are never negative and are exact as int64, which the embedding takes.
SHARD_DTYPES = ("uint16", "uint32")


class TokenWindows(Dataset):
    """Non-overlapping windows of ``seq_len + 1`` tokens over every shard of one split.

    Sample ``i`` is ``(x, y)`` with ``y`` the tokens of ``x`` shifted by one. Windows do not cross
    shard boundaries; the tail of a shard shorter than a window is not used. Every shard is checked
    against meta.json at start, then memory mapped when a sample is first read from it: at most
    ``OPEN_SHARDS`` at a time, the least recently used closed first.
    """

    def __init__(self, data_dir: str | Path, split: str, seq_len: int):
        self.dir = Path(data_dir).expanduser()
        meta_path = self.dir / "meta.json"
        try:
            meta = json.loads(meta_path.read_text())
            self.vocab_size = int(meta["vocab_size"])
            entries = [(self.dir / shard["file"], int(shard["tokens"]))
                       for shard in meta["splits"][split]["shards"]]
            dtype = str(meta["dtype"])
        except OSError as e:
            raise ConfigError(f"data.dir: cannot read {meta_path} ({e.strerror or e})") from None
        except (ValueError, KeyError, TypeError, OverflowError) as e:  # Overflow: a vocab_size of Infinity
            raise ConfigError(f"{meta_path}: unreadable meta.json ({type(e).__name__}: {e})") from None
        if dtype not in SHARD_DTYPES:
            raise ConfigError(f"{meta_path}: dtype {dtype!r}: shards hold token ids as "
                              f"{' or '.join(SHARD_DTYPES)}")
        self.meta = meta
        self.seq_len = seq_len
        self.eos_id = meta.get("eos_id")
        self.paths = [path for path, _ in entries]
        self.lengths, self._headers = [], []  # tokens of each shard, and where they start in its file
        self._stamps = []  # each shard file's size and modification time, as checked
        self.dtype = None
        for path, tokens in entries:
            arr = self._open(path, tokens, dtype)  # checked now; unmapped (its descriptor closed) when dropped
            self.lengths.append(arr.shape[0])
            self._headers.append(arr.offset)
            self._stamps.append(self._stamp(path))
            self.dtype = arr.dtype
        self._maps: OrderedDict[int, np.ndarray] = OrderedDict()  # shard index -> its map, oldest use first
        counts = [max(0, (n - 1) // seq_len) for n in self.lengths]
        self.offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        if self.offsets[-1] == 0:
            raise ConfigError(f"{self.dir}: the {split} split has fewer than seq_len + 1 = "
                              f"{seq_len + 1} tokens in every shard")

    @staticmethod
    def _open(path: Path, tokens: int, dtype: str) -> np.memmap:
        """A shard memory-mapped, checked against its meta.json entry."""
        try:
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as e:
            raise ConfigError(f"{path}: cannot open shard ({e})") from None
        except EOFError:
            raise ConfigError(f"{path}: cannot open shard (an empty file)") from None
        if not isinstance(arr, np.ndarray):  # a .npz archive under a .npy name
            arr.close()
            raise ConfigError(f"{path}: cannot open shard (a .npz archive, not one .npy array)")
        if arr.shape != (tokens,) or arr.dtype.name != dtype:
            shape = ", ".join(map(str, arr.shape))
            raise ConfigError(f"{path}: {arr.dtype.name}[{shape}] does not match meta.json "
                              f"({dtype}[{tokens}])")
        return arr

    @staticmethod
    def _stamp(path: Path) -> tuple[int, int] | None:
        """A shard file's size and modification time (not its inode: gcsfuse may number a file
        anew when the kernel forgets it); None if it cannot be read."""
        try:
            st = path.stat()
        except OSError:
            return None
        return st.st_size, st.st_mtime_ns

    def shard(self, s: int) -> np.ndarray:
        """Shard ``s`` memory-mapped: from the cache, or mapped again from what its header said at
        start (closing the least recently used map when ``OPEN_SHARDS`` are open), if the file is
        still the one checked then. DataLoader workers are made anew each epoch and map the
        shards again: a data.dir prepared again meanwhile (prepare_data.py --overwrite) was read
        from then on, its new tokens taken at the old offsets, without a word."""
        arr = self._maps.get(s)
        if arr is not None:
            self._maps.move_to_end(s)
            return arr
        if len(self._maps) >= OPEN_SHARDS:
            self._maps.popitem(last=False)
        try:
            arr = np.memmap(self.paths[s], dtype=self.dtype, mode="r", offset=self._headers[s],
                            shape=(self.lengths[s],))
        except (OSError, ValueError) as e:  # removed or truncated since the start
            raise ConfigError(f"{self.paths[s]}: cannot open shard ({e})") from None
        if self._stamp(self.paths[s]) != self._stamps[s]:
            raise ConfigError(f"{self.paths[s]}: the shard changed since the run started (data.dir prepared "
                              "again, or written to): restart the run to train on the new data")
        self._maps[s] = arr
        return arr

    def __getstate__(self) -> dict:
        # a DataLoader worker started by spawn or forkserver (macOS's default; Linux's from Python
        # 3.14) gets this object pickled: a pickled memmap is a copy of all its data, so the
        # worker maps the shards again instead
        state = dict(self.__dict__)
        state["_maps"] = OrderedDict()
        return state

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def unused_warning(self, split: str) -> str | None:
        """A warning when more than a tenth of the tokens are in no window: windows do not cross
        shard boundaries, so each shard's tail shorter than ``seq_len`` is never read (400-token
        shards with seq_len 256 leave 36%); None otherwise."""
        total = sum(self.lengths)
        windows = np.diff(self.offsets)  # a shard's c windows read c x seq_len + 1 of its tokens
        unused = 1 - int((windows * self.seq_len + (windows > 0)).sum()) / total
        if unused <= 0.1:
            return None
        return (f"warning: {unused:.0%} of the {split} split's tokens are in no window: windows of "
                f"data.seq_len + 1 = {self.seq_len + 1} tokens do not cross shard boundaries, and its "
                f"shards hold {total / len(self.lengths):,.0f} tokens on average; prepare the data with "
                "a larger --shard-tokens, or use a shorter data.seq_len")

    def locate(self, i: int) -> tuple[int, int]:
        """Sample ``i``'s shard index and first token within it."""
        s = int(np.searchsorted(self.offsets, i, side="right") - 1)
        return s, (i - int(self.offsets[s])) * self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s, start = self.locate(i)
        w = torch.from_numpy(self.shard(s)[start:start + self.seq_len + 1].astype(np.int64))
        return w[:-1], w[1:]

    def check_ids(self, indices) -> None:
        """A ConfigError naming the shard and position of the first token id of these samples
        that is not below the vocabulary (a corrupt shard, or one written with another
        tokenizer): in the model it would be an index error, on CUDA a device-side assert."""
        for i in indices:
            s, start = self.locate(int(i))
            w = np.asarray(self.shard(s)[start:start + self.seq_len + 1])
            bad = np.flatnonzero(w >= self.vocab_size)
            if bad.size:
                raise ConfigError(f"{self.paths[s]}: token {start + int(bad[0])} is id {int(w[bad[0]])}, not "
                                  f"below meta.json's vocab_size {self.vocab_size}: the shard is corrupt or "
                                  "was written with another tokenizer (prepare the data again)")


class ResumableSampler(DistributedSampler):
    """``DistributedSampler(shuffle=True, drop_last=True)`` whose epoch can start part-way.

    Epoch ``e`` is the permutation of all samples drawn from ``seed + e`` (the same for every
    replica count); replica ``r`` of ``R`` takes positions ``start + r, start + r + R, ...``.
    ``start`` counts *global* samples already consumed in the epoch, so a run stopped after ``k``
    global samples resumes on the next one whatever the number of replicas.
    """

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, seed: int, shuffle: bool = True):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle,
                         seed=seed, drop_last=True)
        self.start = 0

    def set_position(self, epoch: int, start: int) -> None:
        self.set_epoch(epoch)
        self.start = start

    def _order(self) -> torch.Tensor:
        n = len(self.dataset)
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            # int32 while it fits: half the memory (4 bytes a sample: 2 GB on every process for
            # 500M samples, 2T tokens of 4096), and the same permutation as int64's
            return torch.randperm(n, generator=g, dtype=torch.int32 if n < 2 ** 31 else torch.int64)
        return torch.arange(n)

    def __iter__(self):
        # The epoch's order stays one tensor (4 bytes a sample; as a Python list it was ~36, on
        # every rank); this replica's positions are a view of it, handed out in chunks.
        order = self._order()
        usable = (len(order) // self.num_replicas) * self.num_replicas  # drop_last
        mine = order[self.start + self.rank:usable:self.num_replicas]
        for chunk in mine.split(1 << 16):
            yield from chunk.tolist()

    def __len__(self) -> int:
        usable = (len(self.dataset) // self.num_replicas) * self.num_replicas
        return max(0, (usable - self.start - self.rank + self.num_replicas - 1) // self.num_replicas)


# The signals that ask a run to stop and save (training.loop.StopRequested): Ctrl+C, a
# preemption or kill, and a terminal's hang-up (an ssh session that ended; torchrun passes a
# SIGHUP on to its workers too).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM) + ((signal.SIGHUP,) if hasattr(signal, "SIGHUP") else ())


def stop_signals_taken() -> tuple:
    """The stop signals this process acts on: a hang-up that it was started ignoring (``nohup``)
    is left ignored, or a nohup'd run would stop when its terminal goes."""
    return tuple(s for s in STOP_SIGNALS
                 if s in (signal.SIGINT, signal.SIGTERM) or signal.getsignal(s) != signal.SIG_IGN)


def ignore_stop_signals(worker_id: int) -> None:
    """A DataLoader worker's ``worker_init_fn``: the stop signals are the trainer's to handle.
    A terminal's Ctrl+C or hang-up, or a SIGTERM to the whole process group (a scheduler's
    preemption), reaches the workers too; one that died of it would end the run with "DataLoader
    worker exited unexpectedly" before the trainer saves. The trainer stops them itself
    (``DataStream.close``), and a worker whose trainer is gone exits on its own (DataLoader's
    watchdog)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):  # blocked while the worker started (see _start_workers)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def _start_workers(make):
    """``make()`` (a DataLoader iterator, which starts its worker processes) with the stop
    signals blocked in this thread: the workers inherit the block, which holds until their
    ``ignore_stop_signals`` runs (a spawned worker imports torch first, seconds with default
    handlers otherwise). A signal that comes meanwhile reaches this process once unblocked."""
    if not hasattr(signal, "pthread_sigmask"):
        return make()
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        return make()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def past_vocabulary(batch, vocab_size: int | None) -> bool:
    """Whether a host batch ``(x, y)`` holds a token id not below ``vocab_size`` (y is x shifted
    by one, so y and x's first column are every token of it): one max per batch, on the host."""
    x, y = batch
    return vocab_size is not None and max(int(y.max()), int(x[:, 0].max())) >= vocab_size


def _shut_down_workers(it) -> None:
    """Shut down a DataLoader iterator's worker processes (a single-process iterator has none)."""
    shutdown = getattr(it, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()
        for w in getattr(it, "_workers", []):  # stuck: its SIGTERM from shutdown is ignored
            if w.is_alive():
                w.kill()


def _worker_message(e: ConfigError) -> str:
    """A ConfigError's own line: DataLoader re-raises a worker's exception with a message of
    its own followed by the worker's traceback, whose last line is ``...ConfigError: <line>``."""
    text = str(e)
    if "Original Traceback" not in text:
        return text
    last = [ln for ln in text.splitlines() if ln.strip()][-1]
    return last.split("ConfigError: ", 1)[-1]


class DataStream:
    """An endless iterator of ``(x, y)`` batches from a known (epoch, global offset) position.

    An epoch holds ``(usable - offset) // global_batch`` more batches on every replica (the same
    count everywhere, so DDP processes never disagree on the number of steps); then the next epoch
    starts at offset 0. Position bookkeeping is plain arithmetic (``advance``), so the loop can say
    where it is even while a device loader prefetches batches ahead of the step.
    """

    def __init__(self, dataset: Dataset, batch_size: int, num_replicas: int, rank: int, seed: int,
                 num_workers: int = 0, pin_memory: bool = False, shuffle: bool = True):
        self.dataset = dataset
        self.global_batch = batch_size * num_replicas
        self.usable = (len(dataset) // num_replicas) * num_replicas
        if self.usable < self.global_batch:
            raise ConfigError(f"the data has {len(dataset)} samples, fewer than one global batch "
                              f"(training.batch_size {batch_size} x {num_replicas} replicas)")
        self.sampler = ResumableSampler(dataset, num_replicas, rank, seed, shuffle=shuffle)
        self.loader_kwargs = dict(batch_size=batch_size, num_workers=num_workers, drop_last=True,
                                  pin_memory=pin_memory,
                                  worker_init_fn=ignore_stop_signals if num_workers > 0 else None)
        self.epoch, self.offset = 0, 0
        self._it, self._left = None, 0
        self._workers_at_exit: weakref.finalize | None = None
        self.vocab_size = getattr(dataset, "vocab_size", None)

    @property
    def batches_per_epoch(self) -> int:
        return self.usable // self.global_batch

    def remaining(self, offset: int) -> int:
        return max(0, (self.usable - offset) // self.global_batch)

    def advance(self, epoch: int, offset: int, n: int) -> tuple[int, int]:
        """The position ``n`` global batches after ``(epoch, offset)``."""
        while True:
            rem = self.remaining(offset)
            if rem == 0:
                epoch, offset = epoch + 1, 0
                continue
            if n == 0:
                return epoch, offset
            k = min(n, rem)
            offset += k * self.global_batch
            n -= k

    def set_position(self, epoch: int, offset: int) -> None:
        self.epoch, self.offset = epoch, offset
        self._it, self._left = None, 0

    def placeholder(self) -> tuple:
        """A batch of this stream's shape and dtype (token 0 everywhere), to stand in for one it
        refused (an XLA loader has to hand a batch on)."""
        x = torch.zeros(self.loader_kwargs["batch_size"], self.dataset.seq_len, dtype=torch.long)
        return x, x.clone()

    def __iter__(self):
        return self

    def close(self) -> None:
        """Shut down the DataLoader's worker processes now (they would otherwise be killed at
        exit halfway through sending a batch)."""
        self._it, self._left = None, 0
        if self._workers_at_exit is not None:
            self._workers_at_exit()   # shuts them down, once

    def __next__(self):
        if self._left == 0:
            self.epoch, self.offset = self.advance(self.epoch, self.offset, 0)
            self.sampler.set_position(self.epoch, self.offset)
            # its own generator: a DataLoader iterator draws a seed for its workers, which from the
            # global RNG would shift every later dropout mask of a resumed run by one draw
            seeds = torch.Generator().manual_seed(self.sampler.seed + self.epoch)
            self.close()   # the last epoch's workers
            self._it = _start_workers(lambda: iter(DataLoader(self.dataset, sampler=self.sampler,
                                                              generator=seeds, **self.loader_kwargs)))
            # also at interpreter exit, before multiprocessing's own exit handler (registered
            # earlier, so run later), which would wait forever for workers that ignore its SIGTERM:
            # a script that never closes its stream hung at exit
            self._workers_at_exit = weakref.finalize(self, _shut_down_workers, self._it)
            self._left = self.remaining(self.offset)
        try:
            batch, offset = next(self._it), self.offset
        except ConfigError as e:  # a worker's (a shard gone or changed): its line, not its traceback
            raise ConfigError(_worker_message(e)) from None
        self._left -= 1                  # the batch is consumed, good or bad: the position moves on
        self.offset += self.global_batch
        if past_vocabulary(batch, self.vocab_size):
            self._bad_ids(offset)
        return batch

    def _bad_ids(self, offset: int) -> None:
        """The batch at ``offset`` holds an id past the vocabulary: say where."""
        s = self.sampler
        order = s._order()[offset + s.rank:offset + self.global_batch:s.num_replicas]
        self.dataset.check_ids(order)
        raise ConfigError(f"{getattr(self.dataset, 'dir', 'the data')}: a batch holds a token id not below "
                          f"the vocabulary ({self.vocab_size})")


def eval_batches(dataset: Dataset, batch_size: int, steps: int, num_replicas: int, rank: int):
    """The first ``steps`` global batches of the split in file order, this replica's share.

    The same samples at every evaluation, so eval losses are comparable across steps, and across
    runs with the same ``batch_size x num_replicas`` (gradient accumulation does not enter: a run
    of batch 4 on one process and one of batch 1 x accumulation 2 on two evaluate 8 and 4 samples).
    """
    steps = max(1, min(steps, len(dataset) // (batch_size * num_replicas)))
    sampler = ResumableSampler(dataset, num_replicas, rank, seed=0, shuffle=False)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True,
                        generator=torch.Generator().manual_seed(0))  # leaves the global RNG as it is
    for i, batch in enumerate(loader):
        if i >= steps:
            break
        if past_vocabulary(batch, getattr(dataset, "vocab_size", None)):
            dataset.check_ids(range(i * batch_size * num_replicas + rank, (i + 1) * batch_size * num_replicas,
                                    num_replicas))
        yield batch
