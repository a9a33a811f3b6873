"""`Checkpointer`: saves and restores a run's checkpoints, for any loop (replay/record/checkpoints.py
holds the format and the reading; this the writer's life and the reader's handle).

    ckpt = Checkpointer(run_dir / "checkpoints", keep=3)       # a writer: keeps the 3 newest
    fp = ckpt.save(k, state)                # returns once checkpoint k is on disk: its fingerprint
    fp = ckpt.save(k, state, wait=False)    # returns once orbax holds the bytes; written meanwhile
    ckpt = Checkpointer(path, create=False)                    # replay: read-only
    state = ckpt.restore(k, target, fingerprint=fp)            # any device count the target says
    Checkpointer(manager=users_manager)     # the user's own orbax CheckpointManager (replay.init)

Used by `replay.init`'s run (replay/record/run.py) and by the trainer (trainer/loop.py,
trainer/replayable.py): one writer, so every loop's checkpoints are the same files.

Asynchronous saves (wait=False) never overlap: a save first waits for the one in flight, so at
most one is being written; wait() and close() wait too, and a failure of a save in flight is
raised there, naming its step (CheckpointDiskFullError carries it as `.step`). The caller may
donate the state to the next step at once: what is written is the state as it was at save()
(tested with a donating jit). On CPU orbax reads the buffers through zero-copy host views until
the write ends, so meanwhile JAX copies instead of donating (one more state in memory; measured).
Orbax writes a checkpoint into a temporary folder and renames it when complete, and prunes old
checkpoints (keep) only after that: a crash while a save is in flight leaves every earlier
checkpoint usable, and steps() lists only complete ones. A run's manifest should record a
checkpoint's fingerprint only once steps() lists it.

Read-only use (create=False) never writes, creates or deletes anything in the directory.
In a multi-process run every process must call save() and restore() (orbax coordinates the
processes and writes each array shard once; the fingerprint is a collective).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable

from replay.record import checkpoints as ckpts
from replay.record.orbax_io import (
    CheckpointDiskFullError, CheckpointError, _is_disk_full, _quiet_orbax, disk_of, quiet_until_released,
)


class Checkpointer:
    """Checkpoints under `path`, one orbax step directory each (checkpoint k: the state entering step k).

    keep: the most recent checkpoints kept on disk (older ones deleted after a save); 0 keeps all.
    create: True for the writer (creates `path`); False opens read-only (replay): saving is
      refused and nothing in the directory is created, modified or deleted.
    manager: a CheckpointManager of the user's instead of `path` (its own options stand; close()
      waits for it but leaves it open).
    step_of: reads the step a state is at (a TrainState's .step); restore then refuses a
      checkpoint holding another step as damaged.
    """

    def __init__(self, path: str | Path | None = None, keep: int = 0, create: bool = True, *,
                 manager: Any = None, step_of: Callable[[Any], int] | None = None):
        if keep < 0:
            raise CheckpointError(f"checkpoint keep={keep} must be >= 0 (0 keeps all)")
        if (path is None) == (manager is None):
            raise ValueError("Checkpointer(path) or Checkpointer(manager=...), not both or neither")
        self.keep, self.read_only, self._step_of = keep, not create, step_of
        self._own = manager is None
        if self._own:
            self.path = ckpts.location(path)  # an epath.Path for a URL (several processes' run on object storage)
            if self.read_only and not self.path.is_dir():
                raise CheckpointError(f"{self.path}: no checkpoint directory; check the run path "
                                      f"(checkpoints live in RUN/checkpoints)")
            self._manager = ckpts.open_manager(self.path, read_only=self.read_only, keep=keep)
        else:
            if keep:
                raise ValueError("keep= is the user's CheckpointManager's own option (max_to_keep)")
            self._manager = manager
            self.path = ckpts.directory_of(manager)
        self._pending: int | None = None  # the step of an asynchronous save not yet waited for
        self._unquiet = None  # ends the quiet kept while that save's writer threads run
        self._failed = False  # a save failed: orbax's manager re-raises it from then on

    @property
    def manager(self) -> Any:
        """The orbax CheckpointManager (replay/record/checkpoints.py's functions take it)."""
        return self._manager

    # ------------------------------------------------------------------------ writing

    def save(self, step: int, state: Any, data: dict | None = None, wait: bool = True) -> str | None:
        """Save `state` (and `data`, a data iterator's payload, replay/record/data_iterator.py, or
        the orbax args its own handler saves it with, grain's, in the same orbax step) as checkpoint `step`; returns the state's fingerprint (computed on
        device before the write starts: the state may be donated to the next step). Returns None
        (and writes nothing) if that step is already saved: the state entering step k is a pure
        function of the run, so the existing checkpoint stands. All processes must call it.

        wait=True returns once the checkpoint is on disk. wait=False returns once orbax holds a
        host copy of the state, and the write goes on in the background until the next save,
        wait() or close(), which wait for it (and raise its failure) before anything else. The
        wait before a save is what keeps saves from overlapping; it costs the step loop nothing
        while saves take less time than the steps between them."""
        import orbax.checkpoint as ocp

        from replay.record.fingerprint import state_fingerprint

        if self.read_only:
            raise CheckpointError(f"{self.path}: opened read-only (create=False); cannot save a checkpoint")
        self.wait()
        if step in self.steps():
            return None
        fingerprint = state_fingerprint(state)  # a collective, on device: every process computes it
        # data: a payload dict (replay's JSON item), or the orbax args of the iterator's own handler (grain's)
        data_args = ocp.args.JsonSave(data) if isinstance(data, dict) else data
        args = (ocp.args.StandardSave(state) if data is None else ocp.args.Composite(
            **{ckpts.STATE: ocp.args.StandardSave(state), ckpts.DATA: data_args}))
        unquiet = quiet_until_released()  # from before the writer threads start: they may fail at once
        try:
            with _quiet_orbax():
                self._manager.save(step, args=args, force=True)
                if wait:
                    self._manager.wait_until_finished()
        except Exception as e:
            unquiet()
            self._failed = True
            if _is_disk_full(e):
                raise self._disk_full(step) from None
            raise
        if wait:
            unquiet()
        self._pending, self._unquiet = (None, None) if wait else (step, unquiet)
        return fingerprint

    def wait(self) -> int | None:
        """Blocks until the asynchronous save in flight is on disk; returns its step (None when
        there was none). Its failure is raised here: CheckpointDiskFullError for a full disk."""
        k, self._pending = self._pending, None
        unquiet, self._unquiet = self._unquiet, None
        if k is None:
            return None
        try:
            with _quiet_orbax():
                self._manager.wait_until_finished()
        except Exception as e:
            self._failed = True
            if _is_disk_full(e):
                raise self._disk_full(k) from None
            raise
        finally:
            if unquiet is not None:
                unquiet()
        return k

    @property
    def pending(self) -> int | None:
        """The step of the asynchronous save in flight (not yet waited for), or None."""
        return self._pending

    def _disk_full(self, step: int) -> CheckpointDiskFullError:
        error = CheckpointDiskFullError(f"{disk_of(self.path)} is full: checkpoint {step} could not be "
                                        f"saved in {self.path}")
        error.step = step  # an asynchronous save's failure surfaces at a later save: which one failed
        return error

    # ------------------------------------------------------------------------ reading

    def steps(self) -> list[int]:
        """Steps with a finished checkpoint, ascending."""
        return ckpts.steps(self._manager)

    def latest_at_or_before(self, step: int) -> int | None:
        """The largest checkpointed step <= `step`, or None if there is none."""
        return ckpts.latest_at_or_before(self.steps(), step)

    def restore(self, step: int, abstract_state: Any, fingerprint: str | None = None) -> Any:
        """The state saved at `step`, laid out as `abstract_state` says: a tree of
        jax.ShapeDtypeStruct with `sharding=`, so any device count or mesh works (checked leaf by
        leaf against the checkpoint first: CheckpointError naming the first that differs).
        Raises CheckpointError for a step that was not saved.

        fingerprint: the state_fingerprint recorded when it was saved; the restored state's is
        computed on device and must equal it (CheckpointDamagedError otherwise). None skips
        the check (the caller says the restore is unverified). All processes must call it."""
        if step == self._pending:
            self.wait()
        return ckpts.restore(self._manager, step, abstract_state, fingerprint, step_of=self._step_of)

    def restore_data(self, step: int, fingerprint: str | None = None) -> Any:
        """The data iterator state saved with checkpoint `step`, verified against `fingerprint`."""
        if step == self._pending:
            self.wait()
        return ckpts.restore_data(self._manager, step, fingerprint)

    def is_composite(self, step: int) -> bool:
        """Whether checkpoint `step` holds a data iterator's state beside the state."""
        return ckpts.is_composite(self._manager, step)

    # ------------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Waits for the save in flight (raising its failure) and releases orbax's threads (of
        the user's manager: only waits; the user closes it)."""
        try:
            self.wait()
        finally:
            # After a failed save orbax re-raises that failure from every wait, close included:
            # it was reported once (where it surfaced), and is not the close's own.
            with contextlib.suppress(Exception) if self._failed else contextlib.nullcontext(), _quiet_orbax():
                if self._own:
                    self._manager.close()
                else:
                    self._manager.wait_until_finished()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
