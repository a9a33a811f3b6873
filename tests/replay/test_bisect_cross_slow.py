"""Slow checks of the cross-framework bisect and of the distance sketch on real training tensors."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from trainer.config import get_preset  # noqa: E402
from trainer.reference_train import jax_config, train_reference  # noqa: E402

pytestmark = pytest.mark.slow


def _cfg(steps: int, **optimizer):
    base = get_preset("tiny")
    return jax_config(dataclasses.replace(base, steps=steps, optimizer=dataclasses.replace(base.optimizer, **optimizer),
                                          checkpoint=dataclasses.replace(base.checkpoint, every_steps=0)))


def test_a_100_step_clean_pair_agrees_within_the_noise_floor_at_every_step(tmp_path):
    from replay.bisect import bisect
    from traces import Run
    from trainer.loop import train

    cfg = _cfg(100)
    train_reference(cfg, tmp_path / "torch", cfg.steps)
    train(cfg, tmp_path / "jax")
    report = bisect(Run.open(tmp_path / "torch"), Run.open(tmp_path / "jax"))
    assert report.within_noise, report.to_json()
    assert sorted(report.distances) == list(range(100))
    assert 0 < report.max_ratio < 1


def _tensors_by_step(run_path, steps: int, names: list[str]) -> list[dict[str, np.ndarray]]:
    """Every recorded tensor of a JAX trainer run at steps 0..steps-1, recomputed by replay."""
    from replay.bisect.cross_distance import _jax_tensors
    from replay.recompute import _Side
    from replay.replayer import Replayer
    from traces import Run

    r = Replayer("A", Run.open(run_path))
    _, state = r.state_at(0)
    out = []
    for k in range(steps):
        side = _Side(r, state, k)
        out.append(_jax_tensors(side, side.cfg, set(names)))
        state = side.after()[0]
    return out


def test_the_sketch_estimate_is_within_a_factor_of_2_of_the_exact_distance_for_every_tensor(tmp_path):
    """A clean run and one with its learning rate 0.1% higher, 20 steps: every forward layer,
    gradient and parameter at every step, the distance estimated from the two tensors' device
    sketches (as a v2 record holds them) against the exact distance of the replayed tensors."""
    import jax

    from replay.record.fingerprint import sketch_and_norm
    from trainer import model
    from trainer.loop import train
    from traces.sketch import exact_relative_distance, relative_distance

    steps = 20
    train(_cfg(steps), tmp_path / "a")
    train(_cfg(steps, lr=1.001e-3), tmp_path / "b")
    m = _cfg(steps).model
    names = (model.layer_names(m)[:] + [f"grad/{n}" for n in model.param_names(m)]
             + [f"param/{n}" for n in model.param_names(m)])
    ta, tb = _tensors_by_step(tmp_path / "a", steps, names), _tensors_by_step(tmp_path / "b", steps, names)
    sk = jax.jit(lambda x: sketch_and_norm(x, 64))
    checked = off = 0
    worst = 1.0
    for k in range(steps):
        for n in names:
            exact = exact_relative_distance(ta[k][n], tb[k][n])
            (sa, na), (sb, nb) = sk(ta[k][n]), sk(tb[k][n])
            est = float(relative_distance(np.asarray(sa), np.asarray(na), np.asarray(sb), np.asarray(nb)))
            if exact == 0:
                assert est == 0, (k, n, est)
                continue
            checked += 1
            ratio = est / exact
            worst = max(worst, ratio, 1 / ratio if ratio > 0 else np.inf)
            off += not (0.5 <= ratio <= 2)
    assert checked > 10 * len(names), checked  # most tensors differ (lr acts from step 1)
    assert off == 0, f"{off} of {checked} estimates off by more than 2x (worst {worst:.2f}x)"
