"""The donated state written in place for every preset, trace level and model option, on the CPU.

    python -m bench.donation [--presets tiny,demo,olmo-1b,olmo3-7b] [--devices 8]

For each preset, in one process with --devices virtual CPU devices, compiles the train step from
abstract shapes (trainer/plan.py: nothing allocated) and reads from the compiled HLO whether the
donated state comes back in the very buffers it went in (trainer/donation.py: every donated
parameter aliased with an output and none copied but the step's scalars). The combinations:

  levels    off, step, layer with the preset as it is;
  options   at level step, one at a time: remat full, remat dots, scan over layers, bf16 compute
            (fp32 master weights), the other attention (fused <-> explicit), mesh-invariant mode
            (explicit attention, 8 microbatches); and all at once (remat full + scan + bf16).

tests/trainer/test_donation.py shows the check failing for a step that copies its state.
Budget: every combination in place (`all_in_place`). Prints one JSON object on the last line
(per combination: in_place, aliased / donated leaves, copied and unaliased bytes, compile s).
Cost: 10 compiles per preset (tiny and demo 2-6 s each on 2 cores, olmo-1b 7-44 s, olmo3-7b
13-182 s, the layer level the longest: 14 minutes for the four); nothing depends on a run's length.
Measured (session 12, 8 devices): 40 of 40 in place; at most 4,648 bytes copied (demo at level
layer, under the 1% the check allows), against 1.7 MB to 10.9 GB donated per device.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from trainer.constants import TRACE_LEVELS  # no jax at module level
from trainer.plan import EXIT_BAD_INPUT  # trainer.plan imports no jax at module level

OPTIONS: dict[str, list[str]] = {
    "remat-full": ["model.remat=full"],
    "remat-dots": ["model.remat=dots"],
    "scan": ["model.scan_layers=true"],
    "bf16": ["model.dtype=bfloat16", "model.param_dtype=float32"],
    "other-attention": [],  # filled per preset: the attention it does not default to
    "mesh-invariant": ["model.attention=explicit", "mesh.mesh_invariant=true", "mesh.n_microbatches=8"],
    "remat-full+scan+bf16": ["model.remat=full", "model.scan_layers=true", "model.dtype=bfloat16",
                             "model.param_dtype=float32"],
}


def combinations(preset: str) -> list[tuple[str, str, list[str]]]:
    """(name, trace level, config overrides) of every combination planned for `preset`."""
    from trainer.presets import get_preset

    other = "explicit" if get_preset(preset).model.attention == "fused" else "fused"
    out = [(f"level-{level}", level, []) for level in TRACE_LEVELS]
    for name, sets in OPTIONS.items():
        out.append((name, "step", [f"model.attention={other}"] if name == "other-attention" else sets))
    return out


def run(presets: list[str], n_devices: int, log=lambda msg: None) -> dict:
    from trainer.config import apply_overrides
    from trainer.presets import get_preset
    from trainer.plan import plan

    rows: dict[str, dict] = {}
    for preset in presets:
        for name, level, sets in combinations(preset):
            key = f"{preset}/{name}"
            try:
                r = plan(apply_overrides(get_preset(preset), sets), n_devices, preset=preset, level=level)
            except Exception as e:  # one combination failing to plan is reported, the rest still run
                rows[key] = {"error": f"{type(e).__name__}: {' '.join(str(e).splitlines())[:300]}"}
                log(f"{key}: {rows[key]['error']}")
                continue
            d = r["donation"]
            rows[key] = {"level": level, "overrides": sets, "in_place": d["in_place"],
                         "aliased_leaves": d["aliased_leaves"], "donated_leaves": d["donated_leaves"],
                         "donated_bytes": d["donated_bytes"], "copied_bytes": d["copied_bytes"],
                         "unaliased_bytes": d["unaliased_bytes"], "compile_s": r["seconds"]["compile"]}
            log(f"{key}: {'in place' if d['in_place'] else 'NOT in place'} ({d['aliased_leaves']} of "
                f"{d['donated_leaves']} leaves aliased, {d['copied_bytes']} B copied; compiled in "
                f"{r['seconds']['compile']:.1f} s)")
    ok = bool(rows) and all(row.get("in_place") is True for row in rows.values())
    return {"bench": "donation", "devices": n_devices, "presets": presets, "combinations": rows,
            "n_combinations": len(rows), "n_in_place": sum(row.get("in_place") is True for row in rows.values()),
            "all_in_place": ok, "budget": {"every_combination_in_place": True}, "within_budget": ok}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="tiny,demo,olmo-1b,olmo3-7b")
    ap.add_argument("--devices", type=int, default=8)
    args = ap.parse_args(argv)
    from trainer.presets import PRESETS
    from trainer.plan import plan_env

    presets = [p for p in args.presets.split(",") if p]
    unknown = [p for p in presets if p not in PRESETS]
    if unknown or not presets or args.devices < 1:
        problem = (f"unknown preset {unknown[0]!r}; valid presets: {', '.join(PRESETS)}" if unknown
                   else "--presets names no preset" if not presets else f"--devices {args.devices} is not >= 1")
        print(f"error: {problem}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT)
    if "jax" in sys.modules:
        raise SystemExit("bench.donation sets the device count before JAX starts; run it as python -m bench.donation")
    os.environ.update(plan_env(args.devices))  # before JAX initialises: N virtual CPU devices
    report = run(presets, args.devices,
                 log=lambda msg: print(f"donation: {msg}", file=sys.stderr, flush=True))
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
