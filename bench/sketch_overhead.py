"""What distance sketches add to a layer-level record: the trainer's step, its fingerprint pass,
and the sketch pass over the same tensors (trace format_version 2, traces/sketch.py).

The layer-level record of trainer/step.py fingerprints every forward layer, gradient and
parameter after the update. This measures, on the trainer's `--preset` (default tiny), with
the parameters standing in for the gradients and parameters (same shapes) and activations of
the layer shapes: `fp` (fingerprints and sums of squares, one jitted program, as recorded
today), `fp+sketch` (the same plus `sketches_of`, in one program: what a v2 record computes),
and `step` (the trainer's train step at level off). Rounds interleave the three; medians of
wall and of process CPU time (others share this CPU: the CPU ratio is the steadier). Prints
one JSON line: the sketch's cost relative to the step (budget beside it: the layer level's
0.03) and to the fingerprint pass.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

BUDGET = {"sketch_over_step": 0.03}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="tiny")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--width", type=int, default=64)
    args = p.parse_args()

    from replay.record.fingerprint import fingerprints_and_sums_of_squares, sketches_of
    from trainer import model
    from trainer.presets import get_preset
    from trainer.step import compile_step, get_path, init_state

    cfg = get_preset(args.preset)
    m = cfg.model
    state = init_state(cfg)
    names = model.param_names(m)
    params = [get_path(state.params, n) for n in names]
    B, L = cfg.data.global_batch_size, m.seq_len
    acts = [jnp.ones((B, L, m.d_model), jnp.float32) * 0.5 for _ in model.layer_names(m)[:-1]]
    acts.append(jnp.ones((B, L, m.vocab_size), jnp.float32))
    tensors = acts + params + params  # forward layers, gradients, parameters after the update

    fp = jax.jit(lambda xs: fingerprints_and_sums_of_squares(xs))
    both = jax.jit(lambda xs: (fingerprints_and_sums_of_squares(xs), sketches_of(xs, args.width)))
    step = compile_step(cfg, "off")
    rows = np.zeros((B, L + 1), np.int32)
    batch = {"inputs": jnp.asarray(rows[:, :-1]), "targets": jnp.asarray(rows[:, 1:])}
    st = [init_state(cfg)]

    def run_step():
        st[0], metrics = step(st[0], batch)
        return metrics

    lanes = {"fp": lambda: fp(tensors), "fp+sketch": lambda: both(tensors), "step": run_step}
    for f in lanes.values():
        jax.block_until_ready(f())
    wall = {k: [] for k in lanes}
    cpu = {k: [] for k in lanes}
    for r in range(args.rounds):
        order = list(lanes)[r % 3:] + list(lanes)[:r % 3]
        for k in order:
            t0, c0 = time.perf_counter(), time.process_time()
            jax.block_until_ready(lanes[k]())
            wall[k].append(time.perf_counter() - t0)
            cpu[k].append(time.process_time() - c0)
    med = {k: statistics.median(v) for k, v in wall.items()}
    cmed = {k: statistics.median(v) for k, v in cpu.items()}
    sketch = med["fp+sketch"] - med["fp"]
    csketch = cmed["fp+sketch"] - cmed["fp"]
    elements = int(sum(np.prod(x.shape) for x in tensors))
    out = {"preset": args.preset, "width": args.width, "tensors": len(tensors), "elements": elements,
           "median_s": med, "cpu_median_s": cmed,
           "sketch_over_step": sketch / med["step"], "cpu_sketch_over_step": csketch / cmed["step"],
           "sketch_over_fingerprints": sketch / med["fp"], "cpu_sketch_over_fingerprints": csketch / cmed["fp"],
           "record_bytes_per_tensor": {"v1": 12, "v2": 12 + 4 * (args.width + 1)},
           "budget": BUDGET, "within_budget": csketch / cmed["step"] <= BUDGET["sketch_over_step"]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
