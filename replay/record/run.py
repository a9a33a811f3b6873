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

import os
from pathlib import Path
from typing import Any, Callable

from replay.record import checkpoints as ckpts
from replay.record import data_iterator, examples_store, export
from replay.record.checkpointer import Checkpointer
from replay.record.errors import RecordError
from replay.record.options import StepOptions
from traces import Run, Schema
from replay.record import manifest as manifestlib
from replay.record.entry_check import check_entrypoint
from replay.record.program import check_state, spec
from traces.errors import TraceError
import warnings

_PENDING = Schema(examples_per_step=0, rng_words=0, metrics=())  # until the first step shows the real one


class RecordingRun:
    """A run open for recording. Use `replay.init` to make one."""

    def __init__(self, path: str | os.PathLike, *, config: Any = None, entrypoint: str | Callable | None = None,
                 dataset_size: int | None = None, checkpoints: Any = None, resume: bool = False,
                 store_examples: bool = False, keep_checkpoints: int = 0):
        if isinstance(keep_checkpoints, bool) or not isinstance(keep_checkpoints, int) or keep_checkpoints < 0:
            raise RecordError(f"replay.init(keep_checkpoints={keep_checkpoints!r}): the newest checkpoints to keep, an "
                              "int >= 0 (0 keeps all)")
        if checkpoints is not None and keep_checkpoints:  # before the run's folder is touched
            raise RecordError("replay.init(checkpoints=manager, keep_checkpoints=N): your CheckpointManager keeps what "
                              "its own max_to_keep says; set it there")
        self.path = Path(path)
        self.finished = False
        self._entrypoint = None if resume else entrypoint  # checked against the step at its first call
        self.next_step = 0
        self._step: Any = None
        if resume:
            try:
                self._run = Run.resume(self.path)
            except TraceError as e:
                raise RecordError(f"replay.init(resume=True): {e}") from None
            if self._run.manifest.get("recorded_by") != manifestlib.RECORDED_BY:
                self._run.close()
                raise RecordError(f"{self.path}: was not recorded by replay.init; it cannot be resumed through it")
            self.next_step = self._run.trace.end if len(self._run.trace) else (self._run.first_step or 0)
        else:
            if entrypoint is None:
                raise RecordError("replay.init(..., entrypoint=make): name the @replay.entrypoint function that "
                                  "rebuilds this loop for replay")
            if self.path.exists() and (not self.path.is_dir() or any(self.path.iterdir())):
                what = "holds another run" if (self.path / "run.json").exists() else "exists and is not empty"
                raise RecordError(f"{self.path}: {what}; record into a new folder, or continue a crashed run with "
                                  "replay.init(PATH, resume=True)")
            inside = checkpoints is None or _inside(ckpts.directory_of(checkpoints), self.path)
            where = ("checkpoints" if checkpoints is None else
                     os.path.relpath(ckpts.directory_of(checkpoints), self.path.absolute()) if inside
                     else str(ckpts.directory_of(checkpoints)))
            manifest = manifestlib.build(config, entrypoint, dataset_size, where)
            self._run = Run.create(self.path, _PENDING, manifest)
        where = self._run.manifest.get("checkpoint_dir", "checkpoints")
        self._ckpt_dir = (self.path / where) if not Path(where).is_absolute() else Path(where)
        self._ckpt = (Checkpointer(manager=checkpoints) if checkpoints is not None else
                      Checkpointer(self._ckpt_dir, keep=keep_checkpoints))
        self._fingerprints: dict = dict(self._run.manifest.get(ckpts.FINGERPRINTS_KEY) or {})
        self._data_fingerprints: dict = dict(self._run.manifest.get(data_iterator.DATA_FINGERPRINTS_KEY) or {})
        self._store_examples, self._examples = bool(store_examples), None  # replay/record/examples_store.py

    # ---------------------------------------------------------------------------- the step

    def step(self, fn: Callable | None = None, *, batch_axis: int = 0, loss: str | None = "loss",
             level: str = "layer", rng: tuple[str, ...] | list[str] = (), metric_kinds: dict | None = None) -> Any:
        """Wraps the train step `(state, batch) -> (state, metrics)`; usable as `@run.step(...)` or `run.step(fn)`.

        batch_axis: the axis of every batch leaf that indexes examples (hashed per example).
        loss: the scalar metric recorded as the trace's "loss" (required unless None).
        level: "layer" (default) fingerprints the state entering the step, every tap, non-scalar
          outputs and the new state; "step" records metrics, RNG words and example hashes only.
        rng: dotted paths of state leaves holding raw uint32 key words (typed keys are found alone).
        metric_kinds: causal kind of a metric ("forward", "backward", "update", ...); default
          "update", the last, so an unknown metric is never named as a cause before what feeds it.
        """
        options = StepOptions(batch_axis=batch_axis, loss=loss, level=level, rng=tuple(rng),
                              metric_kinds=dict(metric_kinds or {}))

        def wrap(f: Callable) -> Any:
            from replay.record.nnx_step import FunctionalStep  # RecordedStep, with its calls checked

            if self._step is not None:
                raise RecordError("run.step wraps one train step per run; this run already has one")
            self._step = FunctionalStep(self, f, options)
            return self._step

        return wrap if fn is None else wrap(fn)

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

        def wrap(f: Callable) -> Any:
            from replay.record.nnx_step import NnxRecordedStep

            if self._step is not None:
                raise RecordError("run.nnx_step wraps one train step per run; this run already has one")
            self._step = NnxRecordedStep(self, f, options)
            return self._step

        return wrap if fn is None else wrap(fn)

    @staticmethod
    def tap(tree: Any, name: str, kind: str | None = None) -> Any:
        """replay.tap (see replay/record/taps.py)."""
        from replay.record.taps import tap

        return tap(tree, name, kind)

    def _start_recording(self, program: Any) -> Any:
        """The first step was traced: complete the manifest, open the trace writer."""
        from replay.record.recorder import Recorder

        schema, run = program.schema, self._run
        recorded = run.manifest.get("record")
        if recorded is not None:  # resuming: the step must be the one recorded
            if run.manifest["schema"] != schema.to_json() or recorded != program.options.to_json():
                raise RecordError(f"{self.path}: the step records a different schema or options than the run did; "
                                  "resume with the same step, config and run.step(...) arguments")
            if run.manifest.get("program_hash") != program.program_hash:
                raise RecordError(f"{self.path}: the step compiles to a different program than the run recorded; "
                                  "resume with the same code and config")
        else:
            if self._entrypoint is not None:  # make() checked here, not on another machine at replay

                check_entrypoint(self._entrypoint, run.manifest.get("config"), program, self.next_step)
            run.update_manifest(schema=schema.to_json(), program_hash=program.program_hash,
                                record=program.options.to_json(), trace_first_step=self.next_step)
            run.schema = schema
            self._record_exported(program)
        self._open_examples(program, resume=recorded is not None)
        return Recorder(schema, run.writer(), "layer" if schema.tensors else "step")

    def _record_exported(self, program: Any) -> None:
        """The step as a jax.export program and the example store's layout, into the manifest, so
        replay needs no user code (replay/record/export.py, examples_store.py; the manifest says
        why when the step could not be exported, and whether examples are stored)."""
        entry = export.export(self.path, program)
        if entry.get("error"):
            warnings.warn(f"replay: {self.path}: recorded without an exported program ({entry['error']}); "
                          "replaying it will need your code", stacklevel=3)
        store = (examples_store.layout_of(program.abstract[1], program.options.batch_axis) if self._store_examples
                 else {"format": examples_store.FORMAT, "enabled": False})
        self._run.update_manifest(**{export.KEY: entry, examples_store.KEY: store})

    def _open_examples(self, program: Any, resume: bool) -> None:
        from replay.record import examples_store

        store = self._run.manifest.get(examples_store.KEY)
        if isinstance(store, dict) and store.get("leaves"):
            self._examples = examples_store.ExampleWriter(self.path, program.options.batch_axis, resume=resume)

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
        if self._step is not None and step != self.next_step:
            raise RecordError(f"run.save({step}, state): the wrapped step has run up to step {self.next_step}; "
                              f"checkpoint k is the state entering step k, so save it as {self.next_step}")

        check_state(state)
        if data is not None:
            data_iterator.check_iterator(data, f"run.save({step}, state, data=...)")
            _one_process(f"run.save({step}, state, data=...)")
        self._check_data_style(step, data is not None)
        self._ckpt.wait()  # the save in flight first: a failure is its, and it may be this step
        if step in self._ckpt.steps():
            return  # the state entering a step is a pure function of the run: the saved one stands
        if self._step is None:
            self.next_step = step
        stored = None if data is None else data_iterator.payload(data)
        self._fingerprints[str(step)] = self._ckpt.save(step, state, stored, wait=wait)
        if stored is not None:
            self._data_fingerprints[str(step)] = data_iterator.fingerprint(stored)
        self._record_checkpoints()

    def _record_checkpoints(self, final: bool = False) -> None:
        """The manifest's checkpoints and their fingerprints: those complete on disk (an
        asynchronous save's once it is; none that `keep_checkpoints` pruned)."""
        listed = self._ckpt.steps()
        done = [k for k in self._fingerprints if int(k) in listed]
        entries = {ckpts.FINGERPRINTS_KEY: {k: self._fingerprints[k] for k in done},
                   "checkpoints": sorted(int(k) for k in done) if final else listed}
        if self._data_fingerprints:
            entries[data_iterator.DATA_FINGERPRINTS_KEY] = {k: v for k, v in self._data_fingerprints.items()
                                                             if int(k) in listed}
        self._run.update_manifest(**entries)

    def _check_data_style(self, step: int, with_data: bool) -> None:
        """One layout per run: every checkpoint holds the iterator's state, or none does."""
        if not self._fingerprints or with_data == bool(self._data_fingerprints):
            return
        first = min(int(k) for k in self._fingerprints)
        if with_data:
            raise RecordError(f"run.save({step}, state, data=...): checkpoint {first} of this run was saved without "
                              "data=; give data= to every run.save of a run, or to none")
        raise RecordError(f"run.save({step}, state): this run's checkpoints hold its data iterator's state (checkpoint "
                          f"{first} was saved with data=); give data= here too")

    def restore(self, like: Any, step: int | None = None, data: Any = None) -> Any:
        """Checkpoint `step` (default: the latest) restored onto the structure of `like` and verified;
        the wrapped step continues from there (resuming a crashed run re-records, and checks, the
        steps already in its trace). data: the run's data iterator, set to the state saved with
        the checkpoint (required when the checkpoint holds one, so the resumed run is fed from there)."""
        self._ckpt.wait()
        have = self._ckpt.steps()
        if not have:
            raise RecordError(f"{self.path}: no checkpoint to restore")
        step = have[-1] if step is None else step
        if data is not None:
            data_iterator.check_iterator(data, f"run.restore(like, {step}, data=...)")
        if step in have and self._ckpt.is_composite(step) != (data is not None):
            raise RecordError(f"run.restore(like, {step}, data=it): checkpoint {step} holds the data iterator's state; "
                              "pass the iterator so it resumes there" if data is None else
                              f"run.restore(like, {step}, data=...): checkpoint {step} was saved without data=, so it "
                              "holds no data iterator state to restore")
        import jax

        nodes, like = like, as_state(like)
        state = self._ckpt.restore(step, jax.tree.map(spec, like), self._fingerprints.get(str(step)))
        if like is not nodes:  # graph nodes: restored in place, as an NNX loop holds its state
            _nnx_update(nodes, state)
        if data is not None:
            data.set_state(self._ckpt.restore_data(step, self._data_fingerprints.get(str(step))))
        self.next_step = step
        return state

    # ---------------------------------------------------------------------------- the end

    def finish(self) -> None:
        """Writes the last record and marks the run complete (the only way a run becomes complete)."""
        if self.finished:
            return
        if self._step is not None:
            self._step.flush()
        self._close_examples()
        self._ckpt.wait()
        self._record_checkpoints(final=True)
        self._ckpt.close()
        self._run.finish()
        self.finished = True

    def close(self) -> None:
        """Stops recording without marking the run complete (it stays INCOMPLETE, resumable)."""
        if self.finished:
            return
        try:
            if self._step is not None:
                self._step.flush()
        finally:
            self._close_examples()
            try:
                if self._ckpt.wait() is not None:  # an asynchronous save completed: its fingerprint counts
                    self._record_checkpoints()
            finally:
                self._ckpt.close()
                self._run.close()
                self.finished = True

    def __enter__(self) -> "RecordingRun":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.finish() if exc_type is None else self.close()


def as_state(tree: Any) -> Any:
    from replay.record.nnx_step import as_state as nodes_state  # Flax only when given graph nodes

    return nodes_state(tree)


def _nnx_update(nodes: Any, state: Any) -> None:
    from flax import nnx

    from replay.record.nnx_step import _is_metric

    nodes = nodes if isinstance(nodes, (tuple, list)) else (nodes,)
    nnx.update(tuple(n for n in nodes if not _is_metric(n)), state)


def _one_process(call: str) -> None:
    import jax

    if jax.process_count() > 1:  # orbax's JsonSave writes process 0's value only
        raise RecordError(f"{call}: a run of {jax.process_count()} processes has one data iterator per host, and "
                          "saving their states with the checkpoint is not supported yet; give the loop batch_at")


def _inside(path: Path, folder: Path) -> bool:
    p, f = Path(path).resolve(), Path(folder).resolve()
    return p == f or f in p.parents


def init(path: str | os.PathLike, *, config: Any = None, entrypoint: str | Callable | None = None,
         dataset_size: int | None = None, checkpoints: Any = None, resume: bool = False,
         store_examples: bool = False, keep_checkpoints: int = 0) -> RecordingRun:
    """Starts recording a run into `path` (a new or empty folder), or resumes a crashed one.

    store_examples: keep every distinct example's rows in the run (RUN/examples/rows.bin) so a
      replay needs no user code. Off by default: its disk is the distinct examples fed, which for
      a pretraining run is the dataset itself (terabytes at a million steps); turn it on for runs
      you will replay elsewhere or pack into bug reports.
    keep_checkpoints: the newest N checkpoints kept on disk (older ones deleted after a save; the
      steps before the oldest kept one can no longer be replayed); 0 keeps all. With your own
      `checkpoints=` manager its max_to_keep decides instead."""
    return RecordingRun(path, config=config, entrypoint=entrypoint, dataset_size=dataset_size,
                        checkpoints=checkpoints, resume=resume, store_examples=store_examples,
                        keep_checkpoints=keep_checkpoints)
