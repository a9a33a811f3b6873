"""Errors of the run format.

Every message is one line that names the file (and step, where there is one) and says what
to do, because the CLI prints `str(error)` as the whole user-facing report.
"""

from __future__ import annotations

import errno
import os


class TraceError(Exception):
    """Base of every error the run format raises on bad input or damaged data."""


class RunNotFoundError(TraceError):
    """The path does not exist."""


class NotARunError(TraceError):
    """The path exists but holds no run manifest."""


class NewerFormatError(TraceError):
    """The run was written by a newer format_version than this reader knows."""


class RunLockedError(TraceError):
    """Another live process is writing the run."""


class TraceCorruptError(TraceError):
    """Stored bytes fail their checksum or structure; names the file and the step."""

    def __init__(self, message: str, path: str | None = None, step: int | None = None):
        super().__init__(message)
        self.path = path
        self.step = step


class StepOrderError(TraceError):
    """An append would leave a gap, or rewrite a recorded step with different content."""


class SchemaError(TraceError):
    """A record does not fit the run's schema, or a schema is malformed."""


class ManifestCorruptError(TraceCorruptError):
    """run.json fails its checksum or structure: it was changed or damaged after recording."""


class ResumeDivergedError(StepOrderError):
    """A resumed run re-recorded a step with different content: it did not reproduce the run."""


class DiskFullError(TraceError):
    """The filesystem holding the run is full; everything before the record being written is intact."""

    def __init__(self, message: str, path: str | None = None, last_step: int | None = None):
        super().__init__(message)
        self.path = path
        self.last_step = last_step


DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def disk_full_message(path, doing: str, last_step: int | None, run, resume: str | None = None) -> str:
    """One line: the file, its filesystem, the last step fully recorded, and what to do (`resume`:
    the call that continues the run; default the trainer's command)."""
    where = _filesystem(path)
    recorded = f"every step up to {last_step} is recorded" if last_step is not None else "no step was recorded yet"
    return (
        f"{path}: no space left on {where} while {doing}; {recorded} and nothing before it is lost; "
        f"free space there, then {resume or f'`replay train --resume {run}`'} (it repairs the unfinished record and "
        "continues)"
    )


def _filesystem(path) -> str:
    """'the filesystem mounted at /mnt (device 8:1)', found by walking up to the mount point."""
    p = os.path.abspath(os.fspath(path))
    try:
        while not os.path.exists(p):
            p = os.path.dirname(p)
        dev = os.stat(p).st_dev
        while not os.path.ismount(p):
            p = os.path.dirname(p)
    except OSError:
        return "its filesystem"
    return f"the filesystem mounted at {p} (device {os.major(dev)}:{os.minor(dev)})"
