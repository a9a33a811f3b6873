"""A plain JAX + optax training loop of its own that records a trace `replay run` can verify.

    python examples/optax_loop.py --out /tmp/mlp --steps 30   # train, checkpoint every 10, record
    replay run /tmp/mlp --steps 12:25                         # restore checkpoint 10, re-run 10..25, compare bits
    replay run /tmp/mlp --steps 17 --json                     # one step, the report as JSON
    replay show /tmp/mlp                                      # what was recorded

`replay run` exits 0 when every replayed step is bit-identical to the trace (RNG key words,
per-example data hashes, metric bits, and the 64-bit fingerprint of every recorded tensor),
1 when a step diverges (the report names the first step and the first field or layer, in
causal order: data, rng, state, forward, loss, backward, update), 2 for bad input.

To make your own loop replayable, do what this file does:

1. Inputs are pure functions of the step. The batch of step k comes from (seed, k) alone
   (`batch_at`), never from an iterator's position; the RNG key of step k is
   fold_in(base_key, k) with the base key's raw words kept in the train state.
2. The jitted step returns a metrics dict holding the schema's scalar metrics by name,
   "rng" (uint32[2], the step key's words), "example_loss" (float32[batch], for
   example_metrics=("loss",)), and for layer-level records "fingerprints" (uint32[T, 2]:
   trainer.fingerprint.fingerprint_lanes of each schema tensor, in schema order) and "rms"
   (float32[T]). Fingerprints only read bits the step computes anyway.
3. Record: traces.Run.create(out, schema, manifest), with the manifest naming your factory
   ("replayable": "module:function") and the folder to import it from ("replayable_path",
   absolute or relative to the run directory); then Recorder.record(step, metrics,
   example_hashes) every step, and run.finish().
4. Save orbax checkpoints in RUN/checkpoints; checkpoint k is the state *before* step k.
   (Orbax, not .npz: `replay run` lists a run's checkpoint steps with orbax before it
   imports your code, and orbax is what JAX loops use anyway.)
5. The factory `function(run, data=None, allow_data_change=False, on_compile=None)` returns
   an object with: schema, environment(), program_hash(), checkpoint_steps(),
   restore(step) -> state, step(state, step) -> (state, metrics, example_hashes).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import xxhash

from traces import Run, Schema
from trainer.environment import environment, program_hash
from trainer.fingerprint import fingerprint_lanes
from trainer.recorder import Recorder

HERE = Path(__file__).resolve().parent


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

    @classmethod
    def from_dict(cls, d: dict) -> "Config":
        return cls(**{**d, "hidden": tuple(d["hidden"])})


class State(NamedTuple):
    step: jax.Array  # int32: the next step to run
    params: dict  # {"dense_0": {"w", "b"}, ..., "out": {"w", "b"}}
    opt_state: Any
    key: jax.Array  # uint32[2]: raw words of the dropout base key (raw, so orbax stores them as is)


def layer_names(cfg: Config) -> list[str]:
    return [f"dense_{i}" for i in range(len(cfg.hidden))] + ["out"]


def param_names(cfg: Config) -> list[str]:
    return [f"{layer}/{p}" for layer in layer_names(cfg) for p in ("w", "b")]


def get(params: dict, name: str) -> jax.Array:
    layer, p = name.split("/")
    return params[layer][p]


def make_schema(cfg: Config) -> Schema:
    """What a record holds. Tensors are named in causal order, execution order within a kind."""
    names = param_names(cfg)
    tensors = ([(f"state/{n}", "state") for n in names] + [(n, "forward") for n in layer_names(cfg)]
               + [(f"grad/{n}", "backward") for n in reversed(names)] + [(f"param/{n}", "update") for n in names])
    return Schema(examples_per_step=cfg.batch, rng_words=2,
                  metrics=(("loss", "loss"), ("grad_norm", "backward"), ("lr", "update")),
                  tensors=tuple(tensors), example_metrics=("loss",))


# Data: exact arithmetic (small integers scaled by powers of two), so a batch's bytes cannot
# depend on the CPU's BLAS or SIMD width: the same (seed, step) gives the same bytes anywhere.
def batch_at(cfg: Config, step: int) -> tuple[dict, np.ndarray]:
    """The batch of `step`, a pure function of (seed, step), and its per-example hashes."""
    teacher = np.random.default_rng([cfg.seed, 1])
    w1, w2 = teacher.integers(-3, 4, (cfg.d_in, 8)), teacher.integers(-3, 4, (8, 1))  # a fixed integer "teacher"
    rng = np.random.default_rng([cfg.seed, 2, step])
    x = rng.integers(-8, 9, (cfg.batch, cfg.d_in))
    y = np.abs(x @ w1) @ w2 + rng.integers(-4, 5, (cfg.batch, 1))  # int64: exact
    batch = {"x": (x / 4).astype(np.float32), "y": (y / 256).astype(np.float32)}
    return batch, example_hashes(batch["x"], batch["y"])


def example_hashes(*arrays: np.ndarray) -> np.ndarray:
    """xxh3_64 of each example's bytes; dtypes and row shapes seed the hash (bytes alone are ambiguous)."""
    seed = xxhash.xxh3_64_intdigest(repr([(a.dtype.name, a.shape[1:]) for a in arrays]).encode())
    return np.array([xxhash.xxh3_64_intdigest(b"".join(a[i].tobytes() for a in arrays), seed=seed)
                     for i in range(len(arrays[0]))], np.uint64)


# Model, optimizer and the train step.
def schedule(cfg: Config) -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(0.0, cfg.lr, cfg.warmup, max(cfg.steps, cfg.warmup + 1))


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


def forward(cfg: Config, params: dict, x: jax.Array, key: jax.Array) -> tuple[jax.Array, dict]:
    acts, h = {}, x
    for i, name in enumerate(layer_names(cfg)[:-1]):
        h = jax.nn.gelu(h @ params[name]["w"] + params[name]["b"])
        keep = jax.random.bernoulli(jax.random.fold_in(key, i), 1.0 - cfg.dropout, h.shape)
        acts[name] = h = jnp.where(keep, h / (1.0 - cfg.dropout), 0.0)
    acts["out"] = out = h @ params["out"]["w"] + params["out"]["b"]
    return out, acts


def rms(x: jax.Array) -> jax.Array:
    return jnp.sqrt(jnp.mean(jnp.square(x.astype(jnp.float32))))


def train_step(state: State, batch: dict, cfg: Config) -> tuple[State, dict]:
    key = jax.random.fold_in(jax.random.wrap_key_data(state.key, impl="threefry2x32"), state.step)

    def loss_fn(params):
        pred, acts = forward(cfg, params, batch["x"], key)
        example_loss = jnp.mean(jnp.square(pred - batch["y"]), axis=-1)
        return jnp.mean(example_loss), (example_loss, acts)

    (loss, (example_loss, acts)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    updates, opt_state = optimizer(cfg).update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    names = param_names(cfg)
    tensors = ([get(state.params, n) for n in names] + [acts[n] for n in layer_names(cfg)]
               + [get(grads, n) for n in reversed(names)] + [get(params, n) for n in names])  # = make_schema order
    metrics = {
        "loss": loss, "grad_norm": optax.tree.norm(grads), "lr": jnp.asarray(schedule(cfg)(state.step), jnp.float32),
        "example_loss": example_loss, "rng": jax.random.key_data(key).reshape(-1),
        "fingerprints": jnp.stack([fingerprint_lanes(t) for t in tensors]), "rms": jnp.stack([rms(t) for t in tensors]),
    }
    return State(state.step + 1, params, opt_state, state.key), metrics


def abstract_state(cfg: Config) -> State:
    """The state's shapes and dtypes on this machine's first device: the orbax restore target."""
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device),
                        jax.eval_shape(functools.partial(init_state, cfg)))


def compile_step(cfg: Config):
    """The compiled step and the hash of its lowered program (replay checks it is the same program)."""
    batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), batch_at(cfg, 0)[0])
    lowered = jax.jit(functools.partial(train_step, cfg=cfg)).lower(abstract_state(cfg), batch)
    return lowered.compile(), program_hash(lowered)


def checkpoints(run: Run, read_only: bool) -> ocp.CheckpointManager:
    if not read_only:
        return ocp.CheckpointManager(run.checkpoint_dir, options=ocp.CheckpointManagerOptions(
            enable_async_checkpointing=False))
    # Replay must change nothing in the run directory. (Orbax logs that read-only is read-only.)
    options = ocp.CheckpointManagerOptions(read_only=True, create=False, save_interval_steps=0,
                                           save_root_metadata=False, cleanup_tmp_directories=False)
    absl, level = logging.getLogger("absl"), logging.getLogger("absl").level
    absl.setLevel(logging.ERROR)
    try:
        return ocp.CheckpointManager(run.checkpoint_dir, options=options)
    finally:
        absl.setLevel(level)


def train(cfg: Config, out: str | Path) -> Path:
    schema = make_schema(cfg)
    step_fn, phash = compile_step(cfg)
    manifest = {"config": dataclasses.asdict(cfg), "environment": environment(), "program_hash": phash,
                "replayable": "optax_loop:replayable", "replayable_path": str(HERE)}
    run = Run.create(out, schema, manifest)
    recorder = Recorder(schema, run.writer(), "layer")
    ckpt = checkpoints(run, read_only=False)
    state = init_state(cfg)
    for step in range(cfg.steps):
        if step % cfg.checkpoint_every == 0:
            ckpt.save(step, args=ocp.args.StandardSave(state))
        batch, hashes = batch_at(cfg, step)
        state, metrics = step_fn(state, batch)
        recorder.record(step, metrics, hashes)  # fetched to the host one step later
        if step % 5 == 4 or step == cfg.steps - 1:
            print(f"step {step:5d}  loss {float(metrics['loss']):.5f}")
    ckpt.save(cfg.steps, args=ocp.args.StandardSave(state))
    recorder.flush()
    ckpt.close()
    run.update_manifest(checkpoints=sorted(ckpt.all_steps()))
    run.finish()
    return Path(out)


class OptaxLoopReplay:
    """The replay protocol (trainer/replayable.py) for runs of this loop."""

    def __init__(self, run: Run, data: str | None = None, allow_data_change: bool = False, on_compile=None):
        if data is not None:
            from trainer.config import ConfigError

            raise ConfigError(f"{run.path}: this loop generates its data from its seed; --data does not apply")
        self.cfg = Config.from_dict(run.manifest["config"])
        self.schema = make_schema(self.cfg)
        if on_compile is not None:
            on_compile()
        self._step, self._program_hash = compile_step(self.cfg)
        self._ckpt = checkpoints(run, read_only=True)

    def environment(self) -> dict:
        return environment()

    def program_hash(self) -> str:
        return self._program_hash

    def checkpoint_steps(self) -> list[int]:
        return sorted(self._ckpt.all_steps())

    def restore(self, step: int) -> State:
        return self._ckpt.restore(step, args=ocp.args.StandardRestore(abstract_state(self.cfg)))

    def step(self, state: State, step: int) -> tuple[State, dict, np.ndarray]:
        batch, hashes = batch_at(self.cfg, step)
        state, metrics = self._step(state, batch)
        return state, metrics, hashes


def replayable(run: Run, data: str | None = None, allow_data_change: bool = False, on_compile=None) -> OptaxLoopReplay:
    return OptaxLoopReplay(run, data=data, allow_data_change=allow_data_change, on_compile=on_compile)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="the run directory to create")
    parser.add_argument("--steps", type=int, default=Config.steps)
    parser.add_argument("--seed", type=int, default=Config.seed)
    parser.add_argument("--checkpoint-every", type=int, default=Config.checkpoint_every)
    args = parser.parse_args()
    path = train(Config(seed=args.seed, steps=args.steps, checkpoint_every=args.checkpoint_every), args.out)
    print(f"recorded {args.steps} steps in {path}; verify them with: replay run {path} --steps 0:{args.steps - 1}")
