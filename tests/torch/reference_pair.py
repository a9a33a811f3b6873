"""A torch-reference vs JAX-trainer pair for tests: same weights, same batches, AdamW both sides.

Interim: helper D's trainer.reference_train.train_reference replaces train_torch when it lands.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from trainer import data, reference, rng
from trainer.config import Config, get_preset, to_dict


def clean_config(steps: int = 20, every: int = 5, z_loss: float = 0.0, level: str = "layer") -> Config:
    base = get_preset("tiny")
    return dataclasses.replace(
        base, steps=steps, trace=dataclasses.replace(base.trace, level=level), model=dataclasses.replace(base.model, dropout=0.0),
        optimizer=dataclasses.replace(base.optimizer, decay_steps=max(steps, 10), warmup_steps=min(5, steps),
                                      z_loss=z_loss),
        checkpoint=dataclasses.replace(base.checkpoint, every_steps=every, keep=0))


def train_jax(cfg: Config, path: Path) -> Path:
    from trainer.loop import train

    train(cfg, path)
    return path


def train_torch(cfg: Config, path: Path) -> Path:
    """The reference from the trainer's initial params, on the trainer's batches, checkpointed
    where the trainer checkpoints (trainer/reference_train.py)."""
    from trainer.reference_train import train_reference

    return train_reference(cfg, path, cfg.steps)
