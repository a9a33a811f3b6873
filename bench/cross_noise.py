"""The noise floor of a cross-framework pair, measured: replay/bisect/cross_floor.py's table.

Trains the tiny preset (fp32, dropout 0) `--steps` steps with the reference through
trainer/reference_train.py and with the JAX trainer on `--devices` virtual CPU devices (each
count in its own process: the device count is fixed at JAX's start), from the same weights on
the same batches, then computes every compared field's relative distance at every step
(replay/bisect/cross_distance.py: the torch sketches against the JAX run replayed) and prints
one JSON line: per causal kind and device count, the largest distance and the envelope
(distance at step 0, growth per step), beside the floor the table gives at the last step and
whether every distance is below it. Cost: 2 + len(devices) short trainings and one replay each
(~15 min for 100 steps and devices 1,8 on 2 shared cores).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def _child(args) -> None:
    import dataclasses

    from replay.bisect.cross_distance import compared_names, from_replay
    from traces import Run
    from trainer.presets import get_preset
    from trainer.loop import train
    from trainer.reference_train import jax_config

    base = get_preset("tiny")
    cfg = jax_config(dataclasses.replace(base, steps=args.steps,
                                         checkpoint=dataclasses.replace(base.checkpoint, every_steps=0)))
    jax_dir = Path(args.dir) / f"jax{args.child}"
    train(cfg, jax_dir)
    t, j = Run.open(Path(args.dir) / "torch"), Run.open(jax_dir)
    names = compared_names(t, j)
    rows = {k: d for k, d in from_replay(t, j, range(args.steps), names)}
    print(json.dumps({"kinds": dict(names), "distances": rows}))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--devices", default="1,8")
    p.add_argument("--dir", default=None)
    p.add_argument("--child", type=int, default=None)
    args = p.parse_args()
    if args.child is not None:
        return _child(args)
    import dataclasses

    from replay.bisect.cross_floor import TRAINER
    from trainer.presets import get_preset
    from trainer.reference_train import jax_config, train_reference

    work = Path(args.dir or tempfile.mkdtemp(prefix="cross_noise_"))
    base = get_preset("tiny")
    cfg = jax_config(dataclasses.replace(base, steps=args.steps))
    if not (work / "torch").exists():
        train_reference(cfg, work / "torch", args.steps)
    result = {"steps": args.steps, "by_devices": {}}
    ok = True
    for n in [int(x) for x in args.devices.split(",")]:
        env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={n}"}
        out = subprocess.run([sys.executable, "-m", "bench.cross_noise", "--steps", str(args.steps), "--dir", str(work),
                              "--child", str(n)], env=env, capture_output=True, text=True, check=True)
        got = json.loads(out.stdout.strip().splitlines()[-1])
        kinds, rows = got["kinds"], {int(k): v for k, v in got["distances"].items()}
        per = {}
        for kind in sorted(set(kinds.values())):
            series = [max([v for name, v in rows[k].items() if kinds[name] == kind] or [0.0]) for k in sorted(rows)]
            base0 = max(series[:5])
            growth = max([(d - base0) / k for k, d in enumerate(series) if k > 0] + [0.0])
            last = args.steps - 1
            below = all(v <= TRAINER.at(kinds[name], k) for k in rows for name, v in rows[k].items())
            ok &= below
            per[kind] = {"max": max(series), "at_step_0_to_4": base0, "growth_per_step": growth,
                         "floor_at_last_step": TRAINER.at(kind, last), "all_below_floor": below}
        result["by_devices"][str(n)] = per
    result["within_floor"] = ok
    print(json.dumps(result))


if __name__ == "__main__":
    main()
