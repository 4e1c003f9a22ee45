"""Print continuations from a checkpoint of either trainer.

    python sample.py runs/demo                      # newest committed checkpoint in a run directory
    python sample.py runs/demo/ckpt_00001000.pt --prompt "def " --max-new-tokens 200 --top-k 40
    python sample.py runs/3b/ckpt_00020000          # a sharded (DCP) checkpoint, read on the CPU

The tokenizer is found through the data directory recorded in the checkpoint's config
(``--tokenizer`` overrides it).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from model import NashMHC
from prepare_data import DataError, TokenizerSpec, as_document_encoder
from training.checkpoint import CheckpointError, resolve_checkpoint
from training.config import ConfigError
from training.data import tokenizer_difference, unverified_tokenizer_warning
from training.hf import model_from_checkpoint



def load_model(path: Path, device: str) -> tuple[NashMHC, dict]:
    """The model of a checkpoint (weights that do not fit its config: a one-line CheckpointError),
    and the checkpoint's other entries."""
    path, ckpt = resolve_checkpoint(path, warn=lambda m: print(m, file=sys.stderr),
                                    with_optimizer=False)
    model = model_from_checkpoint(ckpt, path)
    bad = [name for name, t in model.state_dict().items() if t.is_floating_point() and not t.isfinite().all()]
    if bad:  # a diverged run's save: sampling would fail inside torch.multinomial, or print noise greedily
        raise CheckpointError(f"{path}: non-finite weights in {bad[0]}" + (f" and {len(bad) - 1} more" if len(bad) > 1
                              else "") + " (the run diverged): sample an earlier checkpoint")
    model.to(device).eval()
    print(f"loaded {path} (step {ckpt['step']}, {model.num_params() / 1e6:.2f}M parameters, "
          f"trained by {ckpt.get('trainer', '?')})", file=sys.stderr)
    del ckpt["model"]
    return model, ckpt


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", type=Path,
                    help="a ckpt_*.pt file, a ckpt_* (DCP) directory, or a run directory")
    ap.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    ap.add_argument("--max-new-tokens", type=int, default=200)
    ap.add_argument("--temperature", type=float, default=0.8, help="0: greedy (default: %(default)s)")
    ap.add_argument("--top-k", type=int, default=50, help="sample among the k likeliest tokens; 0: all of "
                                                          "them (default: %(default)s)")
    ap.add_argument("--num-samples", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0, help="the same seed and --num-samples give the same samples")
    ap.add_argument("--ignore-eos", action="store_true",
                    help="print past the tokenizer's end-of-text token (<|endoftext|> for prepare_data.py's "
                         "own), the end of a document (default: a sample ends there, as transformers' "
                         "generate ends an exported model's)")
    ap.add_argument("--tokenizer", type=Path, help="tokenizer.json, or a directory holding one "
                                                    "(default: the config's data.dir)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    for flag, value, low in (("--temperature", args.temperature, 0), ("--top-k", args.top_k, 0),
                             ("--max-new-tokens", args.max_new_tokens, 0), ("--num-samples", args.num_samples, 1)):
        if not value >= low:  # also NaN
            ap.error(f"{flag} must be at least {low}, got {value}")
    if not torch.tensor(args.temperature, dtype=torch.float32).isfinite():  # as generate's fp32 logits see it
        ap.error(f"--temperature must be finite in fp32 (below 3.4e38), got {args.temperature}")
    if not 0 <= args.seed < 2 ** 63:
        ap.error(f"--seed must be in [0, 2**63), got {args.seed}")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        ap.error(f"--device {args.device}: expected cpu, cuda, cuda:N or mps")
    if device.type == "cuda" and not (torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count()):
        ap.error(f"--device {args.device}: no such CUDA device here ({torch.cuda.device_count()} found)")
    if device.type == "mps" and not torch.backends.mps.is_available():
        ap.error(f"--device {args.device}: MPS is not available here")
    if device.type not in ("cpu", "cuda", "mps"):
        ap.error(f"--device {args.device}: expected cpu, cuda, cuda:N or mps")
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError:  # bytes from the command line that are not UTF-8
        ap.error("--prompt: not valid UTF-8 text")
    try:
        model, ckpt = load_model(args.checkpoint, args.device)
        try:
            data_dir = Path(ckpt["config"]["data"]["dir"]).expanduser()
        except (KeyError, TypeError):
            data_dir = None
        if args.tokenizer is None and data_dir is None:
            raise FileNotFoundError("the checkpoint records no data.dir: pass --tokenizer")
        tok_path = args.tokenizer or data_dir
        tok_file = tok_path / "tokenizer.json" if tok_path.is_dir() else tok_path
        if not tok_file.is_file():
            raise FileNotFoundError(f"{tok_path}: tokenizer not found (pass --tokenizer)")
        # as export_hf.py checks it: the data.dir's tokenizer must be the one the model was trained
        # with (else every id decodes to other text); a --tokenizer that differs is said
        differs = tokenizer_difference(ckpt, tok_file)
        if differs and args.tokenizer is None:
            raise FileNotFoundError(f"{data_dir}: {differs}: pass --tokenizer with the model's tokenizer")
        if differs:
            print(f"warning: --tokenizer {tok_path}: {differs}", file=sys.stderr)
        changed = args.tokenizer is None and unverified_tokenizer_warning(ckpt, data_dir)
        if changed:
            print(changed, file=sys.stderr)
        try:  # prepare_data.py's reading: the end-of-text token from tokenizer_config.json beside it
            spec = TokenizerSpec.load(str(tok_path))
        except DataError as e:
            raise FileNotFoundError(str(e).removeprefix("--tokenizer ")) from None
        tok, eos = as_document_encoder(spec.tokenizer), spec.eos_id
        if spec.vocab_size > model.config.vocab_size:
            raise FileNotFoundError(f"{tok_path}: {spec.vocab_size} token ids, but the model has "
                                    f"{model.config.vocab_size} rows: not the tokenizer it was trained "
                                    "with (pass --tokenizer)")
        # as prepare_data.py encodes a document (no BOS or other template tokens; a literal
        # "<|endoftext|>" is text, as it was in every training document)
        ids = tok.encode(args.prompt, add_special_tokens=False).ids
        if args.prompt and not ids:
            raise FileNotFoundError(f"--prompt: the tokenizer {tok_path} encodes none of it (not a byte-level one)")
    except (CheckpointError, ConfigError, FileNotFoundError) as e:
        print(f"sample.py: error: {e}", file=sys.stderr)
        return 2
    if ids and tok.decode(ids, skip_special_tokens=False) != args.prompt:
        print(f"warning: the tokenizer {tok_path} does not encode the prompt exactly: the model sees "
              f"{tok.decode(ids, skip_special_tokens=False)!r}", file=sys.stderr)
    if len(ids) > model.config.max_seq_len:
        print(f"note: the prompt is {len(ids)} tokens; the model sees its last {model.config.max_seq_len} "
              "(model.max_seq_len)", file=sys.stderr)
    trained = (ckpt.get("config") or {}).get("data", {}).get("seq_len")
    if isinstance(trained, int) and trained < min(len(ids) + args.max_new_tokens, model.config.max_seq_len):
        print(f"note: the run trained on {trained}-token windows (data.seq_len); positions past them "
              "were never trained", file=sys.stderr)
    start = ids or [eos]  # an empty prompt starts where every document does, after an end of text
    idx = torch.tensor([start] * args.num_samples, dtype=torch.long, device=args.device)
    stop = None if args.ignore_eos else eos
    out = model.generate(idx, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k or None,
                         vocab_limit=spec.vocab_size, stop_id=stop,
                         generator=torch.Generator(device=idx.device).manual_seed(args.seed))
    if sys.stdout.errors == "strict":  # a console that cannot show a character (an ASCII one, a cp1252
        sys.stdout.reconfigure(errors="backslashreplace")  # redirect) writes its escape, not a traceback
    try:
        for i, row in enumerate(out.tolist()):
            new_ids = row[len(start):]
            if stop in new_ids:
                new_ids = new_ids[:new_ids.index(stop) + 1]
            print(f"----- sample {i + 1} -----")
            print(tok.decode(ids + new_ids, skip_special_tokens=False), flush=True)
    except BrokenPipeError:  # `sample.py ... | head`: the reader is gone, which is not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so that the exit's flush is quiet
    return 0


if __name__ == "__main__":
    sys.exit(main())
