"""A run directory: manifest, trace, checkpoints, completion marker and writer lock.

    RUN/run.json        manifest: format_version, schema, trace_first_step, whatever the trainer
                        records, and manifest_sha256 over all of it (written by write_manifest)
    RUN/INCOMPLETE      present while a writer has the run open or after it crashed
    RUN/COMPLETE        present once the last writer finished cleanly: {"end": one past the last step}
    RUN/.lock           flock()ed by the writer; the kernel drops it when the writer dies
    RUN/trace/          segment files (see trace.py)
    RUN/checkpoints/    checkpoints (orbax, or safetensors for replay.torch), written by the loop: see FORMAT.md

The lock is an advisory flock, not a pid file, so a writer killed with SIGKILL never leaves a
stale lock behind, and `status` can tell a live writer from a crashed one.
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

from traces.errors import ManifestCorruptError, NotARunError, RunLockedError, TraceError
from traces.manifest import (  # noqa: F401  (re-exported: the run format's names, where readers look for them)
    MANIFEST, MANIFEST_CHECKSUM, TRACE_FIRST_STEP, TRUST_FLAG, manifest_checksum, read_manifest, write_json_atomic, write_manifest,
)
from traces.schema import Schema
from traces.storage import as_path, is_remote, is_url
from traces.trace import DEFAULT_SEGMENT_RECORDS, FORMAT_VERSION, Damage, TraceReader
from traces.writer import TraceWriter

INCOMPLETE = "INCOMPLETE"
COMPLETE = "COMPLETE"
LOCK = ".lock"
TRACE_DIR = "trace"
CHECKPOINT_DIR = "checkpoints"


class Run:
    """One run directory. `Run.open` reads; `Run.create`/`Run.resume` also hold the writer lock.

    `notes` holds lines about what could not be checked (a manifest from before checksums).
    """

    def __init__(self, path: Path, manifest: dict, lock_fd: int | None = None, notes: list[str] | None = None):
        self.path = path
        self.manifest = manifest
        self.notes: list[str] = list(notes or [])
        try:
            self.schema = Schema.from_json(manifest["schema"])
        except TraceError as e:
            raise ManifestCorruptError(f"{path / MANIFEST}: {e}", str(path / MANIFEST)) from None
        self._lock_fd = lock_fd
        self.mirror = None  # a run written to object storage: its uploads (traces/storage/mirror.py)
        self._writer: TraceWriter | None = None
        self._reader: TraceReader | None = None
        if TRACE_FIRST_STEP not in manifest and not any(TRUST_FLAG in note for note in self.notes):
            self.notes.append(f"{path / MANIFEST} does not record where the trace starts (recorded before replay "
                              "did), so missing leading segment files cannot be detected")

    # Opening ----------------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | os.PathLike) -> "Run":
        path = as_path(path)  # a folder, or a gs:// / s3:// URL (traces/storage)
        notes: list[str] = []
        run = cls(path, read_manifest(path, notes), notes=notes)
        if is_remote(path) and (path / INCOMPLETE).is_file() and not _is_locked(path):
            from traces.storage.mirror import stopped_note
            run.notes.append(stopped_note(path))
        return run

    @classmethod
    def create(cls, path: str | os.PathLike, schema: Schema, manifest: dict, first_step: int = 0) -> "Run":
        """Starts a new run whose trace starts at `first_step`. The directory must not exist, or be empty."""
        if is_url(path):  # written to a local staging folder and uploaded (traces/storage/mirror.py)
            from traces.storage import mirror
            return mirror.create(cls, path, schema, manifest, first_step)
        path = Path(path)
        if not holds_nothing(path):
            raise NotARunError(f"{path}: already exists and is not empty; choose a new --out or resume it with --resume")
        path.mkdir(parents=True, exist_ok=True)
        lock_fd = take_lock(path)
        full = {"format_version": FORMAT_VERSION, **manifest, "schema": schema.to_json(), TRACE_FIRST_STEP: int(first_step)}
        (path / CHECKPOINT_DIR).mkdir(exist_ok=True)
        (path / TRACE_DIR).mkdir(exist_ok=True)
        (path / INCOMPLETE).touch()
        return cls(path, write_manifest(path / MANIFEST, full), lock_fd)

    @classmethod
    def resume(cls, path: str | os.PathLike, mark: bool = True) -> "Run":
        """Reopens a run for appending: takes the lock and marks it incomplete again. mark=False
        only takes the lock (a second writer is refused from now on) and leaves the run as it
        was until `mark_incomplete()`, so a resume refused before it writes changes nothing."""
        if is_url(path):
            from traces.storage import mirror
            return mirror.resume(cls, path, mark)
        path = Path(path)
        notes: list[str] = []
        manifest = read_manifest(path, notes)
        lock_fd = take_lock(path)
        run = cls(path, manifest, lock_fd, notes)
        if mark:
            run.mark_incomplete()
        return run

    def mark_incomplete(self) -> None:
        """From now until `finish()` the run is incomplete (a crash leaves it so)."""
        (self.path / INCOMPLETE).touch()
        (self.path / COMPLETE).unlink(missing_ok=True)
        if self.mirror is not None:
            self.mirror.mark(complete=False)

    # Contents ---------------------------------------------------------------------------
    @property
    def trace_dir(self) -> Path:
        return self.path / TRACE_DIR

    @property
    def checkpoint_dir(self) -> Path:
        return self.path / CHECKPOINT_DIR

    @property
    def first_step(self) -> int | None:
        """Where the trace starts, as recorded in run.json (None for runs from before it was)."""
        return self.manifest.get(TRACE_FIRST_STEP)

    def reading_trace(self, reader: TraceReader) -> "Run":
        """This run, its trace read through `reader` from now on: a remote run's local copy holds no
        trace of its own and reads the bucket's by ranges (replay/engine/protocol.local_run)."""
        self._reader = reader
        return self

    @property
    def trace(self) -> TraceReader:
        """The trace; its `damage` includes run-level damage (see `Run.damage`)."""
        if self._reader is None:
            self._reader = TraceReader(self.trace_dir, self.schema, first_step=self.first_step)
            end = self.recorded_end
            if end is not None and self._reader.end < end and not self._reader.damage:
                last = self._reader.segments[-1].path if self._reader.segments else self.trace_dir
                self._reader.damage.append(
                    Damage(str(last), last.stat().st_size if last.is_file() else 0, self._reader.end,
                           f"the run finished at step {end - 1} but the trace ends before step {self._reader.end}")
                )
        return self._reader

    @property
    def damage(self) -> list[Damage]:
        """All damage known without reading every record: segment headers and seals, the unsealed
        tail, missing leading segments, and a complete run's trace ending before COMPLETE says.
        Computed once per Run (opening the trace); at most one entry for unreachable later segments."""
        return list(self.trace.damage)

    def verify(self) -> list[Damage]:
        """Everything in `damage`, plus every record's checksum (reads the whole trace)."""
        return self.trace.verify()

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
    @property
    def compacts(self) -> bool:
        """Whether its writer compacts sealed segments (traces/compaction.py): a run of format 3 or
        later. An older run resumed keeps its format, so the replay that wrote it still reads it."""
        version = self.manifest.get("format_version")
        return isinstance(version, int) and version >= 3

    def writer(self, segment_records: int = DEFAULT_SEGMENT_RECORDS, compact: bool | None = None) -> TraceWriter:
        """The run's trace writer (one). `compact`: whether it compacts sealed segments; None: as the
        run's format says (`compacts`). False keeps every record's hashes in it, as format 2 did."""
        compact = self.compacts if compact is None else compact
        if self._lock_fd is None:
            raise RunLockedError(f"{self.path}: opened read-only; use Run.create or Run.resume to write")
        if self._writer is None and self.mirror is not None:
            from traces.storage.mirror import MirroredTraceWriter
            self._writer = MirroredTraceWriter(self.trace_dir, self.schema, segment_records, self.first_step,
                                               self.mirror, self.mirror.tails_found, compact=compact)
        if self._writer is None:
            self._writer = TraceWriter(self.trace_dir, self.schema, segment_records, first_step=self.first_step,
                                       compact=compact)
            self._reader = None
        return self._writer

    def _last_recorded(self) -> int | None:
        w = self._writer
        return w.next_step - 1 if w is not None and w.next_step is not None else None

    def update_manifest(self, **fields) -> None:
        """Replaces top-level manifest fields atomically (e.g. the list of checkpoint steps)."""
        if self._lock_fd is None:
            raise RunLockedError(f"{self.path}: opened read-only; cannot change its manifest")
        self.manifest = write_manifest(self.path / MANIFEST, {**self.manifest, **fields}, self._last_recorded())
        if self.mirror is not None:  # checkpoints first: a manifest never names one not uploaded
            self.mirror.files()
            self.mirror.manifest()
            self.mirror.prune()  # after the manifest: it never names a checkpoint the bucket lacks

    def finish(self) -> None:
        """Marks the run complete (the only way to) and releases the lock."""
        writer = self.writer()
        if writer.broken:
            raise TraceError(f"{self.path}: cannot mark the run complete: its trace writer stopped ({writer.broken}); "
                             f"resume it with `replay train --resume {self.path}`")
        end = writer.next_step if writer.next_step is not None else (self.first_step or 0)
        writer.close()
        write_json_atomic(self.path / COMPLETE, {"end": end}, self._last_recorded())
        (self.path / INCOMPLETE).unlink(missing_ok=True)
        if self.mirror is not None:
            self.mirror.files()
            self.mirror.mark(complete=True)
        self.close()

    def close(self) -> None:
        """Releases the lock without marking the run complete."""
        if self._writer is not None:
            try:
                self._writer.close()
            except BaseException:
                if self.mirror is not None:  # (its uploads failed): a resume from the bucket need not wait
                    mirror, self.mirror = self.mirror, None  # for the lease; the staging folder is kept
                    mirror.release_after_failure()
                raise
            self._writer = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        if self.mirror is not None:
            mirror, self.mirror = self.mirror, None
            mirror.close()

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None and self._lock_fd is not None:
            self.finish()
        else:
            self.close()


def holds_nothing(path: Path) -> bool:
    """Whether a new run may be made at `path`: it does not exist, or is a folder holding only empty
    folders (an orbax CheckpointManager the loop built before replay.init makes its directory at
    construction): nothing there could be lost or mistaken for part of the run."""
    if not path.exists():
        return True
    return path.is_dir() and all(entry.is_dir() and not entry.is_symlink() and holds_nothing(entry)
                                 for entry in path.iterdir())


def take_lock(path: Path, create: bool = True) -> int | None:
    """Holds RUN/.lock (an exclusive flock) and returns its descriptor; RunLockedError when a live
    writer holds it. A writer (create=True) creates the file and writes its pid into it for
    `status`; create=False only holds an existing lock without writing anything (a trainer
    checking a run it has not touched yet) and returns None when the run has no lock file."""
    try:
        fd = os.open(path / LOCK, os.O_RDWR | os.O_CREAT, 0o644) if create else os.open(path / LOCK, os.O_RDONLY)
    except FileNotFoundError:
        if create:
            raise
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise RunLockedError(f"{path}: is being written by {holder}; wait for it to finish or stop it first") from None
    if create:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}".encode(), 0)
    return fd


def _is_locked(path: Path) -> bool:
    if is_remote(path):  # no flock on an object store: a live lease (traces/storage/lease.py) is a writer
        from traces.storage.lease import live
        return (path / LOCK).is_file() and live(path.view.store, (path / LOCK).key)
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
