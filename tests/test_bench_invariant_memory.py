"""bench/invariant_memory.py: the overrides every plan gets, and the 1/devices fit's verdict
(pure functions: no compile here; the plans themselves are `replay plan`'s, tested there)."""

import argparse

import pytest

from bench.invariant_memory import fit_inverse, overrides, summarize
from trainer.config import apply_overrides
from trainer.presets import get_preset

G = 1000  # gradient bytes of the synthetic plans


def _rows(temps_in_g: dict[int, float], states_in_g: dict[int, float] | None = None) -> dict:
    """Synthetic plans; the gradient state defaults to the trainer's shape with 64 microbatches
    (bit_length(64 / n) Counter shards of G / n, plus the reduced shard)."""
    states = states_in_g or {n: ((64 // n).bit_length() + 1) / n for n in temps_in_g}
    return {n: {"scatter": {"argument": 1, "temp": int(t * G), "total": 1, "grad_bytes": G,
                            "gradient_state": int(states[n] * G), "compile_s": 0.0}}
            for n, t in temps_in_g.items()}


def test_every_plan_asks_for_the_explicit_attention_and_user_overrides_come_last():
    sets = overrides(8, ["model.n_layers=1"])
    assert sets[0] == "model.attention=explicit" and sets[-1] == "model.n_layers=1"
    cfg = apply_overrides(get_preset("olmo-1b"), sets)  # olmo presets default to fused attention
    assert get_preset("olmo-1b").model.attention == "fused"
    assert cfg.model.attention == "explicit" and cfg.mesh.mesh_invariant
    assert (cfg.mesh.n_microbatches, cfg.data.global_batch_size) == (8, 8)


@pytest.mark.parametrize("power", [1, 2])
def test_the_fit_recovers_a_floor_and_a_slope(power):
    counts = [2, 4, 8, 64]
    f = fit_inverse(counts, [3.0 + 40.0 / n ** power for n in counts], power)
    assert f["a"] == pytest.approx(3.0) and f["b"] == pytest.approx(40.0)
    assert f["max_relative_residual"] == pytest.approx(0.0, abs=1e-12)


def test_the_verdict_is_true_for_shards_and_false_with_a_floor_that_does_not_shrink():
    args = argparse.Namespace(preset="tiny", microbatches=64, set=None)
    shards = summarize(_rows({n: 1.0 / n for n in (2, 4, 8, 64)}), args)
    assert shards["fit_temp_gradients"]["temp_scales_as_1_over_devices"] is True
    # today's shape (tiny, measured): M G / n^2 over a floor of about 2 G
    floored = summarize(_rows({n: 2.0 + 64.0 / n ** 2 for n in (2, 4, 8, 64)}), args)
    fits = floored["fit_temp_gradients"]
    assert fits["temp_scales_as_1_over_devices"] is False
    assert fits["a_plus_b_over_devices_squared"]["floor_a_gradients"] == pytest.approx(2.0, abs=1e-3)
    assert floored["per_device"]["64"]["temp_scatter_gradients"] == pytest.approx(2.016, abs=1e-3)
    assert floored["within_budget"] is True  # no reference plans: only the 3 G bound at the largest count
    assert summarize(_rows({2: 40.0, 64: 3.5}), args)["within_budget"] is False


def test_the_gradient_state_verdict_holds_for_shards_and_fails_for_a_state_that_does_not_shrink():
    """devices x state may not grow from one count to the next: the trainer's shape (faster than
    1/n at small counts) passes; the previous reduction's (at least the whole mean, G, on every
    device) fails it, and then the bench is not within budget."""
    args = argparse.Namespace(preset="tiny", microbatches=64, set=None)
    temps = {n: 1.5 + 3.0 / n for n in (2, 4, 8, 64)}
    shards = summarize(_rows(temps), args)
    assert shards["gradient_state_scales_as_1_over_devices"] is True and shards["within_budget"] is True
    assert shards["per_device"]["64"]["devices_x_gradient_state_gradients"] == pytest.approx(2.0, abs=0.02)
    assert shards["per_device"]["2"]["temp_minus_gradient_state_gradients"] == pytest.approx(3.0 - 3.5, abs=1e-2)
    whole = summarize(_rows(temps, {n: 1.0 + 1.0 / n for n in temps}), args)
    assert whole["gradient_state_scales_as_1_over_devices"] is False and whole["within_budget"] is False
    missing = _rows(temps)
    missing[8]["scatter"]["gradient_state"] = None  # a plan that did not report it cannot pass
    assert summarize(missing, args)["gradient_state_scales_as_1_over_devices"] is False
