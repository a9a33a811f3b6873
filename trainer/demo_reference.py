"""`replay demo --reference torch`: a JAX port checked against its PyTorch reference, and a port bug found.

Three runs on the embedded corpus, all from the same initial weights (the trainer's init,
converted into the reference by trainer/reference.py) and the same batches:

1. the reference: Hugging Face transformers' OLMo trained with torch AdamW, recorded by
   replay.torch under the trainer's names (trainer/reference_train.py);
2. the JAX trainer with the same config: the cross-framework bisect must report it within the
   noise floor at every step, and `compare --eval` (where the reference saved checkpoints) that
   its checkpoints agree on held-out rows;
3. the JAX trainer with one port bug switched on (trainer/port_bugs.py; RoPE convention by
   default): bisect must name the first step and layer where it leaves the reference.

Nothing is downloaded and nothing is injected at run time: the bug is a config field of the
JAX side, as a port's would be a line of its code. Cost: three short trainings, two bisects.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from trainer.config import Config
from trainer.presets import get_preset
from trainer.port_bugs import PORT_BUGS, with_bug

DEFAULT_STEPS = 40
DEFAULT_BUG = "rope"
RUNS = ("reference-torch", "jax", "jax-port-bug")


def demo_config(steps: int) -> Config:
    """The tiny preset as the reference can be: no dropout; a z-loss so that "z-loss left out" is
    a bug one can pick; checkpoints at quarters for compare --eval; distance sketches recorded
    (trace.sketches), so both bisects read the distances from the traces instead of replaying
    the JAX run."""
    base = get_preset("tiny")
    every = max(1, steps // 4)
    return dataclasses.replace(
        base, steps=steps, model=dataclasses.replace(base.model, dropout=0.0),
        trace=dataclasses.replace(base.trace, sketches=True),
        optimizer=dataclasses.replace(base.optimizer, z_loss=1e-4, decay_steps=max(steps, base.optimizer.warmup_steps)),
        checkpoint=dataclasses.replace(base.checkpoint, every_steps=every, keep=0))


@dataclass
class ReferenceDemoResult:
    reference: Path
    port: Path
    buggy: Path
    bug: str
    bug_text: str
    steps: int
    clean: Any  # replay.bisect.cross.CrossReport of reference vs port
    buggy_report: Any  # ... of reference vs buggy port
    expected: dict  # where the bug should be found (trainer.port_bugs.PORT_BUGS)
    eval: Any = None  # replay.compare.EvalComparison of reference vs port (None: no torch checkpoints)
    seconds: dict = field(default_factory=dict)

    @property
    def found_as_expected(self) -> bool:
        b = self.buggy_report
        return (b.first_layer, b.cause) == (self.expected["first_tensor"], self.expected["kind"])

    def to_json(self) -> dict:
        c, b = self.clean, self.buggy_report
        return {
            "reference": str(self.reference), "port": str(self.port), "buggy_port": str(self.buggy),
            "steps": self.steps, "bug": self.bug, "bug_text": self.bug_text,
            "clean": {"within_noise": c.within_noise, "steps_examined": len(c.distances),
                      "max_ratio_to_floor": c.max_ratio, "inputs": c.inputs},
            "buggy": {"within_noise": b.within_noise, "first_step": b.first_step, "first_layer": b.first_layer,
                      "cause": b.cause, "ratio_to_floor": b.ratio, "first_op": getattr(b, "first_op", None)},
            "expected": self.expected, "found_as_expected": self.found_as_expected,
            "eval": None if self.eval is None else self.eval.to_json(),
            "seconds": self.seconds,
        }


@contextlib.contextmanager
def _torch_threads(n: int):
    """torch on `n` threads for the block. The tiny reference's ops are too small to gain from a
    second thread, and on a shared CPU its threads wait for each other: 40 recorded steps took
    64 s on torch's default 2 threads at load ~8, 12 s on one at load ~5 (2026-12-01)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run_reference_demo(out: Path, steps: int = DEFAULT_STEPS, bug: str = DEFAULT_BUG,
                       on_phase: Callable[[str, int], None] | None = None,
                       on_step: Callable[[Any], None] | None = None) -> ReferenceDemoResult:
    from replay.bisect import bisect
    from replay.torch import checkpoint as torch_checkpoint
    from traces import Run
    from trainer.loop import StepInfo, train
    from trainer.reference_train import train_reference

    cfg = demo_config(steps)
    buggy_cfg = with_bug(cfg, bug)  # a bad bug name is refused before anything trains
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / name for name in RUNS]
    seconds: dict[str, float] = {}

    def phase(name: str, total: int = 0) -> float:
        if on_phase is not None:
            on_phase(name, total)
        return time.perf_counter()

    t = phase("PyTorch reference", steps)
    with _torch_threads(1):
        train_reference(cfg, paths[0], steps, on_step=None if on_step is None else (
            lambda k, loss: on_step(StepInfo(step=k, total=steps, loss=loss, tokens_per_s=0.0, mfu=None))))
    seconds["reference"] = round(time.perf_counter() - t, 1)
    t = phase("JAX trainer", steps)
    train(cfg, paths[1], on_step=on_step)
    seconds["jax"] = round(time.perf_counter() - t, 1)
    t = phase("bisect reference vs JAX")
    clean = bisect(Run.open(paths[0]), Run.open(paths[1]))
    seconds["bisect_clean"] = round(time.perf_counter() - t, 1)
    evaluation = None
    if torch_checkpoint.steps(paths[0]):
        from replay.compare import compare_eval

        t = phase("compare --eval")
        with _torch_threads(1):
            evaluation = compare_eval(paths[0], paths[1])
        seconds["compare_eval"] = round(time.perf_counter() - t, 1)
    t = phase(f"JAX port with bug: {bug}", steps)
    train(buggy_cfg, paths[2], on_step=on_step)
    seconds["jax_bug"] = round(time.perf_counter() - t, 1)
    t = phase("bisect reference vs buggy port")
    buggy = bisect(Run.open(paths[0]), Run.open(paths[2]))
    seconds["bisect_bug"] = round(time.perf_counter() - t, 1)
    b = PORT_BUGS[bug]
    return ReferenceDemoResult(paths[0], paths[1], paths[2], bug, b.what, steps, clean, buggy,
                               {"first_tensor": b.first_tensor, "kind": b.kind}, evaluation, seconds)
