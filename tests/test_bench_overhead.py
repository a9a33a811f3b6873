"""bench/overhead.py runs and prints its JSON (its timings are budgets, never tested here), and the
two things that keep layer-level recording cheap stay true: one fused pass per tensor gives the
reference fingerprint, and the layer-level step does not copy the donated training state. And
bench/accelerator.py's run on the CPU, whose lanes are this bench's (see its test)."""

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
from trainer.config import apply_overrides
from trainer.presets import get_preset
from replay.record.fingerprint import fingerprints_and_sums_of_squares, lanes_to_int
from trainer.loop import build
from tests.test_bench_accelerator import bench as accelerator_bench

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
    assert result["identical_training"] is True  # the levels trained bit-identically, sketched lane included
    sketched = result["sketched_layer"]  # the layer level with trace.sketches=true (issue 34's budget)
    assert sketched["recorded_sketch_width"] > 0 and sketched["budget_overhead"] == 0.03
    assert isinstance(sketched["overhead"], float) and sketched["median_s"] > 0
    assert result["trainer_within_budget"] == (result["step_overhead"] <= 0.01 and result["layer_overhead"] <= 0.03
                                               and sketched["overhead"] <= 0.03)
    api = result["api"]  # the user loop through replay.init / run.step, measured in the same run
    assert api["loop"] == "examples/linen_lm.py" and api["config"]["d_model"] == 16 and api["rounds"] == 2
    for key in ("step_overhead", "layer_overhead", "paired_step_overhead", "paired_layer_overhead",
                "cpu_step_overhead", "cpu_layer_overhead"):
        assert isinstance(api[key], float), key
    assert (api["budget_step_overhead"], api["budget_layer_overhead"]) == (0.01, 0.03)
    assert api["identical_training"] is True  # wrapped or not, the example's step computed the same bits
    assert result["within_budget"] == (result["trainer_within_budget"] and api["within_budget"])


@pytest.mark.slow
def test_accelerator_bench_runs_every_part_on_the_cpu_with_tiny_sizes():
    """bench/accelerator.py on the CPU: the cross-backend pair is CPU against CPU, so its bits
    must be equal and its noise verdict "not above"; the no-copy check must hold for every level,
    in the HLO and in the buffers; the three levels must train identically. Here, after the
    overhead bench, because its lanes (bench/overhead.py's Lane, the same config) are the same
    programs: the compile cache serves them (tests/test_bench_accelerator.py has the rest)."""
    # One block on both sides: the pair's layer-level program is then the lanes' (one compile, not
    # two), and every program compiles in about half the time; no part needs a second block.
    one = "model.n_layers=1"
    done, r = accelerator_bench("--preset", "tiny", "--steps", "4", "--steps-per-round", "2",
                                "--set", one, "--pair-set", one)
    assert len(done.stdout.strip().splitlines()) == 1  # one JSON line; progress goes to stderr
    assert r["args"]["pair_set"] == [one] and r["lanes"]["overrides"][-1] == one
    assert r["errors"] == {} and r["complete"], r["errors"]
    assert r["environment"]["backend"] == "cpu"
    p = r["pair"]
    assert p["recorded_on"] == p["replayed_on"] == "cpu" and p["steps"] == 4
    assert p["identical_bits"] and p["noise"]["above"] is False and p["noise"]["replays"] == 1
    assert p["replay_run_on_cpu"]["exit_code"] == 0 and p["replay_run_on_cpu"]["all_bit_exact"]
    for level in ("off", "step", "layer"):
        nc = r["no_copy"][level]
        assert nc["hlo"]["in_place"] and nc["runtime"]["in_place"], (level, nc)
        assert nc["memory"]["alias"] == nc["hlo"]["donated_bytes"]
    m = r["mfu"]
    assert m["steps"] == 4 and m["median_step_s"] > 0 and m["tokens_per_step"] == 16 * 32
    assert m["peak_flops"] is None and m["mfu"] is None  # a CPU has no meaningful peak
    o = r["overhead"]
    assert o["identical_training"] and o["rounds"] == 2 and set(o["median_s"]) == {"off", "step", "layer"}
    assert "step_overhead" in o and o["budget_layer_overhead"] == 0.03


def test_overhead_bench_rejects_an_unknown_preset():
    out = subprocess.run([sys.executable, "-m", "bench.overhead", "--preset", "nope", "--rounds", "1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "nope" in out.stderr


def test_overhead_bench_refuses_a_config_that_refuses_sketches_naming_the_way_out():
    out = subprocess.run([sys.executable, "-m", "bench.overhead", "--preset", "tiny", "--set", "mesh.mesh_invariant=true",
                          "--set", "check.rerun_every=10", "--sdc-rounds", "0"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    assert "trace.sketches" in out.stderr and "--no-sketches" in out.stderr, out.stderr


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
    # The program is the one `replay train` runs (trainer.loop.build), and the layer lane's of the
    # bench run above (the same config: the persistent compile cache serves it).
    cfg = apply_overrides(get_preset("tiny"), ["model.n_layers=1", "trace.level=layer", "trace.layer_every=1"])
    built = build(cfg)
    state = built.abstract_sharded
    hlo = built.compiled["layer"].as_text()
    entry = hlo[hlo.index("\nENTRY"):]
    params = set(re.findall(r"^\s*(%\S+) = \S+ parameter\(", entry, re.M))
    copied = sum(int(np.prod([int(d) for d in dims.split(",") if d]))
                 for dims, src in re.findall(r"= \w+\[([0-9,]*)\]\S* copy\((%[^)]+)\)", entry) if src in params)
    state_elements = sum(x.size for x in jax.tree.leaves(state))
    assert copied < 0.01 * state_elements, (copied, state_elements)
