"""Opening the run folder for `replay.init`: process 0 creates or resumes it and is its only
writer; every other process of a multi-process run opens it read-only once process 0 has
written run.json (they save their shards of each checkpoint, and replay's records hold every
process's examples through process 0). Cost: O(1) in the run's length (the trace is not read).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from replay.record import manifest as manifestlib
from replay.record.errors import RecordError
from traces import Run, Schema
from traces.run import holds_nothing
from traces.errors import DiskFullError, TraceError
from replay.engine.protocol import LEGACY_DEFAULT_FACTORY

PENDING = Schema(examples_per_step=0, rng_words=0, metrics=())  # until the first step shows the real one
_WAIT_S = 120.0  # how long another process waits for process 0 to create the run


def process_index() -> int:
    import jax

    return jax.process_index()


def processes() -> int:
    import jax

    return jax.process_count()


def create(path: Path, manifest: dict) -> Run | None:
    """A new run: created by process 0 (returned); other processes wait for its run.json (None)."""
    if process_index() != 0:
        _wait_for(path / "run.json")
        return None
    if not holds_nothing(path):  # empty folders are allowed: a CheckpointManager built before replay.init
        what = "holds another run" if (path / "run.json").exists() else "exists and is not empty"
        raise RecordError(f"{path}: {what}; record into a new folder, or continue a crashed run with "
                          "replay.init(PATH, resume=True)")
    return Run.create(path, PENDING, manifest)


def resume(path: Path, replayable: str | None) -> tuple[Run | None, dict]:
    """(the run reopened for writing by process 0, else None; its manifest). Refused: a run this
    loop did not record (another factory). A full disk or an OSError stays what it is: the
    caller says what it means for its run."""
    try:
        run = Run.resume(path, mark=False) if process_index() == 0 else None  # marked at the first write
        manifest = run.manifest if run is not None else Run.open(path).manifest
    except DiskFullError:
        raise
    except TraceError as e:
        raise RecordError(f"replay.init(resume=True): {e}") from None
    if not recorded_by(manifest, replayable):
        if run is not None:
            run.close()
        named = f"replayable={replayable!r}" if replayable else "an entrypoint"
        raise RecordError(f"{path}: was not recorded by replay.init with {named}; it cannot be resumed through it")
    return run, manifest


def recorded_by(manifest: dict, replayable: str | None) -> bool:
    """Whether `replay.init(..., replayable=)` (None: with an entrypoint) records runs like this one.
    A loop's own factory also owns its runs from before they were recorded through replay.init
    (the manifest names no factory: replay.engine.protocol's LEGACY_DEFAULT_FACTORY)."""
    if replayable is None:
        return manifest.get("recorded_by") == manifestlib.RECORDED_BY and manifest.get("replayable") == manifestlib.FACTORY
    return manifest.get("replayable", LEGACY_DEFAULT_FACTORY) == replayable


def _wait_for(path: Path, timeout: float = _WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise RecordError(f"process 0 did not create {path} within {timeout:.0f} s; start every process of the "
                              "run with the same path")
        time.sleep(0.05)


def inside(path: str | os.PathLike, folder: str | os.PathLike) -> bool:
    p, f = Path(path).resolve(), Path(folder).resolve()
    return p == f or f in p.parents
