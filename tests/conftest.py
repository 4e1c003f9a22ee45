"""Shared fixtures.

`stdlib_data`: a small prepared data directory (the contract of prepare_data.py) built from a few
packages of the local Python standard library, for every test that needs real token shards
(`data.dir` in a training config). `prepare_data_cli`: runs prepare_data.py as a subprocess.
"""
from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from hypothesis import settings

# Hypothesis profiles. "ci" (HYPOTHESIS_PROFILE=ci, which .ci/run sets): derandomized and without
# the example database, so every CI run draws the same examples. "dev" (the default): a new random
# draw each run, so local runs keep exploring; a failure prints its seed, and
# `pytest --hypothesis-seed=N` replays a draw.
# No deadline in either: a stalled example on a loaded machine is not a failure (registering "ci"
# replaces Hypothesis's own, which has none).
settings.register_profile("ci", derandomize=True, database=None, print_blob=True, deadline=None)
settings.register_profile("dev", print_blob=True, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the top-level scripts (prepare_data.py, model.py, ...) are modules
    sys.path.insert(0, str(ROOT))

# prepare_data.main() runs in this process; with the tokenizers thread pool on, every later fork
# (DataLoader workers, multiprocessing) would print a warning from the tokenizers library and turn
# it off in the child. Off from the start: the small test corpora do not need it.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# XLA's CPU compiler without LLVM's optimisation passes, for every torch_xla process the tests start
# (the one place this is set): graphs compile faster (test_spmd_checkpoint_reshards_exactly took
# 108 s with LLVM's passes, 67 s without) and their numbers are the same (tests/test_model_xla.py
# compares them with eager CPU to 1e-5). A value already set is kept.
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")

STDLIB = Path(sysconfig.get_paths()["stdlib"])
# ~1.6 MB of .py files: 3 train shards of 200k tokens at vocabulary 512.
STDLIB_PACKAGES = ("json", "email", "asyncio", "collections", "logging", "concurrent")
STDLIB_DATA_ARGS = ["--glob", "*.py", "--vocab-size", "512", "--seed", "0",
                    "--val-fraction", "0.05", "--shard-tokens", "200k"]


def stdlib_inputs(packages=STDLIB_PACKAGES) -> list[str]:
    return [str(STDLIB / p) for p in packages]


@pytest.fixture(scope="session")
def stdlib_data(tmp_path_factory) -> Path:
    """Path of a prepared data directory: tokenizer files, meta.json, >= 2 train shards, val shards.
    One for the session, whichever pytest-xdist worker asks first: so the runs that
    ``helpers.shared_run`` shares between workers are of the same data, at the same path."""
    import prepare_data
    from helpers import once_per_session

    def make(d: Path) -> str:
        out = d / "data"
        rc = prepare_data.main(["--input", *stdlib_inputs(), *STDLIB_DATA_ARGS, "--out", str(out)])
        assert rc == 0, "prepare_data.py failed to build the stdlib_data fixture"
        return str(out)
    return Path(once_per_session(tmp_path_factory, "stdlib_data", make))


def run_prepare_data(*args, env: dict | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    """Run `python prepare_data.py ARGS...` in a fresh interpreter; returns the completed process."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, str(ROOT / "prepare_data.py"), *map(str, args)],
                          capture_output=True, text=True, env=full_env, timeout=timeout, cwd=ROOT)


@pytest.fixture
def prepare_data_cli():
    return run_prepare_data
