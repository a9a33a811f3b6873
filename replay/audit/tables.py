"""A trace's sightings read a hash range at a time from its segments' index tables.

Each segment's index holds its example hashes sorted, with their slots, in checksummed blocks
(traces/index.py), so the sightings of hashes in [lo, hi) are one contiguous read a segment:
a range of PARTITION_ENTRIES sightings is ~12 bytes each in memory, whatever the run's length
(9 bytes each on disk in index version 3, 12 in version 2).
replay/audit/scan.py judges each range. At 1.4M steps of 1,024 examples: 13 GB of tables (17 GB
in version 2), ~340 ranges of 86 reads each; the next range is read in a thread while one is
judged.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

import traces
from traces.index import IndexUnusable
from traces.index_file import FileIndex
from traces.storage import is_remote
from traces.trace import READ_AHEAD

PARTITION_ENTRIES = 1 << 22  # sightings read a range: ~12 bytes each held, ~50 MB


@dataclass(frozen=True)
class Piece:
    """One segment's sightings in a hash range: hashes sorted, and their slots (uint32, offsets
    in the segment; `base` + slot is the global slot). Slots stay narrow: only repeated hashes
    ever need theirs."""

    hs: np.ndarray
    slots: np.ndarray
    base: int

    def global_slots(self, at=slice(None)) -> np.ndarray:
        return self.slots[at].astype(np.int64) + self.base


def _ranges(reader: traces.TraceReader, segments: list[int], entries: int) -> list[tuple[int, int | None]]:
    """Hash ranges [lo, hi) of about PARTITION_ENTRIES sightings each, cut at quantiles of the
    segments' block fences (every 256th sorted hash; index version 3: its top 8-24 bits, from the
    bucket table), so uneven hashes split evenly too; even
    cuts of the hash space when there are too few fences for that (small segments)."""
    parts = max(1, -(-entries // PARTITION_ENTRIES))
    if parts == 1:
        return [(0, None)]
    for k in range(0, len(segments), READ_AHEAD):
        request_ahead(reader, segments[k : k + READ_AHEAD], lambda index: index.heads_span())
    sample = np.sort(np.concatenate([reader.with_index(i, lambda index: index.sample()) for i in segments]))
    if sample.size >= 8 * parts:
        cuts = [int(c) for c in np.unique(sample[(np.arange(1, parts) * sample.size) // parts]) if int(c) > 0]
    else:
        cuts = [(k << 64) // parts for k in range(1, parts)]
    bounds = [0] + cuts
    return list(zip(bounds, bounds[1:] + [None]))


def trace_pieces(reader: traces.TraceReader, start: int, stop: int):
    """Per hash range, the list of Pieces (hashes sorted, slots) of each segment's sightings in
    steps start..stop-1, segments in order; read from the segments' indexes. The next range is
    read in a thread while the caller analyses this one (preads, and numpy's copies, release the
    GIL; the reader is only used by that thread while this runs), its bytes asked of the kernel
    first (posix_fadvise WILLNEED on a local disk) so the disk has many reads in flight."""
    B = reader.schema.examples_per_step
    segments = [i for i, s in enumerate(reader.segments) if s.first_step < stop and s.first_step + s.count > start]
    entries = sum(reader.segments[i].count for i in segments) * B

    def read(lo: int, hi: int | None) -> list[Piece]:
        _advise(reader, segments, lo, hi)
        pieces = []
        for k, i in enumerate(segments):
            if k % READ_AHEAD == 0:  # remote: a window's block heads, then the window's tables, at once
                window = segments[k : k + READ_AHEAD]
                request_ahead(reader, window, lambda index: index.heads_span())
                request_ahead(reader, window, lambda index: index.table_span(lo, hi))
            seg = reader.segments[i]
            hs, slots = reader.with_index(i, lambda index: index.table(lo, hi))
            base = seg.first_step * B
            if seg.first_step < start or seg.first_step + seg.count > stop:
                keep = (slots >= max(0, start * B - base)) & (slots < stop * B - base)
                hs, slots = hs[keep], slots[keep]
            pieces.append(Piece(hs, slots, base))
        return pieces

    ranges = _ranges(reader, segments, entries)
    if is_remote(reader.dir):  # a window of requests at once already (request_ahead); kept on this thread
        yield from (read(lo, hi) for lo, hi in ranges)
        return
    with ThreadPoolExecutor(1, thread_name_prefix="replay-audit-read") as pool:
        ahead = pool.submit(read, *ranges[0])
        for r in range(len(ranges)):
            pieces = ahead.result()
            if r + 1 < len(ranges):
                ahead = pool.submit(read, *ranges[r + 1])
            yield pieces


def _advise(reader: traces.TraceReader, segments: list[int], lo: int, hi: int | None) -> None:
    """Asks the kernel to read these segments' table bytes for [lo, hi) ahead (local files whose
    index is open; anything else, a damaged one included, is left to the read itself)."""
    if is_remote(reader.dir):
        return
    for i in segments:
        index = reader.segments[i].index
        if isinstance(index, FileIndex):
            try:
                index.advise_table(lo, hi)
            except IndexUnusable:
                pass  # the read will say what is wrong


def request_ahead(reader: traces.TraceReader, segments: list[int], span) -> None:
    """On object storage, requests the part `span(index)` of these segments' index files at once
    (one round trip for the window instead of one a segment); what cannot be planned (no index
    file, a damaged one) is left to the reader's own read, where it is handled."""
    if not is_remote(reader.dir):
        return
    ranges = []
    for i in segments:
        try:
            index = reader._file_index(i)
            part = None if index is None else span(index)
            if part is not None:
                ranges.append((index.path.key, *part))
        except IndexUnusable:
            pass
    reader.dir.view.prefetch(ranges)
