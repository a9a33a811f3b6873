"""The audit's engine: per-epoch repeats found in hash-range partitions of the sorted hashes.

Every repeat of an example is a repeat of its hash, so the audit splits the hash space into
ranges and judges each range on its own: all sightings of the hashes in it, sorted by
(hash, slot), are what replay/audit/__init__.py's rules need. For a run's trace the sorted hashes come
from the segments' indexes (traces/index.py: each segment's hashes already sorted), a range
at a time (replay/audit/tables.py), so memory is bounded by the range, not the run. Only
three things are global and small: the per-step count of same-batch copies (which decides
whether a batch's copies are evidence of duplicate content), the per-step row keys that find
whole replayed batches, and the findings themselves.

At 1.4M steps of 1,024 examples: the index tables are read once (~17 GB, 12 bytes a sighting),
a range's hashes checked for repeats in cache-sized pieces on 32-bit keys (`_candidates`), and
only repeated hashes' sightings ordered by slot (all of them when most hashes repeat: several
epochs); ranges are judged JUDGES at a time in threads (`judged`). Memory: JUDGES + 1 ranges and
the unsealed tail's table (peak RSS 0.33 GB at 350k steps with 2 judges) plus 8 bytes a repeat. With
`verify` the records' checksums are read beside it in a thread (BytesCheck, another ~17 GB).
Both together do not fit a 24 GB page cache, so with `verify` the audit runs at the disk's
speed; the tables alone may stay cached between audits. When the dataset size is unknown
the distinct count is needed first: one more pass.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

import traces
from traces import columns
from traces.index import examples_key, index_path
from traces.parallel import WORKERS, ordered_map
from traces.sorting import stable_argsort
from traces.storage import is_remote
from traces.trace import READ_AHEAD
from replay.audit.tables import Piece, request_ahead

SORT_ENTRIES = 1 << 17  # sorted at once within a range: numpy sorts what fits the cache ~2x faster an entry
_SAMPLE_EVERY = 64  # of each piece's sorted hashes, where to cut a range into sorts
JUDGES = WORKERS  # hash ranges judged at once (threads): `judged`
_FEW_CLASHES = 8  # clashing keys of a sub-range looked for one pass each (more: np.isin)
_EMPTY = np.zeros(0, np.int64)


@dataclass
class Part:
    """What one hash range contributes; deferred repeats wait for the global copy evidence."""

    distinct: int = 0
    seen: dict[int, int] = field(default_factory=dict)  # times seen -> distinct hashes seen that often
    again_epochs: np.ndarray = field(default_factory=lambda: _EMPTY)  # epoch of every later sighting in its epoch
    early: np.ndarray = field(default_factory=lambda: _EMPTY)  # slots decided early
    early_first: np.ndarray = field(default_factory=lambda: _EMPTY)
    dups: np.ndarray = field(default_factory=lambda: _EMPTY)  # slots decided duplicate content
    deferred: tuple = (_EMPTY, _EMPTY, _EMPTY, np.zeros(0, np.uint64))  # slot, first slot, rank, hash
    runs: tuple = (np.zeros(0, np.uint64), _EMPTY, _EMPTY)  # same-batch copies: hash, size, step
    duplicates: list = field(default_factory=list)  # source evidence


def analyze(hs: np.ndarray, gs: np.ndarray, N: int, B: int, copies) -> Part:
    """The sightings of a range of hashes, sorted by (hash, slot): hashes `hs`, global slots `gs`."""
    part = Part()
    M = hs.size
    if M == 0:
        return part
    new_h = np.r_[True, hs[1:] != hs[:-1]]
    h_start = np.flatnonzero(new_h)
    times, how_many = np.unique(np.diff(np.r_[h_start, M]), return_counts=True)
    part.distinct, part.seen = int(h_start.size), {int(t): int(c) for t, c in zip(times, how_many)}
    es = gs // N
    new_he = new_h | np.r_[True, es[1:] != es[:-1]]
    again = np.flatnonzero(~new_he)  # sorted positions of second-or-later sightings within an epoch
    if not again.size:
        return part
    starts = np.flatnonzero(new_he)
    he_start = starts[np.searchsorted(starts, again) - 1]  # the (hash, epoch) group each repeat belongs to
    rank = again - he_start
    part.again_epochs = es[again]
    if copies is not None:
        distinct, n = copies
        allowed = np.ones(again.size, dtype=np.int64)
        at = np.clip(np.searchsorted(distinct, hs[again]), 0, max(distinct.size - 1, 0))
        found = distinct[at] == hs[again] if distinct.size else np.zeros(again.size, bool)
        allowed[found] = n[at[found]]
        known = np.unique(hs[again][allowed > 1])
        part.duplicates = [{"hash": int(h), "copies": int(c), "evidence": "source"}
                           for h, c in zip(known, n[np.searchsorted(distinct, known)])]
        early = rank >= allowed
        part.early, part.early_first, part.dups = gs[again[early]], gs[he_start[early]], gs[again[~early]]
        return part
    # Copies in one batch may be duplicate content: a (hash, epoch, step) group of k sits at k
    # adjacent sorted places, k - 1 of them in same_step. Whether it counts is decided globally.
    same_step = again[gs[again] // B == gs[again - 1] // B]
    if same_step.size:
        run_start = np.flatnonzero(np.r_[True, np.diff(same_step) != 1])
        run_ends = np.r_[run_start[1:], same_step.size]
        first = same_step[run_start]
        part.runs = (hs[first], run_ends - run_start + 1, gs[first] // B)
    has_runs = np.isin(hs[again], part.runs[0]) if same_step.size else np.zeros(again.size, bool)
    sure = ~has_runs  # allowed one sighting: every repeat is early
    part.early, part.early_first = gs[again[sure]], gs[he_start[sure]]
    d = again[has_runs]
    part.deferred = (gs[d], gs[he_start[has_runs]], rank[has_runs], hs[d])
    return part


def _copy_evidence(parts: list[Part], B: int) -> tuple[np.ndarray, np.ndarray, list[dict]]:
    """(hashes, copies) the trace shows to be duplicate content, sorted by hash, and the evidence.

    From copies of a hash at several positions of one batch; a batch where many different
    examples repeat is not taken as evidence: that is the signature of hosts reading the same
    slice (a sampler bug), while duplicate windows are rare, or one window (padding) repeated.
    """
    qh = np.concatenate([p.runs[0] for p in parts])
    if not qh.size:
        return np.zeros(0, np.uint64), _EMPTY, []
    qsize = np.concatenate([p.runs[1] for p in parts])
    qstep = np.concatenate([p.runs[2] for p in parts])
    steps_u, per_step = np.unique(qstep, return_counts=True)
    plausible = per_step[np.searchsorted(steps_u, qstep)] <= max(1, B // 8)
    qh, qsize, qstep = qh[plausible], qsize[plausible], qstep[plausible]
    sort = np.lexsort((-qsize, qh))
    qh, qsize, qstep = qh[sort], qsize[sort], qstep[sort]
    keep = np.r_[True, qh[1:] != qh[:-1]] if qh.size else np.zeros(0, bool)  # the largest same-step count per hash
    qh, qsize, qstep = qh[keep], qsize[keep], qstep[keep]
    evidence = [{"hash": int(h), "copies": int(c), "evidence": f"{int(c)} copies in the batch of step {int(s)}"}
                for h, c, s in zip(qh, qsize, qstep)]
    return qh, qsize, evidence


def combine(parts: list[Part], B: int, N: int, base: int, M: int, replayed: np.ndarray, replay_first: np.ndarray,
            copies) -> dict:
    """The AuditReport fields that come from the parts (see replay/audit/__init__.py)."""
    early, early_first, dups = [p.early for p in parts], [p.early_first for p in parts], [p.dups for p in parts]
    duplicates = [d for p in parts for d in p.duplicates]
    if copies is None:
        qh, qsize, duplicates = _copy_evidence(parts, B)
        slot, first, rank, h = (np.concatenate([p.deferred[k] for p in parts]) for k in range(4))
        allowed = np.ones(slot.size, np.int64)
        if qh.size and slot.size:
            at = np.clip(np.searchsorted(qh, h), 0, qh.size - 1)
            hit = qh[at] == h
            allowed[hit] = qsize[at[hit]]
        is_early = rank >= allowed
        early.append(slot[is_early])
        early_first.append(first[is_early])
        dups.append(slot[~is_early])
    early_slots, keep = np.unique(np.concatenate(early + [replayed]).astype(np.int64), return_index=True)
    first_seen = np.concatenate(early_first + [replay_first]).astype(np.int64)[keep]
    dup_slots = np.setdiff1d(np.concatenate(dups).astype(np.int64), early_slots)
    e0, e1 = base // N, (base + M - 1) // N
    epochs = np.arange(e0, e1 + 1)
    lo, hi = np.maximum(epochs * N, base), np.minimum((epochs + 1) * N, base + M)
    again = np.bincount(np.concatenate([p.again_epochs for p in parts]).astype(np.int64) - e0, minlength=epochs.size)
    count = lambda slots: np.bincount(slots // N - e0, minlength=epochs.size)  # noqa: E731
    seen: dict[int, int] = {}
    for p in parts:
        for t, c in p.seen.items():
            seen[t] = seen.get(t, 0) + c
    return {
        "distinct": sum(p.distinct for p in parts), "times_seen": dict(sorted(seen.items())),
        "early_slots": early_slots, "first_seen_slots": first_seen, "duplicate_slots": dup_slots,
        "duplicates": duplicates, "replayed_batches": replayed.size // B if B else 0,
        "per_epoch": {
            "epoch": epochs, "first_step": lo // B, "last_step": (hi - 1) // B, "slots": hi - lo,
            "complete": (hi - lo) == N, "distinct": hi - lo - again,
            "early": count(early_slots), "duplicate": count(dup_slots),
        },
    }


def replayed_batches(keys: np.ndarray, rows, base: int, N: int, B: int) -> tuple[np.ndarray, np.ndarray]:
    """Slots of steps whose whole batch repeats an earlier step's in order, and the slots they repeat.

    `keys`: traces.index.examples_key of each step's row (equal rows, equal keys); `rows(steps)`
    gives the rows of those steps, to confirm every equal key exactly. A fresh permutation per
    epoch practically never deals the same ordered batch twice, so this catches replayed data
    even across an epoch boundary, and when N is unknown and the epochs are only a guess.
    Skipped when the data is so small that it could happen by chance: (pairs of steps) / (N)_B,
    the expected count, above 1e-6.
    """
    S = keys.size
    none = _EMPTY, _EMPTY
    if S < 2 or B > N or 2 * np.log10(S) - np.log10(N - np.arange(B, dtype=np.float64)).sum() > -6:
        return none
    order, ks = stable_argsort(keys)
    again = np.flatnonzero(ks[1:] == ks[:-1]) + 1
    if not again.size:
        return none
    starts = np.flatnonzero(np.r_[True, ks[1:] != ks[:-1]])
    later, first = order[again], order[starts[np.searchsorted(starts, again) - 1]]
    same = (rows(later) == rows(first)).all(axis=1)
    cols = np.arange(B)
    return (base + later[same, None] * B + cols).ravel(), (base + first[same, None] * B + cols).ravel()


def memory_parts(hashes_SxB: np.ndarray, base: int, N: int, copies) -> list[Part]:
    """The in-memory audit: the whole block as one range."""
    flat = np.ascontiguousarray(hashes_SxB, dtype=np.uint64).ravel()
    gs, hs = stable_argsort(flat)
    gs += base
    return [analyze(hs, gs, N, hashes_SxB.shape[1], copies)]


def memory_keys(hashes_SxB: np.ndarray) -> np.ndarray:
    return examples_key(np.ascontiguousarray(hashes_SxB, dtype=np.uint64))


# ------------------------------------------------------------------------------ a range of hashes


def _repeats(pieces: list[Piece], M: int) -> tuple[np.ndarray, int, dict[int, int]]:
    """(the hashes seen more than once, sorted; distinct hashes; times seen -> how many) of the
    range's M sightings. The pieces are sorted, so the range splits at common cut values into
    sub-ranges of about SORT_ENTRIES, each concatenated and sorted alone: equal hashes meet in one
    sub-range, and a sort that fits the cache costs ~half a sort of the whole range an entry."""
    parts = -(-M // SORT_ENTRIES)
    cuts = np.zeros(0, np.uint64)
    if parts > 1:
        sample = np.sort(np.concatenate([p.hs[::_SAMPLE_EVERY] for p in pieces]))
        cuts = np.unique(sample[(np.arange(1, parts) * sample.size) // parts])
    edges = [[0, *np.searchsorted(p.hs, cuts, "left").tolist(), p.hs.size] for p in pieces]
    repeated, distinct, seen = [], 0, {}
    first = min(int(p.hs[0]) for p in pieces)
    last = max(int(p.hs[-1]) for p in pieces)
    bounds = [first, *cuts.tolist(), last]  # sub-range k's hashes lie in [bounds[k], bounds[k + 1]]
    for k in range(cuts.size + 1):
        s = np.concatenate([p.hs[e[k] : e[k + 1]] for p, e in zip(pieces, edges)])
        if not s.size:
            continue
        s, once = _candidates(s, bounds[k], bounds[k + 1])
        if once:
            distinct, seen[1] = distinct + once, seen.get(1, 0) + once
        if not s.size:  # no hash of the sub-range repeats: the common case within one epoch
            continue
        s.sort()
        same = s[1:] == s[:-1]
        starts = np.flatnonzero(np.r_[True, ~same])
        counts = np.diff(starts, append=s.size)
        repeated.append(s[starts[counts > 1]])
        distinct += starts.size
        for t, c in zip(*np.unique(counts, return_counts=True)):
            seen[int(t)] = seen.get(int(t), 0) + int(c)
    return (np.concatenate(repeated) if repeated else np.zeros(0, np.uint64)), distinct, seen


def _candidates(s: np.ndarray, lo: int, hi: int) -> tuple[np.ndarray, int]:
    """The hashes of `s` (unsorted uint64, all in [lo, hi]) that may repeat, and how many certainly
    do not (none may: an empty array and s.size). Repeats are looked for on 32-bit keys, each hash's top 32 bits
    above `lo` (equal hashes get equal keys), which numpy's SIMD sort orders ~2x faster an entry
    than the hashes (1 << 17 of them: 0.6 ms against 1.6 on this machine's AVX2). Keys that clash
    (about two pairs a sub-range of 1 << 17 within one epoch: distinct hashes may share their top
    bits) only make their hashes candidates, which are sorted exactly."""
    shift = max(0, (hi - lo).bit_length() - 32)
    keys = ((s - np.uint64(lo)) >> np.uint64(shift)).astype(np.uint32)
    ordered = np.sort(keys)
    same = ordered[1:] == ordered[:-1]
    if not same.any():
        return s[:0], s.size
    clashing = ordered[1:][same]
    if clashing.size * 16 > s.size:  # many repeats (several epochs): sort them all
        return s, 0
    if clashing.size <= _FEW_CLASHES:  # a pass a key: np.isin cost ~2x these passes at 1 << 17 keys
        maybe = keys == clashing[0]
        for key in clashing[1:].tolist():
            maybe |= keys == key
    else:
        maybe = np.isin(keys, clashing)
    return s[maybe], s.size - int(np.count_nonzero(maybe))


def range_part(pieces: list[Piece], N: int, B: int, copies) -> Part:
    """`analyze` of one hash range given as per-segment pieces, segments in slot order. Only
    hashes seen more than once need their slots in order: the range's hashes are sorted alone
    (numpy's SIMD sort of cache-sized sub-ranges, no argsort), which gives the distinct count and
    times seen, and the sightings of the repeated hashes (rare within one epoch) are gathered
    from the pieces by bisection and analysed. When most hashes repeat (several epochs) the
    whole range is sorted by (hash, slot) instead, as `analyze` expects."""
    pieces = [p for p in pieces if p.hs.size]
    M = sum(p.hs.size for p in pieces)
    if M == 0:
        return Part()
    repeated, distinct, seen = _repeats(pieces, M)
    if not repeated.size:
        return Part(distinct=M, seen={1: M})
    if repeated.size * 8 > M:
        order, hs = stable_argsort(np.concatenate([p.hs for p in pieces]))  # pieces in slot order: stable keeps (hash, slot)
        return analyze(hs, np.concatenate([p.global_slots() for p in pieces])[order], N, B, copies)
    sub_h, sub_g = [], []
    for p in pieces:
        lo, hi = np.searchsorted(p.hs, repeated, "left"), np.searchsorted(p.hs, repeated, "right")
        n = hi - lo
        at = np.repeat(lo - np.r_[0, np.cumsum(n)[:-1]], n) + np.arange(int(n.sum()))
        sub_h.append(p.hs[at])
        sub_g.append(p.global_slots(at))
    sub_h, sub_g = np.concatenate(sub_h), np.concatenate(sub_g)
    order = np.lexsort((sub_g, sub_h))
    part = analyze(sub_h[order], sub_g[order], N, B, copies)
    part.distinct, part.seen = distinct, dict(sorted(seen.items()))
    return part


def judged(judge, ranges):
    """judge(pieces) of each range, in range order, JUDGES ranges at a time in threads
    (traces.parallel.ordered_map): a range's work is mostly numpy's sorts, copies and
    comparisons, which release the GIL, so on several cores ranges are judged side by side (this
    2-core machine: the audit of a 350k-step run used ~1.2 cores with one). Memory: JUDGES ranges
    held beside the one being read (~50 MB each)."""
    return ordered_map(judge, ranges, workers=JUDGES, name="replay-audit-judge")


def range_distinct(pieces: list[Piece]) -> int:
    pieces = [p for p in pieces if p.hs.size]
    return _repeats(pieces, sum(p.hs.size for p in pieces))[1] if pieces else 0


class BytesCheck:
    """reader.check_bytes(start, stop) in a thread while the caller analyses the indexes: both
    mostly wait on the disk, crc32 and numpy's sorts, which release the GIL. The check only
    reads (segment files, the tail's offsets known since opening); `result()` raises its error."""

    def __init__(self, reader: traces.TraceReader, start: int, stop: int, enabled: bool = True):
        self._args, self._error = (reader, start, stop), None
        self._thread = threading.Thread(target=self._run, name="replay-audit-check", daemon=True) if enabled else None

    def _run(self) -> None:
        reader, start, stop = self._args
        try:
            reader.check_bytes(start, stop)
        except BaseException as e:  # noqa: BLE001 - handed to the caller by result()
            self._error = e

    def __enter__(self) -> "BytesCheck":
        if self._thread is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> bool:
        if self._thread is not None:
            self._thread.join()
        return False

    def result(self) -> None:
        if self._error is not None:
            raise self._error


def _examples_key_span(index):
    return index.column_span("examples_key") if index.column_crc else None  # version 1: all columns at once


def trace_keys(reader: traces.TraceReader, start: int, stop: int) -> np.ndarray:
    """Each step's examples key, from the one column (remote: a window of segments' at once)."""
    spans = list(columns.segment_ranges(reader, start, stop))
    keys = []
    for k, (i, lo, hi) in enumerate(spans):
        if k % READ_AHEAD == 0:
            request_ahead(reader, [j for j, _, _ in spans[k : k + READ_AHEAD]], _examples_key_span)
        keys.append(reader.column(i, "examples_key")[lo:hi])
    return np.concatenate(keys or [_EMPTY]).astype(np.uint64)


def trace_rows(reader: traces.TraceReader, start: int):
    """rows(steps): the example hashes of steps start + s for each s, read from the records."""
    def rows(offsets: np.ndarray) -> np.ndarray:
        out = np.empty((offsets.size, reader.schema.examples_per_step), np.uint64)
        order = np.argsort(offsets, kind="stable")  # in step order: a segment's records together (a
        steps = (start + offsets[order]).tolist()  # compacted one's hashes are rebuilt once, not again and again)
        for k, step in enumerate(steps):
            if k % READ_AHEAD == 0:
                _frames_ahead(reader, steps[k : k + READ_AHEAD])
            out[order[k]] = reader.read(step).example_hashes
        return out
    return rows


def _frames_ahead(reader: traces.TraceReader, steps: list[int]) -> None:
    """On object storage, the frames of these steps at once (their segments' offsets first)."""
    if not is_remote(reader.dir):
        return
    where = {s: reader._segment_index(s) for s in steps if s in reader}
    unknown = sorted({i for i in where.values() if reader.segments[i].offsets is None})
    request_ahead(reader, unknown, lambda index: index.column_span("offsets") if index.column_crc else None)
    ranges = []
    for step, i in where.items():
        seg = reader.segments[i]
        offsets = reader.offsets(i)
        at, end = int(offsets[step - seg.first_step]), int(offsets[step - seg.first_step + 1])
        ranges.append((seg.path.key, at, end - at))
        # a compacted segment's record takes its hashes from its index (traces/compaction.py)
        k = step - seg.first_step
        key = index_path(seg.path).key
        ranges += [(key, a, n) for a, n in reader.hash_reads(i, k, k + 1) if (key, a, n) not in ranges]
    reader.dir.view.prefetch(ranges)
