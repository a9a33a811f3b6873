"""A disk that fills once checkpoint 0 is saved, injected where orbax writes array bytes (used in this
process by test_checkpoint_integrity.py and test_resume_disk_full.py, in a fresh one by
test_checkpoint_disk_full_stderr.py)."""

from __future__ import annotations

import errno
from pathlib import Path


def no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def full_after_checkpoint_0(monkeypatch, run: Path) -> None:
    """From now on, orbax's write of a checkpoint's arrays raises ENOSPC once RUN/checkpoints/0 exists.

    Saves never overlap, so checkpoint 0 is complete (renamed from its temporary folder) before the
    next one is written: the disk is full from then on."""
    from orbax.checkpoint._src.serialization import serialization

    real = serialization.async_serialize_from_host

    async def full_after_first_checkpoint(*args, **kwargs):
        if (Path(run) / "checkpoints" / "0").is_dir():
            no_space()
        return await real(*args, **kwargs)

    monkeypatch.setattr(serialization, "async_serialize_from_host", full_after_first_checkpoint)
