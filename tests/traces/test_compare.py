"""traces.compare: first differing step, fields in causal order, float distances."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from traces import TraceReader, TraceWriter, compare, float_distance
from tests.traces.helpers import make_record, make_schema


def write(path, n, schema, change=None, segment_records=8):
    w = TraceWriter(path, schema, segment_records=segment_records)
    for k in range(n):
        rec = make_record(schema, k)
        w.append(change(rec) if change and rec.step == change.step else rec)
    w.close()
    return TraceReader(path, schema)


def at(step, fn):
    fn.step = step
    return fn


def bump(arr, i, by=1):
    out = arr.copy()
    out.view(np.uint32 if out.dtype == np.float32 else out.dtype)[i] += by
    return out


@pytest.fixture
def schema():
    return make_schema()


def test_identical_traces_compare_identical(tmp_path, schema):
    c = compare(write(tmp_path / "a", 40, schema), write(tmp_path / "b", 40, schema))
    assert c.identical and c.first_step is None and c.compared == (0, 40)


@pytest.mark.parametrize("step", [0, 13, 33, 39])  # first segment, sealed middle, open tail, last record
def test_one_ulp_loss_change_is_found_at_its_step(tmp_path, schema, step):
    b = write(tmp_path / "b", 40, schema, at(step, lambda r: dataclasses.replace(r, metrics=bump(r.metrics, 0))))
    c = compare(write(tmp_path / "a", 40, schema), b)
    assert not c.identical and c.first_step == step
    assert [(d.kind, d.name) for d in c.diffs] == [("loss", "loss")]
    assert c.first.distance["ulp"] == 1 and c.first.distance["abs"] > 0


def test_fields_come_in_causal_order(tmp_path, schema):
    def everything(r):
        fps = r.fingerprints.copy()
        fps[[1, 4, 7]] ^= 1  # embed (forward), grad/block_00 (backward), param/embed (update)
        return dataclasses.replace(r, rng=r.rng + 1, metrics=bump(r.metrics, 2), fingerprints=fps,
                                   example_hashes=bump(r.example_hashes, 5))
    c = compare(write(tmp_path / "a", 20, schema), write(tmp_path / "b", 20, schema, at(9, everything)))
    assert c.first_step == 9
    assert [(d.kind, d.name) for d in c.diffs] == [
        ("data", "example_hashes"), ("rng", "rng"), ("forward", "embed"), ("backward", "grad/block_00"),
        ("update", "lr"), ("update", "param/embed"),
    ]
    assert c.diffs[0].positions == [5]


def test_layer_fingerprints_in_execution_order(tmp_path, schema):
    def later_layers(r):
        fps = r.fingerprints.copy()
        fps[2:4] ^= 1 << 63  # block_00 and logits
        return dataclasses.replace(r, fingerprints=fps)
    c = compare(write(tmp_path / "a", 10, schema), write(tmp_path / "b", 10, schema, at(6, later_layers)))
    assert [d.name for d in c.diffs] == ["block_00", "logits"]


def test_prefix_is_identical_and_ranges_are_reported(tmp_path, schema):
    c = compare(write(tmp_path / "a", 40, schema), write(tmp_path / "b", 25, schema))
    assert c.identical and c.compared == (0, 25) and c.a_range == (0, 40) and c.b_range == (0, 25)


def test_different_segment_sizes_still_compare_record_by_record(tmp_path, schema):
    b = write(tmp_path / "b", 30, schema, at(21, lambda r: dataclasses.replace(r, rng=r.rng ^ 1)), segment_records=5)
    c = compare(write(tmp_path / "a", 30, schema), b)
    assert c.first_step == 21 and c.first.kind == "rng"


def test_schema_differences_are_noted_and_common_fields_compared(tmp_path, schema):
    fewer = dataclasses.replace(schema, metrics=schema.metrics[:2])
    a = write(tmp_path / "a", 10, schema)
    b = write(tmp_path / "b", 10, fewer, at(0, lambda r: r))
    c = compare(a, b)
    assert any("lr" in n for n in c.schema_notes)


def test_float_distance():
    one = np.float32(1.0)
    nxt = np.nextafter(one, np.float32(2))
    assert float_distance(one, nxt)["ulp"] == 1
    assert float_distance(np.float32(-0.0), np.float32(0.0))["ulp"] == 0
    assert float_distance(np.float32(-1e-45), np.float32(1e-45))["ulp"] == 2
    d = float_distance(2.0, 3.0)
    assert d["abs"] == 1.0 and d["rel"] == pytest.approx(1 / 3)
    assert float_distance(np.float32("nan"), one)["nan"]
