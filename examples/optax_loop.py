"""A plain JAX + optax training loop, recorded with `replay.init` so `replay run` can verify it.

    python examples/optax_loop.py --out /tmp/mlp --steps 30   # train, checkpoint every 10, record
    replay run /tmp/mlp --steps 12:25 --allow-code            # restore checkpoint 10, re-run 10..25, compare bits
    replay bisect /tmp/mlp /tmp/other                         # where two runs of it first differ, and why

The lines that exist only for replay end in `# replay`. Everything else is an ordinary loop:
batches are a pure function of (seed, step) (`batch_at`), the dropout key of step k is
fold_in(base key, k), and `make(config)` builds the loop for training and for replay alike.
`evaluate` and `eval_batches` (each example's loss without dropout, on batches of a seed stream
training never draws from) let `replay compare A B --eval` compare two runs' checkpoints.
(`--allow-code`: the run names this script's folder, which replay imports from only when
asked; install the module instead and no flag is needed.)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import replay


@dataclasses.dataclass(frozen=True)
class Config:
    seed: int = 0
    steps: int = 30  # length of the learning-rate schedule, and of the run
    batch: int = 32
    d_in: int = 16
    hidden: tuple[int, ...] = (64, 64)
    lr: float = 3e-3
    warmup: int = 5
    dropout: float = 0.1
    checkpoint_every: int = 10
    lr_bump_at: int = -1  # an injected bug: step at which the learning rate is doubled (-1: never)
    refeed_at: int = -1  # an injected bug: step that is fed the batch of step refeed_at - 5 (-1: never)
    poison_at: int = -1  # an injected bug: step whose example POISONED gets a huge target (64), its loss a spike
    reset_opt_at: int = -1  # an edit between steps: the loop resets the optimizer state before step k (-1: never)

    @classmethod
    def from_dict(cls, d: dict) -> "Config":
        return cls(**{**d, "hidden": tuple(d["hidden"])})


class State(NamedTuple):
    step: jax.Array  # int32: the next step to run
    params: dict  # {"dense_0": {"w", "b"}, ..., "out": {"w", "b"}}
    opt_state: Any
    key: jax.Array  # uint32[2]: raw words of the dropout base key


POISONED = 3  # the batch position poison_at replaces
EVAL_STREAM = 3  # held-out batches' seed stream: training draws stream 2, the teacher stream 1


def layer_names(cfg: Config) -> list[str]:
    return [f"dense_{i}" for i in range(len(cfg.hidden))] + ["out"]


# Data: exact arithmetic (small integers scaled by powers of two), so a batch's bytes cannot
# depend on the CPU's BLAS or SIMD width: the same (seed, step) gives the same bytes anywhere.
def batch_at(cfg: Config, step: int, stream: int = 2) -> dict:
    if step == cfg.refeed_at and stream == 2:  # the injected bugs are in training's stream only
        step -= 5
    teacher = np.random.default_rng([cfg.seed, 1])
    w1, w2 = teacher.integers(-3, 4, (cfg.d_in, 8)), teacher.integers(-3, 4, (8, 1))
    rng = np.random.default_rng([cfg.seed, stream, step])
    x = rng.integers(-8, 9, (cfg.batch, cfg.d_in))
    y = np.abs(x @ w1) @ w2 + rng.integers(-4, 5, (cfg.batch, 1))  # int64: exact
    if step == cfg.poison_at and stream == 2:
        y[POISONED] = 64 * 256
    return {"x": (x / 4).astype(np.float32), "y": (y / 256).astype(np.float32)}


def schedule(cfg: Config) -> optax.Schedule:
    base = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, cfg.warmup, max(cfg.steps, cfg.warmup + 1))
    return lambda step: jnp.where(step == cfg.lr_bump_at, 2.0, 1.0) * base(step)


def optimizer(cfg: Config) -> optax.GradientTransformation:
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule(cfg), weight_decay=1e-4))


def init_state(cfg: Config) -> State:
    init_key, dropout_key = jax.random.split(jax.random.key(cfg.seed, impl="threefry2x32"))
    sizes = (cfg.d_in, *cfg.hidden, 1)
    params = {}
    for i, name in enumerate(layer_names(cfg)):
        w = jax.random.normal(jax.random.fold_in(init_key, i), sizes[i:i + 2]) * jnp.sqrt(2.0 / sizes[i])
        params[name] = {"w": w, "b": jnp.zeros(sizes[i + 1])}
    return State(jnp.zeros((), jnp.int32), params, optimizer(cfg).init(params), jax.random.key_data(dropout_key))


def forward(cfg: Config, params: dict, x: jax.Array, key: jax.Array | None) -> tuple[jax.Array, dict]:
    acts, h = {}, x
    for i, name in enumerate(layer_names(cfg)[:-1]):
        acts[name] = h = jax.nn.gelu(h @ params[name]["w"] + params[name]["b"])
        if key is not None:  # None: no dropout (evaluation)
            keep = jax.random.bernoulli(jax.random.fold_in(key, i), 1.0 - cfg.dropout, h.shape)
            acts[name] = h = jnp.where(keep, h / (1.0 - cfg.dropout), 0.0)
    acts["out"] = out = h @ params["out"]["w"] + params["out"]["b"]
    return out, acts


def train_step(state: State, batch: dict, cfg: Config) -> tuple[State, dict]:
    key = jax.random.fold_in(jax.random.wrap_key_data(state.key, impl="threefry2x32"), state.step)
    replay.tap(key, "rng")  # replay

    def loss_fn(params):
        pred, acts = forward(cfg, params, batch["x"], key)
        example_loss = jnp.mean(jnp.square(pred - batch["y"]), axis=-1)
        return jnp.mean(example_loss), (example_loss, acts)

    (loss, (example_loss, acts)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    replay.tap(acts, "forward")  # replay
    replay.tap(grads, "grad")  # replay
    updates, opt_state = optimizer(cfg).update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "lr": jnp.asarray(schedule(cfg)(state.step), jnp.float32),
               "example_loss": example_loss}
    return State(state.step + 1, params, opt_state, state.key), metrics


def evaluate(state: State, batch: dict, cfg: Config) -> jax.Array:
    """float32 [batch]: each example's loss under `state`, without dropout."""
    return jnp.mean(jnp.square(forward(cfg, state.params, batch["x"], None)[0] - batch["y"]), axis=-1)


@replay.entrypoint  # replay
def make(config: dict) -> replay.Loop:
    cfg = Config.from_dict(config)
    step = jax.jit(functools.partial(train_step, cfg=cfg), donate_argnums=0)
    return replay.Loop(step=step, batch_at=functools.partial(batch_at, cfg), init=functools.partial(init_state, cfg),
                       evaluate=jax.jit(functools.partial(evaluate, cfg=cfg)),
                       eval_batches=lambda: [batch_at(cfg, i, stream=EVAL_STREAM) for i in range(4)])


METRIC_KINDS = {"grad_norm": "backward", "lr": "update"}


def train(cfg: Config, out: str) -> str:
    loop = make(dataclasses.asdict(cfg))
    run = replay.init(out, config=dataclasses.asdict(cfg), entrypoint=make, store_examples=True)  # replay
    step = run.step(batch_axis=0, metric_kinds=METRIC_KINDS)(loop.step)  # replay
    state = loop.init()
    for k in range(cfg.steps):
        if k == cfg.reset_opt_at:  # the loop edits its state between two steps (before checkpoint k, if any)
            state = state._replace(opt_state=optimizer(cfg).init(state.params))
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
    args = parser.parse_args()
    cfg = Config(seed=args.seed, steps=args.steps, checkpoint_every=args.checkpoint_every, lr_bump_at=args.lr_bump_at)
    path = train(cfg, args.out)
    print(f"recorded {args.steps} steps in {path}; verify them with: replay run {path} --steps 0:{args.steps - 1}")
