"""The cross-framework bisect from two traces' distance sketches alone (no replay): synthetic runs,
so long runs and the sampled search are cheap to check."""

from __future__ import annotations

import numpy as np
import pytest

from replay.bisect.cross import DENSE_STEPS, cross_bisect
from tests.traces.helpers import at_step_level, sketched_record
from traces import Run, Schema

W = 16
TENSORS = (("state/params", "state"), ("embed", "forward"), ("block_00.attn", "forward"), ("grad/w", "backward"),
           ("param/w", "update"))
SCHEMA = Schema(examples_per_step=2, rng_words=2, metrics=(("loss", "loss"),), tensors=TENSORS, sketch_width=W)


def _write(path, steps: int, torch: bool, bad_from: int | None = None, noise: float = 2e-7, seed: int = 0,
           bad_tensor: str = "block_00.attn", layer_every: int = 1):
    manifest = {"recorded_by": "replay.torch"} if torch else {"environment": {"framework": "jax"}}
    if layer_every > 1:  # a config, as a trainer run has: replaying this synthetic run then fails as unavailable
        manifest["config"] = {"trace": {"layer_every": layer_every}}
    run = Run.create(path, SCHEMA, manifest)
    w = run.writer()
    own = np.random.default_rng(seed + (1 if torch else 2))
    for k in range(steps):
        g = np.random.default_rng(k)  # the shared "true" tensors of step k
        ts = [g.standard_normal((8, 16)).astype(np.float32) for _ in TENSORS]
        for i, (name, _) in enumerate(TENSORS):
            if name not in ("state/params", "embed"):  # inputs agree bit for bit; the rest by rounding
                ts[i] = ts[i] * (1 + noise * own.standard_normal(ts[i].shape)).astype(np.float32)
            if bad_from is not None and k >= bad_from and name == bad_tensor:
                ts[i] = ts[i] + 1e-2
        record = sketched_record(k, ts, 2.0 + 1e-8 * own.standard_normal(), W)
        w.append(at_step_level(record) if k % layer_every else record)
    w.close()
    run.finish()
    return Run.open(path)


def test_sketches_in_both_traces_need_no_replay_and_a_clean_pair_agrees(tmp_path):
    t, j = _write(tmp_path / "t", 12, True), _write(tmp_path / "j", 12, False)
    report = cross_bisect(j, t)
    assert report.source == "traces" and report.torch_side == "B"
    assert report.within_noise, report.to_json()
    assert sorted(report.distances) == list(range(12))
    assert report.distances[0]["embed"] == 0 and report.distances[0]["block_00.attn"] > 0


@pytest.mark.parametrize("tensor, kind", [("block_00.attn", "forward"), ("grad/w", "backward"), ("param/w", "update")])
def test_the_first_step_and_field_above_the_floor_are_named(tmp_path, tensor, kind):
    t, j = _write(tmp_path / "t", 12, True), _write(tmp_path / "j", 12, False, bad_from=5, bad_tensor=tensor)
    report = cross_bisect(t, j)
    assert (report.first_step, report.first_layer, report.cause) == (5, tensor, kind)
    assert report.ratio > 10 and sorted(report.distances) == list(range(6))  # stops at the first step above


def test_a_long_pair_is_sampled_then_searched_and_the_report_stays_bounded(tmp_path):
    steps = 3 * DENSE_STEPS
    t, j = _write(tmp_path / "t", steps, True), _write(tmp_path / "j", steps, False, bad_from=437)
    report = cross_bisect(t, j)
    assert (report.first_step, report.first_layer) == (437, "block_00.attn")
    assert len(report.distances) <= DENSE_STEPS + 12  # the samples up to it and the binary search
    assert all(report.distances[k]["block_00.attn"] < 1e-3 for k in report.distances if k < 437)


def test_an_initial_parameter_difference_is_the_init(tmp_path):
    t = _write(tmp_path / "t", 3, True)
    j = _write(tmp_path / "j", 3, False, bad_from=0, bad_tensor="state/params")
    report = cross_bisect(t, j)
    assert (report.first_step, report.cause, report.first_layer) == (0, "init", "state/params")
    assert report.inputs["init"]["equal"] is False


@pytest.mark.parametrize("refine", [False, True])
def test_a_jax_run_sketched_every_3_steps_is_examined_there_and_the_steps_between_are_not_taken_as_clean(
        tmp_path, refine):
    """The JAX trace sketches steps 0, 3, 6, 9 (trace.layer_every=3); the tensor parts at step 5. The scan
    reads the sketched steps (and the last), finds step 6 above, and searches 4..5; this synthetic run
    cannot be replayed, so those two are judged on their metrics and the report says so, instead of
    taking a step without sketches as within the floor unsaid."""
    t = _write(tmp_path / "t", 12, True)
    j = _write(tmp_path / "j", 12, False, bad_from=5, layer_every=3)
    report = cross_bisect(t, j, refine=refine)
    assert (report.first_step, report.first_layer) == (6, "block_00.attn"), report.to_json()
    assert sorted(report.distances) == [0, 3, 4, 5, 6]  # the sketched steps up to it, then the search
    assert "block_00.attn" not in report.distances[5] and "loss" in report.distances[5]
    assert report.source == "traces"
    assert any("sketches at 4 of the 12 common steps" in n for n in report.notes), report.notes
    assert any("only their metrics are judged" in n for n in report.notes), report.notes
    if refine:  # it tried: the note says why it could not
        assert sum("cannot be replayed" in n for n in report.notes) == 1, report.notes  # tried once, said once


def test_a_clean_pair_sketched_every_3_steps_examines_those_steps_and_the_last(tmp_path):
    t, j = _write(tmp_path / "t", 11, True), _write(tmp_path / "j", 11, False, layer_every=3)
    report = cross_bisect(t, j, refine=False)
    assert report.within_noise, report.to_json()
    assert sorted(report.distances) == [0, 3, 6, 9, 10]
    assert "block_00.attn" in report.distances[9] and "block_00.attn" not in report.distances[10]
