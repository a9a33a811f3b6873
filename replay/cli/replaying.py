"""What every command that replays a run does first: load its replayable and judge the contract.

Shared by `replay run` and `replay spike --step`, so both refuse bad input before compiling,
say which line of the determinism contract applies, and show the same progress bar.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from replay import plugins
from replay.engine.contract import config_of
from replay.cli import console
from replay.engine import contract as contractlib
from replay.record import state_layout


DAMAGED_REMEDY = "restore the run's files from a copy, or record it again"


def prepare_process(target) -> None:
    """A run may need the process prepared before anything starts JAX (a mesh-invariant trainer
    run: XLA:CPU settings); its plugin does that (replay/plugins.py)."""
    plugins.prepare_process(target.manifest, warn=console.warn)


def load_replayable(target, path: Path, data: str | None, allow_data_change: bool,
                    check: Callable[[list[int]], object], damaged_remedy: str | None = DAMAGED_REMEDY,
                    allow_code: bool = False):
    """(replayable, contract) for `target`; `check(checkpoint_steps)` refuses bad ranges, first
    from the checkpoint folder (before compiling, for trainer runs), then from the replayable.
    A damaged trace is refused first (one line naming the damage, then `damaged_remedy`), unless
    `damaged_remedy` is None (the command was told to replay what can be read). `allow_code`:
    the command's --allow-code (replay/engine/code.py: which of the run's code may run)."""
    from replay.engine.damage import damage_error
    from replay.engine.engine import checkpoint_steps
    from replay.engine.protocol import LEGACY_DEFAULT_FACTORY, load

    damaged = damage_error(target, str(path), damaged_remedy) if damaged_remedy is not None else None
    if damaged:
        raise damaged
    if target.status == "running":
        console.warn(f"{path} is still being written; using the steps recorded so far")
    legacy = target.manifest.get("replayable", LEGACY_DEFAULT_FACTORY) == LEGACY_DEFAULT_FACTORY  # a trainer run
    if legacy:
        check(checkpoint_steps(target))
    compiling = (lambda: console.status(f"compiling the train step of {path} ...")) if legacy else None
    replayable = load(target, allow_code=allow_code, data=data, allow_data_change=allow_data_change,
                      on_compile=compiling)
    check(replayable.checkpoint_steps())  # a user loop's own checkpoints
    mesh_invariant = bool(config_of(target.manifest).get("mesh", {}).get("mesh_invariant"))
    program = getattr(replayable, "program", None)  # a with-code replay's: the layout it compiled for
    layout_why = (state_layout.first_difference(target.manifest.get(state_layout.KEY),
                                                state_layout.describe(program.abstract[0]))
                  if getattr(program, "abstract", None) is not None else None)
    contract = contractlib.evaluate(contractlib.recorded_environment(target.manifest), replayable.environment(),
                                    target.manifest.get("program_hash"), replayable.program_hash(), mesh_invariant,
                                    tuple(target.manifest.get("invariant_device_counts", ())), layout_why)
    used = {"exported": "replayed from the exported program", "code": "with your code"}.get(
        getattr(replayable, "replayed_from", None))
    if used:
        contract.line += f"; {used}"
    if contract.fatal:
        console.fail(f"cannot replay {path} here: {contract.fatal[0]}")
    console.status(f"contract: {contract.line}")
    return replayable, contract


def replay_notes(replayable) -> list[str]:
    notes = []
    if getattr(replayable, "mesh_note", None):
        notes.append(replayable.mesh_note)
    if getattr(replayable, "data_changed", False):
        notes.append("the data source changed since recording (--allow-data-change)")
    notes.extend(getattr(replayable, "restore_notes", []))  # checkpoints restored without a fingerprint to check
    return notes


@contextmanager
def replay_progress(title: str, last: int):
    """A progress bar over the replayed steps; yields the per-step callback for the engine."""
    with console.progress(title) as bar:
        task = bar.add_task("replay", total=None, info="restoring")

        def on_step(result) -> None:
            if bar.tasks[task].total is None:
                bar.update(task, total=last - result.step + 1, completed=0)
            bar.update(task, advance=1, info=f"step {result.step} {'exact' if result.exact else 'DIFFERS'}")

        yield on_step
