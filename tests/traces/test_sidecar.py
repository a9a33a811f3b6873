"""The unsealed tail's sidecar (traces/sidecar.py, issue 34): opening reads it, not the tail's
records; a torn, garbled or lying sidecar is found and the tail's records read instead, losing
nothing; a kill at any point of an append leaves a sidecar that vouches only for whole records;
runs recorded before sidecars still read, and a resumed writer gives them one."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np
import pytest

from traces import Run, TraceReader, TraceWriter, same_bits, sidecar
from traces.index import examples_key
from traces.writer import SIDECAR_BATCH
from tests.traces.helpers import BytesRead, make_record, make_schema
from tests.traces.test_kill import _kill_writer_after
from tests.traces.test_seal import FIXTURE, SEGMENT, fixture_record

TAIL = 300  # records in the unsealed tail (segment_records is larger)


def wide_schema():
    """make_schema with 256 examples a step: a record is mostly its example hashes, as at scale."""
    return dataclasses.replace(make_schema(), examples_per_step=256)


def write(path: Path, steps: int = TAIL, per: int = 1000) -> tuple:
    schema = wide_schema()
    run = Run.create(path, schema, {})
    w = run.writer(segment_records=per)
    for k in range(steps):
        w.append(make_record(schema, k))
    run.close()
    return schema, path / "trace" / "000000000000.seg"


def expected_columns(schema, steps):
    recs = [make_record(schema, k) for k in steps]
    return {"batch_hash": [r.batch_hash for r in recs], "metric_bits": [r.metrics.view(np.uint32) for r in recs],
            "rng": [r.rng for r in recs], "flags": [r.flags for r in recs],
            "examples_key": examples_key(np.array([r.example_hashes for r in recs]))}


def assert_tail(path: Path, schema, steps: int = TAIL) -> TraceReader:
    """Every record readable and bit-exact, and the tail's columns those of the records."""
    trace = Run.open(path).trace
    assert trace.damage == [] and (trace.start, trace.end) == (0, steps)
    for k in (0, steps // 2, steps - 1):
        assert same_bits(schema, trace.read(k), make_record(schema, k))
    cols = trace.columns(len(trace.segments) - 1)
    for name, want in expected_columns(schema, range(trace.segments[-1].first_step, steps)).items():
        assert np.array_equal(getattr(cols, name), np.array(want)), name
    return trace


def test_opening_reads_the_sidecar_not_the_tail(tmp_path):
    schema, seg = write(tmp_path / "run")
    tix = sidecar.sidecar_path(seg)
    assert tix.exists() and tix.stat().st_size < seg.stat().st_size // 4
    with BytesRead() as read:
        trace = Run.open(tmp_path / "run").trace
        cols = trace.columns(0)
    # the sidecar, the last frame and run.json; the tail itself is ~5x the sidecar
    assert read.count < tix.stat().st_size + 8192 < seg.stat().st_size // 2, (read.count, seg.stat().st_size)
    assert trace.segments[0].columns is cols and trace.notes == []
    assert_tail(tmp_path / "run", schema)


def test_the_tail_read_whole_equals_the_sidecar(tmp_path):
    """The reference: the same tail opened without its sidecar (as a run recorded before them)."""
    schema, seg = write(tmp_path / "run")
    with_it = Run.open(tmp_path / "run").trace
    sidecar.sidecar_path(seg).unlink()
    without = assert_tail(tmp_path / "run", schema)
    a, b = with_it.columns(0), without.columns(0)
    for f in dataclasses.fields(a):
        assert np.array_equal(getattr(a, f.name), getattr(b, f.name)), f.name
    assert np.array_equal(with_it.offsets(0), without.offsets(0)) and without.notes == []


def test_the_comparison_catches_a_wrong_column(tmp_path):
    """assert_tail is not vacuous: a sidecar whose entries hold another batch hash (checksums
    made to match) is believed for the columns, and assert_tail says so."""
    schema, seg = write(tmp_path / "run")
    cols = Run.open(tmp_path / "run").trace.columns(0)
    wrong = dataclasses.replace(cols, batch_hash=cols.batch_hash + np.uint64(1))
    sidecar.rewrite(seg, schema, wrong)
    with pytest.raises(AssertionError, match="batch_hash"):
        assert_tail(tmp_path / "run", schema)


def _entry_size(schema) -> int:
    return sidecar.entry_dtype(schema).itemsize


@pytest.mark.parametrize("cut", [1, 17, "whole-entry"])
def test_a_torn_last_entry_is_dropped_and_its_record_walked(tmp_path, cut):
    schema, seg = write(tmp_path / "run")
    tix = sidecar.sidecar_path(seg)
    size = tix.stat().st_size
    os.truncate(tix, size - (_entry_size(schema) if cut == "whole-entry" else cut))  # as a kill mid-write leaves it
    with BytesRead() as read:
        trace = Run.open(tmp_path / "run").trace
        trace.columns(0)
    assert read.count < seg.stat().st_size // 4  # the sidecar and the one record it lost
    trace = assert_tail(tmp_path / "run", schema)
    assert trace.notes == []


def test_an_empty_sidecar_is_one_not_yet_begun_and_no_note(tmp_path):
    """A writer killed between creating the sidecar and writing its header leaves an empty file
    (once in test_a_kill_mid_append_leaves_a_sidecar_of_whole_records's random kills): the records
    are read, as with no sidecar, and nothing is reported damaged or unusable."""
    schema, seg = write(tmp_path / "run")
    tix = sidecar.sidecar_path(seg)
    os.truncate(tix, 0)
    trace = assert_tail(tmp_path / "run", schema)
    assert trace.notes == []
    w = TraceWriter(tix.parent, schema, segment_records=1000)  # a resumed writer gives the tail its sidecar again
    w.append(make_record(schema, TAIL))
    w.close()
    side = sidecar.read(seg, schema, 0, seg.stat().st_size)
    assert side is not None and side.problem is None and side.count == TAIL + 1


@pytest.mark.parametrize("where", ["header", "middle-entry", "last-entry-lies", "other-segment"])
def test_a_garbled_sidecar_is_found_and_the_records_read(tmp_path, where):
    schema, seg = write(tmp_path / "run")
    tix = sidecar.sidecar_path(seg)
    data = bytearray(tix.read_bytes())
    if where == "header":
        data[12] ^= 1
    elif where == "middle-entry":
        data[sidecar.SIDECAR_HEADER_SIZE + 100 * _entry_size(schema) + 9] ^= 1
    elif where == "other-segment":
        data[:] = sidecar.header(schema, 5) + data[sidecar.SIDECAR_HEADER_SIZE :]
    if where == "last-entry-lies":  # checksums valid, but the last entry's end is not a frame's end
        cols = Run.open(tmp_path / "run").trace.columns(0)
        offsets = cols.offsets.copy()
        offsets[-1] -= np.uint64(3)
        sidecar.rewrite(seg, schema, dataclasses.replace(cols, offsets=offsets))
    else:
        tix.write_bytes(bytes(data))
    trace = assert_tail(tmp_path / "run", schema)
    [note] = trace.notes
    assert str(tix) in note and "nothing recorded is lost" in note


def test_a_kill_mid_append_leaves_a_sidecar_of_whole_records(tmp_path):
    """SIGKILL at random points of appends (test_kill's writer: segments of 50 records): every
    record reported appended is there, and the sidecar vouches for all but at most the entries
    the writer had not written yet (SIDECAR_BATCH), whose frames opening walks and decodes."""
    schema, path = make_schema(), tmp_path / "run"
    rng = np.random.default_rng(34)
    for i in range(6):
        reported = _kill_writer_after(path, resume=i > 0, appends=int(rng.integers(1, 31)),
                                      delay=float(rng.uniform(0, 0.002)))
        trace = Run.open(path).trace
        assert trace.end >= reported and all(d.step == trace.end for d in trace.damage)
        for step in range(trace.start, trace.end):
            assert same_bits(schema, trace.read(step), make_record(schema, step))
        last = trace.segments[-1]
        if not last.sealed and last.count:
            side = sidecar.read(last.path, schema, last.first_step, last.size)
            assert side is not None and side.problem is None and last.count - SIDECAR_BATCH <= side.count <= last.count
            assert trace.segments[-1].columns is not None  # completed on opening from the walked frames
            assert np.array_equal(side.columns.offsets, trace.offsets(len(trace.segments) - 1)[: side.count + 1])
        assert not [n for n in trace.notes if ".tix" in n]


def test_a_run_recorded_before_sidecars_reads_and_resumes(tmp_path):
    """tests/traces/fixtures/seal_bytes: written before sidecars (its tail, steps 60..74, has none)."""
    import shutil

    schema = make_schema()
    trace_dir = tmp_path / "trace"
    shutil.copytree(FIXTURE, trace_dir)
    assert not list(trace_dir.glob("*.tix"))
    trace = TraceReader(trace_dir, schema)
    assert trace.damage == [] and trace.notes == [] and trace.end == 75
    for step in (0, 2 * SEGMENT, 74):
        assert same_bits(schema, trace.read(step), fixture_record(schema, step))
    assert trace.columns(2).batch_hash.tolist() == [fixture_record(schema, s).batch_hash for s in range(60, 75)]
    w = TraceWriter(trace_dir, schema, segment_records=SEGMENT)  # resumes: writes the tail's sidecar
    w.append(fixture_record(schema, 75))
    w.close()
    side = sidecar.read(trace_dir / "000000000060.seg", schema, 60, (trace_dir / "000000000060.seg").stat().st_size)
    assert side is not None and side.count == 16 and side.problem is None
    assert TraceReader(trace_dir, schema).columns(2).batch_hash.tolist() == \
        [fixture_record(schema, s).batch_hash for s in range(60, 76)]


def test_sealing_removes_the_sidecar(tmp_path):
    schema, seg = write(tmp_path / "run", steps=25, per=10)
    names = sorted(p.name for p in (tmp_path / "run" / "trace").iterdir())
    assert [n for n in names if n.endswith(".tix")] == ["000000000020.tix"]
    assert_tail(tmp_path / "run", schema, steps=25)


def test_a_sidecar_write_that_fails_drops_the_sidecar_not_the_records(tmp_path, monkeypatch):
    """A short write of an entry (a full disk) would misalign every later one: the writer
    deletes the sidecar, says so in its notes, and readers read the tail's records."""
    schema = wide_schema()
    run = Run.create(tmp_path / "run", schema, {})
    w = run.writer(segment_records=1000)
    real, seen = os.write, {"entries": 0}

    def short_on_the_sidecar(fd, data):
        if fd == w._tix:
            seen["entries"] += 1
            if seen["entries"] > 5:  # the 5th write of entries after the header is written half
                return real(fd, bytes(data[: len(data) // 2]))
        return real(fd, data)

    monkeypatch.setattr(os, "write", short_on_the_sidecar)
    for k in range(TAIL):
        w.append(make_record(schema, k))
    monkeypatch.setattr(os, "write", real)
    run.close()
    seg = tmp_path / "run" / "trace" / "000000000000.seg"
    assert not sidecar.sidecar_path(seg).exists()
    assert any(".tix: not written" in n for n in w.notes)
    trace = assert_tail(tmp_path / "run", schema)
    assert trace.notes == []


@pytest.mark.parametrize("appended", [5, SIDECAR_BATCH + 4])
def test_entries_not_yet_written_are_walked_and_decoded(tmp_path, appended):
    """What a kill leaves before the writer's next batch of entries: opening walks the frames
    past the sidecar's last entry (all of them when it has none yet) and completes its columns."""
    schema = wide_schema()
    run = Run.create(tmp_path / "run", schema, {})
    w = run.writer(segment_records=1000)
    for k in range(appended):
        w.append(make_record(schema, k))
    seg = tmp_path / "run" / "trace" / "000000000000.seg"
    side = sidecar.read(seg, schema, 0, seg.stat().st_size)
    assert side is not None and side.count == (appended // SIDECAR_BATCH) * SIDECAR_BATCH  # as a kill now leaves it
    trace = Run.open(tmp_path / "run").trace
    assert trace.end == appended and trace.segments[0].columns is not None and trace.notes == []
    assert trace.columns(0).batch_hash.tolist() == [make_record(schema, k).batch_hash for k in range(appended)]
    run.close()
