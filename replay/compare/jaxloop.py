"""`replay compare A B --eval` for two runs of a JAX loop no plugin gives a PyTorch reference for
(any `replay.Loop` with `evaluate` and `eval_batches`: examples/*.py).

Both runs' checkpoints at the chosen steps are restored through their replayables with the loop's
own code (the recorded step program cannot evaluate) and evaluated with each run's own
`evaluate(state, batch)` on run A's `eval_batches()` (B's, when it gives any, are compared by
their example hashes: a note says when they differ). The two states must have the same shapes
(their abstract trees are compared before anything is restored). The tolerance is floor.py's
rule with the floor measured on the pair itself (floor.WEIGHTS_ULP): e_X = mean over the held-out
examples of |evaluate(w) - evaluate(w')| at run X's weights, w' = w moved one ulp.

Cost at a million steps: opening the runs reads headers only; the held-out batches are read once
and held (their size is the loop's choice, not the run's length); "was an example trained on" is
one trace-index lookup a segment per run (traces.first_fed); per evaluated step and run, one
checkpoint restored, one copy of the state moved one ulp, two evaluation passes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from replay.compare.errors import CompareInputError
from replay.compare.floor import WEIGHTS_ULP, one_ulp_away, tolerance
from traces import Run, first_fed
from replay.compare.report import EvalComparison, EvalRow
from replay.record.hashing import example_hashes
import math

EVALUATE = ("evaluate", "evaluate(state, batch) -> float32 [n], each example's loss")
EVAL_BATCHES = ("eval_batches", "eval_batches() -> a fresh iterable of held-out batches")


class LoopSide:
    """One run of a JAX loop, evaluated with its own loop's code."""

    framework = "jax"

    def __init__(self, run: Run):
        from replay.engine.replayer import open_replayable

        self.run, self.path = run, run.path
        self.rep = None  # a run that saved no checkpoint has nothing to evaluate: steps() says so
        self._last: tuple[int, Any] | None = None
        if run.checkpoint_dir.is_dir():
            self.rep = open_replayable(run)
            if getattr(self.rep, "replayed_from", None) == "exported":
                raise CompareInputError(f"{run.path}: compare --eval evaluates checkpoints with the loop's own code "
                                        "(its replay.Loop's evaluate), which the recorded step program cannot stand in "
                                        "for: install the loop's module, or pass --allow-code as for replay run")
            self.need(EVALUATE)

    def need(self, capability: tuple[str, str]) -> Any:
        name, what = capability
        found = getattr(self.rep, name, None)
        if found is None:
            raise CompareInputError(f"{self.path}: replay compare --eval needs the run's loop to provide {what} "
                                    f"(replay.Loop({name}=...)); its loop gives none")
        return found

    def steps(self) -> list[int]:
        return [] if self.rep is None else sorted(self.rep.checkpoint_steps())

    def state_shapes(self) -> Any:
        shapes = getattr(self.rep, "state_shapes", None)
        return None if shapes is None else shapes()

    def state_at(self, step: int) -> Any:
        if self._last is None or self._last[0] != step:
            self._last = None  # the previous state's buffers go before the next restore
            self._last = (step, self.rep.restore(step))
        return self._last[1]

    def forget(self) -> None:
        self._last = None

    def losses(self, state: Any, batches: list[Any], sizes: list[int]) -> np.ndarray:
        """float64 [examples]: the loop's evaluate on each batch, checked for one loss an example."""
        out = []
        for batch, n in zip(batches, sizes):
            got = np.asarray(self.rep.evaluate(state, batch))
            if got.shape != (n,) or not np.issubdtype(got.dtype, np.floating):
                raise CompareInputError(f"{self.path}: its loop's evaluate returned {got.dtype}{list(got.shape)} for a "
                                        f"batch of {n} examples; it must return float32 [{n}], each example's loss "
                                        "(replay.Loop(evaluate=...))")
            out.append(got.astype(np.float64))
        return np.concatenate(out)


def check_same_state(a: LoopSide, b: LoopSide) -> None:
    """Refuses (one line) two runs whose states differ in structure, shape or dtype."""
    import jax

    if a.rep is None or b.rep is None:
        return
    sa, sb = a.state_shapes(), b.state_shapes()
    if sa is None or sb is None:
        return
    la, lb = (jax.tree_util.tree_flatten_with_path(s)[0] for s in (sa, sb))
    where = None
    if [p for p, _ in la] != [p for p, _ in lb]:
        where = f"their state trees differ ({len(la)} and {len(lb)} leaves)"
    else:
        for (path, x), (_, y) in zip(la, lb):
            if (tuple(x.shape), x.dtype) != (tuple(y.shape), y.dtype):
                where = (f"state leaf {jax.tree_util.keystr(path)} is {x.dtype}{list(x.shape)} in A and "
                         f"{y.dtype}{list(y.shape)} in B")
                break
    if where:
        raise CompareInputError(f"{a.path} and {b.path} hold states of different shapes ({where}); compare --eval "
                                "compares two runs of the same model")


def held_out(a: LoopSide, b: LoopSide, last_step: int) -> tuple[list[Any], list[int], list[str]]:
    """(run A's held-out batches, their example counts, notes): B's batches compared by their
    example hashes, and any held-out example either trace records as fed by `last_step` named."""
    import jax


    def hashes(side: LoopSide, batches: list[Any]) -> list[np.ndarray]:
        axis = getattr(getattr(side.rep, "options", None), "batch_axis", 0)
        return [example_hashes(jax.device_get(batch), axis) for batch in batches]

    batches = list(a.need(EVAL_BATCHES)())
    if not batches:
        raise CompareInputError(f"{a.path}: its loop's eval_batches() gave no batches; give it one or more held-out "
                                "batches (replay.Loop(eval_batches=...))")
    mine = hashes(a, batches)
    notes: list[str] = []
    theirs = getattr(b.rep, EVAL_BATCHES[0], None)
    if theirs is None:
        notes.append(f"{b.path}'s loop gives no eval_batches: both runs evaluated on {a.path}'s")
    else:
        other = hashes(b, list(theirs()))
        if len(other) != len(mine) or not all(np.array_equal(x, y) for x, y in zip(mine, other)):
            notes.append(f"the two runs' loops give different held-out batches (their example hashes differ): both "
                         f"runs evaluated on {a.path}'s")
    every = np.concatenate(mine)
    for side in (a, b):
        fed = first_fed(side.run, [int(h) for h in every], before_step=last_step)
        if fed:
            notes.append(f"{len(fed)} of the {len(every)} held-out examples were trained on in {side.path} by step "
                         f"{last_step} (first at step {min(fed.values())}): its eval loss is not held-out for them")
    return batches, [len(h) for h in mine], notes


def compare_loops(a: LoopSide, b: LoopSide, chosen: list[int], on_step=None) -> Any:
    """The EvalComparison of two JAX loops' runs at the checkpoint steps `chosen` (both have them)."""
    b.need(EVALUATE)
    batches, sizes, notes = held_out(a, b, max(chosen))
    out = EvalComparison(str(a.path), str(b.path), a.framework, b.framework, sum(sizes), 0, floor=WEIGHTS_ULP,
                         notes=notes)
    for k in chosen:
        measured = []
        for side in (a, b):
            state = side.state_at(k)
            loss = side.losses(state, batches, sizes)
            moved = side.losses(one_ulp_away(state), batches, sizes)
            side.forget()  # one run's state held at a time
            measured.append((float(loss.mean()), float(np.mean(np.abs(loss - moved)))))
        (mean_a, ea), (mean_b, eb) = measured
        tol = tolerance(ea, eb, mean_a) if math.isfinite(mean_a) and math.isfinite(mean_b) else 0.0
        row = EvalRow(k, mean_a, mean_b, mean_b - mean_a, tol, ea, eb)
        out.rows.append(row)
        if on_step is not None:
            on_step(row)
    return out
