"""A Flax NNX training loop (BatchNorm, Dropout through nnx.Rngs, an nnx.Optimizer), recorded with `replay.init`.

    python examples/nnx_loop.py --out /tmp/nnx --steps 30   # train, checkpoint every 10, record
    replay run /tmp/nnx --steps 12:25 --allow-code          # restore checkpoint 10, re-run 10..25, compare bits
    replay bisect /tmp/nnx /tmp/other                       # where two runs of it first differ, and why

The lines that exist only for replay end in `# replay`. The step is NNX's functional form:
the model and optimizer travel as `nnx.split`'s (graphdef, state); the jitted step merges them,
trains in place, and returns `nnx.state(...)`, the new state. What the recorder sees entering
the step is that state tree (parameters, BatchNorm statistics, the Dropout stream's typed key
and counter, the optimizer's moments), so checkpoints, fingerprints and RNG words need nothing
NNX-specific. Batches are a pure function of (seed, step), as in examples/optax_loop.py, and so
are `evaluate` (eval mode: BatchNorm's running statistics, no dropout) and `eval_batches` (a seed
stream training never draws from) for `replay compare A B --eval`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

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


class MLP(nnx.Module):
    def __init__(self, cfg: Config, rngs: nnx.Rngs):
        self.dense_0 = nnx.Linear(cfg.d_in, cfg.hidden, rngs=rngs)
        self.norm = nnx.BatchNorm(cfg.hidden, momentum=0.9, rngs=rngs)
        self.drop = nnx.Dropout(cfg.dropout, rngs=rngs)
        self.out = nnx.Linear(cfg.hidden, 1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(self.drop(nnx.gelu(self.norm(self.dense_0(x)))))


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
    return optax.adamw(schedule, weight_decay=1e-4)


def create(cfg: Config) -> tuple[MLP, nnx.Optimizer]:
    model = MLP(cfg, nnx.Rngs(params=cfg.seed, dropout=cfg.seed + 1))
    return model, nnx.Optimizer(model, optimizer(cfg), wrt=nnx.Param)


def train_step(state: nnx.State, batch: dict, graphdef: nnx.GraphDef) -> tuple[nnx.State, dict]:
    model, opt = nnx.merge(graphdef, state)
    model.train()

    def loss_fn(model: MLP):
        example_loss = jnp.mean(jnp.square(model(batch["x"]) - batch["y"]), axis=-1)
        return jnp.mean(example_loss), example_loss

    (loss, example_loss), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    replay.tap(grads, "grad")  # replay
    opt.update(model, grads)  # in place: nnx.merge shares `state`'s Variables (run.step records a copy)
    metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "example_loss": example_loss}
    return nnx.state((model, opt)), metrics


def evaluate(state: nnx.State, batch: dict, graphdef: nnx.GraphDef) -> jax.Array:
    """float32 [batch]: each example's loss in eval mode (running statistics, no dropout)."""
    model, _ = nnx.merge(graphdef, state)
    model.eval()
    return jnp.mean(jnp.square(model(batch["x"]) - batch["y"]), axis=-1)


@replay.entrypoint  # replay
def make(config: dict) -> replay.Loop:
    cfg = Config(**config)
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: create(cfg)))
    step = jax.jit(functools.partial(train_step, graphdef=graphdef), donate_argnums=0)
    return replay.Loop(step=step, batch_at=functools.partial(batch_at, cfg), init=lambda: nnx.split(create(cfg))[1],
                       evaluate=jax.jit(functools.partial(evaluate, graphdef=graphdef)),
                       eval_batches=lambda: [batch_at(cfg, i, stream=EVAL_STREAM) for i in range(4)])


def train(cfg: Config, out: str) -> str:
    loop = make(dataclasses.asdict(cfg))
    run = replay.init(out, config=dataclasses.asdict(cfg), entrypoint=make, store_examples=True)  # replay
    step = run.step(batch_axis=0, metric_kinds={"grad_norm": "backward"})(loop.step)  # replay
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
