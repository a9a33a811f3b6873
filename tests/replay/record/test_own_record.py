"""`replay.init(replayable=...)` with `run.begin`/`run.record`: a loop whose step computes its own
record (the trainer records this way), `run.annotate`, and a resume that writes nothing until
its first write."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import replay
from replay.record.errors import RecordError
from replay.record.hashing import example_hashes
from traces import Run, Schema
from traces.run import COMPLETE, INCOMPLETE

FACTORY = "mypkg.replaying:from_run"  # recorded, never imported here
SCHEMA = Schema(examples_per_step=4, rng_words=2, metrics=(("loss", "loss"),), example_metrics=("loss",))


@jax.jit
def step(w, x_B):
    """A step that returns its own record beside the new state."""
    example_loss_B = jnp.square(x_B * w)
    loss = jnp.mean(example_loss_B)
    record = {"loss": loss, "example_loss": example_loss_B, "rng": jnp.zeros((2,), jnp.uint32)}
    return w - 0.1 * loss, record


def batch_at(k: int) -> np.ndarray:
    return np.arange(4, dtype=np.float32) + k


def record_run(path, steps: int = 3) -> list[np.ndarray]:
    run = replay.init(path, config={"lr": 0.1}, replayable=FACTORY, manifest={"mine": {"a": 1}})
    run.begin(SCHEMA, "hash-of-my-program")
    w = jnp.float32(1.0)
    with pytest.raises(RecordError, match="a single array"):  # orbax's own error was a raw ValueError
        run.save(0, w)
    run.save(0, {"w": w})
    losses = []
    for k in range(steps):
        w, record = step(w, batch_at(k))
        losses.append(np.asarray(record["loss"]))
        run.record(k, record, example_hashes(batch_at(k)))
    run.save(steps, {"w": w})
    run.annotate(mine={"a": 2}, config={"lr": 0.1, "steps": steps})
    run.finish()
    return losses


def test_a_step_that_records_itself_is_recorded_bit_for_bit(tmp_path):
    losses = record_run(tmp_path / "r")
    run = Run.open(tmp_path / "r")
    m = run.manifest
    assert run.status == "complete" and run.trace.end == 3
    assert m["recorded_by"] == "replay.init" and m["replayable"] == FACTORY and "entrypoint" not in m
    assert m["program_hash"] == "hash-of-my-program" and m["mine"] == {"a": 2} and m["config"]["steps"] == 3
    assert m["checkpoints"] == [0, 3] and set(m["checkpoint_fingerprints"]) == {"0", "3"}
    loss_at = run.schema.metric_names.index("loss")
    bits = [run.trace.read(k).metrics[loss_at].view(np.uint32) for k in range(3)]
    assert bits == [loss.view(np.uint32) for loss in losses]
    assert len(set(int(b) for b in bits)) == 3  # the steps' losses differ: the comparison above can fail
    assert all((run.trace.read(k).example_hashes == example_hashes(batch_at(k))).all() for k in range(3))


def test_replay_keys_and_two_factories_are_refused_in_one_line(tmp_path):
    with pytest.raises(RecordError, match="schema is a key replay writes itself"):
        replay.init(tmp_path / "a", replayable=FACTORY, manifest={"schema": 1})
    with pytest.raises(RecordError, match="not both"):
        replay.init(tmp_path / "b", entrypoint="m:f", replayable=FACTORY)
    with pytest.raises(RecordError, match="module:function"):
        replay.init(tmp_path / "c", replayable="no-colon")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists() and not (tmp_path / "c").exists()
    run = replay.init(tmp_path / "d", replayable=FACTORY)
    with pytest.raises(RecordError, match="recorded_by is a key replay writes itself"):
        run.annotate(recorded_by="me")
    with pytest.raises(RecordError, match="before run.record"):
        run.record(0, {}, np.zeros(4, np.uint64))
    run.begin(SCHEMA)
    with pytest.raises(RecordError, match="the next step to record is 0"):
        run.record(2, {}, np.zeros(4, np.uint64))
    run.close()


def test_a_resume_writes_nothing_until_its_first_write_and_holds_the_lock(tmp_path):
    path = tmp_path / "r"
    record_run(path, steps=2)
    before = (path / "run.json").read_bytes()
    run = replay.init(path, resume=True, replayable=FACTORY)
    assert (path / COMPLETE).exists() and not (path / INCOMPLETE).exists()  # opened, not written
    with pytest.raises(RecordError, match="is being written by pid"):
        replay.init(path, resume=True, replayable=FACTORY)  # a second writer
    run.close()
    assert Run.open(path).status == "complete" and (path / "run.json").read_bytes() == before

    with pytest.raises(RecordError, match="was not recorded by replay.init with replayable='other:f'"):
        replay.init(path, resume=True, replayable="other:f")
    with pytest.raises(RecordError, match="with an entrypoint"):
        replay.init(path, resume=True)

    run = replay.init(path, resume=True, replayable=FACTORY)
    assert run.next_step == 2 and run.newest_checkpoint() == 2
    w = run.restore({"w": jnp.float32(0.0)})["w"]
    run.begin(SCHEMA, "hash-of-my-program")
    assert (path / INCOMPLETE).exists() and not (path / COMPLETE).exists()  # the first write marks it
    w, record = step(w, batch_at(2))
    run.record(2, record, example_hashes(batch_at(2)))
    run.finish()
    assert Run.open(path).trace.end == 3 and Run.open(path).status == "complete"
