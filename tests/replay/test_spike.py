"""`replay spike`: the robust detector, the bad-batch fault, and the replayed analysis of one step.

The end-to-end tests train `tiny` (the demo preset takes minutes on CPU; the same claims were
checked by hand on demo, see the module docstring of replay/spike/__init__.py). tiny's loss still falls
steeply at step 65, so the bad-batch run is scanned with --window 10; the clean run shows no
spike at the default window and threshold, nor at --window 10.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from replay.cli.app import app
from replay.spike import DEFAULT_THRESHOLD, DEFAULT_WINDOW, rolling_scores
from traces import Run
from trainer import faults
from trainer.config import apply_overrides
from trainer.presets import get_preset
from trainer.data import Batch, example_hashes
from tests.cli_util import assert_one_line_error

ROOT = Path(__file__).resolve().parents[2]
STEPS, BAD = 80, 65
OVERRIDES = [f"steps={STEPS}", "checkpoint.every_steps=20"]
# The 4-device runs train one block: their claims (contract, bits, examples, replayed layers) need no
# second one, a block is most of a program's compile, and tests/trainer/test_invariant_claims.py
# compiles the same one-block programs at 4 and 1 devices (the session's XLA cache serves either).
ONE_BLOCK = ("--set", "model.n_layers=1")


def invoke(*args: str):
    return CliRunner().invoke(app, [str(a) for a in args])


def last_json(result) -> dict:
    return json.loads(result.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------------- fast: detector

def test_noise_has_no_spike_and_a_jump_is_one():
    rng = np.random.default_rng(0)
    loss = 2.0 + 0.05 * rng.standard_normal(400)
    _, _, score = rolling_scores(loss, DEFAULT_WINDOW)
    assert np.nanmax(score) < DEFAULT_THRESHOLD
    loss[300] += 1.0
    _, _, score = rolling_scores(loss, DEFAULT_WINDOW)
    assert [int(i) for i in np.nonzero(score >= DEFAULT_THRESHOLD)[0]] == [300]
    assert np.isnan(score[:DEFAULT_WINDOW]).all()


def test_falling_loss_is_not_a_spike_and_nan_always_is():
    loss = np.linspace(6.0, 2.0, 200)
    _, _, score = rolling_scores(loss, 20)
    assert np.nanmax(score) < 0
    loss[150] = np.nan
    _, _, score = rolling_scores(loss, 20)
    assert score[150] == np.inf and np.nanmax(np.delete(score, 150)) < 0  # the NaN is left out of later windows


def test_flat_loss_uses_the_relative_floor():
    loss = np.full(100, 3.0)
    loss[80] = 3.0 * (1 + 1e-4)  # a 0.01% wobble on a perfectly flat loss is not a spike
    _, spread, score = rolling_scores(loss, 20)
    assert spread[80] == pytest.approx(3e-3) and score[80] < 1


# ----------------------------------------------------------------------------------- fast: the fault

def test_bad_batch_parses_and_names_its_positions():
    assert faults.parse("bad-batch@7") == faults.Fault("bad-batch", 7)
    assert faults.bad_positions(16) == [3, 7, 11, 15]
    assert faults.bad_positions(8) == [3, 7] and faults.bad_positions(2) == [1]


def test_bad_batch_swaps_rows_only_at_its_step_and_rehashes_them():
    cfg = get_preset("tiny")
    plan = faults.FaultPlan([faults.parse("bad-batch@5")], cfg)
    rows = np.arange(16 * 33, dtype=np.int32).reshape(16, 33) % 250 + 1
    batch = Batch(rows[:, :-1], rows[:, 1:], example_hashes(rows), np.arange(16))
    assert plan.alter_batch(batch, 4, slice(0, 16)) is batch and plan.alter_batch(batch, 6, slice(0, 16)) is batch
    fed = plan.alter_batch(batch, 5, slice(0, 16))
    full = np.concatenate([fed.inputs_BxL[:, :1], fed.targets_BxL], axis=1)
    bad = [3, 7, 11, 15]
    assert (full[bad] == faults.BAD_TOKEN).all()
    assert np.array_equal(np.delete(full, bad, axis=0), np.delete(rows, bad, axis=0))
    assert np.array_equal(fed.example_hashes, example_hashes(full))  # hashes of what is really fed
    # Two hosts with half the batch each swap the same global positions.
    halves = [plan.alter_batch(Batch(rows[s, :-1], rows[s, 1:], example_hashes(rows[s]), np.arange(16)[s]), 5, s)
              for s in (slice(0, 8), slice(8, 16))]
    assert np.array_equal(np.concatenate([h.example_hashes for h in halves]), fed.example_hashes)


# ----------------------------------------------------------------------------------- slow: runs

@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """tiny, 80 steps, checkpoints every 20: a clean run and one with bad-batch at step 65; and a
    copy of the clean run whose checkpoints before step 40 are gone (as checkpoint.keep prunes them)."""
    from trainer.loop import train

    root = tmp_path_factory.mktemp("spike")
    cfg = apply_overrides(get_preset("tiny"), OVERRIDES)
    train(cfg, root / "clean", preset="tiny")
    train(cfg, root / "bad", preset="tiny", faults=faults.FaultPlan([faults.parse(f"bad-batch@{BAD}")], cfg))
    shutil.copytree(root / "clean", root / "pruned", ignore=lambda d, names: [
        n for n in names if n == ".lock" or (Path(d).name == "checkpoints" and n in ("0", "20"))])
    return root / "clean", root / "bad", root / "pruned"


@pytest.mark.slow
def test_scan_lists_the_injected_step_and_nothing_in_the_clean_run(runs):
    clean, bad, _ = runs
    assert Run.open(bad).manifest["faults"] == [f"bad-batch@{BAD}"]
    found = invoke("spike", bad, "--window", "10", "--json")
    assert found.exit_code == 0, found.output
    spikes = last_json(found)["spikes"]
    assert [s["step"] for s in spikes] == [BAD] and spikes[0]["score"] > 2 * DEFAULT_THRESHOLD
    for args in ((), ("--window", "10")):
        result = invoke("spike", clean, *args, "--json")
        assert result.exit_code == 0, result.output
        report = last_json(result)
        assert report["spikes"] == [] and report["max_score"]["score"] < DEFAULT_THRESHOLD / 2, (args, report)
    table = invoke("spike", bad, "--window", "10")
    assert table.exit_code == 0 and f"--step {BAD}" in table.stdout


@pytest.mark.slow
def test_step_replays_bit_exactly_and_names_the_injected_examples(runs, tmp_path):
    _, bad, _ = runs
    batch_file, png = tmp_path / "batch.npy", tmp_path / "spike.png"
    result = invoke("spike", bad, "--step", BAD, "--window", "10", "--save-batch", batch_file, "--plot", png, "--json")
    assert result.exit_code == 0, result.output
    report = last_json(result)
    replayed = report["replay"]
    assert replayed["checkpoint"] == 60 and replayed["all_bit_exact"] and replayed["contract"]["expect_bits"]
    assert replayed["warmup_bit_exact"] == BAD - 60 and replayed["bit_exact"] == 1
    injected = faults.bad_positions(16)
    assert report["injected_positions"] == injected
    top = report["examples"]
    assert sorted(e["position"] for e in top[:4]) == injected
    assert all(e["score"] > DEFAULT_THRESHOLD and e["seen_before"] is None for e in top[:4])
    assert sorted(top[0]["duplicates_in_batch"] + [top[0]["position"]]) == injected
    assert top[0]["first_tokens"][:4] == [faults.BAD_TOKEN] * 4 and top[0]["text"].startswith("\\x00×")
    assert sum(e["share_of_rise"] for e in top[:4]) > 0.8
    assert report["loss"]["score"] > DEFAULT_THRESHOLD and report["grad_norm"]["score"] > DEFAULT_THRESHOLD
    first = report["first_jump"]
    # The degenerate rows move the layers: with this data order the first jump is a forward output's
    # RMS dropping (a negative score), with others it was a gradient's rising.
    assert first is not None and first["kind"] in ("forward", "backward") and abs(first["score"]) >= DEFAULT_THRESHOLD
    assert report["layer_source"] == "recorded" and any(l["kind"] == "forward" for l in report["layers"])
    # The saved batch is what step 65 fed: its rows hash to the recorded example hashes.
    tokens = np.load(batch_file)
    recorded = Run.open(bad).trace.read(BAD)
    assert tokens.shape == (16, 33) and tokens.dtype == np.int32
    assert np.array_equal(example_hashes(tokens), recorded.example_hashes)
    assert (tokens[injected] == faults.BAD_TOKEN).all()
    assert png.stat().st_size > 10_000


@pytest.mark.slow
def test_the_data_only_view_rebuilds_the_fed_batches_and_names_the_injected_rows(runs):
    """replay/rundata.py, pack's and audit's way to a trainer run's data: nothing compiled."""
    from replay import rundata

    _, bad, _ = runs
    run = Run.open(bad)
    view = rundata.run_data(run)
    for step in range(BAD - 2, BAD + 2):
        assert np.array_equal(view.fed_hashes(step), run.trace.read(step).example_hashes), step
    assert view.injected_positions(BAD) == faults.bad_positions(16) and view.injected_positions(BAD - 1) == []
    assert (view.fed_rows(BAD)[faults.bad_positions(16)] == faults.BAD_TOKEN).all()


@pytest.mark.slow
@pytest.mark.parametrize("args, needles", [
    (("--step", "80"), ("outside", "0..79")),
    (("--step", "-1"), ("outside",)),
    (("--step", "32", "--window", "10", "--pruned"), ("no checkpoint at or before step 32", "40, 60, 80")),
    (("--step", "8", "--window", "10"), ("8 recorded steps before it", "--window 8")),
    (("--window", "80"), ("80 steps", "too few for a baseline")),
    (("--window", "2"), ("--window 2",)),
    (("--threshold", "0"), ("--threshold",)),
    (("--save-batch", "x.npy"), ("needs --step",)),
    (("--step", "65", "--save-batch", "x.txt"), (".npy",)),
])
def test_bad_input_is_one_line_and_exit_2(runs, args, needles):
    path = runs[2] if "--pruned" in args else runs[0]
    assert_one_line_error(invoke("spike", path, *[a for a in args if a != "--pruned"]), *needles)


def test_a_missing_run_is_one_line_and_exit_2(tmp_path):
    assert_one_line_error(invoke("spike", tmp_path / "nope"))


@pytest.mark.slow
def test_mesh_invariant_run_from_four_devices_replays_bit_exactly_on_one(tmp_path):
    """In mesh-invariant mode (trainer/invariant.py) the contract promises bits across device
    counts: the spike replay on 1 device matches the 4-device recording bit for bit. Layers are
    recorded every 4th step only, so step 25's layer RMS come from replaying it at the layer level.
    Both run in subprocesses: the mode pins XLA:CPU settings before JAX starts. (A plain-mode
    4-device run is not trained here: its contract, "measured only" for another device count, is
    tests/replay/test_contract.py's, and test_noise.py replays a plain 8-device run on 1.)"""
    path = tmp_path / "inv"
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PJRT_NPROC")}
    env["JAX_PLATFORMS"] = "cpu"
    cmd = [sys.executable, "-m", "replay.cli.app"]
    train = subprocess.run([*cmd, "train", "--preset", "tiny", "--steps", "28", *ONE_BLOCK, "--set", "checkpoint.every_steps=10",
                            "--set", "mesh.mesh_invariant=true", "--set", "mesh.n_microbatches=8",
                            "--set", "trace.layer_every=4", "--inject", "bad-batch@25", "--out", str(path)],
                           cwd=ROOT, capture_output=True, text=True,
                           env={**env, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"})
    assert train.returncode == 0, train.stderr
    assert Run.open(path).manifest["environment"]["device_count"] == 4
    spiked = subprocess.run([*cmd, "spike", str(path), "--step", "25", "--window", "10", "--json"], cwd=ROOT,
                            capture_output=True, text=True, env=env)
    assert spiked.returncode == 0, spiked.stderr
    report = json.loads(spiked.stdout.strip().splitlines()[-1])
    replayed = report["replay"]
    assert replayed["contract"]["expect_bits"] and replayed["all_bit_exact"], replayed
    assert replayed["checkpoint"] == 20 and replayed["warmup_bit_exact"] == 5
    assert sorted(e["position"] for e in report["examples"][:4]) == faults.bad_positions(16)
    assert report["layer_source"] == "replayed" and report["layers"] and report["first_jump"] is not None
