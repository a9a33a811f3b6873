"""Columns of a trace: one field of many records at once, without decoding whole records.

Reading the per-example hashes of a million steps record by record costs seconds; every
record starts with the same fixed prefix (step, flags, rng, batch hash, example hashes, see
FORMAT.md), so decompressing the frames and slicing that prefix is about ten times faster.
Checksums are still checked: a sealed segment's whole, an unsealed one's frame by frame.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np
import zstandard

from traces.errors import TraceCorruptError
from traces.trace import _FRAME, HEADER_SIZE, TraceReader, _decompressor


def read_example_hashes(reader: TraceReader, start: int | None = None, stop: int | None = None) -> np.ndarray:
    """uint64 (steps, B) of steps start..stop-1, in global example order.

    About 10x faster than `reader.records()`: it decompresses each frame but decodes only
    the fixed prefix every record shares (step, flags, rng, batch hash, example hashes).
    Checksums are still checked: a sealed segment's by `segment_bytes`, an unsealed one's
    frame by frame here, and each record must hold the step its place says.
    """
    schema = reader.schema
    start = reader.start if start is None else max(start, reader.start)
    stop = reader.end if stop is None else min(stop, reader.end)
    B = schema.examples_per_step
    prefix = 8 + 1 + 4 * schema.rng_words + 8 + 8 * B
    out = np.empty((max(stop - start, 0), B), dtype=np.uint64)
    decompress = _decompressor().decompress
    for index, seg in enumerate(reader.segments):
        lo, hi = max(start, seg.first_step), min(stop, seg.first_step + seg.count)
        if lo >= hi:
            continue
        data = reader.segment_bytes(index)
        view, pos = memoryview(data), HEADER_SIZE
        for _ in range(lo - seg.first_step):  # frames before the range: skip by their lengths
            pos += 8 + _FRAME.unpack_from(data, pos)[0]
        frames = []
        for _ in range(hi - lo):
            length, crc = _FRAME.unpack_from(data, pos)
            frames.append((pos, length, crc))
            pos += 8 + length
        if not seg.sealed:  # a sealed segment's checksum was checked whole by segment_bytes
            for i, (at, length, crc) in enumerate(frames):
                if zlib.crc32(view[at + 8 : at + 8 + length], zlib.crc32(view[at : at + 4])) != crc:
                    raise _corrupt(seg.path, lo + i, at, "record checksum mismatch")
        try:
            parts = [decompress(view[at + 8 : at + 8 + length])[:prefix] for at, length, _ in frames]
        except zstandard.ZstdError:
            parts = []
        if len(parts) < len(frames) or min(map(len, parts)) < prefix:  # name the first bad record
            i = next(i for i, (at, n, _) in enumerate(frames) if not _decodes(decompress, view[at + 8 : at + 8 + n], prefix))
            raise _corrupt(seg.path, lo + i, frames[i][0], "record does not decompress to a record of this schema")
        block = np.frombuffer(b"".join(parts), dtype=np.uint8).reshape(hi - lo, prefix)
        held = block[:, :8].copy().view("<u8").ravel()
        bad = np.flatnonzero(held != np.arange(lo, hi, dtype=np.uint64))
        if bad.size:
            raise _corrupt(seg.path, lo + int(bad[0]), 0, f"record holds step {int(held[bad[0]])}")
        out[lo - start : hi - start] = block[:, prefix - 8 * B :].copy().view("<u8")
    return out


def _decodes(decompress, body, prefix: int) -> bool:
    try:
        return len(decompress(body)) >= prefix
    except zstandard.ZstdError:
        return False


def _corrupt(path: Path, step: int, offset: int, reason: str) -> TraceCorruptError:
    return TraceCorruptError(f"{path}: damaged at step {step} (byte {offset}): {reason}", str(path), step)
