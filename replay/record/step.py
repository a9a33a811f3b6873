"""`run.step`: the wrapper around the user's train step while recording.

Call k (counted from the run's first step, or from the checkpoint `run.restore` resumed from)
hashes the batch on the host (a batch of device arrays once the step is dispatched:
replay/record/deferred_hashes.py), dispatches the one compiled program (the user's step plus its
record, replay/record/program.py) and hands the record to `run.record` (replay.record.recorder.Recorder), which
fetches step k's record only after step k+1 has been dispatched: the host never waits for the
device to record. The wrapper returns exactly what the user's step returns.
"""

from __future__ import annotations

from typing import Any, Callable

from replay.record.deferred_hashes import DeferredHashes, deferrable
from replay.record.errors import RecordError
from replay.record.hashing import example_hashes
from replay.record.multihost import gathered_hashes
from replay.record.run_open import processes
from replay.record.options import StepOptions
from replay.record.program import Program


class RecordedStep:
    def __init__(self, run: Any, step: Callable, options: StepOptions):
        self._run = run
        self.program = Program(step, options)
        self.options = options
        self.__wrapped__ = step
        self.__name__ = getattr(step, "__name__", "step")
        self.__doc__ = getattr(step, "__doc__", None)
        self._started = False

    def __call__(self, state: Any, batch: Any) -> tuple[Any, Any]:
        run = self._run
        if run.finished:
            raise RecordError(f"{run.path}: the run is finished; a recorded step cannot run after run.finish()")
        if not self._started:
            self.program.compile(state, batch)
            run._start_recording(self.program)
            self._started = True
        axis = self.options.batch_axis
        if processes() > 1:
            hashes = gathered_hashes(batch, axis)  # several hosts: replay/record/multihost.py
        elif run._examples is None and deferrable(batch, axis, self.program.jit_options):
            hashes = DeferredHashes(batch, axis)  # a device batch: hashed once ready, after the dispatch
        else:
            hashes = example_hashes(batch, axis)
        if len(hashes) != self.program.batch:
            raise RecordError(f"step {run.next_step}: the batch has {len(hashes)} examples, the first had "
                              f"{self.program.batch}; a recorded run feeds the same number every step")
        new_state, metrics, record = self.program(state, batch)
        run.record(run.next_step, record, hashes)  # writes step k-1's record, fetched now
        if run._examples is not None:  # rows of examples not stored yet (replay/record/examples_store.py)
            run._examples.add(batch, hashes)
        return new_state, metrics

    def flush(self) -> None:
        self._run.flush()
