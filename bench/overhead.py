"""What recording costs a training loop: median step time at trace levels off, step and layer.

Everything runs in one process. Each level gets the program `replay train` would build for it
(`trainer.loop.build`), its own state (all three start from the same initial state and see the
same batches, so they train identically, which is checked) and, for step and layer, its own
`Recorder` writing a real trace into a temporary directory. A step is the body of the loop in
`trainer/loop.py`, minus checkpoints and the progress display:

    state, metrics, hashes = built.run_step(state, step)  # load + hash the batch, put it on the
                                                          # mesh, dispatch the step (async)
    recorder.record(step, metrics, hashes)                # device_get + trace append of step - 1

A round runs `--steps-per-round` steps of one level, then flushes the recorder (so a round
writes exactly its own records) and waits for the state: the round's wall time / steps is
one sample of that level's sustained step time. Each round visits every level, in an order
rotated from round to round, so drift and machine noise hit all levels alike. The first
`--warmup-rounds` rounds are discarded; the overheads are ratios of medians minus one.

Then the same three levels for a user's own loop recorded through the public API
(`replay.init` + `run.step`, issue 11): by default examples/linen_lm.py, a linen LM, at a size
whose step is a real LM step on this CPU (bench/_api_lanes.py; `--api-set KEY=VALUE` changes
its config, `--api-example ''` skips it). Its figures are under "api", with the same budgets.

A fourth lane is the layer level with `trace.sketches=true` (each tensor's distance sketch, for
the cross-framework bisect), under "sketched_layer", against the layer budget: issue 34 wants the
layer level within it with sketches on (`--no-sketches` skips it; "within_budget" then leaves it out).

Prints one JSON object on its last line: step_overhead, layer_overhead (budgets from issue 3:
<= 0.01 and <= 0.03), the median seconds per step of each level, and how they were measured;
"api" holds the user loop's; "within_budget" is true only when both are.
`--attention-rounds N` adds the attention comparison (issue 14, bench/_attention.py): the
preset's step at level off, at 512 tokens, with model.attention=explicit (the hand-written
softmax) and =fused (jax.nn.dot_product_attention), ABBA-interleaved; "attention" holds the
paired ratio fused / explicit - 1 in wall and CPU time with a 95% interval of its median and a
verdict against the budget (<= 0.01: no slower). `--attention-only` measures only that:

    python -m bench.overhead --attention-only --attention-rounds 16 --steps-per-round 2 --warmup-rounds 1

Wall time is what the budgets are about; the same ratios in process CPU time (cpu_*) and the
load average are printed too, because on a shared machine other processes' load moves wall
time far more than recording does.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax

from traces import TraceWriter
from trainer import mesh as meshlib
from trainer.data import DataError
from trainer.config import ConfigError, apply_overrides
from trainer.presets import get_preset
from trainer.loop import build
from trainer.mesh import MeshError
from replay.record.recorder import Recorder
from trainer.constants import TRACE_LEVELS
from trainer import sketches as trainer_sketches
from trainer.step import tensor_schema

BUDGETS = {"step_overhead": 0.01, "layer_overhead": 0.03, "attention_slowdown": 0.01}
SKETCHED = "layer+sketches"  # the layer level with each tensor's distance sketch (trace.sketches=true)


class Lane:
    """One recording level: its compiled step, state, recorder and position in the data."""

    def __init__(self, cfg, level: str, trace_dir: Path, sketches: bool = False):
        """`sketches`: the layer level with trace.sketches=true (named SKETCHED), else the config's."""
        self.level = SKETCHED if sketches else level
        cfg = apply_overrides(cfg, [f"trace.level={level}", "trace.layer_every=1",
                                    *(["trace.sketches=true"] if sketches else [])])
        self.built = build(cfg)  # what `replay train` compiles and runs, step for step
        self.state = meshlib.init_sharded_state(cfg, self.built.mesh)
        self.writer = TraceWriter(trace_dir / self.level, self.built.schema) if level != "off" else None
        self.recorder = Recorder(self.built.schema, self.writer, level)
        self.step = 0

    def run_round(self, steps: int) -> tuple[float, float]:
        """(wall, process CPU) seconds per step over `steps` loop steps, pipeline drained at the end."""
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(steps):  # the body of trainer/loop.py's loop, minus checkpoints and display
            self.state, metrics, hashes = self.built.run_step(self.state, self.step)
            self.recorder.record(self.step, metrics, hashes)
            self.step += 1
        self.recorder.flush()
        jax.block_until_ready(self.state)
        return (time.perf_counter() - t0) / steps, (time.process_time() - c0) / steps

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def measure(preset: str, rounds: int, steps_per_round: int, warmup_rounds: int, overrides: list[str],
            sketched: bool = True) -> dict:
    """`sketched`: a fourth lane, the layer level with sketches on (issue 34 wants the layer level
    within its budget with them on), judged against the layer budget."""
    cfg = apply_overrides(get_preset(preset), overrides)
    if sketched:
        try:  # refused before anything compiles
            trainer_sketches.check(apply_overrides(cfg, ["trace.level=layer", "trace.sketches=true"]))
        except ConfigError as e:
            raise ConfigError(f"{e} (or pass --no-sketches to skip the sketched lane)") from None
    levels = (*TRACE_LEVELS, *([SKETCHED] if sketched else []))
    wall: dict[str, list[float]] = {lvl: [] for lvl in levels}
    cpu: dict[str, list[float]] = {lvl: [] for lvl in levels}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="replay-bench-overhead-") as tmp:
        lanes = [Lane(cfg, lvl, Path(tmp)) for lvl in TRACE_LEVELS]
        if sketched:
            lanes.append(Lane(cfg, "layer", Path(tmp), sketches=True))
        try:
            for r in range(warmup_rounds + rounds):
                order = lanes[r % len(lanes):] + lanes[:r % len(lanes)]
                for lane in order:
                    seconds, cpu_seconds = lane.run_round(steps_per_round)
                    if r >= warmup_rounds:
                        wall[lane.level].append(seconds)
                        cpu[lane.level].append(cpu_seconds)
        finally:
            for lane in lanes:
                lane.close()
        # Same data, same programs up to recording: the levels must have trained identically.
        finals = [jax.device_get(lane.state.params) for lane in lanes]
        identical = all(
            all((a == b).all() for a, b in zip(jax.tree.leaves(finals[0]), jax.tree.leaves(f))) for f in finals[1:]
        )
    med = {lvl: statistics.median(s) for lvl, s in wall.items()}
    cpu_med = {lvl: statistics.median(s) for lvl, s in cpu.items()}
    # Per-round paired ratios: a second estimate, robust to slow drift within the run.
    paired = {lvl: statistics.median(s / o for s, o in zip(wall[lvl], wall["off"])) - 1 for lvl in levels[1:]}
    result = {
        "bench": "overhead",
        "preset": preset,
        "step_overhead": round(med["step"] / med["off"] - 1, 5),
        "layer_overhead": round(med["layer"] / med["off"] - 1, 5),
        "median_off_s": round(med["off"], 6),
        "median_step_s": round(med["step"], 6),
        "median_layer_s": round(med["layer"], 6),
        "paired_step_overhead": round(paired["step"], 5),
        "paired_layer_overhead": round(paired["layer"], 5),
        # The same medians in process CPU time (all threads): what recording costs in work done,
        # much less disturbed than wall time when other processes share the cores.
        "cpu_step_overhead": round(cpu_med["step"] / cpu_med["off"] - 1, 5),
        "cpu_layer_overhead": round(cpu_med["layer"] / cpu_med["off"] - 1, 5),
        "median_cpu_off_s": round(cpu_med["off"], 6),
        "rounds": rounds,
        "warmup_rounds": warmup_rounds,
        "steps_per_round": steps_per_round,
        "tensors_per_layer_record": len(tensor_schema(cfg)),
        "devices": int(lanes[0].built.mesh.devices.size),
        "cpus": os.cpu_count(),
        "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],  # 1-min, before and after
        "identical_training": bool(identical),
        "budget_step_overhead": BUDGETS["step_overhead"],
        "budget_layer_overhead": BUDGETS["layer_overhead"],
    }
    result["within_budget"] = (result["step_overhead"] <= BUDGETS["step_overhead"]
                               and result["layer_overhead"] <= BUDGETS["layer_overhead"])
    if sketched:
        result["sketched_layer"] = {
            "overhead": round(med[SKETCHED] / med["off"] - 1, 5),
            "paired_overhead": round(paired[SKETCHED], 5),
            "cpu_overhead": round(cpu_med[SKETCHED] / cpu_med["off"] - 1, 5),
            "median_s": round(med[SKETCHED], 6),
            "budget_overhead": BUDGETS["layer_overhead"],
            "recorded_sketch_width": int(lanes[-1].built.schema.sketch_width),  # what its trace holds
        }
        result["sketched_layer"]["within_budget"] = result["sketched_layer"]["overhead"] <= BUDGETS["layer_overhead"]
        result["within_budget"] = result["within_budget"] and result["sketched_layer"]["within_budget"]
    return result


def compare_attention(preset: str, rounds: int, steps_per_round: int, warmup_rounds: int,
                      overrides: list[str]) -> dict:
    """Level-off step time with the explicit and the fused attention (bench/_attention.py)."""
    from bench import _attention

    return _attention.compare(preset, rounds, steps_per_round, warmup_rounds, overrides,
                              BUDGETS["attention_slowdown"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="demo")
    parser.add_argument("--rounds", type=int, default=30, help="measured rounds (each visits every level)")
    parser.add_argument("--steps-per-round", type=int, default=5, help="loop steps per level per round")
    parser.add_argument("--warmup-rounds", type=int, default=1, help="rounds run first and discarded")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="config override, as for `replay train` (repeatable)")
    parser.add_argument("--api-example", default="linen_lm",
                        help="an example in examples/ to measure through the recording API ('' to skip)")
    parser.add_argument("--api-set", dest="api_overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="an override of that example's Config (repeatable)")
    parser.add_argument("--api-rounds", type=int, default=0, help="measured rounds of the example (default: --rounds)")
    parser.add_argument("--api-steps-per-round", type=int, default=5, help="example steps per level per round")
    parser.add_argument("--attention-rounds", type=int, default=0,
                        help="measured rounds of the explicit vs fused attention comparison (0: skip)")
    parser.add_argument("--attention-only", action="store_true",
                        help="measure only the attention comparison (needs --attention-rounds)")
    parser.add_argument("--no-sketches", action="store_true",
                        help="skip the fourth lane (the layer level with trace.sketches=true, judged against the "
                             "layer budget; a config whose checks refuse sketches needs this)")
    parser.add_argument("--sdc-rounds", type=int, default=8,
                        help="measured rounds of the SDC re-run check at N=10 and N=100 (bench/sdc_overhead.py, "
                             "its own 8-device process; 0: skip)")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps_per_round < 1 or args.warmup_rounds < 0:
        parser.error("--rounds and --steps-per-round must be >= 1, --warmup-rounds >= 0")
    try:
        api_config = _api_config(args.api_overrides)
        if args.api_example:
            from bench import _api_lanes

            _api_lanes.check_config(args.api_example, api_config)  # bad input fails before minutes of measuring
        if args.attention_only:
            if args.attention_rounds < 1:
                parser.error("--attention-only needs --attention-rounds N (N >= 1)")
            result = {"bench": "overhead", "preset": args.preset,
                      "attention": compare_attention(args.preset, args.attention_rounds, args.steps_per_round,
                                                     args.warmup_rounds, args.overrides)}
            result["within_budget"] = result["attention"]["no_slower"]
            print(json.dumps(result))
            return
        result = measure(args.preset, args.rounds, args.steps_per_round, args.warmup_rounds, args.overrides,
                         sketched=not args.no_sketches)
        if args.attention_rounds:
            result["attention"] = compare_attention(args.preset, args.attention_rounds, args.steps_per_round,
                                                    args.warmup_rounds, args.overrides)
    except (ConfigError, DataError, MeshError, ValueError) as e:  # bad input: one line, exit 2, as `replay train`
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if args.api_example:
        from bench import _api_lanes

        with tempfile.TemporaryDirectory(prefix="replay-bench-overhead-api-") as tmp:
            result["api"] = _api_lanes.measure(args.api_example, api_config, args.api_rounds or args.rounds,
                                               args.api_steps_per_round, args.warmup_rounds, Path(tmp), BUDGETS)
        result["trainer_within_budget"] = result["within_budget"]
        result["within_budget"] = result["within_budget"] and result["api"]["within_budget"]
        result["identical_training"] = result["identical_training"] and result["api"]["identical_training"]
    if args.sdc_rounds:
        result["sdc_check"] = _sdc_check(args.sdc_rounds)
        result["within_budget"] = result["within_budget"] and result["sdc_check"]["within_budget"]
    print(json.dumps(result))


def _sdc_check(rounds: int) -> dict:
    """check.rerun_every's overhead at N=10 and N=100 (budget 1/N + 2%), measured by
    bench/sdc_overhead.py in a process of its own: it needs 8 virtual devices before JAX starts."""
    from bench import _eight_devices

    return json.loads(_eight_devices.run("bench.sdc_overhead", "--rounds", str(rounds), "--worker"))


# An LM step of a real shape for this CPU (~0.3 s): the trainer's probe LM's width and sequence.
API_CONFIG = {"batch": 16, "seq": 128, "vocab": 256, "d_model": 128, "heads": 4, "layers": 2, "steps": 10**6}


def _api_config(overrides: list[str]) -> dict:
    config = dict(API_CONFIG)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--api-set {item!r}: expected KEY=VALUE")
        config[key] = int(value) if value.lstrip("-").isdigit() else float(value)
    return config


if __name__ == "__main__":
    main()
