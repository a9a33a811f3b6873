"""Checkpoints of a recorded run: orbax, checkpoint k = the state entering step k.

The run's own manager saves into RUN/checkpoints (or the user's CheckpointManager, given to
`replay.init(checkpoints=...)`, saves where it saves; the manifest records that folder). Every
save records `state_fingerprint(state)` (replay/record/fingerprint.py: every leaf's path, dtype, shape
and bits) in the manifest; every restore at replay recomputes it on device and refuses a state
that differs (orbax stores chunks without checksums, so only this catches a flipped bit).
Replay opens the folder read-only: nothing in the run changes.

A checkpoint saved with the data iterator's state (`run.save(k, state, data=it)`,
replay/record/data_iterator.py) is one orbax step of two items, as orbax users write it:
`ocp.args.Composite(state=StandardSave(state), data=JsonSave(it.get_state()))`, i.e. the folders
k/state and k/data; one saved without it is orbax's single item (k/default). `restore` reads the
state of either; `restore_data` the iterator state, checked against its recorded fingerprint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

FINGERPRINTS_KEY = "checkpoint_fingerprints"  # run manifest: {"<step>": "<16 hex>"}; the trainer writes the same key
STATE, DATA = "state", "data"  # the items of a checkpoint that holds the data iterator's state


def open_manager(path: Path, read_only: bool) -> Any:
    import orbax.checkpoint as ocp

    from replay.record.orbax_io import _quiet_orbax

    if read_only:
        options = ocp.CheckpointManagerOptions(read_only=True, create=False, save_interval_steps=0,
                                               save_root_metadata=False, cleanup_tmp_directories=False)
    else:
        options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False, save_interval_steps=1)
    with _quiet_orbax():  # orbax logs that read-only is read-only
        return ocp.CheckpointManager(Path(path).absolute(), options=options)


def directory_of(manager: Any) -> Path:
    return Path(str(manager.directory)).absolute()


def save(manager: Any, step: int, state: Any, data: dict | None = None) -> str:
    """Saves `state` (and `data`, an iterator state payload of replay/record/data_iterator.py, in
    the same orbax step) as checkpoint `step`, waits until it is on disk, returns the state's
    fingerprint."""
    import orbax.checkpoint as ocp

    from replay.record.orbax_io import CheckpointDiskFullError, _is_disk_full, _quiet_orbax, disk_of
    from replay.record.fingerprint import state_fingerprint

    fingerprint = state_fingerprint(state)  # before the save: the state may be donated to the next step
    args = (ocp.args.StandardSave(state) if data is None else
            ocp.args.Composite(**{STATE: ocp.args.StandardSave(state), DATA: ocp.args.JsonSave(data)}))
    try:
        with _quiet_orbax():
            manager.save(step, args=args, force=True)
            manager.wait_until_finished()
    except Exception as e:
        if _is_disk_full(e):
            raise CheckpointDiskFullError(f"{disk_of(directory_of(manager))} is full: checkpoint {step} could not "
                                          "be saved") from None
        raise
    return fingerprint


def steps(manager: Any) -> list[int]:
    from replay.record.orbax_io import _quiet_orbax

    with _quiet_orbax():
        manager.reload()
        return sorted(int(s) for s in manager.all_steps())


def restore(manager: Any, step: int, abstract_state: Any, fingerprint: str | None) -> Any:
    """Checkpoint `step` restored onto `abstract_state`, verified against `fingerprint`."""
    import orbax.checkpoint as ocp

    from replay.record.orbax_io import _WHAT_TO_DO, CheckpointDamagedError, CheckpointError, _quiet_orbax, _read_failure
    from replay.record.fingerprint import state_fingerprint

    where = directory_of(manager) / str(step)
    have = steps(manager)
    if step not in have:
        raise CheckpointError(f"{directory_of(manager)}: no checkpoint at step {step} (saved steps: "
                              f"{', '.join(map(str, have)) or 'none'})")
    composite = is_composite(manager, step)
    try:
        with _quiet_orbax():
            if composite:
                state = manager.restore(step, args=ocp.args.Composite(
                    **{STATE: ocp.args.StandardRestore(abstract_state)}))[STATE]
            else:
                state = manager.restore(step, args=ocp.args.StandardRestore(abstract_state))
    except Exception as e:  # noqa: BLE001 - orbax wraps TensorStore's errors in bare Exceptions
        raise CheckpointDamagedError(f"{where}: checkpoint {step} cannot be restored onto the loop's state "
                                     f"({_read_failure(e)}); {_WHAT_TO_DO}, or check that the Loop builds the "
                                     "state it was saved from") from None
    if fingerprint is not None:
        actual = state_fingerprint(state)
        if actual != fingerprint:
            raise CheckpointDamagedError(f"{where}: checkpoint {step} is damaged (its state's fingerprint {actual} "
                                         f"differs from {fingerprint} recorded when it was saved); {_WHAT_TO_DO}")
    return state


def is_composite(manager: Any, step: int) -> bool:
    """Whether checkpoint `step` was saved with a data iterator's state (the Composite layout)."""
    return (directory_of(manager) / str(step) / STATE).is_dir()


def has_data(manager: Any, step: int) -> bool:
    """Whether checkpoint `step` holds a data iterator's state."""
    return (directory_of(manager) / str(step) / DATA).is_dir()


def state_metadata(manager: Any, step: int) -> Any:
    """The saved state's tree of orbax ArrayMetadata (shape, dtype) in checkpoint `step`, of
    either layout; None when orbax cannot read it (a restore then says why)."""
    import orbax.checkpoint as ocp

    from replay.record.orbax_io import _quiet_orbax

    item = directory_of(manager) / str(step) / (STATE if is_composite(manager, step) else "default")
    try:
        with _quiet_orbax():
            meta = ocp.StandardCheckpointer().metadata(item)
    except Exception:  # noqa: BLE001 - unreadable metadata is the restore's to report
        return None
    return getattr(getattr(meta, "item_metadata", None), "tree", None)


def restore_data(manager: Any, step: int, fingerprint: str | None) -> Any:
    """The data iterator state saved with checkpoint `step` (what its `set_state` takes), verified
    against `fingerprint` (None: unverified)."""
    import orbax.checkpoint as ocp

    from replay.record import data_iterator
    from replay.record.orbax_io import _WHAT_TO_DO, CheckpointDamagedError, _quiet_orbax, _read_failure

    where = directory_of(manager) / str(step) / DATA
    if not has_data(manager, step):
        saved = ("it is missing" if is_composite(manager, step) else
                 "the checkpoint was saved without run.save(..., data=)")
        raise CheckpointDamagedError(f"{where}: checkpoint {step} holds no data iterator state ({saved}); "
                                     f"{_WHAT_TO_DO}")
    try:
        with _quiet_orbax():
            stored = manager.restore(step, args=ocp.args.Composite(**{DATA: ocp.args.JsonRestore()}))[DATA]
    except Exception as e:  # noqa: BLE001 - orbax raises bare Exceptions for unreadable items
        raise CheckpointDamagedError(f"{where}: the data iterator state of checkpoint {step} cannot be read "
                                     f"({_read_failure(e)}); {_WHAT_TO_DO}") from None
    if not data_iterator.well_formed(stored):
        raise CheckpointDamagedError(f"{where}: the data iterator state of checkpoint {step} is not one "
                                     f"run.save(..., data=) wrote; {_WHAT_TO_DO}")
    if fingerprint is not None and data_iterator.fingerprint(stored) != fingerprint:
        raise CheckpointDamagedError(f"{where}: the data iterator state of checkpoint {step} is damaged (its "
                                     f"fingerprint {data_iterator.fingerprint(stored)} differs from {fingerprint} "
                                     f"recorded when it was saved); {_WHAT_TO_DO}")
    return data_iterator.state_of(stored)
