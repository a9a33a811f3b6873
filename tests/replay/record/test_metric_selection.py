"""`run.step(metrics=[...])` chooses which of the step's outputs are recorded (the loss always is);
the default records every one. A replay wraps the loop's step with the recorded choice."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import replay
from replay.record.errors import RecordError
from tests.cli_util import invoke, last_json
from traces import Run

B = 4


def batch_at(step: int) -> dict:
    return {"x": np.random.default_rng([9, step]).normal(size=(B, 3)).astype(np.float32)}


def init() -> dict:
    return {"w": jnp.ones((3,), jnp.float32)}


def step_fn(state: dict, batch: dict, lr: float) -> tuple[dict, dict]:
    per = (batch["x"] @ state["w"]) ** 2
    loss = jnp.mean(per)
    logged = {"loss": loss, "example_loss": per, "w_norm": jnp.linalg.norm(state["w"]), "lr": jnp.float32(lr),
              "x_mean": jnp.mean(batch["x"])}
    return {"w": state["w"] * (1 - lr * loss)}, logged


@replay.entrypoint
def make(config: dict) -> replay.Loop:
    return replay.Loop(step=jax.jit(functools.partial(step_fn, lr=config["lr"])), batch_at=batch_at, init=init)


def record(path, **options) -> Run:
    loop = make({"lr": 0.01})
    run = replay.init(path, config={"lr": 0.01}, entrypoint=make)
    step = run.step(**options)(loop.step)
    state = loop.init()
    run.save(0, state)
    for k in range(3):
        state, _ = step(state, loop.batch_at(k))
    run.finish()
    return Run.open(path)


def test_only_the_chosen_outputs_are_recorded_and_the_replay_agrees(tmp_path):
    every = record(tmp_path / "every")
    assert set(every.schema.metric_names) == {"loss", "w_norm", "lr", "x_mean"}
    assert every.schema.example_metrics == ("loss",)
    chosen = record(tmp_path / "chosen", metrics=["lr"])
    assert chosen.schema.metric_names == ("loss", "lr") and chosen.schema.example_metrics == ()
    assert chosen.manifest["record"]["metrics"] == ["lr"] and "metrics" not in every.manifest["record"]
    result = invoke("run", str(tmp_path / "chosen"), "--steps", "0:2", "--json")
    report = last_json(result)
    assert result.exit_code == 0 and report["all_bit_exact"] and report["replayed"] == 3, result.output


def test_an_output_the_step_does_not_return_is_refused_naming_it(tmp_path):
    with pytest.raises(RecordError, match="returns no output 'grad_norm'"):
        record(tmp_path / "r", metrics=["grad_norm"])
    with pytest.raises(RecordError, match="a list of str"):
        record(tmp_path / "s", metrics="lr")
