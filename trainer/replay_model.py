"""The model side of the loop protocol, as the trainer implements it (see replay/protocol.py).

What replay's commands ask of a run's model through its replayable (a step recomputed with every
intermediate, a tensor by its recorded name, the loss of a state on a batch): mixed into
trainer.replayable.TrainerReplay, so the trainer answers exactly as any loop's replayable would.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from trainer.recompute import TrainerRecomputation, eval_losses


class TrainerModelProtocol:
    """Model capabilities of TrainerReplay (self.built, self.cfg are the trainer's)."""

    # ---------------------------------------------------------------- refine, recompute, compare --eval
    # (replay/recompute.py, replay/bisect/refine.py, replay/bisect/cross_distance.py,
    # replay/compare/sides.py)

    def recompute_step(self, state: Any, step: int) -> Any:
        """Step `step` recomputed from `state` (the state entering it, as restore/step give it,
        before the run's faults) with every intermediate: a replay.recompute.StepRecomputation
        (trainer/recompute.py). Its inputs are exactly what the run's step program is fed (faults
        applied; a layer-bf16 fault's faulty config); its forward layers, block intermediates,
        loss and gradients come from separately jitted programs, computed on first use."""
        return TrainerRecomputation(self.built, state, step)

    def evaluate(self, state: Any, batch: np.ndarray) -> np.ndarray:
        """float32 [n]: each row's mean next-token cross-entropy under `state.params`, without
        z-loss or dropout. `batch`: int32 token rows [n, L+1] (inputs row[:-1], targets row[1:]),
        any n, evaluated data.global_batch_size rows at a time."""
        return eval_losses(self.cfg, state.params, batch)
