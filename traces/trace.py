"""The trace: append-only segment files of checksummed, zstd-compressed step records.

This module defines the byte layouts and reads them; writer.py is the only code that writes
them; FORMAT.md beside them is the spec. A segment holds a contiguous run of steps. Each
record is one frame written with a single write() call, so a writer killed at any moment
leaves at most one partial frame at the tail, which the reader reports (file, byte offset,
step) and never returns. Full segments are sealed with a footer holding their record count
and a checksum of all their bytes, so a reader can jump to step k by file name and footer
without touching the rest of the trace.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import zstandard

from traces.errors import NewerFormatError, SchemaError, TraceCorruptError
from traces.schema import Schema, StepRecord, decode_record

FORMAT_VERSION = 1
SEGMENT_MAGIC = b"RPLYSEG1"
SEGMENT_SUFFIX = ".seg"
DEFAULT_SEGMENT_RECORDS = 16384
MAX_FRAME_BYTES = 64 << 20
SEAL_MARK = 0xFFFFFFFF
_HEADER = struct.Struct("<8sHHIQ")  # magic, format_version, reserved, schema digest, first step
_HEADER_CRC = struct.Struct("<I")
HEADER_SIZE = _HEADER.size + _HEADER_CRC.size
_FRAME = struct.Struct("<II")  # body length, crc32 of (length bytes + body)
_SEAL = struct.Struct("<IQII")  # SEAL_MARK, record count, crc32 of all bytes before the seal, crc32 of those 16 bytes

# Magicless zstd frames: the frame header already identifies the record, and 4 bytes a step matter.
_ZSTD_PARAMS = zstandard.ZstdCompressionParameters.from_level(
    3, format=zstandard.FORMAT_ZSTD1_MAGICLESS, write_checksum=0, write_content_size=1, write_dict_id=0
)


def _compressor() -> zstandard.ZstdCompressor:
    return zstandard.ZstdCompressor(compression_params=_ZSTD_PARAMS)


def _decompressor() -> zstandard.ZstdDecompressor:
    return zstandard.ZstdDecompressor(format=zstandard.FORMAT_ZSTD1_MAGICLESS)


def segment_name(first_step: int) -> str:
    return f"{first_step:012d}{SEGMENT_SUFFIX}"


def encode_header(schema_digest: int, first_step: int) -> bytes:
    head = _HEADER.pack(SEGMENT_MAGIC, FORMAT_VERSION, 0, schema_digest, first_step)
    return head + _HEADER_CRC.pack(zlib.crc32(head))


def encode_frame(body: bytes) -> bytes:
    length = struct.pack("<I", len(body))
    return length + struct.pack("<I", zlib.crc32(body, zlib.crc32(length))) + body


def encode_seal(count: int, content_crc: int) -> bytes:
    head = struct.pack("<IQI", SEAL_MARK, count, content_crc)
    return head + struct.pack("<I", zlib.crc32(head))


@dataclass(frozen=True)
class Damage:
    """A place where the trace stops being readable. `step` is the first step not returned."""

    path: str
    offset: int
    step: int | None
    reason: str

    def __str__(self) -> str:
        at = f" at step {self.step}" if self.step is not None else ""
        return f"{self.path}: damaged from byte {self.offset}{at}: {self.reason}"


def describe_damage(damages: list[Damage]) -> str:
    """One line: the first damage (file, byte, step, reason) and how many more there are."""
    if not damages:
        return "no damage found"
    more = len(damages) - 1
    return str(damages[0]) + (f" (and {more} more damage{'s' if more > 1 else ''})" if more else "")


@dataclass
class _Scan:
    """Frame offsets of one segment's good records, and where (and why) the good part ends."""

    offsets: list[int]
    end: int
    sealed: bool
    damage: str | None


def _scan_frames(data: bytes, first_step: int, schema: Schema, check_steps: bool) -> _Scan:
    """Walks frames from the header on; stops at the seal, the end, or the first bad frame."""
    offsets: list[int] = []
    pos = HEADER_SIZE
    dctx = _decompressor() if check_steps else None
    while pos < len(data):
        if len(data) - pos < _FRAME.size:
            return _Scan(offsets, pos, False, "truncated frame header")
        length, crc = _FRAME.unpack_from(data, pos)
        if length == SEAL_MARK:
            if len(data) - pos != _SEAL.size:
                return _Scan(offsets, pos, False, "seal is not the last thing in the segment")
            mark, count, content_crc, seal_crc = _SEAL.unpack_from(data, pos)
            if seal_crc != zlib.crc32(data[pos : pos + 16]) or count != len(offsets):
                return _Scan(offsets, pos, False, "seal checksum or count mismatch")
            if content_crc != zlib.crc32(memoryview(data)[:pos]):
                return _Scan(offsets, pos, False, "segment checksum mismatch")
            return _Scan(offsets, pos, True, None)
        if length > MAX_FRAME_BYTES:
            return _Scan(offsets, pos, False, f"frame length {length} is implausible")
        end = pos + _FRAME.size + length
        if end > len(data):
            return _Scan(offsets, pos, False, "truncated frame (the writer stopped mid-record)")
        body = memoryview(data)[pos + _FRAME.size : end]
        if zlib.crc32(body, zlib.crc32(data[pos : pos + 4])) != crc:
            return _Scan(offsets, pos, False, "record checksum mismatch")
        if check_steps:
            try:
                raw = dctx.decompress(body)
                step = struct.unpack_from("<Q", raw)[0]
            except (zstandard.ZstdError, struct.error):
                return _Scan(offsets, pos, False, "record does not decompress")
            if step != first_step + len(offsets):
                return _Scan(offsets, pos, False, f"record holds step {step}, expected {first_step + len(offsets)}")
        offsets.append(pos)
        pos = end
    return _Scan(offsets, pos, False, None)


def read_header(path: Path, data: bytes) -> tuple[int, int]:
    """(schema digest, first step) of a segment; raises TraceCorruptError/NewerFormatError."""
    if len(data) < HEADER_SIZE:
        raise TraceCorruptError(f"{path}: segment is shorter than its header", str(path))
    magic, version, _, digest, first = _HEADER.unpack_from(data)
    if magic != SEGMENT_MAGIC:
        raise TraceCorruptError(f"{path}: not a trace segment (bad magic)", str(path))
    if _HEADER_CRC.unpack_from(data, _HEADER.size)[0] != zlib.crc32(data[: _HEADER.size]):
        raise TraceCorruptError(f"{path}: segment header checksum mismatch", str(path))
    if version > FORMAT_VERSION:
        raise NewerFormatError(
            f"{path}: written by trace format_version {version}, this replay reads up to {FORMAT_VERSION}: upgrade replay"
        )
    return digest, first


@dataclass
class _Segment:
    path: Path
    first_step: int
    count: int
    sealed: bool


class TraceReader:
    """Random access to the readable steps of a trace directory: `reader.read(step)`.

    Opening reads every segment header and seal (a few dozen bytes each) and scans only the
    last, unsealed segment. `start`..`end` (exclusive) is the contiguous range of steps that
    can be read; `damage` lists where and why reading stops before the files do, and, when
    `first_step` is given, that the readable start is later than it (leading files missing).
    """

    def __init__(self, trace_dir: str | os.PathLike, schema: Schema, cache_segments: int = 2,
                 first_step: int | None = None):
        self.dir = Path(trace_dir)
        self.first_step = first_step  # where the trace must start (run.json), None when not recorded
        self.schema = schema
        self._digest = schema.digest()
        self._dctx = _decompressor()
        self._cache: OrderedDict[int, tuple[bytes, list[int]]] = OrderedDict()
        self._cache_size = cache_segments
        self.segments: list[_Segment] = []
        self.damage: list[Damage] = []
        self.tail: tuple[Path, int] | None = None  # (file, byte offset) where a writer would truncate
        self._open()

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

    def _open(self) -> None:
        paths = sorted(self.dir.glob("*" + SEGMENT_SUFFIX)) if self.dir.is_dir() else []
        expected: int | None = None
        for i, path in enumerate(paths):
            stop = self._open_segment(path, expected, is_last=i == len(paths) - 1)
            if stop:
                self._unreachable(paths[i + 1 :])
                break
            expected = self.segments[-1].first_step + self.segments[-1].count
        self._check_start(paths)

    def _unreachable(self, later: list[Path]) -> None:
        """One entry for every segment after the damage, however many: the first damage is the news."""
        if later:
            names = later[0].name + (f" .. {later[-1].name}" if len(later) > 1 else "")
            self.damage.append(Damage(str(later[0]), 0, None,
                                      f"{len(later)} later segment(s) unreachable: {names} follow the damaged segment"))

    def _check_start(self, paths: list[Path]) -> None:
        """A trace whose first file starts after the recorded first step has lost its leading files."""
        if self.first_step is None or not paths:
            return
        first = self.segments[0].first_step if self.segments else None
        if first is None:
            try:  # the first file is damaged; its header may still say where it starts
                first = read_header(paths[0], _read_ends(paths[0])[0])[1]
            except (TraceCorruptError, NewerFormatError):
                return
        if first > self.first_step:
            self.damage.insert(0, Damage(
                str(self.dir / segment_name(self.first_step)), 0, self.first_step,
                f"missing: run.json says the trace starts at step {self.first_step} but its first segment file is "
                f"{paths[0].name}, so steps {self.first_step}..{first - 1} are gone (leading segment files deleted or moved)"))
            self.tail = None  # a writer must refuse this trace, not cut it

    def _open_segment(self, path: Path, expected: int | None, is_last: bool) -> bool:
        """Adds the segment; returns True when reading must stop after it.

        A sealed segment before the last is opened by its header and seal alone, so opening a
        long run reads a few dozen bytes per segment, not the run.
        """
        try:
            head, seal = _read_ends(path)
        except TraceCorruptError as e:
            self.damage.append(Damage(str(path), 0, expected, str(e).split(": ", 1)[-1]))
            return True  # not a tail a writer could cut off: tail stays None
        try:
            digest, first = read_header(path, head)
        except TraceCorruptError as e:
            self.damage.append(Damage(str(path), 0, expected, str(e).split(": ", 1)[-1]))
            self.tail = (path, 0)
            return True
        if digest != self._digest:
            raise SchemaError(f"{path}: segment was written with a different schema than run.json declares")
        if path.name != segment_name(first) or (expected is not None and first != expected):
            self.damage.append(Damage(str(path), 0, expected, f"segment starts at step {first}, expected {expected}"))
            return True
        if seal and not is_last:
            mark, count, _, seal_crc = _SEAL.unpack(seal)
            if mark == SEAL_MARK and seal_crc == zlib.crc32(seal[:16]):
                self.segments.append(_Segment(path, first, count, True))
                return False
        try:
            data = _read_segment_file(path, first)
        except TraceCorruptError as e:
            self.damage.append(Damage(str(path), 0, first, str(e).split(": ", 1)[-1]))
            return True
        scan = _scan_frames(data, first, self.schema, check_steps=True)
        self.segments.append(_Segment(path, first, len(scan.offsets), scan.sealed))
        self._remember(len(self.segments) - 1, data, scan.offsets)
        if scan.damage is not None:
            self.damage.append(Damage(str(path), scan.end, first + len(scan.offsets), scan.damage))
            self.tail = (path, scan.end)
            return True
        if not scan.sealed and not is_last:
            self.damage.append(Damage(str(path), scan.end, first + len(scan.offsets), "segment is not sealed"))
            return True
        return False

    def _remember(self, index: int, data: bytes, offsets: list[int] | None) -> None:
        self._cache[index] = (data, offsets)
        self._cache.move_to_end(index)
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)

    def _corrupt(self, seg: _Segment, step: int, offset: int, reason: str) -> TraceCorruptError:
        return TraceCorruptError(f"{seg.path}: damaged at step {step} (byte {offset}): {reason}", str(seg.path), step)

    def _load(self, index: int, need_offsets: bool = True) -> tuple[bytes, list[int] | None]:
        """A segment's verified bytes (and, when asked, its frame offsets).

        A sealed segment is verified with the one checksum in its seal, which is all compare
        needs; frames are walked only to find a record, and then each is checked on its own.
        """
        seg = self.segments[index]
        if index in self._cache:
            self._cache.move_to_end(index)
            data, offsets = self._cache[index]
        else:
            data, offsets = _read_segment_file(seg.path, seg.first_step), None
            if seg.sealed and len(data) >= HEADER_SIZE + _SEAL.size:
                mark, count, content_crc, seal_crc = _SEAL.unpack_from(data, len(data) - _SEAL.size)
                if (mark, count, seal_crc) != (SEAL_MARK, seg.count, zlib.crc32(data[-_SEAL.size : -4])) or content_crc != zlib.crc32(
                    memoryview(data)[: -_SEAL.size]
                ):
                    need_offsets = True  # locate the damaged record to name its step
            elif seg.sealed:
                raise self._corrupt(seg, seg.first_step, 0, "segment is shorter than its header and seal")
        if need_offsets and offsets is None:
            scan = _scan_frames(data, seg.first_step, self.schema, check_steps=False)
            if len(scan.offsets) < seg.count or (seg.sealed and not scan.sealed):
                reason = scan.damage or "fewer records than its seal says"
                raise self._corrupt(seg, seg.first_step + min(len(scan.offsets), seg.count - 1), scan.end, reason)
            offsets = scan.offsets
        self._remember(index, data, offsets)
        return data, offsets

    def _segment_index(self, step: int) -> int:
        lo, hi = 0, len(self.segments) - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.segments[mid].first_step <= step:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def raw_frame(self, step: int) -> bytes:
        """The stored (compressed) body of a step's frame, checksum verified."""
        if step not in self:
            raise IndexError(f"step {step} is not in the trace (readable steps {self.start}..{self.end - 1})")
        index = self._segment_index(step)
        data, offsets = self._load(index)
        pos = offsets[step - self.segments[index].first_step]
        length, _ = _FRAME.unpack_from(data, pos)
        return data[pos + _FRAME.size : pos + _FRAME.size + length]

    def read(self, step: int) -> StepRecord:
        body = self.raw_frame(step)
        path = self.segments[self._segment_index(step)].path
        try:
            rec = decode_record(self.schema, self._dctx.decompress(body))
        except (zstandard.ZstdError, SchemaError) as e:
            raise TraceCorruptError(f"{path}: record of step {step} is unreadable: {e}", str(path), step) from None
        if rec.step != step:
            raise TraceCorruptError(f"{path}: record at step {step}'s place holds step {rec.step}", str(path), step)
        return rec

    def records(self, start: int | None = None, stop: int | None = None) -> Iterator[StepRecord]:
        start = self.start if start is None else max(start, self.start)
        stop = self.end if stop is None else min(stop, self.end)
        for step in range(start, stop):
            yield self.read(step)

    def segment_bytes(self, index: int) -> bytes:
        """A whole segment file's bytes, verified (used by compare to skip identical segments)."""
        return self._load(index, need_offsets=False)[0]

    def verify(self) -> list[Damage]:
        """Checks every frame of every segment; returns all damage (open-time damage included)."""
        found = list(self.damage)
        for i, seg in enumerate(self.segments):
            try:
                self._load(i)
                for step in range(seg.first_step, seg.first_step + seg.count):
                    self.read(step)
            except TraceCorruptError as e:
                found.append(Damage(str(seg.path), 0, e.step, str(e).split(": ", 1)[-1]))
                break
        return found


def _read_segment_file(path: Path, step: int | None = None) -> bytes:
    """A segment's bytes; a directory or an unreadable file in its place is damage, named."""
    try:
        return path.read_bytes()
    except OSError as e:
        raise _unreadable(path, e, step) from None


def _read_ends(path: Path) -> tuple[bytes, bytes]:
    """A segment's header bytes and its last seal-sized bytes (empty when too short for both)."""
    try:
        with open(path, "rb") as f:
            head = f.read(HEADER_SIZE)
            size = os.fstat(f.fileno()).st_size
            if size < HEADER_SIZE + _SEAL.size:
                return head, b""
            f.seek(size - _SEAL.size)
            return head, f.read(_SEAL.size)
    except OSError as e:
        raise _unreadable(path, e) from None


def _unreadable(path: Path, e: OSError, step: int | None = None) -> TraceCorruptError:
    if isinstance(e, IsADirectoryError):
        reason = "is a directory, not a segment file; move it out of the trace folder"
    else:
        reason = f"cannot be read ({e.strerror or e.__class__.__name__}); check its permissions and the disk"
    return TraceCorruptError(f"{path}: {reason}", str(path), step)
