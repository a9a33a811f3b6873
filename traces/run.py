"""A run directory: manifest, trace, checkpoints, completion marker and writer lock.

    RUN/run.json        manifest: format_version, schema, and whatever the trainer records
    RUN/INCOMPLETE      present while a writer has the run open or after it crashed
    RUN/COMPLETE        present once the last writer finished cleanly: {"end": one past the last step}
    RUN/.lock           flock()ed by the writer; the kernel drops it when the writer dies
    RUN/trace/          segment files (see trace.py)
    RUN/checkpoints/    checkpoints, written by the trainer

The lock is an advisory flock, not a pid file, so a writer killed with SIGKILL never leaves a
stale lock behind, and `status` can tell a live writer from a crashed one.
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

from traces.errors import NewerFormatError, NotARunError, RunLockedError, RunNotFoundError, TraceCorruptError
from traces.schema import Schema
from traces.trace import DEFAULT_SEGMENT_RECORDS, FORMAT_VERSION, Damage, TraceReader, TraceWriter

MANIFEST = "run.json"
INCOMPLETE = "INCOMPLETE"
COMPLETE = "COMPLETE"
LOCK = ".lock"
TRACE_DIR = "trace"
CHECKPOINT_DIR = "checkpoints"


def write_json_atomic(path: Path, obj: dict) -> None:
    """Write-then-rename, so a crash leaves the old file or the new one, never half of one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_manifest(path: Path) -> dict:
    """The manifest of the run at `path`; raises one-line errors for every way that can fail."""
    if not path.exists():
        raise RunNotFoundError(f"{path}: no such run; check the path (a run is the folder `replay train --out` wrote)")
    if not path.is_dir():
        raise NotARunError(f"{path}: is a file, not a run directory; pass the folder that `replay train --out` wrote")
    mpath = path / MANIFEST
    if not mpath.exists():
        raise NotARunError(f"{path}: not a run (no {MANIFEST}); pass the folder that `replay train --out` wrote")
    try:
        manifest = json.loads(mpath.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TraceCorruptError(f"{mpath}: manifest is unreadable ({e.__class__.__name__}); the run is damaged", str(mpath)) from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("format_version"), int):
        raise TraceCorruptError(f"{mpath}: manifest has no integer format_version; the run is damaged", str(mpath))
    if manifest["format_version"] > FORMAT_VERSION:
        raise NewerFormatError(
            f"{path}: written by run format_version {manifest['format_version']}, this replay reads up to "
            f"{FORMAT_VERSION}: upgrade replay (pip install -U replay-jax)"
        )
    if "schema" not in manifest:
        raise TraceCorruptError(f"{mpath}: manifest has no schema; the run is damaged", str(mpath))
    return manifest


class Run:
    """One run directory. `Run.open` reads; `Run.create`/`Run.resume` also hold the writer lock."""

    def __init__(self, path: Path, manifest: dict, lock_fd: int | None = None):
        self.path = path
        self.manifest = manifest
        self.schema = Schema.from_json(manifest["schema"])
        self._lock_fd = lock_fd
        self._writer: TraceWriter | None = None
        self._reader: TraceReader | None = None

    # Opening ----------------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | os.PathLike) -> "Run":
        path = Path(path)
        return cls(path, read_manifest(path))

    @classmethod
    def create(cls, path: str | os.PathLike, schema: Schema, manifest: dict) -> "Run":
        """Starts a new run. The directory must not exist, or be empty."""
        path = Path(path)
        if path.exists() and (not path.is_dir() or any(path.iterdir())):
            raise NotARunError(f"{path}: already exists and is not empty; choose a new --out or resume it with --resume")
        path.mkdir(parents=True, exist_ok=True)
        lock_fd = _take_lock(path)
        full = {"format_version": FORMAT_VERSION, **manifest, "schema": schema.to_json()}
        (path / CHECKPOINT_DIR).mkdir(exist_ok=True)
        (path / TRACE_DIR).mkdir(exist_ok=True)
        (path / INCOMPLETE).touch()
        write_json_atomic(path / MANIFEST, full)
        return cls(path, full, lock_fd)

    @classmethod
    def resume(cls, path: str | os.PathLike) -> "Run":
        """Reopens a run for appending: takes the lock and marks it incomplete again."""
        path = Path(path)
        manifest = read_manifest(path)
        lock_fd = _take_lock(path)
        (path / INCOMPLETE).touch()
        (path / COMPLETE).unlink(missing_ok=True)
        return cls(path, manifest, lock_fd)

    # Contents ---------------------------------------------------------------------------
    @property
    def trace_dir(self) -> Path:
        return self.path / TRACE_DIR

    @property
    def checkpoint_dir(self) -> Path:
        return self.path / CHECKPOINT_DIR

    @property
    def trace(self) -> TraceReader:
        """The trace; for a complete run, a trace shorter than the run's recorded end is damage."""
        if self._reader is None:
            self._reader = TraceReader(self.trace_dir, self.schema)
            end = self.recorded_end
            if end is not None and self._reader.end < end and not self._reader.damage:
                last = self._reader.segments[-1].path if self._reader.segments else self.trace_dir
                self._reader.damage.append(
                    Damage(str(last), last.stat().st_size if last.is_file() else 0, self._reader.end,
                           f"the run finished at step {end - 1} but the trace ends before step {self._reader.end}")
                )
        return self._reader

    @property
    def recorded_end(self) -> int | None:
        """One past the last step, as the writer that finished the run saw it (None if unfinished)."""
        try:
            return int(json.loads((self.path / COMPLETE).read_text())["end"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    @property
    def status(self) -> str:
        """"complete", "running" (a live writer holds the lock) or "crashed"."""
        if (self.path / COMPLETE).exists() and not (self.path / INCOMPLETE).exists():
            return "complete"
        if self._lock_fd is not None or _is_locked(self.path):
            return "running"
        return "crashed"

    # Writing ----------------------------------------------------------------------------
    def writer(self, segment_records: int = DEFAULT_SEGMENT_RECORDS) -> TraceWriter:
        if self._lock_fd is None:
            raise RunLockedError(f"{self.path}: opened read-only; use Run.create or Run.resume to write")
        if self._writer is None:
            self._writer = TraceWriter(self.trace_dir, self.schema, segment_records)
            self._reader = None
        return self._writer

    def update_manifest(self, **fields) -> None:
        """Replaces top-level manifest fields atomically (e.g. the list of checkpoint steps)."""
        if self._lock_fd is None:
            raise RunLockedError(f"{self.path}: opened read-only; cannot change its manifest")
        self.manifest = {**self.manifest, **fields}
        write_json_atomic(self.path / MANIFEST, self.manifest)

    def finish(self) -> None:
        """Marks the run complete (the only way to) and releases the lock."""
        end = self.writer().next_step
        self._writer.close()
        write_json_atomic(self.path / COMPLETE, {"end": end})
        (self.path / INCOMPLETE).unlink(missing_ok=True)
        self.close()

    def close(self) -> None:
        """Releases the lock without marking the run complete."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None and self._lock_fd is not None:
            self.finish()
        else:
            self.close()


def _take_lock(path: Path) -> int:
    fd = os.open(path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise RunLockedError(f"{path}: is being written by {holder}; wait for it to finish or stop it first") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()}".encode(), 0)
    return fd


def _is_locked(path: Path) -> bool:
    try:
        fd = os.open(path / LOCK, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
