"""Errors of the run format.

Every message is one line that names the file (and step, where there is one) and says what
to do, because the CLI prints `str(error)` as the whole user-facing report.
"""

from __future__ import annotations


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
