"""The data's user-facing error, shared by the sources and batches (trainer/data.py) and the
orderings they draw from (trainer/order.py), which data.py imports: it lives below both."""

from __future__ import annotations

from replay.errors import InputError


class DataError(ValueError, InputError):
    """A user-facing problem with the data: the message says what to do."""
