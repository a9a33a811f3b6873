"""A recording run the program exits without finishing or closing: its records in flight are kept.

The recorder holds up to Recorder.MAX_HELD + 1 steps' records on device while the host runs
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
A replay.torch run (replay/torch/run.py) holds one record, its last finished step's, until the
next step: written alike.
"""

from __future__ import annotations

import atexit
import contextlib
import weakref
from typing import Callable


def watch(close: Callable[[], None]) -> None:
    """Call `close` (a run's bound method that closes it if still open and of one process) at
    interpreter exit; holds only a weak reference, so a run dropped before then is not kept alive."""
    atexit.register(_at_exit, weakref.WeakMethod(close))


def _at_exit(close: "weakref.WeakMethod") -> None:
    method = close()
    if method is not None:
        with contextlib.suppress(Exception):  # the exit must not fail, nor hide the error that caused it
            method()
