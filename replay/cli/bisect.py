"""`replay bisect RUN_A RUN_B`: where two runs first part, and why."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from replay.cli import console
from replay.cli.errors import EXIT_DIVERGED


def bisect(
    run_a: Annotated[Path, typer.Argument(help="The reference run.")],
    run_b: Annotated[Path, typer.Argument(help="The run to compare with it.")],
    json_out: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="Write both loss curves and their difference to this PNG.")] = None,
) -> None:
    """Name the first step, field and cause where two runs differ."""
    from replay.bisect import bisect as run_bisect
    from traces import Run

    a, b = Run.open(run_a), Run.open(run_b)
    report = run_bisect(a, b)
    if plot is not None:
        from replay.plot import plot_divergence

        plot_divergence(a, b, report.comparison.first_step, plot)
        report.notes.append(f"plot written to {plot}")
    if json_out:
        console.print_json(report.to_json())
    else:
        render(report)
    if not report.identical:
        raise typer.Exit(EXIT_DIVERGED)


def render(report) -> None:
    if report.manifest:
        console.print_table([(m.key, str(m.a), str(m.b)) for m in report.manifest[:30]],
                            columns=("what differs before any step ran", "A", "B"))
    c = report.comparison
    if report.identical:
        console.print_text(f"identical: steps {c.compared[0]}..{c.compared[1] - 1} are bit-identical in both runs "
                           f"(A holds {c.a_range[0]}..{c.a_range[1] - 1}, B {c.b_range[0]}..{c.b_range[1] - 1})",
                           style="green")
        return
    rows = [("first divergent step", str(c.first_step)), ("cause", report.cause or "")]
    if report.layer:
        rows.append(("layer", report.layer))
    if report.cause == "data":
        positions = c.first.positions or []
        rows.append(("examples that differ", f"{len(positions)} of the batch: {', '.join(map(str, positions[:24]))}"))
        for run in ("B", "A"):
            rep = report.repeated(run)
            if rep:
                where = sorted({s["step"] for e in rep for s in e.seen if s["run"] == run})
                rows.append((f"already seen by {run}", f"{len(rep)} of them, first fed at steps {', '.join(map(str, where[:12]))}"))
    rows.append(("replays", str(report.replays)))
    console.print_table(rows, title=f"bisect {report.run_a} vs {report.run_b}")
    console.print_table(
        [(d.kind, d.name, "" if d.a is None else f"{d.a:.6g}" if isinstance(d.a, float) else str(d.a),
          "" if d.b is None else f"{d.b:.6g}" if isinstance(d.b, float) else str(d.b),
          "" if not d.distance or d.distance.get("nan") else f"abs {d.distance['abs']:.3g} ulp {d.distance['ulp']}")
         for d in c.diffs[:15]],
        columns=("kind", "field", "A", "B", "distance"), title=f"fields that differ at step {c.first_step}, causal order",
    )
    if report.refinement:
        r = report.refinement
        console.print_table([(k, str(v)) for k, v in r.items() if not isinstance(v, (list, dict))], title="inside the layer")
    for note in report.notes:
        console.status(note)


def register(app: typer.Typer) -> None:
    app.command("bisect")(bisect)
