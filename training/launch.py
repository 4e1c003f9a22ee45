"""The launch agreement: what every process of a job checks together before any work.

Both trainers run it once their host-side gloo group exists, before the model is built or
anything compiles (``Backend.agree_at_launch``: ``TorchBackend`` right after ``torchrun``'s
process group, ``XLABackend`` after ``init_gloo("xla://")``). Every process contributes one line
of text to one all-gather (``HostGroup.all_gather_text``), and every process reads the same
verdict from the same gathered lines, so they all refuse with the same one-line ``ConfigError``
(exit 2) or none does:

- a problem any process found at launch (``check_data`` failing on one host: its ``data.dir``
  missing; the XLA backend's share of the mesh checks), first by process rank;
- other data on some process (``training.data.data_fingerprint`` of its meta.json);
- another resolved config on some process, named by its first differing key(s).

A problem on one host used to end that process at once while the others waited for it in the
rendezvous for gloo's default timeout (30 minutes); a config that differed (another
``checkpoint.interval``) hung the job at its first save, or (another ``learning_rate``) let DDP
replicas diverge silently.

Config keys left out of the comparison (``PER_HOST_KEYS``): ``data.dir`` and ``checkpoint.dir``
are paths that may legitimately differ between hosts (another mount point for the same storage)
and whose contents are checked by other means (the data's fingerprint here; the shared-directory
probe of ``Checkpointer``); ``xla.compile_cache`` is a per-host cache that never changes a
result; ``data.num_workers`` is how many loader processes a host runs, a matter of its CPUs that
changes neither a batch (the order is the sampler's) nor any collective.
"""
from __future__ import annotations

import hashlib
import json
import os

from .config import ConfigError, check_data

PER_HOST_KEYS = ("data.dir", "checkpoint.dir", "xla.compile_cache", "data.num_workers")


def under_torchrun() -> bool:
    """Whether this process is one of several that ``torchrun`` started (RANK and WORLD_SIZE set,
    WORLD_SIZE > 1): its launch checks are then decided together with the others."""
    try:
        return "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1
    except ValueError:
        return False


def one_pjrt_cpu_device() -> bool:
    """Whether torch_xla's client here is PJRT CPU with one device (CPU_NUM_DEVICES unset or 1):
    xmp.spawn's pool would be one process running one replica, which train_xla.py runs in its own
    process instead (a test that needs the pool's launcher path patches this)."""
    return os.environ.get("PJRT_DEVICE") == "CPU" and os.environ.get("CPU_NUM_DEVICES", "1").strip() == "1"


def config_items(cfg) -> dict:
    """The resolved config as ``{"section.key": value}`` (plain JSON values), without the
    per-host keys: what every process of a job must agree on."""
    flat: dict = {}

    def walk(tree: dict, prefix: str) -> None:
        for k, v in tree.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            elif f"{prefix}{k}" not in PER_HOST_KEYS:
                flat[f"{prefix}{k}"] = v

    walk(cfg.to_dict(), "")
    return flat


def config_text(cfg) -> str:
    """``config_items`` as canonical JSON (the schema's key order, which ``config_difference``
    follows to name the first key that differs; no spaces): equal configs, equal text."""
    return json.dumps(config_items(cfg), separators=(",", ":"))


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def launch_entry(fingerprint: str, config: str, problem: str) -> str:
    """One process's line for the gather: ``<data fingerprint>\\n<config digest> <config
    bytes>\\n<problem>`` (the problem last: a cut at the gather's size only shortens it)."""
    return f"{fingerprint}\n{_digest(config)} {len(config.encode())}\n{' '.join(problem.split())}"


def _parse(entry: str) -> tuple[str, str, int, str]:
    fingerprint, config, problem = (entry.split("\n", 2) + ["", ""])[:3]
    digest, _, size = config.partition(" ")
    return fingerprint, digest, int(size) if size.isdigit() else 0, problem


def launch_verdict(entries: list[str], data_dir: str) -> str | None:
    """The launch decision from every process's ``launch_entry``, in rank order: the first
    problem any process reports, or different data on some, or ``None`` (the config is compared
    by ``config_difference`` once ``configs_differ`` says so)."""
    parsed = [_parse(e) for e in entries]
    for rank, (*_, problem) in enumerate(parsed):
        if problem:
            return f"{problem} (found by process {rank})" if len(entries) > 1 else problem
    odd = [rank for rank, (fp, *_) in enumerate(parsed) if fp != parsed[0][0]]
    if odd:
        return (f"data.dir: {data_dir}/meta.json describes other data on process(es) "
                f"{_ranks(odd)} than on process 0: every host must train on the "
                "same prepared data (copy the directory, or use a shared mount)")
    return None


def configs_differ(entries: list[str]) -> int:
    """0 if every process's config digest is the same, else the bytes of the longest config (the
    size of the second gather, which brings every config whole to name the keys)."""
    parsed = [_parse(e) for e in entries]
    if len({digest for _, digest, _, _ in parsed}) == 1:
        return 0
    return max(size for _, _, size, _ in parsed) or 1


def config_difference(configs: list[dict], shown: int = 3) -> str | None:
    """One line naming the first key(s) whose value differs between processes (``configs``:
    every process's ``config_items``, in rank order), with each value and the processes that
    have it; ``None`` if they agree."""
    keys = list(configs[0]) + sorted({k for c in configs[1:] for k in c} - set(configs[0]))
    missing = object()
    differing = [k for k in keys if any(c.get(k, missing) != configs[0].get(k, missing) for c in configs)]
    if not differing:
        return None
    key = differing[0]
    groups: dict[str, list[int]] = {}
    for rank, c in enumerate(configs):
        groups.setdefault(_value(c.get(key, missing), missing), []).append(rank)
    said = [f"{value} on process{'es' if len(ranks) > 1 else ''} {_ranks(ranks)}" for value, ranks in groups.items()]
    line = f"config differs between processes: {key} is {', '.join(said[:-1])} and {said[-1]}"
    if len(differing) > 1:
        more = differing[1:1 + shown]
        line += (f" (and {len(differing) - 1} more key(s): {', '.join(more)}"
                 f"{', ...' if len(differing) > 1 + shown else ''})")
    return line + "; every process must run the same config file and overrides"


def _value(v, missing) -> str:
    return "(not set)" if v is missing else json.dumps(v)


def _ranks(ranks: list[int], limit: int = 8) -> str:
    return ", ".join(map(str, ranks[:limit])) + (", ..." if len(ranks) > limit else "")


def agree_at_launch(host, cfg, problem: str = "") -> None:
    """The launch agreement over ``host`` (a ``training.distributed.HostGroup``; one process:
    local). ``problem``: what this process already found wrong ("" if nothing). ``check_data``
    runs here on every process and its error joins the problems, so a host whose ``data.dir`` is
    missing stops every host with it. Raises the verdict as a ``ConfigError`` on every process,
    or returns on every process. One all-gather; a second only when the configs differ. One
    process has nothing to compare: only its own ``problem`` is raised (``main`` ran
    ``check_data`` already; benchmarks make backends over stand-in data directories)."""
    if host.size == 1:
        if problem:
            raise ConfigError(problem)
        return
    fingerprint = ""
    try:
        from .data import data_fingerprint
        fingerprint = data_fingerprint(check_data(cfg))
    except ConfigError as e:
        problem = problem or str(e)
    config = config_text(cfg)
    entries = host.all_gather_text(launch_entry(fingerprint, config, problem), size=4096)
    verdict = launch_verdict(entries, cfg.data.dir)
    if verdict is None:
        size = configs_differ(entries)
        if size:  # the same answer on every process: all of them take part in this gather
            configs = [json.loads(t) if t else {} for t in host.all_gather_text(config, size=size)]
            verdict = config_difference(configs)
    if verdict:
        raise ConfigError(verdict)
