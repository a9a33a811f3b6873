"""The train step: `train_step(state, batch) -> (state, metrics)`, a pure function.

`compile_step` is the one place it is jitted. What a step records depends on the level:

    off    the training outputs only (loss, for the progress bar)
    step   + loss, z-loss, grad norm, lr, param norm, per-example loss, the step's RNG key words
    layer  + a 64-bit fingerprint and the RMS of: the parameters and optimizer state entering
           the step (state), every layer's forward output (forward, execution order), every
           gradient leaf (backward, in the order backprop computes them: last layer first),
           every parameter leaf after the update (update, execution order)

With optimizer.microbatches = M > 1 the gradient is accumulated over M sequential microbatches
(`_accumulated_grads`); the records are the same fields, in global example order.

Fingerprints only read the bits of tensors the step computes anyway; training results are
identical at every level (tested), so recording can be switched on for any run. With
trace.packed_record (the default; not in runs recorded before it) the step and layer levels return
their metrics as ONE uint32 vector, a `PackedRecord` (replay/record/packed.py, as run.step's records)
that reads like the dict it packs (`metrics["loss"]`, `"fingerprints" in metrics`) and that the
recorder slices instead of copying 7-11 arrays.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from trainer import chunked_loss, invariant, layers, model, optim, rng, sdc, sketches, tree_sums
from trainer.config import Config, ConfigError
from trainer.constants import BATCH_AXES, TRACE_LEVELS
from replay.record.fingerprint import fingerprint_lanes, fingerprints_and_sums_of_squares
from replay.record.names import get_path  # noqa: F401 - trainer.step.get_path: the recorded names' lookup
from replay.record.packed import pack
from trainer.optim import applied_lr
from trainer import hf_checkpoint

# (name, causal kind) of the scalar metrics, in the order a record stores them.
METRICS = (("loss", "loss"), ("z_loss", "loss"), ("grad_norm", "backward"), ("lr", "update"), ("param_norm", "update"))


class TrainState(NamedTuple):
    step: jax.Array  # int32 scalar: steps taken so far; the next step is this one
    params: Any  # model parameters (nested dict, see trainer/model.py)
    opt_state: Any  # optax AdamW state
    key: jax.Array  # uint32[2]: raw words of the dropout base key (raw, so checkpoints store it as is)


def init_state(cfg: Config) -> TrainState:
    """The state before step 0: a pure function of the config (and so of the root seed), and of
    the checkpoint model.init_from names when it is set (its weights; the rest starts fresh)."""
    params = model.init_params(cfg.model, rng.init_key(cfg.seed)) if not cfg.model.init_from \
        else _checkpoint_params(cfg)
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=optim.make_optimizer(cfg.optimizer).init(params),
        key=jax.random.key_data(rng.dropout_key(cfg.seed)),
    )


def _checkpoint_params(cfg: Config) -> Any:
    return jax.tree.map(jnp.asarray, hf_checkpoint.initial_params(cfg.model))


def tensor_schema(cfg: Config) -> tuple[tuple[str, str], ...]:
    """(name, kind) of every tensor a layer-level record fingerprints, in causal order."""
    names = model.param_names(cfg.model)
    return (
        (("state/params", "state"), ("state/opt_state", "state"))
        + tuple((name, "forward") for name in model.layer_names(cfg.model))
        + tuple((f"grad/{name}", "backward") for name in reversed(names))
        + tuple((f"param/{name}", "update") for name in names)
        + sdc.extra_tensors(cfg, "layer")  # empty unless mesh-invariant with check.replicas / rerun_every
    )


def _summaries(xs: list[jax.Array]) -> tuple[jax.Array, jax.Array]:
    """uint32[T, 2] fingerprint lanes and float32[T] RMS of T tensors, one pass over each."""
    lanes, sum_sq = fingerprints_and_sums_of_squares(xs)
    return lanes, jnp.sqrt(sum_sq / jnp.asarray([x.size for x in xs], jnp.float32))


def _tree_summary(leaves: list[jax.Array]) -> tuple[jax.Array, jax.Array]:
    """uint32[1, 2] fingerprint lanes and float32[1] RMS of a pytree's leaves taken together.

    The pytree's fingerprint is the fingerprint of its leaves' lanes stacked in order, so the
    numpy reference can recompute it from per-leaf fingerprints; its RMS is over all elements.
    """
    lanes, sum_sq = fingerprints_and_sums_of_squares(leaves)
    # float: a 1B model has more than 2^31 elements, which JAX refuses as an int argument
    return fingerprint_lanes(lanes)[None], jnp.sqrt(jnp.sum(sum_sq) / float(sum(x.size for x in leaves)))[None]


def loss_fn(params: Any, cfg: Config, inputs_BxL: jax.Array, targets_BxL: jax.Array, key: jax.Array | None,
            capture: bool, *, fixed_backward: bool = False, batch_sharding: Any = None) -> tuple[jax.Array, dict]:
    """Mean next-token cross-entropy (+ z-loss); aux holds per-example loss and captured layers.
    fixed_backward, batch_sharding: as model.apply's."""
    dropout_key = key if cfg.model.dropout > 0 else None
    chunk = cfg.model.loss_chunk
    out = model.apply(cfg.model, params, inputs_BxL, dropout_key=dropout_key, capture=capture, head=not chunk,
                      fixed_backward=fixed_backward, batch_sharding=batch_sharding)
    logits_BxLxV, layers = out if capture else (out, {})
    if chunk:  # the head in chunks of positions: the whole logits never live (trainer/chunked_loss.py)
        hidden_BxLxD = logits_BxLxV
        logz_BxL, target_logit_BxL = chunked_loss.head_loss(cfg.model, params, hidden_BxLxD, targets_BxL, chunk)
        if capture:  # the record's logits, the head's bits, computed beside the gradient, not through it
            layers = {**layers, "logits": jax.lax.stop_gradient(chunked_loss.head_logits(cfg.model, params,
                                                                                         hidden_BxLxD))}
    else:
        # Fixed-order sums (model.tree_sum) over the vocabulary and the sequence keep each
        # example's loss bits independent of how many examples a device holds.
        logz_BxL = model.logsumexp(logits_BxLxV)[..., 0]
        target_logit_BxL = jnp.take_along_axis(logits_BxLxV, targets_BxL[..., None], axis=-1)[..., 0]
    ce_B = model.tree_sum(logz_BxL - target_logit_BxL)[..., 0] / targets_BxL.shape[-1]
    z_loss = cfg.optimizer.z_loss * jnp.mean(jnp.square(logz_BxL))
    loss = jnp.mean(ce_B)
    return loss + z_loss, {"loss": loss, "z_loss": z_loss, "example_loss": ce_B, "layers": layers}


def _accumulated_grads(params: Any, cfg: Config, batch: dict, step_key: jax.Array, capture: bool,
                       sharding: Any) -> tuple[dict, Any]:
    """Gradient accumulation (optimizer.microbatches = M): the mean of M microbatches' gradients,
    summed in order by a lax.scan, so activations live for B / M examples at a time.

    Microbatch m holds examples m, m + M, m + 2M, ...: a device's contiguous share of the batch
    holds an equal share of every microbatch, so the split moves no data between devices. Its
    dropout key is the step key folded with m. aux comes back in global example order."""
    M = cfg.optimizer.microbatches
    B = batch["inputs"].shape[0]
    if B % M:
        raise ConfigError(f"optimizer.microbatches={M} needs a global batch divisible by it, not {B}")

    def split(x: jax.Array) -> jax.Array:  # [B, ...] -> [M, B / M, ...]
        return jnp.swapaxes(x.reshape((B // M, M) + x.shape[1:]), 0, 1)

    def merge(x: jax.Array) -> jax.Array:  # [M, B / M, ...] -> [B, ...]
        return jnp.swapaxes(x, 0, 1).reshape((B,) + x.shape[2:])

    def body(acc: Any, xs: tuple) -> tuple[Any, dict]:
        inputs, targets, m = xs
        inputs, targets = layers.constrain_batch(inputs, sharding), layers.constrain_batch(targets, sharding)
        key = jax.random.fold_in(step_key, m.astype(jnp.uint32))
        (_, aux), g = jax.value_and_grad(functools.partial(loss_fn, batch_sharding=sharding), has_aux=True)(
            params, cfg, inputs, targets, key, capture)
        return jax.tree.map(jnp.add, acc, g), aux

    zeros = jax.tree.map(jnp.zeros_like, params)
    grads, aux_M = jax.lax.scan(body, zeros, (split(batch["inputs"]), split(batch["targets"]), jnp.arange(M)))
    aux = {"loss": jnp.mean(aux_M["loss"]), "z_loss": jnp.mean(aux_M["z_loss"]),
           "example_loss": merge(aux_M["example_loss"]),
           "layers": {name: merge(x) for name, x in aux_M["layers"].items()}}
    return aux, jax.tree.map(lambda g: g / M, grads)


def train_step(state: TrainState, batch: dict, *, cfg: Config, level: str = "step",
               mesh: Any = None, fixed_backward: bool = True) -> tuple[TrainState, dict]:
    """One optimizer step on `batch` ({"inputs": int32[B, L], "targets": int32[B, L]}).
    `mesh`: the batch's mesh (mesh-invariant mode's reduction, the scanned blocks' batch sharding).
    `fixed_backward`: mesh-invariant mode's fixed-order backward passes (trainer/model.py); False
    only to measure what they buy (autodiff's inside the same microbatch scheme)."""
    step_key = rng.step_key(jax.random.wrap_key_data(state.key, impl="threefry2x32"), state.step)
    if cfg.mesh.mesh_invariant:  # --- mesh-invariant mode: fixed-order microbatched gradients
        if cfg.optimizer.microbatches > 1:
            raise ConfigError("optimizer.microbatches does not apply in mesh-invariant mode; its microbatches are "
                              "mesh.n_microbatches: leave optimizer.microbatches=1")

        (_, aux), grads = invariant.value_and_grad(state.params, cfg, batch, step_key, level == "layer", mesh,
                                                   step=state.step if level == "layer" else None,
                                                   fixed_backward=fixed_backward)
    else:
        # Loops (the scan over layers, gradient accumulation) keep the batch axis sharded inside.
        sharding = None if mesh is None else NamedSharding(mesh, PartitionSpec(BATCH_AXES))
        if cfg.optimizer.microbatches > 1:
            aux, grads = _accumulated_grads(state.params, cfg, batch, step_key, level == "layer", sharding)
        else:
            grad_fn = jax.value_and_grad(functools.partial(loss_fn, batch_sharding=sharding), has_aux=True)
            (_, aux), grads = grad_fn(state.params, cfg, batch["inputs"], batch["targets"], step_key,
                                      level == "layer")
    opt_in = state.opt_state
    if level == "layer":
        # Summarise the state entering the step before the update overwrites it in place.
        names = model.param_names(cfg.model)
        state_summaries = [_tree_summary([get_path(state.params, n) for n in names]),
                           _tree_summary(jax.tree.leaves(state.opt_state))]
        # trace.sketches: the state's distance sketches, read before the update like its summaries (None when off)
        state_sketch = sketches.of_state(cfg, [get_path(state.params, n) for n in names], jax.tree.leaves(state.opt_state),
                                         (state_summaries[0][1], state_summaries[1][1]))
        # The update must depend on these reductions: otherwise XLA may schedule them after it
        # and so copies every donated parameter and moment before the step (the whole state,
        # every step; lax.optimization_barrier does not survive XLA:CPU's pipeline, and
        # tests/test_bench_overhead.py checks the copies stay gone). Every update kernel (params,
        # mu, nu) reads a scalar hyperparameter of the optimizer state, so passing those scalars
        # through a select on `never` orders the reductions first. A sum of squares is never < 0
        # (NaN compares False), so the selects return their inputs' bits. Only scalars are
        # touched: a select on an array changes the update kernels' code, and XLA:CPU then
        # rounds the update differently (measured: params no longer bit-identical to level off).
        never = (state_summaries[0][1][0] < 0) | (state_summaries[1][1][0] < 0) | sketches.never(state_sketch)
        if "check" in aux:
            # The same for the SDC re-run's cond (trainer/sdc.py), which reads the incoming params:
            # without this XLA copies every parameter into its operands on every step, re-run or
            # not (measured: ~1 ms a step on tiny at 8 devices). Its RMS is 0 or 1, never < 0.
            never = never | (aux["check"][1][0] < 0)
        opt_in = jax.tree.map(lambda x: jnp.where(never, jnp.zeros_like(x), x) if x.ndim == 0 else x, opt_in)
    # mesh-invariant: the gradient arrives as shards, with its fixed-order norm (trainer/invariant.py)
    grad_norm = aux["grad_norm"] if cfg.mesh.mesh_invariant else None
    updates, opt_state = optim.update(cfg.optimizer, grads, opt_in, state.params, grad_norm)
    params = optax.apply_updates(state.params, updates)
    new_state = TrainState(state.step + 1, params, opt_state, state.key)
    metrics = {"loss": aux["loss"]}
    if level == "off":
        return new_state, metrics
    metrics.update(
        z_loss=aux["z_loss"],
        grad_norm=optax.tree.norm(grads) if grad_norm is None else grad_norm,
        lr=jnp.asarray(applied_lr(opt_state), jnp.float32),
        # mesh-invariant: a fixed-order norm from row shards, as grad_norm's (an XLA reduce's order follows the layout)
        param_norm=optax.tree.norm(params) if grad_norm is None else tree_sums.sharded_norm(
            params, invariant.mesh_or_one_device(mesh)),
        example_loss=aux["example_loss"],
        rng=rng.key_words(step_key),
    )
    if level == "layer":
        # One fused reduction per tensor yields both its fingerprint and its sum of squares.
        updated = [get_path(params, n) for n in names]
        if grad_norm is not None and mesh is not None:
            # mesh-invariant: the update ran on the gradient's shards; its RMS (an XLA reduce) is
            # taken whole, as on one device, so that the records' bits do not follow the layout
            whole = NamedSharding(mesh, PartitionSpec())
            updated = [jax.lax.with_sharding_constraint(x, whole) for x in updated]
        tensors = ([aux["layers"][n] for n in model.layer_names(cfg.model)]
                   + [get_path(grads, n) for n in reversed(names)] + updated)
        lanes, rms = _summaries(tensors)
        if grad_norm is not None:
            # mesh-invariant: the gradient is sharded and XLA's sum of squares over shards follows
            # the layout; its fixed-order sums (trainer/tree_sums.py) give the same RMS on every count
            grad_ss = jnp.stack([get_path(aux["grad_sums_of_squares"], n) for n in reversed(names)])
            sizes = jnp.asarray([get_path(grads, n).size for n in reversed(names)], jnp.float32)
            first = len(model.layer_names(cfg.model))
            rms = rms.at[first:first + len(names)].set(jnp.sqrt(grad_ss / sizes))
        # the SDC checks' per-microbatch summaries (trainer/sdc.py), present only when configured
        parts = state_summaries + [(lanes, rms)] + [aux[k] for k in ("replicas", "check") if k in aux]
        metrics["fingerprints"] = jnp.concatenate([lanes for lanes, _ in parts])
        metrics["rms"] = jnp.concatenate([rms for _, rms in parts])
        metrics.update(sketches.assemble(state_sketch, tensors, rms))  # "sketches", "norms" with trace.sketches
    return new_state, pack(metrics) if cfg.trace.packed_record else metrics


def compile_step(cfg: Config, level: str, state_sharding: Any = None, batch_sharding: Any = None, *,
                 fixed_backward: bool = True):
    """The jitted train step (the one place it is jitted). Shardings None = let jit decide.
    `fixed_backward`: as train_step's; every argument is in the key, so no setting outside them
    changes what a kept program computes.

    The same arguments give the same jitted function, so a process that builds the step again
    (a replay after a training run, bisect's two runs and its windows, a resume) reuses the
    program traced and compiled the first time instead of tracing, lowering and compiling it again
    (~4 s of CPU for `tiny`'s step at level off, measured here). Up to `_STEPS_KEPT` programs are kept, each
    an executable's worth of memory; nothing grows with the run's length."""
    if level not in TRACE_LEVELS:
        raise ValueError(f"trace level {level!r} is not one of {TRACE_LEVELS}")
    leaves, treedef = jax.tree.flatten(state_sharding)
    try:
        key = (cfg, level, tuple(leaves), treedef, batch_sharding, fixed_backward)
        hash(key)
    except TypeError:  # a config or sharding that cannot be a key: built afresh
        return _jitted_step(cfg, level, state_sharding, batch_sharding, fixed_backward)
    return _kept_step(key)


_STEPS_KEPT = 8


@functools.lru_cache(maxsize=_STEPS_KEPT)
def _kept_step(key: tuple):
    cfg, level, leaves, treedef, batch_sharding, fixed_backward = key
    return _jitted_step(cfg, level, jax.tree.unflatten(treedef, leaves), batch_sharding, fixed_backward)


def _jitted_step(cfg: Config, level: str, state_sharding: Any, batch_sharding: Any, fixed_backward: bool = True):
    fn = functools.partial(train_step, cfg=cfg, level=level, fixed_backward=fixed_backward,
                           mesh=None if batch_sharding is None else batch_sharding.mesh)
    if state_sharding is None:
        return jax.jit(fn, donate_argnums=0)
    # Metrics come back replicated so that every process can read them whole (multi-host).
    replicated = jax.sharding.NamedSharding(batch_sharding.mesh, jax.sharding.PartitionSpec())
    return jax.jit(fn, in_shardings=(state_sharding, batch_sharding), out_shardings=(state_sharding, replicated),
                   donate_argnums=0)
