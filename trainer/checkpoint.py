"""Checkpoints: an orbax CheckpointManager over one directory (a run's RUN/checkpoints).

A checkpoint named k holds the TrainState after k steps (state.step == k): the input of
step k. So "replay steps a..b" restores `latest_at_or_before(a)` and re-runs from there.

    ckpt = Checkpointer(run.checkpoint_dir, keep=cfg.checkpoint.keep)      # the trainer
    ckpt.save(state)                        # returns once the checkpoint is on disk
    ckpt = Checkpointer(path, create=False)                                # replay: read-only
    state = ckpt.restore(k, mesh.sharded_abstract_state(cfg, mesh))        # any device count

Restoring onto a layout (device count, mesh) other than the one saved needs a target with
shardings; it is built from `jax.eval_shape` of the state constructor (trainer/mesh.py),
which also keeps optax's NamedTuples that a target read from checkpoint metadata would lose.
Restored bytes are identical to the saved ones on any layout (tested 8 devices <-> 1).

Read-only use (create=False) never writes, creates or deletes anything in the directory:
no root directory, no metadata, no cleanup of temporary or old checkpoints.
In a multi-process run every process must call save() and restore() (orbax coordinates the
processes and writes each array shard once).
"""

from __future__ import annotations

import bisect
import contextlib
import logging
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp


class CheckpointError(ValueError):
    """A missing or unusable checkpoint; the message is one line for users."""


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
        with _quiet_absl(self.read_only):  # orbax warns that read-only is read-only
            self._manager = ocp.CheckpointManager(self.path, options=options,
                                                  item_handlers=ocp.StandardCheckpointHandler())

    # ------------------------------------------------------------------------ writing

    def save(self, state: Any) -> bool:
        """Save `state` as checkpoint `state.step` and wait until it is on disk, so a step that
        steps() lists is complete. All processes must call it. Returns False (and writes
        nothing) if that step is already saved: the state at step k is a pure function of
        the run, so the existing checkpoint stands."""
        if self.read_only:
            raise CheckpointError(f"{self.path}: opened read-only (create=False); cannot save a checkpoint")
        k = _step_of(state)
        if k in self.steps():
            return False
        self._manager.save(k, args=ocp.args.StandardSave(state), force=True)
        self._manager.wait_until_finished()
        return True

    # ------------------------------------------------------------------------ reading

    def steps(self) -> list[int]:
        """Steps with a finished checkpoint, ascending."""
        self._manager.reload()  # another process (the trainer) may have saved since we opened
        return sorted(int(s) for s in self._manager.all_steps())

    def latest_at_or_before(self, step: int) -> int | None:
        """The largest checkpointed step <= `step`, or None if there is none."""
        steps = self.steps()
        i = bisect.bisect_right(steps, step)
        return steps[i - 1] if i else None

    def restore(self, step: int, abstract_state: Any) -> Any:
        """The TrainState saved at `step`, laid out as `abstract_state` says: a tree of
        jax.ShapeDtypeStruct with `sharding=` (trainer.mesh.sharded_abstract_state), so any
        device count or mesh works. Raises CheckpointError for a step that was not saved."""
        steps = self.steps()
        if step not in steps:
            have = _list(steps) if steps else "none"
            raise CheckpointError(f"{self.path}: no checkpoint at step {step} (saved steps: {have}); "
                                  f"pick a saved step or use latest_at_or_before({step})")
        self._check_target(step, abstract_state)  # before orbax starts reading arrays
        try:
            state = self._manager.restore(step, args=ocp.args.StandardRestore(abstract_state))
        except (ValueError, KeyError, TypeError) as e:
            msg = " ".join(str(e).split())[:300]
            raise CheckpointError(f"{self.path}: checkpoint {step} does not match the target state "
                                  f"({type(e).__name__}: {msg}); was it saved with a different config?") from None
        got = _step_of(state)
        if got != step:
            raise CheckpointError(f"{self.path}: checkpoint {step} holds a state at step {got}; "
                                  f"the checkpoint directory is damaged")
        return state

    def _check_target(self, step: int, abstract_state: Any) -> None:
        """CheckpointError naming the first leaf whose presence, shape or dtype differs
        between checkpoint `step` and the target."""
        try:
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
        self._manager.wait_until_finished()
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@contextlib.contextmanager
def _quiet_absl(quiet: bool):
    logger = logging.getLogger("absl")
    level = logger.level
    if quiet:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


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
