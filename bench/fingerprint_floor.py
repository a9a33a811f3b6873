"""What the layer level's fingerprints alone cost a step of examples/optax_loop.py on this CPU.

At the layer level every step fingerprints (traces/fingerprint.py) every tapped tensor, every
non-scalar output and the new state (the state entering a step is the previous step's new state,
fingerprinted once: replay/record/program.py). The definition is fixed (two lanes of fmix32 over
every 32-bit word, wrapping sums), so this work has a floor per element that depends on the CPU.
Seen on an Intel Xeon (KVM, AVX-512 capable), session 21: XLA:CPU emits one fused pass per tensor
(both lanes and the sum of squares in one variadic reduce, no temporaries), vectorised on 256-bit
registers (8 x uint32, unrolled 4x), about 111 vector uops per 32 elements, 17 of them 2-uop
32-bit multiplies: bound by the vector ALU ports, not by memory (0.50 ns an element for a tensor
that fits in L2, 0.42 for 8 MB). 512-bit code (xla_cpu_prefer_vector_width=512) was 20-25% faster
but is a whole-program compile option and changed the bits of the float sum of squares beside the
lanes: it would change the user's own float reductions. So this bench measures the floor where
`bench.record_overhead` runs: the elements one layer-level step fingerprints at each size, the
time one program takes to fingerprint tensors of exactly those shapes (median of `--repeats`,
wall and process CPU), the plain step's median time, and their ratio: the layer level's
overhead cannot go below it on this CPU whatever the host does. Prints one JSON line.

    python -m bench.fingerprint_floor [--sizes 256x128,1024x512]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench import _api_lanes
from bench.record_overhead import BUDGETS
from replay.record.fingerprint import fingerprints_and_sums_of_squares
from replay.record.taps import collecting


def fingerprinted_shapes(example, config: dict) -> list[jax.ShapeDtypeStruct]:
    """Shapes of what one chained layer-level step of `example` fingerprints: its taps (not rng),
    its outputs that are neither scalars nor per-example [B] floats, and the new state (as
    replay/record/program.py's _record picks them). Traced only (jax.eval_shape), not compiled."""
    loop = example.make(config)
    fn = getattr(loop.step, "__wrapped__", loop.step)
    state, batch = jax.eval_shape(loop.init), loop.batch_at(0)
    shapes: list[jax.ShapeDtypeStruct] = []

    def traced(state, batch):
        with collecting() as taps:
            new_state, metrics = fn(state, batch)
        leaves = [x for _, kind, tree in taps if kind != "rng" for x in jax.tree.leaves(tree)]
        b = config["batch"]
        leaves += [x for x in jax.tree.leaves(metrics) if jnp.ndim(x) and not (jnp.shape(x) == (b,) and
                                                                               jnp.issubdtype(x.dtype, jnp.floating))]
        leaves += jax.tree.leaves(new_state)
        shapes[:] = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
        return 0

    jax.eval_shape(traced, state, batch)
    return shapes


def _median_seconds(call, repeats: int) -> tuple[float, float]:
    """Median wall and process CPU seconds of `call()` run to completion."""
    jax.block_until_ready(call())
    wall, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        jax.block_until_ready(call())
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall), statistics.median(cpu)


def measure(hidden: int, batch: int, repeats: int, budget: float) -> dict:
    example = importlib.import_module("optax_loop")
    config = _api_lanes.check_config("optax_loop", {"steps": 1000, "batch": batch, "hidden": (hidden, hidden), "d_in": 64})
    shapes = fingerprinted_shapes(example, config)
    rng = np.random.default_rng(0)
    tensors = [jnp.asarray(rng.integers(0, 2**32, size=s.shape, dtype=np.uint32).view(np.float32).astype(s.dtype))
               if jnp.issubdtype(s.dtype, jnp.floating) else jnp.zeros(s.shape, s.dtype) for s in shapes]
    fingerprint = jax.jit(fingerprints_and_sums_of_squares)
    fp_wall, fp_cpu = _median_seconds(lambda: fingerprint(tensors), repeats)
    loop = example.make(config)
    state, data = loop.init(), loop.batch_at(0)

    def step():  # the plain step (level off), its state fed back as a loop does (the step donates it)
        nonlocal state
        state = loop.step(state, data)[0]
        return state
    step_wall, step_cpu = _median_seconds(step, repeats)
    elements = int(sum(np.prod(s.shape, dtype=np.int64) for s in shapes))
    return {"hidden": hidden, "batch": batch, "tensors": len(shapes), "elements": elements,
            "fingerprint_us": round(fp_wall * 1e6, 1), "fingerprint_cpu_us": round(fp_cpu * 1e6, 1),
            "ns_per_element": round(fp_wall * 1e9 / max(elements, 1), 3),
            "off_step_us": round(step_wall * 1e6, 1), "off_step_cpu_us": round(step_cpu * 1e6, 1),
            "floor_layer_overhead": round(fp_wall / step_wall, 4), "floor_cpu_layer_overhead": round(fp_cpu / step_cpu, 4),
            "budget_layer_overhead": budget}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), platform.processor())
    except OSError:
        return platform.processor()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="256x128,1024x512", help="comma-separated HIDDENxBATCH (the first: the small budget)")
    p.add_argument("--repeats", type=int, default=30)
    a = p.parse_args(argv)
    load = os.getloadavg()[0]
    sizes = []
    for i, spec in enumerate(a.sizes.split(",")):
        hidden, batch = (int(x) for x in spec.split("x")[:2])
        sizes.append(measure(hidden, batch, a.repeats, BUDGETS["small" if i == 0 else "wide"]["layer_overhead"]))
    print(json.dumps({"bench": "fingerprint_floor", "loop": "examples/optax_loop.py", "sizes": sizes,
                      "cpu_model": _cpu_model(), "cpus": os.cpu_count(), "backend": jax.default_backend(),
                      "loadavg_1m_before": round(load, 2), "loadavg_1m_after": round(os.getloadavg()[0], 2)}))


if __name__ == "__main__":
    main()
