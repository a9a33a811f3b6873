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


def _two_layers(params: dict, batch: jax.Array) -> jax.Array:
    """`a_out` comes first in the alphabet and last in the program: read only after `w_in`'s matmul."""
    h = jnp.tanh(batch @ params["w_in"])
    return jnp.sum(h @ params["a_out"])


def test_the_differing_input_named_is_one_the_op_reads_not_the_first_in_path_order():
    params = {"a_out": jnp.ones((2, 1), jnp.float32), "w_in": jnp.ones((3, 2), jnp.float32) / 3}
    both = {"a_out": params["a_out"] * 2, "w_in": params["w_in"].at[0, 0].add(0.5)}  # two leaves differ
    r = first_differing_op(_two_layers, _two_layers, (params, BATCH), (both, BATCH))
    assert (r["op"], r["first_differing_input"]) == ("dot_general", "0.w_in"), r  # the matmul reads w_in only
    assert [o["input"] for o in r["differing_operands"]] == ["0.w_in"] and r["differing_operands"][0]["operand"] == 1
    assert "it reads the step's input 0.w_in, which differs" in r["reason"] and "a_out" not in r["reason"], r
