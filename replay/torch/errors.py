"""replay.torch's error type: a RecordError (exit 2), one line saying what is wrong and what to do."""

from __future__ import annotations

from replay.record.errors import RecordError


class TorchRecordError(RecordError):
    """Bad input to the PyTorch recorder (`replay.torch.init`, `run.step`, `rec.metrics`)."""
