"""The recorded step's first call (replay/record/step.py), once it was traced: the run's
manifest completed with the step's schema, program hash and options (checked against the run's
on a resume), its exported program and example-store layout written, the trace and the example
store opened. The RecordingRun (replay/record/run.py) hands it what it needs as arguments
(`Opening`) and keeps the example writer it returns.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from replay.engine.human_names import STATE_NAMES_KEY
from replay.record import examples_store, export, state_layout
from replay.record import manifest as manifestlib
from replay.record.entry_check import check_entrypoint
from replay.record.errors import RecordError
from replay.record.run_open import process_index, processes

RESUMED_KEY = "resumed_programs"  # run.json: the programs of resumes on another process count


@dataclass(frozen=True)
class Opening:
    """What the first call needs from the RecordingRun that opens the trace."""

    path: Path  # the run's folder (a remote run's staging folder)
    files: Any  # the traces.Run process 0 writes through; None on the other processes
    manifest: Callable[[], dict]  # run.json as it is now (it changes as this goes)
    begin: Callable[..., None]  # RecordingRun.begin: declares the schema and opens the trace writer
    next_step: int  # the step the recording starts (or resumes) at
    entrypoint: Any  # the make() to check against the step; None on a resume
    store_examples: bool  # replay.init(store_examples=...)
    resuming: bool  # run.json already holds the schema a first step declared


def start(run: Opening, program: Any) -> Any:
    """The wrapped step's first call was traced: its schema, program and options into the
    manifest (checked against the run's on a resume), the exported program, the trace opened.
    Returns the example store's writer (None where this process stores no examples)."""
    if process_index() == 0 and run.files is not None:
        recorded = run.files.manifest.get("record")
        if recorded is not None and recorded != program.options.to_json():
            raise RecordError(f"{run.path}: the step records different options than the run did; resume with "
                              "the same step, config and run.step(...) arguments")
        if recorded is not None and run.files.manifest.get("program_hash") != program.program_hash:
            _resumed_on_other_processes(run, program)
    if not run.resuming and run.entrypoint is not None:  # make() checked here, not on another machine at replay
        check_entrypoint(run.entrypoint, run.manifest().get("config"), program, run.next_step)
    run.begin(program.schema, program.program_hash, record=program.options.to_json())
    if run.store_examples and processes() > 1:
        raise RecordError(f"{run.path}: replay.init(store_examples=True) on {processes()} processes: each "
                          "holds only its rows; record without it (replays then need the loop's code)")
    if not run.resuming and run.files is not None:  # process 0 writes the run's files
        _record_exported(run, program)
        if program.state_names:
            run.files.update_manifest(**{STATE_NAMES_KEY: program.state_names})
        state, batch = program.abstract
        run.files.update_manifest(**{state_layout.KEY: state_layout.describe(state)},
                                  **manifestlib.example_tokens(run.manifest(), batch, program.options.batch_axis))
    return _open_examples(run, program)


def _resumed_on_other_processes(run: Opening, program: Any) -> None:
    """A resume on another process count compiles another program (its mesh spans other hosts): kept,
    said in run.json (`resumed_programs`: the step it starts at, its process count and program hash),
    and its records say whether it computes the same bits. On the same process count a different
    program is a different loop: refused."""
    resumes = list(run.files.manifest.get(RESUMED_KEY, []))
    latest = resumes[-1] if resumes else {"process_count": run.files.manifest.get("environment", {}).get(
        "process_count"), "program_hash": run.files.manifest.get("program_hash")}
    if latest["program_hash"] == program.program_hash:  # resumed again on the processes it last ran on
        return
    if latest["process_count"] == processes():
        raise RecordError(f"{run.path}: the step compiles to a different program than the run recorded; "
                          "resume with the same code and config")
    resumes.append({"step": run.next_step, "process_count": processes(), "program_hash": program.program_hash})
    run.files.update_manifest(**{RESUMED_KEY: resumes})


def _record_exported(run: Opening, program: Any) -> None:
    """The step as a jax.export program and the example store's layout, into the manifest, so
    replay needs no user code (replay/record/export.py, examples_store.py; the manifest says
    why when the step could not be exported, and whether examples are stored)."""
    entry = export.export(run.path, program)
    if entry.get("error"):
        warnings.warn(f"replay: {run.path}: recorded without an exported program ({entry['error']}); "
                      "replaying it will need your code", stacklevel=4)
    store = (examples_store.layout_of(program.abstract[1], program.options.batch_axis) if run.store_examples
             else {"format": examples_store.FORMAT, "enabled": False})
    run.files.update_manifest(**{export.KEY: entry, examples_store.KEY: store})


def _open_examples(run: Opening, program: Any) -> Any:
    store = run.manifest().get(examples_store.KEY)
    if processes() > 1 and run.files is not None and isinstance(store, dict) and store.get("leaves"):
        # a one-process run resumed on several: no process holds the whole batch; the store ends here
        run.files.update_manifest(**{examples_store.KEY: dict(store, until_step=run.next_step)})
        return None
    if run.files is not None and isinstance(store, dict) and store.get("leaves"):
        return examples_store.ExampleWriter(run.path, program.options.batch_axis, resume=run.resuming)
    return None
