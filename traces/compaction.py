"""Compacted segments: a sealed segment whose records hold no example hashes (FORMAT.md, "Compacted
segments"), and the splice that gives a reader its records whole again.

A record carries its batch's example hashes (8 bytes an example: two thirds of it at 1,024
examples a step), and the segment's index holds them again, sorted, for the searches and the
audit. Stored twice, they made the index as large as the records. So a writer of a format-3 run
compacts each segment once it is sealed, on its seal thread: the same records without their
example hashes, in a segment with header version 3, whose index (version 4) is then their only
copy: the sorted table, plus each slot's hash top bits in slot order (traces/index_table.py),
from which a step's hashes are found again. At 1,024 examples a step the index is then 12.15
bytes an example and the records 8.24 less: 3.91 bytes an example beyond the records, where it
was 10.7 (bench.scale measures both on a written run).

Order, so that a crash at any point loses nothing: the compacted copy is written beside the
sealed segment (`NNNN.seg.tmp`) and fsynced; its index is written (tmp, fsync, rename); then the
copy replaces the segment (rename, and the folder fsynced). Before the rename, the index is
stale for the segment still in place (whose records still hold the hashes), and readers index
that one in memory, as for any missing index; a resumed writer compacts it again. After it,
the segment and its index agree. The unsealed tail is never compacted: its records keep their
hashes (a kill loses at most the record being written, as before), and its sidecar is as before.

Reading: `splice` puts a step's hashes back where the record layout has them, so every reader
of records (decoded or raw) sees the layout of FORMAT.md's "Record" whatever the segment. The
hashes come from the index, checked against the step's examples key (index columns, their own
checksum): a damaged table or slot order never passes for the step's hashes.

Cost on the seal thread: every record decompressed and compressed again (~1 s of CPU at 16,384
records of 1,024 examples), the segment written a second time (~190 MB, fsynced), in chunks
of CHUNK_RECORDS records (~12 MB of working memory).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from traces.checksum import crc32
from traces.errors import TraceCorruptError
from traces.index import IndexBuilder, examples_key, record_prefix
from traces.schema import Schema
from traces.segment import (
    COMPACT_VERSION, FRAME_HEAD, SegmentFile, _compressor, _decompressor, encode_frame, encode_header, encode_seal, frame_crc,
)

CHUNK_RECORDS = 1024
TMP_SUFFIX = ".tmp"


def tmp_path(segment: Path) -> Path:
    """Where the compacted copy is written before it replaces the segment."""
    return segment.with_name(segment.name + TMP_SUFFIX)


def hash_span(schema: Schema) -> tuple[int, int]:
    """(start, end) byte offsets of example_hashes in a record (FORMAT.md, "Record")."""
    at = record_prefix(schema).fields["example_hashes"][1]
    return at, at + 8 * schema.examples_per_step


def splice(schema: Schema, raw, hashes_B) -> bytes:
    """A compacted segment's record (`raw`, decompressed) with its example hashes put back."""
    at, _ = hash_span(schema)
    return bytes(raw[:at]) + np.ascontiguousarray(hashes_B, "<u8").tobytes() + bytes(raw[at:])


def check_rows(schema: Schema, rows_nxB: np.ndarray, keys: np.ndarray, path: Path, first_step: int) -> None:
    """Raises TraceCorruptError naming the first step whose rebuilt hashes do not give its
    recorded examples key (the index's table or slot order damaged)."""
    bad = np.flatnonzero(examples_key(rows_nxB) != np.asarray(keys, np.uint64))
    if bad.size:
        step = first_step + int(bad[0])
        raise TraceCorruptError(
            f"{path}: the example hashes its index rebuilds for step {step} do not match the step's examples key: the "
            f"index, their only copy in a compacted segment, is damaged; restore the run's trace folder from a copy",
            str(path), step)


def compact(path: Path, schema: Schema, builder: IndexBuilder, end: int) -> tuple[int, int, int]:
    """Writes tmp_path(path): the sealed segment `path` (its frames as `builder` holds them, up to
    byte `end`) with every record's example hashes left out, fsynced; rebinds the builder to the
    new frames. Returns (where the new frames end, their content crc, the new file's size).
    Every old frame's checksum is checked as it is read; OSError and damage are the caller's."""
    at, stop = hash_span(schema)
    old, old_crcs = builder.frames(end)
    n = len(old) - 1
    dctx, cctx = _decompressor(), _compressor()
    offsets, crcs = [], []
    tmp = tmp_path(path)
    with SegmentFile(path) as f, open(tmp, "wb") as out:
        head = encode_header(schema.digest(), builder.first_step, COMPACT_VERSION)
        out.write(head)
        crc, pos = crc32(head), len(head)
        for a in range(0, n, CHUNK_RECORDS):
            b = min(n, a + CHUNK_RECORDS)
            data = f.read(old[a], old[b] - old[a])
            if len(data) != old[b] - old[a]:
                raise TraceCorruptError(f"{path}: shorter than its records while it was being compacted", str(path))
            view, frames = memoryview(data), []
            for k in range(a, b):
                x, y = old[k] - old[a], old[k + 1] - old[a]
                if frame_crc(view[x : x + 4], view[x + FRAME_HEAD : y]) != old_crcs[k]:
                    raise TraceCorruptError(f"{path}: record {k} changed after it was written", str(path),
                                            builder.first_step + k)
                raw = dctx.decompress(view[x + FRAME_HEAD : y])
                frame = encode_frame(cctx.compress(raw[:at] + raw[stop:]))
                offsets.append(pos)
                crcs.append(int.from_bytes(frame[4:FRAME_HEAD], "little"))
                pos += len(frame)
                frames.append(frame)
            blob = b"".join(frames)
            crc = crc32(blob, crc)
            out.write(blob)
        seal = encode_seal(n, crc)
        out.write(seal)
        out.flush()
        os.fsync(out.fileno())
    builder.rebind(offsets, crcs)
    return pos, crc, pos + len(seal)


def replace(path: Path) -> None:
    """The compacted copy in place of the segment (its index already written), durably."""
    os.replace(tmp_path(path), path)
    try:
        fd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
