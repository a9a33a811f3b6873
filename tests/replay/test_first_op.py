"""replay/bisect/first_op.py names the first op of a step whose outputs differ between two runs, and why:
a differing input of the step, a constant baked in (a config value), an op that computes
differently on equal inputs, different code; identical steps agree on every op."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from replay.bisect.first_op import first_differing_op


def step(state: dict, batch: jax.Array, lr: float = 0.1, bump_at: int = -1, act=jnp.tanh) -> tuple[dict, dict]:
    def loss_fn(w):
        return jnp.mean(act(batch @ w) ** 2)

    loss, g = jax.value_and_grad(loss_fn)(state["w"])
    scale = jnp.where(state["n"] == bump_at, 2.0, 1.0)
    inner = jax.jit(lambda w, g: w - lr * scale * g)  # an inner jit: its ops are named one by one
    return {"w": inner(state["w"], g), "n": state["n"] + 1}, {"loss": loss}


STATE = {"w": jnp.arange(6, dtype=jnp.float32).reshape(3, 2) / 5, "n": jnp.int32(4)}
BATCH = jnp.asarray(np.random.default_rng(0).normal(size=(4, 3)), jnp.float32)


def test_identical_steps_agree_on_every_op():
    r = first_differing_op(step, step, (STATE, BATCH), (STATE, BATCH))
    assert r["op"] is None and r["ops_compared"] > 10 and "every op agrees" in r["reason"]


def test_a_differing_input_names_the_input_and_the_first_op_reading_it():
    other = BATCH.at[2, 1].add(1.0)
    r = first_differing_op(step, step, (STATE, BATCH), (STATE, other))
    assert (r["op"], r["first_differing_input"], r["same_inputs"]) == ("dot_general", "1", False), r
    assert "test_first_op.py:" in r["where"]


def test_a_changed_constant_names_the_op_that_reads_it():
    bumped = functools.partial(step, bump_at=4)
    r = first_differing_op(step, bumped, (STATE, BATCH), (STATE, BATCH))
    assert (r["op"], r["first_differing_input"]) == ("eq", None) and "constant" in r["reason"], r


def test_a_constant_inside_an_inner_jit_is_found_inside_it():
    r = first_differing_op(step, functools.partial(step, lr=0.2), (STATE, BATCH), (STATE, BATCH))
    assert r["op"] == "mul" and r["first_differing_input"] is None, r  # lr * scale, inside the inner jit


def test_other_code_is_named_as_such():
    r = first_differing_op(step, functools.partial(step, act=jax.nn.sigmoid), (STATE, BATCH), (STATE, BATCH))
    assert r["op"] is not None and "different" in r["reason"], r
