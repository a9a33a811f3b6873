"""Taps are recorded in execution order (replay/record/taps.py): a dict of layer outputs in the
order the step filled it, gradients in the order backpropagation computes them, so the first
differing layer of a trace comparison is the first in execution, not in the alphabet."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import replay
from traces import Run, compare

LAYERS = ("embed", "block_1", "block_0", "head")  # execution order; sorted would be block_0, block_1, embed, head
B = 4


def init_state() -> dict:
    return {name: jnp.full((3, 3), 0.1 * (i + 1), jnp.float32) for i, name in enumerate(LAYERS)}


def batch_at(step: int) -> dict:
    return {"x": np.random.default_rng([5, step]).normal(size=(B, 3)).astype(np.float32)}


def step_fn(params: dict, batch: dict, embed_scale: float = 1.0) -> tuple[dict, dict]:
    def loss_fn(p):
        acts, h = {}, batch["x"]
        for name in LAYERS:  # the forward pass fills `acts` layer by layer
            h = jnp.tanh(h @ p[name] * (embed_scale if name == "embed" else 1.0))
            acts[name] = h
        return jnp.mean(h ** 2), acts

    (loss, acts), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    replay.tap(acts, "acts")
    replay.tap(grads, "grad")
    return {k: params[k] - 0.1 * grads[k] for k in params}, {"loss": loss}


@replay.entrypoint
def make(config: dict) -> replay.Loop:
    return replay.Loop(step=jax.jit(functools.partial(step_fn, embed_scale=config["embed_scale"])),
                       batch_at=batch_at, init=init_state)


def record(path, embed_scale: float) -> Run:
    loop = make({"embed_scale": embed_scale})
    run = replay.init(path, config={"embed_scale": embed_scale}, entrypoint=make)
    step = run.step(batch_axis=0)(loop.step)
    state = loop.init()
    run.save(0, state)
    for k in range(2):
        state, _ = step(state, loop.batch_at(k))
    run.finish()
    return Run.open(path)


def test_taps_are_recorded_in_execution_order_and_the_first_differing_layer_follows_it(tmp_path):
    a, b = record(tmp_path / "a", 1.0), record(tmp_path / "b", 1.001)  # B: the embedding layer scaled
    forward = [n for n, k in a.schema.tensors if k == "forward"]
    backward = [n for n, k in a.schema.tensors if k == "backward"]
    assert forward == [f"acts/{name}" for name in LAYERS]
    assert backward == [f"grad/{name}" for name in reversed(LAYERS)]  # backprop: the last layer's first
    c = compare(a.trace, b.trace)
    assert c.first_step == 0 and c.first.kind == "forward" and c.first.name == "acts/embed", c.first
    # Every later layer differs too (they read embed's output): sorted, block_0 would have been named.
    assert {d.name for d in c.diffs if d.kind == "forward"} == set(forward)
