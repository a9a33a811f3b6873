"""Lanes for measuring what `run.step` costs a user's loop (one of examples/), side by side.

A lane is one copy of the example's loop at one recording level: `off` (the plain jitted step),
`step` (`run.step(level="step")`: metrics, RNG words, per-example hashes, the trace write) and
`layer` (`run.step()`, the default: also fingerprints of the state, the taps and the new state).
Each lane has its own state and its own copy of the data (the example's `batch_at` or its data
iterator, read one batch ahead), so all lanes see the same batches and must train bit-identically,
which is checked.
A lane step is the example's loop body minus checkpoints: get the batch, call the step. A round
runs some steps of one lane, then waits for its state; `measure` visits the lanes in an order
rotated from round to round, so drift and other processes' load hit every lane alike.
"""

from __future__ import annotations

import dataclasses
import importlib
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import replay  # noqa: E402
from replay.record.options import RECORD_LEVELS  # noqa: E402

LANES = ("off", *RECORD_LEVELS)  # "off": the loop's step unwrapped, then each recording level


class Lane:
    def __init__(self, example: Any, config: dict, level: str, root: Path, sketch_width: int = 0):
        """`sketch_width`: the layer lane also records distance sketches of this width (run.step's)."""
        self.level = level
        self.loop = example.make(config)
        self.run = None
        self.step_fn = self.loop.step
        if level != "off":
            self.run = replay.init(root / level, config=config, entrypoint=example.make)
            self.step_fn = self.run.step(level=level, metric_kinds=getattr(example, "METRIC_KINDS", {}),
                                         sketch_width=sketch_width if level == "layer" else 0)(self.loop.step)
        self.state = self.loop.init()
        self._batches = self.loop.data() if self.loop.batch_at is None else None
        self.k = 0
        self._ahead = self._fetch(0)

    def _fetch(self, k: int) -> Any:
        return next(self._batches) if self._batches is not None else self.loop.batch_at(k)

    def batch(self) -> Any:
        """Step k's batch, fetched one step ahead (as flax's prefetch_to_device does in a real input
        pipeline): the batch a step gets is on device already, in every lane alike, so what is
        measured is recording, not a host copy of a transfer issued just before."""
        batch, self._ahead = self._ahead, self._fetch(self.k + 1)
        return batch

    def run_round(self, steps: int) -> tuple[float, float]:
        """(wall, process CPU) seconds per step over `steps` steps, the device drained at the end."""
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(steps):
            self.state, _ = self.step_fn(self.state, self.batch())
            self.k += 1
        jax.block_until_ready(self.state)
        return (time.perf_counter() - t0) / steps, (time.process_time() - c0) / steps

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()


def check_config(example_name: str, config: dict) -> dict:
    """The example's full config (dataclasses.asdict of its Config), or ValueError naming what is wrong."""
    try:
        example = importlib.import_module(example_name)
    except ImportError:
        raise ValueError(f"--api-example {example_name!r}: no such example in examples/") from None
    try:
        return dataclasses.asdict(example.Config(**config))
    except TypeError as e:
        raise ValueError(f"--api-set: {example_name}.Config does not take that ({e})") from None


def measure(example_name: str, config: dict, rounds: int, steps_per_round: int, warmup_rounds: int,
            root: Path, budgets: dict) -> dict:
    """The three lanes of one example at one config, interleaved; ratios of median seconds a step."""
    config = check_config(example_name, config)
    example = importlib.import_module(example_name)
    wall: dict[str, list[float]] = {lvl: [] for lvl in LANES}
    cpu: dict[str, list[float]] = {lvl: [] for lvl in LANES}
    lanes = [Lane(example, config, lvl, root / example_name) for lvl in LANES]
    try:
        for r in range(warmup_rounds + rounds):
            for lane in lanes[r % 3:] + lanes[:r % 3]:
                seconds, cpu_seconds = lane.run_round(steps_per_round)
                if r >= warmup_rounds:
                    wall[lane.level].append(seconds)
                    cpu[lane.level].append(cpu_seconds)
        states = [jax.tree.leaves(jax.device_get(lane.state)) for lane in lanes]
    finally:
        for lane in lanes:
            lane.finish()
    identical = all(np.asarray(x).tobytes() == np.asarray(y).tobytes() for s in states[1:] for x, y in zip(states[0], s))
    med = {k: statistics.median(v) for k, v in wall.items()}
    cpu_med = {k: statistics.median(v) for k, v in cpu.items()}
    # Per-round paired ratios: a second estimate, robust to drift within the run (as bench/overhead.py's).
    paired = {lvl: statistics.median(s / o for s, o in zip(wall[lvl], wall["off"])) - 1 for lvl in ("step", "layer")}
    out = {
        "loop": f"examples/{example_name}.py", "config": config,
        "step_overhead": round(med["step"] / med["off"] - 1, 5), "layer_overhead": round(med["layer"] / med["off"] - 1, 5),
        "budget_step_overhead": budgets["step_overhead"], "budget_layer_overhead": budgets["layer_overhead"],
        "paired_step_overhead": round(paired["step"], 5), "paired_layer_overhead": round(paired["layer"], 5),
        "cpu_step_overhead": round(cpu_med["step"] / cpu_med["off"] - 1, 5),
        "cpu_layer_overhead": round(cpu_med["layer"] / cpu_med["off"] - 1, 5),
        # The absolute cost a step: a fixed few hundred microseconds of host work, whatever the step.
        "step_cost_us": round(1e6 * (med["step"] - med["off"]), 1), "layer_cost_us": round(1e6 * (med["layer"] - med["off"]), 1),
        "median_off_s": round(med["off"], 6), "median_step_s": round(med["step"], 6), "median_layer_s": round(med["layer"], 6),
        "rounds": rounds, "steps_per_round": steps_per_round, "warmup_rounds": warmup_rounds,
        "identical_training": bool(identical),
    }
    out["within_budget"] = (out["step_overhead"] <= budgets["step_overhead"]
                            and out["layer_overhead"] <= budgets["layer_overhead"])
    return out
