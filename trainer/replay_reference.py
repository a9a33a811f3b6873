"""The trainer's PyTorch reference (trainer/reference.py: Hugging Face OLMo at the trainer's sizes)
as `replay compare --eval` asks for it: replay.compare.sides.TorchReference, given to replay by the
trainer plugin's `torch_reference(run)` hook (trainer/plugin.py), for the trainer's own runs and
the replay.torch runs of its reference (trainer/reference_train.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from replay.engine.protocol import LEGACY_DEFAULT_FACTORY as TRAINER_FACTORY
from trainer.config import Config, ConfigError, from_dict
from trainer import reference


class TrainerReference:
    """The reference at a run's config: `cfg` (the trainer Config), `batch_size` (rows per forward
    pass: the run's global batch), `model()`, `load(model, weights)`, `weights(state)`."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.batch_size = cfg.data.global_batch_size
        self._m = dataclasses.replace(cfg.model, dropout=0.0)  # evaluation: no dropout

    def model(self) -> Any:
        """A fresh reference model at the run's sizes, float32, eval mode (its weights are
        replaced by `load`)."""
        return reference.hf_model(self._m)

    def load(self, model: Any, weights: dict[str, np.ndarray]) -> None:
        """Copies weights under the reference's names into `model`, bit for bit."""
        reference.load_into(model, weights, self._m)

    def weights(self, state: Any) -> dict[str, np.ndarray]:
        """A JAX trainer state's parameters (as TrainerReplay.restore gives it) under the
        reference's names."""
        import jax

        return reference.to_hf(jax.tree.map(np.asarray, state.params), self.cfg)


def for_run(run: Any) -> TrainerReference | None:
    """The reference of a trainer run or of a replay.torch run of the trainer's reference (its
    config under "trainer_config"); None for any other run. A run that is one of these but whose
    config this version cannot read is a ConfigError (one line)."""
    manifest = run.manifest
    raw = manifest.get("config")
    torch = manifest.get("recorded_by") == "replay.torch"
    if torch:
        if not (isinstance(raw, dict) and "trainer_config" in raw):
            return None
        raw = raw["trainer_config"]
    elif manifest.get("replayable", TRAINER_FACTORY) != TRAINER_FACTORY:
        return None  # another loop's run
    try:
        return TrainerReference(from_dict(raw))
    except (ConfigError, TypeError, KeyError, AttributeError) as e:
        what = "a replay.torch run of trainer.reference" if torch else "a trainer run"
        raise ConfigError(f"{run.path}: its manifest config is not a trainer config this version reads ({e}), so "
                          f"compare --eval cannot rebuild its model; it compares trainer runs and their reference "
                          f"runs ({what} recorded with config=trainer.config.to_dict(cfg))") from None
