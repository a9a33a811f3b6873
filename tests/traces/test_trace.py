"""Round trip, random access, resume-append, duplicate/gap refusal, lock and status."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from traces import (
    Run, RunLockedError, Schema, SchemaError, StepOrderError, TraceReader, TraceWriter,
    decode_record, encode_record, same_bits,
)
from tests.traces.helpers import BytesRead, make_record, make_schema
from traces.index import INDEX_HEADER_SIZE, _column_layout


def write_run(path, n, schema=None, segment_records=7, finish=True, start=0, compact=None):
    schema = schema or make_schema()
    run = Run.create(path, schema, {"config": {"name": "test"}})
    w = run.writer(segment_records=segment_records, compact=compact)
    for k in range(start, start + n):
        assert w.append(make_record(schema, k)) is True
    run.finish() if finish else run.close()
    return schema


def test_every_field_round_trips_bit_exactly():
    schema = make_schema()
    for step in range(6):  # covers records with and without the layer group
        rec = make_record(schema, step)
        rec = dataclasses.replace(rec, metrics=np.array([np.nan, -0.0, np.inf, 1e-45], np.float32))
        back = decode_record(schema, encode_record(schema, rec))
        assert back.step == rec.step and back.batch_hash == rec.batch_hash
        for name in ("rng", "example_hashes", "metrics", "fingerprints", "rms", "example_metrics"):
            a, b = getattr(rec, name), getattr(back, name)
            assert (a is None) == (b is None)
            if a is not None:
                assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), name
        assert same_bits(schema, rec, back)


@pytest.mark.parametrize("metric_dtype,sketch_width", [("float32", 0), ("float64", 0), ("float32", 8)])
def test_encoded_bytes_are_the_packed_layout_filled_field_by_field(metric_dtype, sketch_width):
    """encode_record joins each field's bytes; FORMAT.md's layout is the packed structured array:
    the same bytes for every kind of record, inputs in other byte orders and narrower dtypes
    included, and a one-bit change in a hash changes exactly its byte."""
    base = make_schema()
    schema = dataclasses.replace(base, metric_dtype=metric_dtype, sketch_width=sketch_width)
    n = len(schema.tensors)
    for step in range(6):
        rec = make_record(schema, step)
        if rec.fingerprints is not None and sketch_width:
            rec = dataclasses.replace(rec, sketches=np.random.default_rng(step).random((n, sketch_width), np.float32),
                                      norms=np.arange(n, dtype=np.float32))
        metrics = np.array([np.nan, -0.0, np.inf, 1e-45], np.float32)
        if step % 2:  # big-endian and narrower inputs: stored as the values they hold
            rec = dataclasses.replace(rec, rng=rec.rng.astype(">u4"), metrics=metrics.astype(">f4"))
        else:
            rec = dataclasses.replace(rec, metrics=metrics if metric_dtype == "float32" else metrics.astype(np.float64))
        body = np.zeros((), schema.layout(rec.flags))
        value_dtype = np.dtype("<f4" if metric_dtype == "float32" else "<f8")
        for name in body.dtype.names:
            value = getattr(rec, name)
            body[name] = np.asarray(value).astype(value_dtype).view(body[name].dtype) if name == "metrics" else value
        want = np.array([(rec.step, rec.flags)], "<u8,u1").tobytes() + body.tobytes()
        got = encode_record(schema, rec)
        assert got == want
        hashes = rec.example_hashes.copy()
        hashes[3] ^= np.uint64(1 << 17)
        flipped = encode_record(schema, dataclasses.replace(rec, example_hashes=hashes))
        at = 9 + body.dtype.fields["example_hashes"][1] + 3 * 8 + 2  # head, field, 4th hash, its 3rd byte
        assert [i for i in range(len(got)) if got[i] != flipped[i]] == [at]


def test_same_bits_sees_a_one_ulp_metric_change_and_a_sign_of_zero():
    schema = make_schema()
    rec = make_record(schema, 0)
    bumped = rec.metrics.copy()
    bumped.view(np.uint32)[0] += 1
    assert not same_bits(schema, rec, dataclasses.replace(rec, metrics=bumped))
    zero = dataclasses.replace(rec, metrics=np.array([0.0, 0, 0, 0], np.float32))
    negzero = dataclasses.replace(rec, metrics=np.array([-0.0, 0, 0, 0], np.float32))
    assert not same_bits(schema, zero, negzero)


def test_record_that_does_not_fit_the_schema_is_refused():
    schema = make_schema()
    rec = make_record(schema, 1)
    with pytest.raises(SchemaError, match="example_hashes"):
        encode_record(schema, dataclasses.replace(rec, example_hashes=rec.example_hashes[:3]))
    with pytest.raises(SchemaError, match="metrics"):
        encode_record(schema, dataclasses.replace(rec, metrics=rec.metrics.astype(np.float64)))
    with pytest.raises(SchemaError):
        Schema(examples_per_step=1, rng_words=2, metrics=(("loss", "nonsense"),))


def test_run_round_trip_random_access_across_segments(tmp_path):
    schema = write_run(tmp_path / "run", 50)
    run = Run.open(tmp_path / "run")
    assert run.status == "complete" and run.recorded_end == 50
    trace = run.trace
    assert (trace.start, trace.end, trace.damage) == (0, 50, [])
    assert len(list((tmp_path / "run" / "trace").glob("*.seg"))) == 8
    order = np.random.default_rng(1).permutation(50)
    for step in order:
        assert same_bits(schema, trace.read(int(step)), make_record(schema, int(step)))
    assert [r.step for r in trace.records(10, 13)] == [10, 11, 12]
    with pytest.raises(IndexError):
        trace.read(50)


@pytest.mark.parametrize("compact", [False, True], ids=["hashes-in-records", "compacted"])
def test_random_access_reads_only_the_segment_it_needs(tmp_path, compact):
    """Bytes read are counted from before the trace is opened: the headers and seals, the
    unsealed tail, then the index columns of the one segment holding the step and its frame
    (the reader before indexes read the whole segment holding the step); a compacted segment's
    record also reads its hashes from the index: its block heads, the step's slot order and the
    table blocks of their buckets (here every block: 16 hashes in 4 blocks of 256)."""
    per, sealed, tail = 64, 8, 10
    schema = write_run(tmp_path / "run", sealed * per + tail, segment_records=per, compact=compact)
    trace_dir = tmp_path / "run" / "trace"
    step = 3 * per + 17
    with BytesRead() as read:
        trace = TraceReader(trace_dir, schema, first_step=0)
        opened = read.so_far
        rec = trace.read(step)
    assert same_bits(schema, rec, make_record(schema, step))
    tail_size = (trace_dir / f"{sealed * per:012d}.seg").stat().st_size
    assert opened <= sealed * 48 + 48 + tail_size + 200, opened
    frame = int(np.diff(trace.offsets(3))[17])
    columns = _column_layout(schema, per)[1]
    hashes = 0
    if compact:
        lay = trace.index(3).layout
        hashes = lay.heads_size + lay.blocks * lay.block_bytes + schema.examples_per_step * lay.k // 8
    assert read.count - opened <= INDEX_HEADER_SIZE + columns + hashes + frame + 200, (read.count - opened, columns, frame)
    if not compact:
        assert read.count < (trace_dir / "000000000192.seg").stat().st_size  # less than the one segment holding it


def test_random_access_without_an_index_walks_frame_lengths(tmp_path):
    schema = write_run(tmp_path / "run", 3 * 64, segment_records=64, compact=False)  # a compacted one needs it
    trace_dir = tmp_path / "run" / "trace"
    (trace_dir / "000000000064.idx").unlink()  # a segment recorded before indexes
    trace = TraceReader(trace_dir, schema)
    with BytesRead() as read:
        rec = trace.read(64 + 40)
    assert same_bits(schema, rec, make_record(schema, 64 + 40))
    frame = int(np.diff(trace.offsets(1))[40])
    assert read.count <= 8 * 64 + 20 + frame + 200, read.count
    assert read.count < (trace_dir / "000000000064.seg").stat().st_size // 2


def test_resume_appends_without_gap_and_accepts_identical_rewrites(tmp_path):
    schema = write_run(tmp_path / "run", 20, finish=False)
    run = Run.resume(tmp_path / "run")
    w = run.writer(segment_records=7)
    assert w.next_step == 20
    # A resumed trainer restarts from its last checkpoint and re-records steps 15..19.
    assert [w.append(make_record(schema, k)) for k in range(15, 25)] == [False] * 5 + [True] * 5
    run.finish()
    trace = Run.open(tmp_path / "run").trace
    assert (trace.start, trace.end) == (0, 25)
    assert all(same_bits(schema, trace.read(k), make_record(schema, k)) for k in range(25))


def test_rewrite_of_a_step_with_different_content_is_refused(tmp_path):
    schema = write_run(tmp_path / "run", 10, finish=False)
    run = Run.resume(tmp_path / "run")
    w = run.writer()
    other = make_record(schema, 4, seed=99)
    with pytest.raises(StepOrderError, match="step 4 is already recorded with different content"):
        w.append(other)
    with pytest.raises(StepOrderError, match="gap"):
        w.append(make_record(schema, 12))
    run.close()
    assert same_bits(schema, Run.open(tmp_path / "run").trace.read(4), make_record(schema, 4))


def test_a_second_writer_is_refused_and_status_tells_running_from_crashed(tmp_path):
    schema = make_schema()
    run = Run.create(tmp_path / "run", schema, {})
    run.writer().append(make_record(schema, 0))
    with pytest.raises(RunLockedError, match=r"is being written by pid \d+"):
        Run.resume(tmp_path / "run")
    assert Run.open(tmp_path / "run").status == "running"
    run.close()
    assert Run.open(tmp_path / "run").status == "crashed"
    Run.resume(tmp_path / "run").finish()
    assert Run.open(tmp_path / "run").status == "complete"


def test_create_refuses_a_non_empty_directory(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "file").write_text("keep me")
    with pytest.raises(Exception, match="not empty"):
        Run.create(tmp_path / "x", make_schema(), {})
    assert (tmp_path / "x" / "file").read_text() == "keep me"


def test_create_takes_a_folder_of_empty_folders_but_not_a_file_deep_inside_one(tmp_path):
    """An orbax CheckpointManager built before replay.init makes its (empty) directory inside the
    run folder: nothing there to lose. A file anywhere below is still refused."""
    (tmp_path / "x" / "checkpoints" / "tmp").mkdir(parents=True)
    Run.create(tmp_path / "x", make_schema(), {}).finish()
    assert Run.open(tmp_path / "x").status == "complete"
    (tmp_path / "y" / "checkpoints" / "0").mkdir(parents=True)
    (tmp_path / "y" / "checkpoints" / "0" / "state").write_text("keep me")
    with pytest.raises(Exception, match="not empty"):
        Run.create(tmp_path / "y", make_schema(), {})
    assert sorted(p.name for p in (tmp_path / "y").iterdir()) == ["checkpoints"]


def test_trace_may_start_at_any_step(tmp_path):
    schema = make_schema(layer=False)
    w = TraceWriter(tmp_path / "t", schema, segment_records=4)
    for k in range(10, 21):
        w.append(make_record(schema, k))
    w.close()
    r = TraceReader(tmp_path / "t", schema)
    assert (r.start, r.end) == (10, 21)
    with pytest.raises(StepOrderError, match="before the first recorded step"):
        TraceWriter(tmp_path / "t", schema).append(make_record(schema, 3))


def test_segment_of_a_different_schema_is_refused(tmp_path):
    schema = write_run(tmp_path / "run", 5)
    other = dataclasses.replace(schema, rng_words=4)
    with pytest.raises(SchemaError, match="different schema"):
        TraceReader(tmp_path / "run" / "trace", other)


def test_step_level_record_is_small(tmp_path):
    schema = make_schema(layer=False)
    w = TraceWriter(tmp_path / "t", schema)
    for k in range(1000):
        w.append(make_record(schema, k))
    w.close()
    size = sum(p.stat().st_size for p in (tmp_path / "t").iterdir() if p.suffix != ".tix")  # the tail's sidecar is not the record
    assert size / 1000 <= 200
