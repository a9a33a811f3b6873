"""Trains and verifies the SDC test runs in one fresh process with 8 virtual CPU devices.

`python -m tests.replay.sdc_probe OUT [RUN ...]` writes OUT/results.json, read by
tests/replay/test_verify_e2e.py (RUN names train and check only those runs: for a quick look).
Runs (tiny with one block, mesh-invariant, 8 microbatches, per-replica fingerprints, 12 steps,
checkpoints every 6; the checks rely on nothing a second block would add, and compiling these runs'
own step programs is most of the test's time: a second block adds about a fifth):

    clean        no fault, check.rerun_every=10 (compared with the step's per-replica fingerprints)
    clean-off    check off and no per-replica fingerprints, 13 steps with one transient at the last
                 (step 12): its training must equal `clean`'s 12 steps bit for bit, and only the trace
                 differs from every re-execution at step 12 (`replay verify --steps 11:12` must say so,
                 exit 1). One run for both: each run of its own was ~20 CPU-s
    chip-check   a chip on device 3 from step 2, check.rerun_every=10 without per-replica fingerprints
                 (the re-run is compared with a re-computation): the check must name it at step 10
    faulty       22 steps: 21 transients (steps 1..21) on the six devices that are not chips, and
                 chips on devices 3 (from 2) and 7 (from 5, p=0.5); check.rerun_every=10 (it must
                 name device 3 at step 10)

`clean` and `faulty` share their fault-free program, and one faulty run holds every corruption:
the step programs (each distinct config its own compile) are most of the test's time, ten more
steps are not. One transient a step: two devices wrong in training in one step is, by design,
not one chip but a `genuine` finding (replay/verify/classify.py).
Chips sit 4 devices apart so that with --rotate 3 no microbatch is computed by two bad chips in
one step (the three executions of a microbatch run on devices o, o-3, o+2).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROTATE = 3
STEPS = 12
FAULTY_STEPS = 22
TENSORS = ("embed.embedding", "block_00.attn.q.kernel", "block_00.mlp.up.kernel", "block_00.mlp.down.kernel",
           "final_norm.scale", "lm_head.kernel")
BASE = ["model.n_layers=1", "mesh.mesh_invariant=true", "mesh.n_microbatches=8", f"steps={STEPS}",
        "checkpoint.every_steps=6", "check.replicas=true"]


def transients(offset: int, steps) -> list[str]:
    """A transient at each of `steps` on a device that is not a chip, six tensors, various elements and bits."""
    devices = (0, 1, 2, 4, 5, 6)
    return [f"sdc@{s}:device={devices[(s + offset) % len(devices)]},tensor={TENSORS[(s + offset) % len(TENSORS)]},"
            f"elem={(s * 7 + offset) % 5},bit={(s * 5 + offset) % 31}" for s in steps]


CHECK = ["check.rerun_every=10"]
RUNS = {
    "clean": ([], CHECK),
    "clean-off": ([f"sdc@{STEPS}:device=3,tensor=lm_head.kernel,bit=22"], ["check.replicas=false", f"steps={STEPS + 1}"]),
    "chip-check": (["sdc-chip@2:device=3,tensor=lm_head.kernel,bit=7"], CHECK + ["check.replicas=false"]),
    "faulty": (transients(0, range(1, FAULTY_STEPS)) + ["sdc-chip@2:device=3,tensor=block_00.mlp.up.kernel,bit=3",
                                                        "sdc-chip@5:device=7,p=0.5,tensor=block_00.attn.q.kernel,bit=12"],
               CHECK + [f"steps={FAULTY_STEPS}"]),
}
VERIFIED = ("clean", "faulty")


def main(out: Path, only: list[str] | None = None) -> None:
    from trainer import invariant

    invariant.prepare_process()
    import jax
    import numpy as np

    from replay.bisect import bisect
    from replay.bisect.replica import hardware_fault
    from replay.verify import verify
    from traces import Run
    from trainer import rng
    from trainer.config import apply_overrides
    from trainer.presets import get_preset
    from trainer.faults import FaultPlan, parse
    from trainer.loop import train
    from trainer.replayable import TrainerReplay

    results: dict = {"devices": jax.device_count(), "runs": {}}
    for name, (specs, extra) in RUNS.items():
        if only and name not in only:
            continue
        cfg = apply_overrides(get_preset("tiny"), BASE + extra)
        faults = FaultPlan([parse(s) for s in specs], cfg)
        train(cfg, out / name, faults=faults)
        run = Run.open(out / name)
        entry: dict = {"faults": run.manifest["faults"], "tensors": list(run.schema.tensor_names)}
        if name in VERIFIED:
            report = verify(run, TrainerReplay(run), 0, run.trace.end - 1, ROTATE)
            entry["verify"] = report.to_json()
        recs = [run.trace.read(s) for s in range(run.trace.end)]
        names = run.schema.tensor_names
        keep = [i for i, t in enumerate(names) if not t.startswith(("check/", "replica/"))]
        entry["records"] = [[int(x) for x in r.fingerprints[keep]] + [int(b) for b in r.metrics.view(np.uint32)]
                            for r in recs]
        entry["check"] = {s: [int(r.fingerprints[names.index(t)]) for t in names if t.startswith("check/")]
                          + [float(r.rms[names.index(t)]) for t in names if t.startswith("check/")]
                          for s, r in enumerate(recs)}
        entry["mesh"] = run.manifest["mesh"]
        results["runs"][name] = entry
    # Whether each chip of `faulty` fires at a step: the draw the fault makes (host side, same function).
    cfg = apply_overrides(get_preset("tiny"), BASE)
    draws = {}
    for device, p in ((3, 1.0), (7, 0.5)):
        chip = rng.stream_key(cfg.seed, f"sdc-chip/{device}")
        hits = []
        for s in range(FAULTY_STEPS):
            words = np.asarray(jax.random.key_data(rng.step_key(rng.dropout_key(cfg.seed), s)), np.uint32)
            draw = jax.random.fold_in(jax.random.fold_in(chip, int(words[0])), int(words[1]))
            hits.append(bool(jax.random.uniform(draw) < p))
        draws[device] = hits
    results["draws"] = draws
    cli = _cli(out)
    if only:
        results["cli"] = cli
        (out / "results.json").write_text(json.dumps(results))
        return
    report = bisect(Run.open(out / "faulty"), Run.open(out / "clean"), refine=False)
    results["bisect"] = {"first_step": report.first_step,
                         "hardware": hardware_fault(Run.open(out / "faulty"), Run.open(out / "clean"), report.first_step)}
    results["cli"] = cli
    (out / "results.json").write_text(json.dumps(results))


def _cli(out: Path) -> dict:
    """`replay verify --json` on the runs trained (exit code, the end of stdout and stderr)."""
    from typer.testing import CliRunner

    from replay.cli.app import app

    cli = {}
    for key, args in (("clean", ["clean", "--steps", "0:2", "--rotate", str(ROTATE)]), ("faulty", ["faulty", "--steps", "3:4", "--rotate", "3"]),
                      ("outside", ["clean", "--steps", "50:60"]), ("rotate", ["clean", "--steps", "0:1", "--rotate", "4"]),
                      ("transient-off", ["clean-off", "--steps", f"{STEPS - 1}:{STEPS}", "--rotate", "3"])):
        if not (out / args[0]).is_dir():
            continue
        done = CliRunner().invoke(app, ["verify", str(out / args[0]), *args[1:], "--json"], env={"REPLAY_DEBUG": None})
        cli[key] = {"code": done.exit_code, "stdout": done.stdout[-4000:], "stderr": done.stderr[-500:]}
    return cli


if __name__ == "__main__":
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    main(Path(sys.argv[1]), sys.argv[2:])
