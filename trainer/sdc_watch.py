"""Training: say on stderr, as it happens, when the in-training SDC re-run disagreed.

check.rerun_every=N (trainer/sdc.py) records each re-run's result in the trace ("check/rerun"); a
run of a million steps should not need `replay show --verify` to learn that a chip went bad. The
loop hands every dispatched step's metrics to `RerunWatch.dispatched`; a re-run step's check words
are read when the next step has been dispatched (one step late), so the host waits for a step
only while the device already has the next one queued. A disagreement is one warning line through
the console, naming the step and the device (replay/verify/checks.py's reading of it).

Cost: one small device-to-host read of the fingerprints per re-run step (1 in N steps); nothing
is kept between re-runs, so nothing grows with the run.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np

from traces import Schema
from traces.schema import StepRecord, check_tensors


class RerunWatch:
    """Warns (through `warn`, default the console's) about each re-run that disagreed."""

    def __init__(self, manifest: dict, schema: Schema, every: int, run_path: str,
                 warn: Callable[[str], None] | None = None):
        self.manifest, self.schema, self.every, self.run_path = manifest, schema, every, run_path
        self.warn = warn
        self.held: tuple[int, Any, Any] | None = None  # (step, fingerprint lanes, rms) of an unread re-run
        self.found: list[dict] = []  # the disagreements warned about (replay/verify/checks.describe's dicts)

    @classmethod
    def for_run(cls, manifest: dict, schema: Schema, run_path: str,
                warn: Callable[[str], None] | None = None) -> RerunWatch:
        """The watch of the run at `run_path`: idle (every = 0) without the re-run check, and on
        processes other than 0, which do not write the run."""
        every = int(((manifest.get("config") or {}).get("check") or {}).get("rerun_every") or 0)
        if every and jax.process_index() == 0:
            every = every if check_tensors(schema) else 0
        return cls(manifest, schema, every if jax.process_index() == 0 else 0, run_path, warn)

    def dispatched(self, step: int, metrics: dict) -> None:
        """After step `step` was dispatched: reads the previous re-run's result, holds this one's."""
        self.flush()
        if self.every and step % self.every == 0 and "fingerprints" in metrics:  # trace.layer_every may skip it
            self.held = (step, metrics["fingerprints"], metrics["rms"])

    def flush(self) -> None:
        """Reads the held re-run's result (waits for its step) and warns if it disagreed."""
        if self.held is None:
            return
        from replay.record.recorder import lanes_to_uint64
        from replay.verify.checks import describe

        step, lanes, rms = self.held
        self.held = None
        lanes, rms = jax.device_get((lanes, rms))
        rec = StepRecord(step, np.zeros(0, np.uint32), 0, np.zeros(0, np.uint64), np.zeros(0, np.float32),
                         fingerprints=lanes_to_uint64(np.asarray(lanes)), rms=np.asarray(rms))
        found = describe(self.manifest, self.schema, rec)
        if found is None or not found["microbatches"]:
            return
        self.found.append(found)
        warn = self.warn
        if warn is None:
            from replay.cli.console import warn
        # The previous re-run agreed (or was warned about): the fault is in the steps since.
        warn(f"step {step}: silent data corruption check: {found['line']}; "
             f"`replay verify {self.run_path} --steps {max(step - self.every + 1, 0)}:{step}` names it")
