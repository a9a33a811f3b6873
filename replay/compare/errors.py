"""compare --eval's error: a pair it cannot evaluate (exit 2, one line saying what to do)."""

from __future__ import annotations

from replay.engine.engine import ReplayInputError


class CompareInputError(ReplayInputError):
    """Runs compare --eval cannot evaluate: no common checkpoints, another data source, a model it
    cannot rebuild, a step that is not a checkpoint of both."""
