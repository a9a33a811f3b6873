"""Where was this example fed: earlier occurrences of example hashes, found through the index.

Each sealed segment's index holds a filter of its example hashes and the hashes sorted, in
checksummed blocks of 256: a hash the filter rules out costs one 64-byte filter block a
segment; one it lets through costs the block heads (0.5 MB, once a segment) and the one or two
2.3 KB table blocks of its bucket (index version 3; 0.8 MB and a 3 KB block in version 2).
The records are never scanned; the unsealed tail (and a segment without a usable index file)
is searched in memory. Every occurrence returned is confirmed exactly in the
record it names before it is returned (a compacted segment's record takes its hashes from the
index: traces/compaction.py, so a hit read from its checksummed table blocks is the record's own,
not read again). A compacted segment's filter is leaner (index version 4: 8 bits an example):
~2-3% of absent hashes read their bucket.

At 1.4M steps (86 segments) and 1,024 hashes: ~88K filter blocks (5.6 MB, through a memory
map), ~5 false "maybe"s a segment (so its block heads and a few table blocks), and one
record read a confirmed occurrence.

Two runs (`fed_in_both`, bisect's search) are compared by batch first: the steps where both
traces hold the same batches (their batch-hash and examples-key columns, 16 bytes a step, or
equal segment summaries without reading those) are searched in one run only, and the other
run's per-example search covers only the steps from its first differing batch on.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

from traces.compare import _chunks, _same_summary
from traces.index_file import FileIndex
from traces.index import IndexUnusable, MemoryIndex, record_prefix
from traces.trace import COMPACT_VERSION, TraceReader

Places = dict[int, list[tuple[int, int]]]


def _reader(run_or_reader) -> TraceReader:
    return run_or_reader if isinstance(run_or_reader, TraceReader) else run_or_reader.trace


def fed(run_or_reader, hashes, before_step: int | None = None, limit: int = 1, from_step: int | None = None) -> Places:
    """{hash: [(step, position), ...]}: the first `limit` places each distinct hash was fed at
    in steps from_step..before_step-1 (default: the whole trace), in order; hashes never fed
    there are left out."""
    reader = _reader(run_or_reader)
    B = reader.schema.examples_per_step
    before = reader.end if before_step is None else min(before_step, reader.end)
    start = reader.start if from_step is None else max(from_step, reader.start)
    queries = np.unique(np.asarray(hashes, np.uint64).reshape(-1))
    found: Places = {}
    searched = [i for i, seg in enumerate(reader.segments)
                if seg.first_step < before and seg.first_step + seg.count > start]
    if not queries.size or B == 0:
        return found
    with ThreadPoolExecutor(1, thread_name_prefix="replay-fed-advice") as advisor:
        advice = None  # (segment, its prefetch in flight)
        for n, i in enumerate(searched):
            if not queries.size:
                break
            seg = reader.segments[i]
            advised = advice is not None and advice[0] == i
            if advised:
                advice[1].result()
            advice = _advise(advisor, reader, searched[n + 1], queries) if n + 1 < len(searched) else None
            # A segment cut by from_step: its occurrences before the cut are skipped, so ask for
            # them too (the table reads only the blocks a hash's occurrences fill).
            skip = max(0, start - seg.first_step) * B
            qi, slots = _confirmed(reader, i, queries, limit + skip, skip, (before - seg.first_step) * B, advised)
            for q, slot in zip(qi.tolist(), slots.tolist()):
                places = found.setdefault(int(queries[q]), [])
                if len(places) < limit:
                    places.append((seg.first_step + slot // B, slot % B))
            done = np.array([len(found.get(int(h), ())) >= limit for h in queries], bool)
            queries = queries[~done]
        if advice is not None:
            advice[1].result()
    return found


def _advise(advisor: ThreadPoolExecutor, reader: TraceReader, i: int, queries: np.ndarray):
    """(i, future) of segment i's FileIndex.prefetch(queries) on the advisor thread, while the
    caller searches the segment before it; None when i has no index file (held in memory).
    From a cold page cache the ~1,000 posix_fadvise calls a segment (~11 us each on this VM:
    0.23 s of a 350k-step bisect of repeated data's 21 segments) then overlap the search's
    numpy work instead of preceding it. The queries are a superset of those segment i is
    searched for (hashes found in between drop out): a few pages asked for in vain."""
    index = reader._file_index(i)
    if not isinstance(index, FileIndex):
        return None
    return i, advisor.submit(index.prefetch, queries)


def first_fed(run_or_reader, hashes, before_step: int | None = None) -> dict[int, int]:
    """{hash: the first step whose batch held it}, for the hashes fed before `before_step`."""
    return {h: places[0][0] for h, places in fed(run_or_reader, hashes, before_step, 1).items()}


def same_batches_until(a: TraceReader, b: TraceReader, stop: int) -> int:
    """The first step before `stop` whose batches differ in the two traces (`stop` when none
    does), counted from their common first step; their first step when they start apart.

    A pair of whole segments with equal summaries (FORMAT.md) is skipped on their headers;
    elsewhere the batch-hash and examples-key columns are compared (16 bytes a step): at 1.4M
    steps, 86 index headers a trace and the columns of the segments that differ."""
    if a.start != b.start:
        return min(a.start, b.start)
    lo, hi = a.start, min(stop, a.end, b.end)
    for s, e in _chunks(a, b, lo, hi) if lo < hi else []:
        if _same_summary(a, b, s, e):
            continue
        differ = np.zeros(e - s, bool)
        ia, ib = a._segment_index(s), b._segment_index(s)
        fa, fb = a.segments[ia].first_step, b.segments[ib].first_step
        for name in ("batch_hash", "examples_key"):
            differ |= a.column(ia, name)[s - fa : e - fa] != b.column(ib, name)[s - fb : e - fb]
        if differ.any():
            return s + int(np.argmax(differ))
    return max(lo, hi)


def fed_in_both(a, b, hashes, before_step: int | None = None, limit: int = 1) -> tuple[Places, Places]:
    """(fed(a, ...), fed(b, ...)), with the steps before the traces' first differing batch
    (same_batches_until; cut back to the start of a's segment holding it) searched in `a` alone:
    those places are b's too, each confirmed in the record of b it names. When one does not hold
    there (the batches differ after all), b is searched on its own. That the shared steps hold
    no other occurrence in b rests on their equal batch hashes and examples keys (64-bit each).

    At 1.4M steps with the runs parting late: one run's search over 86 segments, the other's
    over the segment where they part, and one record of b read a shared place: about half of
    two separate searches."""
    ra, rb = _reader(a), _reader(b)
    ends = [r.end if before_step is None else min(before_step, r.end) for r in (ra, rb)]
    shared = same_batches_until(ra, rb, min(ends))
    if ra.segments and shared < ra.end:
        # Cut at a's segment boundary: the segment holding the first differing batch is then
        # searched once in each run, as it would be without the shared part.
        shared = ra.segments[ra._segment_index(shared)].first_step
    if shared <= max(ra.start, rb.start):
        return fed(ra, hashes, ends[0], limit), fed(rb, hashes, ends[1], limit)
    common = fed(ra, hashes, shared, limit)
    if not _hold_places(rb, common):
        return fed(ra, hashes, ends[0], limit), fed(rb, hashes, ends[1], limit)
    queries = np.unique(np.asarray(hashes, np.uint64).reshape(-1))
    out = []
    for reader, end in zip((ra, rb), ends):
        places = {h: list(p) for h, p in common.items()}
        # A hash with fewer than `limit` shared places has them all: its later ones follow.
        need = [h for h in queries.tolist() if len(places.get(int(h), ())) < limit]
        for h, more in fed(reader, np.array(need, np.uint64), end, limit, from_step=shared).items():
            got = places.setdefault(h, [])
            got += more[: limit - len(got)]
        out.append(places)
    return out[0], out[1]


def _hold_places(reader: TraceReader, places: Places) -> bool:
    """Whether each (step, position) of `places` holds its hash in `reader`'s records."""
    by_step: dict[int, list[tuple[int, int]]] = {}
    for h, at in places.items():
        for step, pos in at:
            by_step.setdefault(step, []).append((pos, h))
    prefix = record_prefix(reader.schema)
    for step, pairs in sorted(by_step.items()):
        if step not in reader:
            return False
        row = np.frombuffer(reader.raw_record(step)[: prefix.itemsize], prefix, 1)["example_hashes"][0]
        pos = np.array([p for p, _ in pairs], np.int64)
        if pos.max() >= row.size or not np.array_equal(row[pos], np.array([h for _, h in pairs], np.uint64)):
            return False
    return True


def _confirmed(reader: TraceReader, i: int, queries: np.ndarray, limit: int, start_slot: int, stop_slot: int,
               advised: bool = False):
    """(query index, slot) hits of segment i in start_slot..stop_slot-1, each checked in its
    record; an index file whose hits its segment does not confirm is replaced by one built from it.
    `advised`: its index file's pages for these queries were asked for already (`_advise`)."""
    for _ in range(2):
        index = reader.index(i)
        try:
            qi, slots = index.find(queries, limit, advised)
        except IndexUnusable as e:
            reader._index_unusable(reader.segments[i], e)
            continue
        keep = (slots >= start_slot) & (slots < stop_slot)
        qi, slots = qi[keep], slots[keep]
        if reader.segments[i].version >= COMPACT_VERSION:  # its index is the record: the blocks' checksums held
            return qi, slots
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
