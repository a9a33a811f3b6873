"""A loop fed by a grain iterator, checkpointed through the user's own orbax CheckpointManager
registered with grain's handler (the layout grain documents: {"state": ..., "data":
grain.checkpoint.CheckpointHandler()}): `run.save(k, state, data=it)` writes the iterator through
grain's own handler, so the checkpoint is written once and grain restores it; replay reads it and
replays from it bit for bit. Before: the first save was orbax's raw ValueError ("Item "data" and
args JsonSave(...) does not match with any registered handler")."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import replay
from tests.cli_util import invoke, last_json
from tests.replay.test_bisect_epochs import step_fn  # the same one-weight step
from traces import Run

grain = pytest.importorskip("grain")
from grain import checkpoint as grain_checkpoint  # noqa: E402

ROWS = np.random.default_rng(6).normal(size=(24, 3)).astype(np.float32)


def make_iterator():
    ds = grain.MapDataset.source(ROWS).shuffle(seed=3).batch(4, drop_remainder=True).repeat().map(lambda b: {"x": b})
    return iter(ds.to_iter_dataset())


def init() -> dict:
    return {"w": jnp.ones((3,), jnp.float32)}


@replay.entrypoint
def make(config: dict) -> replay.Loop:
    return replay.Loop(step=jax.jit(step_fn), data=make_iterator, init=init)


def test_the_users_manager_with_grains_handler_writes_each_checkpoint_once_and_both_read_it(tmp_path):
    manager = ocp.CheckpointManager(tmp_path / "ckpts", item_handlers={
        "state": ocp.StandardCheckpointHandler(), "data": grain_checkpoint.CheckpointHandler()})
    loop = make({})
    run = replay.init(tmp_path / "run", config={}, entrypoint=make, checkpoints=manager)
    step = run.step()(loop.step)
    it, state, fed = make_iterator(), loop.init(), []
    for k in range(6):
        if k % 3 == 0:
            run.save(k, state, data=it)
        batch = next(it)
        fed.append(batch["x"])
        state, _ = step(state, batch)
    run.save(6, state, data=it)
    run.finish()
    manager.wait_until_finished()

    assert manager.all_steps() == [0, 3, 6]  # one checkpoint a step, the user's own
    assert (tmp_path / "ckpts" / "3" / "data" / "process_0-of-1.json").is_file()  # grain's layout
    assert set(Run.open(tmp_path / "run").manifest["data_state_fingerprints"]) == {"0", "3", "6"}
    resumed = make_iterator()  # grain restores the iterator from the checkpoint the run wrote
    manager.restore(3, args=ocp.args.Composite(state=ocp.args.StandardRestore(init()),
                                               data=grain_checkpoint.CheckpointRestore(resumed)))
    assert np.array_equal(next(resumed)["x"], fed[3])

    result = invoke("run", str(tmp_path / "run"), "--steps", "3:5", "--json")
    report = last_json(result)
    assert result.exit_code == 0 and report["checkpoint"] == 3 and report["all_bit_exact"], result.output
    assert report["replayed"] == 3
