"""The trace: append-only segment files of checksummed, zstd-compressed step records.

segment.py defines the byte layouts, writer.py is the only code that writes them, index.py
the sidecar index of a sealed segment, opening.py how a reader learns the segments (and the
damage) from the files; FORMAT.md beside them is the spec. A segment holds a
contiguous run of steps. Each record is one frame written with a single write() call, so a
writer killed at any moment leaves at most one partial frame at the tail, which the reader
reports (file, byte offset, step) and never returns. Full segments are sealed with a footer
holding their record count and a checksum of all their bytes, and get an index, so a reader
learns a segment's steps from its last 20 bytes and finds step k's frame in the index.

Costs at 1.4M steps of 1,024 examples (86 segments of 16,384 records, ~12 KB a step):
opening reads 48 bytes a sealed segment, and the unsealed tail's sidecar (~60 bytes a record;
without one, the tail itself, up to ~200 MB, with every frame's checksum); reading step k reads its segment's offsets column once
(~130 KB) and the frame (~12 KB).
"""

from __future__ import annotations

import os
import struct
from collections import OrderedDict
from pathlib import Path
from typing import Iterator

import numpy as np
import zstandard

from traces.checksum import crc32
from traces.errors import SchemaError, TraceCorruptError
from traces.index import INDEX_HEADER_SIZE, IndexBuilder, IndexUnusable, MemoryIndex, StepColumns, index_path
from traces.compaction import check_rows, splice
from traces.index_file import FileIndex
from traces.opening import Damage, _Segment, describe_damage, open_segments, reopen_compacted  # noqa: F401 - Damage re-exported
from traces.schema import Schema, StepRecord, decode_record
from traces.storage import as_path, is_remote
from traces.segment import (  # noqa: F401 - re-exported: the layout's names have always been here
    COMPACT_VERSION, DEFAULT_SEGMENT_RECORDS, FORMAT_VERSION, FRAME_HEAD, HEADER_SIZE, MAX_FRAME_BYTES, SEAL_MARK, SEAL_SIZE,
    SEGMENT_MAGIC, SEGMENT_SUFFIX, SegmentFile, _compressor, _decompressor, check_frames, encode_frame, encode_header,
    encode_seal, parse_seal, read_at, read_header, segment_name, walk_frames,
)

_FRAME = struct.Struct("<II")
READ_AHEAD = 16  # remote segments whose index headers are requested together (traces/storage/path.py)
_BUILD_CHUNK = 1024  # frames read at once when building an index (~12 MB at 1,024 examples a step)
STEPS_HASHES_HELD = 16  # single steps' hashes of compacted segments held (8 KB each at 1,024 examples)


def _bound_by_frames(index: FileIndex, seg: _Segment) -> FileIndex:
    """A damaged compacted segment's index, when its columns hold the frames still readable (their
    offsets and checksums): its hashes are theirs. Else IndexUnusable."""
    cols, n = index.columns(), seg.count
    if index.count < n or not np.array_equal(cols.offsets[: n + 1], seg.offsets[: n + 1]) or \
            not np.array_equal(cols.frame_crc[:n], np.asarray(seg.frame_crcs, np.uint32)):
        raise IndexUnusable("it describes another version of its segment (stale)")
    return index


def corrupt(path: Path, step: int, offset: int, reason: str) -> TraceCorruptError:
    return TraceCorruptError(f"{path}: damaged at step {step} (byte {offset}): {reason}", str(path), step)


class TraceReader:
    """Random access to the readable steps of a trace directory: `reader.read(step)`.

    Opening reads every sealed segment's header and seal (48 bytes each) and the last, unsealed
    segment's sidecar (its frames past the sidecar, and its last frame, checked; without a usable
    sidecar the segment whole, checking each of its frames). `start`..`end` (exclusive) is the
    contiguous range of steps that can be read; `damage` lists where and why reading stops
    before the files do, and, when `first_step` is given, that the readable start is later
    than it (leading files missing). A sealed segment's frames are checked as they are read,
    and all of them by verify().
    """

    def __init__(self, trace_dir: str | os.PathLike, schema: Schema, cache_segments: int = 2,
                 first_step: int | None = None):
        self.dir = as_path(trace_dir)
        self.first_step = first_step  # where the trace must start (run.json), None when not recorded
        self.schema = schema
        self._digest = schema.digest()
        self._dctx = _decompressor()
        self._memory: OrderedDict[tuple, MemoryIndex] = OrderedDict()  # indexes built in memory, most recent last
        self._cache_size = max(1, cache_segments)
        self._steps_hashes: OrderedDict[tuple, np.ndarray] = OrderedDict()  # single steps' hashes read lately
        self.segments: list[_Segment] = []
        self.damage: list[Damage] = []
        self.notes: list[str] = []  # what was rebuilt (an index missing or damaged), once each
        self.tail: tuple[Path, int] | None = None  # (file, byte offset) where a writer would truncate
        self._headers_ahead: set[int] = set()  # segments whose index header was requested ahead (remote)
        open_segments(self)

    @property
    def start(self) -> int:
        return self.segments[0].first_step if self.segments else (self.first_step or 0)

    @property
    def end(self) -> int:
        return self.segments[-1].first_step + self.segments[-1].count if self.segments else self.start

    def __len__(self) -> int:
        return self.end - self.start

    def __contains__(self, step: int) -> bool:
        return self.start <= step < self.end

    # Indexes ----------------------------------------------------------------------------
    def _file_index(self, i: int) -> FileIndex | None:
        seg = self.segments[i]
        damaged_compacted = not seg.sealed and seg.frame_crcs is not None
        if seg.index is None and (seg.sealed or damaged_compacted) and not seg.index_unusable:
            path = index_path(seg.path)
            if is_remote(path) and i not in self._headers_ahead:
                self._read_ahead(i)
            if path.is_file():
                try:
                    if damaged_compacted:
                        seg.index = _bound_by_frames(FileIndex(path, self.schema, seg.first_step, None, None, None), seg)
                    else:
                        seg.index = FileIndex(path, self.schema, seg.first_step, seg.count, seg.content_crc, seg.size)
                except IndexUnusable as e:
                    self._index_unusable(seg, e)
            else:
                self._note("segments without an index file (recorded before replay wrote them) are indexed in memory "
                           "when needed, reading each once; traces.write_indexes(RUN) writes them")
        return seg.index

    def _read_ahead(self, i: int) -> None:
        """On object storage, the index headers of the next READ_AHEAD segments are requested at
        once: every scan reads them segment by segment, so one round trip a window, not a segment."""
        window = [j for j in range(i, min(i + READ_AHEAD, len(self.segments))) if j not in self._headers_ahead]
        self._headers_ahead.update(window)
        paths = [index_path(self.segments[j].path) for j in window
                 if self.segments[j].sealed and self.segments[j].index is None]
        self.dir.view.prefetch([(p.key, 0, INDEX_HEADER_SIZE) for p in paths if p.is_file()])

    def _cached(self, key, build):
        if key in self._memory:
            self._memory.move_to_end(key)
            return self._memory[key]
        built = self._memory[key] = build()
        while len(self._memory) > self._cache_size:
            self._memory.popitem(last=False)
        return built

    def index(self, i: int) -> FileIndex | MemoryIndex:
        """Segment i's index: its file when usable, else built in memory from the segment (read
        once in chunks, every checksum checked; 8 bytes an example held; the last
        `cache_segments` built are kept)."""
        found = self._file_index(i)
        if found is not None:
            return found
        if self.segments[i].version >= COMPACT_VERSION:  # its records cannot rebuild it
            raise self._lost(i, "it is missing or cannot be used")
        return self._cached(("index", i), lambda: self._memory_index(i, keep_hashes=True))

    def _memory_index(self, i: int, keep_hashes: bool) -> MemoryIndex:
        builder, end = self.index_builder(i, keep_hashes)
        return builder.memory_index(end)

    def _index_unusable(self, seg: _Segment, e: Exception) -> None:
        seg.index, seg.index_unusable = None, True
        if seg.sealed:
            seg.offsets = None  # they may have come from it: walk the segment instead
        self._note(f"{index_path(seg.path)} cannot be used ({e}): rebuilt in memory from its segment; delete it and run "
                   "traces.write_indexes(RUN) to write it again")

    def _note(self, line: str) -> None:
        if line not in self.notes:
            self.notes.append(line)

    def with_index(self, i: int, use):
        """use(index) for segment i; an index file found damaged while used is replaced by one
        built from the segment, and `use` runs again."""
        try:
            return use(self.index(i))
        except IndexUnusable as e:
            self._index_unusable(self.segments[i], e)
            return use(self.index(i))

    def columns(self, i: int) -> StepColumns:
        """Segment i's index columns; without an index file, decoded from its records (the
        tail's, or an old segment's) without keeping their example hashes."""
        if self._file_index(i) is not None:
            try:
                return self.segments[i].index.columns()
            except IndexUnusable as e:
                self._index_unusable(self.segments[i], e)
        if self.segments[i].columns is not None:  # the tail's, from its sidecar: no record read
            return self.segments[i].columns
        if ("index", i) in self._memory:
            return self._cached(("index", i), None).columns()
        return self._cached(("columns", i), lambda: self._memory_index(i, keep_hashes=False)).columns()

    def column(self, i: int, name: str) -> np.ndarray:
        """Segment i's index column `name`: alone from an index file of version 2, else columns(i)'s."""
        index = self._file_index(i)
        if index is not None:
            try:
                return index.column(name)
            except IndexUnusable as e:
                self._index_unusable(self.segments[i], e)
        return getattr(self.columns(i), name)

    def summary(self, i: int) -> bytes | None:
        """Segment i's summary (FORMAT.md) from its index file's header; None without one (or version 1)."""
        return getattr(self._file_index(i), "summary", None)

    def index_builder(self, i: int, keep_hashes: bool = True) -> tuple[IndexBuilder, int]:
        """(an IndexBuilder holding segment i's records, where its frames end), read from the
        segment CHUNK frames at a time, every frame's checksum and (sealed) the seal's checked:
        what an index file, or one in memory, is built from."""
        seg = self.segments[i]
        offsets = self.offsets(i)
        builder = IndexBuilder(self.schema, seg.first_step, seg.count, keep_hashes)
        crc = crc32(read_at(seg.path, 0, int(offsets[0]), seg.first_step))
        compacted = seg.version >= COMPACT_VERSION
        for a in range(0, seg.count, _BUILD_CHUNK):
            b = min(seg.count, a + _BUILD_CHUNK)
            data, base, offs = self.frames(i, a, b)
            if self.segments[i] is not seg:  # compacted since this reader opened it: built from that one
                return self.index_builder(i, keep_hashes)
            rows = self.segment_hashes(i, a, b) if compacted else [None] * (b - a)
            crc = crc32(data, crc)
            view = memoryview(data)
            for k in range(b - a):
                at, stop = int(offs[k]) - base, int(offs[k + 1]) - base
                builder.add(self._raw(seg, seg.first_step + a + k, view[at + FRAME_HEAD : stop], rows[k]), int(offs[k]),
                            _FRAME.unpack_from(view, at)[1])
        if seg.sealed and crc != seg.content_crc:
            raise corrupt(seg.path, seg.first_step, 0, "segment checksum mismatch")
        builder.crc = crc  # of every byte before offsets[-1]: where a writer continues the seal's checksum
        return builder, int(offsets[-1])

    def offsets(self, i: int) -> np.ndarray:
        """Segment i's count + 1 frame offsets: from opening (the tail), its index, or walked
        by frame lengths (8 bytes a frame) when it has no usable index file."""
        seg = self.segments[i]
        for key in (("index", i), ("columns", i)):
            if seg.offsets is None and key in self._memory:
                seg.offsets = self._memory[key].columns().offsets
        if seg.offsets is None and seg.sealed and self._file_index(i) is not None:
            try:
                seg.offsets = seg.index.column("offsets")
            except IndexUnusable as e:
                self._index_unusable(seg, e)
        if seg.offsets is None:
            with SegmentFile(seg.path, seg.first_step) as f:
                walk = walk_frames(f, bodies=False)
            if len(walk.offsets) < seg.count + 1 or not walk.sealed:
                k = min(len(walk.offsets), seg.count + 1) - 1
                raise corrupt(seg.path, seg.first_step + k, walk.offsets[k], walk.damage or "its seal does not follow its records")
            seg.offsets = np.array(walk.offsets, np.uint64)
        return seg.offsets

    # Records ----------------------------------------------------------------------------
    def _segment_index(self, step: int) -> int:
        lo, hi = 0, len(self.segments) - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.segments[mid].first_step <= step:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _frame_body(self, seg: _Segment, k: int, step: int) -> bytes:
        at, end = int(seg.offsets[k]), int(seg.offsets[k + 1])
        frame = read_at(seg.path, at, end - at, step)
        if check_frames(frame, at, [at, end]) is not None or len(frame) != end - at:
            i = self._segment_index(step)
            if self.reopened(i):
                self.offsets(i)
                return self._frame_body(self.segments[i], k, step)
            raise corrupt(seg.path, step, at, "record checksum mismatch")
        return frame[FRAME_HEAD:]

    def reopened(self, i: int) -> bool:
        """Whether segment i was compacted by a live run's writer since this reader opened it, and
        is now read as the compacted segment (traces/opening.py `reopen_compacted`): the caller
        whose read of it failed reads it again."""
        if not reopen_compacted(self, i):
            return False
        for key in [key for key in self._memory if key[1] == i]:
            del self._memory[key]
        return True

    def raw_frame(self, step: int) -> bytes:
        """The stored (compressed) body of a step's frame, checksum verified."""
        if step not in self:
            raise IndexError(f"step {step} is not in the trace (readable steps {self.start}..{self.end - 1})")
        i = self._segment_index(step)
        seg = self.segments[i]
        self.offsets(i)
        return self._frame_body(seg, step - seg.first_step, step)

    def _raw(self, seg: _Segment, step: int, body, row: np.ndarray | None = None) -> bytes:
        """A record decompressed, its step checked; a compacted segment's with its example hashes
        put back (traces/compaction.py): `row`, or the step's own from the index."""
        try:
            raw = self._dctx.decompress(body)
        except zstandard.ZstdError as e:
            raise TraceCorruptError(f"{seg.path}: record of step {step} is unreadable: {e}", str(seg.path), step) from None
        if len(raw) < 8 or struct.unpack_from("<Q", raw)[0] != step:
            held = struct.unpack_from("<Q", raw)[0] if len(raw) >= 8 else None
            raise TraceCorruptError(f"{seg.path}: record at step {step}'s place holds step {held}", str(seg.path), step)
        if seg.version >= COMPACT_VERSION:
            if row is None:
                i = self._segment_index(step)
                row = self.segment_hashes(i, step - seg.first_step, step - seg.first_step + 1)[0]
            raw = splice(self.schema, raw, row)
        return raw

    def segment_hashes(self, i: int, lo: int, hi: int) -> np.ndarray:
        """uint64 (hi - lo, B): the example hashes of records lo..hi-1 of compacted segment i, from
        its index (their only copy), each step's checked against its examples key. A few steps read
        their buckets' table blocks; more than 1/64 of the segment rebuilds all of its hashes once
        (8 bytes an example, kept among the `cache_segments` indexes held in memory)."""
        seg = self.segments[i]
        if ("hashes", i) in self._memory:
            return self._cached(("hashes", i), None)[lo:hi]
        index = self._file_index(i)
        if not isinstance(index, FileIndex):
            raise self._lost(i, "it is missing or cannot be used")
        try:
            if index.reads_whole_table((hi - lo) * self.schema.examples_per_step):
                return self._cached(("hashes", i), lambda: self._checked_rows(i, index, 0, seg.count))[lo:hi]
            if hi - lo != 1:
                return self._checked_rows(i, index, lo, hi)
            # One step: read again and again by a command that looks at one step several ways (a
            # bisect compares the step, reads it, then finds where its examples were fed before:
            # 4 reads of each run's, ~50 ms each at 1,024 examples), so the last few are held.
            key = (seg.path.name, lo)
            if key in self._steps_hashes:
                self._steps_hashes.move_to_end(key)
                return self._steps_hashes[key]
            rows = self._steps_hashes[key] = self._checked_rows(i, index, lo, hi)
            rows.flags.writeable = False  # held: a caller must not change what the next one reads
            while len(self._steps_hashes) > STEPS_HASHES_HELD:
                self._steps_hashes.popitem(last=False)
            return rows
        except IndexUnusable as e:
            self._index_unusable(seg, e)
            raise self._lost(i, str(e)) from None

    def hash_reads(self, i: int, lo: int, hi: int) -> list[tuple[int, int]]:
        """The index reads (offset, size) segment_hashes(i, lo, hi) starts with; none when it needs
        none (not a compacted segment, or its hashes held): a remote scan requests them ahead."""
        seg = self.segments[i]
        if seg.version < COMPACT_VERSION or ("hashes", i) in self._memory:
            return []
        index = self._file_index(i)
        if not isinstance(index, FileIndex):
            return []
        B = self.schema.examples_per_step
        if index.reads_whole_table((hi - lo) * B):
            lo, hi = 0, seg.count
        return index.slot_hashes_spans(lo * B, hi * B)

    def _checked_rows(self, i: int, index: FileIndex, lo: int, hi: int) -> np.ndarray:
        seg, B = self.segments[i], self.schema.examples_per_step
        rows = index.slot_hashes(lo * B, hi * B).reshape(hi - lo, B)
        check_rows(self.schema, rows, index.column("examples_key")[lo:hi], index.path, seg.first_step + lo)
        return rows

    def _lost(self, i: int, why: str) -> TraceCorruptError:
        seg = self.segments[i]
        path = index_path(seg.path)
        return TraceCorruptError(
            f"{path}: {why}; it holds the only copy of the example hashes of steps {seg.first_step}.."
            f"{seg.first_step + seg.count - 1} (a compacted segment): restore the run's trace folder from a copy",
            str(path), seg.first_step)

    def raw_record(self, step: int) -> bytes:
        """A step's record, decompressed (checksum and step checked)."""
        body = self.raw_frame(step)  # first: a segment compacted since it was opened is re-opened here
        return self._raw(self.segments[self._segment_index(step)], step, body)

    def read(self, step: int) -> StepRecord:
        raw = self.raw_record(step)
        seg = self.segments[self._segment_index(step)]
        try:
            return decode_record(self.schema, raw)
        except SchemaError as e:
            raise TraceCorruptError(f"{seg.path}: record of step {step} is unreadable: {e}", str(seg.path), step) from None

    def records(self, start: int | None = None, stop: int | None = None) -> Iterator[StepRecord]:
        start = self.start if start is None else max(start, self.start)
        stop = self.end if stop is None else min(stop, self.end)
        for step in range(start, stop):
            yield self.read(step)

    def frames(self, i: int, lo: int, hi: int) -> tuple[bytes, int, np.ndarray]:
        """(bytes, their file offset, frame offsets) of segment i's records lo..hi-1 (counted in the
        segment), read at once, every frame's checksum checked."""
        seg = self.segments[i]
        offsets = self.offsets(i)[lo : hi + 1]
        base = int(offsets[0])
        data = read_at(seg.path, base, int(offsets[-1]) - base, seg.first_step + lo)
        bad = check_frames(data, base, offsets, lo) if len(data) == int(offsets[-1]) - base else lo
        if bad is not None and self.reopened(i):
            return self.frames(i, lo, hi)
        if bad is not None:
            raise corrupt(seg.path, seg.first_step + bad, int(self.offsets(i)[bad]), "record checksum mismatch")
        return data, base, offsets

    def segment_bytes(self, index: int) -> bytes:
        """A whole segment file's bytes, verified (each frame's checksum, and its seal's)."""
        return checked_segment(self, index)[0]

    def check_bytes(self, start: int | None = None, stop: int | None = None) -> None:
        """Checks the checksums of every segment holding a step of start..stop-1 (traces/verify.py):
        what a verdict vouching for those steps rests on. Raises the damage, naming its step."""
        check_bytes(self, start, stop)

    def verify(self) -> list[Damage]:
        """Checks every frame of every segment; returns all damage (open-time damage included).
        Reads the whole trace, one segment at a time."""
        return verify(self)


from traces.verify import check_bytes, checked_segment, verify  # noqa: E402 - verify.py reads through TraceReader
