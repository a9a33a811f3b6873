"""What the recording API costs a user's loop: examples/optax_loop.py, unwrapped vs `run.step`-wrapped.

One process, three lanes per size (bench/_api_lanes.py), each with its own state and the same
batches: `off` (the plain jitted step), `step` (run.step(level="step"): metrics, RNG words,
per-example hashes) and `layer` (run.step(), the default: also fingerprints of the state entering
the step, the taps and the new state). A step is the loop body minus checkpoints: take the batch
(built one step ahead), call the step. A round runs `--steps-per-round` steps of one lane then
waits for its state; rounds visit the lanes in an order rotated from round to round, so drift
hits every lane alike; the first `--warmup-rounds` are discarded. Overheads are ratios of median
seconds per step, minus one, in wall time and in the process's CPU time (on a CPU backend the
step's own compute and the recorder's host work share the cores: CPU time says what recording
costs when the machine is busy with other work, which wall time on a shared machine hides or
exaggerates).

Two sizes by default: the example's own scaled to a ~1 ms step here (where any per-step host work
is the whole ratio; budgets step <= 5%, layer <= 10%, issue 34) and a wider MLP whose step is
tens of milliseconds (budgets step <= 1%, layer <= 3%). `--sketch-width W`: the layer lane also
records each tensor's distance sketch (run.step(sketch_width=W), off by default), against the same
budgets (issue 34 wants sketches cheap enough to be on at the layer level); recorded_sketch_width
is what its trace holds. Prints one JSON line: per size, the overheads with their budgets beside
them, the absolute cost per step in microseconds, the medians, and whether the lanes trained
bit-identically (the wrapper must not change what the step computes); the 1-minute load average
before and after (this machine is shared).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from bench import _api_lanes
from traces import Run
from traces.sketch import check_width

# Issue 34: (step level, layer level) per size; the small size is the example's ~1 ms step.
BUDGETS = {"small": {"step_overhead": 0.05, "layer_overhead": 0.10},
           "wide": {"step_overhead": 0.01, "layer_overhead": 0.03}}


def measure(hidden: int, batch: int, rounds: int, steps_per_round: int, warmup_rounds: int, budgets: dict,
            sketch_width: int = 0) -> dict:
    """The three lanes at one size, interleaved: wall, process CPU and the loop's own thread's CPU
    (what recording leaves on the loop's critical path) per step, as medians over rounds."""
    config = _api_lanes.check_config("optax_loop", {"steps": (warmup_rounds + rounds) * steps_per_round, "batch": batch,
                                                    "hidden": (hidden, hidden), "d_in": 64})
    example = importlib.import_module("optax_loop")
    samples = {lvl: {"wall": [], "cpu": [], "loop": []} for lvl in _api_lanes.LANES}
    with tempfile.TemporaryDirectory() as tmp:
        lanes = [_api_lanes.Lane(example, config, lvl, Path(tmp), sketch_width) for lvl in _api_lanes.LANES]
        try:
            for r in range(warmup_rounds + rounds):
                for lane in lanes[r % 3:] + lanes[:r % 3]:
                    t0 = time.thread_time()
                    wall, cpu = lane.run_round(steps_per_round)
                    if r >= warmup_rounds:
                        got = samples[lane.level]
                        got["wall"].append(wall), got["cpu"].append(cpu)
                        got["loop"].append((time.thread_time() - t0) / steps_per_round)
            states = [jax.tree.leaves(jax.device_get(lane.state)) for lane in lanes]
        finally:
            for lane in lanes:
                lane.finish()
        recorded_width = Run.open(Path(tmp) / "layer").schema.sketch_width  # what the layer lane's trace holds
    identical = all(np.asarray(x).tobytes() == np.asarray(y).tobytes() for s in states[1:] for x, y in zip(states[0], s))
    med = {lvl: {k: statistics.median(v) for k, v in got.items()} for lvl, got in samples.items()}
    off = med["off"]
    out = {"hidden": hidden, "batch": batch, "sketch_width": sketch_width, "recorded_sketch_width": recorded_width}
    for lvl in ("step", "layer"):
        m = med[lvl]
        paired = statistics.median(s / o for s, o in zip(samples[lvl]["wall"], samples["off"]["wall"])) - 1
        out.update({f"{lvl}_overhead": round(m["wall"] / off["wall"] - 1, 4), f"budget_{lvl}_overhead": budgets[f"{lvl}_overhead"],
                    f"paired_{lvl}_overhead": round(paired, 4), f"cpu_{lvl}_overhead": round(m["cpu"] / off["cpu"] - 1, 4),
                    f"{lvl}_cost_us": round(1e6 * (m["wall"] - off["wall"]), 1),
                    f"loop_thread_{lvl}_cost_us": round(1e6 * (m["loop"] - off["loop"]), 1)})
    out.update({f"median_{lvl}_s": round(med[lvl]["wall"], 6) for lvl in med})
    out.update({f"median_cpu_{lvl}_s": round(med[lvl]["cpu"], 6) for lvl in med})
    out.update({"rounds": rounds, "steps_per_round": steps_per_round, "identical_training": bool(identical)})
    out["within_budget"] = all(out[f"{lvl}_overhead"] <= budgets[f"{lvl}_overhead"] for lvl in ("step", "layer"))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--warmup-rounds", type=int, default=2)
    p.add_argument("--sizes", default="256x128x40,1024x512x8",
                   help="comma-separated HIDDENxBATCHxSTEPS_PER_ROUND: the example's own size (a ~1 ms step on "
                        "this CPU; the small budgets), then a wider one whose step is tens of milliseconds (the "
                        "wide budgets: every size after the first)")
    p.add_argument("--sketch-width", type=int, default=0,
                   help="the layer lane also records distance sketches of this width (run.step(sketch_width=...); "
                        "a power of two, 8..65536); 0: none, the default of run.step")
    a = p.parse_args(argv)
    if a.sketch_width:
        try:
            check_width(a.sketch_width)
        except ValueError as e:
            p.error(f"--sketch-width: {e}")
    load_before = os.getloadavg()[0]
    sizes = []
    for i, spec in enumerate(a.sizes.split(",")):
        hidden, batch, steps = (int(x) for x in spec.split("x"))
        sizes.append(measure(hidden, batch, a.rounds, steps, a.warmup_rounds, BUDGETS["small" if i == 0 else "wide"],
                             a.sketch_width))
    result = {
        "bench": "record_overhead", "loop": "examples/optax_loop.py", "sizes": sizes,
        "within_budget": {f"{s['hidden']}x{s['batch']}": s["within_budget"] for s in sizes},
        "identical_training": all(s["identical_training"] for s in sizes),
        "backend": jax.default_backend(), "devices": jax.device_count(), "cpus": os.cpu_count(),
        "loadavg_1m_before": round(load_before, 2), "loadavg_1m_after": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
