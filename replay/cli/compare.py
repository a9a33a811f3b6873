"""`replay compare A B --eval`: do two runs' checkpoints agree on held-out data (replay/compare/)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Optional

import typer

from replay.cli import console
from replay.errors import EXIT_DIVERGED
from replay.engine.code import allowing
from traces.storage import as_path, is_url, shown


def _parse_steps(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        steps = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        console.fail(f"--steps {text!r}: give checkpoint steps separated by commas, e.g. --steps 10,50,100")
    if not steps or min(steps) < 0:
        console.fail(f"--steps {text!r}: give one or more checkpoint steps >= 0, e.g. --steps 10,50,100")
    return steps


def _num(x: float) -> str:
    return "nan" if isinstance(x, float) and math.isnan(x) else f"{x:.7g}"


def compare(
    run_a: Annotated[Path, typer.Argument(help="The reference run (a trainer run, a replay.torch run, or a JAX "
                                               "loop's run).")],
    run_b: Annotated[Path, typer.Argument(help="The run to compare with it.")],
    eval_: Annotated[bool, typer.Option("--eval", help="Evaluate both runs' checkpoints on the same held-out rows, "
                                                       "each with its own framework's code.")] = False,
    steps: Annotated[Optional[str], typer.Option("--steps", help="Checkpoint steps to evaluate, comma-separated "
                                                                 "(default: early, middle and late).")] = None,
    examples: Annotated[Optional[int], typer.Option("--examples", help="Held-out rows to evaluate on (default 64; "
                                                    "a JAX loop's are its eval_batches).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    allow_code: Annotated[bool, typer.Option("--allow-code", help="Run the training-loop code the run's manifest "
                                             "names from a folder it names (never from inside a bundle).")] = False,
) -> None:
    """Whether two runs' checkpoints agree: the eval-loss difference at early, middle and late
    checkpoints against the float32 noise floor measured on the runs' own weights.
    Exit 0 agree, 1 differ, 2 bad input. A run on gs:// or s3:// is evaluated from a local copy,
    downloaded once (the whole run: its checkpoints, program and examples)."""
    from replay.compare import compare_eval
    from replay.compare.floor import RULES

    if not eval_:
        console.fail("replay compare needs --eval (the only comparison it makes so far); for where two runs part, "
                     "use replay bisect A B")
    for path in (run_a, run_b):  # a run on object storage: its checkpoints from a local copy (replay.engine.protocol.local_run)
        if not as_path(path).exists():
            console.fail(f"{shown(path)}: no such run; pass the folder a training run wrote")
    same = shown(run_a) == shown(run_b) if is_url(run_a) or is_url(run_b) else run_a.resolve() == run_b.resolve()
    if same:
        console.fail(f"{shown(run_a)} and {shown(run_b)} are the same run; compare two different runs")
    with allowing(allow_code):  # a JAX loop's runs are evaluated with the loop's own code
        report = compare_eval(shown(run_a), shown(run_b), steps=_parse_steps(steps), examples=examples)
    if json_out:
        j = report.to_json()
        for row in j["steps"]:  # JSON has no NaN: a diverged loss is a string
            for k, v in row.items():
                if isinstance(v, float) and not math.isfinite(v):
                    row[k] = str(v)
        console.print_json(j)
    else:
        rows = [(str(r.step), _num(r.loss_a), _num(r.loss_b), _num(r.difference), _num(r.tolerance),
                 console.styled("agree" if r.agree else "DIFFER", "green" if r.agree else "red")) for r in report.rows]
        console.print_table(rows, columns=("step", f"eval loss A ({report.framework_a})",
                                           f"eval loss B ({report.framework_b})", "B - A", "tolerance", ""),
                            title=f"replay compare --eval: {report.examples} held-out rows, each run with its own code")
        console.print_text(f"tolerance ({report.floor} floor) = {RULES[report.floor]}")
        for note in report.notes:
            console.print_text(f"note: {note}")
        if report.agree:
            n = len(report.rows)
            console.print_text(f"agree within the noise floor at {n} checkpoint{'s' if n != 1 else ''}", style="green")
        else:
            console.print_text(f"differ: first at step {report.first_disagreement}; find the step and layer where they "
                               f"part with replay bisect {shown(run_a)} {shown(run_b)}", style="red")
    if not report.agree:
        raise typer.Exit(EXIT_DIVERGED)


def register(app: typer.Typer) -> None:
    app.command("compare")(compare)
