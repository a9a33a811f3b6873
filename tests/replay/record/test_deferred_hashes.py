"""A batch of device arrays is hashed after the step that reads it was dispatched
(replay/record/deferred_hashes.py): the loop's thread does not wait for the batch before the
dispatch, the trace holds the same hashes as for the same batches fed from the host, and a step
that donates its batch, or a run storing its examples, is hashed before the dispatch as before."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import replay
from replay.record import deferred_hashes
from replay.record.hashing import example_hashes
from replay.record.program import Program
from tests.replay.test_record_api import batch_at, make
from traces import Run

STEPS = 12


def _record(path, monkeypatch, to_device: bool, store_examples: bool = False, donate_batch: bool = False):
    """Records STEPS steps; returns, for each step, how many steps had been dispatched when its
    batch was hashed."""
    dispatched, hashed_at = [0], []
    real_call, real_hashes = Program.__call__, deferred_hashes.example_hashes

    def call(self, *args, **kwargs):
        out = real_call(self, *args, **kwargs)
        dispatched[0] += 1
        return out

    def hashes(batch, axis=0):
        hashed_at.append(dispatched[0])
        return real_hashes(batch, axis)

    monkeypatch.setattr(Program, "__call__", call)
    monkeypatch.setattr(deferred_hashes, "example_hashes", hashes)
    monkeypatch.setattr("replay.record.step.example_hashes", hashes)
    loop = make({"scale": 1.0})
    run = replay.init(path, config={"scale": 1.0}, entrypoint=make, store_examples=store_examples)
    fn = loop.step
    if donate_batch:
        fn = jax.jit(fn.__wrapped__ if hasattr(fn, "__wrapped__") else fn, donate_argnums=(0, 1))
    step = run.step(level="step")(fn)
    state = loop.init()
    for k in range(STEPS):
        batch = loop.batch_at(k)
        state, _ = step(state, jax.device_put(batch) if to_device else batch)
    run.finish()
    return hashed_at


def test_a_device_batch_is_hashed_after_its_step_is_dispatched_to_the_hashes_of_the_host_batch(tmp_path, monkeypatch):
    hashed_at = _record(tmp_path / "device", monkeypatch, to_device=True)
    # batch k is hashed once step k was dispatched (step k's own call), never before it
    assert len(hashed_at) == STEPS and all(at >= k + 1 for k, at in enumerate(hashed_at)), hashed_at
    monkeypatch.undo()
    host = _record(tmp_path / "host", monkeypatch, to_device=False)
    assert host == list(range(STEPS)), host  # a host batch: hashed before its step, as before
    a, b = Run.open(tmp_path / "device").trace, Run.open(tmp_path / "host").trace
    want = [example_hashes(batch_at(k)).tolist() for k in range(STEPS)]
    assert [r.example_hashes.tolist() for r in a.records()] == want == [r.example_hashes.tolist() for r in b.records()]
    assert [r.batch_hash for r in a.records()] == [r.batch_hash for r in b.records()]


def test_ready_device_batches_are_hashed_at_the_next_steps_not_at_the_records_write(tmp_path, monkeypatch):
    """The recorder writes eight records at a time; a ready device batch is hashed (its buffers let
    go) by the next step's record call, not held until its record is written."""
    hashed_at = _record(tmp_path / "run", monkeypatch, to_device=True)
    assert all(at <= k + 3 for k, at in enumerate(hashed_at)), hashed_at  # CPU: ready a step or two later


@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")
def test_a_step_donating_its_batch_or_a_run_storing_examples_hashes_before_the_dispatch(tmp_path, monkeypatch):
    assert _record(tmp_path / "donates", monkeypatch, to_device=True, donate_batch=True) == list(range(STEPS))
    monkeypatch.undo()
    assert _record(tmp_path / "stores", monkeypatch, to_device=True, store_examples=True) == list(range(STEPS))


def test_deferrable_needs_device_arrays_with_the_axis_and_no_donated_batch():
    x = jax.device_put(np.zeros((4, 2), np.float32))
    assert deferred_hashes.deferrable({"x": x}, 0, {"donate_argnums": (0,)})
    assert not deferred_hashes.deferrable({"x": np.zeros((4, 2))}, 0, {})  # a host array: hashed at once
    assert not deferred_hashes.deferrable({"x": x, "y": np.zeros((4,))}, 0, {})
    assert not deferred_hashes.deferrable({"x": x, "y": jax.device_put(np.zeros((3,)))}, 0, {})  # sizes disagree
    assert not deferred_hashes.deferrable({"x": x}, 2, {})  # no such axis: the immediate path says so
    assert not deferred_hashes.deferrable({"x": x}, 0, {"donate_argnums": 1})
    assert not deferred_hashes.deferrable({"x": x}, 0, {"donate_argnames": ("batch",)})
    assert not deferred_hashes.deferrable({}, 0, {})
    assert not deferred_hashes.deferrable({"x": x, "k": jax.random.split(jax.random.key(0), 4)}, 0, {})  # no host bytes
