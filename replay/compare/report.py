"""What `replay compare --eval` reports: per evaluated checkpoint the two runs' eval losses, their
difference and the tolerance the measured noise floor gives (EvalRow), and the comparison
(EvalComparison); which common checkpoints are evaluated (pick_steps). Both comparisons, the
trainer's with its PyTorch floor (replay/compare/__init__.py) and a JAX loop's with the weights-ulp
floor (jaxloop.py), report through these. Holds nothing that grows with the run.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from replay.compare.errors import CompareInputError
from replay.compare.floor import RULES, TORCH_FLOAT64


@dataclass
class EvalRow:
    step: int
    loss_a: float  # mean over the held-out rows of run A's per-row loss, A's framework
    loss_b: float
    difference: float  # loss_b - loss_a
    tolerance: float
    noise_a: float  # e_A: float32 rounding of the eval loss at A's weights (floor.py)
    noise_b: float

    @property
    def agree(self) -> bool:
        return abs(self.difference) <= self.tolerance


@dataclass
class EvalComparison:
    run_a: str
    run_b: str
    framework_a: str
    framework_b: str
    examples: int
    skipped_trained: int  # candidate rows left out because a run trained on them
    rows: list[EvalRow] = field(default_factory=list)
    floor: str = TORCH_FLOAT64  # the floor rule (floor.RULES)
    notes: list[str] = field(default_factory=list)

    @property
    def agree(self) -> bool:
        return all(r.agree for r in self.rows)

    @property
    def first_disagreement(self) -> int | None:
        return next((r.step for r in self.rows if not r.agree), None)

    def to_json(self) -> dict:
        return {"run_a": self.run_a, "run_b": self.run_b, "framework_a": self.framework_a,
                "framework_b": self.framework_b, "examples": self.examples, "skipped_trained": self.skipped_trained,
                "agree": self.agree, "first_disagreement": self.first_disagreement,
                "floor": self.floor, "tolerance_rule": RULES[self.floor], "notes": self.notes,
                "steps": [{**asdict(r), "agree": r.agree} for r in self.rows]}


def pick_steps(common: list[int], wanted: list[int] | None = None) -> list[int]:
    """`wanted` (each a checkpoint of both runs), or early / middle / late of the common ones:
    the first after step 0, the one nearest halfway, the last."""
    if wanted:
        missing = [k for k in wanted if k not in common]
        if missing:
            raise CompareInputError(f"step {missing[0]} is not a checkpoint of both runs (common: "
                                    f"{listing(common)}); pass --steps from those")
        return sorted(set(wanted))
    trained = [k for k in common if k > 0] or common
    early, late = trained[0], trained[-1]
    middle = min(trained, key=lambda k: (abs(k - (early + late) / 2), k))
    return sorted({early, middle, late})


def listing(steps: list[int], most: int = 10) -> str:
    if not steps:
        return "none"
    shown = ", ".join(map(str, steps[:most]))
    return shown + (f", ... ({len(steps)} in all)" if len(steps) > most else "")
