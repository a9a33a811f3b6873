"""What bisect says about the data of a divergent step: for each differing example, where it
was fed before (repeated data makes a loss look better than it is), and whether the two
batches hold the same examples in another order (a permutation within the batch, no new data)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from replay.audit import permutation
from traces import Run
from traces.fed import fed, fed_in_both

if TYPE_CHECKING:
    from replay.bisect.report import BisectReport


@dataclass
class SeenBefore:
    """Where an example of the first divergent batch had already been fed."""

    run: str  # "A" or "B": the run whose batch holds the example
    position: int  # its position in the divergent step's batch
    example_hash: str
    seen: list[dict] = field(default_factory=list)  # [{run, step, position}] earlier occurrences



def seen_before(runs: dict[str, Run], step: int, positions: list[int], limit: int = 5) -> list[SeenBefore]:
    """For each differing example of each run at `step`: where it was fed earlier, in either run
    (the first `limit` places, in order). A place in the same run is marked `same_epoch` when the
    run declares its dataset's size (replay.init(dataset_size=N): epoch e feeds example slots
    e*N .. e*N + N - 1, a step's batch its B slots in order): an example fed again in a later
    epoch is what multi-epoch training does, one fed twice in an epoch is repeated data.

    One search for all the examples of both batches, through the segments' indexes
    (traces.fed): at 1.4M steps about a block read a hash a segment, never the records. The
    steps before the runs' first differing batch (their batch-hash columns) are searched in
    one run only, the other's per-example search starting there (traces.fed.fed_in_both).
    """
    rows = {name: run.trace.read(step).example_hashes for name, run in runs.items()}
    wanted = {name: [(pos, row[pos]) for pos in positions if pos < len(row)] for name, row in rows.items()}
    queries = np.array([h for pairs in wanted.values() for _, h in pairs], np.uint64)
    # Copies within the step itself come after the earlier places: ask for enough to skip them.
    extra = max((int(np.count_nonzero(row == h)) for name, row in rows.items() for _, h in wanted[name]), default=0)
    if len(runs) == 2:
        places = dict(zip(runs, fed_in_both(*runs.values(), queries, before_step=step + 1, limit=limit + extra)))
    else:
        places = {other: fed(run, queries, before_step=step + 1, limit=limit + extra) for other, run in runs.items()}
    width = {name: run.schema.examples_per_step for name, run in runs.items()}
    sizes = {name: _dataset_size(run) for name, run in runs.items()}
    found: list[SeenBefore] = []
    for name, pairs in wanted.items():
        for pos, target in pairs:
            seen = []
            for other in runs:
                # Earlier than (step, pos) in the run itself; earlier than `step` in the other run.
                limit_slot = step * width[other] + (pos if other == name else 0)
                earlier = [(s, p) for s, p in places[other].get(int(target), []) if s * width[other] + p < limit_slot]
                for s, p in earlier[:limit]:
                    place = {"run": other, "step": s, "position": p}
                    if other == name and sizes[name]:
                        n = sizes[name]
                        place["same_epoch"] = (s * width[name] + p) // n == (step * width[name] + pos) // n
                    seen.append(place)
            found.append(SeenBefore(name, pos, f"{int(target):016x}", seen))
    return found


def _dataset_size(run: Run) -> int | None:
    size = run.manifest.get("dataset_size")
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None


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
