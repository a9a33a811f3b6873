"""What distance sketches add to a layer-level record: the trainer's step, its fingerprint pass,
and the sketch pass over the same tensors (trace format_version 2, traces/sketch.py).

The layer-level record of trainer/step.py fingerprints every forward layer, gradient and
parameter after the update. This measures, on the trainer's `--preset` (default tiny), with
the parameters standing in for the gradients and parameters (same shapes) and activations of
the layer shapes: `fp` (fingerprints and sums of squares, one jitted program, as recorded
today), `fp+sketch` (the same plus `sketch_rows`, in one program: what a v2 record computes),
and `step` (the trainer's train step at level off). Rounds interleave the three; medians of
wall and of process CPU time (others share this CPU: the CPU ratio is the steadier). Prints
one JSON line: the sketch's cost relative to the step (budget beside it: the layer level's
0.03) and to the fingerprint pass.

`fp+sketch` is what the trainer computes (trainer/sketches.py): `sketch_rows` (one sign table a
program) and the norms from the fingerprint pass's sums of squares. `--shapes 6x1024x512` measures
T tensors of one shape instead of the preset's (the step lane is then skipped). `--one-pass` adds
the lane `one-pass`: the sketch inside the fingerprint's own reduce (one variadic reduce a tensor
over the rows of [chunks, CHUNK_ROWS, W], outputs the lane, sum-of-squares and sketch partials per
(chunk, bucket), each row's columns gathered by c XOR offset(r)), what issue 34 proposed; its
fingerprints are checked bit-equal to `fp`'s and its sketches against the reference.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

BUDGET = {"sketch_over_step": 0.03}


def _one_pass_tensor(x, width: int):
    """(uint32[2] lanes, float32 sum of squares, float32[W] sketch) of a float32 tensor from ONE variadic
    reduce over the rows of [chunks, R, W] (the `--one-pass` lane; not what the trainer runs)."""
    from jax import lax

    from replay.record.fingerprint import _fmix32, _u32, _words
    from traces.fingerprint import GOLDEN, lane_seeds
    from traces.sketch import CHUNK_ROWS, SIGN_SEED, row_offsets

    n = x.size
    rows = -(-n // width)
    R = min(CHUNK_ROWS, rows)
    chunks = -(-rows // R)
    shape = (chunks, R, width)
    offs = row_offsets(np.arange(chunks * R, dtype=np.uint32), width).astype(np.uint32).reshape(chunks, R)
    c = lax.bitwise_xor(lax.broadcasted_iota(jnp.uint32, shape, 2), lax.broadcast_in_dim(jnp.asarray(offs), shape, (0, 1)))
    e = (lax.broadcasted_iota(jnp.uint32, shape, 0) * _u32(R) + lax.broadcasted_iota(jnp.uint32, shape, 1)) * _u32(width) + c
    valid = e < _u32(n)
    g = x.reshape(-1).at[jnp.where(valid, e, _u32(0)).astype(jnp.int32)].get(mode="promise_in_bounds")
    s0, s1 = lane_seeds(np.dtype(x.dtype).name, x.shape)
    base = _words(g) + e * _u32(GOLDEN)
    t0, t1 = (jnp.where(valid, _fmix32(base + _u32(s)), _u32(0)) for s in (s0, s1))
    f = jnp.where(valid, g.astype(jnp.float32), 0.0)
    negative = lax.shift_right_logical(_fmix32(e * _u32(GOLDEN) + _u32(SIGN_SEED)), _u32(31)) == 1
    zero = (np.uint32(0), np.uint32(0), np.float32(0), np.float32(0))
    out = lax.reduce((t0, t1, f * f, jnp.where(negative, -f, f)), zero, lambda a, b: tuple(p + q for p, q in zip(a, b)), (1,))
    return jnp.stack([jnp.sum(out[0]), jnp.sum(out[1])]), jnp.sum(out[2]), jnp.sum(out[3], axis=0)


def _one_pass(xs, width: int):
    parts = [_one_pass_tensor(x, width) for x in xs]
    return tuple(jnp.stack([p[i] for p in parts]) for i in range(3))


def _check_one_pass(got, want, tensors, width: int) -> None:
    """The one-pass lane's fingerprints are the fingerprint's bits; its sketches the reference's."""
    from traces.sketch import bucket_and_sign, sketch

    assert np.asarray(got[0]).tobytes() == np.asarray(want[0]).tobytes(), "one-pass fingerprints differ"
    for x, row in zip(tensors, np.asarray(got[2], np.float64)):
        v = np.asarray(x, np.float64).reshape(-1)
        bound = 2.0 ** -22 * np.bincount(bucket_and_sign(np.arange(v.size, dtype=np.uint32), width)[0],
                                         weights=np.abs(v), minlength=width)
        assert np.all(np.abs(row - sketch(np.asarray(x), width)[0]) <= bound), "one-pass sketch off the reference"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="tiny")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--shapes", default="", help="TxRxC: T float32 tensors of R x C instead of the preset's")
    p.add_argument("--one-pass", action="store_true")
    args = p.parse_args()

    from replay.record.fingerprint import fingerprints_and_sums_of_squares, sketch_rows
    from trainer import model
    from trainer.presets import get_preset
    from trainer.step import compile_step, get_path, init_state

    cfg = get_preset(args.preset)
    m = cfg.model
    B, L = cfg.data.global_batch_size, m.seq_len
    if args.shapes:
        t, r, c = (int(v) for v in args.shapes.split("x"))
        tensors = [jnp.asarray(np.random.default_rng(i).standard_normal((r, c)).astype(np.float32)) for i in range(t)]
    else:
        state = init_state(cfg)
        params = [get_path(state.params, n) for n in model.param_names(m)]
        acts = [jnp.ones((B, L, m.d_model), jnp.float32) * 0.5 for _ in model.layer_names(m)[:-1]]
        acts.append(jnp.ones((B, L, m.vocab_size), jnp.float32))
        tensors = acts + params + params  # forward layers, gradients, parameters after the update

    fp = jax.jit(lambda xs: fingerprints_and_sums_of_squares(xs))

    def fp_and_sketch(xs):
        lanes, ss = fingerprints_and_sums_of_squares(xs)
        return lanes, ss, sketch_rows(xs, args.width), jnp.sqrt(ss)

    both = jax.jit(fp_and_sketch)
    lanes = {"fp": lambda: fp(tensors), "fp+sketch": lambda: both(tensors)}
    if not args.shapes:
        step = compile_step(cfg, "off")
        rows = np.zeros((B, L + 1), np.int32)
        batch = {"inputs": jnp.asarray(rows[:, :-1]), "targets": jnp.asarray(rows[:, 1:])}
        st = [init_state(cfg)]

        def run_step():
            st[0], metrics = step(st[0], batch)
            return metrics

        lanes["step"] = run_step
    if args.one_pass:
        fused = jax.jit(lambda xs: _one_pass(xs, args.width))
        _check_one_pass(fused(tensors), fp(tensors), tensors, args.width)
        lanes["one-pass"] = lambda: fused(tensors)
    for f in lanes.values():
        jax.block_until_ready(f())
    wall = {k: [] for k in lanes}
    cpu = {k: [] for k in lanes}
    for r in range(args.rounds):
        order = list(lanes)[r % len(lanes):] + list(lanes)[:r % len(lanes)]
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
    out = {"preset": args.preset, "shapes": args.shapes or None, "width": args.width, "tensors": len(tensors),
           "elements": elements, "median_s": med, "cpu_median_s": cmed,
           "sketch_over_fingerprints": sketch / med["fp"], "cpu_sketch_over_fingerprints": csketch / cmed["fp"],
           "record_bytes_per_tensor": {"v1": 12, "v2": 12 + 4 * (args.width + 1)}, "load_average": list(os.getloadavg())}
    if "step" in med:
        out.update(sketch_over_step=sketch / med["step"], cpu_sketch_over_step=csketch / cmed["step"], budget=BUDGET,
                   within_budget=csketch / cmed["step"] <= BUDGET["sketch_over_step"])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
