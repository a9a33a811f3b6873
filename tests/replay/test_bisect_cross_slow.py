"""Slow checks of the cross-framework bisect and of the distance sketch on real training tensors.

One 100-step pair serves both tests: a torch reference and a JAX run that records distance
sketches (trace.sketches), so the 100-step bisect reads both traces and replays nothing (the
replay path, for JAX runs without sketches: tests/replay/test_bisect_cross.py); the sketch-vs-
exact check replays the JAX run's first 20 steps (the schedule's decay_steps is apart from
Config.steps, so they are a 20-step run's) against a 20-step run with a 0.1% higher lr."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from trainer.presets import get_preset  # noqa: E402
from trainer.reference_train import jax_config, train_reference  # noqa: E402

pytestmark = pytest.mark.slow
LONG = 100  # steps of the clean pair
SHORT = 20  # steps of the sketch-vs-exact check


def _cfg(steps: int, sketches: bool = False, **optimizer):
    # One block: the claims are about the noise floor and the sketch, per tensor; a second block adds
    # tensors of the same kinds, a fifth of each compile and of every step on both sides.
    base = dataclasses.replace(get_preset("tiny"), model=dataclasses.replace(get_preset("tiny").model, n_layers=1))
    return jax_config(dataclasses.replace(base, steps=steps, optimizer=dataclasses.replace(base.optimizer, **optimizer),
                                          trace=dataclasses.replace(base.trace, sketches=sketches),
                                          checkpoint=dataclasses.replace(base.checkpoint, every_steps=0)))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A torch reference and a sketched JAX run, 100 steps from the same weights on the same data."""
    import torch

    from trainer.loop import train

    root = tmp_path_factory.mktemp("cross-slow")
    cfg = _cfg(LONG, sketches=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny reference's ops lose to a second thread on a shared CPU (2.4x the CPU time)
    try:
        train_reference(cfg, root / "torch", cfg.steps)
    finally:
        torch.set_num_threads(threads)
    train(cfg, root / "jax")
    return {"torch": root / "torch", "jax": root / "jax"}


def test_a_100_step_clean_pair_agrees_within_the_noise_floor_at_every_step(pair, monkeypatch):
    import replay.engine.replayer
    from replay.bisect import bisect
    from traces import Run

    replays = []

    def refuse(self, *a, **k):
        replays.append(a)
        raise AssertionError("the cross bisect replayed a run that records sketches")

    monkeypatch.setattr(replay.engine.replayer.Replayer, "__init__", refuse)
    report = bisect(Run.open(pair["torch"]), Run.open(pair["jax"]))
    assert report.source == "traces" and replays == [], (report.source, replays)
    assert report.within_noise, report.to_json()
    assert sorted(report.distances) == list(range(LONG))
    assert 0 < report.max_ratio < 1


def _tensors_by_step(run_path, steps: int, names: list[str]) -> list[dict[str, np.ndarray]]:
    """Every recorded tensor of a JAX trainer run at steps 0..steps-1, recomputed by replay."""
    from replay.bisect.cross_distance import _jax_tensors
    from replay.engine.recompute import _Side
    from replay.engine.replayer import Replayer
    from traces import Run

    r = Replayer("A", Run.open(run_path))
    _, state = r.state_at(0)
    out = []
    for k in range(steps):
        side = _Side(r, state, k)
        out.append(_jax_tensors(side, set(names)))
        state = side.after()[0]
    return out


def test_the_sketch_estimate_is_within_a_factor_of_2_of_the_exact_distance_for_every_tensor(pair, tmp_path):
    """The clean run's first 20 steps and a run with its learning rate 0.1% higher: every forward
    layer, gradient and parameter at every step, the distance estimated from the two tensors' device
    sketches (as a v2 record holds them) against the exact distance of the replayed tensors."""
    import jax

    from replay.record.fingerprint import sketch_and_norm
    from trainer import model
    from trainer.loop import train
    from traces.sketch import exact_relative_distance, relative_distance

    steps = SHORT
    train(_cfg(steps, lr=1.001e-3), tmp_path / "b")
    m = _cfg(steps).model
    names = (model.layer_names(m)[:] + [f"grad/{n}" for n in model.param_names(m)]
             + [f"param/{n}" for n in model.param_names(m)])
    ta, tb = _tensors_by_step(pair["jax"], steps, names), _tensors_by_step(tmp_path / "b", steps, names)
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
