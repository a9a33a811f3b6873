"""Test-session settings shared by every test module.

One persistent XLA compilation cache for the whole session, in a temporary folder: most modules
train and replay the same few `tiny` step programs, and the subprocesses that end-to-end tests
start (kill/resume, multi-process, fresh-process CLI runs) compile them again from scratch
otherwise. The settings travel to subprocesses through the environment, which JAX reads at
import. A cached executable is the same program XLA would compile, so no result changes; the
folder is removed when the session ends, so nothing carries over between sessions. Under
pytest-xdist (pyproject.toml's addopts) the controller loads this file before it starts the
workers, so they inherit its folder through the environment and share it; only the controller
owns (and removes) it.

Test files that hold slow tests run first, in collection order; the others follow, the longest
first (their wall seconds in a whole suite run, tests/file_durations.json, written by
tools/suite_profile). xdist hands out whole files (`--dist loadfile`) in this order, so the long
files start while the other workers still have short ones left to take, instead of one long file
running alone at the end. The slow files keep collection order on purpose: sorted by length, the
three longest (two of them 8-device mesh-invariant processes with 8-thread pools) start together
on the 2 cores; measured once so, test_invariant_claims took 1.7x the CPU of a run in this order,
against 1.3x for the suite as a whole (the machine was slower then too). The figures
only order the files; a file missing from them (a new one) counts as 0 s.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

_CACHE_ENV = {
    "JAX_COMPILATION_CACHE_DIR": None,  # filled in below
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
}

_owned_dir: str | None = None
if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    _owned_dir = tempfile.mkdtemp(prefix="replay-tests-xla-cache-")
    _CACHE_ENV["JAX_COMPILATION_CACHE_DIR"] = _owned_dir
    for _key, _value in _CACHE_ENV.items():
        os.environ.setdefault(_key, _value)
    if "jax" in sys.modules:  # imported before this file (a plugin): set it in-process too
        import jax

        jax.config.update("jax_compilation_cache_dir", _owned_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


# torch (and the BLAS libraries) on one thread in every test process, subprocesses included (they
# inherit the environment): the tests' tensors are tiny, and on the suite's 2 shared cores a second
# thread spin-waits for the first (the demo and tests/torch/reference_pair.one_torch_thread chose one
# thread for the same reason; test_recorder alone: 13.2/15.3/9.5 -> 7.4/7.5/6.8 CPU s). Bits: every
# process of a session gets the same count, so no comparison spans differently threaded processes,
# and no stored fixture holds torch bits (tests/*/fixtures: JAX runs and traces only). A count set
# in the environment before the session is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")
if "torch" in sys.modules:  # imported before this file (a plugin): its thread pool is sized already
    sys.modules["torch"].set_num_threads(1)

# Every process the session starts loads tests/subprocess_site/sitecustomize.py first: process 1 of a
# two-process job keeps its compiled programs in the cache folder above too, and the garbage
# collector runs as pytest_collection_finish sets it below (that file says why).
_SITE = str(Path(__file__).resolve().parent / "subprocess_site")
if _SITE not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_SITE, os.environ.get("PYTHONPATH")]))

# The repository's own modules as bytecode once, before the workers start: this machine sets
# PYTHONDONTWRITEBYTECODE, so every test process (about 120 subprocesses and the workers) otherwise
# compiled replay, trainer and traces from source on import (~0.25 s of CPU a process importing the
# trainer and the CLI: 1.48-1.67 -> 1.23-1.29 s; compiling all 460 files here takes ~0.9 s). Only the
# session's first process writes (into __pycache__, which git ignores); the others read, as Python
# does with or without that setting, and a source changed since is compiled again by its mtime.
if not os.environ.get("PYTEST_XDIST_WORKER"):
    import compileall

    for _package in ("replay", "trainer", "traces", "bench", "examples", "tests"):
        try:
            compileall.compile_dir(str(Path(__file__).resolve().parents[1] / _package), quiet=2)
        except OSError:  # a read-only checkout: the processes compile in memory, as before
            pass

# Runs that several test files read and none writes (tests/torch/reference_pair.py): made once per
# session into this folder, which the xdist workers inherit as the XLA cache folder above.
_owned_shared: str | None = None
if not os.environ.get("REPLAY_TESTS_SHARED_DIR"):
    _owned_shared = tempfile.mkdtemp(prefix="replay-tests-shared-runs-")
    os.environ["REPLAY_TESTS_SHARED_DIR"] = _owned_shared


def pytest_sessionfinish(session, exitstatus):
    for owned in (_owned_dir, _owned_shared):
        if owned is not None:
            shutil.rmtree(owned, ignore_errors=True)


def pytest_collection_modifyitems(session, config, items):
    """Files with a slow test first, then the others longest first, each file's tests together
    and in their order (a stable sort).
    Among them, files that set READS_SHARED_RUNS come last: another worker makes the shared runs
    they wait for (tests/torch/reference_pair.py) meanwhile, in the slow file that makes them."""
    has_slow = {item.nodeid.split("::", 1)[0] for item in items if item.get_closest_marker("slow")}
    durations = _file_durations()

    def key(item):
        file = item.nodeid.split("::", 1)[0]
        slow = file in has_slow
        return (not slow, bool(getattr(getattr(item, "module", None), "READS_SHARED_RUNS", False)),
                0.0 if slow else -durations.get(file, 0.0))

    items.sort(key=key)


def _file_durations() -> dict[str, float]:
    """{test file: its wall seconds in a suite run} (tests/file_durations.json); {} if unreadable."""
    try:
        data = json.loads((Path(__file__).parent / "file_durations.json").read_text())
    except (OSError, ValueError):
        return {}
    return {k: float(v) for k, v in data.items() if isinstance(v, (int, float))} if isinstance(data, dict) else {}


def pytest_collection_finish(session):
    """Python's cyclic garbage collector, tuned for a long test process: everything alive after
    collection (jax, flax, torch, every test module) moves to the permanent generation, and a
    collection runs every 50,000 allocations instead of 700. A worker accumulates about a million
    objects (traced programs, compiled executables), and scanning them again and again was ~5% of
    the in-process time (tests/replay without slow: 10.3 s of GC in 212 s, 3.9 s with these
    settings). Only when garbage is freed changes, never what a test computes."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)

