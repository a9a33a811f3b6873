"""Bisect's "already seen" on a multi-epoch loop: an example fed again in a later epoch is what
training over epochs does; one fed twice within an epoch is repeated data. With
replay.init(dataset_size=N) the two are told apart: a clean run is no longer said to have seen
its divergent batch before, the run that re-fed a batch within the epoch is."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import replay
from tests.cli_util import invoke, last_json

N, B = 8, 4  # an epoch is 2 steps: examples 0-3, then 4-7
DATA = np.random.default_rng(2).normal(size=(N, 3)).astype(np.float32)


def batch_at(step: int, refeed_at: int = -1) -> dict:
    fed = step - 1 if step == refeed_at else step  # the bug: step refeed_at gets the batch of the step before
    first = (fed * B) % N
    return {"x": DATA[first:first + B]}


def step_fn(state: dict, batch: dict) -> tuple[dict, dict]:
    per = (batch["x"] @ state["w"]) ** 2
    loss = jnp.mean(per)
    return {"w": state["w"] * (1 - 0.01 * loss)}, {"loss": loss, "example_loss": per}


@replay.entrypoint
def make(config: dict) -> replay.Loop:
    return replay.Loop(step=jax.jit(step_fn), batch_at=functools.partial(batch_at, refeed_at=config["refeed_at"]),
                       init=lambda: {"w": jnp.ones((3,), jnp.float32)})


def record(path, refeed_at: int, dataset_size: int | None) -> None:
    loop = make({"refeed_at": refeed_at})
    run = replay.init(path, config={"refeed_at": refeed_at}, entrypoint=make, dataset_size=dataset_size)
    step = run.step()(loop.step)
    state = loop.init()
    run.save(0, state)
    for k in range(6):
        state, _ = step(state, loop.batch_at(k))
    run.finish()


def test_a_later_epoch_is_not_repeated_data_and_a_refeed_within_the_epoch_is(tmp_path):
    record(tmp_path / "clean", -1, N)
    record(tmp_path / "refeed", 5, N)  # step 5 (epoch 2's second step) fed step 4's batch again
    result = invoke("bisect", str(tmp_path / "clean"), str(tmp_path / "refeed"), "--json")
    report = last_json(result)
    assert result.exit_code == 1 and (report["first_step"], report["cause"]) == (5, "data"), result.output
    # A's batch at 5 (examples 4-7) was fed at steps 1 and 3: earlier epochs, as training does.
    assert report["repeated_in_a"] == 0 and report["repeated_in_b"] == B, report
    a_places = [s for e in report["examples"] if e["run"] == "A" for s in e["seen_before"] if s["run"] == "A"]
    assert a_places and not any(s["same_epoch"] for s in a_places), a_places
    assert "already seen by A" not in invoke("bisect", str(tmp_path / "clean"), str(tmp_path / "refeed")).stdout

    # Without a dataset size the epochs are unknown: every earlier feeding counts, as before.
    record(tmp_path / "clean_n", -1, None)
    record(tmp_path / "refeed_n", 5, None)
    report = last_json(invoke("bisect", str(tmp_path / "clean_n"), str(tmp_path / "refeed_n"), "--json"))
    assert report["repeated_in_a"] == B and report["repeated_in_b"] == B, report
