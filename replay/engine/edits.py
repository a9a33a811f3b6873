"""Edits between steps: the loop changed its state after step k-1 returned it and before step k ran
(an optimizer reset, `metrics.reset()` on recorded state, a learning-rate override written into
the state). A `replay.init` run's layer records hold both sides of that gap: step k-1's
`update/PATH` (each leaf it returned) and step k's `state/PATH` (each leaf fed to it). When the
loop feeds back exactly what it got they are the same fingerprint (replay/record/program.py
chains them); a leaf where they differ was edited between the steps. So the trace alone says
it, with no replay: bisect names it as the cause of a divergence, and `replay run` says why it
cannot follow the step (it runs each step from the state the previous one returned).

Not seen: edits in a step-level trace (no fingerprints), and in runs whose tensors are not named
this way (the trainer's record the state as one summary; its state is never edited by the loop).
Cost: two records read, O(tensors).
"""

from __future__ import annotations

from traces import Run

STATE, UPDATE = "state/", "update/"


def state_edits(run: Run, step: int) -> list[str]:
    """The state leaves (PATH) whose fingerprint entering `step` differs from what step - 1
    returned; [] when there is no edit or the trace cannot tell (see the module doc)."""
    names = run.schema.tensor_names
    index = {n: i for i, n in enumerate(names)}
    pairs = [(n[len(STATE):], i, index[UPDATE + n[len(STATE):]]) for i, n in enumerate(names)
             if n.startswith(STATE) and UPDATE + n[len(STATE):] in index]
    trace = run.trace
    if not pairs or step - 1 < trace.start or step >= trace.end:
        return []
    before, at = trace.read(step - 1), trace.read(step)
    if before.fingerprints is None or at.fingerprints is None:
        return []
    return [path for path, i_state, i_update in pairs if at.fingerprints[i_state] != before.fingerprints[i_update]]


def describe(leaves: list[str], step: int, run: str | None = None, limit: int = 4) -> str:
    """One line: which leaves the loop changed between steps step-1 and step."""
    shown = ", ".join(leaves[:limit]) + (f" and {len(leaves) - limit} more" if len(leaves) > limit else "")
    whose = f"run {run}'s loop" if run else "your loop"
    return (f"{whose} changed {shown} between steps {step - 1} and {step}: the state entering step {step} is not what "
            f"step {step - 1} returned")
