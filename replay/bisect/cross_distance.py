"""Per-step, per-tensor relative distances between a torch run and a JAX run (cross-framework bisect).

Two sources, the first that applies:

- traces: both runs recorded distance sketches of one width (trace format_version 2): each
  tensor's distance is estimated from the two records alone (traces/sketch.py), no replay.
- replay: the JAX run has no sketches (recorded before format 2, or by a recorder that does
  not write them: the trainer writes them with trace.sketches=true): it is replayed here from
  its checkpoints through the steps examined, its tensors at those steps recomputed (its
  replayable's `recompute_step`, replay/engine/recompute.py) and sketched on the host, and compared
  with the torch run's recorded sketches. Costs, per step examined, a replay from the newest
  checkpoint at or before it (or from the step examined before it, when that is nearer).

A JAX run that records sketches at some steps only (the trainer at trace.layer_every = N > 1: its
layer-level records, which hold them, come every N steps; `layer_steps` says which) is read by `mixed`: the traces where both
records hold sketches, and the JAX run replayed through the other steps asked for (when replay is
allowed; else those steps are judged on their metrics alone).

Scalar metrics (loss, z_loss, grad_norm, lr, param_norm) come from both traces: |a - b| / max(|a|, |b|).
A tensor whose fingerprints are equal in both runs is at distance 0, whatever the sketches say.
Cost per examined step: two records read (traces), or one replayed step (replay); memory O(tensors).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import numpy as np

from traces import Run
from traces.sketch import relative_distance, sketch
from replay.record.names import get_path
from traces.schema import CAUSAL_KINDS

SKIPPED = ("state/opt_state",)  # torch's and optax's optimizer states are different structures


def compared_names(torch_run: Run, jax_run: Run) -> list[tuple[str, str]]:
    """(name, kind) of what both runs record, in causal order: the JAX run's tensors and metrics."""
    tt = dict(torch_run.schema.tensors)
    tensors = [(n, k) for n, k in jax_run.schema.tensors if n in tt and n not in SKIPPED]
    tm = dict(torch_run.schema.metrics)
    metrics = [(n, k) for n, k in jax_run.schema.metrics if n in tm]
    order = {k: i for i, k in enumerate(CAUSAL_KINDS)}
    return sorted(tensors + metrics, key=lambda nk: order[nk[1]])  # stable: execution order within a kind


def _scalar_distance(a: float, b: float) -> float:
    if a == b or (np.isnan(a) and np.isnan(b)):
        return 0.0
    den = max(abs(a), abs(b))
    return float(abs(a - b) / den) if den > 0 and np.isfinite(den) else float("inf")


def _metric_distances(ra, rb, sa, sb, names: Iterable[str]) -> dict[str, float]:
    ma, mb = ra.metrics_dict(sa), rb.metrics_dict(sb)
    return {n: _scalar_distance(ma[n], mb[n]) for n in names if n in ma and n in mb}


def sketches_in_both(torch_run: Run, jax_run: Run) -> bool:
    w = torch_run.schema.sketch_width
    return bool(w) and w == jax_run.schema.sketch_width


def layer_steps(run_a: Run, run_b: Run, start: int, end: int) -> np.ndarray:
    """The steps in start..end-1 both traces record at the layer level (the records that hold
    sketches, in a run that has them: every step, or the trainer's every trace.layer_every-th),
    from the index's flags column, no record read. Cost: a byte a step of each trace."""
    from traces.columns import step_columns
    from traces.schema import FLAG_LAYER

    def layer(run: Run) -> np.ndarray:
        out = np.zeros(end - start, bool)
        for c in step_columns(run.trace, start, end):
            out[c.first_step - start: c.first_step - start + len(c.flags)] = (c.flags & FLAG_LAYER) != 0
        return out

    return start + np.flatnonzero(layer(run_a) & layer(run_b))


def from_traces(torch_run: Run, jax_run: Run, steps: Iterable[int], names: list[tuple[str, str]]
                ) -> Iterable[tuple[int, dict[str, float]]]:
    """(step, {name: distance}) from the two traces' sketches (metrics only at a step where either
    record holds none)."""
    st, sj = torch_run.schema, jax_run.schema
    it, ij = ({n: i for i, n in enumerate(s.tensor_names)} for s in (st, sj))
    tensor_names = [n for n, _ in names if n in it]
    metric_names = [n for n, _ in names if n not in it]
    for k in steps:
        rt, rj = torch_run.trace.read(k), jax_run.trace.read(k)
        out = _metric_distances(rt, rj, st, sj, metric_names)
        if rt.sketches is not None and rj.sketches is not None:
            for n in tensor_names:
                a, b = it[n], ij[n]
                out[n] = 0.0 if rt.fingerprints[a] == rj.fingerprints[b] else float(
                    relative_distance(rt.sketches[a], rt.norms[a], rj.sketches[b], rj.norms[b]))
        yield k, out


def _jax_tensors(side: Any, wanted: set[str]) -> dict[str, np.ndarray]:
    """The JAX run's recorded tensors at one step, recomputed (forward layers, gradients,
    parameters after the update: whatever its loop records under those names)."""
    return side.rc.tensors(wanted, side.after()[0])


def _params_summary(side: Any, width: int) -> tuple[np.ndarray, float]:
    """The sketch of `state/params` (a pytree summary): the sum of its leaves' sketches, its norm
    over all of them (traces/FORMAT.md, "Distance sketches")."""
    import jax


    total, ss = np.zeros(width, np.float64), 0.0
    for n in side.rc.param_names:
        s, norm = sketch(np.asarray(jax.device_get(get_path(side.rc.params(), n))), width)
        total += s
        ss += float(norm) ** 2
    return total.astype(np.float32), np.float32(np.sqrt(ss))


def from_replay(torch_run: Run, jax_run: Run, steps: Iterable[int], names: list[tuple[str, str]],
                on_replay: Callable[[int], None] | None = None) -> Iterable[tuple[int, dict[str, float]]]:
    """(step, {name: distance}): the JAX run replayed through the steps (ascending), sketched here.
    A step past a checkpoint newer than the last step replayed starts from that checkpoint, so steps
    examined far apart cost a restore and the steps since it each, not a replay of the whole run."""
    from replay.engine.recompute import CAPABILITY, _Side, recomputes
    from replay.engine.replayer import Replayer, ReplayUnavailable

    st, sj = torch_run.schema, jax_run.schema
    width = st.sketch_width
    it, ij = ({n: i for i, n in enumerate(s.tensor_names)} for s in (st, sj))
    tensor_names = [n for n, _ in names if n in it]
    metric_names = [n for n, _ in names if n not in it]
    r = Replayer("JAX", jax_run)
    if not recomputes(r):
        raise ReplayUnavailable(f"{jax_run.path}: records no distance sketches and its loop does not provide "
                                f"{CAPABILITY}(state, step), so its tensors cannot be recomputed here; record it with "
                                "distance sketches (trace format 2; the trainer: --set trace.sketches=true)")
    steps = sorted(set(steps))
    at, state = 0, None
    for k in steps:
        if state is None or any(at < c <= k for c in r.checkpoints()):  # restoring beats replaying up to it
            _, state = r.state_at(k)
        else:
            state = r.advance(state, at, k, keep_input=False)
        side = _Side(r, state, k)
        rt, rj = torch_run.trace.read(k), jax_run.trace.read(k)
        out = _metric_distances(rt, rj, st, sj, metric_names)
        if rt.sketches is not None:
            values = _jax_tensors(side, set(tensor_names))
            if "state/params" in it:
                values["state/params"] = _params_summary(side, width)
            for n in tensor_names:
                a = it[n]
                if rj.fingerprints is not None and rt.fingerprints[a] == rj.fingerprints[ij[n]]:
                    out[n] = 0.0
                elif n in values:
                    s, norm = values[n] if isinstance(values[n], tuple) else sketch(values[n], width)
                    out[n] = float(relative_distance(rt.sketches[a], rt.norms[a], s, norm))
        state, at = side.after()[0], k + 1
        if on_replay is not None:
            on_replay(k)
        yield k, out


def mixed(torch_run: Run, jax_run: Run, steps: Iterable[int], names: list[tuple[str, str]], replay: bool,
          used: set[str], notes: list[str]) -> Iterable[tuple[int, dict[str, float]]]:
    """(step, {name: distance}) for `steps` in ascending order: from the two traces where both records
    hold sketches; at a step where only the torch record does, from the JAX run replayed (`replay`: one
    replay through all such steps, ascending, started on first need), else from the metrics alone (and
    a note says why when the JAX run cannot be replayed). `used` gets the sources taken ("traces",
    "replay", "metrics"; "unreplayable" once a replay was refused: the same report's later calls
    do not try again). A run sketched at every step replays nothing. Cost: two records read a step,
    and a replay up to the last step that needs one."""
    from replay.engine.replayer import ReplayUnavailable

    steps = sorted(set(steps))
    needs_replay = [k for k in steps if torch_run.trace.read(k).sketches is not None
                    and jax_run.trace.read(k).sketches is None]
    pending = set(needs_replay)
    replayed = None
    replay = replay and "unreplayable" not in used
    for k in steps:
        if k in pending and replay:
            if replayed is None:
                replayed = iter(from_replay(torch_run, jax_run, needs_replay, names))
            try:
                at, dist = next(replayed)
            except ReplayUnavailable as e:  # a loop without recompute_step: its metrics are what is left
                replay = False
                used.add("unreplayable")  # later calls for the same report do not try again
                notes.append(f"steps the JAX trace holds no distance sketches for are judged on their metrics "
                             f"alone: {e}")
            else:
                assert at == k, (at, k)
                used.add("replay")
                yield k, dist
                continue
        used.add("metrics" if k in pending else "traces")
        yield next(iter(from_traces(torch_run, jax_run, [k], names)))


def replay_checkpoints(jax_run: Run) -> list[int] | None:
    """The JAX run's checkpoint steps, where a replay of it can start; None when it cannot be
    replayed here (from_replay then says why)."""
    from replay.engine.replayer import Replayer, ReplayUnavailable

    try:
        return Replayer("JAX", jax_run).checkpoints()
    except ReplayUnavailable:
        return None
