"""Does the step loop wait for the per-example hash gather? Two local processes, old vs new.

Two processes on this machine (jax.distributed on 127.0.0.1, one CPU device each) train the
same run with the old blocking gather of the per-example hashes before each step is dispatched
(`Built.hash_gather = "blocking"`) and with the asynchronous device gather
(replay/record/gather.py), `--rounds` times each, alternating which goes first. Each process
keeps a `Timeline`: the host time each step was dispatched, its hashes reached the host, its
record was written, and (a watcher thread) its outputs were ready.

Per mode, after `--warmup` steps: steps/s (process 0, median over rounds); `ahead_share_min`,
the smallest share, over rounds and processes, of steps k for which step k+1 was dispatched
before step k finished (the host running ahead of its devices); `lead_s_median`, the median of
finished(k) - dispatched(k+1) (positive: ahead); `gathered_after_next_dispatch`, whether every
step's hashes reached the host only after the next step was dispatched. `traces_identical`:
every run's trace directory equal, file by file and byte by byte, to the first blocking run's.

    python -m bench.multihost_dispatch [--steps 40] [--warmup 5] [--rounds 3] [--set KEY=VALUE ...] [--out DIR]

One JSON object on the last line, with budgets beside the figures: the asynchronous gather
must run ahead on >= 90% of steps, be no slower than the blocking one, and leave the trace
byte-identical. On a CPU backend the "devices" are the host's own cores, so running ahead
overlaps host work with device work on the same cores and gains no compute: steps/s there is
about load, not the gather; the ordering figures are what the change is about.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

MODES = ("blocking", "async")
BUDGETS = {"async_ahead_share_min": 0.9, "async_vs_blocking_steps_per_s_min": 1.0, "traces_identical": True}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(steps: int, overrides: list[str]):
    from trainer.config import apply_overrides
    from trainer.presets import get_preset

    # Checkpoints only at the end: a checkpoint flushes the recorder, which is not what is measured.
    return apply_overrides(get_preset("tiny"), [f"steps={steps}", "checkpoint.every_steps=0", *overrides])


def _orders(rounds: int) -> list[tuple[int, str]]:
    """(round, mode) in training order: the modes alternate which goes first, so load drifting on a
    shared machine hits both alike."""
    return [(r, m) for r in range(rounds) for m in (MODES if r % 2 == 0 else MODES[::-1])]


def worker(args: argparse.Namespace) -> None:
    import jax

    jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=2, process_id=args.process_id)
    from replay.record.gather import Timeline
    from trainer.loop import prepare, run_prepared

    cfg = _config(args.steps, args.set)
    out = Path(args.out)
    for r, mode in _orders(args.rounds):
        job = prepare(cfg, out / f"{mode}-{r}")
        job.built.hash_gather = mode
        job.built.timeline = timeline = Timeline(watch=True)
        run_prepared(job)
        timeline.close()
        events = [list(e) for e in timeline.events]
        (out / f"timeline-{mode}-{r}-{args.process_id}.json").write_text(json.dumps(events))


def _tree_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def summarize(events: list[list], warmup: int) -> dict:
    """The dispatch-vs-finish figures of one process's timeline (see the module docstring)."""
    at: dict[str, dict[int, float]] = {}
    for event, step, t in events:
        at.setdefault(event, {})[int(step)] = float(t)
    dispatched, finished, gathered = at.get("dispatched", {}), at.get("finished", {}), at.get("gathered", {})
    steps = sorted(s for s in dispatched if s >= warmup and s + 1 in dispatched and s in finished)
    leads = [finished[s] - dispatched[s + 1] for s in steps]
    span = finished[steps[-1]] - finished[steps[0]] if len(steps) > 1 else 0.0
    order = [(e, int(s)) for e, s, _ in events if e != "finished"]
    pos = {ev: i for i, ev in enumerate(order)}
    late = [s for s in gathered if ("dispatched", s + 1) in pos]
    return {
        "steps_measured": len(steps),
        "steps_per_s": round((len(steps) - 1) / span, 2) if span > 0 else None,
        "ahead_share": round(sum(lead > 0 for lead in leads) / len(leads), 3) if leads else None,
        "lead_s_median": round(statistics.median(leads), 5) if leads else None,
        "gathered_after_next_dispatch": bool(late) and all(pos[("gathered", s)] > pos[("dispatched", s + 1)]
                                                           for s in late),
    }


def run(steps: int, warmup: int, overrides: list[str], out: Path, rounds: int = 1, timeout: float = 900) -> dict:
    """Spawns the two workers, waits for them and returns the JSON figures."""
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    port = _free_port()
    cmd = [sys.executable, "-m", "bench.multihost_dispatch", "--worker", "--coordinator", f"127.0.0.1:{port}",
           "--steps", str(steps), "--out", str(out), "--rounds", str(rounds)] + [f"--set={s}" for s in overrides]
    root = Path(__file__).resolve().parents[1]
    procs = [subprocess.Popen(cmd + ["--process-id", str(i)], cwd=root, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=timeout) for p in procs]
    if any(p.returncode for p in procs):
        tails = " | ".join(o[1].strip().splitlines()[-1] if o[1].strip() else "" for o in outs)
        raise RuntimeError(f"a worker failed (exit {[p.returncode for p in procs]}): {tails}")
    figures = {}
    for mode in MODES:
        per_round = [[summarize(json.loads((out / f"timeline-{mode}-{r}-{i}.json").read_text()), warmup)
                      for i in range(2)] for r in range(rounds)]
        rates = [p[0]["steps_per_s"] for p in per_round if p[0]["steps_per_s"]]
        figures[mode] = {
            "steps_per_s_median": round(statistics.median(rates), 2) if rates else None,
            "steps_per_s_rounds": rates,
            "ahead_share_min": min(p[i]["ahead_share"] or 0 for p in per_round for i in range(2)),
            "lead_s_median": statistics.median(p[0]["lead_s_median"] for p in per_round),
            "gathered_after_next_dispatch": all(p[i]["gathered_after_next_dispatch"] for p in per_round for i in range(2)),
        }
    reference = _tree_bytes(out / "blocking-0" / "trace")
    identical = all(_tree_bytes(out / f"{m}-{r}" / "trace") == reference for r, m in _orders(rounds))
    sa, sb = figures["async"]["steps_per_s_median"], figures["blocking"]["steps_per_s_median"]
    ratio = round(sa / sb, 3) if sa and sb else None
    within = (identical and figures["async"]["ahead_share_min"] >= BUDGETS["async_ahead_share_min"]
              and ratio is not None and ratio >= BUDGETS["async_vs_blocking_steps_per_s_min"])
    return {"bench": "multihost_dispatch", "processes": 2, "steps": steps, "warmup": warmup, "rounds": rounds,
            "overrides": overrides, **figures, "async_vs_blocking_steps_per_s": ratio, "traces_identical": identical,
            "load_average_1m": round(os.getloadavg()[0], 2), "cpu_count": os.cpu_count(),
            "budgets": BUDGETS, "within_budget": bool(within)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--set", action="append", default=[], help="trainer config override KEY=VALUE")
    parser.add_argument("--out", default=None, help="keep the runs and timelines here (default: a temp dir)")
    parser.add_argument("--rounds", type=int, default=3, help="runs per mode, alternating which trains first")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--coordinator", help=argparse.SUPPRESS)
    parser.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return
    if args.out:
        result = run(args.steps, args.warmup, args.set, Path(args.out), args.rounds)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            result = run(args.steps, args.warmup, args.set, Path(tmp), args.rounds)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
