"""`replay bisect TORCH_RUN JAX_RUN` (either order): the cross-framework report, its JSON and plot."""

from __future__ import annotations

from pathlib import Path

import typer

from replay.cli import console
from replay.errors import EXIT_DIVERGED


def run_cross(a, b, *, json_out: bool, plot: Path | None, no_refine: bool, floor: str | None = None) -> None:
    from replay.bisect.cross import cross_bisect

    report = cross_bisect(a, b, refine=not no_refine, floor=floor)
    if plot is not None:
        from replay.plot import plot_layer_distances

        plot_layer_distances(report, plot)
        report.notes.append(f"plot written to {plot}")
    if json_out:
        console.print_json(report.to_json())
    else:
        render(report)
    if report.failure is not None:
        raise report.failure  # one error line after the report: 2 bad input, 3 a bug
    if not report.within_noise:
        raise typer.Exit(EXIT_DIVERGED)


def render(report) -> None:
    side = {"A": "torch", "B": "JAX"} if report.torch_side == "A" else {"A": "JAX", "B": "torch"}
    rows = [("runs", f"A ({side['A']}) {report.run_a}, B ({side['B']}) {report.run_b}")]
    d, i = report.inputs.get("data", {}), report.inputs.get("init", {})
    if d:
        rows.append(("data", f"batch hashes equal at every common step {d['steps'][0]}..{d['steps'][1] - 1}"
                     if d["equal"] else f"differ first at step {d['first_step']} (positions "
                     f"{', '.join(map(str, d.get('positions', [])))})"))
    if i:
        rows.append(("initial parameters", "not compared" if i["equal"] is None else
                     "fingerprints equal" if i["equal"] else f"differ (torch {i['torch']}, JAX {i['jax']})"))
    noise = report.noise
    rows.append(("noise floor", f"{noise.name} (measured on {noise.measured_on}; {noise.factor:g}x its envelope)"))
    examined = sorted(report.distances)
    if examined:
        rows.append(("steps examined", f"{len(examined)} of {report.steps[0]}..{report.steps[1] - 1}, distances from "
                     + {"traces": "both traces' distance sketches", "replay": "the torch sketches and the JAX run "
                        "replayed here", "traces+replay": "both traces' distance sketches, and the JAX run replayed "
                        "here at the steps its trace holds none for", "metrics": "the recorded metrics only"}[report.source]))
    if report.within_noise:
        rows.append(("verdict", f"agree within the noise floor at every examined step (largest distance "
                                f"{report.max_ratio:.2g}x the floor)"))
    elif report.first_step is not None:
        rows.append(("first step above the noise floor", str(report.first_step)))
        rows.append(("cause", report.cause_text or ""))
        if report.first_layer and report.cause != "forward":
            rows.append(("field", report.first_layer))
        if report.ratio is not None:
            dist = report.distances.get(report.first_step, {}).get(report.first_layer)
            floor = report.floor.get(report.first_layer)
            rows.append(("distance", f"{dist:.3g} relative, {report.ratio:.3g}x the floor {floor:.3g}"
                         if dist is not None and floor is not None else f"{report.ratio:.3g}x the floor"))
        op = report.op
        if op is not None and op.name and op.ratio is not None:  # replay/bisect/cross_refine.py
            rows.append(("op", f"{op.name}: {op.text}{' (' + op.diagnosis + ')' if op.diagnosis else ''}, "
                               f"{op.ratio:.3g}x the floor on re-running step {report.first_step} (torch weights: "
                               f"{op.weights})"))
    console.print_table(rows, title=f"bisect across frameworks: {report.run_a} vs {report.run_b}")
    at = report.first_step if report.first_step is not None else (examined[-1] if examined else None)
    if at is not None and at in report.distances:
        dist = report.distances[at]
        kinds = dict(report.names)
        shown = [(n, kinds[n], dist[n], report.floor.get(n)) for n, _ in report.names if n in dist][:40]
        console.print_table([(n, k, f"{v:.3g}", "" if f is None else f"{f:.3g}", "above" if f is not None and not v <= f
                              else "") for n, k, v, f in shown],
                            columns=("field", "kind", "relative distance", "floor", ""),
                            title=f"step {at}, causal order")
    for note in report.notes:
        console.status(note)
