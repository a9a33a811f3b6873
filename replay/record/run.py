"""`replay.init(...)`: a run being recorded, and what the user calls on it.

    run = replay.init("runs/a", config=cfg, entrypoint=make, dataset_size=N)
    step = run.step(batch_axis=0)(train_step)     # or @run.step(batch_axis=0) above @jax.jit
    for k in range(steps):
        if k % every == 0:
            run.save(k, state)                    # checkpoint k: the state entering step k
        state, metrics = step(state, batch_at(k))
    run.finish()                                  # COMPLETE; a crash leaves the run INCOMPLETE

A loop fed by a data iterator (grain's get_state/set_state) saves its state with each
checkpoint, `run.save(k, state, data=it)`, and resumes with `run.restore(like, k, data=it)`.
`run.save(k, state, wait=False)` writes in the background while the next steps run, and
`replay.init(..., keep_checkpoints=N)` keeps the N newest (replay/record/checkpointer.py, the
trainer's checkpoints too).

The run directory is the one traces/run.py defines. Its trace schema is derived from the
step's outputs on the first call, so run.json is written with a placeholder schema at init
and completed then (with the program hash and the step options replay needs).
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Any, Callable

from replay.record import at_exit, run_open, run_start
from replay.record.run_checkpoints import RunCheckpoints, as_state
from replay.record.errors import RecordError
from replay.record.options import StepOptions
from replay.record.orbax_io import CheckpointDiskFullError
from traces import Run, Schema, StepRecord
from replay.record import manifest as manifestlib
from replay.record.program import check_state
from traces.errors import DiskFullError, disk_full_message

_PENDING_JSON = run_open.PENDING.to_json()  # run.json's schema until the first step shows the real one


class RecordingRun:
    """A run open for recording. Use `replay.init` to make one."""

    def __init__(self, path: str | os.PathLike, *, config: Any = None, entrypoint: str | Callable | None = None,
                 dataset_size: "int | manifestlib.Tokens | None" = None, checkpoints: Any = None, resume: bool = False,
                 store_examples: bool = False, keep_checkpoints: int = 0, replayable: str | None = None,
                 manifest: dict | None = None, state_step: Callable[[Any], int] | None = None,
                 resume_command: str | None = None):
        run_open.check_arguments(checkpoints, keep_checkpoints, entrypoint, replayable)
        self.path = Path(path)
        self.finished = False
        self._entrypoint = None if resume else entrypoint  # checked against the step at its first call
        self._step: Any = None
        self._recorder: Any = None  # set by begin(): what hands records to the trace writer
        self._first_record = True
        self._resume_command = resume_command or f"replay.init({str(self.path)!r}, resume=True)"
        self._marked = not resume  # a resumed run is marked incomplete at its first write (run_open.resume)
        # _trace_end: a resumed run's, where its trace ended when it was reopened (None: a new run)
        self._run, recorded, self.next_step, self._trace_end = run_open.open_run(
            self.path, resume, config, entrypoint, dataset_size, checkpoints, replayable, manifest)
        if self._run is not None and self._run.mirror is not None:
            self.path = self._run.path  # a run on object storage is written in its staging folder (traces/storage/mirror.py)
        where = recorded.get("checkpoint_dir", "checkpoints")
        self._ckpt_dir = run_open.checkpoint_dir(path, self.path, where)  # several processes' remote run: the bucket
        self._checkpoints = RunCheckpoints(self._ckpt_dir, recorded, manager=checkpoints, keep=keep_checkpoints,
                                           state_step=state_step,
                                           write=self._run.update_manifest if self._run is not None else None)
        self._store_examples, self._examples = bool(store_examples), None  # replay/record/examples_store.py
        at_exit.watch(self._close_at_exit)  # an exit without finish() or close() still writes what is in flight

    @property
    def manifest(self) -> dict:
        """run.json as this process last wrote or read it."""
        return self._run.manifest if self._run is not None else Run.open(self.path).manifest

    def annotate(self, **fields: Any) -> None:
        """Adds or replaces the loop's own keys in run.json (JSON values; never a key replay writes
        itself, replay/record/manifest.py REPLAY_KEYS, except `config`, which a loop may extend as
        the run grows). Process 0 writes; the others' calls are no-ops."""
        extra = manifestlib.check_extra({k: v for k, v in fields.items() if k != "config"}, "run.annotate(...)")
        if "config" in fields:
            extra["config"] = manifestlib.check_extra({"c": fields["config"]}, "run.annotate(config=...)")["c"]
        if self._run is not None:
            self._mark()
            self._run.update_manifest(**extra)

    def _mark(self) -> None:
        """A resumed run becomes incomplete at its first write, not when it is opened: a resume
        refused before then (a damaged checkpoint, a config error) leaves the run as it was."""
        if not self._marked and self._run is not None:
            self._run.mark_incomplete()
        self._marked = True

    # ---------------------------------------------------------------------------- the step

    def step(self, fn: Callable | None = None, *, batch_axis: int = 0, loss: str | None = "loss",
             level: str = "layer", rng: tuple[str, ...] | list[str] = (), metric_kinds: dict | None = None,
             metrics: tuple[str, ...] | list[str] | None = None, sketch_width: int = 0) -> Any:
        """Wraps the train step `(state, batch) -> (state, metrics)`; usable as `@run.step(...)` or `run.step(fn)`.

        batch_axis: the axis of every batch leaf that indexes examples (hashed per example).
        loss: the scalar metric recorded as the trace's "loss" (required unless None).
        level: "layer" (default) fingerprints the state entering the step, every tap, non-scalar
          outputs and the new state; "step" records metrics, RNG words and example hashes only.
        rng: dotted paths of state leaves holding raw uint32 key words (typed keys are found alone).
        metric_kinds: causal kind of a metric ("forward", "backward", "update", ...); default
          "update", the last, so an unknown metric is never named as a cause before what feeds it.
        metrics: the names of the step's outputs to record (the loss always is); default every one
          (a step that returns a hundred logging scalars records them all: choose here).
        sketch_width: at the layer level, also every recorded tensor's distance sketch of this
          width and its norm (traces/sketch.py; 64, as replay.torch records), computed in the step's
          program, so `replay bisect` measures the distance to a PyTorch run from the traces alone.
          Default 0 (none): one more pass over every recorded tensor a step.
        """
        options = StepOptions(batch_axis=batch_axis, loss=loss, level=level, rng=tuple(rng),
                              metric_kinds=dict(metric_kinds or {}), metrics=metrics, sketch_width=sketch_width)

        from replay.record.nnx_step import FunctionalStep  # RecordedStep, with its calls checked

        return self._wrap("run.step", FunctionalStep, options, fn)

    def nnx_step(self, fn: Callable | None = None, *, batch_axis: int = 0, loss: str | None = "loss",
                 level: str = "layer", rng: tuple[str, ...] | list[str] = (), metric_kinds: dict | None = None) -> Any:
        """Wraps an in-place Flax NNX step `fn(*graph nodes, batch)` (an `@nnx.jit` function that
        updates its model, optimizer and metrics and returns nothing, or a dict of metrics); the
        wrapper is called exactly as `fn` is and returns what it returns. The Variables of the
        nodes that are not metrics are the recorded state (`run.save(k, (model, optimizer))`), the
        step's values of its nnx.MultiMetric the recorded metrics (replay/record/nnx_step.py).
        Replay rebuilds it from `replay.Loop(nnx_step=fn, nodes=...)`. Options as for `run.step`."""
        options = StepOptions(batch_axis=batch_axis, loss=loss, level=level, rng=tuple(rng),
                              metric_kinds=dict(metric_kinds or {}))

        from replay.record.nnx_step import NnxRecordedStep

        return self._wrap("run.nnx_step", NnxRecordedStep, options, fn)

    def _wrap(self, called: str, wrapper: Callable, options: StepOptions, fn: Callable | None) -> Any:
        def wrap(f: Callable) -> Any:
            if self._step is not None:
                raise RecordError(f"{called} wraps one train step per run; this run already has one")
            self._step = wrapper(self, f, options)
            return self._step

        return wrap if fn is None else wrap(fn)

    @staticmethod
    def tap(tree: Any, name: str, kind: str | None = None) -> Any:
        """replay.tap (see replay/record/taps.py)."""
        from replay.record.taps import tap

        return tap(tree, name, kind)

    def _start_recording(self, program: Any) -> None:
        """The wrapped step's first call was traced (replay/record/run_start.py)."""
        self._examples = run_start.start(run_start.Opening(
            path=self.path, files=self._run, manifest=lambda: self.manifest, begin=self.begin,
            next_step=self.next_step, entrypoint=self._entrypoint, store_examples=self._store_examples,
            resuming=self._recorded_schema() is not None), program)

    def begin(self, schema: Schema, program_hash: str | None = None, *, level: str | None = None,
              record: dict | None = None, timeline: Any = None) -> None:
        """Opens the trace for a loop whose step computes its own record (the trainer's does, in
        its own program); `run.step` calls it for the step it wraps. Then `run.record(...)` once
        a step. On a new run the schema, the step's program hash and `record` (the step options,
        JSON) go into run.json, the trace starting at `next_step`; a resumed run must declare the
        schema it recorded (its program may differ: a resume on another host count compiles
        another one, and its records say whether it computes the same bits). level: "off" writes
        no records (the loop records nothing, checkpoints still count), default "layer" when the
        schema has tensors, else "step". timeline: bench/multihost_dispatch.py's per-step times."""
        from replay.record.recorder import Recorder

        if self._recorder is not None:
            raise RecordError(f"{self.path}: run.begin was called already; a run records one step program")
        recorded = self._recorded_schema()
        resuming = recorded is not None
        if resuming and recorded != schema.to_json():
            raise RecordError(f"{self.path}: the step records a different schema than the run did; resume with "
                              "the same step, config and run.step(...) arguments")
        self._mark()
        if not resuming and self._run is not None:
            fields = dict(schema=schema.to_json(), program_hash=program_hash, trace_first_step=self.next_step)
            if record is not None:
                fields["record"] = record
            self._run.update_manifest(**fields)
            self._run.schema = schema
        writer = self._run.writer() if self._run is not None else None
        self._recorder = Recorder(schema, writer, level or ("layer" if schema.tensors else "step"), timeline=timeline)

    def _recorded_schema(self) -> dict | None:
        """The schema run.json holds once a first step declared it (None before: a new run's placeholder)."""
        recorded = self.manifest.get("schema")
        return None if recorded is None or recorded == _PENDING_JSON else recorded

    def record(self, step: int, record: dict, example_hashes: Any) -> None:
        """Hands step `step`'s record to the trace writer: `record` holds the step's device arrays
        by the names replay.record.recorder.to_record reads (the schema's metrics, "rng",
        "example_<name>", and at the layer level "fingerprints" and "rms"); example_hashes: the
        batch's per-example hashes in global order (uint64[B], or a gather still in flight,
        replay/record/gather.py). Fetched to the host only once ready, after later steps were
        dispatched. Steps are consecutive; the first after a resume may restart at a checkpoint
        the trace already reaches past (its records are then rewritten only if bit-identical)."""
        if self._recorder is None:
            raise RecordError(f"{self.path}: call run.begin(schema, ...) before run.record")
        if self.finished:
            raise RecordError(f"{self.path}: the run is finished; a step cannot be recorded after run.finish()")
        if step != self.next_step and not (self._first_record and step < self.next_step
                                           and (step == 0 or step in self._checkpoints.steps())):
            raise RecordError(f"run.record({step}, ...): the next step to record is {self.next_step}")
        self._first_record = False
        self._recorder.record(step, record, example_hashes)
        self.next_step = step + 1

    @property
    def last_record(self) -> StepRecord | None:
        """The newest record written (one or more steps behind the dispatched step)."""
        return None if self._recorder is None else self._recorder.last

    @property
    def rewritten(self) -> int:
        """Steps of a resumed run recorded again bit-identically to what the trace held."""
        return 0 if self._recorder is None else self._recorder.rewritten

    def flush(self) -> None:
        """Writes every record still held on device (run.save and run.finish do it too)."""
        if self._recorder is not None:
            self._recorder.flush()

    def _close_examples(self) -> None:
        if self._examples is not None:
            self._examples.close()

    # ---------------------------------------------------------------------------- checkpoints

    def save(self, step: int, state: Any, data: Any = None, wait: bool = True) -> None:
        """Checkpoint `step` = the state entering step `step` (before the step runs on it).

        data: the data iterator (grain's protocol: get_state()/set_state(state)) positioned at
          the batch of step `step`; its state is saved in the same orbax step and fingerprinted,
          so replay and `run.restore(..., data=it)` resume it there. Give it to every save of a
          run or to none (replay/record/data_iterator.py).
        wait: False returns once orbax holds a host copy of the state (the step may donate it at
          once) and writes it while the next steps run; the next save, restore or finish waits
          for it (saves never overlap) and raises its failure. Its fingerprint reaches the
          manifest once it is complete on disk."""
        if self.finished:
            raise RecordError(f"{self.path}: the run is finished; save checkpoints before run.finish()")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise RecordError(f"run.save({step!r}, state): the step is an int >= 0")
        state = as_state(state)  # an NNX step's graph nodes: their recorded Variables
        stepping = self._step is not None or self._recorder is not None
        if stepping and step != self.next_step:
            raise RecordError(f"run.save({step}, state): the recorded step has run up to step {self.next_step}; "
                              f"checkpoint k is the state entering step k, so save it as {self.next_step}")
        check_state(state)
        if hasattr(state, "shape") and hasattr(state, "dtype"):  # a bare array (check_state: every leaf is one)
            raise RecordError(f"run.save({step}, state): the state is a single array, which orbax's StandardSave "
                              "does not save; save a dict of it ({'w': w}) and restore it alike")
        self.flush()  # the trace always reaches at least as far as the newest checkpoint
        try:
            saved = self._checkpoints.save(step, state, data, wait, before_write=self._mark)
        except CheckpointDiskFullError as e:
            failed = getattr(e, "step", step)  # the save in flight, or this one
            writer = self._recorder.writer if self._recorder is not None else None
            last = writer.next_step - 1 if writer is not None and writer.next_step else step - 1
            where = self._checkpoints.ckpt.path
            raise DiskFullError(disk_full_message(where / str(failed), f"saving checkpoint {failed}", last, self.path,
                                                  self._resume_command), str(where), last) from e
        if saved and not stepping:
            self.next_step = step

    def restore(self, like: Any, step: int | None = None, data: Any = None) -> Any:
        """Checkpoint `step` restored onto the structure of `like` (arrays or ShapeDtypeStructs,
        with the shardings to restore onto) and verified against its recorded fingerprint; the
        recorded step continues from there (resuming a crashed run re-records, and checks, the
        steps already in its trace). Default: the newest checkpoint a resumed run's trace reaches,
        one with a recorded fingerprint before one without (an asynchronous save can land just
        before a crash, its fingerprint not yet in run.json). A checkpoint restored unverified
        (saved before replay recorded fingerprints) is said in `run.notes`.
        data: the run's data iterator, set to the state saved with the checkpoint (required when
        the checkpoint holds one, so the resumed run is fed from there)."""
        self._checkpoints.ckpt.wait()
        if not self._checkpoints.steps():
            raise RecordError(f"{self.path}: no checkpoint to restore")
        step = self.newest_checkpoint() if step is None else step
        if step is None:
            raise RecordError(f"{self.path}: no checkpoint at or before step {self._trace_end}, where its trace ends")
        state = self._checkpoints.restore(like, step, data)
        self.next_step, self._first_record = step, True
        return state

    def newest_checkpoint(self) -> int | None:
        """The checkpoint `restore()` takes by default (None: none the trace reaches)."""
        return self._checkpoints.newest(self._trace_end)

    @property
    def checkpoints(self) -> list[int]:
        """The steps checkpointed on disk."""
        return self._checkpoints.steps()

    @property
    def notes(self) -> list[str]:
        """What could not be checked (a checkpoint restored unverified), one line each."""
        return self._checkpoints.notes

    # ---------------------------------------------------------------------------- the end

    def finish(self) -> None:
        """Writes the last record and marks the run complete (the only way a run becomes complete)."""
        if self.finished:
            return
        self.flush()
        self._close_examples()
        self._checkpoints.ckpt.wait()
        self._checkpoints.record(final=True)
        self._checkpoints.ckpt.close()
        if self._run is not None:
            self._run.finish()
        self.finished = True

    def close(self) -> None:
        """Stops recording without marking the run complete (it stays INCOMPLETE, resumable).
        Called while an error is being handled (an `except` block, or a `with` block left by
        one), a failure of the records or the save still in flight is not raised: the first
        error stands."""
        self._close(quiet=sys.exc_info()[1] is not None)

    def _close(self, quiet: bool) -> None:
        if self.finished:
            return
        try:
            with contextlib.suppress(Exception) if quiet else contextlib.nullcontext():
                self.flush()
        finally:
            self._close_examples()
            try:
                with contextlib.suppress(Exception) if quiet else contextlib.nullcontext():
                    if self._checkpoints.ckpt.wait() is not None:  # an asynchronous save completed: it counts
                        self._checkpoints.record()
            finally:
                try:
                    with contextlib.suppress(Exception) if quiet else contextlib.nullcontext():
                        self._checkpoints.ckpt.close()
                finally:
                    if self._run is not None:
                        self._run.close()
                    self.finished = True

    def _close_at_exit(self) -> None:
        """At interpreter exit (replay/record/at_exit.py) a run still open is closed as an error closes
        it: the records in flight written, the run left incomplete; one stderr line says so."""
        if self.finished or self._recorder is None or run_open.processes() > 1:  # several: needs a collective
            return
        held = self._recorder.held
        self._close(quiet=True)
        last = self.last_record
        if held and last is not None:
            sys.stderr.write(f"replay: {self.path} was not finished; at exit wrote the {held} record(s) still in "
                             f"flight, through step {last.step}; it stays incomplete (resume it with "
                             f"{self._resume_command})\n")

    def __enter__(self) -> "RecordingRun":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.finish() if exc_type is None else self._close(quiet=True)


def init(path: str | os.PathLike, *, config: Any = None, entrypoint: str | Callable | None = None,
         dataset_size: int | None = None, checkpoints: Any = None, resume: bool = False,
         store_examples: bool = False, keep_checkpoints: int = 0, replayable: str | None = None,
         manifest: dict | None = None, state_step: Callable[[Any], int] | None = None,
         resume_command: str | None = None) -> RecordingRun:
    """Starts recording a run into `path` (a new or empty folder), or resumes a crashed one.

    Several processes (jax.distributed): every process calls it with the same path; process 0
    creates the run and writes its trace and run.json, the others wait for it and save their
    shards of each checkpoint.

    entrypoint: the @replay.entrypoint function that rebuilds the loop as a replay.Loop.
    replayable: instead, "module:function" of the loop's own replay-protocol factory (a loop that
      implements replay/engine/protocol.py itself, as the trainer does); its step records itself
      through `run.begin` and `run.record`. A resume with it accepts the factory's runs from
      before they were recorded through replay.init.
    manifest: the loop's own run.json keys (JSON; `run.annotate` adds more later).
    store_examples: keep every distinct example's rows in the run (RUN/examples/rows.bin) so a
      replay needs no user code. Off by default: its disk is the distinct examples fed, which for
      a pretraining run is the dataset itself (terabytes at a million steps); turn it on for runs
      you will replay elsewhere or pack into bug reports.
    keep_checkpoints: the newest N checkpoints kept on disk (older ones deleted after a save; the
      steps before the oldest kept one can no longer be replayed); 0 keeps all. With your own
      `checkpoints=` manager its max_to_keep decides instead.
    state_step: reads the step a saved state is at (a TrainState's .step); a restore then refuses
      a checkpoint holding another step as damaged.
    resume_command: how to continue this run, said when a full disk stops it (default
      `replay.init(PATH, resume=True)`).

    Cost at a million steps: O(1) here; the run's records stream to disk (traces/writer.py)."""
    return RecordingRun(path, config=config, entrypoint=entrypoint, dataset_size=dataset_size,
                        checkpoints=checkpoints, resume=resume, store_examples=store_examples,
                        keep_checkpoints=keep_checkpoints, replayable=replayable, manifest=manifest,
                        state_step=state_step, resume_command=resume_command)
