"""Appending to a trace: the only code that writes segment files (their layout is in trace.py).

Each record is one frame written with one write() call, so a writer that dies at any moment,
or runs out of disk, leaves at most one partial frame at the tail; the next writer cuts it off.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

from traces.errors import (
    DISK_FULL_ERRNOS, DiskFullError, ResumeDivergedError, StepOrderError, TraceCorruptError, disk_full_message,
)
from traces.index import IndexBuilder, IndexUnusable, index_path
from traces.schema import Schema, StepRecord, encode_record, same_bits
from traces.segment import FRAME_HEAD
from traces.trace import (
    DEFAULT_SEGMENT_RECORDS, HEADER_SIZE, Damage, TraceReader, _compressor, describe_damage, encode_frame,
    encode_header, encode_seal, segment_name,
)


class TraceWriter:
    """Appends records to a trace directory, resuming where a previous writer stopped.

    A damaged tail left by a killed writer is cut off (and reported in `repaired`). Appending
    a step that is already recorded succeeds only when it is bit-identical, which is how a
    resumed run proves it re-computed the same steps; a gap is refused (StepOrderError) and
    different content is a divergence (ResumeDivergedError). `first_step`, when given, is where
    the trace must start: the first record of an empty trace must be that step.
    """

    def __init__(self, trace_dir: str | os.PathLike, schema: Schema, segment_records: int = DEFAULT_SEGMENT_RECORDS,
                 first_step: int | None = None):
        self.dir = Path(trace_dir)
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
        self._size = 0  # bytes in the open segment
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
        if sealed >= 0 and not index_path(reader.segments[sealed].path).exists():
            seg = reader.segments[sealed]
            builder, end = reader.index_builder(sealed)
            self._write_index(builder, seg.path, end, seg.content_crc, seg.size)
        if last.sealed:
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
        self._crc, self._count, self._first, self._size = builder.crc, last.count, last.first_step, end
        if self._count >= self.segment_records:  # full but unsealed: the last writer stopped while sealing it
            self._seal()

    @property
    def broken(self) -> str | None:
        """Why this writer stopped (a failed write), or None."""
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
        else:
            os.truncate(path, offset)
        self.repaired += damage
        self._reader = TraceReader(self.dir, self.schema, first_step=self.first_step)
        if self._reader.damage:
            raise TraceCorruptError(f"cannot append: {describe_damage(self._reader.damage)}", self._reader.damage[0].path)

    def append(self, rec: StepRecord) -> bool:
        """Writes the record; returns False when it was already recorded bit-identically."""
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
        self._builder.add(raw, offset, int.from_bytes(frame[4:FRAME_HEAD], "little"))
        self._count += 1
        self.next_step = rec.step + 1
        if self._count >= self.segment_records:
            self._seal()
        return True

    def _existing(self, step: int) -> StepRecord:
        if step >= self._reader.end:  # written by this writer after it opened
            self._reader = TraceReader(self.dir, self.schema, first_step=self.first_step)
        return self._reader.read(step)

    def _last_recorded(self) -> int | None:
        return self.next_step - 1 if self.next_step is not None else None

    def _failed(self, e: OSError, doing: str, path: Path | None = None) -> Exception:
        """The error to raise for a failed write; the writer refuses to continue after it."""
        path = path or self._path or self.dir
        self._broken = f"{e.strerror or e} {doing} to {path}"
        if e.errno in DISK_FULL_ERRNOS:
            last = self._last_recorded()
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

    def _write(self, data: bytes, doing: str) -> None:
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError as e:
            raise self._failed(e, doing) from None
        self._crc = zlib.crc32(data, self._crc)
        self._size += len(data)

    def _fsync(self, doing: str) -> None:
        try:
            os.fsync(self._fd)
        except OSError as e:
            raise self._failed(e, doing) from None

    def _seal(self) -> None:
        """Seals the segment, then writes its index (a crash between the two leaves a sealed
        segment without an index: readers build it in memory, a resume writes it)."""
        doing = f"sealing {self._path.name}"
        end, content_crc = self._size, self._crc
        self._write(encode_seal(self._count, content_crc), doing)
        self._fsync(doing)
        os.close(self._fd)
        self._fd = None
        builder, self._builder = self._builder, None
        self._write_index(builder, self._path, end, content_crc, self._size)

    def _write_index(self, builder: IndexBuilder, segment: Path, end: int, content_crc: int, size: int) -> None:
        """The index is derived data: failing to write it (a full disk) loses nothing recorded, so
        it is a note, not an error; the next write to the full disk raises DiskFullError."""
        path = index_path(segment)
        try:
            builder.write(path, end, content_crc, size)
        except OSError as e:
            path.with_name(path.name + ".tmp").unlink(missing_ok=True)
            self.notes.append(f"{path}: not written ({e.strerror or e}); readers index {segment.name} in memory")

    def flush(self) -> None:
        """fsync the open segment: records already survive a kill -9; this covers power loss."""
        if self._fd is not None and not self._broken:
            self._fsync("flushing the trace")

    def close(self) -> None:
        """Closes the open segment; after a failed write only closes it (the error was raised already)."""
        if self._fd is None:
            return
        try:
            if not self._broken:
                self._fsync("closing the trace")
        finally:
            os.close(self._fd)
            self._fd = None


def write_indexes(trace_dir: str | os.PathLike, schema: Schema) -> list[Path]:
    """Writes the index file of every sealed segment that lacks a usable one (a run recorded
    before replay wrote them, or one whose index was damaged); returns the files written.
    Reads each such segment once, in chunks; checks nothing else."""
    reader = TraceReader(trace_dir, schema)
    written = []
    for i, seg in enumerate(reader.segments):
        if not seg.sealed:
            continue
        index = reader._file_index(i)
        if index is not None:
            try:
                index.columns()
                continue  # usable
            except IndexUnusable:
                pass
        builder, end = reader.index_builder(i)
        builder.write(index_path(seg.path), end, seg.content_crc, seg.size)
        written.append(index_path(seg.path))
    return written
