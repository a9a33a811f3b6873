"""Segment indexes (issue 12): written at seal, checked, rebuilt when missing or damaged; the
columns and "where was this example fed" they answer, checked against the records."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from traces import Run, TraceCorruptError, TraceReader, TraceWriter, columns, compare, fed, first_fed, write_indexes
from traces import filter as example_filter
from traces.index import INDEX_HEADER_SIZE, _column_layout, examples_key, index_path
from traces.index_file import FileIndex
from tests.traces.helpers import BytesRead, make_record, make_schema

PER, STEPS = 16, 100  # six sealed segments and a tail of 4 records


def planted(schema, steps=STEPS):
    """Records with example hashes fed again: step 5's position 2 at steps 70 and 90 (twice)."""
    recs = [make_record(schema, k) for k in range(steps)]
    h = recs[5].example_hashes[2]
    recs[70].example_hashes[3] = h
    recs[90].example_hashes[0] = recs[90].example_hashes[9] = h
    recs[97].example_hashes[1] = recs[40].example_hashes[4]  # a repeat fed again in the tail
    return recs


def write(path, recs, schema, per=PER):
    """A run whose sealed segments keep their hashes in their records (not compacted, as format 2
    wrote them and a failed compaction leaves them): their indexes are derived, what this file tests.
    Compacted segments, whose index is the hashes' only copy: tests/traces/test_compaction.py."""
    run = Run.create(path, schema, {})
    w = run.writer(segment_records=per, compact=False)
    for r in recs:
        w.append(r)
    run.close()
    return path


@pytest.fixture
def run(tmp_path):
    schema = make_schema()
    recs = planted(schema)
    return write(tmp_path / "run", recs, schema), schema, recs


def brute_fed(recs, h, before, limit):
    places = [(r.step, int(p)) for r in recs if r.step < before for p in np.flatnonzero(r.example_hashes == h)]
    return places[:limit]


def test_every_sealed_segment_gets_an_index_and_its_columns_match_the_records(run):
    path, schema, recs = run
    trace = Run.open(path).trace
    assert [index_path(s.path).exists() for s in trace.segments] == [True] * 6 + [False]
    for i, seg in enumerate(trace.segments):
        c = trace.columns(i)
        mine = recs[seg.first_step : seg.first_step + seg.count]
        assert np.array_equal(c.batch_hash, [r.batch_hash for r in mine])
        assert np.array_equal(c.rng, [r.rng for r in mine])
        assert np.array_equal(c.metric_bits, [r.metrics.view(np.uint32) for r in mine])
        assert np.array_equal(c.flags, [r.flags for r in mine])
        assert np.array_equal(c.examples_key, examples_key(np.array([r.example_hashes for r in mine])))
        assert np.array_equal(np.diff(c.offsets.astype(np.int64)) > 8, np.ones(seg.count, bool))
    assert trace.notes == []


@pytest.mark.parametrize("before", [None, 6, 70, 71, 91, 98])
def test_fed_finds_every_place_in_order_as_a_scan_of_the_records_does(run, before):
    path, schema, recs = run
    r = Run.open(path)
    wanted = [recs[5].example_hashes[2], recs[40].example_hashes[4], recs[99].example_hashes[0], 12345]
    got = fed(r, wanted, before_step=before, limit=3)
    stop = STEPS if before is None else before
    expected = {int(h): brute_fed(recs, h, stop, 3) for h in wanted}
    assert got == {h: p for h, p in expected.items() if p}
    assert first_fed(r, wanted, before) == {h: p[0][0] for h, p in expected.items() if p}
    assert got.get(int(recs[5].example_hashes[2]), [None])[0] in (None, (5, 2))


def test_fed_of_a_whole_batch_matches_the_records(run):
    path, schema, recs = run
    batch = recs[90].example_hashes
    got = first_fed(Run.open(path), batch, before_step=90)
    assert got == {int(recs[5].example_hashes[2]): 5}  # the only example of step 90 fed before it


def _flip(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("where", ["header", "columns", "heads", "block", "filter", "truncated", "stale"])
def test_a_damaged_or_stale_index_is_rebuilt_from_its_segment_and_answers_the_same(run, where):
    path, schema, recs = run
    idx = path / "trace" / "000000000000.idx"
    columns_size = _column_layout(schema, PER)[1]
    filter_at = idx.stat().st_size - example_filter.filter_blocks(PER * schema.examples_per_step) * 64
    if where == "header":
        _flip(idx, 20)
    elif where == "columns":
        _flip(idx, INDEX_HEADER_SIZE + 40)
    elif where == "heads":
        _flip(idx, INDEX_HEADER_SIZE + columns_size + 3)
    elif where == "block":
        _flip(idx, filter_at - 100)  # the last table block
    elif where == "filter":  # the filter block the search below reads
        nb = example_filter.filter_blocks(PER * schema.examples_per_step)
        _flip(idx, filter_at + 64 * int(example_filter.block_of(recs[5].example_hashes[2:3], nb)[0]) + 3)
    elif where == "truncated":
        idx.write_bytes(idx.read_bytes()[:-7])
    else:
        idx.write_bytes((path / "trace" / "000000000016.idx").read_bytes())
    r = Run.open(path)
    assert r.damage == []  # the index is derived data: the trace is intact
    h = recs[5].example_hashes[2]
    assert fed(r, [h], limit=5)[int(h)] == brute_fed(recs, h, STEPS, 5)
    assert np.array_equal(columns.metric(r.trace, "loss"), [x.metrics[0] for x in recs])
    assert r.trace.read(3).step == 3
    [note] = r.trace.notes
    assert "000000000000.idx cannot be used" in note and "rebuilt in memory" in note


def test_hits_an_index_names_are_confirmed_in_the_records(run, monkeypatch):
    """An index whose checksums hold but whose table names the wrong place (a bug, an edit) is
    caught by the confirmation and replaced by one built from the segment."""
    path, schema, recs = run
    real = FileIndex.find

    def lying(self, queries, limit, advised=False):
        qi, slots = real(self, queries, limit, advised)
        return qi, (slots + 1) % (self.count * schema.examples_per_step)

    monkeypatch.setattr(FileIndex, "find", lying)
    r = Run.open(path)
    h = recs[5].example_hashes[2]
    assert fed(r, [h], limit=5)[int(h)] == brute_fed(recs, h, STEPS, 5)
    assert any("does not hold" in n for n in r.trace.notes)


def test_a_run_without_indexes_reads_the_same_and_write_indexes_writes_them(run):
    path, schema, recs = run
    for idx in (path / "trace").glob("*.idx"):
        idx.unlink()
    r = Run.open(path)
    h = recs[40].example_hashes[4]
    assert fed(r, [h], limit=5)[int(h)] == brute_fed(recs, h, STEPS, 5)
    assert np.array_equal(columns.batch_hashes(r.trace), [x.batch_hash for x in recs])
    assert any("without an index file" in n for n in r.trace.notes)
    assert len(write_indexes(path / "trace", schema)) == 6
    r = Run.open(path)
    assert fed(r, [h], limit=5)[int(h)] == brute_fed(recs, h, STEPS, 5) and r.trace.notes == []


def test_a_resumed_writer_writes_the_index_its_predecessor_did_not(run):
    path, schema, recs = run
    idx = path / "trace" / "000000000080.idx"
    written = idx.read_bytes()
    idx.unlink()  # the writer died between sealing the segment and writing its index
    Run.resume(path).writer(segment_records=PER, compact=False).close()
    assert idx.read_bytes() == written


def test_a_resuming_writer_reads_only_the_unsealed_tail(tmp_path):
    schema = make_schema()
    path = write(tmp_path / "run", [make_record(schema, k) for k in range(20 * PER + 5)], schema)
    tail = path / "trace" / f"{20 * PER:012d}.seg"
    total = sum(p.stat().st_size for p in (path / "trace").iterdir())
    with BytesRead() as read:
        w = TraceWriter(path / "trace", schema, segment_records=PER, first_step=0)
    assert w.next_step == 20 * PER + 5
    # headers and seals, then the tail whole: on opening, and for its records and checksum
    assert read.count <= 20 * 48 + 48 + 2 * tail.stat().st_size + 300, read.count
    assert read.count < total // 5
    w.append(make_record(schema, 20 * PER + 5))
    w.close()


# ------------------------------------------------------------------------------ columns


def test_columns_match_the_records_in_chunks(run):
    path, schema, recs = run
    trace = Run.open(path).trace
    assert np.array_equal(columns.metric(trace, "grad_norm", 10, 60), [r.metrics[1] for r in recs[10:60]])
    blocks = list(columns.example_hashes(trace, 3, 97, chunk=5))
    assert max(b.shape[0] for _, b in blocks) <= 5
    assert np.array_equal(np.concatenate([b for _, b in blocks]), [r.example_hashes for r in recs[3:97]])
    for first, fp, rms, present in columns.fingerprints(trace, chunk=7):
        for k in range(fp.shape[0]):
            r = recs[first + k]
            assert present[k] == (r.fingerprints is not None)
            if present[k]:
                assert np.array_equal(fp[k], r.fingerprints) and np.array_equal(rms[k], r.rms)
    for first, em in columns.example_metric(trace, "loss", chunk=9):
        for k in range(em.shape[0]):
            r = recs[first + k]
            assert np.isnan(em[k]).all() if r.example_metrics is None else np.array_equal(em[k], r.example_metrics[0])


# ------------------------------------------------------------------------------ damage found lazily


def test_damage_inside_a_sealed_segment_surfaces_when_read_as_one_line(run):
    path, schema, recs = run
    seg = path / "trace" / "000000000016.seg"
    trace = Run.open(path).trace
    at = int(trace.offsets(1)[5]) + 12  # inside the body of step 21's frame
    _flip(seg, at)
    r = Run.open(path)
    assert r.damage == []  # not seen on opening: headers and seals only
    for read in (lambda: r.trace.read(21), lambda: columns.read_example_hashes(r.trace, 16, 32),
                 lambda: r.trace.check_bytes(0, STEPS)):
        with pytest.raises(TraceCorruptError) as e:
            read()
        assert "\n" not in str(e.value) and str(seg) in str(e.value) and "step 21" in str(e.value)
    assert r.trace.read(20).step == 20  # the records around it still read
    [damage] = r.verify()
    assert damage.step == 21 and damage.path == str(seg)


# ------------------------------------------------------------------------------ compare on the columns


@pytest.mark.parametrize("field", ["example_hash", "fingerprint", "example_metric", "metric", "rng"])
def test_compare_finds_a_difference_in_any_field_through_the_columns(tmp_path, field):
    schema = make_schema()
    recs = [make_record(schema, k) for k in range(STEPS)]
    a = write(tmp_path / "a", recs, schema)
    step = 75  # a layer step (75 % 3 == 0): it has fingerprints and example metrics
    r = recs[step]
    if field == "example_hash":
        r = dataclasses.replace(r, example_hashes=r.example_hashes.copy())
        r.example_hashes[4] ^= 1  # batch_hash kept: only the record's bytes tell
    elif field == "fingerprint":
        r = dataclasses.replace(r, fingerprints=r.fingerprints.copy())
        r.fingerprints[2] ^= 1
    elif field == "example_metric":
        r = dataclasses.replace(r, example_metrics=np.nextafter(r.example_metrics, np.float32(2)))
    elif field == "metric":
        r = dataclasses.replace(r, metrics=np.nextafter(r.metrics, np.float32(9)))
    else:
        r = dataclasses.replace(r, rng=r.rng ^ np.uint32(1))
    b = write(tmp_path / "b", recs[:step] + [r] + recs[step + 1 :], schema, per=10)  # other segment boundaries
    c = compare(Run.open(a).trace, Run.open(b).trace)
    assert not c.identical and c.first_step == step, c
    same = compare(Run.open(a).trace, Run.open(a).trace)
    assert same.identical and same.first_step is None


def test_an_identical_verdict_reads_every_record_s_checksum(run, tmp_path):
    path, schema, recs = run
    copy = write(tmp_path / "copy", recs, schema)
    seg = copy / "trace" / "000000000032.seg"
    _flip(seg, int(Run.open(copy).trace.offsets(2)[3]) + 12)
    with pytest.raises(TraceCorruptError, match="000000000032.seg"):
        compare(Run.open(path).trace, Run.open(copy).trace)


def test_a_trace_being_written_is_read_and_searched(tmp_path):
    schema = make_schema()
    w = TraceWriter(tmp_path / "t", schema, segment_records=PER)
    for k in range(PER + 3):
        w.append(make_record(schema, k))
    r = TraceReader(tmp_path / "t", schema)
    assert (r.start, r.end, r.damage) == (0, PER + 3, [])
    assert first_fed(r, [make_record(schema, PER + 1).example_hashes[0]]) == {
        int(make_record(schema, PER + 1).example_hashes[0]): PER + 1}
    w.close()


@pytest.mark.parametrize("sidecar", [True, False], ids=["with-sidecar", "recorded-before-sidecars"])
def test_damage_inside_the_unsealed_tail(run, sidecar):
    """Without its sidecar the tail is read whole on opening: a bad frame there is damage at
    once. With it (traces/sidecar.py) opening reads the sidecar, and the bad frame is found
    when read, as in a sealed segment, and by verify(). Either way a resuming writer (which
    reads the tail whole) cuts from it, as from a torn record."""
    path, schema, recs = run
    tail = path / "trace" / "000000000096.seg"
    _flip(tail, int(Run.open(path).trace.offsets(6)[2]) + 12)  # inside step 98's frame
    if not sidecar:
        (path / "trace" / "000000000096.tix").unlink(missing_ok=True)  # as a run recorded before sidecars
        [damage] = Run.open(path).damage
    else:
        trace = Run.open(path).trace
        assert trace.damage == [] and trace.end == STEPS
        with pytest.raises(TraceCorruptError, match="step 98"):
            trace.read(98)
        [damage] = trace.verify()
    assert damage.path == str(tail) and damage.step == 98 and "checksum" in damage.reason
    w = Run.resume(path).writer(segment_records=PER, compact=False)
    assert w.next_step == 98 and [d.step for d in w.repaired] == [98]
    w.close()
