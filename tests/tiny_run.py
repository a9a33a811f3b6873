"""The `tiny` preset's own run, as `replay train --preset tiny` makes it (20 steps, checkpoints at
0, 10 and 20, trace level layer), trained once per test session for the files that read it:
tests/replay/test_corruption.py and tests/trainer/test_checkpoint_integrity.py each trained this
same run for themselves; tests/replay/test_bisect_checkpoints.py trained a 4-step one whose three
checkpoints served as these three do, and tests/trainer/test_train_nothing_to_do.py a 2-step one
(any complete run serves). Made in the session's shared folder under a file lock
(tests/torch/reference_pair.py's `shared`); readers copy it before they change anything in it.
"""

from __future__ import annotations

from pathlib import Path


def tiny_run() -> Path:
    from tests.torch.reference_pair import shared

    def make(out: Path) -> None:
        from trainer.loop import train
        from trainer.presets import get_preset

        train(get_preset("tiny"), out, preset="tiny")

    return shared("tiny-preset", make)
