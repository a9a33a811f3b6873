"""`replay pack RUN --steps A:B -o FILE`: one file with everything needed to replay steps A..B elsewhere."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from replay.cli import console
from replay.engine.code import allowing
from traces.storage import shown


def pack(
    run: Annotated[Path, typer.Argument(metavar="RUN", help="The run directory (or a bundle) to pack.", show_default=False)],
    out: Annotated[Path, typer.Option("-o", "--out", help="The bundle file to write (e.g. bug.rpk).", show_default=False)],
    steps: Annotated[Optional[str], typer.Option("--steps", help="A:B (inclusive) or A; optional with --from-bisect/--spike.")] = None,
    lite: Annotated[bool, typer.Option("--lite", help="Trace and report only: no checkpoint, no batch data (compare, not replay).")] = False,
    force: Annotated[bool, typer.Option("--force", help="Overwrite FILE if it exists.")] = False,
    from_bisect: Annotated[Optional[Path], typer.Option("--from-bisect", metavar="RUN_B",
                                                        help="Bisect RUN against RUN_B and put the finding in the report.")] = None,
    spike: Annotated[Optional[int], typer.Option("--spike", metavar="S", help="Report the loss spike at step S (replay spike).")] = None,
    data: Annotated[Optional[str], typer.Option("--data", help="Where the run's token file is now.")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print what was written as JSON.")] = False,
    allow_code: Annotated[bool, typer.Option("--allow-code", help="Run the training-loop code the run's manifest "
                                             "names from a folder it names: your own "
                                             "checkout, never a bundle's or the run's own folder.")] = False,
) -> None:
    """Pack steps A..B of a run into one file: manifest, trace, checkpoint, batch data and REPORT.md.
    RUN on gs:// or s3://: --lite reads only the records it packs; a full bundle (and --from-bisect,
    --spike) downloads a local copy of the whole run once, for its checkpoint, program and examples."""
    from replay import bundle
    from replay.engine.engine import parse_steps

    console.local_output("-o", out)
    rng = parse_steps(steps) if steps is not None else None
    run, from_bisect = shown(run), None if from_bisect is None else shown(from_bisect)  # URLs with their "//"
    with allowing(allow_code):  # --from-bisect and --spike replay the run with its own code
        result = bundle.pack(run, out, rng, lite=lite, force=force, data=data, from_bisect=from_bisect, spike=spike,
                             on_status=console.status)
    if json_out:
        console.print_json(result.to_json())
        return
    a, b = result.steps
    what = "lite: trace and report" if result.lite else f"checkpoint {result.checkpoint}, {result.examples} examples"
    console.print_text(f"wrote {result.path}: {bundle.fmt_bytes(result.size)} ({result.size} bytes), steps {a}..{b} "
                       f"({what}), bundle format_version {bundle.FORMAT_VERSION}, sha256 {result.sha256[:16]}")
    console.print_table(
        [(p.name, p.detail, bundle.fmt_bytes(p.packed_bytes), f"{100 * p.packed_bytes / result.size:.0f}%",
          bundle.fmt_bytes(p.raw_bytes)) for p in result.parts],
        columns=("part", "contents", "in the bundle", "share", "unpacked"), title="what takes the space",
        justify=("left", "left", "right", "right", "right"),
    )
    if result.finding:
        console.print_text(f"finding: {result.finding['headline']}")
    name = result.path.name
    todo = (f"to look at it anywhere: replay show {name}, or replay bisect {name} RUN --no-refine" if result.lite
            else f"to replay it anywhere: replay run {name} --steps {a}:{b}")
    console.print_text(f"{todo}   (REPORT.md inside: replay unpack {name} DIR)")


def register(app: typer.Typer) -> None:
    app.command("pack")(pack)
