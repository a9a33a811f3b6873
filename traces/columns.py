"""Columns of a trace: one field of many records at once, streamed segment by segment.

The scalar fields (flags, rng, batch hash, metrics) come from each segment's index, never
the records: one column alone (index version 2), so at 1.4M steps a metric column reads
~5.6 MB (all metrics of a step: 4 bytes a metric) and holds 4 bytes a step. The per-example fields (example hashes, per-example
metrics) and the layer fields (fingerprints, RMS) are in the records only: a chunk of
frames is read at once, each frame's checksum checked, decompressed, and decoded by numpy
for all records of the chunk together (one structured view per record layout), so memory
is bounded by the chunk (CHUNK_RECORDS records), whatever the run's length.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from traces.index import StepColumns, record_prefix
from traces.schema import FLAG_EXAMPLE_METRICS, FLAG_LAYER, METRIC_DTYPES, Schema
from traces.trace import COMPACT_VERSION, FRAME_HEAD, TraceReader, corrupt

CHUNK_RECORDS = 1024  # ~12 MB of frames at 1,024 examples a step


def _range(reader: TraceReader, start: int | None, stop: int | None) -> tuple[int, int]:
    start = reader.start if start is None else max(start, reader.start)
    stop = reader.end if stop is None else min(stop, reader.end)
    return start, max(start, stop)


def segment_ranges(reader: TraceReader, start: int | None = None, stop: int | None = None,
                   chunk: int | None = None) -> Iterator[tuple[int, int, int]]:
    """(segment, lo, hi): records lo..hi-1 of the segment (counted in it) covering start..stop-1,
    at most `chunk` records each."""
    start, stop = _range(reader, start, stop)
    for i, seg in enumerate(reader.segments):
        lo, hi = max(start, seg.first_step) - seg.first_step, min(stop, seg.first_step + seg.count) - seg.first_step
        step = chunk or max(hi - lo, 1)
        for a in range(lo, hi, step):
            yield i, a, min(hi, a + step)


def step_columns(reader: TraceReader, start: int | None = None, stop: int | None = None) -> Iterator[StepColumns]:
    """The index columns of steps start..stop-1, one StepColumns a segment (offsets excluded)."""
    for i, lo, hi in segment_ranges(reader, start, stop):
        c = reader.columns(i)
        yield StepColumns(c.first_step + lo, c.offsets[lo : hi + 1], c.frame_crc[lo:hi], c.flags[lo:hi], c.rng[lo:hi],
                          c.batch_hash[lo:hi], c.metric_bits[lo:hi], c.examples_key[lo:hi])


def _concat(parts: list[np.ndarray], empty: np.ndarray) -> np.ndarray:
    return np.concatenate(parts) if parts else empty


def metric(reader: TraceReader, name: str, start: int | None = None, stop: int | None = None) -> np.ndarray:
    """The values of scalar metric `name` for steps start..stop-1 (its dtype, exact bits)."""
    schema = reader.schema
    j = schema.metric_index(name)
    value, bits = METRIC_DTYPES[schema.metric_dtype]
    return _concat([reader.column(i, "metric_bits")[lo:hi, j] for i, lo, hi in segment_ranges(reader, start, stop)],
                   np.zeros(0, bits)).view(value)


def batch_hashes(reader: TraceReader, start: int | None = None, stop: int | None = None) -> np.ndarray:
    return _concat([reader.column(i, "batch_hash")[lo:hi] for i, lo, hi in segment_ranges(reader, start, stop)],
                   np.zeros(0, np.uint64))


# ------------------------------------------------------------------------------ fields inside the records


def _bodies(reader: TraceReader, i: int, lo: int, hi: int, hashes: bool = True) -> list[bytes]:
    """Records lo..hi-1 of segment i decompressed; checksums and steps checked. A compacted
    segment's get their example hashes from its index, or zeros when `hashes` is False (a caller
    that reads other fields)."""
    data, base, offsets = reader.frames(i, lo, hi)
    seg, view = reader.segments[i], memoryview(data)
    if seg.version < COMPACT_VERSION:
        rows = [None] * (hi - lo)
    else:
        rows = reader.segment_hashes(i, lo, hi) if hashes else np.zeros((hi - lo, reader.schema.examples_per_step), np.uint64)
    return [reader._raw(seg, seg.first_step + lo + k, view[int(offsets[k]) - base + FRAME_HEAD : int(offsets[k + 1]) - base],
                        rows[k]) for k in range(hi - lo)]


def _full_dtype(schema: Schema, flags: int) -> np.dtype:
    """A whole record's layout: the (step, flags) head, then `schema.layout(flags)`."""
    body = schema.layout(flags)
    return np.dtype([("step", "<u8"), ("flags", "u1")] + [(name, body.fields[name][0]) for name in body.names])


def decode(reader: TraceReader, i: int, lo: int, hi: int, fields: tuple[str, ...]) -> dict[str, np.ndarray]:
    """Fields of records lo..hi-1 of segment i, decoded by numpy for all of them at once.

    Optional fields (fingerprints, rms, example_metrics) are zero where a record lacks them;
    "flags" says which have them. Fields of the fixed prefix are read without the rest.
    """
    schema, n = reader.schema, hi - lo
    raws = _bodies(reader, i, lo, hi, "example_hashes" in fields)
    prefix = record_prefix(schema)
    out: dict[str, np.ndarray] = {}
    if all(f in prefix.names for f in fields):
        short = [k for k, r in enumerate(raws) if len(r) < prefix.itemsize]
        if short:
            seg = reader.segments[i]
            raise corrupt(seg.path, seg.first_step + lo + short[0], 0, "record is shorter than its schema says")
        rows = np.frombuffer(b"".join(r[: prefix.itemsize] for r in raws), prefix, n)
        return {f: rows[f] for f in fields}
    flags = np.frombuffer(b"".join(r[8:9] for r in raws), np.uint8, n)
    for f in fields:
        if f == "flags":
            continue
        dtype = _full_dtype(schema, FLAG_LAYER | FLAG_EXAMPLE_METRICS).fields[f][0]
        out[f] = np.zeros((n, *dtype.shape), dtype.base)
    for value in np.unique(flags):
        at = np.flatnonzero(flags == value)
        dtype = _full_dtype(schema, int(value))
        group = [raws[k] for k in at]
        bad = [k for k, r in zip(at, group) if len(r) != dtype.itemsize]
        if int(value) & ~(FLAG_LAYER | FLAG_EXAMPLE_METRICS) or bad:
            seg = reader.segments[i]
            k = int(bad[0]) if bad else int(at[0])
            raise corrupt(seg.path, seg.first_step + lo + k, 0, "record does not fit the run's schema")
        rows = np.frombuffer(b"".join(group), dtype, at.size)
        for f in fields:
            if f != "flags" and f in dtype.names:
                out[f][at] = rows[f]
    out["flags"] = flags
    return out


def chunks(reader: TraceReader, fields: tuple[str, ...], start: int | None = None, stop: int | None = None,
           chunk: int = CHUNK_RECORDS) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
    """(first step, fields) of consecutive chunks of steps start..stop-1: bounded memory."""
    for i, lo, hi in segment_ranges(reader, start, stop, chunk):
        yield reader.segments[i].first_step + lo, decode(reader, i, lo, hi, fields)


def example_hashes(reader: TraceReader, start: int | None = None, stop: int | None = None,
                   chunk: int = CHUNK_RECORDS) -> Iterator[tuple[int, np.ndarray]]:
    """(first step, uint64 (n, B)) chunks of the per-example hashes, in global example order."""
    for first, cols in chunks(reader, ("example_hashes",), start, stop, chunk):
        yield first, cols["example_hashes"]


def example_metric(reader: TraceReader, name: str, start: int | None = None, stop: int | None = None,
                   chunk: int = CHUNK_RECORDS) -> Iterator[tuple[int, np.ndarray]]:
    """(first step, float32 (n, B)) chunks of per-example metric `name`; NaN where a record has none."""
    j = list(reader.schema.example_metrics).index(name)
    for first, cols in chunks(reader, ("example_metrics",), start, stop, chunk):
        values = cols["example_metrics"][:, j].copy()
        values[(cols["flags"] & FLAG_EXAMPLE_METRICS) == 0] = np.nan
        yield first, values


def fingerprints(reader: TraceReader, start: int | None = None, stop: int | None = None,
                 chunk: int = CHUNK_RECORDS) -> Iterator[tuple[int, np.ndarray, np.ndarray, np.ndarray]]:
    """(first step, uint64 (n, T) fingerprints, float32 (n, T) rms, bool (n) recorded) chunks."""
    for first, cols in chunks(reader, ("fingerprints", "rms"), start, stop, chunk):
        yield first, cols["fingerprints"], cols["rms"], (cols["flags"] & FLAG_LAYER) != 0


def read_example_hashes(reader: TraceReader, start: int | None = None, stop: int | None = None) -> np.ndarray:
    """uint64 (steps, B) of steps start..stop-1 in one array: 8 bytes an example of the range,
    so for a bounded range; `example_hashes` streams a long one."""
    start, stop = _range(reader, start, stop)
    out = np.empty((stop - start, reader.schema.examples_per_step), np.uint64)
    for first, block in example_hashes(reader, start, stop):
        out[first - start : first - start + block.shape[0]] = block
    return out

