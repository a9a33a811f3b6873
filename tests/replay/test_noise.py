"""The noise floor: 1 vs 8 devices is noise only; one block in bfloat16 is far above it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from replay.noise import DEFAULT_FACTOR, floor_by_replay, judge
from traces import Run, compare
from trainer.config import apply_overrides, get_preset
from trainer.loop import train

ROOT = Path(__file__).resolve().parents[2]
STEPS = 20
SETS = [f"steps={STEPS}", "checkpoint.every_steps=5"]
pytestmark = pytest.mark.slow


def train_on_8_devices(out: Path, *extra: str) -> Run:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    args = [a for s in SETS for a in ("--set", s)]
    proc = subprocess.run([sys.executable, "-m", "replay.cli.app", "train", "--preset", "tiny", "--out", str(out),
                           *args, *extra], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return Run.open(out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("noise")
    train(apply_overrides(get_preset("tiny"), SETS), root / "one")
    return Run.open(root / "one"), train_on_8_devices(root / "eight"), \
        train_on_8_devices(root / "eight-bf16", "--inject", "layer-bf16@10")


@pytest.fixture(scope="module")
def floors(runs):
    return floor_by_replay(runs[0], 0, STEPS)


def test_one_vs_eight_devices_is_numerical_noise_only(runs, floors):
    one, eight, _ = runs
    assert not compare(one.trace, eight.trace).identical  # the bits do differ ...
    verdict = judge(one, eight, 0, STEPS, floors=floors[0], replays=floors[1])
    assert not verdict.above, verdict  # ... but only by rounding noise
    assert verdict.max_ratio_below < DEFAULT_FACTOR / 4


def test_a_bf16_block_is_far_above_the_floor_at_its_step_and_layer(runs, floors):
    one, _, bf16 = runs
    verdict = judge(one, bf16, 0, STEPS, floors=floors[0], replays=floors[1])
    assert verdict.above and verdict.first_step == 10
    assert verdict.field == "block_01.attn" and verdict.kind == "forward"
    assert verdict.ratio > 2 * DEFAULT_FACTOR


def test_bisect_reports_noise_only_and_above_the_floor(runs):
    import json

    from typer.testing import CliRunner

    from replay.cli.app import app

    one, eight, bf16 = runs
    noise = CliRunner().invoke(app, ["bisect", str(one.path), str(eight.path), "--json"])
    assert noise.exit_code == 0, noise.output  # differing bits the contract allows are not a divergence
    report = json.loads(noise.stdout.strip().splitlines()[-1])
    assert report["identical"] is False and report["bits_expected"] is False and report["noise_only"] is True
    real = CliRunner().invoke(app, ["bisect", str(one.path), str(bf16.path), "--json"])
    assert real.exit_code == 1, real.output
    verdict = json.loads(real.stdout.strip().splitlines()[-1])["noise"]
    assert verdict["above"] and (verdict["first_step"], verdict["field"]) == (10, "block_01.attn")
