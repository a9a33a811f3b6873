"""One row of the seed table (issue 33 part 3): a run resumed on another process count, against
the same run resumed on the one it started with.

    row("olmo-core", "1->2", resumed, control, since=K) ->
      {"framework": "olmo-core", "processes": "1->2", "steps": 10, "since": 5,
       "refed_examples": 0, "refed_share": 0.0,
       "bisect": {"step": .., "cause": .., "identical": .., "data_identical": true, "compared_steps": 10}}

refed_examples: the examples `replay audit` finds fed again within their epoch at step `since`
or later (the steps fed after the process count changed); refed_share: their share of the
examples fed from `since` on. bisect: `replay bisect control resumed`'s first step and cause
(trace scan only: a torch run has no program to replay), and whether the two runs fed the same
examples at every step both recorded (their batch hashes, column by column, never a record).

`python tools/seed_row.py olmo-core [DIR]` trains OLMo-core's runs (tests/torch/olmo_core_runs.py:
a tiny olmo3_1M on 1 rank to step 5, resumed from OLMo-core's checkpoint on 2 ranks and on 1;
about a minute on two cores) into DIR (default: a temporary folder) and prints its row as JSON.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np


def _batch_hashes(run) -> np.ndarray:
    trace = run.trace
    cols = [trace.column(i, "batch_hash") for i in range(len(trace.segments))]
    return np.concatenate(cols) if cols else np.zeros(0, np.uint64)


def row(framework: str, processes: str, resumed: str | Path, control: str | Path, since: int | None = None) -> dict:
    from replay.audit import audit
    from replay.bisect import bisect
    from replay.bundle import open_run

    a, b = open_run(Path(control)), open_run(Path(resumed))
    report = audit(b)
    B, end = report.examples_per_step, report.end
    since = report.start if since is None else since
    refed = int(np.count_nonzero(report.early_slots >= since * B))
    fed = max(end - since, 0) * B
    found = bisect(a, b, refine=False).to_json()
    ha, hb = _batch_hashes(a), _batch_hashes(b)
    n = min(ha.size, hb.size)
    return {"framework": framework, "processes": processes, "steps": end, "since": since,
            "refed_examples": refed, "refed_share": refed / fed if fed else 0.0,
            "bisect": {"step": found["first_step"], "cause": found["cause"], "identical": found["identical"],
                       "data_identical": bool(np.array_equal(ha[:n], hb[:n])), "compared_steps": n}}


def olmo_core_row(root: Path) -> dict:
    """Trains the OLMo-core seed runs into root and returns their row."""
    from tests.torch.olmo_core_runs import seed_runs

    runs = seed_runs(root)
    segments = json.loads((runs["1->2"] / "run.json").read_text())["olmo_core"]["segments"]
    return row("olmo-core", "1->2", runs["1->2"], runs["1->1"], since=segments[-1]["start_step"])


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ is imported from the checkout
    if len(sys.argv) < 2 or sys.argv[1] != "olmo-core":
        print("error: name the framework whose row to make: python tools/seed_row.py olmo-core [DIR]", file=sys.stderr)
        sys.exit(2)
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else Path(tempfile.mkdtemp(prefix="seed-olmo-core-"))
    out.mkdir(parents=True, exist_ok=True)
    print(json.dumps(olmo_core_row(out)))
