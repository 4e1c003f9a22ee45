"""Nash-MHC against its baseline: training-step time on the three CPU backends, compile warm-up,
XLA graph size per layer, and peak memory.

    .venv/bin/python bench/model.py                                   # issue 13's shape, every backend
    .venv/bin/python bench/model.py --d-model 768 --n-heads 12 --n-kv-heads 12   # the small_gpu width
    .venv/bin/python bench/model.py --backends eager,compile --variants baseline,nash-mhc --profile   # + where the time goes
    .venv/bin/python bench/model.py --hlo-only --variants baseline,nash-mhc   # HLO lines per layer, no timing
    .venv/bin/python bench/model.py --backends xla --model-root /tmp/before --variants baseline,nash-mhc,root:nash-mhc
                                        # before/after: /tmp/before's model (git worktree add /tmp/before REV) side by side
    .venv/bin/python bench/model.py --loss-steps 200 --loss-compare mhc_lite=false,mhc_lite=true   # the loss

Variants (same width and depth; max_seq_len = --seq):
  baseline           mhc_streams 1, nash_scales 1, no window: the plain pre-norm transformer
  nash-mhc           4 mHC streams (the model's default H_res: mHC-lite), 3 scales (compression 4), window --window
  mhc-only           4 streams, 1 scale, no window
  nash-only          1 stream, 3 scales, window --window
  baseline-window    mhc_streams 1, nash_scales 1, window --window (not run unless asked for)
  nash-mhc-sinkhorn  nash-mhc with mhc_lite false: H_res by --sinkhorn-iters Sinkhorn-Knopp iterations
  mhc-sinkhorn-only  mhc-only with mhc_lite false
  NAME+field=value   any of these with model settings changed, joined by + as in --loss-compare
                     (nash-only+aggregation=mean: the scales without the Nash game)

The step is forward + backward + AdamW (no clipping), fp32, batch --batch x seq --seq, on:
  eager    PyTorch eager on the CPU with --threads intra-op threads, torch's fused AdamW (train.py's CPU step)
  compile  train.py's training.compile (which train.py applies on CUDA only), run on the CPU here:
           each block's forward torch.compile'd (fullgraph, inductor, CPU; every block reuses the
           first's graph), the rest eager, fused AdamW; a fresh inductor cache, so the warm-up is a
           real compilation
  xla      PJRT CPU as train_xla.py runs it: training.xla_backend.XLABackend places the model, the
           AdamW of the backend (torch_xla's fused update per parameter), one XLA graph per step
           (torch_xla.sync()); a step ends when its loss reaches the host
Every backend runs in its own process. In it, every variant first takes one step alone (its
"warm-up": compilation included, after a tiny model has been compiled once so that one-time costs
of the compiler land on none of them), then all take turns, one step each per round (every other
round in reverse), so a change in the machine's load hits them alike: the median over --repeats
rounds after --warmup rounds, as wall time and as the process's CPU time. "x baseline" divides by
the baseline measured in the same process; "rounds" gives the least and the most of the variant's
step over the baseline's in the same round: how far the machine moved the ratio during the run.
The component split: mhc-only and nash-only against the baseline. Warm-ups in one process are not
independent: a kernel whose source an earlier variant already compiled is not compiled again
(inductor's in-process code cache), so every variant after the first would warm up faster than
alone. The compile backend therefore measures each variant's warm-up again in a worker of its
own (fresh cache, after the tiny model): "warm-up" is that figure. Each round also times each
variant's first step in a fresh process and an empty cache without the tiny model: a first
launch's first step, the compiler's one-time set-up included in both (~9 s on 2 cores here; most
of it, not in inductor's on-disk cache, every later launch pays again); the report gives it beside
the warm-up.

torch.compile's warm-up by phase (--compile-split, instead of the timing): each variant alone in
a fresh process and inductor cache with TORCHINDUCTOR_COMPILE_THREADS=1, so every C++ compiler call
(one per group of generated kernels between two extern calls, a GEMM or an attention call:
inductor's CPU code flushes a group there) runs in the process and is timed; the rest by Dynamo's
phase timers (torch._dynamo.utils.compilation_time_metrics: tracing, AOT joint graph, partition,
lowering, scheduler, code generation). Serial, so longer than the two-thread warm-up of the timing run.

Where the step's time goes (--profile, after the timing): each variant's step on the eager and
compile backends, in a process per backend (compile: a fresh cache), under torch.profiler: the
self CPU time of its ops per step by kind (bench/gpu.py's kernel kinds: attention, matmul,
inductor's generated kernels, each recorded alone, other), the time outside any op, and the top ops.
The profiler's own allocations move the heap under a profiled step: its memory-bound ops (mHC's
4-stream element-wise work) took several times their unprofiled time in some steps (the read's
outer product 1.8-2.9 ms a call against 0.42 ms, bench/RESULTS.md 2026-11-29), so the profile says
which ops run and how often, not how the step's time divides.

HLO lines per layer (--hlo, --hlo-only): bench/xla.py's ``compile`` (the training
step's model graph, forward + backward, as the XLA backend builds it, unrolled) in a fresh process
at 1 and at 2 layers; the difference is what one more block adds to the graph XLA compiles.

Memory (eager): each variant again in a fresh process that runs one warm-up step (forward and
backward), resets the kernel's resident-set high-water mark (/proc/self/clear_refs) and runs one
more: "peak RSS" is the high-water mark during that step (it includes the ~0.5 GiB of the torch
import and the model), "step RSS" how far the step raised it above the resident set just before it.
The memory worker never tunes glibc's heap, whatever --cpu-malloc says, and runs with a fixed mmap
threshold of 64 KiB (the resident set follows the live tensors); the eager and compile backends
time the step with train.py's training.cpu_malloc (--cpu-malloc, default: train.py's, tuned), the
xla backend as train_xla.py runs, on glibc's defaults.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

VARIANTS = {
    "baseline": dict(mhc_streams=1, nash_scales=1, nash_window=0),
    "nash-mhc": dict(),
    "mhc-only": dict(nash_scales=1, nash_window=0),
    "nash-only": dict(mhc_streams=1),
    "baseline-window": dict(mhc_streams=1, nash_scales=1),
    "nash-mhc-sinkhorn": dict(mhc_lite=False),
    "mhc-sinkhorn-only": dict(nash_scales=1, nash_window=0, mhc_lite=False),
}
DEFAULT_VARIANTS = ("baseline", "nash-mhc", "mhc-only", "nash-only", "nash-mhc-sinkhorn")
BACKENDS = ("eager", "compile", "xla")
TARGETS = {"eager": 1.4, "compile": 1.25, "xla": 1.3}   # issue 13, nash-mhc / baseline at its shape
CPU_MALLOC = "tuned"   # train.py's training.cpu_malloc default (a test keeps them equal; no torch import here)


def model_module(args, variant: str):
    """(model module, variant) for a variant name: ``root:NAME`` is NAME built by --model-root's
    model.py (another checkout, loaded as a second module), timed in the same process as this
    checkout's variants: before/after ratios measured side by side."""
    if not variant.startswith("root:"):
        import model
        return model, variant
    if not getattr(args, "model_root", None):
        raise ValueError(f"variant {variant!r} needs --model-root")
    name = "model_at_root"
    if name not in sys.modules:
        import importlib.util
        path = Path(args.model_root) / "model.py"
        if not path.is_file():
            raise ValueError(f"--model-root {args.model_root}: no model.py there")
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name], variant[len("root:"):]


def build_model(mcfg):
    """The NashMHC of the module that ``mcfg``'s class comes from (this checkout's or --model-root's)."""
    return sys.modules[type(mcfg).__module__].NashMHC(mcfg)


def split_variant(variant: str, module=None) -> tuple[str, dict]:
    """``NAME+field=value[+field=value]`` -> (NAME, the settings); a ValueError names a bad one."""
    name, *settings = variant.split("+")
    if name not in VARIANTS:
        raise ValueError(f"--variants: unknown {name!r}; choose from {', '.join(VARIANTS)}")
    return name, (parse_setting("+".join(settings), "--variants", module) if settings else {})


def make_config(args, variant: str, **over):
    module, variant = model_module(args, variant)
    variant, settings = split_variant(variant, module)
    ModelConfig = module.ModelConfig
    base = getattr(args, "base_model", None) or dict(
        vocab_size=args.vocab, d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads,
        n_kv_heads=args.n_kv_heads, max_seq_len=args.seq, mhc_streams=4, nash_scales=3, nash_compression=4,
        nash_window=getattr(args, "window", 64), nash_iters=3, sinkhorn_iters=args.sinkhorn_iters)
    extra = dict(stream_dtype=args.stream_dtype) if getattr(args, "stream_dtype", None) else {}
    return ModelConfig(**{**base, **extra, **VARIANTS[variant], **settings, **over})


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


def interleaved(steps: dict, warmup: int, repeats: int, sync=None) -> dict:
    """Call every step once per round, in turn (every other round in reverse order, so that
    neither going first nor following a given step favours one); median wall and process-CPU
    seconds after ``warmup``. ``sync`` (e.g. torch.cuda.synchronize) brackets every call."""
    wall = {k: [] for k in steps}
    cpu = {k: [] for k in steps}
    order = list(steps.items())
    for r in range(warmup + repeats):
        for k, fn in (order if r % 2 == 0 else order[::-1]):
            if sync:
                sync()
            w0, c0 = time.perf_counter(), time.process_time()
            fn()
            if sync:
                sync()
            if r >= warmup:
                wall[k].append(time.perf_counter() - w0)
                cpu[k].append(time.process_time() - c0)
    return {k: {"wall_s": statistics.median(wall[k]), "cpu_s": statistics.median(cpu[k]), "wall_all": wall[k]}
            for k in steps}


def fwd_bwd(model, idx, tgt):
    model(idx, tgt).loss.backward()
    model.zero_grad(set_to_none=True)


def time_variants(args) -> dict:
    """Eager forward+backward (no optimiser) of ``args.variants``, interleaved (bench/run.py's speed section)."""
    import torch

    torch.manual_seed(0)
    models = {v: build_model(make_config(args, v)) for v in args.variants}
    idx = torch.randint(0, args.vocab, (args.batch, args.seq))
    tgt = torch.randint(0, args.vocab, (args.batch, args.seq))
    res = interleaved({v: (lambda m=m: fwd_bwd(m, idx, tgt)) for v, m in models.items()}, args.warmup, args.repeats)
    for v, m in models.items():
        res[v]["params"] = m.num_params()
    return res


# ----------------------------------------------------------------------------------------------
# One backend, in its own process.

def torch_step(args, variant: str, compiled: bool):
    """The eager or torch.compile training step of one variant (fused AdamW, as train.py on CPU/CUDA)."""
    import torch
    from training.backend import TorchBackend, compile_regions
    from training.config import TrainingConfig
    from training.optim import build_optimizer

    torch.manual_seed(0)
    model = build_model(make_config(args, variant))
    if compiled:
        compile_regions(model)                   # train.py's training.compile
    # train.py's backend on the CPU, with its training.cpu_malloc (process-wide, as in train.py)
    opt = build_optimizer(model, TrainingConfig(), TorchBackend("cpu", cpu_malloc=args.cpu_malloc).adamw_factory())
    idx = torch.randint(0, args.vocab, (args.batch, args.seq))
    tgt = torch.randint(0, args.vocab, (args.batch, args.seq))

    def step():
        model(idx, tgt).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, model.num_params()


def bare_data_dir() -> str:
    """A data directory with an empty meta.json: the XLA backend checks at start that every host has
    the same data (a fingerprint of meta.json); these measurements read no data."""
    path = tempfile.mkdtemp(prefix="bench-model-data-")
    Path(path, "meta.json").write_text("{}")
    return path


class XLAStepBuilder:
    """The train_xla.py training step of a variant on PJRT CPU (torch_xla through the XLA backend)."""

    def __init__(self):
        from training.config import Config
        from training.xla_backend import XLABackend

        self.cfg = Config()
        self.cfg.xla.compile_cache = None
        self.cfg.data.dir = bare_data_dir()
        self.backend = XLABackend(self.cfg)

    def build(self, mcfg):
        import torch
        from training.optim import build_optimizer

        torch.manual_seed(0)
        self.cfg.model = mcfg
        model = self.backend.prepare_model(build_model(mcfg), self.cfg)
        opt = build_optimizer(model, self.cfg.training, self.backend.adamw_factory())
        opt.init_state()
        self.backend.sync()
        dev = self.backend.device
        idx = torch.randint(0, mcfg.vocab_size, (4, mcfg.max_seq_len)).to(dev)
        tgt = torch.randint(0, mcfg.vocab_size, (4, mcfg.max_seq_len)).to(dev)
        return model, opt, idx, tgt

    def step(self, args, variant: str):
        import torch

        mcfg = make_config(args, variant)
        model, opt, _, _ = self.build(mcfg)
        dev = self.backend.device
        idx = torch.randint(0, args.vocab, (args.batch, args.seq)).to(dev)
        tgt = torch.randint(0, args.vocab, (args.batch, args.seq)).to(dev)

        def step():
            loss = model(idx, tgt).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            self.backend.sync()
            loss.cpu()  # waits for the step's graph to finish

        return step, model.num_params()


def xla_overrides(args, variant: str, n_layers: int) -> list[str]:
    """``section.key=value`` overrides that give bench/xla.py's ``compile`` this variant's model at
    ``n_layers`` and this batch, unrolled, fp32, one device."""
    import dataclasses

    mcfg = make_config(args, variant, n_layers=n_layers)
    fields = dataclasses.asdict(mcfg)
    if not args.stream_dtype:
        fields.pop("stream_dtype", None)   # the default; a checkout from before the key has no such key
    over = [f"model.{k}={json.dumps(v)}" for k, v in fields.items()]
    return over + [f"data.dir={args.data_dir}", f"data.seq_len={args.seq}", f"training.batch_size={args.batch}", "training.precision=fp32",
                   "xla.mode=ddp", "xla.scan_layers=false", "xla.compile_cache="]


def hlo_per_layer(args) -> dict:
    """HLO lines of the training step's model graph (forward + backward, bench/xla.py ``compile``,
    each in a fresh process) at 1 and 2 layers; per layer = the difference. ``--hlo-root`` also
    runs the bench/xla.py of another checkout (e.g. ``git worktree add /tmp/before main``) with
    the same overrides, side by side, for a before/after comparison."""
    roots = {"": ROOT}
    if args.hlo_root:
        roots["before"] = Path(args.hlo_root).resolve()
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "1",
           "TF_CPP_MIN_LOG_LEVEL": "3"}
    out = {}
    args.data_dir = bare_data_dir()
    for tag, root in roots.items():
        for v in args.variants:
            lines = {}
            for n in (1, 2):
                cmd = [sys.executable, str(root / "bench" / "xla.py"), "compile", str(root / "configs" / "demo.yaml"),
                       *xla_overrides(args, v, n)]
                r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=root)
                res = [s for s in r.stdout.splitlines() if s.startswith("RESULT ")]
                if r.returncode != 0 or not res:
                    tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
                    raise RuntimeError(f"bench/xla.py compile ({root}, {v}, {n} layers) failed: {tail}")
                lines[n] = json.loads(res[-1][len("RESULT "):])
            name = f"{v} ({tag})" if tag else v
            out[name] = {"one_layer": lines[1]["hlo_lines"], "two_layers": lines[2]["hlo_lines"],
                         "per_layer": lines[2]["hlo_lines"] - lines[1]["hlo_lines"],
                         "compile_s": [lines[1]["compile_s"], lines[2]["compile_s"]]}
    return out


def backend_worker(args) -> dict:
    """Warm-up, interleaved timing (and, on xla, HLO lines per layer) of every variant on one backend."""
    import torch

    torch.set_num_threads(args.threads)
    out: dict = {"backend": args.worker, "threads": args.threads}
    builder = XLAStepBuilder() if args.worker == "xla" else None
    if args.worker == "compile":
        many_compiled_variants()

    def make(variant, a=args):
        if builder is not None:
            return builder.step(a, variant)
        return torch_step(a, variant, compiled=args.worker == "compile")

    # A tiny model first: the compilers' one-time costs (imports, C++ toolchain checks) land here;
    # --cold leaves them in the variant's first step, as a launch's first step has them.
    if not args.cold:
        # (a vocabulary no one measures: a requested shape the same as this one would find the
        # baseline compiled already, its warm-up 0)
        tiny = argparse.Namespace(**{**vars(args), "d_model": 32, "n_heads": 2, "n_kv_heads": 2, "n_layers": 1,
                                     "batch": 1, "seq": 64, "vocab": 67, "window": 16})
        make("baseline", tiny)[0]()
    gcc = gcc_timer() if args.compile_split else None
    steps, results = {}, {}
    for v in args.variants:
        step, params = make(v)
        if gcc is not None:
            gcc.clear()
        t0 = time.perf_counter()
        step()
        results[v] = {"params": params, "warmup_s": time.perf_counter() - t0}
        if gcc is not None:
            results[v]["split"] = gcc.split()
        steps[v] = step
    if not args.warmup_only:
        for v, r in interleaved(steps, args.warmup, args.repeats).items():
            results[v].update(r)
    out["results"] = results
    return out


# torch.compile's warm-up by phase (--compile-split): Dynamo's own timers, and every C++ compiler
# call timed (inductor's one per kernel, in this process when compile_threads is 1)
PHASES = {"dynamo": "bytecode_tracing", "aot joint graph": "aot_trace_joint_graph",
          "partition": "min_cut_rematerialization_partition", "lowering": "GraphLowering.run",
          "scheduler": "Scheduler.__init__", "codegen": "Scheduler.codegen"}


class gcc_timer:
    """Times inductor's C++ compiler calls (``cpp_builder._run_compile_cmd``), and reads Dynamo's
    phase timers (``torch._dynamo.utils.compilation_time_metrics``); ``clear`` starts afresh."""

    def __init__(self):
        import torch._inductor.cpp_builder as cb

        self.calls: list[float] = []
        run = cb._run_compile_cmd

        def timed(cmd, cwd):
            t0 = time.perf_counter()
            run(cmd, cwd)
            self.calls.append(time.perf_counter() - t0)

        cb._run_compile_cmd = timed

    def clear(self) -> None:
        import torch._dynamo.utils as du

        self.calls.clear()
        du.compilation_time_metrics.clear()

    def split(self) -> dict:
        import torch._dynamo.utils as du

        times = {k: sum(v) for k, v in du.compilation_time_metrics.items()}
        return {"gcc_calls": len(self.calls), "gcc_s": sum(self.calls),
                **{name: times.get(key, 0.0) for name, key in PHASES.items()}}


def compile_split(args) -> dict:
    """--compile-split: each variant's torch.compile warm-up alone, in a process of its own with a
    fresh inductor cache and one compile thread (so the C++ compiler's calls are serial and counted)."""
    return {v: run_worker(args, "compile", [f"--variants={v}", "--warmup-only", "--compile-split"],
                          {"TORCHINDUCTOR_COMPILE_THREADS": "1"})["results"][v] for v in args.variants}


def render_split(split: dict) -> str:
    L = ["torch.compile warm-up by phase (each variant alone, fresh cache, 1 compile thread: the C++ "
         "compiler's calls serial):", "",
         "| variant | warm-up | C++ compiler | calls | rest | " + " | ".join(PHASES) + " |",
         "|---|" + "---:|" * (4 + len(PHASES))]
    for v, r in split.items():
        x = r["split"]
        L.append(f"| {v} | {r['warmup_s']:.1f} s | {x['gcc_s']:.1f} s | {x['gcc_calls']} | "
                 f"{r['warmup_s'] - x['gcc_s']:.1f} s | " + " | ".join(f"{x[k]:.2f}" for k in PHASES) + " |")
    return "\n".join(L)


def run_backend(args, backend: str) -> dict:
    """One backend's worker. For torch.compile with several variants, each variant's warm-up is
    then measured again alone, in a worker of its own with a fresh cache (in the shared worker the
    later variants reuse kernels that earlier ones compiled: ``warmup_shared_s`` keeps that
    figure): ``--warmup-rounds`` rounds, the variants in turn in each, and the median of each
    variant's (``warmup_alone_s`` lists them). Each round also times each variant's first step in
    a fresh process and an empty cache without the tiny model (``first_step_s``,
    ``first_step_alone_s``): what a first launch of train.py waits for, the compiler's one-time
    set-up included, which the warm-up leaves out."""
    out = run_worker(args, backend)
    if backend == "compile" and len(args.variants) > 1:
        alone: dict[str, list[float]] = {v: [] for v in out["results"]}
        cold: dict[str, list[float]] = {v: [] for v in out["results"]}
        for _ in range(args.warmup_rounds):
            for v in alone:
                alone[v].append(run_worker(args, backend, [f"--variants={v}", "--warmup-only"])["results"][v]["warmup_s"])
                cold[v].append(run_worker(args, backend, [f"--variants={v}", "--warmup-only", "--cold"])
                               ["results"][v]["warmup_s"])
        for v, r in out["results"].items():
            r["warmup_shared_s"], r["warmup_s"], r["warmup_alone_s"] = r["warmup_s"], statistics.median(alone[v]), alone[v]
            r["first_step_s"], r["first_step_alone_s"] = statistics.median(cold[v]), cold[v]
    return out


def run_worker(args, backend: str, extra=(), env_extra=None) -> dict:
    cmd = [sys.executable, __file__, "--worker", backend, *forwarded(args), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), **(env_extra or {})}
    cache = None
    if backend == "compile":
        cache = tempfile.mkdtemp(prefix="bench-inductor-")
        env["TORCHINDUCTOR_CACHE_DIR"] = cache
    if backend == "xla":
        env.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES="1", TF_CPP_MIN_LOG_LEVEL="3")
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    finally:
        if cache:
            shutil.rmtree(cache, ignore_errors=True)
    lines = [s for s in r.stdout.splitlines() if s.startswith("RESULT ")]
    if r.returncode != 0 or not lines:
        tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"the {backend} worker failed: {tail}")
    return json.loads(lines[-1][len("RESULT "):])


# ----------------------------------------------------------------------------------------------
# Model settings (model.stream_dtype, mhc_lite, sinkhorn_iters): their effect on the loss, measured.

def stdlib_bytes_tokens(limit: int = 4_000_000):
    """Byte-level tokens (vocab 256) of the Python standard library's source: the demo's corpus
    without a trained tokenizer, so the comparison needs no prepared data."""
    import torch

    lib, buf = Path(os.__file__).parent, bytearray()
    for path in sorted(lib.glob("*.py")):
        buf += path.read_bytes()
        if len(buf) >= limit:
            break
    return torch.frombuffer(buf[:limit], dtype=torch.uint8).long()


def parse_loss_settings(text: str) -> dict[str, dict]:
    """``--loss-compare``: comma-separated settings, each one or more ``field=value`` of the model
    joined by ``+`` (``mhc_lite=true``, ``sinkhorn_iters=5+stream_dtype=bf16``); values as YAML reads
    them. A ValueError names a bad entry."""
    out = {entry: parse_setting(entry, "--loss-compare")
           for entry in (e.strip() for e in text.split(",")) if entry}
    if len(out) < 1:
        raise ValueError("--loss-compare: no settings")
    return out


def parse_setting(entry: str, option: str, module=None) -> dict:
    """One setting, ``field=value[+field=value]`` of the model's config (``module``'s, default this
    checkout's model.py), values as YAML reads them; a ValueError names a bad one."""
    import yaml

    if module is None:
        import model as module
    fields = {f.name for f in dataclasses.fields(module.ModelConfig)}
    over = {}
    for kv in entry.split("+"):
        key, sep, value = kv.partition("=")
        if not sep or key.strip() not in fields:
            raise ValueError(f"{option}: {kv!r} is not field=value with a model field")
        over[key.strip()] = yaml.safe_load(value)
    return over


def loss_model_config(over: dict):
    """The demo-shaped model of ``loss_comparison`` with the setting ``over``."""
    from model import ModelConfig

    return ModelConfig(**{**dict(vocab_size=256, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2,
                                 max_seq_len=256, nash_window=64), **over})


def loss_comparison(args) -> dict:
    """The demo model's shape (d_model 128, 4 layers, 4 heads / 2 kv, window 64, seq 256, batch 8,
    AdamW at 3e-3 with the demo's warm-up and cosine schedule) trained for ``--loss-steps`` steps in
    eager PyTorch once per ``--loss-compare`` setting: same seed, same batches, and the same initial
    weights wherever the settings do not change the parameters' shapes. Training loss (mean of the
    last 10 steps) and the loss on 16 held-out windows."""
    import torch
    from model import NashMHC
    from training.backend import TorchBackend
    from training.config import TrainingConfig
    from training.optim import build_optimizer, lr_at, set_lr

    torch.set_num_threads(args.threads)
    tokens = stdlib_bytes_tokens()
    seq, batch, steps = 256, 8, args.loss_steps
    split = int(len(tokens) * 0.9)
    val = torch.stack([tokens[split + i * (seq + 1): split + (i + 1) * (seq + 1)] for i in range(16)])
    out = {}
    for name, over in parse_loss_settings(args.loss_compare).items():
        torch.manual_seed(args.loss_seed)
        model = NashMHC(loss_model_config(over))
        tcfg = TrainingConfig(learning_rate=3e-3, weight_decay=0.1)
        opt = build_optimizer(model, tcfg, TorchBackend("cpu").adamw_factory())
        g = torch.Generator().manual_seed(args.loss_seed + 1)
        losses, t0 = [], time.perf_counter()
        for step in range(steps):
            set_lr(opt, lr_at(step, steps, 1.0, 30, 0.1))
            starts = torch.randint(0, split - seq - 1, (batch,), generator=g)
            w = torch.stack([tokens[i: i + seq + 1] for i in starts.tolist()])
            loss = model(w[:, :-1], w[:, 1:]).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        model.eval()
        with torch.no_grad():
            val_loss = model(val[:, :-1], val[:, 1:]).loss.item()
        out[name] = {"train_loss_last10": statistics.mean(losses[-10:]), "val_loss": val_loss,
                     "first_loss": losses[0], "seconds": time.perf_counter() - t0, "losses": losses}
    return {"steps": steps, "seq": seq, "batch": batch, "seed": args.loss_seed, "results": out}


# ----------------------------------------------------------------------------------------------
# Memory (eager), in fresh processes.

def memory_worker(args) -> None:
    """In a fresh process: build one variant, run a warm-up step (lazy initialisations), reset
    the resident-set high-water mark, run one step, print the RSS figures in bytes."""
    import torch

    torch.manual_seed(0)
    model = build_model(make_config(args, args.memory_worker))
    idx = torch.randint(0, args.vocab, (args.batch, args.seq))
    tgt = torch.randint(0, args.vocab, (args.batch, args.seq))
    fwd_bwd(model, idx, tgt)
    exact = reset_peak_rss()
    before = _status_kib("VmRSS")
    fwd_bwd(model, idx, tgt)
    peak = _status_kib("VmHWM") if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"peak_rss": peak * 1024, "step_rss": max(0, peak - before) * 1024, "hwm_reset": exact}))


def measure_memory(args, variant: str) -> dict:
    # (the worker builds no TorchBackend, so --cpu-malloc does not reach its heap: kept, the warm-up
    # step's memory would stay in it and the measured step's figure would read ~0)
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
    out = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in
           ("batch", "seq", "vocab", "d_model", "n_layers", "n_heads", "n_kv_heads", "window", "sinkhorn_iters",
            "threads", "warmup", "repeats")]
    out.append("--variants=" + ",".join(args.variants))
    if args.stream_dtype:
        out.append(f"--stream-dtype={args.stream_dtype}")
    out.append(f"--cpu-malloc={args.cpu_malloc}")
    if args.model_root:
        out.append(f"--model-root={args.model_root}")
    return out


def many_compiled_variants() -> None:
    """Let one process compile the blocks' one code object for many models (each variant, each
    sequence length is one more compiled entry of it): past Dynamo's default limit of 8 graphs,
    fullgraph's recompilation error ended the 8th model's compile instead of compiling it."""
    import torch._dynamo

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)


def profile_worker(args) -> dict:
    """--profile, one torch backend (eager or compile) in this process: every variant's step after
    1 + --warmup untimed ones, then --repeats rounds in which each variant takes one step under
    torch.profiler (in turn, as ``interleaved`` orders them); ``summarise_profile`` of them. The
    compiled graphs' kernels are recorded one by one (inductor's ``cpp.enable_kernel_profile``)."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    torch.set_num_threads(args.threads)
    compiled = args.worker == "compile"
    if compiled:
        import torch._inductor.config

        torch._inductor.config.cpp.enable_kernel_profile = True
        many_compiled_variants()
    steps = {}
    for v in args.variants:
        steps[v] = torch_step(args, v, compiled)[0]
        for _ in range(1 + args.warmup):
            steps[v]()
    rounds: dict = {v: [] for v in steps}

    def profiled(v):
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            steps[v]()
            wall = time.perf_counter() - t0
        rounds[v].append((1e3 * wall, {e.key: (e.self_cpu_time_total / 1e3, e.count)
                                       for e in prof.key_averages() if e.self_cpu_time_total > 0}))

    interleaved({v: (lambda v=v: profiled(v)) for v in steps}, 0, args.repeats)
    return {v: summarise_profile(rs, args.profile_rows) for v, rs in rounds.items()}


def summarise_profile(rounds: list, rows: int) -> dict:
    """One variant's profiled rounds, each ``(wall ms, {op: (self ms, calls)})``: the medians over
    the rounds of the step's wall time, of the self time of its ops by kind (bench/gpu.py's
    ``kernel_kind``), of the time outside any op, and of each op's time (an op missing from a round
    counts 0 there); the ``rows`` slowest ops, with their most calls in a round."""
    from bench.gpu import KIND_NAMES, kernel_kind, time_by_kind

    kinds = [time_by_kind((op, ms) for op, (ms, _) in ops.items()) for _, ops in rounds]
    names = set().union(*(ops for _, ops in rounds))
    op_ms = {op: statistics.median(ops.get(op, (0.0, 0))[0] for _, ops in rounds) for op in names}
    top = sorted(names, key=lambda op: (-op_ms[op], op))[:rows]
    return {"step_ms": statistics.median(wall for wall, _ in rounds),
            "by_kind_ms": {k: statistics.median(by.get(k, 0.0) for by in kinds) for k in KIND_NAMES},
            "outside_ops_ms": statistics.median(wall - sum(ms for ms, _ in ops.values()) for wall, ops in rounds),
            "top": [{"op": op, "kind": kernel_kind(op), "ms": op_ms[op],
                     "calls": max(ops.get(op, (0.0, 0))[1] for _, ops in rounds)} for op in top]}


def profiles(args, backends: list[str]) -> dict:
    """--profile: ``profile_worker`` for each of --backends' torch backends, in a process of its
    own (the compile one with a fresh inductor cache, as the timing's)."""
    return {b: run_worker(args, b, ["--profile-here", f"--profile-rows={args.profile_rows}"])
            for b in backends if b in ("eager", "compile")}


def render_profiles(args, prof: dict) -> str:
    from bench.gpu import KIND_NAMES

    L = [f"torch.profiler, ms per step by kind of op (self CPU time), each the median of {args.repeats} interleaved "
         f"profiled steps after {1 + args.warmup} untimed. Profiled steps are timed apart from the table above and "
         "their ratios differ from its. The profiler slows memory-bound ops (element-wise work over large tensors) "
         "several-fold in some steps, so these kinds say which ops run, not how the step's time divides. The "
         "medians of the kinds need not add up to the step's.", "",
         "| backend | variant | step | x baseline | " + " | ".join(KIND_NAMES) + " | outside ops |",
         "|---|---|" + "---:|" * (len(KIND_NAMES) + 3)]
    for b, res in prof.items():
        ref = res.get("baseline", {}).get("step_ms")
        for v, r in res.items():
            x = f"{r['step_ms'] / ref:.2f}" if ref else "-"
            cells = [f"{r['by_kind_ms'][k]:.1f}" for k in KIND_NAMES]
            L.append(f"| {b} | {v} | {r['step_ms']:.1f} | {x} | " + " | ".join(cells) + f" | {r['outside_ops_ms']:.1f} |")
    for b, res in prof.items():
        for v, r in res.items():
            L += ["", f"{b}, {v}: top ops by self CPU time", "| ms/step | calls/step | kind | op |", "|---:|---:|---|---|"]
            L += [f"| {t['ms']:.2f} | {t['calls']} | {t['kind']} | {t['op'][:100]} |" for t in r["top"]]
    return "\n".join(L)


def write_json(path: str, data: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------------------------
# The report.

def round_band(x: dict, ref: dict | None) -> str | None:
    """``"LO-HI"``: the least and the most of ``x``'s step over ``ref``'s in the same round of
    ``interleaved`` (None without both rounds' times). Each round's two steps ran next to each other,
    so the spread is the machine's, which the ratio of the medians does not show."""
    rounds, ref_rounds = x.get("wall_all"), (ref or {}).get("wall_all")
    if not rounds or not ref_rounds or len(rounds) != len(ref_rounds):
        return None
    ratios = [a / b for a, b in zip(rounds, ref_rounds)]
    return f"{min(ratios):.2f}-{max(ratios):.2f}"


def render(args, report: dict) -> str:
    L = [f"Nash-MHC vs baseline, training step (forward+backward+AdamW, fp32): batch {args.batch} x seq "
         f"{args.seq}, d_model {args.d_model}, {args.n_layers} layers, {args.n_heads} heads ({args.n_kv_heads} kv), "
         f"vocab {args.vocab}, window {args.window}, sinkhorn_iters {args.sinkhorn_iters}"
         + (f", stream_dtype {args.stream_dtype}" if args.stream_dtype else "")
         + f"; {args.threads} thread(s)"
         + ("" if args.hlo_only else f"; median of {args.repeats} interleaved rounds after {args.warmup}; "
            f"cpu_malloc {args.cpu_malloc} (eager, compile)")
         + f"; load average {report['load'][0]:.2f} at the start, {report['load'][1]:.2f} at the end"]
    timed = {b: r for b, r in report["backends"].items() if "results" in r}
    if timed:
        w = max([19] + [len(v) + 2 for r in timed.values() for v in r["results"]])   # NAME+field=value ones
        L += ["", f"{'backend':<9}{'variant':<{w}}{'params':>11}{'step wall':>12}{'step CPU':>11}{'x baseline':>13}"
                  f"{'rounds':>12}{'warm-up':>10}{'x baseline':>12}"]
        for b, r in timed.items():
            res, ref = r["results"], r["results"].get("baseline")
            for v, x in res.items():
                ratio = f"{x['wall_s'] / ref['wall_s']:.2f} / {x['cpu_s'] / ref['cpu_s']:.2f}" if ref else "-"
                wratio = f"{x['warmup_s'] / ref['warmup_s']:.2f}" if ref else "-"
                mem = ""
                if "peak_rss" in x:
                    mem = f"{x['peak_rss'] / 2**20:>9.0f}MiB peak{x['step_rss'] / 2**20:>7.0f}MiB step"
                band = round_band(x, ref) if v != "baseline" else None
                L.append(f"{b:<9}{v:<{w}}{x['params']:>11,}{x['wall_s'] * 1e3:>10.1f}ms{x['cpu_s'] * 1e3:>9.1f}ms"
                         f"{ratio:>13}{band or '-':>12}{x['warmup_s']:>9.1f}s{wratio:>12}{mem}")
        alone = ("; compile: the median of each variant's alone, in a process of its own, "
                 f"{args.warmup_rounds} round(s) of the variants in turn" if "compile" in timed else "")
        L.append(f"x baseline: wall / CPU time (warm-up: wall{alone}) over 'baseline' in the same process; "
                 "rounds: the least and the most of the variant's step over the baseline's in the same round "
                 "(how far the machine moved the ratio in this run); "
                 "targets for nash-mhc: " + ", ".join(f"{b} <= {t}" for b, t in TARGETS.items()))
        first = {v: x["first_step_s"] for v, x in timed.get("compile", {}).get("results", {}).items()
                 if "first_step_s" in x}
        if "baseline" in first:
            L.append("compile, a first launch's first step (a fresh process, an empty cache, no tiny model before "
                     "it: the compiler's one-time set-up included), median of the same rounds: " + ", ".join(
                         f"{v} {t:.1f} s ({t / first['baseline']:.2f}x)" for v, t in first.items()))
        split = [b for b, r in timed.items() if "baseline" in r["results"]]
        if split:
            L += ["", "| backend | baseline | Nash-MHC | ratio | mHC alone | Nash alone | warm-up ratio "
                  "| with Sinkhorn | its warm-up ratio |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
            for b in split:
                res = timed[b]["results"]
                ref = res["baseline"]

                def cell(v, key="wall_s"):
                    if v not in res:
                        return ""
                    band = round_band(res[v], ref) if key == "wall_s" else None
                    return f"{res[v][key] / ref[key]:.2f}x" + (f" ({band})" if band else "")

                nash = f"{res['nash-mhc']['wall_s'] * 1e3:.0f} ms" if "nash-mhc" in res else ""
                L.append(f"| {b} | {ref['wall_s'] * 1e3:.0f} ms | {nash} | {cell('nash-mhc')} | {cell('mhc-only')} | "
                         f"{cell('nash-only')} | {cell('nash-mhc', 'warmup_s')} | {cell('nash-mhc-sinkhorn')} | "
                         f"{cell('nash-mhc-sinkhorn', 'warmup_s')} |")
    hlo = report.get("hlo")
    if hlo:
        L += ["", "HLO lines of the training step's model graph (forward + backward, bench/xla.py compile) on "
              "PJRT CPU; per layer = 2 layers - 1 layer; x baseline = per layer over the baseline's of the same "
              "checkout:", "",
              "| variant | 1 layer | 2 layers | per layer | x baseline |", "|---|---:|---:|---:|---:|"]
        for v, x in hlo.items():
            tag = v[len(v.split(" ")[0]):]
            ref = hlo.get("baseline" + tag)
            ratio = f"{x['per_layer'] / ref['per_layer']:.2f}x" if ref else "-"
            L.append(f"| {v} | {x['one_layer']:,} | {x['two_layers']:,} | {x['per_layer']:,} | {ratio} |")
    return "\n".join(L)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated, from: " + ", ".join(BACKENDS))
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--n-heads", type=int, default=8)
    p.add_argument("--n-kv-heads", type=int, default=4)
    p.add_argument("--window", type=int, default=128, help="nash_window of nash-mhc and nash-only")
    p.add_argument("--sinkhorn-iters", type=int, default=20)
    p.add_argument("--stream-dtype", choices=["fp32", "bf16"], default=None,
                   help="model.stream_dtype of every variant (default: the model's default)")
    p.add_argument("--repeats", type=int, default=7, help="timed rounds (median)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds after each variant's first step")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (eager, compile)")
    p.add_argument("--warmup-rounds", type=int, default=3,
                   help="torch.compile: rounds of each variant's warm-up alone (fresh process and cache), "
                        "the variants in turn; the median is reported")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help="comma-separated, from: " + ", ".join(VARIANTS) + "; NAME+field=value[+...]: NAME with "
                        "model settings changed; root:NAME: NAME with --model-root's model")
    p.add_argument("--no-memory", action="store_true", help="skip the per-variant memory processes (eager)")
    p.add_argument("--loss-steps", type=int, default=0, metavar="N",
                   help="only compare the --loss-compare settings: N training steps of the demo-shaped model each")
    p.add_argument("--loss-compare", default="stream_dtype=fp32,stream_dtype=bf16", metavar="SETTINGS",
                   help="with --loss-steps: comma-separated model settings, each field=value[+field=value] "
                        "(default: %(default)s; e.g. mhc_lite=false,mhc_lite=true)")
    p.add_argument("--loss-seed", type=int, default=0,
                   help="with --loss-steps: seed of the initial weights (the batches' seed is this + 1)")
    p.add_argument("--hlo", action="store_true", help="also count HLO lines per layer (PJRT CPU)")
    p.add_argument("--hlo-only", action="store_true", help="HLO lines per layer only (no timing)")
    p.add_argument("--hlo-root", metavar="DIR", help="also count HLO lines with DIR's bench/xla.py and model "
                   "(another checkout of the project), side by side: before/after")
    p.add_argument("--model-root", metavar="DIR", help="another checkout of the project: variants named "
                   "root:NAME are built by its model.py and timed in the same processes as this checkout's")
    p.add_argument("--cpu-malloc", choices=("tuned", "default"), default=CPU_MALLOC,
                   help="the eager and compile backends' training.cpu_malloc (default: train.py's, %(default)s): "
                        "tuned, glibc keeps freed memory; default, glibc's own settings")
    p.add_argument("--profile", action="store_true",
                   help="also profile each variant's step on the eager and compile backends: ms per step by kind "
                        "of op (attention, matmul, inductor's kernels, other) and the top ops")
    p.add_argument("--profile-rows", type=int, default=12, help="--profile: top ops listed per variant")
    p.add_argument("--compile-split", action="store_true",
                   help="only torch.compile's warm-up of each variant, split by phase (C++ compiler, Dynamo, "
                        "AOT, lowering, scheduler, code generation)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--worker", choices=BACKENDS, help=argparse.SUPPRESS)
    p.add_argument("--warmup-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--cold", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--memory-worker", help=argparse.SUPPRESS)
    p.add_argument("--profile-here", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not args.variants:
        print(f"error: --variants: empty; choose from {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    bad = [b for b in backends if b not in BACKENDS]
    if bad or not backends:
        print(f"error: --backends: unknown {bad or 'empty'}; choose from {', '.join(BACKENDS)}", file=sys.stderr)
        return 2
    if (args.hlo or args.hlo_only) and any(v.startswith("root:") for v in args.variants):
        print("error: --hlo/--hlo-only count this checkout's variants; --hlo-root counts another's", file=sys.stderr)
        return 2
    if args.hlo_root and not (args.hlo or args.hlo_only):
        print("error: --hlo-root counts HLO lines: give it with --hlo or --hlo-only", file=sys.stderr)
        return 2
    if args.hlo_root:
        missing = [f for f in ("model.py", "bench/xla.py") if not (Path(args.hlo_root) / f).is_file()]
        if missing:
            print(f"error: --hlo-root {args.hlo_root}: no {' or '.join(missing)} there", file=sys.stderr)
            return 2
    given_options = {a.split("=")[0] for a in (argv if argv is not None else sys.argv[1:]) if a.startswith("--")}
    given = {a for a in given_options if a.startswith("--loss-")}
    if given - {"--loss-steps"} and not args.loss_steps:
        print(f"error: {', '.join(sorted(given))} apply with --loss-steps N (the loss comparison)", file=sys.stderr)
        return 2
    if min(args.batch, args.seq, args.repeats, args.threads, args.warmup_rounds) < 1 or \
            min(args.warmup, args.loss_steps) < 0:
        print("error: --batch, --seq, --repeats, --threads and --warmup-rounds must be >= 1, --warmup and "
              "--loss-steps >= 0", file=sys.stderr)
        return 2
    try:
        for v in args.variants:
            make_config(args, v)
        if args.loss_steps:
            for over in parse_loss_settings(args.loss_compare).values():
                loss_model_config(over)
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.profile and not {"eager", "compile"} & set(backends):
        print("error: --profile profiles the eager and compile backends: name one in --backends", file=sys.stderr)
        return 2
    alone = [o for o, on in (("--hlo-only", args.hlo_only), ("--compile-split", args.compile_split),
                             ("--loss-steps", args.loss_steps)) if on]
    if args.profile and alone:
        print(f"error: --profile profiles the timed steps, which {alone[0]} does not run", file=sys.stderr)
        return 2
    if "--profile-rows" in given_options and not (args.profile or args.profile_here):
        print("error: --profile-rows applies with --profile", file=sys.stderr)
        return 2
    if args.profile_rows < 1:
        print(f"error: --profile-rows must be >= 1, got {args.profile_rows}", file=sys.stderr)
        return 2
    if args.memory_worker:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
        import torch

        torch.set_num_threads(args.threads)
        memory_worker(args)
        return 0
    if args.worker:
        print("RESULT " + json.dumps(profile_worker(args) if args.profile_here else backend_worker(args)), flush=True)
        return 0

    load0 = os.getloadavg()[0]
    if args.compile_split:
        split = compile_split(args)
        print(render_split(split) + f"\n\nload average {load0:.2f} -> {os.getloadavg()[0]:.2f}")
        if args.json:
            write_json(args.json, split)
        return 0
    if args.loss_steps:
        res = loss_comparison(args)
        print(f"{res['steps']} training steps of the demo-shaped model (eager, seed {res['seed']}, batch {res['batch']} x seq "
              f"{res['seq']}, byte-level stdlib source); load average {load0:.2f} -> {os.getloadavg()[0]:.2f}\n\n"
              "| model setting | first loss | train loss (last 10) | held-out loss | time |\n|---|---:|---:|---:|---:|")
        for k, r in res["results"].items():
            print(f"| {k} | {r['first_loss']:.4f} | {r['train_loss_last10']:.4f} | {r['val_loss']:.4f} | "
                  f"{r['seconds']:.0f} s |")
        if args.json:
            write_json(args.json, res)
        return 0
    report = {"args": {k: v for k, v in vars(args).items() if k not in ("worker", "memory_worker")}, "backends": {}}
    if args.hlo or args.hlo_only:
        print("  xla HLO lines per layer ...", file=sys.stderr, flush=True)
        report["hlo"] = hlo_per_layer(args)
    for b in ([] if args.hlo_only else backends):
        print(f"  {b} ...", file=sys.stderr, flush=True)
        report["backends"][b] = run_backend(args, b)
        if b == "eager" and not args.no_memory:
            for v in args.variants:
                report["backends"][b]["results"][v].update(measure_memory(args, v))
    report["load"] = [load0, os.getloadavg()[0]]
    print(render(args, report))
    if args.profile:
        print("  profiles ...", file=sys.stderr, flush=True)
        report["profile"] = profiles(args, backends)
        print("\n" + render_profiles(args, report["profile"]))
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
