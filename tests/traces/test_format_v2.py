"""Trace format_version 2: distance sketches in layer-level records; version 1 runs still read."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

import traces
from traces import NewerFormatError, Run, Schema, SchemaError, StepRecord
from traces.fingerprint import fingerprint
from traces.schema import decode_record, encode_record
from traces.sketch import sketch

V1 = Path(__file__).parent / "fixtures" / "v1_run"  # written by the version-1 code (session 4, before v2)


def _tensors(k: int) -> list[np.ndarray]:
    g = np.random.default_rng(k)
    return [g.standard_normal((4, 8)).astype(np.float32) for _ in range(3)]


def test_a_version_1_run_still_reads(tmp_path):
    run = Run.open(shutil.copytree(V1, tmp_path / "v1"))
    assert run.manifest["format_version"] == 1 and run.schema.sketch_width == 0 and not run.damage
    g = np.random.default_rng(0)  # the fixture's generator, re-drawn
    for k in range(3):
        rec = run.trace.read(k)
        t = [g.standard_normal((4, 8)).astype(np.float32) for _ in range(3)]
        assert rec.step == k and rec.sketches is None and rec.norms is None
        assert [int(f) for f in rec.fingerprints] == [fingerprint(x) for x in t]
        assert rec.metrics[0] == np.float32(2.0 - 0.1 * k)
    assert not run.verify()


def _schema(width: int = 16) -> Schema:
    return Schema(examples_per_step=2, rng_words=2, metrics=(("loss", "loss"),),
                  tensors=(("blocks_0.mlp", "forward"), ("param/w", "update")), sketch_width=width)


def _record(schema: Schema, k: int, sketched: bool = True) -> StepRecord:
    t = _tensors(k)[:2]
    sk = [sketch(x, schema.sketch_width or 16) for x in t]
    return StepRecord(step=k, rng=np.array([k, 1], np.uint32), batch_hash=k + 1,
                      example_hashes=np.array([1, 2], np.uint64), metrics=np.array([1.5], np.float32),
                      fingerprints=np.array([fingerprint(x) for x in t], np.uint64),
                      rms=np.array([np.sqrt(np.mean(x * x)) for x in t], np.float32),
                      sketches=np.stack([s for s, _ in sk]) if sketched else None,
                      norms=np.array([n for _, n in sk], np.float32) if sketched else None)


def test_a_version_2_run_round_trips_its_sketches(tmp_path):
    schema = _schema()
    run = Run.create(tmp_path / "v2", schema, {})
    w = run.writer(segment_records=2)
    written = [_record(schema, k) for k in range(3)]
    for rec in written:
        w.append(rec)
    w.close()
    run.finish()
    back = Run.open(tmp_path / "v2")
    assert back.manifest["format_version"] == traces.FORMAT_VERSION == 3  # sketches came with 2; compaction with 3
    assert back.trace.segments[0].version == 3  # a sealed segment, compacted: its sketches read back all the same
    assert back.schema == schema and back.schema.to_json()["sketch_width"] == 16
    for rec in written:
        got = back.trace.read(rec.step)
        np.testing.assert_array_equal(got.sketches, rec.sketches)
        np.testing.assert_array_equal(got.norms, rec.norms)
    assert not back.verify()


def test_a_schema_without_sketches_keeps_its_version_1_json_and_digest():
    v1 = Run.open(V1).schema
    assert "sketch_width" not in v1.to_json()
    assert Schema.from_json(v1.to_json()).digest() == v1.digest()
    assert _schema(16).digest() != _schema(32).digest()


def test_a_sketched_schema_refuses_a_layer_record_without_sketches():
    with pytest.raises(SchemaError, match="sketches"):
        encode_record(_schema(), _record(_schema(), 0, sketched=False))
    with pytest.raises(SchemaError, match="sketch_width"):
        encode_record(_schema(0), _record(_schema(16), 0))
    rec = _record(_schema(), 1)
    back = decode_record(_schema(), encode_record(_schema(), rec))
    np.testing.assert_array_equal(back.sketches, rec.sketches)


@pytest.mark.parametrize("reader, steps, segment_version", [
    pytest.param(1, 1, 2, id="a version-1 reader refuses a newer run and its version-2 segment"),
    pytest.param(2, 3, 3, id="a version-2 reader refuses a version-3 run and its compacted segment"),
])
def test_an_older_reader_refuses_a_newer_run(tmp_path, monkeypatch, reader, steps, segment_version):
    schema = _schema()
    run = Run.create(tmp_path / "run", schema, {})
    w = run.writer(segment_records=2)  # 3 steps: the first segment sealed, so compacted (version 3)
    for k in range(steps):
        w.append(_record(schema, k))
    w.close()
    run.finish()
    # The older reader is this code with its version constant lowered: the check is the same code.
    import traces.manifest as trun
    import traces.segment as tseg
    import traces.trace as ttrace

    for mod in (trun, tseg, ttrace):
        monkeypatch.setattr(mod, "FORMAT_VERSION", reader)
    with pytest.raises(NewerFormatError, match=f"format_version 3, this replay reads up to {reader}: upgrade replay"):
        Run.open(tmp_path / "run")
    # The segment header refuses it too (a trace read without its manifest).
    with pytest.raises(NewerFormatError, match=f"trace format_version {segment_version}"):
        traces.TraceReader(tmp_path / "run" / "trace", schema)
