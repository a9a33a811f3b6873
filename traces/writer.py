"""Appending to a trace: the only code that writes segment files (their layout is in trace.py).

Each record is one frame written with one write() call, so a writer that dies at any moment,
or runs out of disk, leaves at most one partial frame at the tail; the next writer cuts it off.

Sealing never pauses the loop that appends (issue 34). The append that fills a segment writes
its seal (one write(): from then on the segment is sealed for any reader, and a kill loses
nothing) and hands the rest to a seal thread: the segment's fsync and close, then its index
(a sort of its example hashes, the table, the filter: ~2 s and ~200 MB at 1,024 examples a step
and 16,384 records a segment, which on the loop's thread paused it ~1.5 s with a 610 MB peak).
Why a thread and not an index built as records arrive: the table is a sort of every hash of the
segment, which cannot be finished a record at a time for free (merging sorted runs at the seal
is the same pass), and the seal's fsync of the whole segment is itself a pause no incremental
index removes. The records themselves are still written on the caller's thread, so no record
is ever in flight: a crash while the thread works leaves a sealed segment without its index,
which readers index in memory and the next writer writes (as a crash between seal and index
always did). At most one seal is in flight: a segment filled while the previous one's index is
still being built waits for it (bounded memory: one segment's hashes, as the builder holds).
The thread's failures come back on the caller's thread: a failed fsync is raised by the next
append, flush or close, as the same DiskFullError or OSError the append that sealed raised
before (and the writer stops); an index that could not be written is a note, as before.
`close()` waits for the thread. The files are byte for byte what sealing on the loop wrote.
A writer of a format-3 run (`compact=True`, what `Run.writer` gives one) also compacts each
sealed segment on that thread before its index (traces/compaction.py: the records again
without their example hashes, which the index then holds once; ~1 s of CPU and the segment
written a second time at 16,384 records of 1,024 examples).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from traces.checksum import crc32
from traces.errors import (
    DISK_FULL_ERRNOS, DiskFullError, ResumeDivergedError, StepOrderError, TraceCorruptError, disk_full_message,
)
from traces import compaction, sidecar
from traces.index import IndexBuilder, index_path
from traces.schema import Schema, StepRecord, encode_record, same_bits
from traces.segment import FRAME_HEAD
from traces.trace import (
    COMPACT_VERSION, DEFAULT_SEGMENT_RECORDS, HEADER_SIZE, Damage, TraceReader, _compressor, describe_damage, encode_frame,
    encode_header, encode_seal, segment_name,
)


SIDECAR_BATCH = 16  # sidecar entries written at once: a kill loses at most these, whose frames the reader walks


class TraceWriter:
    """Appends records to a trace directory, resuming where a previous writer stopped.

    A damaged tail left by a killed writer is cut off (and reported in `repaired`). Appending
    a step that is already recorded succeeds only when it is bit-identical, which is how a
    resumed run proves it re-computed the same steps; a gap is refused (StepOrderError) and
    different content is a divergence (ResumeDivergedError). `first_step`, when given, is where
    the trace must start: the first record of an empty trace must be that step.
    """

    def __init__(self, trace_dir: str | os.PathLike, schema: Schema, segment_records: int = DEFAULT_SEGMENT_RECORDS,
                 first_step: int | None = None, compact: bool = False):
        self.dir = Path(trace_dir)
        self.compact = compact  # seal compacted segments (traces/compaction.py): a format-3 run's writer
        self.dir.mkdir(parents=True, exist_ok=True)
        self.schema = schema
        self.segment_records = segment_records
        self.first_step = first_step
        self._digest = schema.digest()
        self._cctx = _compressor()
        self._fd: int | None = None
        self._path: Path | None = None
        self._broken: str | None = None
        self.repaired: list[Damage] = []
        self.notes: list[str] = []  # an index that could not be written (the trace is intact without it)
        self._builder: IndexBuilder | None = None
        self._sealing: threading.Thread | None = None  # the seal in flight (at most one)
        self._seal_error: tuple[OSError, str, Path, int | None] | None = None  # set by that thread
        self._sealed_synced = threading.Event()  # the sealed segment's fsync is done (or failed)
        self._sealed_synced.set()
        self._size = 0  # bytes in the open segment
        self._tix: int | None = None  # the open segment's sidecar (traces/sidecar.py), None when it has none
        self._entry = sidecar.EntryMaker(schema)
        self._pending: list[bytes] = []  # sidecar entries not yet written (their heads: see _append)
        self._reader = TraceReader(self.dir, schema, first_step=first_step)
        self._repair_tail()
        self.next_step: int | None = self._reader.end if self._reader.segments else None
        self._count = 0
        self._crc = 0
        self._first = 0
        self._resume_tail()

    def _resume_tail(self) -> None:
        """Continues the last segment: an unsealed one is read whole (the only segment a resume
        reads), checked frame by frame, and reopened for appending. The last sealed segment, if
        it lost its index (the writer died between seal and index), gets it written again."""
        reader = self._reader
        if not reader.segments:
            return
        last = reader.segments[-1]
        sealed = len(reader.segments) - (1 if last.sealed else 2)  # the segment the last writer sealed
        if sealed >= 0:
            seg = reader.segments[sealed]
            compaction.tmp_path(seg.path).unlink(missing_ok=True)  # a kill while it was being compacted
            if seg.version >= COMPACT_VERSION and not index_path(seg.path).exists():
                raise reader._lost(sealed, "it is missing")
            if (self.compact and seg.version < COMPACT_VERSION) or not index_path(seg.path).exists():
                builder, end = reader.index_builder(sealed)
                self._write_index(builder, seg.path, end, seg.content_crc, seg.size)
                self._reader = reader = TraceReader(self.dir, self.schema, first_step=self.first_step)
                last = reader.segments[-1]
        if last.sealed:
            sidecar.sidecar_path(last.path).unlink(missing_ok=True)  # left by a kill between seal and unlink
            return
        try:
            builder, end = reader.index_builder(len(reader.segments) - 1)
        except TraceCorruptError as e:  # a bad record inside the tail: cut from it, as a torn one
            if e.step is None or e.step < last.first_step:
                raise
            cut = int(last.offsets[e.step - last.first_step])
            self._cut(last.path, cut, [Damage(str(last.path), cut, e.step, str(e).split(": ", 1)[-1])])
            self.next_step = self._reader.end if self._reader.segments else None
            return self._resume_tail()
        self._fd = os.open(last.path, os.O_WRONLY | os.O_APPEND)
        self._path, self._builder = last.path, builder
        self._resume_sidecar(builder.columns(end))
        self._crc, self._count, self._first, self._size = builder.crc, last.count, last.first_step, end
        if self._count >= self.segment_records:  # full but unsealed: the last writer stopped while sealing it
            self._seal()

    def _resume_sidecar(self, cols) -> None:
        """Rewrites the tail's sidecar from its records (read whole by the resume anyway), so it
        holds exactly them whatever a kill or a cut left, and opens it for appending."""
        try:
            sidecar.rewrite(self._path, self.schema, cols)
            self._tix = os.open(sidecar.sidecar_path(self._path), os.O_WRONLY | os.O_APPEND)
        except OSError as e:
            self._drop_sidecar(e)

    def _drop_sidecar(self, e: OSError) -> None:
        """The sidecar is derived: a failure to write it (a full disk) loses nothing recorded;
        without it readers read the tail's records, as before sidecars."""
        if self._tix is not None:
            os.close(self._tix)
            self._tix = None
        if self._path is not None:
            path = sidecar.sidecar_path(self._path)
            for p in (path, path.with_name(path.name + ".tmp")):
                try:
                    p.unlink(missing_ok=True)
                except OSError:
                    pass
            self.notes.append(f"{path}: not written ({e.strerror or e}); readers read the tail's records instead")

    def _write_pending(self) -> None:
        """The pending entries, finished (their examples keys from the builder's hashes, in one
        numpy pass) and written with one write()."""
        if self._pending and self._tix is not None:
            n = len(self._pending)
            self._append_sidecar(self._entry.finish(self._pending, self._builder.hashes()[-n:]))
        self._pending = []

    def _append_sidecar(self, data: bytes) -> None:
        """One write(); a short one (a full disk) ends the sidecar like a failed one: an entry
        after a partial one would be misread, so none is written."""
        try:
            if os.write(self._tix, data) != len(data):
                raise OSError(28, "short write (the disk is full)")
        except OSError as e:
            self._drop_sidecar(e)

    def _close_sidecar(self, unlink: bool) -> None:
        if not unlink and self._builder is not None:
            self._write_pending()
        self._pending = []
        if self._tix is not None:
            os.close(self._tix)
            self._tix = None
        if unlink and self._path is not None:
            sidecar.sidecar_path(self._path).unlink(missing_ok=True)

    @property
    def broken(self) -> str | None:
        """Why this writer stopped (a failed write, a failed seal that finished), or None."""
        if self._sealing is not None and not self._sealing.is_alive():
            self._wait_seal()
        if self._seal_error is not None and self._sealing is None and self._seal_error[1] is not None:
            e, doing, path, last = self._seal_error  # kept: the next append, flush or close raises it
            self._failed(e, doing, path, last)
        return self._broken

    @property
    def run_path(self) -> Path:
        return self.dir.parent if self.dir.name == "trace" else self.dir

    def _repair_tail(self) -> None:
        damage = self._reader.damage
        if not damage:
            return
        if len(damage) > 1 or self._reader.tail is None:
            raise TraceCorruptError(
                f"cannot append: {describe_damage(damage)}; a resume repairs only an unfinished last record, "
                f"so restore the trace from a copy", damage[0].path)
        path, offset = self._reader.tail
        self._cut(path, offset, list(damage))

    def _cut(self, path: Path, offset: int, damage: list[Damage]) -> None:
        if offset < HEADER_SIZE:
            path.unlink()
            sidecar.sidecar_path(path).unlink(missing_ok=True)
        else:
            os.truncate(path, offset)
        self.repaired += damage
        self._reader = TraceReader(self.dir, self.schema, first_step=self.first_step)
        if self._reader.damage:
            raise TraceCorruptError(f"cannot append: {describe_damage(self._reader.damage)}", self._reader.damage[0].path)

    def append(self, rec: StepRecord) -> bool:
        """Writes the record; returns False when it was already recorded bit-identically."""
        self._surface()
        if self._broken:
            raise StepOrderError(f"trace writer stopped after an earlier failure ({self._broken}); resume the run")
        if self.next_step is None and self.first_step is not None and rec.step != self.first_step:
            raise StepOrderError(f"step {rec.step} cannot start the trace of {self.run_path}: run.json says it "
                                 f"starts at step {self.first_step}")
        if self.next_step is not None and rec.step < self.next_step:
            if rec.step < self._reader.start:
                raise StepOrderError(f"step {rec.step} is before the first recorded step {self._reader.start}")
            existing = self._existing(rec.step)
            if same_bits(self.schema, existing, rec):
                return False
            raise ResumeDivergedError(
                f"{self.run_path}: step {rec.step} is already recorded with different content: this run is not "
                f"reproducing itself (compare the record with `replay show`), or it was resumed with a different config"
            )
        if self.next_step is not None and rec.step > self.next_step:
            raise StepOrderError(f"step {rec.step} would leave a gap: the trace ends before step {self.next_step}")
        raw = encode_record(self.schema, rec)
        frame = encode_frame(self._cctx.compress(raw))
        doing = f"writing the record of step {rec.step}"
        if self._fd is None:
            self._start_segment(rec.step, doing)
        offset = self._size
        self._write(frame, doing)
        crc = int.from_bytes(frame[4:FRAME_HEAD], "little")
        self._builder.add(raw, offset, crc)
        if self._tix is not None:  # after the frame: an entry never vouches for a frame not written
            self._pending.append(self._entry.head(raw, rec.step, self._size, crc))
        self._count += 1
        self.next_step = rec.step + 1
        if self._count >= self.segment_records:
            self._seal()
        elif len(self._pending) >= SIDECAR_BATCH:
            self._write_pending()
        return True

    def _existing(self, step: int) -> StepRecord:
        if step >= self._reader.end:  # written by this writer after it opened
            self._reader = TraceReader(self.dir, self.schema, first_step=self.first_step)
        return self._reader.read(step)

    def _last_recorded(self) -> int | None:
        return self.next_step - 1 if self.next_step is not None else None

    def _failed(self, e: OSError, doing: str, path: Path | None = None, last: int | None = -1) -> Exception:
        """The error to raise for a failed write; the writer refuses to continue after it.
        `last`: the last step recorded safely, when not the last appended (a failed seal's)."""
        path = path or self._path or self.dir
        self._broken = f"{e.strerror or e} {doing} to {path}"
        if e.errno in DISK_FULL_ERRNOS:
            last = self._last_recorded() if last == -1 else last
            return DiskFullError(disk_full_message(path, doing, last, self.run_path), str(path), last)
        return e

    def _start_segment(self, first_step: int, doing: str) -> None:
        path = self.dir / segment_name(first_step)
        try:
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
        except OSError as e:
            raise self._failed(e, doing, path) from None
        self._path = path
        self._count, self._crc, self._first, self._size = 0, 0, first_step, 0
        self._builder = IndexBuilder(self.schema, first_step, self.segment_records)
        self._write(encode_header(self._digest, first_step), doing)
        try:
            self._tix = os.open(sidecar.sidecar_path(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
        except OSError as e:
            self._drop_sidecar(e)
        else:
            self._append_sidecar(sidecar.header(self.schema, first_step))

    def _write(self, data: bytes, doing: str) -> None:
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError as e:
            raise self._failed(e, doing) from None
        self._crc = crc32(data, self._crc)
        self._size += len(data)

    def _fsync(self, doing: str) -> None:
        try:
            os.fsync(self._fd)
        except OSError as e:
            raise self._failed(e, doing) from None

    def _seal(self) -> None:
        """Seals the segment (its seal written here), then hands its fsync, close and index to
        the seal thread (a crash before the index leaves a sealed segment without one: readers
        build it in memory, a resume writes it). Waits for the previous seal first."""
        doing = f"sealing {self._path.name}"
        end, content_crc = self._size, self._crc
        self._wait_seal()
        self._surface()  # the previous seal's failure first
        self._write(encode_seal(self._count, content_crc), doing)
        self._close_sidecar(unlink=True)  # sealed: opened by its seal from now on
        fd, self._fd = self._fd, None
        builder, self._builder = self._builder, None
        job = (fd, self._path, builder, end, content_crc, self._size, doing, self._last_recorded())
        self._sealed_synced.clear()
        self._sealing = threading.Thread(target=self._finish_seal, args=job, name=f"replay-seal-{self._path.name}")
        self._sealing.start()

    def _finish_seal(self, fd: int, path: Path, builder: IndexBuilder, end: int, content_crc: int, size: int,
                     doing: str, last: int | None) -> None:
        """The seal thread: never raises; what failed is kept for the caller's thread (`_surface`)."""
        try:  # background work: where cores are short the loop's thread goes first (Linux: per thread)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        except (AttributeError, OSError):
            pass
        try:
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            self._seal_error = (e, doing, path, last)
            return
        finally:
            self._sealed_synced.set()
        try:
            self._write_index(builder, path, end, content_crc, size, consume=True)
        except BaseException as e:  # noqa: BLE001 - a bug: raised on the caller's thread, never lost
            self._seal_error = (e, None, path, last)

    def _wait_seal(self) -> None:
        if self._sealing is not None:
            self._sealing.join()
            self._sealing = None

    def _surface(self) -> None:
        """Raises, on the caller's thread, what the seal thread failed at (once; the writer stops)."""
        if self._seal_error is None and (self._sealing is None or self._sealing.is_alive()):
            return
        self._wait_seal()
        if self._seal_error is not None:
            (e, doing, path, last), self._seal_error = self._seal_error, None
            if doing is None:
                self._broken = f"indexing {path.name} failed ({e!r})"
                raise e
            raise self._failed(e, doing, path, last) from None

    def _write_index(self, builder: IndexBuilder, segment: Path, end: int, content_crc: int, size: int,
                     consume: bool = False) -> None:
        """The index is derived data: failing to write it (a full disk) loses nothing recorded, so
        it is a note, not an error; the next write to the full disk raises DiskFullError. A
        compacting writer compacts the segment first (traces/compaction.py: its index is then the
        hashes' only copy); failing that, the sealed segment stays as it was, without an index
        (readers index it in memory; a resumed writer compacts it)."""
        path = index_path(segment)
        try:
            if not self.compact:
                builder.write(path, end, content_crc, size, consume)
                return
            try:
                new_end, new_crc, new_size = compaction.compact(segment, self.schema, builder, end)
                builder.write(path, new_end, new_crc, new_size, consume, compacted=True)
                compaction.replace(segment)
            except (OSError, TraceCorruptError):
                compaction.tmp_path(segment).unlink(missing_ok=True)
                path.unlink(missing_ok=True)  # a version-4 index whose compacted segment did not replace this one
                raise
        except (OSError, TraceCorruptError) as e:
            path.with_name(path.name + ".tmp").unlink(missing_ok=True)
            why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            self.notes.append(f"{path}: not written ({why}); readers index {segment.name} in memory")

    def flush(self) -> None:
        """fsync the open segment: records already survive a kill -9; this covers power loss.
        Waits for the fsync of a segment sealed just before (the seal thread's), not for its
        index, and raises what that fsync failed at."""
        self._sealed_synced.wait()
        self._surface()
        if self._builder is not None:
            self._write_pending()  # not fsynced: derived, and checked when read
        if self._fd is not None and not self._broken:
            self._fsync("flushing the trace")

    def close(self) -> None:
        """Waits for the seal in flight, then closes the open segment; after a failed write only
        closes it (the error was raised already). A seal that failed is raised here, after the
        open segment is closed."""
        try:
            self._close_open()
        finally:
            self._surface()

    def _close_open(self) -> None:
        self._wait_seal()
        self._close_sidecar(unlink=False)
        if self._fd is None:
            return
        try:
            if not self._broken:
                self._fsync("closing the trace")
        finally:
            os.close(self._fd)
            self._fd = None

