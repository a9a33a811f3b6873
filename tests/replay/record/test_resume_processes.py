"""A run resumed on another process count (MaxText's seed scenario: trained on one host, resumed on
two) compiles another program: the resume records it and says where it starts; on the same process
count a different program is still refused. Several processes are simulated by the process count
replay.record.run_start sees (a real two-process resume: tests/maxtext/test_maxtext_seed.py)."""

from __future__ import annotations

import json

import jax
import pytest

import replay
from replay.record import run_start
from replay.record.errors import RecordError
from tests.replay.test_record_api import batch_at, init_state, make, record, step_fn


def same_bits_other_program(state: dict, batch: dict) -> tuple[dict, dict]:
    """The step's results, bit for bit, from another program (as another mesh compiles the same step)."""
    new, metrics = step_fn(state, batch)
    return new, dict(metrics, loss=metrics["loss"] + 0.0)


def _resume(path, fn=same_bits_other_program, steps: int = 5) -> None:
    run = replay.init(path, resume=True)
    try:
        step = run.step(batch_axis=0)(jax.jit(fn))
        state = run.restore(like=init_state())
        for k in range(run.next_step, run.next_step + steps):
            state, _ = step(state, batch_at(k))
    finally:
        run.close()


def test_a_resume_on_another_process_count_keeps_its_program_and_says_where_it_starts(tmp_path, monkeypatch):
    record(tmp_path / "a", steps=3, finish=False)
    with pytest.raises(RecordError, match="different program"):  # on the process count it was recorded on
        _resume(tmp_path / "a")
    monkeypatch.setattr(run_start, "processes", lambda: 2)
    _resume(tmp_path / "a")  # re-runs steps 0-2 from checkpoint 0, bit-identical
    manifest = json.loads((tmp_path / "a" / "run.json").read_text())
    resumed = manifest["resumed_programs"]
    # the first step it ran: the restored checkpoint 0 (steps 0-2 rewritten only as they were)
    assert [(r["step"], r["process_count"]) for r in resumed] == [(0, 2)], resumed
    assert resumed[0]["program_hash"] != manifest["program_hash"]
    _resume(tmp_path / "a")  # again on two: its own program, not a third
    resumed = json.loads((tmp_path / "a" / "run.json").read_text())["resumed_programs"]
    assert len(resumed) == 1, resumed


def test_the_example_store_ends_where_a_one_process_run_resumes_on_several(tmp_path, monkeypatch):
    loop = make({"scale": 1.0})
    run = replay.init(tmp_path / "a", config={"scale": 1.0}, entrypoint=make, store_examples=True)
    step, state = run.step(batch_axis=0)(loop.step), loop.init()
    for k in range(4):
        if k % 3 == 0:
            run.save(k, state)
        state, _ = step(state, batch_at(k))
    run.close()
    monkeypatch.setattr(run_start, "processes", lambda: 2)
    _resume(tmp_path / "a")
    store = json.loads((tmp_path / "a" / "run.json").read_text())["example_store"]
    assert store["until_step"] == 3, store  # restored at checkpoint 3: the rows of steps 0-2 are stored
