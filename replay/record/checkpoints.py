"""Checkpoints of a recorded run: orbax, checkpoint k = the state entering step k.

The run's own manager saves into RUN/checkpoints (or the user's CheckpointManager, given to
`replay.init(checkpoints=...)`, saves where it saves; the manifest records that folder). Every
save records `state_fingerprint(state)` (trainer/fingerprint.py: every leaf's path, dtype, shape
and bits) in the manifest; every restore at replay recomputes it on device and refuses a state
that differs (orbax stores chunks without checksums, so only this catches a flipped bit).
Replay opens the folder read-only: nothing in the run changes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

FINGERPRINTS_KEY = "checkpoint_fingerprints"  # as trainer/checkpoint.py records them


def open_manager(path: Path, read_only: bool) -> Any:
    import orbax.checkpoint as ocp

    from trainer.checkpoint import _quiet_orbax

    if read_only:
        options = ocp.CheckpointManagerOptions(read_only=True, create=False, save_interval_steps=0,
                                               save_root_metadata=False, cleanup_tmp_directories=False)
    else:
        options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False, save_interval_steps=1)
    with _quiet_orbax():  # orbax logs that read-only is read-only
        return ocp.CheckpointManager(Path(path).absolute(), options=options)


def directory_of(manager: Any) -> Path:
    return Path(str(manager.directory)).absolute()


def save(manager: Any, step: int, state: Any) -> str:
    """Saves `state` as checkpoint `step`, waits until it is on disk, returns its fingerprint."""
    import orbax.checkpoint as ocp

    from trainer.checkpoint import CheckpointDiskFullError, _is_disk_full, _quiet_orbax, disk_of
    from trainer.fingerprint import state_fingerprint

    fingerprint = state_fingerprint(state)  # before the save: the state may be donated to the next step
    try:
        with _quiet_orbax():
            manager.save(step, args=ocp.args.StandardSave(state), force=True)
            manager.wait_until_finished()
    except Exception as e:
        if _is_disk_full(e):
            raise CheckpointDiskFullError(f"{disk_of(directory_of(manager))} is full: checkpoint {step} could not "
                                          "be saved") from None
        raise
    return fingerprint


def steps(manager: Any) -> list[int]:
    from trainer.checkpoint import _quiet_orbax

    with _quiet_orbax():
        manager.reload()
        return sorted(int(s) for s in manager.all_steps())


def restore(manager: Any, step: int, abstract_state: Any, fingerprint: str | None) -> Any:
    """Checkpoint `step` restored onto `abstract_state`, verified against `fingerprint`."""
    import orbax.checkpoint as ocp

    from trainer.checkpoint import (
        _WHAT_TO_DO, CheckpointDamagedError, CheckpointError, _quiet_orbax, _read_failure,
    )
    from trainer.fingerprint import state_fingerprint

    where = directory_of(manager) / str(step)
    have = steps(manager)
    if step not in have:
        raise CheckpointError(f"{directory_of(manager)}: no checkpoint at step {step} (saved steps: "
                              f"{', '.join(map(str, have)) or 'none'})")
    try:
        with _quiet_orbax():
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
