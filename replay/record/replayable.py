"""The loop protocol (replay/engine/protocol.py) for runs recorded through `replay.init`.

The manifest's "replayable" is this module's `from_run` (replay's own code, trusted); it
imports the user's entry point the manifest names through replay.engine.code.import_entrypoint (the
code policy: installed modules by name, a recorded folder only with --allow-code, never from a
bundle), calls it with the recorded config, and wraps the Loop's step exactly as `run.step`
did while recording (the recorded step options), so the program, its hash and its schema are
the recorded ones when the code is. Every call into the user's code goes through
replay.engine.code.call_user: an exception there is the user's (exit 2), named.

The batch of step k is `batch(k)`: the Loop's `batch_at(k)`, or the next batch of its data
iterator, restored with the checkpoint the replay started from (replay/record/data_iterator.py:
steps in order cost one `next` each; a step out of order re-iterates from the newest checkpoint
at or before it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np

from replay.errors import ReplayUnavailable
from replay.record import checkpoints as ckpts
from replay.record import data_iterator, examples_store, loop_checkpoints, saved_layout
from replay.record.data_iterator import IteratorFeed, next_batch
from replay.record.hashing import example_hashes
from replay.record.loop import MARK, Loop
from replay.record.options import StepOptions
from replay.record.nnx_step import program_for
from traces import Run
from replay.engine.code import call_user, call_user_as, function_name, import_entrypoint
from replay.engine.placement import rotated
from replay.record.exported import choose
import functools


class LoopReplay:
    def __init__(self, run: Run, data: str | None = None, allow_data_change: bool = False, on_compile=None,
                 allow_code: bool = False):
        if data is not None:
            raise ReplayUnavailable(f"{run.path}: this run's batches come from its loop (batch_at or its data iterator); "
                               "--data does not apply")
        manifest = run.manifest
        spec = manifest.get("entrypoint")
        if not isinstance(spec, str):
            raise ReplayUnavailable(f"{run.path}: its manifest names no entry point to rebuild the loop from")
        make = import_entrypoint(run, spec, allow_code=allow_code, search_path=manifest.get("entrypoint_path"))
        if not getattr(make, MARK, False):
            raise ReplayUnavailable(f"{run.path}: its entry point {spec} is not marked @replay.entrypoint; replay calls "
                               "only functions declared as loop factories")
        loop = call_user(make, manifest.get("config"))
        if not isinstance(loop, Loop):
            raise ReplayUnavailable(f"{function_name(make)} returned {type(loop).__name__}, not a replay.Loop")
        self.loop, self._call = loop, call_user
        self.options = StepOptions.from_json(manifest.get("record") or {})
        self._manifest, self._shown = manifest, run.path
        own = ckpts.run_checkpoint_dir(run)  # none in a run whose loop keeps its checkpoints (Loop.checkpoints)
        self._manager = ckpts.open_manager(own, read_only=True) if loop.checkpoints is None or own.is_dir() else None
        self._run = run
        self.restore_notes: list[str] = []
        self._abstract = call_user(loop.state_shapes)
        self._abstract = _as_saved(self._abstract, loop, self._manager)
        self._feed = None if loop.data is None else IteratorFeed(loop.data, self.checkpoint_steps, self._restore_data)
        # The step compiles for the batches' shapes: a fresh iterator's first batch has them.
        batch = call_user(loop.batch_at, run.first_step or 0) if self._feed is None else next_batch(self._feed.fresh())
        if on_compile is not None:
            on_compile()
        self.program = program_for(loop.step, self.options)
        # Errors while tracing are the Loop's step's (or a state it does not take), never Program.compile's.
        call_user_as(function_name(_user_function(loop.step)), self.program.compile, self._abstract, batch)
        self.schema = self.program.schema
        self._trace, self._batch_tree = run.trace, jax.tree.structure(batch)
        self._stored = _stored_rows(run)
        self._check_loop_at: int | None = None  # the first step after a restore: the loop's own batch compared there
        if self._stored is not None:
            self.restore_notes.append("fed the run's stored rows (RUN/examples) at every step it holds, the bytes the "
                                      "run fed, not the loop's batch_at or data iterator")
        if self.schema.to_json() != run.schema.to_json():
            self.restore_notes.append("the loop's step records a different schema here than the run recorded "
                                      "(different outputs, taps or state): its records are compared field by field")

    def environment(self) -> dict:
        from replay.record.environment import environment

        return environment()

    def program_hash(self) -> str | None:
        return self.program.program_hash

    def checkpoint_steps(self) -> list[int]:
        return sorted(set(self._own_steps()) | set(self._loop_steps()))

    def _own_steps(self) -> list[int]:
        return ckpts.steps(self._manager) if self._manager is not None else []

    def _loop_steps(self) -> list[int]:
        given = self.loop.checkpoints
        return [] if given is None else [int(k) for k in self._call(given.steps)]

    def restore(self, step: int) -> Any:
        if step not in self._own_steps() and step in self._loop_steps():  # the loop's own (loop_checkpoints.py)
            given = self.loop.checkpoints
            state = self._call(given.restore, step)
            where = (self._call(given.describe, step) if callable(getattr(given, "describe", None))
                     else f"{function_name(given.restore)}({step}) for {self._shown}")
            note = loop_checkpoints.verify(state, step, self._run, where)
            if note is not None and note not in self.restore_notes:
                self.restore_notes.append(note)
            self._check_loop_at = step
            return state
        fingerprint = (self._manifest.get(ckpts.FINGERPRINTS_KEY) or {}).get(str(step))
        if fingerprint is None and not any(str(step) in n for n in self.restore_notes):
            self.restore_notes.append(f"checkpoint {step} has no recorded fingerprint, so it was restored unverified")
        state = ckpts.restore(self._manager, step, self._abstract, fingerprint)
        if self._feed is not None:
            self._feed.restore(step)
        self._check_loop_at = step
        return state

    def _restore_data(self, step: int) -> Any:
        if not ckpts.is_composite(self._manager, step):
            raise ReplayUnavailable(f"checkpoint {step} of {self._shown} holds no data iterator state (it was saved with "
                               "run.save(k, state), without data=), so the Loop's data= cannot be set to it; give the "
                               "Loop batch_at, or record with run.save(k, state, data=it)")
        fingerprint = (self._manifest.get(data_iterator.DATA_FINGERPRINTS_KEY) or {}).get(str(step))
        note = f"the data iterator state of checkpoint {step} has no recorded fingerprint: it was restored unverified"
        if fingerprint is None and note not in self.restore_notes:
            self.restore_notes.append(note)
        return ckpts.restore_data(self._manager, step, fingerprint)

    def batch(self, step: int) -> Any:
        """The batch step `step` is fed: the run's stored rows of it when it kept them (what it fed,
        whatever the loop's data now gives), else batch_at(step) or the data iterator's (see the
        module doc). At the first step after a restore the loop's own batch is compared with the
        stored one: a data pipeline (or an iterator's set_state) that does not reproduce the run's
        stream is named in a note."""
        stored = self._stored_batch(step)
        if stored is None:
            return self._own_batch(step)
        if self._check_loop_at == step:
            self._check_loop_at = None
            own = example_hashes(self._own_batch(step), self.options.batch_axis)
            recorded = np.asarray(self._trace.read(step).example_hashes, np.uint64)
            if not np.array_equal(own, recorded):
                n = int(np.sum(own != recorded)) if own.shape == recorded.shape else len(recorded)
                how = "its data iterator, restored at that checkpoint (set_state)," if self._feed else "its batch_at"
                self.restore_notes.append(f"the loop's own data does not reproduce step {step}'s batch ({n} of "
                                          f"{len(recorded)} examples differ): {how} gives other rows than the run fed; "
                                          "replay fed the stored rows")
        return stored

    def _own_batch(self, step: int) -> Any:
        return self._call(self.loop.batch_at, step) if self._feed is None else self._feed.batch(step)

    def _stored_batch(self, step: int) -> Any:
        if self._stored is None or step not in self._trace:
            return None
        try:
            leaves = self._stored.batch(step, np.asarray(self._trace.read(step).example_hashes, np.uint64))
        except examples_store.ExampleStoreError as e:
            # Not stored (a step before the store began), or the store is damaged: the loop's own batch.
            if "not stored" not in str(e) and not any(n.startswith("the example store") for n in self.restore_notes):
                self.restore_notes.append(f"the example store could not give step {step}'s rows ({e}); fed the loop's "
                                          "own batch")
            return None
        return jax.tree.unflatten(self._batch_tree, leaves)

    def step(self, state: Any, step: int) -> tuple[Any, dict, np.ndarray]:
        batch = self.batch(step)
        hashes = example_hashes(batch, self.options.batch_axis)
        state, _, record = self.program(state, batch)
        return state, record, hashes

    def rotated_step(self, state: Any, step: int, rotate: int) -> Any:
        """(new state, metrics) of the Loop's own step at `step` from `state` (not consumed), every
        array of the state and the batch moved `rotate` devices further (replay/engine/placement.py):
        for `replay verify`'s shard-by-shard comparison. The Loop's step as written, without the
        record's program around it, so the three rotations run one program."""
        batch = self.batch(step)
        return self._call(self.loop.step, rotated(state, rotate), rotated(batch, rotate))

    # replay compare --eval: capabilities only where the Loop gives them. A property that raises
    # AttributeError reads as absent to getattr(rep, NAME, None), so commands say which field to add.
    @property
    def evaluate(self) -> Any:
        """(state, batch) -> float32 [n]: the Loop's `evaluate` (replay.engine.protocol.Replayable)."""
        fn = self.loop.evaluate
        if fn is None:
            raise AttributeError("the run's replay.Loop gives no evaluate")
        return lambda state, batch: np.asarray(self._call(fn, state, batch))

    @property
    def eval_batches(self) -> Any:
        """() -> iterable of held-out batches: the Loop's `eval_batches` (replay.engine.protocol.Replayable)."""
        fn = self.loop.eval_batches
        if fn is None:
            raise AttributeError("the run's replay.Loop gives no eval_batches")

        @functools.wraps(fn)  # an error while iterating is named as the user's eval_batches
        def listed() -> list:
            return list(fn())

        return lambda: self._call(listed)

    def state_shapes(self) -> Any:
        """The state's abstract tree (jax.ShapeDtypeStruct leaves), as checkpoints are restored onto it."""
        return self._abstract


def _as_saved(abstract: Any, loop: Loop, manager: Any) -> Any:
    """The state's shapes with each leaf the Loop does not place where the newest checkpoint saved
    it (replay/record/saved_layout.py), so the step compiles for the layout the run trained on."""
    saved = ckpts.steps(manager) if manager is not None else []
    if not saved:
        return abstract
    layout = saved_layout.saved_shardings(ckpts.state_metadata(manager, saved[-1]))
    return saved_layout.with_saved_shardings(abstract, saved_layout.given_shardings(loop.abstract_state), layout)


def _stored_rows(run: Run) -> Any:
    """The run's example store, when it kept one (replay/record/examples_store.py), else None."""
    entry = run.manifest.get(examples_store.KEY)
    if not isinstance(entry, dict) or not entry.get("leaves"):
        return None
    return examples_store.ExampleReader(Path(run.path), entry, complete=run.status == "complete")


def _user_function(step: Any) -> Any:
    """The function the user wrote under a jit and functools.partial, to name in an error."""
    for _ in range(4):
        inner = getattr(step, "__wrapped__", None) or getattr(step, "func", None)
        if not callable(inner):
            break
        step = inner
    return step


def from_run(run: Run, **options: Any) -> Any:
    return choose(run, LoopReplay, **options)
