"""A with-code replay of a run that stored its examples feeds the stored rows (what the run fed),
says so, and names a loop whose own data no longer reproduces the run's batches (a data pipeline
changed, or an iterator whose set_state loses its place) instead of failing on it."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import replay
from tests.cli_util import invoke, last_json

B = 4
SHIFT = 0.0  # what the loop's data adds to every row: a test changes it to make the loop's data drift


def batch_at(step: int) -> dict:
    return {"x": np.random.default_rng([4, step]).normal(size=(B, 3)).astype(np.float32) + np.float32(SHIFT)}


def init() -> dict:
    return {"w": jnp.ones((3,), jnp.float32)}


def step_fn(state: dict, batch: dict, lr: float) -> tuple[dict, dict]:
    per = (batch["x"] @ state["w"]) ** 2
    loss = jnp.mean(per)
    return {"w": state["w"] * (1 - lr * loss)}, {"loss": loss, "example_loss": per}


@replay.entrypoint
def make(config: dict) -> replay.Loop:
    return replay.Loop(step=jax.jit(functools.partial(step_fn, lr=config["lr"])), batch_at=batch_at, init=init)


def record(path, store: bool) -> None:
    loop = make({"lr": 0.01})
    run = replay.init(path, config={"lr": 0.01}, entrypoint=make, store_examples=store)
    step = run.step()(loop.step)
    state = loop.init()
    for k in range(4):
        if k % 2 == 0:
            run.save(k, state)
        state, _ = step(state, loop.batch_at(k))
    run.finish()


def test_the_stored_rows_are_fed_and_a_loop_whose_data_drifted_is_named(tmp_path, monkeypatch):
    record(tmp_path / "stored", store=True)
    record(tmp_path / "unstored", store=False)
    result = invoke("run", str(tmp_path / "stored"), "--steps", "2:3", "--json")
    report = last_json(result)
    assert result.exit_code == 0 and report["all_bit_exact"], result.output
    assert any("fed the run's stored rows" in n for n in report["notes"]), report["notes"]
    assert not any("does not reproduce" in n for n in report["notes"]), report["notes"]

    monkeypatch.setattr(__import__(__name__, fromlist=["x"]), "SHIFT", 1.0)  # the loop's data drifts
    result = invoke("run", str(tmp_path / "stored"), "--steps", "2:3", "--json")
    report = last_json(result)
    assert result.exit_code == 0 and report["all_bit_exact"] and report["replayed"] == 2, result.output
    assert any("the loop's own data does not reproduce step 2's batch (4 of 4 examples differ)" in n
               for n in report["notes"]), report["notes"]
    # Without stored rows the drifted data is what the replay feeds: it differs, and the replay says so.
    result = invoke("run", str(tmp_path / "unstored"), "--steps", "2:3", "--json")
    assert result.exit_code == 1 and last_json(result)["first_mismatch"]["fields"][0]["kind"] == "data", result.output
