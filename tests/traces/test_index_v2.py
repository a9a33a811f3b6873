"""Index version 2 (issue 12): one column read alone, the example filter in front of the sorted
table, the segment summary that lets compare skip equal segments (version 1 and 2 files still read:
tests/traces/test_index_v3.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from traces import Run, columns, compare, fed
from traces import filter as example_filter
from traces.index import INDEX_HEADER_SIZE, _column_layout
from traces.index_file import FileIndex
from tests.traces.helpers import make_record, make_schema
from tests.traces.test_index import PER, STEPS, brute_fed, planted, write


@pytest.fixture
def run(tmp_path):
    schema = make_schema()
    recs = planted(schema)
    return write(tmp_path / "run", recs, schema), schema, recs


def _counting(monkeypatch, name):
    calls = []
    real = getattr(FileIndex, name)

    def counted(self, *args):
        calls.append((self.first_step, *args))
        return real(self, *args)

    monkeypatch.setattr(FileIndex, name, counted)
    return calls


def test_a_metric_column_is_read_without_the_other_columns(run, monkeypatch):
    path, schema, recs = run
    whole = _counting(monkeypatch, "columns")
    trace = Run.open(path).trace
    assert np.array_equal(columns.metric(trace, "loss"), [r.metrics[0] for r in recs])
    assert np.array_equal(columns.batch_hashes(trace), [r.batch_hash for r in recs])
    assert whole == []  # old code read every column of every segment for one metric


def test_a_damaged_column_is_found_when_that_column_is_read(run):
    path, schema, recs = run
    idx = path / "trace" / "000000000000.idx"
    layout = {name: pos for name, _, _, pos in _column_layout(schema, PER)[0]}
    data = bytearray(idx.read_bytes())
    data[INDEX_HEADER_SIZE + layout["metric_bits"] + 2] ^= 0x10
    idx.write_bytes(bytes(data))
    trace = Run.open(path).trace
    assert np.array_equal(columns.metric(trace, "loss"), [r.metrics[0] for r in recs])  # rebuilt from the segment
    assert any("metric_bits column's checksum" in n for n in trace.notes)


def test_the_filter_never_misses_a_hash_and_rules_out_most_others(run):
    path, schema, recs = run
    trace = Run.open(path).trace
    index = trace.index(0)
    held = np.unique([r.example_hashes for r in recs[:PER]])
    assert index.maybe(held).all()
    others = np.unique(np.random.default_rng(7).integers(0, 2**63, 4000, dtype=np.uint64))
    assert index.maybe(others).mean() < 0.05  # 16 records of 16 hashes: ~0.5% expected


def test_a_search_the_filter_rules_out_reads_no_table_block(run, monkeypatch):
    path, schema, recs = run
    blocks = _counting(monkeypatch, "_blocks")
    r = Run.open(path)
    h = recs[5].example_hashes[2]  # in segment 0, and at steps 70 and 90 (segments 4 and 5)
    assert fed(r, [h], limit=5)[int(h)] == brute_fed(recs, h, STEPS, 5)
    assert sorted({first for first, _ in blocks}) == [0, 64, 80]  # the segments that hold it, no other


# ------------------------------------------------------------------------------ the summary in compare


@pytest.mark.parametrize("step", [3, 50, 99])
def test_compare_skips_segments_whose_summaries_match_and_finds_the_difference(tmp_path, monkeypatch, step):
    schema = make_schema()
    recs = [make_record(schema, k) for k in range(STEPS)]
    a = write(tmp_path / "a", recs, schema)
    changed = list(recs)
    m = recs[step].metrics.copy()
    m[0] = np.nextafter(m[0], np.float32(np.inf))
    changed[step] = dataclasses.replace(recs[step], metrics=m)
    b = write(tmp_path / "b", changed, schema)
    read = _counting(monkeypatch, "columns")
    c = compare(Run.open(a).trace, Run.open(b).trace)
    assert not c.identical and c.first_step == step
    differing = (step // PER) * PER
    assert {first for first, *_ in read} <= {differing}  # equal segments before it: their headers only


def test_prefetch_asks_for_exactly_the_pages_a_search_touches(run, monkeypatch):
    """FileIndex.prefetch advises (posix_fadvise WILLNEED) each page a filter block of a query lies
    in, and no other page: with 40-byte 'pages' a 64-byte block spans two or three, so a page
    set off by one, or the whole filter advised, differs from the pages touched."""
    from traces import index_file

    path, schema, recs = run
    advised = []
    monkeypatch.setattr(index_file.os, "posix_fadvise", lambda fd, at, size, how: advised.append((at, size, how)))
    monkeypatch.setattr(index_file, "PAGE", 40)
    index = Run.open(path).trace.index(1)
    queries = np.array([recs[20].example_hashes[3], np.uint64(12345)], np.uint64)
    index.prefetch(queries)
    assert all(how == index_file.os.POSIX_FADV_WILLNEED for *_, how in advised)
    pages = {p for at, size, _ in advised for p in range(at // 40, (at + size) // 40)}
    blocks = example_filter.block_of(queries, index.filter_blocks).astype(np.int64)
    starts = [index._filter_at + 64 * int(b) for b in blocks]
    assert len(set(blocks.tolist())) == 2 and all(at % 40 for at in starts)  # two blocks, neither page-aligned
    assert pages == {p for at in starts for p in range(at // 40, (at + 63) // 40 + 1)}


def test_a_search_asks_for_each_segments_filter_pages_before_reading_them(run, monkeypatch):
    from traces import index_file

    path, schema, recs = run
    events = []  # (what, index file), in the order they happened (the next segment's advice comes from a thread)
    willneed = index_file._willneed
    monkeypatch.setattr(index_file, "_willneed", lambda p, spans: events.append(("advice", p)) or willneed(p, spans))
    maybe = FileIndex.maybe
    monkeypatch.setattr(FileIndex, "maybe", lambda self, q: events.append(("read", self.path)) or maybe(self, q))
    h = recs[5].example_hashes[2]
    assert fed(Run.open(path), [h], limit=5)[int(h)] == brute_fed(recs, h, STEPS, 5)
    reads = [(k, p) for k, (e, p) in enumerate(events) if e == "read"]
    assert len({p for _, p in reads}) == len(reads) == 6  # six sealed segments, each read once
    assert all(("advice", p) in events[:k] for k, p in reads)  # each one's pages asked for before it is read
    assert len(events) == 12  # and once only
