"""Segment files: their byte layout (header, frames, seal; FORMAT.md) and reading parts of them.

Everything that reads a segment goes through `read_at`/`SegmentFile`, which read with pread
(never mmap): a reader reads only the bytes it needs, and a test can count them (rchar).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import zstandard

from traces.checksum import crc32
from traces.errors import NewerFormatError, TraceCorruptError
from traces.storage import is_remote

FORMAT_VERSION = 3  # the newest run format read and written. 3: sealed segments compacted (traces/compaction.py:
# header version 3, records without example hashes); 2: distance sketches in layer-level records (traces/sketch.py);
# 1 still read
HASHED_VERSION = 2  # a segment header's format_version when its records hold their example hashes
COMPACT_VERSION = 3  # a compacted segment's (sealed; its records without example hashes: traces/compaction.py)
SEGMENT_MAGIC = b"RPLYSEG1"
SEGMENT_SUFFIX = ".seg"
DEFAULT_SEGMENT_RECORDS = 16384
MAX_FRAME_BYTES = 64 << 20
SEAL_MARK = 0xFFFFFFFF
_HEADER = struct.Struct("<8sHHIQ")  # magic, format_version, reserved, schema digest, first step
_HEADER_CRC = struct.Struct("<I")
HEADER_SIZE = _HEADER.size + _HEADER_CRC.size
_FRAME = struct.Struct("<II")  # body length, crc32 of (length bytes + body)
FRAME_HEAD = _FRAME.size
_SEAL = struct.Struct("<IQII")  # SEAL_MARK, record count, crc32 of all bytes before the seal, crc32 of those 16 bytes
SEAL_SIZE = _SEAL.size

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


def encode_header(schema_digest: int, first_step: int, version: int = HASHED_VERSION) -> bytes:
    head = _HEADER.pack(SEGMENT_MAGIC, version, 0, schema_digest, first_step)
    return head + _HEADER_CRC.pack(crc32(head))


def frame_crc(length_bytes: bytes, body) -> int:
    return crc32(body, crc32(length_bytes))


def encode_frame(body: bytes) -> bytes:
    length = struct.pack("<I", len(body))
    return length + struct.pack("<I", frame_crc(length, body)) + body


def encode_seal(count: int, content_crc: int) -> bytes:
    head = struct.pack("<IQI", SEAL_MARK, count, content_crc)
    return head + struct.pack("<I", crc32(head))


def parse_seal(seal: bytes) -> tuple[int, int] | None:
    """(record count, content crc) of a well-formed seal (its own checksum holds), else None."""
    if len(seal) != SEAL_SIZE:
        return None
    mark, count, content_crc, seal_crc = _SEAL.unpack(seal)
    if mark != SEAL_MARK or seal_crc != crc32(seal[:16]):
        return None
    return count, content_crc


def header_version(data: bytes) -> int:
    """The format_version of a segment header read_header accepted."""
    return _HEADER.unpack_from(data)[1]


def read_header(path: Path, data: bytes) -> tuple[int, int]:
    """(schema digest, first step) of a segment; raises TraceCorruptError/NewerFormatError."""
    if len(data) < HEADER_SIZE:
        raise TraceCorruptError(f"{path}: segment is shorter than its header", str(path))
    magic, version, _, digest, first = _HEADER.unpack_from(data)
    if magic != SEGMENT_MAGIC:
        raise TraceCorruptError(f"{path}: not a trace segment (bad magic)", str(path))
    if _HEADER_CRC.unpack_from(data, _HEADER.size)[0] != crc32(data[: _HEADER.size]):
        raise TraceCorruptError(f"{path}: segment header checksum mismatch", str(path))
    if version > FORMAT_VERSION:
        raise NewerFormatError(
            f"{path}: written by trace format_version {version}, this replay reads up to {FORMAT_VERSION}: upgrade replay"
        )
    return digest, first


# ------------------------------------------------------------------------------ reading files


def open_fd(path: Path) -> int:
    """The one place a segment file is opened for reading (tests replace it to inject errors)."""
    return os.open(path, os.O_RDONLY)


class SegmentFile:
    """A segment opened for reading parts of it; OSError becomes damage naming the file."""

    def __init__(self, path: Path, step: int | None = None):
        self.path, self.step = path, step
        if is_remote(path):  # an object: its size from the folder's listing, its bytes by range reads
            self.fd = None
            try:
                self.size = path.stat().st_size
            except FileNotFoundError as e:
                raise unreadable(path, e, step) from None
            return
        try:
            self.fd = open_fd(path)
            self.size = os.fstat(self.fd).st_size
        except OSError as e:
            raise unreadable(path, e, step) from None

    def read(self, offset: int, size: int) -> bytes:
        if self.fd is None:
            try:
                return self.path.read_range(offset, size)
            except FileNotFoundError as e:  # deleted since the folder was listed
                raise unreadable(self.path, e, self.step) from None
        try:
            data = os.pread(self.fd, size, offset)
            while len(data) < size:  # pread may return short on some filesystems; EOF returns b""
                more = os.pread(self.fd, size - len(data), offset + len(data))
                if not more:
                    break
                data += more
            return data
        except OSError as e:
            raise unreadable(self.path, e, self.step) from None

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)

    def __enter__(self) -> "SegmentFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_at(path: Path, offset: int, size: int, step: int | None = None) -> bytes:
    with SegmentFile(path, step) as f:
        return f.read(offset, size)


def read_whole(path: Path, step: int | None = None) -> bytes:
    with SegmentFile(path, step) as f:
        return f.read(0, f.size)


def unreadable(path: Path, e: OSError, step: int | None = None) -> TraceCorruptError:
    if isinstance(e, IsADirectoryError):
        reason = "is a directory, not a segment file; move it out of the trace folder"
    else:
        reason = f"cannot be read ({e.strerror or e.__class__.__name__}); check its permissions and the disk"
    return TraceCorruptError(f"{path}: {reason}", str(path), step)


# ------------------------------------------------------------------------------ walking frames


@dataclass
class Walk:
    """Frame offsets of a segment's records (offsets[-1] is where the next frame or the seal
    starts), whether a valid seal ends it, and where (and why) the good part ends."""

    offsets: list[int]
    sealed: bool
    damage: str | None
    crcs: list[int]
    last_body: bytes | None = None  # the last frame's body, when bodies were read


WALK_CHUNK = 4 << 20  # bytes read at once when walking a segment's bodies


def walk_frames(f: SegmentFile, bodies: bool = True, start: int = HEADER_SIZE) -> Walk:
    """Walks a segment frame by frame, from its header to its seal, its end, or the first bad frame.

    bodies=True reads the segment in WALK_CHUNK pieces and checks every frame's checksum (what
    opening does with the unsealed tail: one segment at most). bodies=False reads only each
    frame's 8-byte head (pread), for a sealed segment's offsets when it has no index. A torn
    tail (what a kill or a full disk leaves: a prefix of one frame) shows as a length past the
    end of the file; a zero-filled one as a length of 0. `start`: where a frame starts (the tail
    past what its sidecar vouches for); offsets then begin there.
    """
    offsets, crcs, pos, size = [], [], start, f.size
    buf, at = b"", pos  # with bodies: the file's bytes at..at+len(buf)

    def get(start: int, n: int):
        nonlocal buf, at
        if not bodies:
            return f.read(start, n)
        if start < at or start + n > at + len(buf):
            buf, at = f.read(start, max(n, WALK_CHUNK)), start
        return memoryview(buf)[start - at : start - at + n]

    def done(sealed: bool, damage: str | None) -> Walk:
        last = bytes(get(offsets[-1] + FRAME_HEAD, pos - offsets[-1] - FRAME_HEAD)) if bodies and offsets else None
        return Walk(offsets + [pos], sealed, damage, crcs, last)

    while pos < size:
        head = bytes(get(pos, FRAME_HEAD))
        if len(head) < FRAME_HEAD:
            return done(False, "truncated frame header")
        length, crc = _FRAME.unpack(head)
        if length == SEAL_MARK:
            if size - pos != SEAL_SIZE:
                return done(False, "seal is not the last thing in the segment")
            parsed = parse_seal(bytes(get(pos, SEAL_SIZE)))
            if parsed is None or parsed[0] != len(offsets):
                return done(False, "seal checksum or count mismatch")
            return done(True, None)
        if length == 0 or length > MAX_FRAME_BYTES:
            return done(False, f"frame length {length} is implausible")
        if pos + FRAME_HEAD + length > size:
            return done(False, "truncated frame (the writer stopped mid-record)")
        if bodies:
            frame = get(pos, FRAME_HEAD + length)
            if frame_crc(frame[:4], frame[FRAME_HEAD:]) != crc:
                return done(False, "record checksum mismatch")
        offsets.append(pos)
        crcs.append(crc)
        pos += FRAME_HEAD + length
    return done(False, None)


def check_frames(data, base: int, offsets, first_index: int = 0) -> int | None:
    """Index (counted from `first_index`) of the first frame in `data` (the file's bytes from
    `base` on) whose checksum or length field fails, else None."""
    view = memoryview(data)
    for i in range(len(offsets) - 1):
        at, end = offsets[i] - base, offsets[i + 1] - base
        length, crc = _FRAME.unpack_from(view, at)
        if length != end - at - FRAME_HEAD or frame_crc(view[at : at + 4], view[at + FRAME_HEAD : end]) != crc:
            return first_index + i
    return None
