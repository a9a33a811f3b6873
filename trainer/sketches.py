"""Distance sketches of the trainer's layer-level tensors (`trace.sketches=true`, trace format 2).

With sketches, every layer-level record holds, beside each tensor's fingerprint and RMS, its
W-wide distance sketch and L2 norm (traces/sketch.py; W = traces.sketch.DEFAULT_WIDTH, the
width replay.torch records by default), so `replay bisect` measures the distance between two
runs' tensors from their traces alone: a JAX run against its PyTorch reference without
replaying the JAX run (replay/bisect/cross_distance.py, "traces").

The tensors are the record's own, in schema order (trainer/step.py `tensor_schema`):
`state/params` and `state/opt_state` (pytree summaries: the sum of the leaves' sketches, the
norm over all leaves, as replay.torch and traces/FORMAT.md define them), forward layers,
gradients, parameters after the update. The two state sketches read the state entering the
step, which the update overwrites in place (donation): `never` gives the step a predicate that
is never true but that XLA cannot prove false, so the update's scalar hyperparameters are passed
through it (as for the state fingerprints) and the sketch reductions are scheduled first.

Cost: 260 bytes a tensor a record, O(1) in the run's length: at a million steps and 100 tensors,
26 GB of trace (record at the layer level's cadence, trace.layer_every). Compute: each tensor's
signed rows and one scatter-add of them (replay/record/fingerprint.py `sketch_rows`: the signs and
row segments hashed once a call, one XOR permutation for its tensors; two calls a step, the
state's before the update and the other tensors' after it); the norms are the
fingerprint pass's RMS * sqrt(elements), no pass of their own. `python -m bench.step_sketches
--preset demo --rounds 30`, 2 shared CPU cores, 2026-12-06, 3 runs: +1.8% / +1.4% / +4.1% CPU
(the last at load ~2.9), +1.6% / +2.4% / +2.2% wall, on a ~0.21 s step (before: +3.5% / +3.75%
/ +3.4% CPU, per-tensor sign hashes and a norm pass). Off by default: over the ~1% that would
make it free beside the layer level's 3% budget. The sums are a float32 scatter-add:
bit-reproducible on CPU; not checked on GPU, where XLA's scatter-add may use atomics (a
resume's re-recorded records must match bit for bit).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from replay.record.fingerprint import norms_from_rms, sketch_rows
from traces.sketch import DEFAULT_WIDTH
from trainer.config import ConfigError

__all__ = ["assemble", "check", "never", "of_state", "width"]

StateSketch = tuple[jax.Array, jax.Array]  # float32[2, W] sketches, float32[2] norms (params, opt_state)


def width(cfg: Any) -> int:
    """The schema's sketch_width: DEFAULT_WIDTH with trace.sketches at the layer level, else 0."""
    return DEFAULT_WIDTH if cfg.trace.sketches and cfg.trace.level == "layer" else 0


def check(cfg: Any) -> None:
    """trace.sketches sketches the step's own tensors; the SDC checks' extra trace tensors are
    fingerprint words, not tensors with a distance: refuse the combination before anything runs."""
    from trainer import sdc

    if width(cfg) and sdc.extra_tensors(cfg, "layer"):
        raise ConfigError("trace.sketches=true does not apply with check.replicas or check.rerun_every (their "
                          "trace tensors are fingerprints, not tensors to measure): switch one of them off")


def of_state(cfg: Any, param_leaves: list[jax.Array], opt_leaves: list[jax.Array],
             rms: tuple[jax.Array, jax.Array]) -> StateSketch | None:
    """The sketches of `state/params` (leaves in model.param_names order) and `state/opt_state`
    (jax.tree.leaves order) entering the step; None without trace.sketches. `rms`: the two pytree
    summaries' float32[1] RMS (trainer/step.py `_tree_summary`), which give the norms."""
    w = width(cfg)
    if not w:
        return None
    check(cfg)
    rows = sketch_rows(list(param_leaves) + list(opt_leaves), w)  # one call: one sign table
    zero = jnp.zeros((w,), jnp.float32)
    sp = jnp.sum(rows[:len(param_leaves)], axis=0) if param_leaves else zero
    so = jnp.sum(rows[len(param_leaves):], axis=0) if opt_leaves else zero
    sizes = [float(sum(x.size for x in param_leaves)), float(sum(x.size for x in opt_leaves))]
    return jnp.stack([sp, so]), norms_from_rms(jnp.concatenate([rms[0].reshape(1), rms[1].reshape(1)]), sizes)


def never(state_sketch: StateSketch | None) -> jax.Array | bool:
    """False, computed from every state sketch value: OR it into the predicate the update's scalar
    hyperparameters are selected on, so the sketches are read before the in-place update.
    A sum of squares is never < 0 (NaN compares False), so the training results keep their bits."""
    if state_sketch is None:
        return False
    sketches, norms = state_sketch
    return (jnp.sum(jnp.square(sketches)) + jnp.sum(norms)) < 0


def assemble(state_sketch: StateSketch | None, tensors: list[jax.Array], rms: jax.Array) -> dict[str, jax.Array]:
    """{"sketches": float32[T, W], "norms": float32[T]} for the record, in schema order: the state's
    two, then `tensors` (the forward layers, gradients and parameters after the update, as the
    step fingerprints them); {} without trace.sketches (state_sketch None). `rms`: the float32 RMS
    the step recorded for `tensors` (its first len(tensors) rows), which give their norms."""
    if state_sketch is None:
        return {}
    w = state_sketch[0].shape[-1]
    sketches, norms = [state_sketch[0]], [state_sketch[1]]
    if tensors:
        sketches.append(sketch_rows(tensors, w))
        norms.append(norms_from_rms(rms[:len(tensors)], [x.size for x in tensors]))
    return {"sketches": jnp.concatenate(sketches), "norms": jnp.concatenate(norms)}
