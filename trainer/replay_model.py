"""The model side of the loop protocol, as the trainer implements it (see replay/protocol.py).

What replay's commands ask of a run's model through its replayable (a step recomputed with every
intermediate, a tensor by its recorded name, the loss of a state on a batch): mixed into
trainer.replayable.TrainerReplay, so the trainer answers exactly as any loop's replayable would.
"""

from __future__ import annotations


class TrainerModelProtocol:
    """Model capabilities of TrainerReplay (self.built, self.cfg are the trainer's)."""
