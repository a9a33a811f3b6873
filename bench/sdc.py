"""`replay verify` at length: clean steps give no finding, injected corruptions are all found.

Two runs of `tiny` in mesh-invariant mode on 8 virtual CPU devices (8 microbatches, per-replica
fingerprints, checkpoints every 50 steps): a clean run of `--steps` steps, verified whole (every
microbatch re-computed with the work rotated by 0, 3 and 6 devices); and a faulty run with
`--corruptions` injected faults (transients on steps 1, 2, ... on the devices that are not chips,
every fourth a different tensor and bit, plus chips on devices 3 and 7 from the middle), verified
whole. Each found fault must have its step, device and class.

    python -m bench.sdc [--steps 1000] [--corruptions 20]

Runs itself in a child process with XLA_FLAGS=--xla_force_host_platform_device_count=8. Prints one
JSON object on its last line: findings on the clean run (budget 0), corruptions found with the
right step/device/class (budget: all), seconds per verified step.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

TENSORS = ("embed.embedding", "block_00.attn.q.kernel", "block_01.mlp.up.kernel", "block_00.mlp.down.kernel",
           "final_norm.scale", "lm_head.kernel")
CHIPS = (3, 7)  # 4 apart: with rotation 3 no microbatch meets both in one step


def faults_for(corruptions: int, steps: int) -> tuple[list[str], dict]:
    """(specs, expected {(class, device, step)}) for `corruptions` faults in a run of `steps`."""
    n_chips = min(len(CHIPS), max(corruptions // 10, 1))
    n_transient = corruptions - n_chips
    if n_transient >= steps:
        raise ValueError(f"--corruptions {corruptions} needs more than {n_transient} steps")
    others = [d for d in range(8) if d not in CHIPS[:n_chips]]
    specs, want = [], set()
    for s in range(1, n_transient + 1):
        d = others[s % len(others)]
        specs.append(f"sdc@{s}:device={d},tensor={TENSORS[s % len(TENSORS)]},elem={s % 7},bit={(5 * s) % 31}")
        want.add(("transient", d, s))
    for j, d in enumerate(CHIPS[:n_chips]):
        start = 1 + (j + 1) * n_transient // (n_chips + 1)
        specs.append(f"sdc-chip@{start}:device={d},tensor={TENSORS[(j + 2) % len(TENSORS)]},bit={3 + j}")
        want.add(("persistent", d, start))
    return specs, want


def _worker(args: argparse.Namespace, out: Path) -> dict:
    from trainer import invariant

    invariant.prepare_process()
    from replay.verify import verify
    from traces import Run
    from trainer.config import apply_overrides
    from trainer.presets import get_preset
    from trainer.faults import FaultPlan, parse
    from trainer.loop import train
    from trainer.replayable import TrainerReplay

    base = ["mesh.mesh_invariant=true", "mesh.n_microbatches=8", "check.replicas=true", "checkpoint.every_steps=50"]
    result = {}
    corrupt_steps = args.corruptions + 2
    specs, want = faults_for(args.corruptions, corrupt_steps)
    for name, steps, fault_specs in (("clean", args.steps, []), ("faulty", corrupt_steps, specs)):
        cfg = apply_overrides(get_preset("tiny"), base + [f"steps={steps}", f"optimizer.decay_steps={max(steps, 20)}"])
        t0 = time.perf_counter()
        train(cfg, out / name, faults=FaultPlan([parse(s) for s in fault_specs], cfg))
        t1 = time.perf_counter()
        run = Run.open(out / name)
        report = verify(run, TrainerReplay(run), 0, steps - 1, 3)
        result[name] = {"steps": steps, "train_s": round(t1 - t0, 1), "verify_s": round(time.perf_counter() - t1, 1),
                        "findings": [f.to_json() for f in report.findings], "unresolved": len(report.unresolved)}
    got = {(f["class"], f["device"], f["step"]) for f in result["faulty"]["findings"]}
    return {
        "clean_steps_verified": args.steps, "clean_findings": len(result["clean"]["findings"]) + result["clean"]["unresolved"],
        "clean_findings_budget": 0,
        "corruptions": len(want), "found_right": len(want & got), "found_budget": len(want),
        "extra_findings": sorted(map(list, got - want)), "missed": sorted(map(list, want - got)),
        "verify_s_per_step": round(result["clean"]["verify_s"] / args.steps, 3),
        "within_budget": not result["clean"]["findings"] and want <= got and not (got - want),
        "runs": {k: {kk: v[kk] for kk in ("steps", "train_s", "verify_s")} for k, v in result.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000, help="steps of the clean run, all verified")
    parser.add_argument("--corruptions", type=int, default=20, help="faults injected into the faulty run")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    from bench import _eight_devices

    parser.error = _eight_devices.bad_input  # one line, not argparse's usage and error
    args = parser.parse_args()

    if args.steps < 1 or args.corruptions < 1:
        _eight_devices.bad_input(f"--steps {args.steps} --corruptions {args.corruptions}: both must be >= 1")
    if args.worker is not None:
        try:
            print(json.dumps(_worker(args, args.worker)))
        except ValueError as e:  # bad input (ConfigError, FaultError, MeshError are ValueErrors): one line, exit 2
            _eight_devices.bad_input(str(e))
        return

    with tempfile.TemporaryDirectory(prefix="bench-sdc-") as tmp:
        print(_eight_devices.run("bench.sdc", "--steps", str(args.steps), "--corruptions", str(args.corruptions),
                                 "--worker", tmp))


if __name__ == "__main__":
    main()
