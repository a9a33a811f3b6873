"""How fast `replay run` re-runs steps compared with training them: `replay_over_train`.

Both sides run in this one process, each with its own compiled step, and compile time is
excluded from both (each program is compiled once, before any timing):

    train   the training loop as `replay train` runs it (`trainer.loop.run_prepared` on a job
            prepared once): N steps recorded at the preset's trace level, checkpoints at 0
            and N. Timed: the loop (`TrainResult.seconds`): the N steps, the recording and
            the checkpoint saved at N; the initial state and checkpoint 0 come before it.
    replay  what `replay run RUN --steps 0:N-1` does once its program is compiled
            (`replay.engine.engine.replay` with the trainer's `TrainerReplay`): restore checkpoint 0,
            re-run the N steps, compare every recorded field of every step with the trace.
            Timed: all of that.

A round trains one new run and replays the run trained first (the same steps, the same
records); the order of the two alternates from round to round so drift and machine noise
hit both alike, and the first `--warmup-rounds` rounds are discarded.
`replay_over_train` is replay steps/s divided by training steps/s, from the medians (a
paired per-round median is printed too). The budget is 0.95: replaying a step must cost
about what training it did.

    python -m bench.replay_speed [--preset tiny] [--steps 100] [--rounds 8] [--set KEY=VALUE ...]

`restore_s` (a checkpoint-0 restore alone, timed each round) shows what part of a replay the
restore is. The default is `tiny` (about a minute on 2 busy cores); `--preset demo --steps 20`
measures a compute-bound step instead (a few minutes). A persistent compilation cache in the
temporary folder makes the per-run initial-state program cheap to rebuild (never timed).

Prints one JSON object on its last line. `ok` is true when replay_over_train meets the
budget and every replayed step was bit-exact (a fast replay that verifies nothing is not ok).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

BUDGET = 0.95


def measure(preset: str, steps: int, rounds: int, warmup_rounds: int, overrides: list[str]) -> dict:
    from replay.engine.contract import evaluate
    from replay.engine.engine import replay
    from traces import Run
    from trainer.config import apply_overrides
    from trainer.presets import get_preset
    from trainer.loop import prepare, run_prepared
    from trainer.replayable import TrainerReplay

    import jax

    cfg = apply_overrides(get_preset(preset), [*overrides, f"steps={steps}", f"checkpoint.every_steps={steps}"])
    load_before = os.getloadavg()[0]
    train_s: list[float] = []
    replay_s: list[float] = []
    restore_s: list[float] = []
    exact = True
    with tempfile.TemporaryDirectory(prefix="replay-bench-speed-") as tmp:
        # Each new run builds its initial state with a freshly jitted program; the cache keeps
        # that from costing a full compile per round (it is outside both timings anyway).
        jax.config.update("jax_compilation_cache_dir", str(Path(tmp) / "jax-cache"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        t0 = time.perf_counter()
        job = prepare(cfg, Path(tmp) / "run-0", preset=preset)  # compiles the training step
        compile_train = time.perf_counter() - t0

        def train_once(r: int) -> float:
            return run_prepared(dataclasses.replace(job, out=Path(tmp) / f"run-{r}")).seconds

        first_train = train_once(0)  # the run every round replays
        run = Run.open(Path(tmp) / "run-0")
        t0 = time.perf_counter()
        rep = TrainerReplay(run)  # compiles the replay's step (what `replay run` does before replaying)
        compile_replay = time.perf_counter() - t0
        contract = evaluate(run.manifest["environment"], rep.environment(), run.manifest.get("program_hash"),
                            rep.program_hash())

        def replay_once() -> float:
            nonlocal exact
            t = time.perf_counter()
            report = replay(run, rep, 0, steps - 1, contract)
            seconds = time.perf_counter() - t
            exact = exact and report.exact and len(report.steps) == steps
            return seconds

        def restore_once() -> float:
            t = time.perf_counter()
            jax.block_until_ready(rep.restore(0))
            return time.perf_counter() - t

        for r in range(warmup_rounds + rounds):
            if r % 2:
                pair = (train_once(r + 1), replay_once())
            else:
                rs = replay_once()
                pair = (train_once(r + 1), rs)
            restored = restore_once()
            if r >= warmup_rounds:
                train_s.append(pair[0])
                replay_s.append(pair[1])
                restore_s.append(restored)
    med_train, med_replay = statistics.median(train_s), statistics.median(replay_s)
    ratio = med_train / med_replay  # (steps / replay_s) / (steps / train_s)
    result = {
        "bench": "replay_speed",
        "preset": preset,
        "steps": steps,
        "rounds": rounds,
        "warmup_rounds": warmup_rounds,
        "trace_level": cfg.trace.level,
        "compile": "excluded from both (each side compiled once, before timing)",
        "compile_train_s": round(compile_train, 3),
        "compile_replay_s": round(compile_replay, 3),
        "first_train_s": round(first_train, 4),
        "train_s": [round(s, 4) for s in train_s],
        "replay_s": [round(s, 4) for s in replay_s],
        "restore_s": round(statistics.median(restore_s), 4),
        "train_steps_per_s": round(steps / med_train, 3),
        "replay_steps_per_s": round(steps / med_replay, 3),
        "paired_replay_over_train": round(statistics.median(t / r for t, r in zip(train_s, replay_s)), 4),
        "all_bit_exact": bool(exact),
        "contract": contract.line,
        "cpus": os.cpu_count(),
        "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],  # 1-min, before and after
        "replay_over_train": round(ratio, 4),
        "replay_over_train_budget": BUDGET,
    }
    result["ok"] = bool(ratio >= BUDGET and exact)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=100, help="steps trained and replayed per round")
    parser.add_argument("--rounds", type=int, default=8, help="measured rounds (each trains and replays once)")
    parser.add_argument("--warmup-rounds", type=int, default=1, help="rounds run first and discarded")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="config override, as for `replay train` (repeatable)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.rounds < 1 or args.warmup_rounds < 0:
        parser.error("--steps and --rounds must be >= 1, --warmup-rounds >= 0")
    from trainer.config import ConfigError
    from trainer.data import DataError
    from trainer.mesh import MeshError

    try:
        result = measure(args.preset, args.steps, args.rounds, args.warmup_rounds, args.overrides)
    except (ConfigError, DataError, MeshError) as e:  # bad input: one line, exit 2, as `replay train`
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(json.dumps(result))


if __name__ == "__main__":
    main()
