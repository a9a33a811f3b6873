"""`replay train`: train a run with the recording trainer, or resume one."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from replay.cli import console
from replay.cli.distributed import Coordinator, NumProcesses, ProcessId, initialize
from traces.storage import shown
from trainer.config import apply_overrides
from trainer.presets import get_preset


def train(
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="New run directory to create.")] = None,
    preset: Annotated[Optional[str], typer.Option("--preset", "-p", help="tiny, demo, olmo-1b, olmo3-7b.")] = None,
    steps: Annotated[Optional[int], typer.Option("--steps", help="Total steps of the run. On resume: the run's new total, at least the steps it is configured for.")] = None,
    overrides: Annotated[Optional[list[str]], typer.Option("--set", help="Config override section.field=value; repeatable.")] = None,
    resume: Annotated[Optional[Path], typer.Option("--resume", help="Continue this run from its newest checkpoint.")] = None,
    inject: Annotated[Optional[list[str]], typer.Option("--inject", help="Inject a fault NAME@STEP (trainer/faults.py); repeatable.")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
    coordinator: Coordinator = None,
    num_processes: NumProcesses = 1,
    process_id: ProcessId = 0,
) -> None:
    """Train a run that records every step (new run: --preset and --out; or --resume RUN)."""
    initialize(coordinator, num_processes, process_id)  # must come before anything touches a device
    from trainer.loop import StepInfo, load_resume_config, prepare, run_prepared

    from traces import Run
    from trainer.faults import FaultPlan, parse

    new_faults = [parse(spec) for spec in inject or []]
    if steps is not None and steps < 1:  # a run of no steps records nothing: bad input, not "done"
        console.fail(f"--steps {steps}: a run takes at least 1 step; give --steps 1 or more")
    if resume is not None and out is not None:
        console.fail("give either --out (a new run) or --resume RUN, not both")
    if resume is None and out is None:
        console.fail("give --out RUN for a new run (with --preset), or --resume RUN to continue one")
    if resume is not None:
        asked = apply_overrides(get_preset(preset), overrides or []) if preset else None
        if overrides and not preset:
            console.fail("--set with --resume needs the --preset the run was made with; or drop --set")
        cfg = load_resume_config(resume, asked, steps)
        path = resume
        recorded = Run.open(resume)
        early = [f for f in new_faults if f.step < recorded.trace.end]
        if early:
            console.fail(f"--inject {early[0]}: step {early[0].step} is already recorded (the trace ends at step "
                         f"{recorded.trace.end - 1}); a fault injected on resume must start at or after step {recorded.trace.end}")
        faults = FaultPlan([*FaultPlan.from_manifest(recorded.manifest.get("faults"), cfg).faults, *new_faults], cfg)
    else:
        cfg = apply_overrides(get_preset(preset or "tiny"), list(overrides or []) + ([f"steps={steps}"] if steps is not None else []))
        path = out
        faults = FaultPlan(new_faults, cfg)

    import jax

    job = prepare(cfg, path, resume=resume is not None, preset=preset, faults=faults,
                  on_compile=lambda: console.status(f"compiling the train step for {shown(path)} ..."))
    if jax.process_index() != 0:  # one progress display per run
        run_prepared(job)
        return
    try:
        with console.progress(f"train {path.name}") as bar:
            task = bar.add_task("train", total=cfg.steps, info="")

            def on_step(info: StepInfo) -> None:
                loss = f"loss {info.loss:.4f}" if info.loss is not None else "loss -"
                mfu = f"  MFU {info.mfu:.1%}" if info.mfu is not None else ""
                bar.update(task, completed=info.step + 1, info=f"{loss}  {info.tokens_per_s:,.0f} tok/s{mfu}")

            result = run_prepared(job, on_step)
            bar.update(task, completed=cfg.steps)
    except KeyboardInterrupt:  # run_prepared closed the run: every step dispatched is in its trace
        _interrupted(path)
    for note in result.notes:
        console.warn(note)
    summary = {
        "run": shown(result.path),  # a URL with its "//" (a Path argument makes gs:// gs:/)
        "steps": result.end_step, "started_at": result.start_step,
        "rewritten_identical": result.rewritten, "last_loss": result.last_loss,
        "seconds": round(result.seconds, 2), "compile_seconds": round(result.compile_seconds, 2),
        "checkpoints": result.checkpoints,
    }
    if json_out:
        console.print_json(summary)
    else:
        console.print_table([(k, str(v)) for k, v in summary.items()], title="trained")


def _interrupted(path) -> None:
    """Ctrl-C: one line saying what the run holds and how to continue it, exit 130 (SIGINT's)."""
    from traces import Run

    try:
        trace = Run.open(path).trace
        held = f"holds steps {trace.start}..{trace.end - 1} and " if trace.end > trace.start else ""
    except Exception:  # noqa: BLE001 - the line is said without the steps rather than not at all
        held = ""
    console.warn(f"interrupted: {shown(path)} {held}stays incomplete; `replay train --resume {shown(path)}` "
                 "continues it from its newest checkpoint")
    raise typer.Exit(130)


def register(app: typer.Typer) -> None:
    app.command("train")(train)
