"""The Flax NNX MNIST tutorial's loop, as written upstream, recorded with `replay.init`.

    python examples/nnx_mnist.py --out /tmp/mnist --steps 30   # train, checkpoint every 10, record
    replay run /tmp/mnist --steps 12:25 --allow-code           # restore checkpoint 10, re-run 10..25, compare bits
    replay bisect /tmp/mnist /tmp/other                        # where two runs of it first differ, and why

The shape of https://flax.readthedocs.io/en/latest/mnist_tutorial.html: a CNN with BatchNorm and
Dropout, an `nnx.Optimizer`, an `nnx.MultiMetric` (loss, accuracy) updated inside an in-place
`@nnx.jit` train_step that returns nothing, `metrics.compute()` and `metrics.reset()` every
epoch, an eval pass in eval mode, and an iterator that reshuffles every epoch. The data is
synthetic (8x8 images labelled by a fixed integer "teacher", exact arithmetic), so nothing is
downloaded and a batch's bytes cannot depend on the machine.

The lines that exist only for replay end in `# replay`: `run.nnx_step(train_step)` records the
step called exactly as written (replay/record/nnx_step.py), and `make` gives replay the same
function, the nodes it takes and the iterator.
"""

from __future__ import annotations

import argparse
import dataclasses

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
    batch: int = 16
    batches_per_epoch: int = 12  # the training set: batch * batches_per_epoch images, reshuffled every epoch
    side: int = 8
    features: int = 4
    lr: float = 5e-3
    dropout: float = 0.1
    checkpoint_every: int = 10
    lr_bump_at: int = -1  # an injected bug: step at which the learning rate is doubled (-1: never)
    refeed_at: int = -1  # an injected bug: step that is fed the batch of step refeed_at - 5 (-1: never)


class CNN(nnx.Module):
    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        self.conv = nnx.Conv(1, cfg.features, kernel_size=(3, 3), rngs=rngs)
        self.norm = nnx.BatchNorm(cfg.features, rngs=rngs)
        self.dropout = nnx.Dropout(cfg.dropout, rngs=rngs)
        self.linear = nnx.Linear(cfg.features * (cfg.side // 2) ** 2, 10, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = nnx.avg_pool(nnx.relu(self.norm(self.conv(x))), window_shape=(2, 2), strides=(2, 2))
        return self.linear(self.dropout(x.reshape(x.shape[0], -1)))


def images(cfg: Config, split: int) -> dict:
    """The whole split (0: train, 1: test): images in quarters, labels by an integer teacher."""
    n = cfg.batch * (cfg.batches_per_epoch if split == 0 else 2)
    x = np.random.default_rng([cfg.seed, split]).integers(0, 9, (n, cfg.side, cfg.side, 1))
    teacher = np.random.default_rng([cfg.seed, 7]).integers(-2, 3, (cfg.side * cfg.side, 10))
    return {"image": (x / 4).astype(np.float32), "label": np.argmax(x.reshape(n, -1) @ teacher, axis=1).astype(np.int32)}


class Batches:
    """Training batches, reshuffled every epoch; grain's get_state()/set_state() protocol."""

    def __init__(self, cfg: Config):
        self.cfg, self.data, self.step = cfg, images(cfg, 0), 0

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        k, self.step = self.step, self.step + 1
        if k == self.cfg.refeed_at:
            k -= 5
        epoch, i = divmod(k, self.cfg.batches_per_epoch)
        order = np.random.default_rng([self.cfg.seed, 100 + epoch]).permutation(len(self.data["label"]))
        rows = order[i * self.cfg.batch:(i + 1) * self.cfg.batch]
        return {name: column[rows] for name, column in self.data.items()}

    def get_state(self) -> dict:
        return {"step": self.step}

    def set_state(self, state: dict) -> None:
        self.step = int(state["step"])


def create(cfg: Config) -> tuple[CNN, nnx.Optimizer, nnx.MultiMetric]:
    model = CNN(cfg, rngs=nnx.Rngs(params=cfg.seed, dropout=cfg.seed + 1))
    base = optax.cosine_decay_schedule(cfg.lr, max(cfg.steps, 1))
    schedule = lambda step: jnp.where(step == cfg.lr_bump_at, 2.0, 1.0) * base(step)  # noqa: E731
    optimizer = nnx.Optimizer(model, optax.adamw(schedule), wrt=nnx.Param)
    metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))
    return model, optimizer, metrics


def loss_fn(model: CNN, batch: dict):
    logits = model(batch["image"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits=logits, labels=batch["label"]).mean()
    return loss, logits


@nnx.jit
def train_step(model: CNN, optimizer: nnx.Optimizer, metrics: nnx.MultiMetric, batch: dict):
    """Train for a single step."""
    grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
    (loss, logits), grads = grad_fn(model, batch)
    replay.tap(grads, "grad")  # replay
    metrics.update(loss=loss, logits=logits, labels=batch["label"])  # in-place updates
    optimizer.update(model, grads)  # in-place updates


@nnx.jit
def eval_step(model: CNN, metrics: nnx.MultiMetric, batch: dict):
    loss, logits = loss_fn(model, batch)
    metrics.update(loss=loss, logits=logits, labels=batch["label"])


@replay.entrypoint  # replay
def make(config: dict) -> replay.Loop:
    cfg = Config(**config)
    return replay.Loop(nnx_step=train_step, nodes=lambda: create(cfg), data=lambda: Batches(cfg))  # replay


def train(cfg: Config, out: str) -> str:
    model, optimizer, metrics = create(cfg)
    run = replay.init(out, config=dataclasses.asdict(cfg), entrypoint=make, store_examples=True,  # replay
                      dataset_size=cfg.batch * cfg.batches_per_epoch)
    step = run.nnx_step(train_step)  # replay
    batches, test, history = Batches(cfg), images(cfg, 1), []
    for k in range(cfg.steps):
        if k % cfg.checkpoint_every == 0:
            run.save(k, (model, optimizer), data=batches)  # replay
        model.train()  # Switch to train mode (BatchNorm statistics, Dropout on)
        step(model, optimizer, metrics, next(batches))
        if (k + 1) % cfg.batches_per_epoch == 0 or k == cfg.steps - 1:  # one epoch
            history.append({f"train_{n}": float(v) for n, v in metrics.compute().items()})
            metrics.reset()  # Reset the metrics for the test set.
            model.eval()  # Switch to eval mode (running statistics, no Dropout)
            for i in range(2):
                eval_step(model, metrics, {n: c[i * cfg.batch:(i + 1) * cfg.batch] for n, c in test.items()})
            history[-1].update({f"test_{n}": float(v) for n, v in metrics.compute().items()})
            metrics.reset()
            print(f"step {k:4d}  " + "  ".join(f"{n} {v:.4f}" for n, v in history[-1].items()))
    run.save(cfg.steps, (model, optimizer), data=batches)  # replay
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
