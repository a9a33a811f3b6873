"""Two runs' "where was this example fed" (traces.fed.fed_in_both, bisect's repeated-data
search): batches first, per-example hashes only where the batches differ. The steps both traces
hold with equal batches are searched in one run; the answer is each run's own search's."""

from __future__ import annotations

import dataclasses
import sys

import numpy as np
import pytest

from tests.traces.helpers import FileReads, make_record, make_schema
from traces import Run, StepRecord, fed
from traces.fed import fed_in_both, same_batches_until
from traces.index import index_path

SCHEMA = make_schema(layer=False)
B = SCHEMA.examples_per_step
STEPS = 60


def hashes_of(seed: int, steps: int = STEPS, pool: int = 400) -> np.ndarray:
    """Example hashes drawn from a small pool, so most recur in many places."""
    rng = np.random.default_rng(seed)
    return (rng.integers(0, pool, (steps, B)).astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) | np.uint64(1)


def write(path, rows: np.ndarray, segment_records: int = 8, start: int = 0, batch_hash=None, seal_all=True) -> Run:
    run = Run.create(path, SCHEMA, {"config": {}}, first_step=start)
    writer = run.writer(segment_records)
    for k, row in enumerate(rows[start:], start):
        rec = make_record(SCHEMA, k)
        bh = int(row.sum(dtype=np.uint64)) if batch_hash is None else batch_hash
        writer.append(dataclasses.replace(rec, example_hashes=np.asarray(row, np.uint64), batch_hash=bh))
    run.finish() if seal_all else run.close()
    return Run.open(path)


def resumed_from(rows: np.ndarray, at: int, back: int) -> np.ndarray:
    """B: A's batches until `at`, then half of each batch fed `back` steps before, again."""
    out = rows.copy()
    out[at:, : B // 2] = rows[at - back : len(rows) - back, : B // 2]
    return out


A_ROWS = hashes_of(1)
SCENARIOS = {  # name -> (B's rows, B's segment size, B's first step, one batch hash for every step)
    "resume mid-segment": (resumed_from(A_ROWS, 43, 20), 8, 0, None),
    "resume at a segment start": (resumed_from(A_ROWS, 40, 20), 8, 0, None),
    "resume in the first segment": (resumed_from(A_ROWS, 5, 3), 8, 0, None),
    "other segment sizes": (resumed_from(A_ROWS, 43, 20), 5, 0, None),
    "identical": (A_ROWS.copy(), 8, 0, None),
    "B starts later": (resumed_from(A_ROWS, 43, 20), 8, 16, None),
    "batch hashes say nothing": (resumed_from(A_ROWS, 43, 20), 8, 0, 7),  # a writer that records a constant
}


@pytest.mark.parametrize("name", list(SCENARIOS))
@pytest.mark.parametrize("limit", [1, 5])
def test_fed_in_both_is_each_runs_own_search(tmp_path, name, limit):
    rows, records, start, bh = SCENARIOS[name]
    a = write(tmp_path / "a", A_ROWS, batch_hash=bh)
    b = write(tmp_path / "b", rows, records, start, batch_hash=bh, seal_all=name != "identical")
    queries = np.concatenate([A_ROWS[50], rows[50], [np.uint64(2)]])  # the last is never fed
    got = fed_in_both(a, b, queries, before_step=51, limit=limit)
    assert got == (fed(a, queries, 51, limit), fed(b, queries, 51, limit))
    assert any(len(p) == limit for p in got[1].values())


def test_the_first_differing_batch_is_found_in_the_batch_columns(tmp_path):
    a = write(tmp_path / "a", A_ROWS)
    assert same_batches_until(a.trace, write(tmp_path / "b", resumed_from(A_ROWS, 43, 20)).trace, STEPS) == 43
    assert same_batches_until(a.trace, write(tmp_path / "c", A_ROWS.copy(), 5).trace, STEPS) == STEPS
    # The writer's batch hash equal at every step: the index's key of the examples still tells.
    d = write(tmp_path / "d", A_ROWS, batch_hash=7)
    e = write(tmp_path / "e", resumed_from(A_ROWS, 43, 20), batch_hash=7)
    assert same_batches_until(d.trace, e.trace, STEPS) == 43


def test_a_shared_place_b_does_not_hold_sends_b_to_its_own_search(tmp_path, monkeypatch):
    """The places found in A are confirmed in B's records; one that fails there is not believed."""
    fed_module = sys.modules["traces.fed"]  # the package's name `fed` is the function
    a = write(tmp_path / "a", A_ROWS)
    b = write(tmp_path / "b", resumed_from(A_ROWS, 43, 20))
    monkeypatch.setattr(fed_module, "same_batches_until", lambda ra, rb, stop: stop)  # as if no batch differed
    rows = resumed_from(A_ROWS, 43, 20)
    queries = rows[50]
    assert fed_in_both(a, b, queries, 51, 5) == (fed(a, queries, 51, 5), fed(b, queries, 51, 5))


def test_b_is_searched_only_from_the_segment_where_its_batches_part(tmp_path, monkeypatch):
    """Counted from the moment the traces are opened: of B's index files before the segment
    holding the first differing batch, only the headers are read (no filter block, no table
    block), beyond what confirming one of A's places in B's record reads: its offsets column and,
    the segments being compacted (their index holds the record's hashes: traces/compaction.py),
    the examples key column, the block heads and the table blocks of that step's hashes; A's are
    searched as one run's search would be. Searching both runs whole (as bisect did) reads B's
    filters in every segment."""
    a_rows = hashes_of(2, 200, pool=10**6)
    b_rows = resumed_from(a_rows, 180, 100)
    write(tmp_path / "a", a_rows, 16)
    write(tmp_path / "b", b_rows, 16)
    reads = FileReads(monkeypatch)
    a, b = Run.open(tmp_path / "a"), Run.open(tmp_path / "b")
    queries = np.concatenate([a_rows[185], b_rows[185]])
    places_a, places_b = fed_in_both(a, b, queries, before_step=186, limit=5)
    assert any(s == 85 for p in places_b.values() for s, _ in p)  # B's repeats, found where A fed them
    cut = b.trace.segments[b.trace._segment_index(180)].first_step
    for seg in b.trace.segments:
        path = str(index_path(seg.path))
        if seg.first_step < cut:  # its header, and where a place is confirmed what reading the record reads
            assert reads.filter_blocks.get(path, 0) == 0, seg.path.name
            lay = b.trace.index(b.trace._segment_index(seg.first_step)).layout
            confirm = 8 * (seg.count + 1) + 8 * seg.count + lay.heads_size + lay.blocks * lay.block_bytes
            assert reads.bytes.get(path, 0) in (120, 120 + confirm), seg.path.name
        elif seg.first_step <= 185:
            assert reads.filter_blocks.get(path, 0) > 0, seg.path.name
    searched_a = [s for s in a.trace.segments if reads.filter_blocks.get(str(index_path(s.path)))]
    assert len(searched_a) == len([s for s in a.trace.segments if s.first_step <= 185])
    assert sum(reads.filter_blocks.values()) < 0.6 * 2 * len(searched_a) * len(np.unique(queries))
