"""A recording run's checkpoints: saved through replay/record/checkpointer.py, each one's state
(and data iterator) fingerprint recorded in run.json once it is complete on disk, and restored
verified against it. `replay.init`'s run (replay/record/run.py) holds one; every loop's
checkpoints, the trainer's included, go through it. Cost: O(checkpoints) in memory (their
fingerprints), nothing per step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from replay.record import checkpoints as ckpts
from replay.record import data_iterator
from replay.record.checkpointer import Checkpointer
from replay.record.errors import RecordError
from replay.record.program import spec


class RunCheckpoints:
    def __init__(self, directory: Path, manifest: dict, *, manager: Any = None, keep: int = 0,
                 state_step: Callable[[Any], int] | None = None, write: Callable[..., None] | None = None):
        self.ckpt = (Checkpointer(manager=manager) if manager is not None else
                     Checkpointer(directory, keep=keep, step_of=state_step))
        self.fingerprints: dict = dict(manifest.get(ckpts.FINGERPRINTS_KEY) or {})
        self.data_fingerprints: dict = dict(manifest.get(data_iterator.DATA_FINGERPRINTS_KEY) or {})
        self.notes: list[str] = []  # checkpoints restored unverified (saved before fingerprints were recorded)
        self._write = write  # run.json's updater; None on processes other than 0

    def steps(self) -> list[int]:
        return self.ckpt.steps()

    def save(self, step: int, state: Any, data: Any, wait: bool, before_write: Callable[[], None]) -> bool:
        """Saves checkpoint `step` (False, writing nothing, when it is on disk already: the state
        entering a step is a pure function of the run, so the saved one stands). The save in
        flight is waited for first: a CheckpointDiskFullError may be its."""
        if data is not None:
            data_iterator.check_iterator(data, f"run.save({step}, state, data=...)")
            one_process(f"run.save({step}, state, data=...)")
        self._check_data_style(step, data is not None)
        self.ckpt.wait()
        if step in self.ckpt.steps():
            return False
        before_write()
        stored = None if data is None else data_iterator.payload(data)
        saved_as = None if data is None else data_iterator.save_args(data, stored)
        # every process: the fingerprint is a collective, taken before the next step donates the state
        self.fingerprints[str(step)] = self.ckpt.save(step, state, saved_as, wait=wait)
        if stored is not None:
            self.data_fingerprints[str(step)] = data_iterator.fingerprint(stored)
        self.record()
        return True

    def record(self, final: bool = False) -> None:
        """The manifest's checkpoints and their fingerprints: those complete on disk (an
        asynchronous save's once it is; none that `keep_checkpoints` pruned)."""
        listed = self.ckpt.steps()
        done = [k for k in self.fingerprints if int(k) in listed]
        entries = {ckpts.FINGERPRINTS_KEY: {k: self.fingerprints[k] for k in done},
                   "checkpoints": sorted(int(k) for k in done) if final else listed}
        if self.data_fingerprints:
            entries[data_iterator.DATA_FINGERPRINTS_KEY] = {k: v for k, v in self.data_fingerprints.items()
                                                             if int(k) in listed}
        if self._write is not None:
            self._write(**entries)

    def _check_data_style(self, step: int, with_data: bool) -> None:
        """One layout per run: every checkpoint holds the iterator's state, or none does."""
        if not self.fingerprints or with_data == bool(self.data_fingerprints):
            return
        first = min(int(k) for k in self.fingerprints)
        if with_data:
            raise RecordError(f"run.save({step}, state, data=...): checkpoint {first} of this run was saved without "
                              "data=; give data= to every run.save of a run, or to none")
        raise RecordError(f"run.save({step}, state): this run's checkpoints hold its data iterator's state (checkpoint "
                          f"{first} was saved with data=); give data= here too")

    def newest(self, trace_end: int | None) -> int | None:
        """The newest checkpoint at or before `trace_end` (None: any), one with a recorded
        fingerprint before one without; None when there is none."""
        usable = [k for k in self.ckpt.steps() if trace_end is None or k <= trace_end]
        verified = [k for k in usable if str(k) in self.fingerprints]
        chosen = verified or usable
        return chosen[-1] if chosen else None

    def restore(self, like: Any, step: int, data: Any = None) -> Any:
        """Checkpoint `step` onto the structure of `like`, verified; `data` (the run's data
        iterator) set to the state saved with it."""
        import jax

        if data is not None:
            data_iterator.check_iterator(data, f"run.restore(like, {step}, data=...)")
        if step in self.ckpt.steps() and self.ckpt.is_composite(step) != (data is not None):
            raise RecordError(f"run.restore(like, {step}, data=it): checkpoint {step} holds the data iterator's state; "
                              "pass the iterator so it resumes there" if data is None else
                              f"run.restore(like, {step}, data=...): checkpoint {step} was saved without data=, so it "
                              "holds no data iterator state to restore")
        nodes, like = like, as_state(like)
        expected = self.fingerprints.get(str(step))
        state = self.ckpt.restore(step, jax.tree.map(spec, like), expected)
        if expected is None:
            self.notes.append(f"{self.ckpt.path / str(step)}: checkpoint {step} has no recorded fingerprint (saved "
                              "before replay recorded them); resumed from it unverified")
        if like is not nodes:  # graph nodes: restored in place, as an NNX loop holds its state
            _nnx_update(nodes, state)
        if data is not None:
            data.set_state(self.ckpt.restore_data(step, self.data_fingerprints.get(str(step))))
        return state


def as_state(tree: Any) -> Any:
    from replay.record.nnx_step import as_state as nodes_state  # Flax only when given graph nodes

    return nodes_state(tree)


def _nnx_update(nodes: Any, state: Any) -> None:
    from flax import nnx

    from replay.record.nnx_step import _is_metric

    nodes = nodes if isinstance(nodes, (tuple, list)) else (nodes,)
    nnx.update(tuple(n for n in nodes if not _is_metric(n)), state)


def one_process(call: str) -> None:
    import jax

    if jax.process_count() > 1:  # orbax's JsonSave writes process 0's value only
        raise RecordError(f"{call}: a run of {jax.process_count()} processes has one data iterator per host, and "
                          "saving their states with the checkpoint is not supported yet; give the loop batch_at")
