"""An Equinox + optax training loop with a filtered jit, recorded with `replay.init`.

    python examples/equinox_loop.py --out /tmp/eqx --steps 30   # train, checkpoint every 10, record
    replay run /tmp/eqx --steps 12:25 --allow-code              # restore checkpoint 10, re-run 10..25, compare bits
    replay bisect /tmp/eqx /tmp/other                           # where two runs of it first differ, and why

The lines that exist only for replay end in `# replay`. The model is split once with
`eqx.partition(model, eqx.is_array)`: its arrays travel in the state (a tree of arrays only,
what a checkpoint and a fingerprint need), its static part is bound into the step, which
`eqx.combine`s them again. Dropout keys are fold_in(base key, step) from raw uint32 words in the
state; batches are a pure function of (seed, step), as in examples/optax_loop.py. `evaluate`
(dropout off) and `eval_batches` (a seed stream training never draws from) are for
`replay compare A B --eval`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import replay


@dataclasses.dataclass(frozen=True)
class Config:
    seed: int = 0
    steps: int = 30
    batch: int = 32
    d_in: int = 16
    hidden: int = 32
    lr: float = 3e-3
    dropout: float = 0.1
    checkpoint_every: int = 10
    lr_bump_at: int = -1  # an injected bug: step at which the learning rate is doubled (-1: never)
    refeed_at: int = -1  # an injected bug: step that is fed the batch of step refeed_at - 5 (-1: never)
    poison_at: int = -1  # an injected bug: step whose example POISONED gets a huge target (64), its loss a spike


class MLP(eqx.Module):
    dense_0: eqx.nn.Linear
    drop: eqx.nn.Dropout
    out: eqx.nn.Linear

    def __init__(self, cfg: Config, key: jax.Array):
        k0, k1 = jax.random.split(key)
        self.dense_0 = eqx.nn.Linear(cfg.d_in, cfg.hidden, key=k0)
        self.drop = eqx.nn.Dropout(cfg.dropout)
        self.out = eqx.nn.Linear(cfg.hidden, 1, key=k1)

    def __call__(self, x: jax.Array, key: jax.Array | None) -> jax.Array:
        h = self.drop(jax.nn.gelu(self.dense_0(x)), key=key, inference=key is None)  # key None: no dropout
        return self.out(h)


class State(NamedTuple):
    step: jax.Array  # int32: the next step to run
    params: Any  # the model's arrays (eqx.partition), None where the model is static
    opt_state: Any
    key: jax.Array  # uint32[2]: raw words of the dropout base key


POISONED = 3  # the batch position poison_at replaces
EVAL_STREAM = 3  # held-out batches' seed stream: training draws stream 2, the teacher stream 1


# Exact arithmetic (small integers scaled by powers of two): a batch's bytes cannot depend on the machine.
def batch_at(cfg: Config, step: int, stream: int = 2) -> dict:
    if step == cfg.refeed_at and stream == 2:  # the injected bugs are in training's stream only
        step -= 5
    teacher = np.random.default_rng([cfg.seed, 1])
    w1, w2 = teacher.integers(-3, 4, (cfg.d_in, 8)), teacher.integers(-3, 4, (8, 1))
    rng = np.random.default_rng([cfg.seed, stream, step])
    x = rng.integers(-8, 9, (cfg.batch, cfg.d_in))
    y = np.abs(x @ w1) @ w2 + rng.integers(-4, 5, (cfg.batch, 1))
    if step == cfg.poison_at and stream == 2:
        y[POISONED] = 64 * 256
    return {"x": (x / 4).astype(np.float32), "y": (y / 256).astype(np.float32)}


def optimizer(cfg: Config) -> optax.GradientTransformation:
    base = optax.cosine_decay_schedule(cfg.lr, max(cfg.steps, 1))
    schedule = lambda step: jnp.where(step == cfg.lr_bump_at, 2.0, 1.0) * base(step)  # noqa: E731
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=1e-4))


def split_model(cfg: Config) -> tuple[Any, Any]:
    init_key = jax.random.key(cfg.seed, impl="threefry2x32")
    return eqx.partition(MLP(cfg, init_key), eqx.is_array)  # (arrays, static)


def init_state(cfg: Config) -> State:
    params, _ = split_model(cfg)
    dropout_key = jax.random.key_data(jax.random.key(cfg.seed + 1, impl="threefry2x32"))
    return State(jnp.zeros((), jnp.int32), params, optimizer(cfg).init(params), dropout_key)


def train_step(state: State, batch: dict, static: Any, cfg: Config) -> tuple[State, dict]:
    key = jax.random.fold_in(jax.random.wrap_key_data(state.key, impl="threefry2x32"), state.step)
    keys = jax.random.split(key, cfg.batch)

    def loss_fn(params):
        model = eqx.combine(params, static)
        pred = jax.vmap(model)(batch["x"], keys)
        example_loss = jnp.mean(jnp.square(pred - batch["y"]), axis=-1)
        return jnp.mean(example_loss), example_loss

    (loss, example_loss), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(state.params)
    replay.tap(grads, "grad")  # replay
    updates, opt_state = optimizer(cfg).update(grads, state.opt_state, state.params)
    params = eqx.apply_updates(state.params, updates)
    metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "example_loss": example_loss}
    return State(state.step + 1, params, opt_state, state.key), metrics


def evaluate(state: State, batch: dict, static: Any) -> jax.Array:
    """float32 [batch]: each example's loss, without dropout."""
    model = eqx.combine(state.params, static)
    return jnp.mean(jnp.square(jax.vmap(lambda x: model(x, None))(batch["x"]) - batch["y"]), axis=-1)


@replay.entrypoint  # replay
def make(config: dict) -> replay.Loop:
    cfg = Config(**config)
    static = split_model(cfg)[1]
    step = eqx.filter_jit(functools.partial(train_step, static=static, cfg=cfg), donate="all")
    return replay.Loop(step=step, batch_at=functools.partial(batch_at, cfg), init=functools.partial(init_state, cfg),
                       evaluate=eqx.filter_jit(functools.partial(evaluate, static=static)),
                       eval_batches=lambda: [batch_at(cfg, i, stream=EVAL_STREAM) for i in range(4)])


def train(cfg: Config, out: str) -> str:
    loop = make(dataclasses.asdict(cfg))
    run = replay.init(out, config=dataclasses.asdict(cfg), entrypoint=make, store_examples=True)  # replay
    step = run.step(batch_axis=0, rng=["key"], metric_kinds={"grad_norm": "backward"})(loop.step)  # replay
    state = loop.init()
    for k in range(cfg.steps):
        if k % cfg.checkpoint_every == 0:
            run.save(k, state)  # replay
        state, metrics = step(state, loop.batch_at(k))
        if k % 5 == 4 or k == cfg.steps - 1:
            print(f"step {k:5d}  loss {float(metrics['loss']):.5f}")
    run.save(cfg.steps, state)  # replay
    run.finish()  # replay
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="the run directory to create")
    parser.add_argument("--steps", type=int, default=Config.steps)
    parser.add_argument("--seed", type=int, default=Config.seed)
    parser.add_argument("--checkpoint-every", type=int, default=Config.checkpoint_every)
    parser.add_argument("--lr-bump-at", type=int, default=-1, help="inject a bug: double the learning rate at this step")
    parser.add_argument("--refeed-at", type=int, default=-1, help="inject a bug: feed this step the batch of 5 steps before")
    args = parser.parse_args()
    cfg = Config(seed=args.seed, steps=args.steps, checkpoint_every=args.checkpoint_every, lr_bump_at=args.lr_bump_at,
                 refeed_at=args.refeed_at)
    path = train(cfg, args.out)
    print(f"recorded {args.steps} steps in {path}; verify them with: replay run {path} --steps 0:{args.steps - 1}")
