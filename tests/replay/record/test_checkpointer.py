"""The one checkpoint module (replay/record/checkpointer.py, checkpoints.py) as `replay.init`'s runs
use it: asynchronous saves and keep-N (the trainer's options, tests/trainer/test_checkpoint*.py),
a wrong target named leaf by leaf before orbax reads, and the user's own CheckpointManager."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
import pytest

import replay
from replay.record import checkpoints as ckpts
from replay.record.checkpointer import Checkpointer
from replay.record.errors import RecordError
from replay.record.orbax_io import CheckpointDamagedError, CheckpointError
from replay.record.program import spec
from tests.replay.test_record_api import batch_at, init_state, make, record, replay_all
from traces import Run


def test_async_saves_and_keep_in_a_replay_init_run(tmp_path):
    loop = make({"scale": 1.0})
    run = replay.init(tmp_path / "a", config={"scale": 1.0}, entrypoint=make, keep_checkpoints=2)
    step = run.step(loop.step)
    state = loop.init()
    for k in range(6):
        run.save(k, state, wait=False)  # the donating step runs while it is written
        state, _ = step(state, batch_at(k))
    run.save(6, state, wait=False)
    run.finish()  # waits for the last save: its fingerprint reaches the manifest once it is on disk
    recorded = Run.open(tmp_path / "a")
    on_disk = sorted(int(p.name) for p in (tmp_path / "a" / "checkpoints").iterdir() if p.name.isdigit())
    assert on_disk == [5, 6] and recorded.manifest["checkpoints"] == [5, 6]
    assert sorted(recorded.manifest[ckpts.FINGERPRINTS_KEY], key=int) == ["5", "6"]  # none of a pruned one
    report = replay_all(tmp_path / "a", 5, 5)  # restored from checkpoint 5, verified against its fingerprint
    assert report["all_bit_exact"] and report["checkpoint"] == 5


def test_a_state_of_another_shape_is_named_before_orbax_reads(tmp_path, capfd):
    record(tmp_path / "a", steps=3)
    manager = ckpts.open_manager(tmp_path / "a" / "checkpoints", read_only=True)
    wrong = dict(init_state(), w=jnp.zeros((5, 3), jnp.float32))
    with pytest.raises(CheckpointError) as e:
        ckpts.restore(manager, 0, jax.tree.map(spec, wrong), None)
    msg = str(e.value)
    assert not isinstance(e.value, CheckpointDamagedError)  # nothing is wrong with the files
    assert "checkpoint 0 does not match the state to restore: w is float32[4, 3] in the checkpoint, " \
           "float32[5, 3] in the target" in msg and "\n" not in msg, msg
    with pytest.raises(CheckpointError, match="the target has extra"):
        ckpts.restore(manager, 0, jax.tree.map(spec, dict(init_state(), extra=jnp.zeros(2))), None)
    assert "Traceback" not in capfd.readouterr().err


def test_the_users_manager_keeps_its_own_options(tmp_path):
    mine = ocp.CheckpointManager((tmp_path / "ck").absolute(), options=ocp.CheckpointManagerOptions(max_to_keep=1))
    with pytest.raises(RecordError, match="max_to_keep"):
        replay.init(tmp_path / "a", entrypoint=make, checkpoints=mine, keep_checkpoints=2)
    with pytest.raises(RecordError, match="keep_checkpoints=-1"):
        replay.init(tmp_path / "a", entrypoint=make, keep_checkpoints=-1)
    assert not (tmp_path / "a").exists()  # refused before the run's folder was touched
    ck = Checkpointer(manager=mine)
    state = {"w": jnp.arange(3.0)}
    assert ck.save(0, state, wait=False) and ck.save(1, state) and ck.save(1, state) is None
    ck.close()  # waits, and leaves the user's manager open
    assert mine.all_steps() == [1]
    mine.close()
