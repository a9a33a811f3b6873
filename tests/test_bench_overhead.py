"""bench/overhead.py runs and prints its JSON (its timings are budgets, never tested here), and the
two things that keep layer-level recording cheap stay true: one fused pass per tensor gives the
reference fingerprint, and the layer-level step does not copy the donated training state."""

import json
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from traces.fingerprint import fingerprint
from trainer.config import get_preset
from replay.record.fingerprint import fingerprints_and_sums_of_squares, lanes_to_int
from trainer.step import compile_step, init_state

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # trains three levels and the example's three lanes in a new process
def test_overhead_bench_reports_every_level():
    out = subprocess.run(
        [sys.executable, "-m", "bench.overhead", "--preset", "tiny", "--rounds", "2", "--steps-per-round", "2",
         "--warmup-rounds", "1", "--set", "model.n_layers=1", "--api-set", "batch=4", "--api-set", "seq=8",
         "--api-set", "d_model=16", "--api-set", "layers=1", "--api-rounds", "2", "--sdc-rounds", "0"],
        cwd=ROOT, capture_output=True, text=True, check=True, timeout=600,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("step_overhead", "layer_overhead", "paired_step_overhead", "paired_layer_overhead",
                "cpu_step_overhead", "cpu_layer_overhead"):
        assert isinstance(result[key], float), key
    for key in ("median_off_s", "median_step_s", "median_layer_s", "median_cpu_off_s"):
        assert isinstance(result[key], float) and result[key] > 0, key
    assert (result["rounds"], result["steps_per_round"], result["warmup_rounds"]) == (2, 2, 1)
    assert result["preset"] == "tiny" and result["devices"] >= 1 and result["tensors_per_layer_record"] > 0
    assert (result["budget_step_overhead"], result["budget_layer_overhead"]) == (0.01, 0.03)
    assert isinstance(result["within_budget"], bool)
    assert result["identical_training"] is True  # the three levels trained bit-identically
    api = result["api"]  # the user loop through replay.init / run.step, measured in the same run
    assert api["loop"] == "examples/linen_lm.py" and api["config"]["d_model"] == 16 and api["rounds"] == 2
    for key in ("step_overhead", "layer_overhead", "paired_step_overhead", "paired_layer_overhead",
                "cpu_step_overhead", "cpu_layer_overhead"):
        assert isinstance(api[key], float), key
    assert (api["budget_step_overhead"], api["budget_layer_overhead"]) == (0.01, 0.03)
    assert api["identical_training"] is True  # wrapped or not, the example's step computed the same bits
    assert result["within_budget"] == (result["trainer_within_budget"] and api["within_budget"])


def test_overhead_bench_rejects_an_unknown_preset():
    out = subprocess.run([sys.executable, "-m", "bench.overhead", "--preset", "nope", "--rounds", "1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "nope" in out.stderr


def test_overhead_bench_rejects_an_unknown_example_field_before_measuring():
    out = subprocess.run([sys.executable, "-m", "bench.overhead", "--preset", "tiny", "--api-set", "nope=1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "nope" in out.stderr and out.stderr.count("\n") == 1


def test_fused_pass_gives_the_reference_fingerprint_and_sum_of_squares():
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((3, 5, 7)).astype(np.float32), rng.standard_normal(9).astype(ml_dtypes.bfloat16),
          rng.integers(-9, 9, (4, 4)).astype(np.int32), np.float32(-2.5), rng.random((2, 3)) < 0.5,
          np.zeros((0, 4), np.float32)]
    lanes, sum_sq = jax.jit(fingerprints_and_sums_of_squares)([jnp.asarray(x) for x in xs])
    assert lanes.shape == (len(xs), 2) and sum_sq.shape == (len(xs),)
    for i, x in enumerate(xs):
        assert lanes_to_int(lanes[i]) == fingerprint(x), i
        want = float(np.sum(np.asarray(x, np.float64) ** 2))
        assert abs(float(sum_sq[i]) - want) <= 1e-5 * max(want, 1.0), i


def test_layer_level_step_does_not_copy_the_donated_state():
    # Reading the incoming params/moments for the state fingerprints must happen before the update
    # overwrites them in place; if XLA cannot see that order it copies the whole state every step.
    cfg = get_preset("tiny")
    shape = (cfg.data.global_batch_size, cfg.model.seq_len)
    batch = {k: jax.ShapeDtypeStruct(shape, jnp.int32) for k in ("inputs", "targets")}
    state = jax.eval_shape(lambda: init_state(cfg))
    hlo = compile_step(cfg, "layer").lower(state, batch).compile().as_text()
    entry = hlo[hlo.index("\nENTRY"):]
    params = set(re.findall(r"^\s*(%\S+) = \S+ parameter\(", entry, re.M))
    copied = sum(int(np.prod([int(d) for d in dims.split(",") if d]))
                 for dims, src in re.findall(r"= \w+\[([0-9,]*)\]\S* copy\((%[^)]+)\)", entry) if src in params)
    state_elements = sum(x.size for x in jax.tree.leaves(state))
    assert copied < 0.01 * state_elements, (copied, state_elements)
