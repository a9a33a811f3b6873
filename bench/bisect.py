"""How long bisect takes on two long traces, and how many replays a sparse bisect needs.

Part 1 writes two synthetic step-level runs of --steps steps (16 per-example hashes a step)
that agree up to a random step, then times `replay.bisect.bisect` (refinement by replay off:
there is nothing to replay in a synthetic run). Two divergences are timed: a numerical one
(the loss differs by one ULP from that step on; the budget case) and a data one (other
examples from that step on, so bisect also searches both runs' whole history for where each
differing example was fed before).

Part 2 (skip with --no-sparse) trains two `tiny` runs recorded with trace.level=off (no
records, checkpoints every 10 steps), one with a bitflip fault, and counts the replays the
binary search needs to find the step.

Prints one JSON object on its last line: seconds_1m_steps (budget <= 2.0 at 1,000,000 steps),
seconds_1m_steps_data_cause, found steps, replays, replay_bound (ceil(log2(N)) + 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import tempfile
import time
from pathlib import Path

import numpy as np

from bench._synthetic import SCHEMA, records
from traces import Run


def write_run(path: Path, steps: int, diverge_at: int | None, kind: str) -> None:
    run = Run.create(path, SCHEMA, {"config": {"synthetic": True}})
    writer = run.writer()
    for rec in records(steps, seed=0):
        if diverge_at is not None and rec.step >= diverge_at:
            if kind == "loss":
                metrics = rec.metrics.copy()
                metrics.view(np.uint32)[0] += 1
                rec = dataclasses.replace(rec, metrics=metrics)
            else:
                rec = dataclasses.replace(rec, example_hashes=rec.example_hashes ^ np.uint64(0x9E3779B97F4A7C15))
        writer.append(rec)
    run.finish()


def time_bisect(root: Path, steps: int, first: int, kind: str) -> tuple[float, dict]:
    from replay.bisect import bisect

    write_run(root / f"a-{kind}", steps, None, kind)
    write_run(root / f"b-{kind}", steps, first, kind)
    t0 = time.perf_counter()
    report = bisect(Run.open(root / f"a-{kind}"), Run.open(root / f"b-{kind}"), refine=False)
    return time.perf_counter() - t0, report.to_json()


def sparse_replays(root: Path, steps: int = 40, flip_at: int = 23) -> dict:
    from replay.bisect import bisect
    from trainer.config import apply_overrides
    from trainer.presets import get_preset
    from trainer.faults import Fault, FaultPlan
    from trainer.loop import train

    cfg = apply_overrides(get_preset("tiny"), [f"steps={steps}", "trace.level=off", "checkpoint.every_steps=10"])
    train(cfg, root / "sparse-a")
    train(cfg, root / "sparse-b", faults=FaultPlan([Fault("bitflip", flip_at)], cfg))
    report = bisect(Run.open(root / "sparse-a"), Run.open(root / "sparse-b")).to_json()
    return {"sparse_steps": steps, "sparse_planted_step": flip_at, "sparse_found_step": report["first_step"],
            "replays": report["replays"], "replay_bound": math.ceil(math.log2(steps)) + 2}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=1_000_000)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--no-sparse", action="store_true")
    args = parser.parse_args()
    first = random.Random(args.seed).randrange(1, args.steps)
    out = {"bench": "bisect", "steps": args.steps, "first_divergence": first, "budget_seconds_1m_steps": 2.0}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        seconds, report = time_bisect(root, args.steps, first, "loss")
        out.update(seconds_1m_steps=round(seconds, 3), found_step=report["first_step"], cause=report["cause"])
        seconds, report = time_bisect(root, args.steps, first, "data")
        out.update(seconds_1m_steps_data_cause=round(seconds, 3), found_step_data=report["first_step"],
                   cause_data=report["cause"])
        if not args.no_sparse:
            out.update(sparse_replays(root))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
