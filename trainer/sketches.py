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

Cost: one more pass over every recorded tensor (and the state) each layer-level step, 260 bytes
a tensor a record, O(1) in the run's length: at a million steps and 100 tensors, 26 GB of trace
(record at the layer level's cadence, trace.layer_every). `python -m bench.step_sketches`,
2 shared CPU cores at load 8-11, 2026-12-01: tiny preset +2.0 ms CPU on a 9.7 ms step (21%;
6% by wall), demo preset +2.1% CPU / +2.4% wall on a 0.31 s step. Off by default: on small
models it is far over the layer level's 3% budget. The sums are a float32 scatter-add
(replay/record/fingerprint.py): bit-reproducible on CPU; not checked on GPU, where XLA's
scatter-add may use atomics (a resume's re-recorded records must match bit for bit).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from replay.record.fingerprint import sketch_and_norm
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


def _tree_sketch(leaves: list[jax.Array], w: int) -> tuple[jax.Array, jax.Array]:
    if not leaves:
        return jnp.zeros((w,), jnp.float32), jnp.zeros((), jnp.float32)
    pairs = [sketch_and_norm(x, w) for x in leaves]
    total = pairs[0][0]
    for s, _ in pairs[1:]:
        total = total + s
    return total, jnp.sqrt(sum(jnp.square(n) for _, n in pairs))


def of_state(cfg: Any, param_leaves: list[jax.Array], opt_leaves: list[jax.Array]) -> StateSketch | None:
    """The sketches of `state/params` (leaves in model.param_names order) and `state/opt_state`
    (jax.tree.leaves order) entering the step; None without trace.sketches."""
    w = width(cfg)
    if not w:
        return None
    check(cfg)
    (sp, np_), (so, no) = _tree_sketch(param_leaves, w), _tree_sketch(opt_leaves, w)
    return jnp.stack([sp, so]), jnp.stack([np_, no])


def never(state_sketch: StateSketch | None) -> jax.Array | bool:
    """False, computed from every state sketch value: OR it into the predicate the update's scalar
    hyperparameters are selected on, so the sketches are read before the in-place update.
    A sum of squares is never < 0 (NaN compares False), so the training results keep their bits."""
    if state_sketch is None:
        return False
    sketches, norms = state_sketch
    return (jnp.sum(jnp.square(sketches)) + jnp.sum(norms)) < 0


def assemble(state_sketch: StateSketch | None, tensors: list[jax.Array]) -> dict[str, jax.Array]:
    """{"sketches": float32[T, W], "norms": float32[T]} for the record, in schema order: the state's
    two, then `tensors` (the forward layers, gradients and parameters after the update, as the
    step fingerprints them); {} without trace.sketches (state_sketch None)."""
    if state_sketch is None:
        return {}
    w = state_sketch[0].shape[-1]
    pairs = [sketch_and_norm(x, w) for x in tensors]
    sketches, norms = [state_sketch[0]], [state_sketch[1]]
    if pairs:
        sketches.append(jnp.stack([s for s, _ in pairs]))
        norms.append(jnp.stack([n for _, n in pairs]))
    return {"sketches": jnp.concatenate(sketches), "norms": jnp.concatenate(norms)}
