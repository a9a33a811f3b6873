"""The recorded step's first call (replay/record/step.py), once it was traced: the run's
manifest completed with the step's schema, program hash and options (checked against the run's
on a resume), its exported program and example-store layout written, the trace and the example
store opened. It sets up the RecordingRun (replay/record/run.py) that calls it, so it reads and
sets that run's private fields: one concept, kept out of run.py for its length.
"""

from __future__ import annotations

import warnings
from typing import Any

from replay.engine.human_names import STATE_NAMES_KEY
from replay.record import examples_store, export, state_layout
from replay.record import manifest as manifestlib
from replay.record.entry_check import check_entrypoint
from replay.record.errors import RecordError
from replay.record.run_open import process_index, processes

RESUMED_KEY = "resumed_programs"  # run.json: the programs of resumes on another process count


def start(run: Any, program: Any) -> None:
    """The wrapped step's first call was traced: its schema, program and options into the
    manifest (checked against the run's on a resume), the exported program, the trace opened."""
    if process_index() == 0 and run._run is not None:
        recorded = run._run.manifest.get("record")
        if recorded is not None and recorded != program.options.to_json():
            raise RecordError(f"{run.path}: the step records different options than the run did; resume with "
                              "the same step, config and run.step(...) arguments")
        if recorded is not None and run._run.manifest.get("program_hash") != program.program_hash:
            _resumed_on_other_processes(run, program)
    resuming = run._recorded_schema() is not None
    if not resuming and run._entrypoint is not None:  # make() checked here, not on another machine at replay
        check_entrypoint(run._entrypoint, run.manifest.get("config"), program, run.next_step)
    run.begin(program.schema, program.program_hash, record=program.options.to_json())
    if run._store_examples and processes() > 1:
        raise RecordError(f"{run.path}: replay.init(store_examples=True) on {processes()} processes: each "
                          "holds only its rows; record without it (replays then need the loop's code)")
    if not resuming and run._run is not None:  # process 0 writes the run's files
        _record_exported(run, program)
        if program.state_names:
            run._run.update_manifest(**{STATE_NAMES_KEY: program.state_names})
        state, batch = program.abstract
        run._run.update_manifest(**{state_layout.KEY: state_layout.describe(state)},
                                 **manifestlib.example_tokens(run.manifest, batch, program.options.batch_axis))
    _open_examples(run, program, resume=resuming)


def _resumed_on_other_processes(run: Any, program: Any) -> None:
    """A resume on another process count compiles another program (its mesh spans other hosts): kept,
    said in run.json (`resumed_programs`: the step it starts at, its process count and program hash),
    and its records say whether it computes the same bits. On the same process count a different
    program is a different loop: refused."""
    resumes = list(run._run.manifest.get(RESUMED_KEY, []))
    latest = resumes[-1] if resumes else {"process_count": run._run.manifest.get("environment", {}).get(
        "process_count"), "program_hash": run._run.manifest.get("program_hash")}
    if latest["program_hash"] == program.program_hash:  # resumed again on the processes it last ran on
        return
    if latest["process_count"] == processes():
        raise RecordError(f"{run.path}: the step compiles to a different program than the run recorded; "
                          "resume with the same code and config")
    resumes.append({"step": run.next_step, "process_count": processes(), "program_hash": program.program_hash})
    run._run.update_manifest(**{RESUMED_KEY: resumes})


def _record_exported(run: Any, program: Any) -> None:
    """The step as a jax.export program and the example store's layout, into the manifest, so
    replay needs no user code (replay/record/export.py, examples_store.py; the manifest says
    why when the step could not be exported, and whether examples are stored)."""
    entry = export.export(run.path, program)
    if entry.get("error"):
        warnings.warn(f"replay: {run.path}: recorded without an exported program ({entry['error']}); "
                      "replaying it will need your code", stacklevel=4)
    store = (examples_store.layout_of(program.abstract[1], program.options.batch_axis) if run._store_examples
             else {"format": examples_store.FORMAT, "enabled": False})
    run._run.update_manifest(**{export.KEY: entry, examples_store.KEY: store})


def _open_examples(run: Any, program: Any, resume: bool) -> None:
    store = run.manifest.get(examples_store.KEY)
    if processes() > 1 and run._run is not None and isinstance(store, dict) and store.get("leaves"):
        # a one-process run resumed on several: no process holds the whole batch; the store ends here
        run._run.update_manifest(**{examples_store.KEY: dict(store, until_step=run.next_step)})
        return
    if run._run is not None and isinstance(store, dict) and store.get("leaves"):
        run._examples = examples_store.ExampleWriter(run.path, program.options.batch_axis, resume=resume)
