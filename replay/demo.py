"""The demo: the data-loader bug that made a loss look better than it was, found in one command.

Run A trains the `demo` preset on the embedded corpus. Run B is the same run on a "new
cluster": from the middle step S on, its sampler lags and re-feeds batches it fed a few steps
earlier (the `data-repeat` fault, trainer/faults.py). Then `bisect` names the first divergent
step, the cause and the repeated examples, `audit` flags B from its own trace alone, and the
plot shows B's loss looking better than A's after S.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from replay.audit import audit
from replay.bisect import BisectReport, bisect
from replay.plot import metric_curve, plot_divergence
from traces import Run
from trainer.config import apply_overrides, get_preset
from trainer.faults import FaultPlan, Fault
from trainer.loop import StepInfo, train

DEFAULT_STEPS = 160


@dataclass
class DemoResult:
    run_a: Path
    run_b: Path
    plot: Path
    fault_step: int
    bisect: BisectReport
    audit_a_ok: bool
    audit_b_ok: bool
    audit_b_first: int | None
    audit_b_summary: str
    loss_a_after: float  # mean training loss of A over steps S..end
    loss_b_after: float
    batch_size: int
    seconds: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        b = self.bisect
        repeated = b.repeated("B")
        return {
            "run_a": str(self.run_a), "run_b": str(self.run_b), "plot": str(self.plot), "fault": f"data-repeat@{self.fault_step}",
            "first_step": b.comparison.first_step, "cause": b.cause,
            "examples_differing": len(b.comparison.first.positions or []) if b.comparison.first else 0,
            "already_seen_in_b": len(repeated),
            "first_seen_steps": sorted({s["step"] for e in repeated for s in e.seen if s["run"] == "B"}),
            "audit_a_ok": self.audit_a_ok, "audit_b_ok": self.audit_b_ok, "audit_b_first_repeat": self.audit_b_first,
            "loss_a_after": self.loss_a_after, "loss_b_after": self.loss_b_after, "seconds": self.seconds,
        }


def run_demo(out: Path, steps: int = DEFAULT_STEPS, on_phase: Callable[[str, int], None] | None = None,
             on_step: Callable[[StepInfo], None] | None = None) -> DemoResult:
    """Trains A and B under `out`, then bisects, audits and plots them."""
    import time

    phase = on_phase or (lambda name, total: None)
    out.mkdir(parents=True, exist_ok=True)
    cfg = apply_overrides(get_preset("demo"), [f"steps={steps}", f"checkpoint.every_steps={steps // 4}",
                                               f"optimizer.decay_steps={steps}",
                                               f"optimizer.warmup_steps={min(50, steps // 4)}"])
    fault_step = steps // 2
    seconds = {}
    t0 = time.perf_counter()
    phase("training run A (clean)", steps)
    train(cfg, out / "run-A", preset="demo", on_step=on_step)
    seconds["train_a"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    phase(f"training run B (data-repeat from step {fault_step})", steps)
    train(cfg, out / "run-B", preset="demo", on_step=on_step, faults=FaultPlan([Fault("data-repeat", fault_step)], cfg))
    seconds["train_b"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    phase("bisect, audit and plot", 0)
    run_a, run_b = Run.open(out / "run-A"), Run.open(out / "run-B")
    report = bisect(run_a, run_b)
    audit_a, audit_b = audit(run_a), audit(run_b)
    plot = plot_divergence(run_a, run_b, report.comparison.first_step, out / "divergence.png",
                           label_a="A (clean)", label_b="B (repeated data)")
    _, loss_a = metric_curve(run_a)
    _, loss_b = metric_curve(run_b)
    seconds["analyse"] = time.perf_counter() - t0
    return DemoResult(out / "run-A", out / "run-B", plot, fault_step, report, audit_a.ok, audit_b.ok,
                      audit_b.first_early_repeat_step, audit_b.summary(), float(np.mean(loss_a[fault_step:])),
                      float(np.mean(loss_b[fault_step:])), cfg.data.global_batch_size, {k: round(v, 1) for k, v in seconds.items()})
