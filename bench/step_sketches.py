"""What `trace.sketches=true` costs the trainer's layer-level step (trainer/sketches.py).

Three programs of the trainer's `--preset` (default tiny), the real train step each: level
`off` (the training outputs only), `layer` (fingerprints and RMS of every recorded tensor) and
`layer` with `trace.sketches=true` (also each tensor's distance sketch and norm). Rounds
interleave them on the same batch; medians of wall time and of process CPU time (others share
this CPU: the CPU ratio is the steadier). Prints one JSON line: the sketches' cost relative to
the level-off step, beside the layer level's budget (0.03 of a step for the whole layer record),
and relative to the layer record without sketches.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

BUDGET = {"layer_over_step": 0.03}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="tiny")
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from trainer.presets import get_preset
    from trainer.step import compile_step, init_state

    cfg = get_preset(args.preset)
    sketched = dataclasses.replace(cfg, trace=dataclasses.replace(cfg.trace, level="layer", sketches=True))
    B, L = cfg.data.global_batch_size, cfg.model.seq_len
    rows = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (B, L + 1)).astype(np.int32)
    batch = {"inputs": jnp.asarray(rows[:, :-1]), "targets": jnp.asarray(rows[:, 1:])}
    programs = {"off": (cfg, "off"), "layer": (cfg, "layer"), "layer+sketches": (sketched, "layer")}
    steps = {k: compile_step(c, lvl) for k, (c, lvl) in programs.items()}
    states = {k: init_state(c) for k, (c, _) in programs.items()}

    def run(k: str) -> None:
        states[k], metrics = steps[k](states[k], batch)
        jax.block_until_ready(metrics)

    for k in steps:
        run(k)
    wall = {k: [] for k in steps}
    cpu = {k: [] for k in steps}
    names = list(steps)
    for r in range(args.rounds):
        for k in names[r % 3:] + names[:r % 3]:
            t0, c0 = time.perf_counter(), time.process_time()
            run(k)
            wall[k].append(time.perf_counter() - t0)
            cpu[k].append(time.process_time() - c0)
    med = {k: statistics.median(v) for k, v in wall.items()}
    cmed = {k: statistics.median(v) for k, v in cpu.items()}
    out = {"preset": args.preset, "rounds": args.rounds, "median_s": med, "cpu_median_s": cmed,
           "layer_over_step": med["layer"] / med["off"] - 1, "cpu_layer_over_step": cmed["layer"] / cmed["off"] - 1,
           "sketches_over_step": (med["layer+sketches"] - med["layer"]) / med["off"],
           "cpu_sketches_over_step": (cmed["layer+sketches"] - cmed["layer"]) / cmed["off"],
           "sketches_over_layer_record": (med["layer+sketches"] - med["layer"]) / max(med["layer"] - med["off"], 1e-9),
           "budget": BUDGET}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
