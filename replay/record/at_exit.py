"""A recording run the program exits without finishing or closing: its records in flight are kept.

The recorder holds up to Recorder.MAX_PENDING + 1 steps' records on device while the host runs
ahead (replay/record/recorder.py). A loop written as the README's ten lines (`replay.init`,
`run.step`, `run.finish()`, no `with` block) that stops on an uncaught exception, a Ctrl-C or a
`sys.exit` in the loop would lose them: the very steps that led to the stop. At interpreter exit
(atexit, before JAX's own exit handlers, which were registered earlier), each such run of one
process is closed as a `with` block left by an error closes it: the records still held are
fetched and written, an asynchronous checkpoint save in flight is waited for, and the run stays
INCOMPLETE (resumable, `crashed` to `replay show`). One line on stderr says how many records
that kept and up to which step. What a kill -9 or a lost machine leaves is what it always was:
the records not yet written are lost, and a resume records them again.

Runs of several processes (jax.distributed) are left alone: writing their last records needs
the other processes' hashes (a collective), which a process exiting alone must not wait for.
"""

from __future__ import annotations

import atexit
import contextlib
import sys
import weakref
from typing import Any


def watch(run: Any) -> None:
    """Close `run` at interpreter exit if it is still open then (holds only a weak reference)."""
    atexit.register(_close_at_exit, weakref.ref(run))


def _close_at_exit(ref: "weakref.ref[Any]") -> None:
    run = ref()
    if run is None or run.finished or run._recorder is None:
        return
    with contextlib.suppress(Exception):  # the exit must not fail, nor hide the error that caused it
        import jax

        if jax.process_count() > 1:
            return
        held = run._recorder.held
        run._close(quiet=True)
        last = run.last_record
        if held and last is not None:
            sys.stderr.write(f"replay: {run.path} was not finished; at exit wrote the {held} record(s) still in "
                             f"flight, through step {last.step}; it stays incomplete (resume it with "
                             f"{run._resume_command})\n")
