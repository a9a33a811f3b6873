"""Loaded at the start of every Python process the test session starts (tests/conftest.py puts this
folder first on PYTHONPATH, which subprocesses inherit; a subprocess given an environment without
it runs as before). Never imported by replay, the trainer or a user; tools/suite_profile's hooks
use its after_import. Two settings, neither of which changes what a process computes:

Process 1 of a two-process test job (jax.distributed on 127.0.0.1) keeps its compiled
programs in the session's persistent compilation cache, as process 0 does: JAX writes entries from
process 0 only, and on CPU a program's cache key includes its process's own topology, so process 1
never hits an entry process 0 wrote: it compiled every step program again in every two-process
run of the session (the same trainer config recorded to a bucket and to a folder, then replayed,
is three full compiles of process 1's step). Measured on tests/replay/test_multihost_loop.py,
tests/traces/test_remote_processes.py and tests/trainer/test_multihost_dispatch.py in one
process: 163 CPU s without it, 138 and 149 with it (two runs). An entry is the executable XLA
compiled for that very key (process 1's own program), as process 0's are, so no result changes;
a JAX without the private function patched here, as this one has it, is left as it is.

Python's cyclic garbage collector runs every 50,000 allocations instead of 700 in these processes,
as tests/conftest.py sets it in the workers: tracing and lowering allocate objects fast, and the
default thresholds had full collections scan the ~130,000 objects the imports alone leave (jax, the
trainer, the CLI) again and again (tests/replay/sdc_probe.py's `clean` run, 8 devices, programs in
the cache: 9.7-10.0 -> 9.1-9.2 CPU s, two runs each; peak RSS 601 -> 608 MB).
Only when garbage is freed changes, never what a process computes.

After its own settings it runs the next sitecustomize on sys.path, if any (the profiling hooks of
tools/suite_profile), as Python would have without this folder.
"""

from __future__ import annotations

import gc
import importlib.abc
import importlib.util
import inspect
import os
import sys


def after_import(name: str, patch) -> None:
    """Calls patch(module) right after `name` is first imported (this file runs before JAX loads)."""

    class _Hook(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname != name:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(fullname)
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                patch(module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _Hook())


_WRITE_ARGS = ["cache_key", "compile_time_secs", "module_name", "backend", "executable", "host_callbacks"]


def _cache_every_process(compiler) -> None:
    write = getattr(compiler, "_cache_write", None)
    try:
        if write is None or list(inspect.signature(write).parameters) != _WRITE_ARGS:
            return
        compilation_cache, distributed, config = compiler.compilation_cache, compiler.distributed, compiler.config
    except (AttributeError, TypeError, ValueError):
        return

    def cache_write(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks):
        if (distributed.global_state.process_id == 0 or host_callbacks
                or compile_time_secs < config.persistent_cache_min_compile_time_secs.value):
            return write(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks)
        try:
            compilation_cache.put_executable_and_time(cache_key, module_name, executable, backend,
                                                      int(compile_time_secs))
        except Exception:  # as JAX treats a failed write: a speed-up missed, never a failed compile
            pass

    compiler._cache_write = cache_write


def _run_next_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if not entry or os.path.abspath(entry) == here:
            continue
        path = os.path.join(entry, "sitecustomize.py")
        if os.path.isfile(path):
            spec = importlib.util.spec_from_file_location("sitecustomize", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return


if __name__ == "sitecustomize":
    gc.set_threshold(50_000, 20, 20)
    after_import("jax._src.compiler", _cache_every_process)
    _run_next_sitecustomize()
