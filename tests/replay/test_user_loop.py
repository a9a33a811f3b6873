"""A training loop that is not trainer/ (examples/optax_loop.py) records, and `replay run` verifies it.

Recorded once per module (30 steps, checkpoints at 0, 10, 20, 30); each test replays it, or a
copy of it with one bit of one checkpointed parameter flipped.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp
import pytest
from typer.testing import CliRunner

from replay.cli.app import app
from traces import Run, Schema
from trainer.recorder import to_record

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))
import optax_loop  # noqa: E402
from tests.cli_util import dir_digest

STEPS = 30


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Path:
    cfg = optax_loop.Config(steps=STEPS, checkpoint_every=10)
    return optax_loop.train(cfg, tmp_path_factory.mktemp("user_loop") / "run")


def test_recorded_run_names_its_own_replay_entry_point(recorded):
    run = Run.open(recorded)
    assert run.status == "complete" and run.trace.start == 0 and run.trace.end == STEPS
    assert run.manifest["replayable"] == "optax_loop:replayable"
    assert Path(run.manifest["replayable_path"]) == EXAMPLES
    assert run.manifest["checkpoints"] == [0, 10, 20, 30]
    rec = run.trace.read(0)
    assert rec.fingerprints is not None and len(rec.fingerprints) == len(run.schema.tensors)
    assert run.schema.tensor_names[:2] == ("state/dense_0/w", "state/dense_0/b")


def test_replay_is_bit_exact_and_changes_nothing(recorded):
    before = dir_digest(recorded)
    result = invoke("run", str(recorded), "--steps", "12:25", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["checkpoint"] == 10
    assert (report["replayed"], report["bit_exact"]) == (14, 14)
    assert (report["warmup_replayed"], report["warmup_bit_exact"]) == (2, 2)
    assert report["all_bit_exact"] and report["contract"]["expect_bits"]
    assert dir_digest(recorded) == before


@pytest.mark.parametrize("steps", ["0", "9", "29", "20:29"])
def test_single_steps_and_the_tail_replay_exactly(recorded, steps):
    result = invoke("run", str(recorded), "--steps", steps, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["all_bit_exact"]


def test_flipped_parameter_bit_in_a_checkpoint_is_named(recorded, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(recorded, copy)
    cfg = optax_loop.Config.from_dict(Run.open(copy).manifest["config"])
    # Edit the stored array: restore checkpoint 20, flip one bit of dense_1/w, save it back as 20.
    mgr = ocp.CheckpointManager(copy / "checkpoints", options=ocp.CheckpointManagerOptions(
        enable_async_checkpointing=False))
    state = mgr.restore(20, args=ocp.args.StandardRestore(optax_loop.abstract_state(cfg)))
    w = np.asarray(state.params["dense_1"]["w"]).copy()
    w.view(np.uint32)[3, 5] ^= 1 << 20
    state.params["dense_1"]["w"] = w
    mgr.delete(20)
    mgr.save(20, args=ocp.args.StandardSave(state), force=True)
    mgr.close()

    result = invoke("run", str(copy), "--steps", "21:23", "--json")
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    first = report["first_mismatch"]
    assert first["step"] == 20 and first["warmup"]  # the first step after the checkpoint
    names = [(f["kind"], f["name"]) for f in first["fields"]]
    assert names[0] == ("state", "state/dense_1/w")  # the restored state, named exactly
    assert [n for k, n in names if k == "forward"][0] == "dense_1"  # dense_0's output is untouched
    assert ("data", "example_hashes") not in names and ("rng", "rng") not in names
    assert report["mismatched_steps"] == [20, 21, 22, 23]

    text = invoke("run", str(copy), "--steps", "20")
    assert text.exit_code == 1 and "first mismatch: step 20" in text.stdout and "real divergence" in text.stdout


@pytest.mark.parametrize("args, needle", [
    (("--steps", "25:40"), "outside the recorded steps 0..29"),
    (("--steps", "12:5"), "A <= B"),
    (("--steps", "3", "--data", "x.bin"), "--data does not apply"),
])
def test_bad_input_is_one_line_and_exit_2(recorded, args, needle):
    result = invoke("run", str(recorded), *args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], result.stderr


def test_to_record_takes_the_schemas_example_metric_names():
    metrics = {"loss": np.float32(1.5), "rng": np.array([1, 2], np.uint32), "example_acc": np.ones(4, np.float32)}
    hashes = np.arange(4, dtype=np.uint64)
    rec = to_record(Schema(4, 2, (("loss", "loss"),), example_metrics=("acc",)), 7, metrics, hashes)
    assert rec.example_metrics.shape == (1, 4) and rec.fingerprints is None
    assert to_record(Schema(4, 2, (("loss", "loss"),)), 7, metrics, hashes).example_metrics is None


@pytest.mark.slow
def test_script_records_and_cli_replays_in_fresh_processes(tmp_path):
    run = tmp_path / "run"
    subprocess.run([sys.executable, str(EXAMPLES / "optax_loop.py"), "--out", str(run), "--steps", "12",
                    "--checkpoint-every", "5"], check=True, capture_output=True, cwd=tmp_path)
    replayed = subprocess.run([sys.executable, "-m", "replay.cli.app", "run", str(run), "--steps", "6:11", "--json"],
                              capture_output=True, text=True, cwd=tmp_path)
    assert replayed.returncode == 0, replayed.stderr
    report = json.loads(replayed.stdout)
    assert report["checkpoint"] == 5 and report["bit_exact"] == 6 and report["all_bit_exact"]
