"""One run of a compared pair, evaluated with its own framework's code.

A JAX run is evaluated through its replayable (replay.engine.replayer.open_replayable, any loop): its
checkpoint restored onto the run's layout by the replayable's `restore` (the trainer's verifies
it against the fingerprint recorded at save), each row's loss by the loop's optional
`evaluate(state, batch)` capability. A replay.torch run is evaluated with a PyTorch model of it
that an installed plugin gives (replay/plugins.py, the hook `torch_reference(run)` returning a
TorchReference; the trainer's covers its own runs and those of its reference, Hugging Face OLMo:
trainer/replay_reference.py), its safetensors checkpoint loaded by replay.torch.checkpoint,
verified against the recorded xxh3. The float32 noise floor of either side (floor.py) is measured
with that reference at the side's weights. The eval loss is each example's mean next-token
cross-entropy, in float32 as the framework computes it, without z-loss or dropout; the two runs
are compared on the same rows.

Cost: one checkpoint restored and one forward pass over the held-out rows per evaluated step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import numpy as np

from replay.compare.errors import CompareInputError
from replay.compare.floor import reference_losses, rounding_error
from traces import Run
from replay.bundle import open_run
from replay.engine.damage import damage_error
from replay.engine.protocol import local_run
from replay import plugins

EVALUATE = "evaluate"
HOOK = "torch_reference"


class TorchReference(Protocol):
    """What a plugin's `torch_reference(run)` returns: a PyTorch model of the run's model."""

    cfg: Any  # the run's config as the plugin reads it (compare reads cfg.model's sizes, cfg.data and cfg.seed)
    batch_size: int  # rows per forward pass

    def model(self) -> Any: ...  # a fresh torch.nn.Module, float32, eval mode: model(int64 [B, L]).logits -> [B, L, V]

    def load(self, model: Any, weights: dict[str, np.ndarray]) -> None: ...  # weights by the reference's names

    def weights(self, state: Any) -> dict[str, np.ndarray]: ...  # a JAX run's state (restore's) by those names


def framework_of(run: Run) -> str:
    return "torch" if run.manifest.get("recorded_by") == "replay.torch" else "jax"


def _reference(run: Run, why: str) -> TorchReference:
    ref = plugins.first_answer(HOOK, run)
    if ref is None:
        raise CompareInputError(f"{run.path}: compare --eval needs a PyTorch reference of the run's model {why}, and "
                                f"no installed replay plugin gives one for this run (a `replay.plugins` entry point "
                                f"with {HOOK}(run); the trainer's covers its runs and its reference's)")
    return ref


class JaxSide:
    framework = "jax"

    def __init__(self, run: Run, reference: TorchReference | None = None):
        from replay.engine.replayer import open_replayable

        self.run, self.path = run, run.path
        self.rep = None  # a run that saved no checkpoint has nothing to evaluate: steps() says so
        if run.checkpoint_dir.is_dir():
            self.rep = open_replayable(run)
            if getattr(self.rep, EVALUATE, None) is None:
                raise CompareInputError(f"{run.path}: replay compare --eval needs the run's loop to provide "
                                        f"{EVALUATE}(state, batch) -> float32 per-example losses "
                                        f"(replay.Loop({EVALUATE}=...)); its loop gives none")
        self.reference = reference or _reference(run, "to measure the float32 noise floor at its weights")
        self.cfg = self.reference.cfg
        self._last: tuple[int, Any] | None = None

    def steps(self) -> list[int]:
        return [] if self.rep is None else sorted(self.rep.checkpoint_steps())

    def state_at(self, step: int) -> Any:
        """Checkpoint `step` restored onto the run's layout (the last one restored is kept: eval
        and the floor read it)."""
        if self._last is None or self._last[0] != step:
            self._last = None  # the previous state's buffers go before the next restore
            self._last = (step, self.rep.restore(step))
        return self._last[1]

    def eval(self, step: int, rows: np.ndarray) -> np.ndarray:
        return np.asarray(self.rep.evaluate(self.state_at(step), rows), np.float32)

    def hf_weights(self, step: int) -> dict[str, np.ndarray]:
        """The checkpoint's weights under the reference's names (for the float64 floor)."""
        return self.reference.weights(self.state_at(step))

    def rounding_error(self, step: int, rows: np.ndarray) -> float:
        return rounding_error(self.reference, self.hf_weights(step), rows)


class TorchSide:
    framework = "torch"

    def __init__(self, run: Run):
        self.run, self.path = run, run.path
        self._files = local_run(run).path  # torch checkpoints are read as files: a remote run's local copy
        self.reference = _reference(run, "to evaluate its checkpoints with")
        self.cfg = self.reference.cfg
        self._model = None

    def steps(self) -> list[int]:
        from replay.torch import checkpoint

        return checkpoint.steps(self._files)

    def hf_weights(self, step: int) -> dict[str, np.ndarray]:
        from replay.torch import checkpoint

        return {k: v.float().numpy() for k, v in checkpoint.read_model(self._files, step).items()}

    def eval(self, step: int, rows: np.ndarray) -> np.ndarray:
        from replay.torch import checkpoint

        if self._model is None:
            self._model = self.reference.model()
        checkpoint.load(self._files, step, self._model)
        return reference_losses(self._model, rows, self.reference.batch_size)

    def rounding_error(self, step: int, rows: np.ndarray) -> float:
        return rounding_error(self.reference, self.hf_weights(step), rows)


def open_side(path: str | Path) -> Any:
    """The run at `path` as one side of a comparison; a damaged run is refused (one line, exit 2)
    even though only its checkpoints are evaluated: its manifest and trace are what name them.
    A JAX run no plugin gives a PyTorch reference for is a JAX loop's (replay/compare/jaxloop.py:
    its own evaluate and held-out batches, a floor measured with its own evaluate)."""
    from replay.compare.jaxloop import LoopSide

    run = open_run(path)  # a folder a bundle was unpacked to is checked as one
    damaged = damage_error(run, f"{path}: its trace", "compare its checkpoints once the run's files are restored "
                           "from a copy")
    if damaged:
        raise damaged
    if framework_of(run) == "torch":
        return TorchSide(run)
    reference = plugins.first_answer(HOOK, run)
    return LoopSide(run) if reference is None else JaxSide(run, reference)
