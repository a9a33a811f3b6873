"""`replay run RUN --steps A:B`: re-run recorded steps from a checkpoint and verify them bit for bit."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from replay.cli import console
from replay.cli.distributed import (Coordinator, NumProcesses, ProcessId, any_process, first_process_prints, initialize,
                                    prints_report)
from replay.errors import EXIT_DIVERGED
from replay.engine.human_names import namer


def _fmt_distance(d: dict | None) -> str:
    if not d:
        return ""
    if d.get("nan"):
        return "NaN involved"
    return f"abs {d['abs']:.3g}  rel {d['rel']:.3g}  ulp {d['ulp']}"


def run(
    path: Annotated[Path, typer.Argument(help="The run directory, or a bundle (`replay pack`).")],
    steps: Annotated[Optional[str], typer.Option("--steps", help="A:B (inclusive) or A; a bundle's own range by default.")] = None,
    data: Annotated[Optional[str], typer.Option("--data", help="Where the run's token file is now.")] = None,
    allow_data_change: Annotated[bool, typer.Option("--allow-data-change",
                                                    help="Replay although the data fingerprint changed.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    allow_damaged: Annotated[bool, typer.Option("--allow-damaged", help="Replay steps a damaged trace can still read "
                                                                        "(the report says the trace is damaged).")] = False,
    allow_code: Annotated[bool, typer.Option("--allow-code", help="Run the training-loop code the run's manifest "
                                             "names from a folder it names: your own "
                                             "checkout, never a bundle's or the run's own folder.")] = False,
    coordinator: Coordinator = None,
    num_processes: NumProcesses = 1,
    process_id: ProcessId = 0,
) -> None:
    """Replay steps A..B of a run and compare every recorded field with the trace.

    A run recorded on several processes replays bit for bit on as many: start this command once
    per process with the same --coordinator and --num-processes and its own --process-id (each
    restores its checkpoint shards and feeds its rows); only process 0 prints the report, and
    every process exits with the same code. In one process it replays measured only."""
    initialize(coordinator, num_processes, process_id)  # before anything touches a device
    from replay.bundle import default_steps, open_run
    from replay.engine.damage import describe_damage, named_as_bundle, run_damage
    from replay.cli.replaying import load_replayable, prepare_process, replay_notes, replay_progress
    from replay.engine.engine import check_range, parse_steps, replay

    target = open_run(path, for_replay=True)  # a run folder, or a bundle unpacked to a temporary folder
    with named_as_bundle(target):  # errors name the bundle file, not the temporary folder
        prepare_process(target)
        processes_note = _check_processes(target, coordinator)
        first, last = parse_steps(steps) if steps else default_steps(target) or console.fail("--steps A:B is required")
        remedy = None if allow_damaged else "pass --allow-damaged to replay steps it can read"
        with first_process_prints(coordinator):
            replayable, contract = load_replayable(target, path, data, allow_data_change,
                                                   lambda checkpoints: check_range(target, first, last, checkpoints),
                                                   damaged_remedy=remedy, allow_code=allow_code)
            with replay_progress(f"replay {path.name}", last) as on_step:
                report = replay(target, replayable, first, last, contract, on_step)
    report.notes.extend(target.notes)  # e.g. a manifest from before checksums: taken as recorded
    report.notes.extend(replay_notes(replayable))
    if processes_note:
        report.notes.append(processes_note)
    damage = run_damage(target)
    if damage:
        report.notes.append(f"the trace is damaged ({describe_damage(target, damage)}): only steps "
                            f"{report.checkpoint}..{report.last} were replayed and verified, not the run")
    if prints_report(coordinator):
        if json_out:
            console.print_json(report.to_json())
        else:
            _render(report, namer(target.manifest))
    if any_process(not report.exact):  # every process exits with one code, whatever each compared
        raise typer.Exit(EXIT_DIVERGED)
    if report.stopped_at is not None:  # everything replayed matched, but not every step asked for was replayed
        k = report.stopped_at
        from replay.engine.edits import describe

        console.fail(f"steps {k}..{last} not replayed: {describe(report.edit['leaves'], k)}, and no checkpoint holds "
                     f"the edited state; save one after the edit (run.save({k}, state)) to replay past it, or replay "
                     f"up to step {k - 1}")


def _check_processes(target, coordinator: str | None) -> str | None:
    """A run recorded on several processes replays in one (measured only: the contract line names
    process_count; the note returned says how to get bits) or on as many as it recorded; any
    other count is refused before compiling."""
    import jax

    recorded = (target.manifest.get("environment") or {}).get("process_count")
    here = jax.process_count()
    if not isinstance(recorded, int) or here == recorded:
        return None
    if coordinator is not None:
        from replay.engine.damage import shown_path

        if recorded == 1:
            console.fail(f"{shown_path(target)} was recorded in one process and this replay has {here}: replay it in "
                         "one process, without --coordinator")
        console.fail(f"{shown_path(target)} was recorded on {recorded} processes and this replay has {here}: replay it on "
                     f"{recorded} (--num-processes {recorded}, once per --process-id), or in one process without "
                     "--coordinator (measured only)")
    return (f"recorded on {recorded} processes, replayed in {here}: for bits, start this command once per process "
            f"with --coordinator HOST:PORT --num-processes {recorded} --process-id I")


def _render(report, shown=str) -> None:
    """The report for people; `shown`: the display name of a recorded tensor (replay/engine/human_names.py)."""
    j = report.to_json()
    exact_word = "bit-exact" if report.contract.expect_bits else "bit-identical (not promised here)"
    rows = [
        ("steps", f"{report.first}..{report.last}"),
        ("from checkpoint", str(report.checkpoint)),
        ("replayed", str(j["replayed"])),
        (exact_word, f"{j['bit_exact']} of {j['replayed']}"),
        ("warm-up steps verified", f"{j['warmup_bit_exact']} of {j['warmup_replayed']} bit-identical"),
        ("contract", report.contract.line),
    ]
    for key, rec, here in report.contract.differences:
        rows.append((f"differs: {key}", f"recorded {rec}, here {here}"))
    rows += [("note", n) for n in report.notes]
    console.print_table(rows, title=f"replay {report.run}")
    first = report.first_mismatch
    if first is None:
        console.print_text(f"all {len(report.steps)} replayed steps are bit-identical to the trace", style="green")
        return
    console.print_table(
        [(d.kind, shown(d.name), "" if d.a is None else repr(d.a), "" if d.b is None else repr(d.b),
          _fmt_distance(d.distance), "" if d.positions is None else ", ".join(map(str, d.positions[:16])))
         for d in first.diffs[:20]],
        columns=("kind", "field or layer", "recorded", "replayed", "distance", "examples"),
        title=f"first mismatch: step {first.step}{' (warm-up)' if first.warmup else ''}",
    )
    if len(first.diffs) > 20:
        console.print_text(f"... and {len(first.diffs) - 20} more fields (see --json)")
    verdict = ("the contract promised bits here: this is a real divergence" if report.contract.expect_bits
               else "the contract does not promise bits on this machine; the distances above are measurements")
    console.print_text(f"{len(j['mismatched_steps'])} step(s) differ; {verdict}", style="red")
    if any(d.kind in ("forward", "backward", "update", "state") for d in first.diffs):
        console.print_text("for tensors the trace holds fingerprints and RMS only: 'recorded'/'replayed' are RMS values")


def register(app: typer.Typer) -> None:
    app.command("run")(run)
