"""Forward+backward step time and peak memory of Nash-MHC against its baseline, on CPU.

    .venv/bin/python bench/model.py                      # demo size, batch 4 x seq 512
    .venv/bin/python bench/model.py --d-model 512 --n-heads 8 --json out.json --profile

Variants (same width and depth; max_seq_len = --seq):
  baseline         mhc_streams 1, nash_scales 1, no window: the plain pre-norm transformer
  nash-mhc         the demo model: 4 mHC streams, 3 scales (compression 4), window 64
  baseline-window  mhc_streams 1, nash_scales 1 with the demo's window 64
  mhc-only         4 streams, 1 scale, no window
  nash-only        1 stream, 3 scales, window 64

Time: all variants live in one process and take turns, one step each per round, so a change in
the machine's load hits them alike; the median over --repeats rounds after --warmup rounds, as
wall time and as this process's CPU time (steadier on a shared machine). With glibc's default
malloc, freed blocks of a few MiB go back to the kernel and are faulted in again on the next
allocation, which taxes mHC's n-times wider tensors most; --tuned-malloc keeps them (as jemalloc
or tcmalloc would). Memory: each variant again in a fresh process that runs one warm-up step,
resets the kernel's resident-set high-water mark (/proc/self/clear_refs) and runs one more step:
"peak RSS" is the process's high-water mark during that step (it includes the ~0.5 GiB of the
torch import and the model), "step RSS" how far the step raised it above the resident set just
before it: activations, gradients and allocator slack, the memory a step costs.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VARIANTS = {
    "baseline": dict(mhc_streams=1, nash_scales=1, nash_window=0),
    "nash-mhc": dict(),
    "baseline-window": dict(mhc_streams=1, nash_scales=1),
    "mhc-only": dict(nash_scales=1, nash_window=0),
    "nash-only": dict(mhc_streams=1),
}


def tune_glibc_malloc() -> bool:
    """Keep freed memory in glibc's heap (fixed 32 MiB mmap threshold, 1 GiB trim threshold)
    instead of returning it to the kernel and faulting it in again on the next allocation; the
    effect of jemalloc or tcmalloc, which PyTorch's CPU tuning guide recommends."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(libc.mallopt(m_mmap_threshold, 32 << 20)) and bool(libc.mallopt(m_trim_threshold, 1 << 30))


def make_config(args, variant: str):
    from model import ModelConfig

    base = dict(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads,
                n_kv_heads=args.n_kv_heads, max_seq_len=args.seq, mhc_streams=4, nash_scales=3,
                nash_compression=4, nash_window=64, nash_iters=3, sinkhorn_iters=args.sinkhorn_iters)
    return ModelConfig(**{**base, **VARIANTS[variant]})


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak_rss() -> bool:
    """Reset the kernel's resident-set high-water mark (VmHWM; Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def step(model, idx, tgt):
    model(idx, tgt).loss.backward()
    model.zero_grad(set_to_none=True)


def time_variants(args) -> dict:
    import torch
    from model import NashMHC

    torch.manual_seed(0)
    models = {v: NashMHC(make_config(args, v)) for v in args.variants}
    idx = torch.randint(0, args.vocab, (args.batch, args.seq))
    tgt = torch.randint(0, args.vocab, (args.batch, args.seq))
    wall = {v: [] for v in models}
    cpu = {v: [] for v in models}
    for r in range(args.warmup + args.repeats):
        for v, m in models.items():
            w0, c0 = time.perf_counter(), time.process_time()
            step(m, idx, tgt)
            if r >= args.warmup:
                wall[v].append(time.perf_counter() - w0)
                cpu[v].append(time.process_time() - c0)
    return {v: {"params": models[v].num_params(), "wall_s": statistics.median(wall[v]),
                "cpu_s": statistics.median(cpu[v]), "wall_all": wall[v]} for v in models}


def memory_worker(args) -> None:
    """In a fresh process: build one variant, run a warm-up step (lazy initialisations), reset
    the resident-set high-water mark, run one step, print the RSS figures in bytes."""
    import torch
    from model import NashMHC

    torch.manual_seed(0)
    model = NashMHC(make_config(args, args.memory_worker))
    idx = torch.randint(0, args.vocab, (args.batch, args.seq))
    tgt = torch.randint(0, args.vocab, (args.batch, args.seq))
    step(model, idx, tgt)
    exact = reset_peak_rss()
    before = _status_kib("VmRSS")
    step(model, idx, tgt)
    peak = _status_kib("VmHWM") if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"peak_rss": peak * 1024, "step_rss": max(0, peak - before) * 1024, "hwm_reset": exact}))


def measure_memory(args, variant: str) -> dict:
    cmd = [sys.executable, __file__, "--memory-worker", variant] + forwarded(args)
    # A fixed glibc mmap threshold: every allocation above 64 KiB gets its own mapping, returned to
    # the kernel when freed, so the resident set follows the live tensors instead of the heap's
    # high-water mark.
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MALLOC_MMAP_THRESHOLD_": "65536"}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"memory worker for {variant} failed: {r.stderr.strip().splitlines()[-1:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def forwarded(args) -> list[str]:
    return [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in
            ("batch", "seq", "vocab", "d_model", "n_layers", "n_heads", "n_kv_heads", "sinkhorn_iters", "threads")]


def profile(args, variant: str, rows: int = 25) -> str:
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    from model import NashMHC

    torch.manual_seed(0)
    model = NashMHC(make_config(args, variant))
    idx = torch.randint(0, args.vocab, (args.batch, args.seq))
    tgt = torch.randint(0, args.vocab, (args.batch, args.seq))
    step(model, idx, tgt)
    with torch_profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step(model, idx, tgt)
    return prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=rows,
                                                              max_name_column_width=40, max_shapes_column_width=60)


def write_json(path: str, data: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2)
    os.replace(tmp, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--n-kv-heads", type=int, default=2)
    p.add_argument("--sinkhorn-iters", type=int, default=20)
    p.add_argument("--repeats", type=int, default=7, help="timed rounds (median)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, from: " + ", ".join(VARIANTS))
    p.add_argument("--no-memory", action="store_true", help="skip the per-variant memory processes")
    p.add_argument("--tuned-malloc", action="store_true",
                   help="time with glibc malloc keeping freed memory (see tune_glibc_malloc)")
    p.add_argument("--profile", action="store_true", help="also print torch.profiler's top ops for nash-mhc")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--memory-worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad or not args.variants:
        print(f"error: --variants: unknown {bad or 'empty'}; choose from {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    if min(args.batch, args.seq, args.repeats, args.threads) < 1 or args.warmup < 0:
        print("error: --batch, --seq, --repeats and --threads must be >= 1, --warmup >= 0", file=sys.stderr)
        return 2
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch

    torch.set_num_threads(args.threads)
    try:
        make_config(args, "nash-mhc")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.memory_worker:
        memory_worker(args)
        return 0

    if args.tuned_malloc and not tune_glibc_malloc():
        print("error: --tuned-malloc: glibc's mallopt is not available here", file=sys.stderr)
        return 2
    results = time_variants(args)
    if not args.no_memory:
        for v in args.variants:
            results[v].update(measure_memory(args, v))
    ref = results.get("baseline")
    print(f"Nash-MHC forward+backward on CPU: batch {args.batch} x seq {args.seq}, d_model {args.d_model}, "
          f"{args.n_layers} layers, {args.n_heads} heads ({args.n_kv_heads} kv), vocab {args.vocab}, "
          f"{args.threads} thread(s); median of {args.repeats} interleaved rounds after {args.warmup} warm-up; "
          f"{'tuned' if args.tuned_malloc else 'default'} glibc malloc; load average {os.getloadavg()[0]:.1f}")
    header = f"{'variant':<16}{'params':>10}{'step wall':>12}{'step CPU':>11}{'x baseline':>12}"
    if not args.no_memory:
        header += f"{'peak RSS':>12}{'step RSS':>11}"
    print(header)
    for v in args.variants:
        r = results[v]
        ratio = f"{r['wall_s'] / ref['wall_s']:.2f} / {r['cpu_s'] / ref['cpu_s']:.2f}" if ref else "-"
        line = f"{v:<16}{r['params']:>10,}{r['wall_s'] * 1e3:>10.1f}ms{r['cpu_s'] * 1e3:>9.1f}ms{ratio:>12}"
        if not args.no_memory:
            line += f"{r['peak_rss'] / 2**20:>9.0f}MiB{r['step_rss'] / 2**20:>8.0f}MiB"
        print(line)
    if ref:
        print("x baseline: wall / CPU time ratio to 'baseline' (target for nash-mhc: <= 1.5)")
    if args.profile:
        print("\ntorch.profiler, one nash-mhc step, top ops by self CPU time:")
        print(profile(args, "nash-mhc"))
    if args.json:
        write_json(args.json, {"args": {k: v for k, v in vars(args).items() if k != "memory_worker"},
                               "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
