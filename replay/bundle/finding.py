"""The finding a bundle carries (`replay pack --from-bisect/--spike`): a JSON summary of
`replay bisect` or `replay spike` on the run being packed, shown in its REPORT.md."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from replay.engine.contract import config_of
from replay.bundle.format import PackError, open_run
from replay.engine.damage import damage_error, named_as_bundle
from replay.bundle.report import _short, _value
from traces import Run
from replay.bisect import bisect, comparability_problem
from replay.engine import contract as contractlib
import replay.spike as spikelib


def _bisect_finding(run: Run, run_path, other) -> dict:
    """`replay bisect RUN OTHER`, refusing what bisect refuses: another model or batch size, a
    damaged OTHER; a replay the finding needs that fails here fails the pack."""
    run_b = open_run(other)
    damaged = damage_error(run_b, f"--from-bisect {other}", "its finding would not be a finding: restore its files "
                           "from a copy, or pack with --steps A:B alone")
    if damaged:
        raise damaged
    problem = comparability_problem(run, run_b)
    if problem:
        raise PackError(f"--from-bisect {other}: {problem}")
    with named_as_bundle(run), named_as_bundle(run_b):
        report = bisect(run, run_b)
        if report.failure is not None:
            raise report.failure
    c = report.comparison
    out: dict[str, Any] = {"kind": "bisect", "run_a": str(run_path), "run_b": str(other), "identical": report.identical,
                           "step": c.first_step, "cause": report.cause, "layer": report.layer,
                           "compared": list(c.compared), "manifest_diff": [[m.key, m.a, m.b] for m in report.manifest[:20]],
                           "fields": [{"kind": d.kind, "name": d.name, "a": d.a, "b": d.b, "distance": d.distance,
                                       "positions": d.positions} for d in c.diffs[:20]],
                           "more_fields": max(0, len(c.diffs) - 20),
                           "repeated_in_b": [{"position": e.position, "hash": e.example_hash, "seen": e.seen[:3]}
                                             for e in report.repeated("B")],
                           "repeated_in_a": [{"position": e.position, "hash": e.example_hash, "seen": e.seen[:3]}
                                             for e in report.repeated("A")],
                           "refinement": report.refinement, "notes": list(report.notes)}
    if report.identical:
        out["headline"] = f"identical over steps {c.compared[0]}..{c.compared[1] - 1}"
    else:
        where = f" in {report.layer}" if report.layer else ""
        out["headline"] = f"first divergence at step {c.first_step}: {report.cause}{where}"
        if out["repeated_in_b"]:
            out["headline"] += f"; {len(out['repeated_in_b'])} example(s) of B's batch were already seen by B"
    return out


def _spike_finding(run: Run, run_path, step: int, data: str | None, status) -> dict:
    """`replay spike RUN --step S` on the run being packed: detection from the trace, then the
    analysis, which replays the window from a checkpoint (verifying every step)."""
    trace = run.trace
    if not trace.start <= step < trace.end:
        raise PackError(f"--spike {step} is outside the recorded steps {trace.start}..{trace.end - 1} of {run_path}")
    window = min(spikelib.DEFAULT_WINDOW, step - trace.start)
    if window < spikelib.MIN_WINDOW:
        raise PackError(f"--spike {step}: only {step - trace.start} recorded steps before it; a spike's baseline needs "
                        f"at least {spikelib.MIN_WINDOW}")
    out: dict[str, Any] = {"kind": "spike", "step": step, "window": window, "run": str(run_path), "notes": []}
    try:
        found = spikelib.scan(run, window)
        out["threshold"] = found.threshold
        out["detected"] = any(sp.step == step for sp in found.spikes)
        out["spikes"] = [sp.step for sp in found.spikes][:20]
    except spikelib.SpikeInputError as e:
        out["notes"].append(f"detection did not run: {e}")
    from replay.engine.protocol import load

    status(f"replaying the window of step {step} to analyse it (replay spike {run_path} --step {step} --window {window})")
    rep = load(run, data=data)
    env = contractlib.recorded_environment(run.manifest)
    contract = contractlib.evaluate(env, rep.environment(), run.manifest.get("program_hash"), rep.program_hash(),
                                    bool(config_of(run.manifest).get("mesh", {}).get("mesh_invariant")),
                                    tuple(run.manifest.get("invariant_device_counts", ())))
    report = spikelib.analyze(run, rep, step, contract, window)
    j = report.to_json()
    replayed = j["replay"] or {}
    out.update({"loss": j["loss"], "grad_norm": j["grad_norm"], "typical_example_loss": j["typical_example_loss"],
                "examples": j["examples"], "first_jump": j["first_jump"], "layer_source": j["layer_source"],
                "injected_positions": j["injected_positions"],
                "replay": {k: replayed.get(k) for k in ("checkpoint", "replayed", "bit_exact", "warmup_replayed",
                                                         "warmup_bit_exact", "all_bit_exact")}
                          | {"contract": contract.line}})
    out["notes"] += j["notes"]
    loss = j["loss"] or {}
    verdict = "a spike" if out.get("detected") else "not flagged as a spike"
    out["headline"] = (f"loss {_value(loss.get('loss'))} at step {step} against a baseline of "
                       f"{_short(loss.get('baseline'))} (score {_short(loss.get('score'))}, {verdict} at threshold "
                       f"{out.get('threshold', '?')})")
    if j["first_jump"]:
        out["headline"] += f"; first layer to jump: {j['first_jump']['name']}"
    return out


def _json_safe(obj: Any) -> Any:
    """NaN and infinities as strings, numpy scalars as Python values: strict JSON."""
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    return obj
