"""One run of a compared pair, evaluated with its own framework's code.

A JAX trainer run is evaluated with the trainer (its checkpoint restored by orbax, verified
against the fingerprint recorded at save, the loss by trainer.step.loss_fn); a replay.torch run
of the trainer's reference with the reference (Hugging Face OLMo built by trainer.reference at
the run's config, its safetensors checkpoint loaded by replay.torch.checkpoint, verified against
the recorded xxh3). The eval loss is each example's mean next-token cross-entropy, in float32 as
the framework computes it, without z-loss or dropout; the two runs are compared on the same rows.

Cost: one checkpoint restored and one forward pass over the held-out rows per evaluated step.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import numpy as np

from replay.compare.errors import CompareInputError
from traces import Run


def framework_of(run: Run) -> str:
    return "torch" if run.manifest.get("recorded_by") == "replay.torch" else "jax"


def _trainer_config(run: Run) -> Any:
    from trainer.config import ConfigError, from_dict

    raw = run.manifest.get("config")
    if framework_of(run) == "torch" and isinstance(raw, dict) and "trainer_config" in raw:
        raw = raw["trainer_config"]  # trainer/reference_train.py's runs
    try:
        return from_dict(raw)
    except (ConfigError, TypeError, KeyError, AttributeError) as e:
        what = "a replay.torch run of trainer.reference" if framework_of(run) == "torch" else "a trainer run"
        raise CompareInputError(f"{run.path}: its manifest config is not a trainer config this version reads ({e}), so "
                                f"compare --eval cannot rebuild its model; it compares trainer runs and their reference "
                                f"runs ({what} recorded with config=trainer.config.to_dict(cfg))") from None


class JaxSide:
    framework = "jax"

    def __init__(self, run: Run):
        self.run, self.path = run, run.path
        self.cfg = _trainer_config(run)
        self._last: tuple[int, Any] | None = None

    def steps(self) -> list[int]:
        from trainer.checkpoint import Checkpointer

        if not self.run.checkpoint_dir.is_dir():
            return []
        return Checkpointer(self.run.checkpoint_dir, create=False).steps()

    def params_at(self, step: int) -> Any:
        """Checkpoint `step`'s parameters (the last one restored is kept: eval and the floor read it)."""
        if self._last is not None and self._last[0] == step:
            return self._last[1]
        from trainer import mesh as meshlib
        from trainer.checkpoint import Checkpointer, recorded_fingerprint
        from trainer.config import MeshConfig

        target = meshlib.sharded_abstract_state(self.cfg, meshlib.make_mesh(MeshConfig()))
        ckpt = Checkpointer(self.run.checkpoint_dir, create=False)
        try:
            state = ckpt.restore(step, target, fingerprint=recorded_fingerprint(self.run.manifest, step))
        finally:
            ckpt.close()
        self._last = (step, state.params)
        return state.params

    def losses(self, params: Any, rows: np.ndarray) -> np.ndarray:
        """float32 [N]: each row's mean cross-entropy under `params` (trainer layout), batch by batch."""
        import jax.numpy as jnp

        cfg = dataclasses.replace(self.cfg, model=dataclasses.replace(self.cfg.model, dropout=0.0))
        fn = _loss_program(cfg)
        out = [np.asarray(fn(params, jnp.asarray(chunk[:, :-1]), jnp.asarray(chunk[:, 1:])))
               for chunk in _chunks(rows, cfg.data.global_batch_size)]
        return np.concatenate(out).astype(np.float32)

    def eval(self, step: int, rows: np.ndarray) -> np.ndarray:
        return self.losses(self.params_at(step), rows)

    def hf_weights(self, step: int) -> dict[str, np.ndarray]:
        """The checkpoint's weights under the reference's names (for the float64 floor)."""
        import jax

        from trainer import reference

        return reference.to_hf(jax.tree.map(np.asarray, self.params_at(step)), self.cfg)


class TorchSide:
    framework = "torch"

    def __init__(self, run: Run):
        self.run, self.path = run, run.path
        self.cfg = _trainer_config(run)
        self._model = None

    def steps(self) -> list[int]:
        from replay.torch import checkpoint

        return checkpoint.steps(self.path)

    def hf_weights(self, step: int) -> dict[str, np.ndarray]:
        from replay.torch import checkpoint

        return {k: v.float().numpy() for k, v in checkpoint.read_model(self.path, step).items()}

    def eval(self, step: int, rows: np.ndarray) -> np.ndarray:
        from replay.torch import checkpoint
        from trainer import reference

        if self._model is None:
            self._model = reference.hf_model(_eval_model_config(self.cfg))
        checkpoint.load(self.path, step, self._model)
        return reference_losses(self._model, rows, self.cfg.data.global_batch_size)


@functools.lru_cache(maxsize=8)
def _loss_program(cfg: Any) -> Any:
    """The jitted per-row eval loss of the trainer for `cfg` (one per config: a pair's later
    compares reuse its compiled programs)."""
    import jax

    from trainer.step import loss_fn

    return jax.jit(lambda p, x, y: loss_fn(p, cfg, x, y, None, False)[1]["example_loss"])


def _eval_model_config(cfg: Any) -> Any:
    return dataclasses.replace(cfg.model, dropout=0.0)


def reference_losses(model: Any, rows: np.ndarray, batch: int, dtype: Any = None) -> np.ndarray:
    """[N] each row's mean next-token cross-entropy under the torch reference `model`, in the
    model's dtype (float32 losses as float32; a float64 model's as float64)."""
    import torch

    out = []
    model.eval()
    with torch.no_grad():
        for chunk in _chunks(rows, batch):
            t = torch.from_numpy(np.ascontiguousarray(chunk)).long()
            logits = model(t[:, :-1]).logits
            ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), t[:, 1:], reduction="none")
            out.append(ce.mean(dim=1).numpy())
    return np.concatenate(out)


def _chunks(rows: np.ndarray, batch: int):
    for i in range(0, len(rows), batch):
        yield rows[i:i + batch]


def open_side(path: str | Path) -> JaxSide | TorchSide:
    """The run at `path` as one side of a comparison; a damaged run is refused (one line, exit 2)
    even though only its checkpoints are evaluated: its manifest and trace are what name them."""
    from replay.bundle import damage_error, open_run

    run = open_run(path)  # a folder a bundle was unpacked to is checked as one
    damaged = damage_error(run, f"{path}: its trace", "compare its checkpoints once the run's files are restored "
                           "from a copy")
    if damaged:
        raise damaged
    return TorchSide(run) if framework_of(run) == "torch" else JaxSide(run)
