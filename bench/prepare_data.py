#!/usr/bin/env python3
"""Throughput of prepare_data.py against raw `Tokenizer.encode_batch` on the same text.

    .venv/bin/python bench/prepare_data.py [--passes 2] [--repeats 3] [--vocab-size 32768] [--large-file-mb 100,200]

Corpus: the .py files of this Python's standard library (without site-packages), copied `--passes`
times into a temporary directory (as distinct files, so the pipeline reads every copy), enough
passes to exceed 50 MB by default. One tokenizer (trained here on the first 20 MB, or `--tokenizer`)
serves both sides.

- raw: the documents already in memory, `encode_batch` over batches of the size the pipeline uses;
  nothing kept. `encode_batch_fast` (no offsets), which the pipeline calls, is shown as well.
- pipeline: `prepare_data.main([... --tokenizer T ...])` end to end: walking and reading the files,
  UTF-8 checks, split hashing, encoding, shard building and hashing, writing with fsync.

tokens/s counts document tokens (end-of-text ids excluded) on both sides. Runs are interleaved
(raw, fast, pipeline, raw, ...) so that load from other processes hits all three alike; the table
shows medians. Results also go to bench/results/prepare_data.json (`--json PATH` elsewhere).

One large file (`--large-file-mb`, default 100 and 200; 0: skip): the documents concatenated into
one plain-text file of that size, prepared end to end in a child process read in blocks (as
prepare_data.py does past STREAM_BYTES) and read whole (STREAM_BYTES raised past the file), runs
interleaved; the child's peak resident memory (`wait4`'s ru_maxrss) and wall time, medians.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import prepare_data  # noqa: E402

TARGET_BYTES = 50_000_000


def stdlib_files() -> list[Path]:
    std = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(std):
        dirnames[:] = sorted(d for d in dirnames if d != "site-packages")
        files += [Path(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
    return files


def build_corpus(folder: Path, passes: int | None) -> tuple[list[str], int]:
    """Copy the stdlib .py files into folder/pass_k/...; return the documents prepare_data will see
    (UTF-8, non-empty, in its order) and the number of passes."""
    std = Path(sysconfig.get_paths()["stdlib"])
    texts, rels = [], []
    for path in stdlib_files():
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue
        if text:
            texts.append(text)
            rels.append(path.relative_to(std))
    size = sum(len(t.encode()) for t in texts)
    passes = passes or -(-TARGET_BYTES // size)
    docs = []
    for k in range(passes):
        for rel, text in zip(rels, texts):
            dest = folder / f"pass_{k}" / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(text, encoding="utf-8", newline="")
        docs += texts
    # prepare_data walks directories in sorted order; the order does not change token counts.
    return docs, passes


def time_raw(tok, docs: list[str], fast: bool) -> tuple[float, int]:
    encode = tok.encode_batch_fast if fast else tok.encode_batch
    batches, batch, nbytes = [], [], 0
    for d in docs:  # the pipeline's batching
        batch.append(d)
        nbytes += len(d.encode())
        if nbytes >= prepare_data.BATCH_BYTES or len(batch) >= prepare_data.BATCH_DOCS:
            batches.append(batch)
            batch, nbytes = [], 0
    if batch:
        batches.append(batch)
    t0 = time.perf_counter()
    tokens = 0
    for b in batches:
        tokens += sum(len(e) for e in encode(b, add_special_tokens=False))
    return time.perf_counter() - t0, tokens


def time_pipeline(corpus: Path, tokenizer: Path, out: Path) -> tuple[float, int]:
    argv = ["--input", str(corpus), "--glob", "*.py", "--tokenizer", str(tokenizer), "--out", str(out),
            "--overwrite"]
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        rc = prepare_data.main(argv)
    elapsed = time.perf_counter() - t0
    if rc != 0:
        raise SystemExit(f"prepare_data.py failed with exit code {rc}")
    meta = json.loads((out / "meta.json").read_text())
    splits = meta["splits"].values()
    return elapsed, sum(s["tokens"] - s["documents"] for s in splits)  # without end-of-text ids


# A child that prepares one file with prepare_data.STREAM_BYTES set to argv[1].
CHILD = ("import sys; sys.path.insert(0, sys.argv[1]); import prepare_data; "
         "prepare_data.STREAM_BYTES = int(sys.argv[2]); sys.exit(prepare_data.main(sys.argv[3:]))")


def large_file(docs: list[str], path: Path, nbytes: int) -> int:
    """The documents one after the other, repeated, cut to about ``nbytes`` at a document's end."""
    written = 0
    with open(path, "wb") as f:
        while written < nbytes:
            for d in docs:
                data = d.encode()
                f.write(data)
                written += len(data)
                if written >= nbytes:
                    break
    return written


def time_large_file(path: Path, tokenizer: Path, out: Path, whole: bool) -> tuple[float, float]:
    """(peak resident MiB, seconds) of prepare_data.py on one file, in a child process."""
    limit = path.stat().st_size + 1 if whole else prepare_data.STREAM_BYTES
    argv = [sys.executable, "-c", CHILD, str(ROOT), str(limit), "--input", str(path), "--tokenizer", str(tokenizer),
            "--out", str(out), "--overwrite"]
    t0 = time.perf_counter()
    child = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(child.pid, 0)
    seconds = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"prepare_data.py failed on {path} (exit status {os.waitstatus_to_exitcode(status)})")
    return usage.ru_maxrss / 1024, seconds  # KiB on Linux


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--passes", type=int, help="copies of the stdlib (default: enough for 50 MB)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of each kind (default 3)")
    ap.add_argument("--vocab-size", type=int, default=32768, help="of the tokenizer trained here")
    ap.add_argument("--tokenizer", help="use this tokenizer.json / directory instead of training one")
    ap.add_argument("--large-file-mb", default="100,200", metavar="MB[,MB...]",
                    help="sizes of the one-file runs, each over STREAM_BYTES (default 100,200; 0: none)")
    ap.add_argument("--workdir", help="where to put the corpus copy (default: a temporary directory)")
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "prepare_data.json",
                    metavar="PATH", help="write the results there (default: bench/results/prepare_data.json)")
    args = ap.parse_args()

    def refuse(message: str) -> None:   # one line, no usage text: exit status 2 as argparse's
        print(f"bench/prepare_data.py: error: {message}", file=sys.stderr)
        sys.exit(2)

    for flag, value in (("--passes", args.passes), ("--repeats", args.repeats), ("--vocab-size", args.vocab_size)):
        if value is not None and value < 1:
            refuse(f"{flag} must be at least 1, got {value}")
    try:
        large_mb = [int(v) for v in args.large_file_mb.split(",")] if args.large_file_mb != "0" else []
    except ValueError:
        large_mb = [0]
    stream_mb = prepare_data.STREAM_BYTES / 1e6
    if any(mb <= stream_mb for mb in large_mb):
        refuse(f"--large-file-mb {args.large_file_mb}: sizes must be whole numbers of MB over "
               f"prepare_data.STREAM_BYTES ({stream_mb:.0f} MB), or 0")
    if args.workdir and not Path(args.workdir).is_dir():
        refuse(f"--workdir {args.workdir}: no such directory")
    if not args.json.parent.is_dir() and args.json.parent != ROOT / "bench" / "results":
        refuse(f"--json {args.json}: no directory {args.json.parent}")
    if args.tokenizer and not (Path(args.tokenizer).is_file() or (Path(args.tokenizer) / "tokenizer.json").is_file()):
        refuse(f"--tokenizer {args.tokenizer}: no tokenizer.json there")

    from tokenizers import Tokenizer
    import tokenizers

    with tempfile.TemporaryDirectory(dir=args.workdir, prefix="bench_prepare_data_") as tmp:
        tmp = Path(tmp)
        docs, passes = build_corpus(tmp / "corpus", args.passes)
        nbytes = sum(len(d.encode()) for d in docs)
        if args.tokenizer:
            tok_path = Path(args.tokenizer)
            tok_path = tok_path / "tokenizer.json" if tok_path.is_dir() else tok_path
            tok_note = str(args.tokenizer)
        else:
            t0 = time.perf_counter()
            sample, used = [], 0
            for d in docs:
                sample.append(d)
                used += len(d.encode())
                if used >= 20_000_000:
                    break
            tok_path = tmp / "tokenizer.json"
            prepare_data.train_tokenizer(iter(sample), args.vocab_size, False).save(str(tok_path))
            tok_note = f"byte-level BPE, vocab {args.vocab_size}, trained on {used / 1e6:.0f} MB " \
                       f"in {time.perf_counter() - t0:.0f} s"
        tok = Tokenizer.from_file(str(tok_path))
        tok.encode_special_tokens = True  # as the pipeline does

        runs = {"raw Tokenizer.encode_batch": [], "raw Tokenizer.encode_batch_fast": [],
                "prepare_data.py pipeline": []}
        counts = {}
        for r in range(args.repeats):
            for name, fn in (("raw Tokenizer.encode_batch", lambda: time_raw(tok, docs, False)),
                             ("raw Tokenizer.encode_batch_fast", lambda: time_raw(tok, docs, True)),
                             ("prepare_data.py pipeline",
                              lambda: time_pipeline(tmp / "corpus", tok_path, tmp / "out"))):
                seconds, tokens = fn()
                runs[name].append(seconds)
                counts[name] = tokens
                print(f"  run {r + 1}/{args.repeats} {name}: {seconds:.2f} s", file=sys.stderr, flush=True)
        if len(set(counts.values())) != 1:
            raise SystemExit(f"token counts differ between raw and pipeline: {counts}")
        tokens = counts["prepare_data.py pipeline"]

        large = {}  # MB -> {"blocks"|"whole": [(peak MiB, s), ...]}
        for mb in large_mb:
            path = tmp / f"large_{mb}.txt"
            size = large_file(docs, path, mb * 1_000_000)
            large[mb] = {"bytes": size, "blocks": [], "whole": []}
            for r in range(args.repeats):
                for kind in ("blocks", "whole"):
                    peak, seconds = time_large_file(path, tok_path, tmp / "out_large", kind == "whole")
                    large[mb][kind].append((peak, seconds))
                    print(f"  run {r + 1}/{args.repeats} one {mb} MB file read {kind}: {peak:.0f} MiB, "
                          f"{seconds:.1f} s", file=sys.stderr, flush=True)
            path.unlink()

    print(f"corpus: stdlib .py files x {passes} passes = {nbytes / 1e6:.1f} MB, {len(docs):,} documents, "
          f"{tokens:,} tokens")
    print(f"tokenizer: {tok_note}")
    print(f"machine: {os.cpu_count()} CPUs, Python {platform.python_version()}, "
          f"tokenizers {tokenizers.__version__}, repeats {args.repeats} (medians)")
    print(f"{'':34}{'median s':>9}{'tokens/s':>12}{'MB/s':>8}")
    medians = {name: statistics.median(v) for name, v in runs.items()}
    for name, s in medians.items():
        print(f"{name:34}{s:9.2f}{tokens / s:12,.0f}{nbytes / s / 1e6:8.2f}")
    ratio = medians["raw Tokenizer.encode_batch"] / medians["prepare_data.py pipeline"]
    ratio_fast = medians["raw Tokenizer.encode_batch_fast"] / medians["prepare_data.py pipeline"]
    print(f"pipeline / raw encode_batch: {ratio:.2f} (target >= 0.5); "
          f"pipeline / raw encode_batch_fast: {ratio_fast:.2f}")

    if large:
        print(f"one plain-text file, peak resident memory and wall time (medians), read in blocks as "
              f"prepare_data.py does past {stream_mb:.0f} MB vs read whole:")
        print(f"{'file MB':>8}{'blocks MiB':>12}{'whole MiB':>11}{'whole/blocks':>14}{'blocks s':>10}{'whole s':>9}")
    large_medians = {}
    for mb, runs_of in large.items():
        m = {kind: [statistics.median(v[i] for v in runs_of[kind]) for i in (0, 1)] for kind in ("blocks", "whole")}
        large_medians[mb] = {"bytes": runs_of["bytes"], "peak_mib": {k: v[0] for k, v in m.items()},
                             "seconds": {k: v[1] for k, v in m.items()}}
        print(f"{runs_of['bytes'] / 1e6:8.0f}{m['blocks'][0]:12.0f}{m['whole'][0]:11.0f}"
              f"{m['whole'][0] / m['blocks'][0]:14.2f}{m['blocks'][1]:10.1f}{m['whole'][1]:9.1f}")

    args.json.parent.mkdir(parents=True, exist_ok=True)   # bench/results/ on a fresh checkout
    record = {"corpus_bytes": nbytes, "documents": len(docs), "tokens": tokens, "passes": passes,
              "tokenizer": tok_note, "cpus": os.cpu_count(), "runs_s": runs, "median_s": medians,
              "ratio_pipeline_to_raw_encode_batch": ratio,
              "ratio_pipeline_to_raw_encode_batch_fast": ratio_fast,
              "large_file_runs": {mb: {k: v[k] for k in ("blocks", "whole")} for mb, v in large.items()},
              "large_file_medians": large_medians}
    tmp_file = args.json.with_name(args.json.name + ".tmp")
    tmp_file.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp_file, args.json)


if __name__ == "__main__":
    main()
