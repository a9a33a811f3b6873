"""Opening a trace: which segment files it has, the steps each holds, and where it is damaged.

A sealed segment is known by its header and seal (48 bytes); the unsealed tail (one segment
at most) by its sidecar (traces/sidecar.py: ~60 bytes a record), its last frame checked against
it, and only the frames past the sidecar's last entry walked, every frame's checksum and the
last record's step checked. Without a usable sidecar (a run recorded before them, a damaged
one) the tail is walked whole, as before. At 1.4M steps that is 86 x 48 bytes and ~1 MB of
sidecar, instead of the tail (up to ~200 MB at 1,024 examples a step).
traces/trace.py's TraceReader opens itself with `open_segments`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import zstandard

from traces import sidecar
from traces.errors import NewerFormatError, SchemaError, TraceCorruptError
from traces.storage import is_remote
from traces.segment import (
    COMPACT_VERSION, FRAME_HEAD, HEADER_SIZE, SEAL_SIZE, SEGMENT_SUFFIX, SegmentFile, Walk, check_frames, header_version, parse_seal,
    read_at, read_header, segment_name, walk_frames,
)

if TYPE_CHECKING:
    from traces.index import StepColumns
    from traces.index_file import FileIndex
    from traces.trace import TraceReader


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
class _Segment:
    path: Path
    first_step: int
    count: int
    sealed: bool
    size: int
    content_crc: int | None = None  # the seal's
    offsets: np.ndarray | None = None  # count + 1 frame offsets, once known (the tail's from opening)
    index: FileIndex | None = None
    index_unusable: bool = False
    columns: StepColumns | None = None  # the tail's, from its sidecar (when it vouches for every record)
    version: int = 2  # its header's format_version: 3 is a compacted segment (traces/compaction.py)
    frame_crcs: list[int] | None = None  # a damaged compacted segment's readable frames' (binds its index to them)


def open_segments(reader: TraceReader) -> None:
    """Fills reader.segments, .damage and .tail from the trace directory's segment files: each
    sealed segment's header and seal (48 bytes), the unsealed tail whole."""
    paths = sorted(reader.dir.glob("*" + SEGMENT_SUFFIX)) if reader.dir.is_dir() else []
    if is_remote(reader.dir):  # every header and seal requested at once: O(segments) requests, in parallel
        sizes = [p.stat().st_size for p in paths]
        reader.dir.view.prefetch([(p.key, 0, HEADER_SIZE) for p in paths] +
                                 [(p.key, n - SEAL_SIZE, SEAL_SIZE) for p, n in zip(paths, sizes)
                                  if n >= HEADER_SIZE + SEAL_SIZE])
    expected: int | None = None
    for i, path in enumerate(paths):
        stop = _open_segment(reader, path, expected, is_last=i == len(paths) - 1)
        if stop:
            _unreachable(reader, paths[i + 1 :])
            break
        expected = reader.segments[-1].first_step + reader.segments[-1].count
    _check_start(reader, paths)


def reopen_compacted(reader: TraceReader, i: int) -> bool:
    """Whether segment i, opened before its writer compacted it (FORMAT.md, "Compacted segments":
    the compacted copy renamed over the sealed segment, or over what was the tail when this
    reader opened it), is now that compacted segment, whole; then it replaces the one opened
    (its offsets, index and columns, all of the old file, dropped with it). A reader of a live
    run otherwise reads the new file at the old file's offsets: a checksum error for a healthy
    run. Reads its header and seal."""
    seg = reader.segments[i]
    if seg.version >= COMPACT_VERSION:
        return False
    try:
        with SegmentFile(seg.path, seg.first_step) as f:
            if f.size < HEADER_SIZE or header_version(f.read(0, HEADER_SIZE)) < COMPACT_VERSION:
                return False
    except (TraceCorruptError, NewerFormatError):
        return False
    held, damage = reader.segments, len(reader.damage)
    reader.segments = []
    try:
        stop = _open_segment(reader, seg.path, seg.first_step, is_last=False)
        fresh = reader.segments
    finally:
        reader.segments = held
    if stop or len(fresh) != 1 or not fresh[0].sealed or fresh[0].count < seg.count:
        del reader.damage[damage:]  # not the compacted segment whole: the caller's error stands
        return False
    held[i] = fresh[0]
    return True


def _unreachable(reader: TraceReader, later: list[Path]) -> None:
    """One entry for every segment after the damage, however many: the first damage is the news."""
    if later:
        names = later[0].name + (f" .. {later[-1].name}" if len(later) > 1 else "")
        reader.damage.append(Damage(str(later[0]), 0, None,
                                    f"{len(later)} later segment(s) unreachable: {names} follow the damaged segment"))


def _check_start(reader: TraceReader, paths: list[Path]) -> None:
    """A trace whose first file starts after the recorded first step has lost its leading files."""
    if reader.first_step is None or not paths:
        return
    first = reader.segments[0].first_step if reader.segments else None
    if first is None:
        try:  # the first file is damaged; its header may still say where it starts
            first = read_header(paths[0], read_at(paths[0], 0, HEADER_SIZE))[1]
        except (TraceCorruptError, NewerFormatError):
            return
    if first > reader.first_step:
        reader.damage.insert(0, Damage(
            str(reader.dir / segment_name(reader.first_step)), 0, reader.first_step,
            f"missing: run.json says the trace starts at step {reader.first_step} but its first segment file is "
            f"{paths[0].name}, so steps {reader.first_step}..{first - 1} are gone "
            "(leading segment files deleted or moved)"))
        reader.tail = None  # a writer must refuse this trace, not cut it


def _open_segment(reader: TraceReader, path: Path, expected: int | None, is_last: bool) -> bool:
    """Adds the segment; returns True when reading must stop after it.

    A sealed segment is opened by its header and seal alone; an unsealed one (the last)
    is read whole, in pieces, every frame's checksum and the last one's step checked.
    """
    def damaged(offset: int, step: int | None, reason: str, tail: bool) -> bool:
        reader.damage.append(Damage(str(path), offset, step, reason))
        if tail:
            reader.tail = (path, offset)
        return True

    try:
        with SegmentFile(path, expected) as f:
            head, size = f.read(0, HEADER_SIZE), f.size
            try:
                digest, first = read_header(path, head)
            except TraceCorruptError as e:
                return damaged(0, expected, _joined_damage(path) or str(e).split(": ", 1)[-1], tail=True)
            if digest != reader._digest:
                raise SchemaError(f"{path}: segment was written with a different schema than run.json declares")
            if path.name != segment_name(first) or (expected is not None and first != expected):
                return damaged(0, expected, f"segment starts at step {first}, expected {expected}", tail=False)
            seal = parse_seal(f.read(size - SEAL_SIZE, SEAL_SIZE)) if size >= HEADER_SIZE + SEAL_SIZE else None
            version = header_version(head)
            if seal is not None and 0 < seal[0] <= (size - HEADER_SIZE - SEAL_SIZE) // (FRAME_HEAD + 1):
                reader.segments.append(_Segment(path, first, seal[0], True, size, seal[1], version=version))
                return False
            walk, side = _walk_tail(reader, f, path, first, size)
    except TraceCorruptError as e:  # unreadable, or a directory: not a tail a writer could cut off
        return damaged(0, expected, str(e).split(": ", 1)[-1], tail=False)
    n = len(walk.offsets) - 1
    seg = _Segment(path, first, n, False, size, offsets=np.array(walk.offsets, np.uint64), version=version)
    reason = walk.damage or (_last_frame_problem(reader, seg, walk.last_body) if n else None)
    if reason is not None and walk.damage is None:  # the last frame's step is wrong: it is the torn one
        seg.count, seg.offsets = n - 1, seg.offsets[:-1]
    reason = reason or _joined_damage(path)  # a damaged tail object: the frames before it are whole
    if side is not None and 0 < seg.count - side.count <= _EXTEND_MAX:  # a kill between a frame and its entry
        side = _extend(reader, seg, side)
    if side is not None and side.count == seg.count:
        seg.columns = side.columns
    reader.segments.append(seg)
    if version >= COMPACT_VERSION:  # written whole and renamed into place: damaged, never a tail to cut and go on
        seg.frame_crcs = walk.crcs[: seg.count]
        return damaged(int(seg.offsets[-1]), first + seg.count, reason or "a compacted segment without its seal",
                       tail=False)
    if reason is not None:
        return damaged(int(seg.offsets[-1]), first + seg.count, reason, tail=True)
    if not is_last:
        return damaged(int(seg.offsets[-1]), first + n, "segment is not sealed", tail=False)
    return False


def _joined_damage(path: Path) -> str | None:
    """What ended a segment joined from tail objects early (traces/storage/tails.py), if anything."""
    found = path.view.tail_damage.get(path.key) if is_remote(path) else None
    return None if found is None else found[0]


def _last_frame_problem(reader: TraceReader, seg: _Segment, body: bytes) -> str | None:
    step = seg.first_step + seg.count - 1
    try:
        raw = reader._dctx.decompress(body)
        held = struct.unpack_from("<Q", raw)[0]
    except (zstandard.ZstdError, struct.error, TraceCorruptError):
        return "record does not decompress"
    return None if held == step else f"record holds step {held}, expected {step}"


_EXTEND_MAX = 64  # records past the sidecar decoded on opening to complete its columns (a kill leaves one)


def _extend(reader: TraceReader, seg: _Segment, side):
    """The sidecar with entries for the frames walked past its last one (read and decoded here);
    None when one does not decode (its columns are then built from the records when asked)."""
    make = sidecar.EntryMaker(reader.schema)
    more = []
    for k in range(side.count, seg.count):
        at, end = int(seg.offsets[k]), int(seg.offsets[k + 1])
        frame = read_at(seg.path, at, end - at, seg.first_step + k)
        try:
            raw = reader._dctx.decompress(frame[FRAME_HEAD:])
        except zstandard.ZstdError:
            return None
        if len(raw) < make.prefix.itemsize or struct.unpack_from("<Q", raw)[0] != seg.first_step + k:
            return None
        more.append(make(raw, seg.first_step + k, end, int.from_bytes(frame[4:FRAME_HEAD], "little")))
    return side.extended(reader.schema, b"".join(more))


def _walk_tail(reader: TraceReader, f: SegmentFile, path: Path, first: int, size: int):
    """(the tail's walk, its sidecar or None): the frames the sidecar vouches for are taken from
    it (its last one read and checked against it), only the ones after are walked. A sidecar
    that does not hold is noted and the tail walked whole: nothing recorded is lost."""
    def unusable(why: str):
        reader._note(f"{sidecar.sidecar_path(path)} cannot be used ({why}): the tail's records were read instead; "
                     "nothing recorded is lost, and the next writer rewrites it")
        return walk_frames(f), None

    try:
        side = sidecar.read(path, reader.schema, first, size)
    except sidecar.SidecarUnusable as e:
        return unusable(str(e))
    if side is None:
        return walk_frames(f), None
    if side.problem is not None:
        reader._note(f"{sidecar.sidecar_path(path)}: {side.problem}; the records after its last good entry were read "
                     "instead (nothing recorded is lost)")
    if side.count == 0:  # a segment younger than the writer's first batch of entries
        return walk_frames(f), side
    after = walk_frames(f, start=side.end)
    if after.sealed or (after.damage or "").startswith("seal"):  # not a plain tail: the whole walk says what
        return walk_frames(f), None
    offs, crcs = side.columns.offsets, side.columns.frame_crc
    body = after.last_body
    if len(after.offsets) == 1:  # nothing past the sidecar: its last frame is the tail's last record
        at, end = int(offs[-2]), int(offs[-1])
        frame = f.read(at, end - at)
        if len(frame) != end - at or check_frames(frame, at, [at, end]) is not None or \
                int.from_bytes(frame[4:FRAME_HEAD], "little") != int(crcs[-1]):
            return unusable(f"its last entry does not match the frame at byte {at}")
        body = frame[FRAME_HEAD:]
    walk = Walk([int(x) for x in offs[:-1]] + after.offsets, False, after.damage, [int(c) for c in crcs] + after.crcs, body)
    return walk, side
