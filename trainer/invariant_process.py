"""Mesh-invariant mode's process settings on XLA:CPU (trainer/invariant.py, points b and c of its
docstring): no FMA (ISA_FLAG in XLA_FLAGS) and a pinned intra-op pool (PJRT_NPROC), both read when
JAX's backend starts; `prepare_process()` applies them or refuses, and `invariant_counts` says which
device counts a run's manifest may promise.
"""

from __future__ import annotations

import os
import re

import jax

from replay.record.environment import pool_threads
from trainer.config import Config, ConfigError

POOL_THREADS = 8  # the XLA:CPU intra-op pool size mesh-invariant mode pins (PJRT_NPROC)
POOL_ENV = "PJRT_NPROC"  # read by XLA's DefaultThreadPoolSize() when the CPU client is created
# XLA:CPU lets LLVM fuse a multiply and an add into one FMA wherever both land in one fused
# kernel, and which ops share a kernel depends on the whole program, which changes with the
# device count. Capping the instruction set at AVX (no FMA) makes every op round on its own.
# XLA:CPU reads it from XLA_FLAGS when the backend starts (a per-jit compiler_options entry is
# recorded but not used for code generation: measured), so it is a process setting.
ISA_FLAG = "--xla_cpu_max_isa=AVX"
# Device counts measured to give bit-identical steps with these settings, per backend. Only
# verified counts go here (bench/invariance.py, tests/trainer/test_invariant_claims.py).
INVARIANT_COUNTS: dict[str, tuple[int, ...]] = {"cpu": (1, 2, 4, 8)}


# ------------------------------------------------------------------ process settings (XLA:CPU)

def _flag_values(flags: str, name: str) -> list[str]:
    return re.findall(rf"(?:^|\s)--{name}=(\S*)", flags)


def settings_problem() -> str | None:
    """Why this process, as started, cannot give mesh-invariant bits on XLA:CPU; None if it can."""
    flags = os.environ.get("XLA_FLAGS", "")
    isa = _flag_values(flags, "xla_cpu_max_isa")
    if isa[-1:] != [ISA_FLAG.split("=", 1)[1]]:
        return f"XLA_FLAGS lacks {ISA_FLAG}" if not isa else f"XLA_FLAGS sets --xla_cpu_max_isa={isa[-1]}"
    have = pool_threads()
    # XLA sizes the pool max(PJRT_NPROC, local devices): past POOL_THREADS devices it grows anyway
    # (allowed, but those counts were not measured: invariant_counts leaves them out).
    want = max(POOL_THREADS, jax.local_device_count())
    if have is not None and have != want:
        return f"the XLA:CPU thread pool has {have} threads, not {want}"
    return None


def prepare_process() -> None:
    """Put this process in the state mesh-invariant mode needs, or refuse (ConfigError, one line).

    Before JAX's backend starts: adds ISA_FLAG to XLA_FLAGS (kept, so the manifest records the
    flags the run had) and sets PJRT_NPROC=POOL_THREADS while the backend starts (then restored,
    so child processes are unaffected). After it started: checks that both hold.
    """
    from jax._src import xla_bridge

    if not xla_bridge.backends_are_initialized():
        before = os.environ.get(POOL_ENV)
        if before is not None and before != str(POOL_THREADS):
            raise ConfigError(f"mesh-invariant mode pins the XLA:CPU thread pool with {POOL_ENV}={POOL_THREADS}, "
                              f"but {POOL_ENV}={before} is set; unset it or set {POOL_ENV}={POOL_THREADS}")
        flags = os.environ.get("XLA_FLAGS", "")
        isa = _flag_values(flags, "xla_cpu_max_isa")
        if isa and isa[-1] != ISA_FLAG.split("=", 1)[1]:
            raise ConfigError(f"mesh-invariant mode needs {ISA_FLAG} (no FMA), but XLA_FLAGS sets "
                              f"--xla_cpu_max_isa={isa[-1]}; remove it from XLA_FLAGS")
        if not isa:
            os.environ["XLA_FLAGS"] = f"{flags} {ISA_FLAG}".strip()
        os.environ[POOL_ENV] = str(POOL_THREADS)
        try:
            jax.devices()  # starts the backend: it reads PJRT_NPROC and XLA_FLAGS now
        finally:
            if before is None:
                os.environ.pop(POOL_ENV, None)
    if jax.default_backend() != "cpu":
        return  # neither setting is what decides the numerics there
    problem = settings_problem()
    if problem:
        raise ConfigError(
            f"mesh-invariant mode needs XLA_FLAGS={ISA_FLAG} and {POOL_ENV}={POOL_THREADS} set before JAX starts, "
            f"but in this process {problem}; run it through `replay train` / `replay run`, or set both first")


def invariant_counts(cfg: Config, backend: str, local_devices: int) -> list[int]:
    """The device counts this run's steps are measured to agree on, for the manifest: the
    backend's measured set, less counts the microbatches do not fit; empty where the set was
    not measured or this process lacks the settings (or holds more devices than the pool)."""
    counts = INVARIANT_COUNTS.get(backend, ())
    if backend == "cpu" and (settings_problem() is not None or local_devices > POOL_THREADS):
        return []
    return [n for n in counts if cfg.mesh.n_microbatches % n == 0]
