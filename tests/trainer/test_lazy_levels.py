"""trainer/loop.py build: a run with trace.layer_every > 1 has a step-level and a layer-level program;
build compiles the recorded level's now and the other on first use (`replay spike` replays its
window at the layer level only), training compiles both before the run is written. Nothing is
compiled here: the step compiler the loop lowers through (trainer.step.compile_step, called by
trainer.mesh.lower_step) is swapped for a stand-in that says which level was lowered."""

from __future__ import annotations

import pytest

from trainer import loop, step
from trainer.config import apply_overrides
from trainer.presets import get_preset


class _Stub:
    def __init__(self, level: str, lowered: list[str]):
        self.level, self.lowered = level, lowered

    def lower(self, *args):
        self.lowered.append(self.level)
        return self

    def compile(self) -> str:
        return f"program:{self.level}"


@pytest.fixture
def lowered(monkeypatch) -> list[str]:
    seen: list[str] = []
    monkeypatch.setattr(step, "compile_step", lambda cfg, level, *a, **k: _Stub(level, seen))
    monkeypatch.setattr(loop, "program_hash", lambda lowered: f"hash:{lowered.level}")
    return seen


CFG = apply_overrides(get_preset("tiny"), ["model.n_layers=1", "trace.layer_every=4"])


def test_build_compiles_the_step_level_program_on_first_use(lowered):
    built = loop.build(CFG)
    assert lowered == ["layer"] and built.program_hash == "hash:layer"
    assert set(built.compiled) == {"layer", "step"} and "step" in built.compiled
    assert built.compiled[built.level(4)] == "program:layer" and lowered == ["layer"]
    assert built.compiled[built.level(5)] == "program:step" and lowered == ["layer", "step"]
    assert built.compiled["step"] == "program:step" and lowered == ["layer", "step"]  # kept
    with pytest.raises(KeyError):
        built.compiled["off"]


def test_training_compiles_every_level_before_it_starts(lowered):
    built = loop.build(CFG)
    before = built.compile_seconds
    loop._warm(built)
    assert sorted(lowered) == ["layer", "step"] and built.compile_seconds >= before
