"""`replay audit RUN`: did the run see its data in the promised order?

A thin wrapper over replay/audit/__init__.py. Read-only. Exit codes:
  0  no example came back early
  1  the data order is violated (examples came back within the epoch that already had them)
  2  bad input: no such run, not a run, a damaged run (a damaged or missing segment, a damaged
     index table; with --verify also a damaged record; a crashed run's torn last record is not
     damage: what was recorded is audited), no recorded step, a bad --steps or one reaching past
     the recorded steps (refused, never clipped)

Cost at a million steps: reads each segment's example-hash table (~8 KB a step at 1,024 examples
a step), one range at a time; --verify reads every record's checksum too, about as much again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from replay.cli import console
from replay.errors import EXIT_DIVERGED
from traces.storage import shown

SHOWN_REPEATS = 20  # steps in the human table
JSON_REPEATS = 1000  # steps in --json; a run that replays data for days would otherwise print gigabytes
JSON_EPOCHS = 1000
SHOWN_EPOCHS = 20


def register(app: typer.Typer) -> None:
    app.command("audit")(audit)


def audit(
    run: Annotated[Path, typer.Argument(metavar="RUN", help="The run directory (what `replay train --out` wrote).", show_default=False)],
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout instead of tables.")] = False,
    steps: Annotated[Optional[str], typer.Option("--steps", metavar="A:B", help="Audit only steps A..B-1, within the recorded steps (either side may be left out).")] = None,
    source: Annotated[
        Optional[bool],
        typer.Option("--source/--no-source", help="Hash the run's data source to tell duplicate windows from sampler bugs "
                     "(default: when the source is here and small)."),
    ] = None,
    verify: Annotated[bool, typer.Option("--verify", help="Also check every audited record's checksum (reads about as much again "
                                                         "as the hash tables the verdict rests on).")] = False,
) -> None:
    """Audit a run's data order from its per-example hashes: which examples came back early, and where."""
    from replay import audit as lib
    from replay.bundle import open_run
    from replay.engine.damage import damage_error

    opened = open_run(run)  # a run folder, a bundle file, or a folder a bundle was unpacked to (checked as one)
    damaged = damage_error(opened, f"{run}: its trace", "restore the run's files from a copy (audit never passes a "
                           "damaged run)")
    if damaged:
        raise damaged
    report = lib.audit(opened, parse_steps(steps), source=source, verify=verify)
    data = to_json(report, run)
    if json_out:
        console.print_json(data)
    else:
        render(report, data)
    for note in report.notes:
        if "more than the dataset" in note:
            console.warn(note)
        else:
            console.status(note)
    if not report.ok:
        raise typer.Exit(EXIT_DIVERGED)


def parse_steps(text: str | None) -> tuple[int | None, int | None]:
    """"A:B" (half-open, like a Python slice), "A:", ":B"; one line and exit 2 when malformed."""
    if text is None:
        return None, None
    parts = text.split(":")
    try:
        if len(parts) != 2:
            raise ValueError
        a, b = (int(p) if p.strip() else None for p in parts)
    except ValueError:
        console.fail(f"--steps {text!r} is not A:B; give a step range such as 100:200, 100: or :200")
    if (a is not None and a < 0) or (b is not None and b < 0) or (a is not None and b is not None and b <= a):
        console.fail(f"--steps {text!r} is empty or negative; give A:B with 0 <= A < B")
    return a, b


def to_json(report, run: Path) -> dict[str, Any]:
    repeats = report.early_repeats(limit=JSON_REPEATS)
    pe = report.per_epoch
    return {
        "ok": report.ok,
        "run": shown(run),  # a URL with its "//" (a Path argument drops one)
        "steps": {"start": report.start, "end": report.end, "count": report.end - report.start},
        "examples_per_step": report.examples_per_step,
        "dataset_size": report.dataset_size if report.dataset_size_from != "trace" else None,
        "dataset_size_from": report.dataset_size_from,
        "epoch_size": report.dataset_size,
        "examples_seen": report.examples_seen,
        "distinct": report.distinct,
        "epochs": report.epochs if report.dataset_size_from != "trace" else None,  # never counted from the trace alone
        "times_seen": {str(k): v for k, v in report.times_seen.items()},
        "early_repeats": [
            {"step": r.step, "epoch": r.epoch, "positions": list(r.positions),
             "first_seen": [{"step": s, "position": p} for s, p in r.first_seen]}
            for r in repeats
        ],
        "early_repeat_steps": report.early_repeat_steps,
        "early_repeat_examples": int(report.early_slots.size),
        "early_repeats_truncated": report.early_repeat_steps > len(repeats),
        "first_early_repeat_step": report.first_early_repeat_step,
        "duplicate_content": {
            "repeats": int(report.duplicate_slots.size),
            "hashes": [{**d, "hash": f"{d['hash']:016x}"} for d in report.duplicates[:JSON_REPEATS]],
        },
        "per_epoch": [
            {k: (bool(v[i]) if k == "complete" else int(v[i])) for k, v in pe.items()} for i in range(min(pe["epoch"].size, JSON_EPOCHS))
        ],
        "summary": report.summary(),
        "notes": list(report.notes),
    }


def render(report, data: dict[str, Any]) -> None:
    origin = {"source": "the data source", "declared": "declared at replay.init: each example once per epoch",
              "manifest": "the manifest's data",
              "tokens": "rows of packed tokens: the tokens declared at replay.init over a row's tokens"}.get(
        report.dataset_size_from, report.dataset_size_from)
    size = (f"{report.dataset_size} ({origin})" if report.dataset_size_from != "trace"
            else f"unknown, not declared (epochs taken as the {report.dataset_size} distinct examples seen: "
                 "early repeats can be missed)")
    times = ", ".join(f"{k}x: {v}" for k, v in list(report.times_seen.items())[:8])
    rows = [
        ("steps", f"{report.start}..{report.end - 1} ({report.end - report.start} steps x {report.examples_per_step} examples)"),
        ("dataset size", size),
        ("examples seen", report.examples_seen),
        ("distinct examples", report.distinct),
        ("times seen", times + (", ..." if len(report.times_seen) > 8 else "")),
        ("epochs", f"{report.epochs} ({report.examples_seen / report.dataset_size:.3g} of the data)"
         if report.dataset_size_from != "trace" else "not counted: the dataset size is unknown"),
        ("came back early", console.styled(f"{report.early_slots.size} examples in {report.early_repeat_steps} steps",
                                           "red" if not report.ok else "green")),
        ("duplicate content", f"{report.duplicate_slots.size} repeats of {len(report.duplicates)} duplicated windows"),
    ]
    console.print_table(rows, title=f"audit {data['run']}")

    pe = report.per_epoch
    flagged = [i for i in range(pe["epoch"].size) if pe["early"][i] or pe["duplicate"][i]]
    shown = sorted(set([0, pe["epoch"].size - 1] + flagged[:SHOWN_EPOCHS - 2]))
    console.print_table(
        [(pe["epoch"][i], f"{pe['first_step'][i]}..{pe['last_step'][i]}", pe["slots"][i],
          "yes" if pe["complete"][i] else "no", pe["distinct"][i],
          console.styled(str(pe["early"][i]), "red") if pe["early"][i] else "0", pe["duplicate"][i]) for i in shown],
        columns=["epoch", "steps", "examples", "complete", "distinct", "came back early", "duplicate content"],
        title="per epoch" + (f" (showing {len(shown)} of {pe['epoch'].size}; see --json)" if len(shown) < pe["epoch"].size else ""),
        justify=["right", "left", "right", "left", "right", "right", "right"],
    )
    if not report.ok:
        repeats = report.early_repeats(limit=SHOWN_REPEATS)
        console.print_table(
            [(r.step, r.epoch, _list(r.positions), _list(f"{s}:{p}" for s, p in r.first_seen)) for r in repeats],
            columns=["step", "epoch", "positions", "first seen (step:position)"],
            title=f"came back early (first {len(repeats)} of {report.early_repeat_steps} steps)",
            justify=["right", "right", "left", "left"],
        )
    console.print_text(report.summary(), style="bold green" if report.ok else "bold red")


def _list(items, limit: int = 8) -> str:
    items = [str(i) for i in items]
    return ", ".join(items[:limit]) + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")
