"""Which device counts give the same bits: plain data parallel vs mesh-invariant mode.

Each configuration runs in its own process (the device count is fixed when JAX starts):
`--steps` layer-level steps of a preset from the same initial state, every recorded field
(metrics, per-example losses, RNG words, layer fingerprints and RMS) kept as exact bits. The
parent compares every configuration with the reference (`--reference` devices, same mode)
and times the steps (median seconds per step after the first, which compiles).

    python -m bench.invariance [--preset tiny] [--steps 8] [--devices 1,2,4,8] [--microbatches 8]
    python -m bench.invariance --overhead [--preset demo] [--level step] [--steps 60] [--rounds 6]

Modes, to show what each part of mesh-invariant mode buys:
    plain          data parallel (the default trainer)
    bare           the microbatch scheme alone: autodiff backward, no process settings
    no-settings    + fixed-order softmax/RMSNorm backward, no process settings
    no-isa         + the pinned XLA:CPU pool (PJRT_NPROC), but FMA allowed
    no-pool        + the AVX cap (no FMA), but the pool as XLA sizes it
    invariant      mesh-invariant mode as the trainer runs it (everything)
Prints one JSON object on its last line: per mode, the device counts bit-identical to the
reference, the first differing field of the others, and the median step times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
POOL_THREADS, ISA_FLAG = 8, "--xla_cpu_max_isa=AVX"  # as trainer/invariant.py (not imported: no JAX here)
MODES = ("plain", "bare", "no-settings", "no-isa", "no-pool", "invariant")


def _worker(args: argparse.Namespace) -> None:
    import time

    import jax
    import numpy as np

    from trainer import invariant, loop, mesh as meshlib
    from trainer.config import apply_overrides
    from trainer.presets import get_preset
    from replay.record.recorder import to_record

    sets = [f"steps={args.steps}", f"trace.level={args.level}", "trace.layer_every=1"]
    if args.mode != "plain":
        sets += ["mesh.mesh_invariant=true", f"mesh.n_microbatches={args.microbatches}"]
    cfg = apply_overrides(get_preset(args.preset), sets + list(args.set or []))
    if args.mode not in ("plain", "invariant"):  # the parent set what this mode keeps in the environment
        invariant.prepare_process = lambda *a, **k: None
    if args.mode == "bare":  # the microbatch scheme with autodiff's backward
        import functools

        from trainer import step as steplib

        # the loop lowers through trainer.mesh.lower_step, which calls steplib.compile_step
        steplib.compile_step = functools.partial(steplib.compile_step, fixed_backward=False)
    built = loop.build(cfg)
    state = meshlib.init_sharded_state(cfg, built.mesh)
    records, times = [], []
    for step in range(args.steps):
        t0 = time.perf_counter()
        state, metrics, hashes = built.run_step(state, step)
        host = jax.device_get(metrics)
        times.append(time.perf_counter() - t0)
        rec = to_record(built.schema, step, host, hashes)
        records.append({
            "metrics": rec.metrics.view(np.uint32).tolist(),
            "metric_names": list(built.schema.metric_names),
            "example_loss": rec.example_metrics.view(np.uint32).reshape(-1).tolist(),
            "rng": rec.rng.tolist(),
            "fingerprints": [] if rec.fingerprints is None else [int(x) for x in rec.fingerprints],
            "rms": [] if rec.rms is None else rec.rms.view(np.uint32).tolist(),
            "tensor_names": [name for name, _ in built.schema.tensors],
        })
    print(json.dumps({"devices": jax.device_count(), "pool": invariant.pool_threads(), "records": records,
                      "step_s": statistics.median(times[1:]) if len(times) > 1 else None}))


def _ab_worker(args: argparse.Namespace) -> None:
    """Plain data parallel and mesh-invariant mode in one process with mesh-invariant settings,
    in alternating rounds (so machine noise hits both alike): median seconds per step of each."""
    import time

    import jax

    from trainer import invariant, loop, mesh as meshlib
    from trainer.config import apply_overrides
    from trainer.presets import get_preset

    invariant.prepare_process()
    base = [f"trace.level={args.level}", "trace.layer_every=1", *(args.set or [])]
    cfgs = {"plain": apply_overrides(get_preset(args.preset), base),
            "invariant": apply_overrides(get_preset(args.preset), base + [
                "mesh.mesh_invariant=true", f"mesh.n_microbatches={args.microbatches}"])}
    built = {k: loop.build(c) for k, c in cfgs.items()}
    states = {k: meshlib.init_sharded_state(cfgs[k], b.mesh) for k, b in built.items()}
    samples: dict[str, list[float]] = {k: [] for k in built}
    per_round = max(1, args.steps // args.rounds)
    for r in range(args.rounds + 1):  # round 0 warms up
        for k in (list(built) if r % 2 else list(reversed(list(built)))):
            t0 = time.perf_counter()
            for i in range(per_round):
                states[k], metrics, _ = built[k].run_step(states[k], i)
            jax.block_until_ready((states[k], metrics))
            if r:
                samples[k].append((time.perf_counter() - t0) / per_round)
    med = {k: statistics.median(v) for k, v in samples.items()}
    print(json.dumps({"devices": jax.device_count(), "step_s": med, "ratio": med["invariant"] / med["plain"]}))


def overhead(args: argparse.Namespace, counts: list[int]) -> dict:
    """Per device count: plain vs mesh-invariant step time in one process with the settings
    (`ratio`: the scheme's cost), and plain in a default process (`plain_default_s`), so
    plain_with_settings / plain_default is what the AVX cap and pinned pool cost plain code."""
    out = {}
    for n in counts:
        env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PJRT_NPROC")}
        env["JAX_PLATFORMS"] = "cpu"
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={n}"
        cmd = [sys.executable, "-m", "bench.invariance", "--ab", "--preset", args.preset, "--steps", str(args.steps),
               "--rounds", str(args.rounds), "--microbatches", str(args.microbatches), "--level", args.level]
        cmd += [a for o in args.set or [] for a in ("--set", o)]
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if done.returncode:
            out[n] = {"error": done.stderr.strip().splitlines()[-1]}
            continue
        ab = json.loads(done.stdout.strip().splitlines()[-1])
        default = run_one("plain", n, args)
        out[n] = {"plain_s": ab["step_s"]["plain"], "invariant_s": ab["step_s"]["invariant"],
                  "invariant_over_plain": ab["ratio"], "plain_default_s": default.get("step_s")}
        print(f"{n} devices: {json.dumps(out[n])}", file=sys.stderr)
    return out


VERIFIED = ("rng", "metrics", "example_loss", "fingerprints")  # what `replay run` compares bit for bit


def _first_difference(a: list[dict], b: list[dict], keys: tuple[str, ...] = VERIFIED) -> str | None:
    """The first field of `keys` that differs; RMS values are informational in traces (shown next
    to a differing fingerprint) and are checked separately with keys=("rms",)."""
    for step, (ra, rb) in enumerate(zip(a, b)):
        for key in keys:
            if ra[key] != rb[key]:
                if key in ("metrics", "fingerprints", "rms"):
                    names = ra["metric_names"] if key == "metrics" else ra["tensor_names"]
                    i = next(i for i, (x, y) in enumerate(zip(ra[key], rb[key])) if x != y)
                    return f"step {step}: {key} {names[i]}"
                return f"step {step}: {key}"
    return None


def run_one(mode: str, devices: int, args: argparse.Namespace) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PJRT_NPROC")}
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices} {args.xla_flags}".strip()
    if mode == "no-isa":
        env["PJRT_NPROC"] = str(POOL_THREADS)
    if mode == "no-pool":
        env["XLA_FLAGS"] += f" {ISA_FLAG}"
    cmd = [sys.executable, "-m", "bench.invariance", "--worker", "--mode", mode, "--preset", args.preset,
           "--steps", str(args.steps), "--microbatches", str(args.microbatches), "--level", args.level]
    cmd += [a for o in args.set or [] for a in ("--set", o)]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if out.returncode:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ab", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--overhead", action="store_true",
                    help="measure step time of mesh-invariant mode against plain data parallel instead")
    ap.add_argument("--rounds", type=int, default=6, help="--overhead: alternating timed rounds")
    ap.add_argument("--mode", choices=MODES, default="invariant")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--level", default="layer", choices=("step", "layer"))
    ap.add_argument("--set", action="append", help="extra config override (repeatable)")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--devices", default="1,2,4,8")
    ap.add_argument("--reference", type=int, default=4)
    ap.add_argument("--xla-flags", default="", help="extra XLA_FLAGS for every process (to explore settings)")
    args = ap.parse_args(argv)
    if args.worker:
        _worker(args)
        return
    if args.ab:
        _ab_worker(args)
        return
    counts = [int(x) for x in args.devices.split(",")]
    if args.overhead:
        print(json.dumps({"preset": args.preset, "level": args.level, "microbatches": args.microbatches,
                          "cpu_count": os.cpu_count(), "overhead": overhead(args, counts)}))
        return
    result = {"preset": args.preset, "steps": args.steps, "microbatches": args.microbatches,
              "reference_devices": args.reference, "cpu_count": os.cpu_count(), "modes": {}}
    for mode in args.modes.split(","):
        runs = {n: run_one(mode, n, args) for n in sorted(set(counts) | {args.reference})}
        ref = runs[args.reference]
        entry = {"identical_to_reference": [], "differs": {}, "rms_identical": [], "step_s": {}, "pool_threads": {}}
        for n, r in runs.items():
            if "error" in r:
                entry["differs"][n] = r["error"]
                continue
            entry["step_s"][n] = r["step_s"]
            entry["pool_threads"][n] = r["pool"]
            if "error" in ref:
                continue
            diff = _first_difference(ref["records"], r["records"])
            if diff is None:
                entry["identical_to_reference"].append(n)
            else:
                entry["differs"][n] = diff
            if _first_difference(ref["records"], r["records"], ("rms",)) is None:
                entry["rms_identical"].append(n)
        result["modes"][mode] = entry
        print(f"{mode}: {json.dumps(entry)}", file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
