"""What bisect says about the data of a divergent step: for each differing example, where it
was fed before (repeated data makes a loss look better than it is), and whether the two
batches hold the same examples in another order (a permutation within the batch, no new data)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from replay.audit import permutation, read_example_hashes
from traces import Run

if TYPE_CHECKING:
    from replay.bisect import BisectReport


@dataclass
class SeenBefore:
    """Where an example of the first divergent batch had already been fed."""

    run: str  # "A" or "B": the run whose batch holds the example
    position: int  # its position in the divergent step's batch
    example_hash: str
    seen: list[dict] = field(default_factory=list)  # [{run, step, position}] earlier occurrences



def seen_before(runs: dict[str, Run], step: int, positions: list[int]) -> list[SeenBefore]:
    """For each differing example of each run at `step`: where it was fed earlier, in either run."""
    hashes = {name: read_example_hashes(run, stop=step + 1) for name, run in runs.items()}
    starts = {name: run.trace.start for name, run in runs.items()}
    found: list[SeenBefore] = []
    for name, table in hashes.items():
        row = table[step - starts[name]]
        for pos in positions:
            if pos >= len(row):
                continue
            target = row[pos]
            seen = []
            for other, other_table in hashes.items():
                flat = other_table.reshape(-1)
                width = other_table.shape[1]
                # Earlier than (step, pos) in the run itself; earlier than `step` in the other run.
                limit = (step - starts[other]) * width + (pos if other == name else 0)
                for idx in np.flatnonzero(flat[:limit] == target)[:5]:
                    seen.append({"run": other, "step": int(idx // width) + starts[other], "position": int(idx % width)})
            found.append(SeenBefore(name, pos, f"{int(target):016x}", seen))
    return found


def _data_at(report: BisectReport, run_a: Run, run_b: Run, step: int, positions: list[int]) -> None:
    """The batches at a divergent step differ: whether they hold the same examples in another
    order (a permutation, no new data), and where each differing example was fed before."""
    if step not in run_a.trace or step not in run_b.trace:
        return  # no recorded hashes at that step (a sparse trace): refinement says what it can
    ha, hb = run_a.trace.read(step).example_hashes, run_b.trace.read(step).example_hashes
    moved = permutation(ha, hb)
    if moved is not None:
        report.permutation = {"step": step, **moved}
        report.notes.append(f"step {step}: B's batch holds the same {moved['examples']} examples as A's in another "
                            f"order ({moved['moved']} moved): a permutation within the batch, not new data")
    report.examples = seen_before({"A": run_a, "B": run_b}, step, positions)
