"""replay/bisect/first_op.py compiles one program for two steps that are one program up to a
literal constant (a config value baked in: the learning-rate bump bisect refines most often), and
that program gives every op the bits each step's own program gives; steps closing over arrays
(at the top level or in an inner jit) are compared, the arrays as constants."""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np

from replay.bisect import first_op
from replay.bisect.first_op import first_differing_op
from tests.replay.test_first_op import BATCH, STATE, step


@contextlib.contextmanager
def compiles():
    """The XLA compiles requested inside the block (a persistent-cache hit counts too: the event
    wraps the request, so the count does not depend on what other tests compiled first)."""
    names: list[str] = []

    def listen(event: str, secs: float, **kw) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            names.append(kw.get("fun_name", "?"))

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield names
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def test_a_changed_literal_constant_compiles_one_program_for_both_steps():
    # The bump's step number and the inner jit's learning rate are literals of the jaxpr: the two
    # steps are one program fed other constants. Before, each step compiled its own (2 compiles).
    other = functools.partial(step, bump_at=4, lr=0.2)
    with compiles() as names:
        r = first_differing_op(step, other, (STATE, BATCH), (STATE, BATCH))
    assert (r["op"], r["first_differing_input"]) == ("eq", None) and "constant" in r["reason"], r
    assert len(names) == 1, names


def test_other_code_still_compiles_each_step_on_its_own():
    with compiles() as names:
        r = first_differing_op(step, functools.partial(step, act=jax.nn.sigmoid), (STATE, BATCH), (STATE, BATCH))
    assert "different" in r["reason"] and len(names) == 2, (r, names)


def test_the_shared_program_gives_every_op_the_bits_of_each_steps_own():
    other = functools.partial(step, bump_at=4, lr=0.2)
    a, b = first_op._Side(step, (STATE, BATCH)), first_op._Side(other, (STATE, BATCH))
    shared = first_op._outputs(a, b)
    alone = a.values(a.compile([]), []), b.values(b.compile([]), [])
    assert len(a.ops) > 10
    for got, want in zip(shared, alone):
        assert [first_op._bits(x) for x in got] == [first_op._bits(x) for x in want]


def _closing_over(c: np.ndarray, inner: bool):
    c = jnp.asarray(c, jnp.float32)
    scale = jax.jit(lambda w: w * c) if inner else (lambda w: w * c)

    def closed_step(state, batch):
        return {"w": scale(state["w"]) + batch.sum(), "n": state["n"] + 1}, {}

    return closed_step


def test_an_array_the_step_closes_over_is_a_constant_at_the_top_level_or_in_an_inner_jit():
    # A closed-over array is a constvar of the jaxpr (an inner jit's, inlined, or the step's own):
    # before, naming the ops mapped the constants onto the inputs and failed (KeyError).
    state, batch = {"w": jnp.ones((3,), jnp.float32), "n": jnp.int32(0)}, jnp.ones((2,), jnp.float32)
    for inner in (False, True):
        a, b = _closing_over(np.array([1, 2, 3]), inner), _closing_over(np.array([1, 2, 4]), inner)
        r = first_differing_op(a, b, (state, batch), (state, batch))
        assert (r["op"], r["first_differing_input"], r["shape"]) == ("mul", None, [3]) and "constant" in r["reason"], r
        same = first_differing_op(a, a, (state, batch), (state, batch))
        assert same["op"] is None and same["ops_compared"] >= 3, same
