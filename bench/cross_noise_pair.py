"""The noise floor of the MaxText / OLMo-core OLMo 3 pair, measured: replay/bisect/cross_floor.py's OLMO3_PAIR.

Records clean pairs with tools/olmo3_pair.py (MaxText's OLMo 3 and OLMo-core's, the same weights and rows),
one per `--data-seeds` (other tokens, hence other weights' trajectories; the tests' pair is data seed 0),
`--steps` steps each, then computes every compared field's relative distance at every step from the
two traces' sketches (what `replay bisect` reads) and prints one JSON line: per seed and causal kind
the largest distance (with its field and step) and the envelope (distance at step 0, then growth per
step: see envelope()), the envelope over the `--fit` seeds, and each
seed's largest distance / floor under every named floor and the fitted one. Seeds outside `--fit` are
held out: their ratio under the table fitted without them is the honest margin. "floor_file" is the
fitted table as `replay bisect --floor FILE` reads it.

Needs both venvs: run it with an interpreter that has torch and ai2-olmo-core (this package's
[olmo-core] extra); the MaxText stages run in MAXTEXT_VENV (default ~/.cache/replay/maxtext-venv-0.2.5,
built by tools/maxtext-env.sh). Cost: per seed one MaxText and one OLMo-core training side by side, about
a minute each at 64 steps (measured: three seeds in 2:55 and 3:47 wall on 2 shared cores), reused when
DIR already holds them. The table in cross_floor.py: `python -m bench.cross_noise_pair` (the defaults).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOOL = str(REPO / "tools" / "olmo3_pair.py")


def _stage(python: str, *args: str, wait: bool = True):
    env = dict(os.environ, DECOUPLE_GCLOUD="TRUE", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    p = subprocess.Popen([python, TOOL, *args], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    return _wait(p) if wait else p


def _wait(p: subprocess.Popen) -> None:
    out, err = p.communicate()
    if p.returncode:
        raise SystemExit(f"error: {' '.join(p.args[1:4])} failed (exit {p.returncode}): {err.strip()[-2000:]}")


def record_pair(root: Path, steps: int, data_seed: int, maxtext_python: str) -> tuple[Path, Path]:
    """DIR/mt_clean and DIR/oc_clean, `steps` steps each, recorded unless already complete."""
    mt, oc = root / "mt_clean", root / "oc_clean"
    if not (root / "hf" / "config.json").exists():
        _stage(sys.executable, "prepare", str(root), f"--data-seed={data_seed}")
    if not (root / "mt_params").exists():
        _stage(maxtext_python, "convert", str(root))
    todo = []
    if not (mt / "COMPLETE").exists():
        todo.append(_stage(maxtext_python, "maxtext", str(root), "mt_clean", f"--steps={steps}", wait=False))
    if not (oc / "COMPLETE").exists():
        todo.append(_stage(sys.executable, "olmo-core", str(root), "oc_clean", f"--steps={steps}", wait=False))
    for p in todo:
        _wait(p)
    return mt, oc


def distances(mt: Path, oc: Path) -> tuple[dict[str, str], dict[int, dict[str, float]]]:
    from replay.bisect.cross_distance import compared_names, from_traces
    from traces import Run

    t, j = Run.open(oc), Run.open(mt)  # the torch side first, as replay/bisect/cross.py orders them
    names = compared_names(t, j)
    end = min(t.trace.end, j.trace.end)
    return dict(names), dict(from_traces(t, j, range(end), names))


def envelope(kinds: dict[str, str], rows: dict[int, dict[str, float]]) -> dict[str, dict]:
    """Per kind: the largest distance (field, step) and the envelope: the distance at step 0, then the
    growth per step. Unlike the trainer pair's fit (bench/cross_noise.py: the largest over steps 0..4),
    the base is step 0 alone: the same weights on the same rows before any update, the ops' own
    rounding; from step 1 on AdamW amplifies it (a gradient that nearly cancels takes an update of
    either sign: seen here as a jump of 100 x from step 0 to step 1 in one data seed), and that is growth."""
    per = {}
    for kind in sorted(set(kinds.values())):
        series = [max([(v, n) for n, v in rows[k].items() if kinds[n] == kind] or [(0.0, "")]) for k in sorted(rows)]
        base0 = series[0][0]
        growth = max([(v - base0) / k for k, (v, _) in enumerate(series) if k > 0] + [0.0])
        top = max(range(len(series)), key=lambda k: series[k][0])
        per[kind] = {"max": series[top][0], "field": series[top][1], "step": top, "at_step_0": base0,
                     "growth_per_step": growth}
    return per


def worst_ratio(kinds: dict[str, str], rows: dict[int, dict[str, float]], floor) -> dict:
    ratio, step, name = max((v / floor.at(kinds[n], k), k, n) for k, row in rows.items() for n, v in row.items())
    return {"max_ratio": ratio, "step": step, "field": name}


def main() -> None:
    from replay.bisect.cross_floor import FLOORS, Floor

    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--data-seeds", default="1,2,3,4,5,0")
    p.add_argument("--fit", default="1,2,3,4,5", help="the seeds whose envelope is the table (the rest held out)")
    p.add_argument("--dir", default=str(Path.home() / ".cache" / "replay" / "cross_noise_pair"))
    p.add_argument("--maxtext-python", default=str(Path(os.environ.get(
        "MAXTEXT_VENV", Path.home() / ".cache" / "replay" / "maxtext-venv-0.2.5")) / "bin" / "python"))
    args = p.parse_args()
    seeds, fit = [int(s) for s in args.data_seeds.split(",")], [int(s) for s in args.fit.split(",")]
    result = {"steps": args.steps, "fit_seeds": fit, "by_seed": {}}
    measured = {}
    for s in seeds:
        mt, oc = record_pair(Path(args.dir) / f"seed{s}", args.steps, s, args.maxtext_python)
        measured[s] = distances(mt, oc)
        result["by_seed"][str(s)] = {"kinds": envelope(*measured[s])}
    base: dict[str, float] = {}
    growth: dict[str, float] = {}
    for s in fit:
        for kind, e in result["by_seed"][str(s)]["kinds"].items():
            base[kind], growth[kind] = max(base.get(kind, 0.0), e["at_step_0"]), max(growth.get(kind, 0.0),
                                                                                   e["growth_per_step"])
    fitted = Floor("fitted", base, growth, measured_on=f"bench/cross_noise_pair.py, data seeds {args.fit}, "
                                                        f"{args.steps} steps")
    for s in seeds:  # a seed outside --fit is held out: its ratio under "fitted" is the honest margin
        result["by_seed"][str(s)]["ratio_under"] = {name: worst_ratio(*measured[s], f)
                                                    for name, f in {**FLOORS, "fitted": fitted}.items()}
    result["floor_file"] = {"name": fitted.name, "base": base, "growth": growth, "factor": fitted.factor,
                            "measured_on": fitted.measured_on}  # what `replay bisect --floor FILE` reads
    print(json.dumps(result))


if __name__ == "__main__":
    main()
