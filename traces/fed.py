"""Where was this example fed: earlier occurrences of example hashes, found through the index.

Each sealed segment's index holds a filter of its example hashes and the hashes sorted, in
checksummed blocks of 256: a hash the filter rules out costs one 64-byte filter block a
segment; one it lets through costs the block heads (0.8 MB, once a segment) and a 3 KB table
block. The records are never scanned; the unsealed tail (and a segment without a usable
index file) is searched in memory. Every occurrence returned is confirmed exactly in the
record it names before it is returned.

At 1.4M steps (86 segments) and 1,024 hashes: ~88K filter blocks (5.6 MB, through a memory
map), ~5 false "maybe"s a segment (so its block heads and a few table blocks), and one
record read a confirmed occurrence.
"""

from __future__ import annotations

import numpy as np

from traces.index import IndexUnusable, MemoryIndex, record_prefix
from traces.trace import TraceReader


def _reader(run_or_reader) -> TraceReader:
    return run_or_reader if isinstance(run_or_reader, TraceReader) else run_or_reader.trace


def fed(run_or_reader, hashes, before_step: int | None = None, limit: int = 1) -> dict[int, list[tuple[int, int]]]:
    """{hash: [(step, position), ...]}: the first `limit` places each distinct hash was fed at
    before `before_step` (default: the whole trace), in order; hashes never fed are left out."""
    reader = _reader(run_or_reader)
    B = reader.schema.examples_per_step
    before = reader.end if before_step is None else min(before_step, reader.end)
    queries = np.unique(np.asarray(hashes, np.uint64).reshape(-1))
    found: dict[int, list[tuple[int, int]]] = {}
    for i, seg in enumerate(reader.segments):
        if seg.first_step >= before or not queries.size or B == 0:
            break
        qi, slots = _confirmed(reader, i, queries, limit, (before - seg.first_step) * B)
        for q, slot in zip(qi.tolist(), slots.tolist()):
            places = found.setdefault(int(queries[q]), [])
            if len(places) < limit:
                places.append((seg.first_step + slot // B, slot % B))
        done = np.array([len(found.get(int(h), ())) >= limit for h in queries], bool)
        queries = queries[~done]
    return found


def first_fed(run_or_reader, hashes, before_step: int | None = None) -> dict[int, int]:
    """{hash: the first step whose batch held it}, for the hashes fed before `before_step`."""
    return {h: places[0][0] for h, places in fed(run_or_reader, hashes, before_step, 1).items()}


def _confirmed(reader: TraceReader, i: int, queries: np.ndarray, limit: int, stop_slot: int):
    """(query index, slot) hits of segment i before `stop_slot`, each checked in its record; an
    index file whose hits its segment does not confirm is replaced by one built from it."""
    for _ in range(2):
        index = reader.index(i)
        try:
            qi, slots = index.find(queries, limit)
        except IndexUnusable as e:
            reader._index_unusable(reader.segments[i], e)
            continue
        keep = slots < stop_slot
        qi, slots = qi[keep], slots[keep]
        if _hold(reader, i, queries[qi], slots):
            return qi, slots
        if isinstance(index, MemoryIndex):
            break
        reader._index_unusable(reader.segments[i], IndexUnusable("its table names places its segment does not hold"))
    seg = reader.segments[i]
    raise AssertionError(f"{seg.path}: hashes found in its records are not there when read again")


def _hold(reader: TraceReader, i: int, hashes: np.ndarray, slots: np.ndarray) -> bool:
    """Whether the records hold each hash at its slot (read from the records themselves)."""
    B, seg = reader.schema.examples_per_step, reader.segments[i]
    prefix = record_prefix(reader.schema)
    steps = seg.first_step + slots // B
    for step in np.unique(steps).tolist():
        at = steps == step
        row = np.frombuffer(reader.raw_record(step)[: prefix.itemsize], prefix, 1)["example_hashes"][0]
        if not np.array_equal(row[slots[at] % B], hashes[at]):
            return False
    return True
