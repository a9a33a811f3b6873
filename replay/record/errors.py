"""The recording API's one error type."""

from __future__ import annotations


class RecordError(ValueError):
    """Bad input to the recording API (`replay.init`, `run.step`, `run.save`, a `replay.Loop`):
    one line that says what is wrong and what to do. Exit 2 when it reaches the CLI."""
