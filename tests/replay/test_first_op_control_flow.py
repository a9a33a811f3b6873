"""replay/bisect/first_op.py descends into the branch of a `cond` both runs took and into
custom-derivative calls' bodies (before, each was one op: bisect named `cond`, not the op inside
it, e.g. the learning-rate schedule inside optax.MultiSteps' cond), and locates an op by the user's line and the library's."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from replay.bisect import op_program
from replay.bisect.first_op import first_differing_op
from tests.replay.test_first_op_compiles import compiles

STATE = {"w": jnp.linspace(-1.0, 1.0, 6, dtype=jnp.float32), "n": jnp.int32(4), "k": jnp.int32(1)}
BATCH = jnp.linspace(0.5, 2.0, 6, dtype=jnp.float32)


def limited(limit: float):
    @jax.custom_vjp
    def f(x):
        return jnp.minimum(x, limit)

    f.defvjp(lambda x: (f(x), x), lambda x, g: (g * (x < limit),))
    return f


def smooth(scale: float):
    @jax.custom_jvp
    def f(x):
        return jnp.tanh(x) * scale

    f.defjvp(lambda p, t: (f(p[0]), t[0] * scale))
    return f


def step(state: dict, batch: jax.Array, bump_at: int = -1, lr: float = 0.1, skip: bool = False):
    g = jax.grad(lambda w: jnp.sum(jnp.tanh(w * batch) ** 2))(state["w"])

    def apply(w, g, n):  # inside the cond: the schedule's `n == bump_at`
        return w - lr * jnp.where(n == bump_at, 2.0, 1.0) * g

    w = jax.lax.cond(jnp.logical_and(state["n"] >= 0, not skip), apply, lambda w, g, n: w, state["w"], g, state["n"])
    w = jax.lax.switch(state["k"], [lambda w: w, lambda w: w * 0.5, lambda w: w + 1.0], w)  # a cond of 3 branches
    return {"w": w, "n": state["n"] + 1, "k": state["k"]}, {"loss": jnp.sum(w)}


def test_a_constant_inside_a_cond_names_the_op_inside_it_with_one_compile():
    with compiles() as names:
        r = first_differing_op(step, functools.partial(step, bump_at=4), (STATE, BATCH), (STATE, BATCH))
    assert (r["op"], r["first_differing_input"]) == ("eq", None) and "constant" in r["reason"], r
    assert [(c["op"], c["branch"], c["of"]) for c in r["inside"]] == [("cond", 1, 2)], r["inside"]
    assert "inside cond at" in r["where"] and "apply)" in r["where"], r["where"]
    assert len(names) == 1, names  # the constant became an input of the cond: one program for both
    same = first_differing_op(step, step, (STATE, BATCH), (STATE, BATCH))  # the other branch's zeros agree too
    assert same["op"] is None and "every op agrees" in same["reason"], same


def test_custom_derivative_bodies_are_searched():
    # Evaluated, not differentiated, a custom_vjp / custom_jvp call computes its body: its ops are named.
    def measured(state, batch, limit=1.0, scale=1.0):
        return state, {"a": limited(limit)(state["w"] * batch), "b": smooth(scale)(state["w"])}

    for other, op in (({"limit": 0.5}, "min"), ({"scale": 2.0}, "mul")):
        r = first_differing_op(measured, functools.partial(measured, **other), (STATE, BATCH), (STATE, BATCH))
        assert (r["op"], r["first_differing_input"]) == (op, None) and "constant" in r["reason"], (other, r)
        assert "f)" in r["where"], r["where"]  # the custom function's own line


def test_a_library_op_is_located_at_the_users_line_and_the_librarys():
    def scheduled(state, batch, lr=0.1):
        rate = optax.cosine_decay_schedule(lr, 10)(state["n"])
        return {**state, "w": state["w"] - rate * batch}, {}

    r = first_differing_op(scheduled, functools.partial(scheduled, lr=0.2), (STATE, BATCH), (STATE, BATCH))
    assert r["user_frame"].startswith("test_first_op_control_flow.py:") and "scheduled)" in r["user_frame"], r
    assert r["library_frame"].startswith("optax/schedules/_schedule.py:"), r  # the cosine's mul
    assert r["user_frame"] in r["where"] and f"in {r['library_frame']}" in r["where"], r["where"]


def test_library_frames_survive_packages_installed_into_the_interpreter(monkeypatch):
    # CI installs into the interpreter itself: site-packages then lies inside the stdlib folder, and
    # jax's own user-frame filter (a prefix match on that folder) dropped optax's frames with it.
    from jax._src import source_info_util as jax_frames

    def clear():
        jax_frames._exclude_path_regex.cache_clear()
        jax_frames.is_user_filename.cache_clear()
        op_program._jax_internal.cache_clear()  # its answers depend on _STDLIB, patched here

    site = optax.__file__.rsplit("site-packages", 1)[0]
    monkeypatch.setattr(jax_frames, "_exclude_paths", [*jax_frames._exclude_paths, site])
    monkeypatch.setattr(op_program, "_STDLIB", site)
    monkeypatch.setattr(op_program, "_LIBRARY_ROOTS", (op_program._LIBRARY_ROOTS[0], site))
    clear()
    try:
        assert not jax_frames.is_user_filename(optax.__file__)  # the CI layout, as jax sees it
        test_a_library_op_is_located_at_the_users_line_and_the_librarys()
        assert op_program._jax_internal(site + "functools.py") and not op_program._jax_internal(optax.__file__)
    finally:
        monkeypatch.undo()
        clear()


def looped(state: dict, rows: jax.Array, scale: float = 1.0, stop: int = 3):
    def body(c, x):
        return c * 0.9 + x * scale, jnp.sum(c)

    carry, ys = jax.lax.scan(body, state["w"], rows)  # one iteration per row of the batch
    out = jax.lax.while_loop(lambda c: c[0] < stop, lambda c: (c[0] + 1, c[1] * 1.5), (0, carry))[1]
    return {**state, "w": out}, {"loss": jnp.sum(ys)}


ROWS = jnp.arange(24, dtype=jnp.float32).reshape(4, 6) / 10


def test_a_scan_is_searched_at_its_first_differing_iteration():
    r = first_differing_op(looped, looped, (STATE, ROWS), (STATE, ROWS.at[2, 3].add(1.0)))
    assert (r["op"], r["first_differing_input"]) == ("mul", "1"), r  # x * scale, at the third row
    assert [(c["op"], c["iteration"], c["of"]) for c in r["inside"]] == [("scan", 2, 4)], r["inside"]
    assert "inside scan at test_first_op_control_flow.py:" in r["where"] and "(iteration 2 of 4)" in r["where"], r
    r = first_differing_op(looped, functools.partial(looped, scale=2.0), (STATE, ROWS), (STATE, ROWS))
    assert (r["op"], r["first_differing_input"], r["inside"][0]["iteration"]) == ("mul", None, 0), r
    assert "constant" in r["reason"], r


def test_a_while_loop_that_runs_longer_is_searched_in_its_condition():
    r = first_differing_op(looped, functools.partial(looped, stop=5), (STATE, ROWS), (STATE, ROWS))
    assert (r["op"], r["first_differing_input"]) == ("lt", None) and "constant" in r["reason"], r
    assert [(c["op"], c["iteration"]) for c in r["inside"]] == [("while", 3)], r["inside"]
