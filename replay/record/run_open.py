"""Opening the run folder for `replay.init`: process 0 creates or resumes it and is its only
writer; every other process of a multi-process run opens it read-only once process 0 has
written run.json (they save their shards of each checkpoint, and replay's records hold every
process's examples through process 0). Cost: O(1) in the run's length (the trace is not read).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable

from replay.record import checkpoints as ckpts
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


def check_arguments(checkpoints: Any, keep_checkpoints: Any, entrypoint: str | Callable | None,
                    replayable: str | None) -> None:
    """replay.init's arguments that contradict each other, refused before the run's folder is touched."""
    if isinstance(keep_checkpoints, bool) or not isinstance(keep_checkpoints, int) or keep_checkpoints < 0:
        raise RecordError(f"replay.init(keep_checkpoints={keep_checkpoints!r}): the newest checkpoints to keep, an "
                          "int >= 0 (0 keeps all)")
    if checkpoints is not None and keep_checkpoints:  # before the run's folder is touched
        raise RecordError("replay.init(checkpoints=manager, keep_checkpoints=N): your CheckpointManager keeps what "
                          "its own max_to_keep says; set it there")
    if entrypoint is not None and replayable is not None:
        raise RecordError("replay.init: give entrypoint= (a loop replay rebuilds) or replayable= (your own replay "
                          "protocol factory), not both")


def open_run(path: Path, resumed: bool, config: Any, entrypoint: str | Callable | None,
             dataset_size: "int | manifestlib.Tokens | None", checkpoints: Any, replayable: str | None,
             manifest: dict | None) -> tuple[Run | None, dict, int, int | None]:
    """(the run for writing, process 0's, else None; its manifest; the next step to record; where a
    resumed run's trace ended when it was reopened, None for a new run)."""
    if resumed:
        run, recorded = resume(path, replayable)
        trace_end = Run.open(path).trace.end if run is None else run.trace.end
        return run, recorded, trace_end if trace_end else (recorded.get("trace_first_step") or 0), trace_end
    if entrypoint is None and replayable is None:
        raise RecordError("replay.init(..., entrypoint=make): name the @replay.entrypoint function that "
                          "rebuilds this loop for replay")
    inside_run = checkpoints is None or inside(ckpts.directory_of(checkpoints), path)
    where = ("checkpoints" if checkpoints is None else
             os.path.relpath(ckpts.directory_of(checkpoints), path.absolute()) if inside_run
             else str(ckpts.directory_of(checkpoints)))
    run = create(path, manifestlib.build(config, entrypoint, dataset_size, where, replayable, manifest))
    return run, run.manifest if run is not None else Run.open(path).manifest, 0, None


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


def checkpoint_dir(given: str | os.PathLike, folder: Path, where: str) -> Any:
    """Where this process saves the run's checkpoints: `where` (the manifest's "checkpoint_dir")
    in the run's folder. A run on object storage recorded by several processes saves them
    straight to the bucket (URL/checkpoints, orbax writing gs:// or s3:// itself): orbax's
    multi-process save needs one folder every process writes and process 0 then reads to merge
    them, which a staging folder per host is not. With one process they go to its staging folder
    and are uploaded from there, as the rest of the run (traces/storage/mirror.py)."""
    from traces.storage import is_url, url_of

    if Path(where).is_absolute():
        return Path(where)
    if is_url(given) and processes() > 1:
        return f"{url_of(given)}/{where}"
    return folder / where


def _exists(path: Path) -> bool:
    """Asked now (a bucket's object with a request of its own: a run's listing is a snapshot)."""
    from traces.storage import is_url, open_store

    if is_url(path):
        store, key = open_store(str(path))
        return store.stat(key) is not None
    return path.exists()


def _wait_for(path: Path, timeout: float = _WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not _exists(path):
        if time.monotonic() > deadline:
            raise RecordError(f"process 0 did not create {path} within {timeout:.0f} s; start every process of the "
                              "run with the same path")
        time.sleep(0.05)


def inside(path: str | os.PathLike, folder: str | os.PathLike) -> bool:
    p, f = Path(path).resolve(), Path(folder).resolve()
    return p == f or f in p.parents
