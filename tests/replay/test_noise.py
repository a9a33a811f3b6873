"""The noise floor: 1 vs 8 devices is noise only; one block in bfloat16 is far above it.

12 steps (tiny's schedule is fixed by its decay_steps, so these are the first 12 steps of its
20-step run, the same numbers) of tiny with one block (no claim here is about two; it compiles
faster): the fault at step 10 leaves 10 clean steps of 1 vs 8 noise. The same two clean runs show
what is bit-identical on 1 and 8 devices: the batches, the RNG words and the forward pass."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from replay.engine.noise import DEFAULT_FACTOR, floor_by_replay, judge
from traces import Run, compare
from trainer.config import apply_overrides
from trainer.presets import get_preset
from trainer.loop import train

ROOT = Path(__file__).resolve().parents[2]
STEPS = 12
SETS = ["model.n_layers=1", f"steps={STEPS}", "checkpoint.every_steps=5"]
FAULTY_BLOCK = "block_00"  # layer-bf16 computes block n_layers // 2 in bfloat16: the only one
pytestmark = pytest.mark.slow

# Both 8-device runs in one fresh process (the device count is set before JAX starts): `replay
# train` twice through the CLI, the second with the fault.
_TRAIN_TWICE = """
import sys
from typer.testing import CliRunner
from replay.cli.app import app
sets = [a for s in sys.argv[3:] for a in ("--set", s)]
for out, extra in ((sys.argv[1], []), (sys.argv[2], ["--inject", "layer-bf16@10"])):
    done = CliRunner().invoke(app, ["train", "--preset", "tiny", "--out", out, *sets, *extra])
    if done.exit_code != 0:
        sys.exit(f"{out}: exit {done.exit_code}: {done.output[-2000:]} {done.exception!r}")
"""


def train_on_8_devices(clean: Path, bf16: Path) -> tuple[Run, Run]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    proc = subprocess.run([sys.executable, "-c", _TRAIN_TWICE, str(clean), str(bf16), *SETS], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    runs = Run.open(clean), Run.open(bf16)
    assert [r.manifest["environment"]["device_count"] for r in runs] == [8, 8]
    assert runs[1].manifest["faults"] == ["layer-bf16@10"] and runs[0].manifest["faults"] == []
    return runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("noise")
    train(apply_overrides(get_preset("tiny"), SETS), root / "one")
    return Run.open(root / "one"), *train_on_8_devices(root / "eight", root / "eight-bf16")


@pytest.fixture(scope="module")
def floors(runs):
    return floor_by_replay(runs[0], 0, STEPS)


def test_one_and_eight_devices_feed_the_same_batches_keys_and_forward_bits(runs):
    """The inputs are the same bits on 1 and 8 devices, and so is tiny's forward at step 0: from 2
    examples per device XLA:CPU picks the same kernels (trainer/presets.py)."""
    one, eight, _ = runs
    for step in range(STEPS):
        a, b = one.trace.read(step), eight.trace.read(step)
        assert a.batch_hash == b.batch_hash and np.array_equal(a.example_hashes, b.example_hashes), step
        assert np.array_equal(a.rng, b.rng), step
    names = eight.schema.tensor_names
    forward = [i for i, (_, kind) in enumerate(eight.schema.tensors) if kind in ("state", "forward")]
    assert forward and one.schema.tensors == eight.schema.tensors
    a0, b0 = one.trace.read(0), eight.trace.read(0)
    assert [names[i] for i in forward if a0.fingerprints[i] != b0.fingerprints[i]] == []


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
    assert verdict.field == f"{FAULTY_BLOCK}.attn" and verdict.kind == "forward"
    assert verdict.ratio > 2 * DEFAULT_FACTOR


def test_a_plain_run_from_eight_devices_does_not_replay_bit_exactly_on_one(runs):
    """Without mesh-invariant mode the gradient sums follow the device count: `replay run` on 1
    device (this process) of the 8-device run is not bit-exact, and the report says the bits were
    not promised and gives distances. The negative control of tests/trainer/test_invariant_claims.py,
    whose mesh-invariant runs replay bit-exactly on other device counts through the same command."""
    from tests.cli_util import invoke

    _, eight, _ = runs
    assert "invariant_device_counts" not in eight.manifest
    out = invoke("run", str(eight.path), "--steps", "1:3")
    assert out.exit_code == 1, out.output
    assert "measured only" in out.stdout and "bit-exact" not in out.stdout
    assert "ulp" in out.stdout  # distances of the first mismatch


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
    assert verdict["above"] and (verdict["first_step"], verdict["field"]) == (10, f"{FAULTY_BLOCK}.attn")
