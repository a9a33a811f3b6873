"""`bisect TORCH_RUN JAX_RUN`: where a JAX port leaves its PyTorch reference, layer by layer.

Bits are never expected to match across frameworks, so instead of the first differing field:

1. Inputs, bit for bit: the batch hash of every common step (a column of each trace: 8 bytes
   a step) and the initial parameters' fingerprint (`state/params` at the first step). A
   difference is the cause ("data" at its step, "init" at step 0): nothing after it is judged.
2. Distances: for the steps examined, the relative distance of every tensor and metric both
   runs record (replay/bisect/cross_distance.py: from the traces' distance sketches, or by
   replaying the JAX run), in causal order: forward layers, loss, gradients, parameters after
   the update.
3. The noise floor (replay/bisect/cross_floor.py): the distance two correct implementations
   reach, measured. The first examined step where some field exceeds it, and the first field
   there in causal order, name the step, the layer and the cause.
4. The op (replay/bisect/cross_refine.py): for a forward layer, that step re-run on both sides
   with the points inside the layer's block captured; the first above the floor is named.

Steps examined: every common step up to DENSE_STEPS; beyond, DENSE_STEPS evenly spaced ones
(moved back to the JAX run's checkpoints when it is replayed),
then a binary search between the last one within the floor and the first one above it (a
divergence does not heal: once above, later steps stay above), so a million-step pair costs
~DENSE_STEPS + 20 records of each run (or, replayed, ~DENSE_STEPS checkpoint restores each with
one step, and ~20 searched steps each replayed from the checkpoint before it), and the report
holds only those steps' distances. A JAX trace that sketches every N-th step only
(trace.layer_every) is examined at those steps, the steps searched between them replayed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from replay.bisect.cross_distance import (compared_names, from_replay, from_traces, layer_steps, mixed,
                                          replay_checkpoints, sketches_in_both)
from replay.bisect.cross_floor import TRAINER, Floor, choose
from replay.bisect.cross_refine import OpFinding, refine_op
from traces import Run

DENSE_STEPS = 256
RECORDED_BY_TORCH = "replay.torch"
CAUSE_TEXT = {"data": "data (the batches differ)", "init": "init (the initial parameters differ)",
              "forward": "forward layer", "loss": "loss", "backward": "gradient", "update": "optimizer update"}


from replay.errors import UserError  # noqa: E402 - a one-line user error, exit 2 (no heavy imports)
from replay.bisect.report import finite_json
from replay.engine.damage import shown_path
from traces.columns import batch_hashes


class CrossBisectError(UserError):
    """The two runs cannot be compared across frameworks (another batch size, no common step): exit 2."""


def framework(run: Run) -> str:
    """"torch" for a run replay.torch recorded, else the environment's framework ("jax" by default)."""
    if run.manifest.get("recorded_by") == RECORDED_BY_TORCH:
        return "torch"
    return str((run.manifest.get("environment") or {}).get("framework", "jax"))


def is_cross(run_a: Run, run_b: Run) -> bool:
    return framework(run_a) != framework(run_b)


@dataclass
class CrossReport:
    run_a: str
    run_b: str
    torch_side: str  # "A" or "B"
    inputs: dict  # {"data": {...}, "init": {...}}
    names: list[tuple[str, str]]  # (name, kind) compared, causal order
    distances: dict[int, dict[str, float]] = field(default_factory=dict)  # examined steps only
    floor: dict[str, float] = field(default_factory=dict)  # name -> floor at the first step above (or the last)
    first_step: int | None = None
    first_layer: str | None = None
    cause: str | None = None
    ratio: float | None = None  # distance / floor at (first_step, first_layer)
    source: str = "traces"  # "replay", "traces+replay" (sketched every N steps, replayed between) or "metrics"
    steps: tuple[int, int] = (0, 0)  # the common steps [start, end)
    notes: list[str] = field(default_factory=list)
    failure: Exception | None = None
    max_ratio: float = 0.0  # the largest distance / floor seen where nothing was above
    op: OpFinding | None = None  # the op inside first_layer (replay/bisect/cross_refine.py)
    noise: Floor = TRAINER  # the measured envelope judging the distances (replay/bisect/cross_floor.py)

    @property
    def within_noise(self) -> bool:
        return self.first_step is None and self.failure is None

    @property
    def jax_side(self) -> str:
        return "B" if self.torch_side == "A" else "A"

    @property
    def cause_text(self) -> str | None:
        if self.cause is None:
            return None
        text = CAUSE_TEXT.get(self.cause, self.cause)
        if self.cause == "init" and "one_side" in self.inputs.get("init", {}):
            side, name = self.inputs["init"]["one_side"]
            return f"{text}: {name} is a parameter of the {side} run only"
        if self.cause != "forward" or not self.first_layer:
            return text
        text = f"{text} {self.first_layer}"
        op = self.op
        if op is not None and op.name and op.name != self.first_layer:
            return f"{text}, op {op.name} ({op.text}{': ' + op.diagnosis if op.diagnosis else ''})"
        return f"{text} ({op.text})" if op is not None and op.name and op.text != op.name else text

    @property
    def first_op(self) -> str | None:
        return self.op.name if self.op is not None else None

    # Names shared with BisectReport, so callers need not tell the two apart.
    @property
    def layer(self) -> str | None:
        return self.first_layer

    @property
    def identical(self) -> bool:
        return False  # bits are not expected across frameworks

    @property
    def noise_only(self) -> bool:
        return self.within_noise

    def to_json(self) -> dict:
        return finite_json({
            "cross_framework": True, "run_a": self.run_a, "run_b": self.run_b, "torch_side": self.torch_side,
            "within_noise": self.within_noise, "first_step": self.first_step, "first_layer": self.first_layer,
            "cause": self.cause, "cause_text": self.cause_text, "ratio": self.ratio, "max_ratio_within": self.max_ratio,
            "inputs": self.inputs, "source": self.source, "steps": list(self.steps),
            "examined": sorted(self.distances), "names": [n for n, _ in self.names],
            "kinds": {n: k for n, k in self.names}, "floor": self.floor,
            "distances": {str(k): v for k, v in sorted(self.distances.items())},
            "first_op": self.first_op, "op": None if self.op is None else self.op.to_json(),
            "error": None if self.failure is None else str(self.failure), "notes": self.notes,
            "floor_table": {"name": self.noise.name, "factor": self.noise.factor, "measured_on": self.noise.measured_on},
        })


def _common_steps(a: Run, b: Run) -> tuple[int, int]:
    start, end = max(a.trace.start, b.trace.start), min(a.trace.end, b.trace.end)
    if end <= start:
        raise CrossBisectError(f"{a.path} and {b.path} record no step in common (A: steps {a.trace.start}.."
                               f"{a.trace.end - 1}, B: {b.trace.start}..{b.trace.end - 1})")
    return start, end


def _check_inputs(report: CrossReport, t: Run, j: Run, start: int, end: int) -> bool:
    """Data (batch hashes, every common step) and init (state/params at `start`): True when both agree."""
    ht, hj = batch_hashes(t.trace, start, end), batch_hashes(j.trace, start, end)
    differ = np.flatnonzero(ht != hj)
    report.inputs["data"] = {"equal": not differ.size, "steps": [start, end],
                             "first_step": int(start + differ[0]) if differ.size else None}
    if differ.size:
        k = int(start + differ[0])
        rt, rj = t.trace.read(k), j.trace.read(k)
        pos = np.flatnonzero(rt.example_hashes != rj.example_hashes)
        report.inputs["data"]["positions"] = pos[:16].tolist()
        report.first_step, report.cause, report.first_layer = k, "data", None
        return False
    rt, rj = t.trace.read(start), j.trace.read(start)
    names_t, names_j = t.schema.tensor_names, j.schema.tensor_names
    if "state/params" in names_t and "state/params" in names_j and rt.fingerprints is not None \
            and rj.fingerprints is not None:
        ft, fj = int(rt.fingerprints[names_t.index("state/params")]), int(rj.fingerprints[names_j.index("state/params")])
        report.inputs["init"] = {"equal": ft == fj, "step": start, "torch": f"{ft:016x}", "jax": f"{fj:016x}"}
        if ft != fj:
            report.first_step, report.cause, report.first_layer = start, "init", "state/params"
            one_side = _one_side_params(t, j)
            if one_side:  # one model has a parameter the other lacks (tied vs untied embeddings): name it
                report.first_layer, report.inputs["init"]["one_side"] = one_side[0][1], list(one_side[0])
            return False
    else:
        report.inputs["init"] = {"equal": None, "step": start}
        report.notes.append(f"the initial parameters could not be compared: step {start} is not recorded at the "
                            "layer level in both runs")
    return True


def _one_side_params(t: Run, j: Run) -> list[tuple[str, str]]:
    """(side, parameter) for each parameter one run records and the other does not ("param/NAME")."""
    pt, pj = ([n[6:] for n in r.schema.tensor_names if n.startswith("param/")] for r in (t, j))
    return [("torch", n) for n in pt if n not in pj] + [("JAX", n) for n in pj if n not in pt]


def _above(report: CrossReport, step: int, dist: dict[str, float]) -> tuple[str, str, float, float] | None:
    """The first (name, kind, distance, floor) above the floor at `step`, causal order, or None."""
    for name, kind in report.names:
        if name not in dist:
            continue
        f = report.noise.at(kind, step)
        d = dist[name]
        if not (d <= f):  # NaN is above
            return name, kind, d, f
        report.max_ratio = max(report.max_ratio, d / f if f > 0 else 0.0)
    return None


def _examined(start: int, end: int, sketched: np.ndarray | None = None, checkpoints: list[int] | None = None
              ) -> list[int]:
    """The steps the scan reads: of `sketched` (ascending; None: every step in start..end-1), all
    up to DENSE_STEPS, else DENSE_STEPS evenly spaced among them, each moved back to the newest of
    `checkpoints` at or before it within start..end (a replayed sample then costs a restore and one
    step, not the steps since the checkpoint); and the last common step."""
    if sketched is None:
        sketched = np.arange(start, end)
    if len(sketched) > DENSE_STEPS:
        sketched = sketched[np.unique(np.round(np.linspace(0, len(sketched) - 1, DENSE_STEPS)).astype(np.int64))]
        ckpts = np.array(sorted(c for c in checkpoints or () if start <= c < end), np.int64)
        if ckpts.size:
            at = np.searchsorted(ckpts, sketched, side="right") - 1
            sketched = np.where(at >= 0, ckpts[np.maximum(at, 0)], sketched)
    return sorted({int(k) for k in sketched} | {end - 1})


def named_floor(spec: str | None, run_a: Run, run_b: Run) -> Floor:
    """The floor `--floor SPEC` names for this pair: `twin:PATH`, a rounding-level twin of one side
    (replay/bisect/twin_floor.py), else a table's name, a floor file or auto (cross_floor.choose)."""
    from replay.bisect.twin_floor import PREFIX, twin_floor

    if spec is not None and spec.startswith(PREFIX):
        return twin_floor(spec[len(PREFIX):], run_a, run_b)
    return choose(spec, run_a.manifest, run_b.manifest)


def cross_bisect(run_a: Run, run_b: Run, refine: bool = True, floor: str | Floor | None = None) -> CrossReport:
    """The cross-framework report for a torch run and a JAX run (either order). `refine=False`
    allows no replay: a JAX run without sketches is then judged on its metrics alone. `floor`: a
    Floor, or what `--floor` takes (named_floor: twin:PATH, a table's name, a file, None for the pair's own)."""
    noise = floor if isinstance(floor, Floor) else named_floor(floor, run_a, run_b)
    torch_side = "A" if framework(run_a) == "torch" else "B"
    t, j = (run_a, run_b) if torch_side == "A" else (run_b, run_a)
    names_src = (t.manifest.get("names") or {}).get("source", "")
    report = CrossReport(shown_path(run_a), shown_path(run_b), torch_side, {}, compared_names(t, j), noise=noise)
    if not str(names_src).startswith("trainer.reference"):
        report.notes.append(f"the torch run's tensors are named by {names_src or 'its own module names'}, not "
                            "trainer.reference.tensor_names: only the tensors of the same name are compared")
    if not any(k != "loss" and n in t.schema.tensor_names for n, k in report.names):
        report.notes.append("no tensor is recorded under the same name in both runs: only metrics are compared")
    if t.schema.examples_per_step != j.schema.examples_per_step:
        raise CrossBisectError(f"the runs feed different batch sizes ({t.schema.examples_per_step} vs "
                               f"{j.schema.examples_per_step} examples a step): train both sides on the same batches")
    start, end = _common_steps(t, j)
    report.steps = (start, end)
    if not _check_inputs(report, t, j, start, end):
        return report
    sketched, used, checkpoints = None, None, None
    if sketches_in_both(t, j):
        used, sketched = set(), layer_steps(t, j, start, end)
        source = lambda steps: mixed(t, j, steps, report.names, refine, used, report.notes)  # noqa: E731
    elif refine and t.schema.sketch_width:
        report.source = "replay"
        checkpoints = replay_checkpoints(j)
        source = lambda steps: from_replay(t, j, steps, report.names)  # noqa: E731
    else:
        report.source = "metrics"
        report.names = [(n, k) for n, k in report.names if n not in t.schema.tensor_names]
        report.notes.append("tensor distances need distance sketches in both traces or a replay of the JAX run "
                            "(not allowed by --no-refine, or the torch run has none): metrics only")
        source = lambda steps: from_traces(t, j, steps, report.names)  # noqa: E731
    try:
        _scan(report, source, start, end, sketched, checkpoints)
        if used is not None:
            _say_sources(report, used, sketched, end - start)
        if refine and report.cause == "forward" and report.first_layer:
            report.op = refine_op(t, j, report.first_step, report.first_layer, report.notes, noise)
    except Exception as e:  # noqa: BLE001 - the CLI raises it after the report (2 bad input, 3 a bug)
        report.failure = e
    return report


def _say_sources(report: CrossReport, used: set[str], sketched: np.ndarray, steps: int) -> None:
    """Where the JAX trace sketches only some steps: which source judged the others."""
    report.source = "traces+replay" if "replay" in used else "traces"
    if len(sketched) < steps:
        report.notes.append(f"both traces record distance sketches at {len(sketched)} of the {steps} common steps "
                            "(the JAX trainer: every trace.layer_every steps): the steps examined are those and the "
                            "last common step; a step searched between two of them is replayed")
    if "metrics" in used:
        report.notes.append("some steps examined have no distance sketch in the JAX trace and were not replayed "
                            "(--no-refine, or a loop replay cannot recompute): only their metrics are judged, so the "
                            "first step above may lie earlier, after the last step examined within the floor")


def _scan(report: CrossReport, source, start: int, end: int, sketched: np.ndarray | None = None,
          checkpoints: list[int] | None = None) -> None:
    steps = _examined(start, end, sketched, checkpoints)
    below = None
    for k, dist in source(steps):
        report.distances[k] = dist
        hit = _above(report, k, dist)
        if hit is not None:
            if below is not None and k - below > 1:  # sampled: search the steps in between
                k, hit = _search(report, source, below, k, hit)
            _found(report, k, hit)
            return
        below = k
    report.floor = {n: report.noise.at(kind, end - 1) for n, kind in report.names}


def _search(report: CrossReport, source, lo: int, hi: int, hit):
    """The first step in (lo, hi] above the floor, lo within it, hi above (binary search)."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        _, dist = next(iter(source([mid])))
        report.distances[mid] = dist
        h = _above(report, mid, dist)
        if h is None:
            lo = mid
        else:
            hi, hit = mid, h
    return hi, hit


def _found(report: CrossReport, step: int, hit) -> None:
    name, kind, d, f = hit
    report.first_step, report.first_layer = step, name
    report.cause = "init" if kind == "state" else kind
    report.ratio = d / f if f > 0 else math.inf
    report.floor = {n: report.noise.at(k, step) for n, k in report.names}
