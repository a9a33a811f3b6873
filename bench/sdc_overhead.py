"""What `check.rerun_every=N` costs a training step: budget <= 1/N + 2% at N = 10 and N = 100.

`tiny` in mesh-invariant mode on 8 virtual CPU devices (8 microbatches), trace level layer. Two
compiled step programs: without the check, and with check.rerun_every=10 (one program serves every
N: a step re-runs when its counter is a multiple of N, so what differs with N is only how often).
Rounds interleave three lanes, each timing `--steps` dispatches of one program on one state:
base (no check), plain (the check program on a step it does not re-run) and checked (on a step it
re-runs). Overhead at N = ((N - 1) plain + checked) / (N base) - 1, with plain / base and checked /
base the medians over rounds of each round's ratio (paired: a round's lanes run back to back, so
load from other processes hits them alike). The headline figures use this process's CPU time (the
machine may be shared: other processes' work is not counted); `overhead_wall` is the same from wall
time, beside it.

    python -m bench.sdc_overhead [--rounds 8] [--steps 5]

`section(rounds, steps)` returns the JSON section for bench/overhead.py (the hook it can call);
run as a module it re-runs itself with 8 virtual devices and prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

NS = (10, 100)


def section(rounds: int = 8, steps: int = 5) -> dict:
    """Measures in this process (which must have 8 devices and no JAX backend started yet)."""
    from trainer import invariant

    invariant.prepare_process()
    import jax
    import numpy as np

    from trainer import loop, mesh as meshlib
    from trainer.config import apply_overrides
    from trainer.presets import get_preset

    base = ["mesh.mesh_invariant=true", "mesh.n_microbatches=8", "trace.level=layer"]
    programs = {}
    for lane, extra in (("base", []), ("check", ["check.rerun_every=10"])):
        built = loop.build(apply_overrides(get_preset("tiny"), base + extra))
        programs[lane] = built
    arrays, _ = programs["base"].device_batch(0)
    lanes = ("base", "plain", "checked")
    times: dict[str, dict[str, list[float]]] = {clock: {lane: [] for lane in lanes} for clock in ("cpu", "wall")}
    same = True

    def timed(built, at_step: int) -> tuple[float, float, dict]:
        """(CPU seconds, wall seconds) a step of `built` at counter `at_step`, and its metrics."""
        state = meshlib.init_sharded_state(built.cfg, built.mesh)
        sharding = state.step.sharding
        counters = [jax.device_put(np.int32(at_step), sharding) for _ in range(steps + 1)]  # each is donated
        program = built.compiled["layer"]
        state, metrics = program(state._replace(step=counters[-1]), arrays)  # warm
        jax.block_until_ready(metrics)
        c0, t0 = time.process_time(), time.perf_counter()
        for counter in counters[:-1]:
            state, metrics = program(state._replace(step=counter), arrays)
        jax.block_until_ready((state, metrics))
        return (time.process_time() - c0) / steps, (time.perf_counter() - t0) / steps, jax.device_get(metrics)

    for _ in range(rounds):
        got = {lane: timed(programs[prog], at) for lane, prog, at in
               (("base", "base", 1), ("plain", "check", 1), ("checked", "check", 10))}
        for lane in lanes:
            times["cpu"][lane].append(got[lane][0])
            times["wall"][lane].append(got[lane][1])
        m_base, m_plain = got["base"][2], got["plain"][2]
        n_fp = len(m_base["fingerprints"])
        same = same and bool(np.array_equal(m_base["fingerprints"], m_plain["fingerprints"][:n_fp])
                             and np.array_equal(m_base["loss"], m_plain["loss"]))

    def overheads(t: dict[str, list[float]]) -> dict[str, float]:
        ratio = {lane: statistics.median(x / b for x, b in zip(t[lane], t["base"])) for lane in ("plain", "checked")}
        return {str(n): ((n - 1) * ratio["plain"] + ratio["checked"]) / n - 1 for n in NS}

    overhead, overhead_wall = overheads(times["cpu"]), overheads(times["wall"])
    budget = {str(n): 1 / n + 0.02 for n in NS}
    return {
        "median_step_cpu_s": {k: round(statistics.median(v), 5) for k, v in times["cpu"].items()},
        "median_step_wall_s": {k: round(statistics.median(v), 5) for k, v in times["wall"].items()},
        "unchecked_step_cpu_ratio": round(statistics.median(p / b for p, b in zip(times["cpu"]["plain"],
                                                                                  times["cpu"]["base"])), 4),
        "overhead": {k: round(v, 4) for k, v in overhead.items()}, "budget": {k: round(v, 4) for k, v in budget.items()},
        "overhead_wall": {k: round(v, 4) for k, v in overhead_wall.items()},
        "within_budget": all(overhead[k] <= budget[k] for k in budget),
        "same_results_unchecked_step": same, "rounds": rounds, "steps": steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    from bench import _eight_devices

    parser.error = _eight_devices.bad_input  # one line, not argparse's usage and error
    args = parser.parse_args()

    if args.rounds < 1 or args.steps < 1:
        _eight_devices.bad_input(f"--rounds {args.rounds} --steps {args.steps}: both must be >= 1")
    if args.worker:
        print(json.dumps(section(args.rounds, args.steps)))
        return

    print(_eight_devices.run("bench.sdc_overhead", "--rounds", str(args.rounds), "--steps", str(args.steps), "--worker"))


if __name__ == "__main__":
    main()
