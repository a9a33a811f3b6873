"""The noise floor: how far two runs drift apart from rounding alone, to judge a real divergence.

Bits are not expected to match across backends, or across device counts outside
mesh-invariant mode (reduction order changes). To tell rounding noise from a real
difference, run A is replayed here from a checkpoint with every parameter nudged by one ULP,
and the relative distance of each recorded quantity (loss and the other metrics, every
layer's forward, gradient and parameter RMS) between that replay and A's own trace is the
floor: what one ULP of disagreement grows into, step by step (the largest distance each
field has reached so far, since rounding noise only grows). Every recorded quantity is itself
a float32 sum over many elements (an RMS, a norm, a mean loss) whose rounding depends on the
summation order, so no floor is below RESOLUTION (relative; sqrt(n) * eps32 for the ~10^5
elements of a typical tensor). A tensor whose fingerprints are equal in both runs is
identical, whatever its RMS values say. A difference between A and B is "above the noise
floor" where it exceeds the floor by `factor` (default 20); the first such (step, field) in
causal order is reported, or that there is none.

Measured (tiny preset, two blocks, 20 steps, when this was written): the same run on 1 and 8
devices stays below 0.5x the floor; with one block in bfloat16 from step 10, step 10 and that
block's attention output are flagged at ~170x. tests/replay/test_noise.py now asserts the same
on tiny with one block over 12 steps: below a quarter of the factor, and above twice it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from traces import CAUSAL_KINDS, Run

RESOLUTION = 1e-5  # no floor is finer than the rounding of a float32 sum over ~10^5 elements
DEFAULT_FACTOR = 20.0


@dataclass
class NoiseVerdict:
    above: bool  # some recorded quantity differs by more than factor x the floor
    first_step: int | None  # first step where it does
    field: str | None  # the field (metric or tensor) that does, first in causal order
    kind: str | None  # its causal kind
    ratio: float | None  # distance / floor there
    distance: float | None  # relative distance between A and B there
    floor: float | None  # the floor there
    factor: float
    steps: tuple[int, int]  # the steps compared
    replays: int  # replays the floor took
    max_ratio_below: float = 0.0  # the largest ratio seen where nothing was above
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in ("above", "first_step", "field", "kind", "ratio", "distance", "floor",
                                                "factor", "replays", "max_ratio_below", "notes")} | {"steps": list(self.steps)}


def _fields(run: Run) -> list[tuple[str, str, str, int]]:
    """(name, kind, source, index) of every comparable quantity, in causal order."""
    out = [(name, kind, "metric", i) for i, (name, kind) in enumerate(run.schema.metrics)]
    out += [(name, kind, "rms", i) for i, (name, kind) in enumerate(run.schema.tensors)]
    return sorted(out, key=lambda f: CAUSAL_KINDS.index(f[1]))


def _values(run: Run, step: int, fields) -> np.ndarray:
    rec = run.trace.read(step)
    return _values_of(rec.metrics, rec.rms, fields)


def _values_of(metrics, rms, fields) -> np.ndarray:
    vals = []
    for _, _, source, i in fields:
        if source == "metric":
            vals.append(float(metrics[i]))
        else:
            vals.append(float(rms[i]) if rms is not None else np.nan)
    return np.array(vals, np.float64)


def relative(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    scale = np.maximum(np.abs(a), np.abs(b))
    with np.errstate(invalid="ignore", divide="ignore"):
        d = np.where(scale > 0, np.abs(a - b) / scale, 0.0)
    return d


def floor_by_replay(run: Run, start: int, stop: int, replayable=None) -> tuple[dict[int, np.ndarray], int]:
    """Relative distances, per step in [checkpoint, stop), between A's trace and a replay of A
    whose parameters were nudged by one ULP at the checkpoint at or before `start`. `replayable`:
    A's (default: the one its manifest names, replay.engine.replayer.open_replayable)."""
    from replay.engine.replayer import open_replayable

    rep = replayable or open_replayable(run)
    fields = _fields(run)
    ckpt = max(c for c in rep.checkpoint_steps() if c <= start)
    state = _nudged(rep.restore(ckpt))
    floors: dict[int, np.ndarray] = {}
    envelope = np.zeros(len(fields))
    for step in range(ckpt, stop):
        state, metrics, _ = rep.step(state, step)
        m = jax.device_get(metrics)
        names = run.schema.metric_names
        replayed = _values_of(np.array([m[n] for n in names], np.float32), m.get("rms"), fields)
        # Rounding noise only grows: the floor of a field is the largest distance it has reached.
        envelope = np.fmax(envelope, relative(_values(run, step, fields), replayed))
        floors[step] = envelope.copy()
    return floors, 1


def _nudged(state):
    """`state` with every floating-point parameter one ULP up: its `params` when it is a state
    with named parameters (a NamedTuple with .params, as the trainer's and optax-style loops keep
    it), else every floating-point array leaf of the state (the loop names no parameters)."""
    def up(x):
        if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating):
            return jnp.nextafter(x, jnp.full_like(x, jnp.inf))
        return x

    if hasattr(state, "params") and hasattr(state, "_replace"):
        return state._replace(params=jax.tree.map(up, state.params))
    return jax.tree.map(up, state)


def judge(run_a: Run, run_b: Run, start: int, stop: int, factor: float = DEFAULT_FACTOR,
          floors: dict[int, np.ndarray] | None = None, replays: int = 0) -> NoiseVerdict:
    """Compares A and B over [start, stop) against the floor; both traces must record the same fields."""
    if floors is None:
        floors, replays = floor_by_replay(run_a, start, stop)
    fields = _fields(run_a)
    b_fields = {(n, s): i for n, _, s, i in _fields(run_b)}
    usable = np.array([(n, s) in b_fields for n, _, s, _ in fields])
    worst = 0.0
    for step in range(start, stop):
        ra, rb = run_a.trace.read(step), run_b.trace.read(step)
        dist = relative(_values_of(ra.metrics, ra.rms, fields), _values_of(rb.metrics, rb.rms, fields))
        if ra.fingerprints is not None and rb.fingerprints is not None and run_a.schema.tensors == run_b.schema.tensors:
            same = np.array([src == "rms" and ra.fingerprints[i] == rb.fingerprints[i] for _, _, src, i in fields])
            dist = np.where(same, 0.0, dist)  # equal fingerprints: the tensors are bit-identical
        fl = np.maximum(floors[step], RESOLUTION)
        ratio = np.where(usable & ~np.isnan(dist), dist / fl, 0.0)
        hits = np.flatnonzero(ratio > factor)
        if hits.size:
            i = int(hits[0])
            name, kind, _, _ = fields[i]
            return NoiseVerdict(True, step, name, kind, float(ratio[i]), float(dist[i]), float(fl[i]), factor,
                                (start, stop), replays, worst)
        worst = max(worst, float(np.max(ratio)) if ratio.size else 0.0)
    return NoiseVerdict(False, None, None, None, None, None, None, factor, (start, stop), replays, worst)
