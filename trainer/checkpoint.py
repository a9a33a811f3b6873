"""Checkpoints: an orbax CheckpointManager over one directory (a run's RUN/checkpoints).

A checkpoint named k holds the TrainState after k steps (state.step == k): the input of
step k. So "replay steps a..b" restores `latest_at_or_before(a)` and re-runs from there.

    ckpt = Checkpointer(run.checkpoint_dir, keep=cfg.checkpoint.keep)      # the trainer
    ckpt.save(state)                        # returns once the checkpoint is on disk
    ckpt.save(state, wait=False)            # returns once orbax holds the bytes; written meanwhile
    ckpt = Checkpointer(path, create=False)                                # replay: read-only
    state = ckpt.restore(k, mesh.sharded_abstract_state(cfg, mesh))        # any device count

Restoring onto a layout (device count, mesh) other than the one saved needs a target with
shardings; it is built from `jax.eval_shape` of the state constructor (trainer/mesh.py),
which also keeps optax's NamedTuples that a target read from checkpoint metadata would lose.
Restored bytes are identical to the saved ones on any layout (tested 8 devices <-> 1).

Asynchronous saves (wait=False) never overlap: a save first waits for the one in flight, so at
most one is being written; wait() and close() wait too, and a failure of a save in flight is
raised there, naming its step (CheckpointDiskFullError carries it as `.step`). The caller may
donate the state to the next step at once: what is written is the state as it was at save()
(tested with a donating jit). On CPU orbax reads the buffers through zero-copy host views until
the write ends, so meanwhile JAX copies instead of donating (one more state in memory; measured).
Orbax writes a checkpoint into a temporary folder
and renames it when complete, and prunes old checkpoints (keep) only after that: a crash while
a save is in flight leaves every earlier checkpoint usable, and steps() lists only complete ones.
A run's manifest should record a checkpoint's fingerprint only once steps() lists it.

Read-only use (create=False) never writes, creates or deletes anything in the directory:
no root directory, no metadata, no cleanup of temporary or old checkpoints.
In a multi-process run every process must call save() and restore() (orbax coordinates the
processes and writes each array shard once).

Integrity: the trainer records `state_fingerprint(state)` (replay/record/fingerprint.py) of every state it
saves in the run manifest ("checkpoint_fingerprints"); restore(..., fingerprint=) recomputes it on
device and raises CheckpointDamagedError on a mismatch. Orbax stores array chunks with no checksum
(zstd without frame checksums), so a flipped bit in a chunk restores silently; only this catches it.
Unreadable chunk files (truncated, zeroed, missing) are CheckpointDamagedError too.
Orbax reports through absl logging, asyncio and unraisable-exception hooks from its threads;
all of that is kept off the terminal (replay/record/orbax_io.py): failures become one-line errors.
"""

from __future__ import annotations

import bisect
import contextlib
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from replay.record.orbax_io import (  # one home for these, shared with the recording API
    _WHAT_TO_DO, CheckpointDamagedError, CheckpointDiskFullError, CheckpointError, _is_disk_full, _quiet_orbax,
    _read_failure, disk_of, quiet_until_released,
)
from replay.record.checkpoints import FINGERPRINTS_KEY  # the manifest key, the recording API's




def recorded_fingerprint(manifest: dict, step: int) -> str | None:
    """The state fingerprint recorded when checkpoint `step` was saved; None for runs (or
    checkpoints) from before fingerprints were recorded."""
    value = (manifest.get(FINGERPRINTS_KEY) or {}).get(str(step))
    return value if isinstance(value, str) else None


class Checkpointer:
    """Saves and restores TrainStates under `path`, one orbax step directory per checkpoint.

    keep: the most recent checkpoints kept on disk (older ones deleted after a save); 0 keeps all.
    create: True for the writer (creates `path`); False opens read-only (replay): saving is
      refused and nothing in the directory is created, modified or deleted.
    """

    def __init__(self, path: str | Path, keep: int = 0, create: bool = True):
        if keep < 0:
            raise CheckpointError(f"checkpoint keep={keep} must be >= 0 (0 keeps all)")
        self.path = Path(path).absolute()
        self.keep = keep
        self.read_only = not create
        if self.read_only and not self.path.is_dir():
            raise CheckpointError(f"{self.path}: no checkpoint directory; check the run path "
                                  f"(checkpoints live in RUN/checkpoints)")
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=0 if self.read_only else 1,
            max_to_keep=None if keep == 0 or self.read_only else keep,
            create=create,
            read_only=self.read_only,
            cleanup_tmp_directories=False,  # a crashed save's leftovers are for people to inspect
            save_root_metadata=not self.read_only,
            enable_async_checkpointing=True,
        )
        with _quiet_orbax():  # orbax warns that read-only is read-only
            self._manager = ocp.CheckpointManager(self.path, options=options,
                                                  item_handlers=ocp.StandardCheckpointHandler())
        self._pending: int | None = None  # the step of an asynchronous save not yet waited for
        self._unquiet = None  # ends the quiet kept while that save's writer threads run
        self._failed = False  # a save failed: orbax's manager re-raises it from then on

    # ------------------------------------------------------------------------ writing

    def save(self, state: Any, wait: bool = True) -> bool:
        """Save `state` as checkpoint `state.step`. All processes must call it. Returns False (and
        writes nothing) if that step is already saved: the state at step k is a pure function of
        the run, so the existing checkpoint stands.

        wait=True returns once the checkpoint is on disk. wait=False returns once orbax holds a
        host copy of the state, and the write goes on in the background until the next save,
        wait() or close(), which wait for it (and raise its failure) before anything else. The
        wait before a save is what keeps saves from overlapping; it costs the step loop nothing
        while saves take less time than the steps between them."""
        if self.read_only:
            raise CheckpointError(f"{self.path}: opened read-only (create=False); cannot save a checkpoint")
        k = _step_of(state)
        self.wait()
        if k in self.steps():
            return False
        unquiet = quiet_until_released()  # from before the writer threads start: they may fail at once
        try:
            with _quiet_orbax():
                self._manager.save(k, args=ocp.args.StandardSave(state), force=True)
                if wait:
                    self._manager.wait_until_finished()
        except Exception as e:
            unquiet()
            self._failed = True
            if _is_disk_full(e):
                raise self._disk_full(k) from None
            raise
        if wait:
            unquiet()
        self._pending, self._unquiet = (None, None) if wait else (k, unquiet)
        return True

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
        with _quiet_orbax():
            self._manager.reload()  # another process (the trainer) may have saved since we opened
            return sorted(int(s) for s in self._manager.all_steps())

    def latest_at_or_before(self, step: int) -> int | None:
        """The largest checkpointed step <= `step`, or None if there is none."""
        steps = self.steps()
        i = bisect.bisect_right(steps, step)
        return steps[i - 1] if i else None

    def restore(self, step: int, abstract_state: Any, fingerprint: str | None = None) -> Any:
        """The TrainState saved at `step`, laid out as `abstract_state` says: a tree of
        jax.ShapeDtypeStruct with `sharding=` (trainer.mesh.sharded_abstract_state), so any
        device count or mesh works. Raises CheckpointError for a step that was not saved.

        fingerprint: the state_fingerprint recorded when it was saved; the restored state's is
        computed on device and must equal it (CheckpointDamagedError otherwise). None skips
        the check (the caller says the restore is unverified). All processes must call it."""
        if step == self._pending:
            self.wait()
        steps = self.steps()
        if step not in steps:
            have = _list(steps) if steps else "none"
            raise CheckpointError(f"{self.path}: no checkpoint at step {step} (saved steps: {have}); "
                                  f"pick a saved step or use latest_at_or_before({step})")
        self._check_target(step, abstract_state)  # before orbax starts reading arrays
        where = self.path / str(step)
        try:
            with _quiet_orbax():
                state = self._manager.restore(step, args=ocp.args.StandardRestore(abstract_state))
        except Exception as e:  # noqa: BLE001 - the target matched (checked above): the files are bad
            # Orbax raises bare Exceptions wrapping TensorStore's ValueErrors (2 KB of spec).
            raise CheckpointDamagedError(f"{where}: checkpoint {step} is damaged ({_read_failure(e)}); "
                                         f"{_WHAT_TO_DO}") from None
        got = _step_of(state)
        if got != step:
            raise CheckpointDamagedError(f"{where}: checkpoint {step} is damaged (it holds the state after "
                                         f"step {got}); {_WHAT_TO_DO}")
        if fingerprint is not None:
            from replay.record.fingerprint import state_fingerprint

            actual = state_fingerprint(state)
            if actual != fingerprint:
                raise CheckpointDamagedError(
                    f"{where}: checkpoint {step} is damaged (its state's fingerprint {actual} differs from "
                    f"{fingerprint} recorded when it was saved); {_WHAT_TO_DO}")
        return state

    def _check_target(self, step: int, abstract_state: Any) -> None:
        """CheckpointError naming the first leaf whose presence, shape or dtype differs
        between checkpoint `step` and the target."""
        try:
            with _quiet_orbax():
                stored = _shapes(self._manager.item_metadata(step))
        except Exception:  # no readable metadata: let restore itself report what is wrong
            return
        if not stored:
            return
        target = _shapes(abstract_state)
        problem = None
        for name in list(target) + [n for n in stored if n not in target]:  # in state order
            if name not in stored:
                problem = f"the target has {name} {_fmt(target[name])}, the checkpoint does not"
            elif name not in target:
                problem = f"the checkpoint has {name} {_fmt(stored[name])}, the target does not"
            elif stored[name] != target[name]:
                problem = f"{name} is {_fmt(stored[name])} in the checkpoint, {_fmt(target[name])} in the target"
            if problem:
                break
        if problem:
            raise CheckpointError(f"{self.path}: checkpoint {step} does not match the state to restore: {problem}; "
                                  f"restore it with the config it was saved with")

    # ------------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Waits for the save in flight (raising its failure) and releases orbax's threads."""
        try:
            self.wait()
        finally:
            # After a failed save orbax re-raises that failure from every wait, close included:
            # it was reported once (where it surfaced), and is not the close's own.
            with contextlib.suppress(Exception) if self._failed else contextlib.nullcontext(), _quiet_orbax():
                self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _shapes(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """{"opt_state.1.count": (shape, dtype)} for a state, its abstract target or orbax's
    metadata of it (which stores NamedTuples as dicts of their fields)."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        parts = []
        for k in path:
            parts.append(str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k)))))
        shape = tuple(int(d) for d in getattr(leaf, "shape", np.shape(leaf)))
        dtype = getattr(leaf, "dtype", None)
        out[".".join(parts)] = (shape, str(np.dtype(dtype)) if dtype is not None else type(leaf).__name__)
    return out


def _fmt(shape_dtype: tuple[tuple[int, ...], str]) -> str:
    shape, dtype = shape_dtype
    return f"{dtype}{list(shape)}"


def _step_of(state: Any) -> int:
    # state.step is replicated; in a multi-process run it is not fully addressable, so read
    # this process's copy instead of int(state.step).
    s = state.step
    if isinstance(s, jax.Array):
        s = s.addressable_shards[0].data
    return int(np.asarray(s))


def _list(steps: list[int], most: int = 12) -> str:
    if len(steps) <= most:
        return ", ".join(map(str, steps))
    return ", ".join(map(str, steps[:most // 2])) + ", ..., " + ", ".join(map(str, steps[-most // 2:]))
