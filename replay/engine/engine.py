"""The replay engine: restore the checkpoint at or before A, re-run steps up to B, compare.

Every recorded field of every replayed step is compared with the trace (RNG key words,
per-example hashes, metric bits, layer fingerprints), the warm-up steps between the
checkpoint and A included. Nothing is written anywhere: the run is opened read-only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import numpy as np

from replay.bisect import finite_json
from replay.engine.contract import Contract
from traces import FieldDiff, Run, TraceCorruptError, diff_records
from traces.schema import METRIC_DTYPES
from replay.record.recorder import to_record
from replay.engine.damage import bundle_terms, describe_damage, run_damage, shown_path
from replay.engine.edits import describe, state_edits
from replay.record import checkpoints as ckpts
from replay.errors import ReplayUnavailable


class ReplayInputError(ValueError):
    """A step range or run that cannot be replayed; one line, exit 2."""


@dataclass
class StepResult:
    step: int
    exact: bool  # every recorded field bit-identical
    warmup: bool  # between the checkpoint and A: replayed to get there, verified too
    diffs: list[FieldDiff] = field(default_factory=list)  # differing fields in causal order


@dataclass
class ReplayReport:
    run: str
    first: int  # A
    last: int  # B (inclusive)
    checkpoint: int  # the checkpoint the replay started from
    contract: Contract
    steps: list[StepResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    value_dtype: str = "float32"  # of the recorded metrics and RMS values: how their bits are shown
    edit: dict | None = None  # {"step", "leaves", "followed"}: the loop changed its state between steps (edits.py)

    @property
    def stopped_at(self) -> int | None:
        """The step replay could not follow the loop to (an edit with no checkpoint after it)."""
        return self.edit["step"] if self.edit and not self.edit["followed"] else None

    @property
    def in_range(self) -> list[StepResult]:
        return [s for s in self.steps if not s.warmup]

    @property
    def exact(self) -> bool:
        return all(s.exact for s in self.steps)

    @property
    def first_mismatch(self) -> StepResult | None:
        return next((s for s in self.steps if not s.exact), None)

    def to_json(self) -> dict:
        """Strict JSON: a NaN or infinite value is null, with its repr and bits beside it."""
        first = self.first_mismatch
        return finite_json({
            "run": self.run, "steps": [self.first, self.last], "checkpoint": self.checkpoint,
            "replayed": len(self.in_range), "bit_exact": sum(s.exact for s in self.in_range),
            "warmup_replayed": len(self.steps) - len(self.in_range),
            "warmup_bit_exact": sum(s.exact for s in self.steps if s.warmup),
            "all_bit_exact": self.exact, "contract": self.contract.to_json(), "notes": self.notes, "edit": self.edit,
            "first_mismatch": None if first is None else {
                "step": first.step, "warmup": first.warmup,
                "fields": [{"kind": d.kind, "name": d.name, "recorded": d.a, "replayed": d.b, "distance": d.distance,
                            "positions": d.positions, **self._exact("recorded", d.a), **self._exact("replayed", d.b)}
                           for d in first.diffs],
            },
            "mismatched_steps": [s.step for s in self.steps if not s.exact],
        })

    def _exact(self, key: str, value: object) -> dict:
        """{key_repr, key_bits} of a recorded float: the exact value, whatever JSON can hold."""
        if not isinstance(value, float):
            return {}
        value_dtype, bits_dtype = METRIC_DTYPES[self.value_dtype]
        v = np.asarray(value, value_dtype)
        return {f"{key}_repr": str(v), f"{key}_bits": f"0x{int(v.view(bits_dtype)):0{2 * bits_dtype.itemsize}x}"}


def parse_steps(text: str) -> tuple[int, int]:
    """"A:B" (inclusive) or "A" (one step)."""
    try:
        if ":" in text:
            a, b = text.split(":", 1)
            first, last = int(a), int(b)
        else:
            first = last = int(text)
    except ValueError:
        raise ReplayInputError(f"--steps {text!r} is not A:B or A (step numbers, B inclusive)") from None
    if first < 0 or first > last:
        raise ReplayInputError(f"--steps {text}: need 0 <= A <= B")
    return first, last


def checkpoint_steps(run: Run) -> list[int]:
    """The steps with an orbax checkpoint in the run's checkpoint folder, read from the folder
    alone (no loop code, nothing compiled), read-only ([] when it has none)."""
    from replay.engine.protocol import local_run

    run = local_run(run)  # a remote run: restored from its local copy
    if not run.checkpoint_dir.is_dir():
        return []
    return ckpts.steps(ckpts.open_manager(run.checkpoint_dir, read_only=True))


def latest_checkpoint(checkpoints: list[int], step: int) -> int | None:
    """The newest checkpoint at or before `step`: where a replay of `step` starts."""
    return max((c for c in checkpoints if c <= step), default=None)


def check_range(run: Run, first: int, last: int, checkpoints: list[int]) -> int:
    """The checkpoint to start from; raises ReplayInputError for a range the run cannot replay."""
    trace, name = run.trace, shown_path(run)
    if len(trace) == 0 or first < trace.start or last >= trace.end:
        damage = run_damage(run)
        if damage:  # the range is out of reach because the trace is damaged: say that, not "outside"
            readable = f"only steps {trace.start}..{trace.end - 1} can be read" if len(trace) else "no step can be read"
            raise ReplayInputError(f"--steps {first}:{last}: the trace of {name} is damaged ({describe_damage(run, damage)}); "
                                   f"{readable}")
    if len(trace) == 0:
        raise ReplayInputError(f"{name}: the trace holds no steps; nothing to replay")
    if first < trace.start or last >= trace.end:
        raise ReplayInputError(f"--steps {first}:{last} is outside the recorded steps {trace.start}..{trace.end - 1} "
                               f"of {name}")
    start = latest_checkpoint(checkpoints, first)
    if start is None:
        have = ", ".join(map(str, checkpoints)) or "none"
        raise ReplayInputError(f"{name} has no checkpoint at or before step {first} (checkpoints: {have}); "
                               "replay a range that starts at or after a checkpoint")
    _check_records(run, start, last)
    return start


def _check_records(run: Run, start: int, last: int) -> None:
    """Every record the replay will compare passes its checksums before anything is compiled, so
    damage inside the range is refused up front, never found halfway through a verdict."""
    try:
        for step in range(start, last + 1):
            run.trace.read(step)
    except TraceCorruptError as e:
        raise ReplayInputError(f"the trace of {shown_path(run)} is damaged ({bundle_terms(run, str(e))}); "
                               f"restore the run's files from a copy, or record it again") from None


def replay(run: Run, replayable: Any, first: int, last: int, contract: Contract,
           on_step: Callable[[StepResult], None] | None = None) -> ReplayReport:
    start = check_range(run, first, last, replayable.checkpoint_steps())
    report = ReplayReport(shown_path(run), first, last, start, contract, value_dtype=run.schema.metric_dtype)
    schema = run.schema
    state = replayable.restore(start)

    def verify(step: int, metrics: Any, hashes: Any) -> None:
        replayed = to_record(replayable.schema, step, jax.device_get(metrics), hashes)
        diffs = diff_records(schema, run.trace.read(step), replayable.schema, replayed)
        result = StepResult(step, not diffs, step < first, diffs)
        report.steps.append(result)
        if on_step is not None:
            on_step(result)

    # Step k is compared once step k+1 is dispatched, as the recorder does while training: fetching
    # its metrics at once would make the host wait for the device before building the next batch.
    pending = None
    for step in range(start, last + 1):
        edited = state_edits(run, step) if step > start else []
        if edited:  # the loop changed its state between step - 1 and step (replay/engine/edits.py)
            if step not in replayable.checkpoint_steps():
                report.edit = {"step": step, "leaves": edited, "followed": False}
                break
            state = replayable.restore(step)  # saved after the edit: the state the run really fed
            report.edit = {"step": step, "leaves": edited, "followed": True}
            report.notes.append(describe(edited, step) + f"; replay restarted from checkpoint {step}, which holds it")
        state, metrics, hashes = replayable.step(state, step)
        if pending is not None:
            verify(*pending)
        pending = (step, metrics, hashes)
    if pending is not None:
        verify(*pending)
    return report
