"""`replay verify RUN --steps A:B [--rotate K]`: re-run steps on other devices, name a bad chip."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from replay.cli import console
from replay.errors import EXIT_DIVERGED
from traces.storage import shown


def verify(
    path: Annotated[Path, typer.Argument(help="The run directory (or bundle).")],
    steps: Annotated[str, typer.Option("--steps", help="A:B (inclusive) or A: the steps to verify.")],
    rotate: Annotated[int, typer.Option("--rotate", help="Re-run with the work moved K and 2K devices along the "
                                        "data axis (and unmoved).")] = 1,
    data: Annotated[Optional[str], typer.Option("--data", help="Where the run's token file is now.")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Re-execute steps A..B with the work on other devices; exit 1 when a device computed wrongly
    or a recorded step is reproduced by no re-execution. A run on gs:// or s3:// is replayed from a
    local copy, downloaded once (the whole run: its checkpoints, program and examples)."""
    from replay.bundle import open_run
    from replay.cli.replaying import load_replayable, prepare_process, replay_notes
    from replay.engine.engine import check_range, parse_steps
    from replay.verify import VerifyInputError, refusal, too_few_devices
    from replay.verify import verify as run_verify

    if rotate < 1:
        console.fail(f"--rotate {rotate} must be at least 1")
    name = shown(path)  # a URL with its "//" (a Path argument drops one)
    target = open_run(name, for_replay=True)
    first, last = parse_steps(steps)
    why = refusal(target)  # from the manifest: before anything compiles or prints
    if why:
        raise VerifyInputError(why)
    prepare_process(target)
    import jax

    why = too_few_devices(jax.device_count())  # the replay's mesh has at most these
    if why:
        raise VerifyInputError(f"{name}: {why}")
    replayable, contract = load_replayable(target, name, data, False, lambda cps: check_range(target, first, last, cps))
    with console.progress(f"verify {path.name}") as bar:
        task = bar.add_task("verify", total=last - first + 1, info="")
        report = run_verify(target, replayable, first, last, rotate,
                            lambda step: bar.update(task, advance=1, info=f"step {step}"),
                            None if contract.expect_bits else contract.line)
    report.notes.extend(replay_notes(replayable))
    if json_out:
        console.print_json(report.to_json())
    else:
        _render(report)
    if not report.clean:
        raise typer.Exit(EXIT_DIVERGED)


def _render(report) -> None:
    shards = report.mode == "shards"
    what = (f"each step re-run with its arrays on rotations 0, {report.rotate}, {2 * report.rotate} of {report.devices} "
            f"devices, compared shard by shard" if shards else
            f"rotations 0, {report.rotate}, {2 * report.rotate} of {report.devices} devices"
            + (" and the trace's own per-replica fingerprints" if report.trace_replicas else ""))
    console.print_table([
        ("steps", f"{report.first}..{report.last} ({report.steps_verified} verified, from checkpoint {report.checkpoint})"),
        ("executions", what + "; each step re-run as recorded and compared with the trace"),
        ("shards" if shards else "microbatches",
         f"{report.shards} (on {report.devices_used} devices)" if shards else str(report.microbatches)),
        *[("note", n) for n in report.notes],
    ], title=f"verify {report.run}")
    unit = "shard" if shards else "microbatch"
    if report.clean:
        console.print_text(f"every device agreed on every {unit} of {report.steps_verified} step(s), and each "
                           "step re-ran to the bits the trace recorded", style="green")
        return
    console.print_table(
        [(f.kind, "-" if f.device is None else str(f.device), str(f.step), str(len(f.steps)),
          "" if shards else ", ".join(map(str, f.microbatches[:8])), ", ".join((f.layers or f.fields)[:4]), f.why)
         for f in report.findings],
        columns=("class", "device", "step", "steps", "microbatches", "shards / fields" if shards else "layers / fields",
                 "why"),
        title=f"{len(report.findings)} finding(s)")
    for step, i in report.unresolved[:10]:
        where = report.shard_names[i] if shards else f"microbatch {i}"
        console.print_text(f"step {step} {where}: no two devices agreed; cannot tell which is wrong", style="red")


def register(app: typer.Typer) -> None:
    app.command("verify")(verify)
