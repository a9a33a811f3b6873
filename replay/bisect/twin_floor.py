"""A noise floor measured from the runs themselves: a rounding-level twin of one side.

A measured table (replay/bisect/cross_floor.py) is one envelope for every config of a pair of
frameworks; a chaotic config (the MaxText/OLMo-core pair on random tokens) needs a wide one, and a
real bug small at step 1 hides inside it. A TWIN is a second run of one side (the same framework,
config, data and steps) that differs from it only by rounding, e.g. its initial weights moved by
one ULP in one element per tensor: d(side, twin) at step k is how far rounding alone has carried
THIS config by step k. `replay bisect A B --floor twin:PATH` judges d(A, B) against

    floor(kind, k) = max(FACTOR x max over the fields of `kind` of d(side, twin) at k,  table.at(kind, 0))

where `table` is the pair's measured table (auto: cross_floor.choose) and its step-0 value is the
absolute floor: the two frameworks' kernels round differently at every step, which a twin of one
side cannot show, and a twin identical to its side (distance 0) must not make every rounding
difference a divergence. Early, where the twin is still near rounding, the floor is as tight as
the table's at step 0; later, where the twin itself has parted, it widens with it. A kind the twin
records no field of is judged by the table at its step. Per kind, not per field: one field's twin
distance is noisy (it can pass near zero while its neighbours have grown), the kind's largest is not.

MEASURED (2026-12-06, this machine's CPU; tests/maxtext/test_olmo3_pair.py, data seed 0): the MaxText/
OLMo-core OLMo 3 pair (tools/olmo3_pair.py) with a twin of its OLMo-core run (`--twin`: one ULP on the first
element of every parameter). The twin is 5.6e-7 off its side at step 0 (forward), 9.8e-5 at step 1 and
1.6e-3 by step 63: AdamW's first update is about +-lr an element, and rounding flips the sign where a
gradient is near zero (param blocks.1.attention.w_q is already 1.5e-4 apart after step 0). The clean
pair stays within this floor over 64 steps, 0.20 x at most (the loss at step 61); the olmo3-pair table
gives 0.099 x. OLMo-core's AdamW counter bug (--keep-adam-count) against a twin of that run is named at
step 1, embeddings, 8.9 x (distance 6.6e-3, floor 7.4e-4), where the olmo3-pair table (0.23 at step
1) lets it pass. At step 0 the twin's 10 x 5.6e-7 is under the table's 7.2e-6, so step-0 bugs are
judged exactly as by the table. A twin must re-run the side it twins: a twin of the clean OLMo-core run
against the buggy one measures the bug as noise (its config differs, which is refused).

The twin is checked before any distance (one line, exit 2 otherwise): the framework of A or of B
(that run is its side), the side's config (a dict config may hold the perturbation under "twin",
which is not compared), the side's batches at every common step of A and B, distance sketches of
the side's width, every common step recorded, and sketched in both the twin and its side (from the
traces' flags columns): the floor at a step is their distance there, so a side sketched every N
steps (trace.layer_every) has no twin floor at the steps between, and is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from replay.bisect.cross_distance import compared_names, from_traces, layer_steps
from replay.bisect.cross_floor import Floor, choose
from replay.errors import UserError
from traces import Run
from traces.columns import batch_hashes

PREFIX = "twin:"
FACTOR = 10.0  # the margin over the twin's distance, as the tables' (cross_floor.Floor.factor)
PERTURBATION_KEY = "twin"  # a twin's config may say how it was perturbed under this key: not compared


@dataclass(frozen=True)
class TwinFloor(Floor):
    """`at(kind, step)`: FACTOR x the twin's largest distance of `kind` at `step`, never under the
    table's step-0 floor; read from the two traces' sketches on first use, one record each a step."""

    side: Any = field(default=None, hash=False, compare=False, repr=False)  # the run the twin twins
    twin: Any = field(default=None, hash=False, compare=False, repr=False)
    table: Floor | None = field(default=None, hash=False, compare=False)
    _seen: dict = field(default_factory=dict, hash=False, compare=False, repr=False)  # step -> kind -> distance

    def at(self, kind: str, step: int) -> float:
        step = int(step)
        if step not in self._seen:
            self._seen[step] = self._distances(step)
        d = self._seen[step].get(kind)
        if d is None:
            return self.table.at(kind, step)
        return max(self.table.at(kind, 0), self.factor * d)

    def _distances(self, step: int) -> dict[str, float]:
        names = compared_names(self.twin, self.side)
        kind_of = dict(names)
        out: dict[str, float] = {}
        for _, dist in from_traces(self.side, self.twin, [step], names):
            for n, d in dist.items():
                d = float(d) if np.isfinite(d) else float("inf")  # a twin gone to NaN: nothing can be judged
                out[kind_of[n]] = max(out.get(kind_of[n], 0.0), d)
        return out


def _config(run: Run) -> Any:
    c = run.manifest.get("config")
    if isinstance(c, dict):  # a run with no config of its own and its twin holding only "twin" are alike
        c = {k: v for k, v in c.items() if k != PERTURBATION_KEY} or None
    return c


def twin_floor(path: str, run_a: Run, run_b: Run, twin: Run | None = None) -> TwinFloor:
    """The floor `--floor twin:PATH` names for the cross-framework pair (run_a, run_b); `twin`: the
    run at PATH already opened (else opened here: a run folder or a bundle)."""
    from replay.bisect.cross import framework
    from replay.bisect.cross_distance import sketches_in_both

    if twin is None:
        from replay.bundle import open_run

        twin = open_run(path)
    what = f"--floor {PREFIX}{path}"
    sides = [(name, r) for name, r in (("A", run_a), ("B", run_b)) if framework(r) == framework(twin)]
    if len(sides) != 1:
        raise UserError(f"{what}: the twin is recorded by {framework(twin)}, which is neither side's alone (A "
                        f"{framework(run_a)}, B {framework(run_b)}); a twin re-runs one side of the pair")
    name, side = sides[0]
    if _config(twin) != _config(side):
        raise UserError(f"{what}: the twin's config is not run {name}'s (only its \"{PERTURBATION_KEY}\" key may "
                        "differ); a twin re-runs one side with nothing changed but rounding")
    if not sketches_in_both(side, twin):
        raise UserError(f"{what}: the twin and run {name} need distance sketches of one width (twin "
                        f"{twin.schema.sketch_width}, {name} {side.schema.sketch_width})")
    start, end = max(run_a.trace.start, run_b.trace.start), min(run_a.trace.end, run_b.trace.end)
    if not (twin.trace.start <= start and end <= twin.trace.end):
        raise UserError(f"{what}: the twin records steps {twin.trace.start}..{twin.trace.end - 1}, not every "
                        f"common step of A and B ({start}..{end - 1})")
    if end > start and not np.array_equal(batch_hashes(side.trace, start, end), batch_hashes(twin.trace, start, end)):
        raise UserError(f"{what}: the twin is not fed run {name}'s batches over steps {start}..{end - 1}")
    both = layer_steps(side, twin, start, end)
    if len(both) < end - start:  # a step without both sketches would be judged by the table, unsaid
        missing = int(np.setdiff1d(np.arange(start, end), both)[0])
        raise UserError(f"{what}: the twin and run {name} both record distance sketches at {len(both)} of the "
                        f"{end - start} common steps of A and B (not at step {missing}); a twin floor needs them at "
                        "every step of both (the trainer: trace.layer_every=1)")
    table = choose(None, run_a.manifest, run_b.manifest)
    return TwinFloor(f"{PREFIX}{path}", dict(table.base), dict(table.growth), FACTOR,
                     f"run {name} vs its twin {path}: {FACTOR:g} x their distance per step and kind, never under "
                     f"{table.name}'s step-0 floor", side=side, twin=twin, table=table)
