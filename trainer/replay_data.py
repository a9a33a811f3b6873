"""The data side of the loop protocol, as the trainer implements it (see replay/protocol.py).

What replay's commands ask of a run's data through its replayable (the rows of a batch, the
token rows of an example, what was injected into a batch): mixed into
trainer.replayable.TrainerReplay, so the trainer answers exactly as any loop's replayable would.
"""

from __future__ import annotations


class TrainerDataProtocol:
    """Data capabilities of TrainerReplay (self.built, self.cfg, self.source are the trainer's)."""
