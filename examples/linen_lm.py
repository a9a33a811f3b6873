"""A small Flax linen decoder-only language model trained with optax, recorded with `replay.init`.

    python examples/linen_lm.py --out /tmp/lm --steps 30   # train, checkpoint every 10, record
    replay run /tmp/lm --steps 12:25 --allow-code          # restore checkpoint 10, re-run 10..25, compare bits
    replay bisect /tmp/lm /tmp/other                       # where two runs of it first differ, and why

The lines that exist only for replay end in `# replay`. The model is linen's functional form
(`model.apply(params, ...)`): a token and position embedding, causal self-attention blocks,
logits tied to the embedding, no dropout (as in most current LMs). The batch is sharded
over `jax.devices()` along its batch axis with a NamedSharding (one device works the same), and
the step is jitted with `donate_argnums=0`. The optimizer accumulates gradients as nanodo's does,
`optax.MultiSteps(..., every_k_schedule=2)`: each step feeds one micro-batch, and every second
step applies an update (inside MultiSteps' `lax.cond`, where the learning-rate schedule runs).
The task is a copy task (the second half of each row repeats the first): learnable, though 30
steps (15 updates) only start it.

The data is a grain pipeline (`grain.MapDataset` -> `IterDataset`), consumed as an iterator,
as streaming loops do. The loop checkpoints through its own orbax `CheckpointManager`, registered
with grain's handler for the iterator (the layout grain documents); replay records through it:
`run.save(k, state, data=it)` writes checkpoint k once, the state and grain's iterator state in
one orbax step, and replay restores both from it (`replay.Loop(data=...)`). Batch i of the stream
is a pure function of (seed, i): token rows drawn from a generator seeded with (seed, i).
`evaluate` (each row's mean next-token loss) and `eval_batches` (rows of a seed stream training
never draws from) are for `replay compare A B --eval`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from pathlib import Path
from typing import Any, NamedTuple

import flax.linen as nn
import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from grain import checkpoint as grain_checkpoint
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import replay


@dataclasses.dataclass(frozen=True)
class Config:
    seed: int = 0
    steps: int = 30  # length of the learning-rate schedule, and of the run
    batch: int = 8
    seq: int = 16
    vocab: int = 64
    d_model: int = 32
    heads: int = 2
    layers: int = 1
    lr: float = 3e-3
    warmup: int = 5
    checkpoint_every: int = 10
    accumulate: int = 2  # optax.MultiSteps applies the accumulated gradients every this many steps
    # An injected bug: the update applied at this step (or the next: MultiSteps applies one every
    # `accumulate` steps) has its learning rate doubled (-1: never).
    lr_bump_at: int = -1
    refeed_at: int = -1  # an injected bug: step that is fed the batch of step refeed_at - 5 (-1: never)
    # An injected bug: at this step example POISONED's targets are ids past the vocabulary (a tokenizer that does
    # not match the model). JAX's gather fills NaN there, so that example's loss (and the step's) is NaN.
    poison_at: int = -1


class State(NamedTuple):
    step: jax.Array  # int32: the next step to run
    params: Any  # linen's {"params": {...}} collection
    opt_state: Any


class Block(nn.Module):
    """A pre-norm block: causal self-attention, then an MLP. RMSNorm and no biases keep the state
    to few leaves; every leaf is fingerprinted in the recorded step, so fewer compile faster."""

    cfg: Config

    @nn.compact
    def __call__(self, h: jax.Array, mask: jax.Array) -> jax.Array:
        cfg = self.cfg
        h = h + nn.MultiHeadDotProductAttention(num_heads=cfg.heads, use_bias=False, name="attn")(
            nn.RMSNorm(name="norm_attn")(h), mask=mask)
        m = nn.Dense(4 * cfg.d_model, use_bias=False, name="mlp_in")(nn.RMSNorm(name="norm_mlp")(h))
        m = nn.Dense(cfg.d_model, use_bias=False, name="mlp_out")(nn.gelu(m))
        return h + m


class LM(nn.Module):
    cfg: Config

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg = self.cfg
        embed = nn.Embed(cfg.vocab, cfg.d_model, name="embed")
        pos = self.param("pos", nn.initializers.normal(0.02), (cfg.seq, cfg.d_model))
        h = embed(tokens) + pos[: tokens.shape[-1]]
        mask = nn.make_causal_mask(tokens)
        for i in range(cfg.layers):
            h = Block(cfg, name=f"block_{i}")(h, mask)
        return embed.attend(nn.RMSNorm(name="norm_out")(h))  # logits tied to the embedding


def sharding(*spec: str) -> NamedSharding:
    """On a mesh of every device, one "batch" axis: sharding("batch") splits axis 0 over the
    devices (the batch must divide by the device count); sharding() replicates."""
    return NamedSharding(Mesh(np.array(jax.devices()), ("batch",)), PartitionSpec(*spec))


POISONED = 3  # the batch position poison_at replaces
EVAL_STREAM = 3  # held-out rows' seed stream: training draws stream 2


# A copy task: each row is 9 random tokens followed by its first 8 again, so the last half of
# every row is predictable from the first. 64**9 possible rows: no two batches share a row by chance.
def batch_rows(cfg: Config, index: int, stream: int = 2) -> dict:
    rng = np.random.default_rng([cfg.seed, stream, index])
    half = rng.integers(0, cfg.vocab, (cfg.batch, cfg.seq // 2 + 1))
    rows = np.concatenate([half, half[:, : cfg.seq // 2]], axis=1).astype(np.int32)
    targets = rows[:, 1:].copy()
    if index == cfg.poison_at and stream == 2:
        targets[POISONED] = cfg.vocab
    return {"inputs": rows[:, :-1], "targets": targets}


def dataset(cfg: Config) -> grain.IterDataset:
    """The stream of batches, sharded along the batch axis; its iterator's state is its position."""
    def source(i: int) -> int:  # the injected data-loader bug: batch refeed_at repeats batch refeed_at - 5
        return i - 5 if i == cfg.refeed_at else i

    return (grain.MapDataset.range(1 << 40).map(source).map(functools.partial(batch_rows, cfg))
            # Batches this small cost less than prefetch threads would; grain's default prefetches.
            .to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
            .map(lambda batch: jax.device_put(batch, sharding("batch"))))


def schedule(cfg: Config) -> optax.Schedule:
    """The rate of the `update`-th applied update (MultiSteps' inner optimizer counts applied updates)."""
    # Warm up from lr / warmup, not 0: a zero rate would leave the first update's parameters unchanged.
    updates = max(cfg.steps // cfg.accumulate, cfg.warmup + 1)
    base = optax.warmup_cosine_decay_schedule(cfg.lr / cfg.warmup, cfg.lr, cfg.warmup, updates)
    return lambda update: jnp.where(update == cfg.lr_bump_at // cfg.accumulate, 2.0, 1.0) * base(update)


def optimizer(cfg: Config) -> optax.MultiSteps:
    inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule(cfg), weight_decay=1e-4))
    return optax.MultiSteps(inner, every_k_schedule=cfg.accumulate)


def init_state(cfg: Config) -> State:
    params = LM(cfg).init(jax.random.key(cfg.seed, impl="threefry2x32"), jnp.zeros((1, cfg.seq), jnp.int32))
    state = State(jnp.zeros((), jnp.int32), params, optimizer(cfg).init(params))
    # Replicated, as the step's outputs are: a state placed elsewhere would compile the step twice.
    return jax.device_put(state, sharding())


def example_losses(params: Any, batch: dict, cfg: Config) -> jax.Array:
    logits = LM(cfg).apply(params, batch["inputs"])
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]), axis=-1)


def train_step(state: State, batch: dict, cfg: Config) -> tuple[State, dict]:
    def loss_fn(params):
        example_loss = example_losses(params, batch, cfg)
        return jnp.mean(example_loss), example_loss

    (loss, example_loss), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    replay.tap(grads, "grad")  # replay
    updates, opt_state = optimizer(cfg).update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)  # zero updates while MultiSteps accumulates
    applies = state.step % cfg.accumulate == cfg.accumulate - 1
    lr = jnp.where(applies, schedule(cfg)(state.step // cfg.accumulate), 0.0)  # the rate this step applies
    metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "lr": jnp.asarray(lr, jnp.float32),
               "example_loss": example_loss}
    return State(state.step + 1, params, opt_state), metrics


@replay.entrypoint  # replay
def make(config: dict) -> replay.Loop:
    cfg = Config(**config)
    step = jax.jit(functools.partial(train_step, cfg=cfg), donate_argnums=0)
    init = jax.jit(functools.partial(init_state, cfg))  # one compile, not one per initializer op run eagerly
    evaluate = jax.jit(lambda state, batch: example_losses(state.params, batch, cfg))
    return replay.Loop(step=step, data=lambda: iter(dataset(cfg)), init=init, evaluate=evaluate,
                       eval_batches=lambda: [batch_rows(cfg, i, stream=EVAL_STREAM) for i in range(4)])


METRIC_KINDS = {"grad_norm": "backward", "lr": "update"}


def checkpoint_manager(directory: str | Path, cfg: Config) -> ocp.CheckpointManager:
    """The loop's own manager: the train state and grain's iterator, in the layout grain documents."""
    options = ocp.CheckpointManagerOptions(save_interval_steps=cfg.checkpoint_every)
    return ocp.CheckpointManager(Path(directory).absolute(), options=options, item_handlers={
        "state": ocp.StandardCheckpointHandler(), "data": grain_checkpoint.CheckpointHandler()})


def train(cfg: Config, out: str) -> str:
    config = dataclasses.asdict(cfg)
    loop, manager = make(config), checkpoint_manager(Path(out) / "checkpoints", cfg)
    run = replay.init(out, config=config, entrypoint=make, store_examples=True, checkpoints=manager)  # replay
    step = run.step(batch_axis=0, metric_kinds=METRIC_KINDS)(loop.step)  # replay
    state, batches = loop.init(), loop.data()
    for k in range(cfg.steps):
        if manager.should_save(k):  # the loop's own policy; run.save saves through its manager, once
            run.save(k, state, data=batches)  # replay
        state, metrics = step(state, next(batches))
        if k % 5 == 4 or k == cfg.steps - 1:
            print(f"step {k:5d}  loss {float(metrics['loss']):.5f}")
    run.save(cfg.steps, state, data=batches)  # replay
    run.finish()  # replay
    manager.close()
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="the run directory to create")
    parser.add_argument("--steps", type=int, default=Config.steps)
    parser.add_argument("--seed", type=int, default=Config.seed)
    parser.add_argument("--checkpoint-every", type=int, default=Config.checkpoint_every)
    parser.add_argument("--lr-bump-at", type=int, default=-1,
                        help="inject a bug: double the learning rate of the update applied at this step (or the next)")
    parser.add_argument("--refeed-at", type=int, default=-1, help="inject a bug: feed this step the batch of 5 steps before")
    args = parser.parse_args()
    cfg = Config(seed=args.seed, steps=args.steps, checkpoint_every=args.checkpoint_every, lr_bump_at=args.lr_bump_at,
                 refeed_at=args.refeed_at)
    path = train(cfg, args.out)
    print(f"recorded {args.steps} steps in {path}; verify them with: replay run {path} --steps 0:{args.steps - 1}")
