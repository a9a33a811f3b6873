"""A training loop of its own (examples/optax_loop.py) records through `replay.init`, and the CLI
replays and bisects it: bit-exact replays, a tampered checkpoint or trace refused, bad input one
line, and injected bugs found at their step with their cause.

Recorded once per module (30 steps, checkpoints at 0, 10, 20, 30), plus two runs with a bug.
"""

from __future__ import annotations

import json
import os
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
from replay.record.recorder import to_record

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))  # the example is "installed": its module is importable by name
import optax_loop  # noqa: E402
from tests.cli_util import dir_digest  # noqa: E402

STEPS = 30


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


@pytest.fixture(scope="module")
def runs() -> dict[str, Path]:
    """clean, clean2, lr (lr_bump_at=17), refeed (refeed_at=23; a poisoned example at 26 too): the
    session's runs of the example, which tests/examples/test_optax_loop.py reads too (made once)."""
    from tests.examples import loops

    assert (loops.STEPS, loops.EVERY, loops.LR_AT, loops.REFEED_AT) == (STEPS, 10, 17, 23)
    return loops.shared_runs(optax_loop, ("clean", "clean2", "lr", "refeed"))


@pytest.fixture(scope="module")
def recorded(runs) -> Path:
    return runs["clean"]


def test_lines_only_for_replay_are_few():
    lines = [l for l in (EXAMPLES / "optax_loop.py").read_text().splitlines() if l.rstrip().endswith("# replay")]
    assert 0 < len(lines) <= 12, lines


def test_recorded_run_names_its_entry_point_by_module(recorded):
    run = Run.open(recorded)
    assert run.status == "complete" and run.trace.start == 0 and run.trace.end == STEPS
    assert run.manifest["replayable"] == "replay.record.replayable:from_run"
    assert run.manifest["entrypoint"] == "optax_loop:make" and "entrypoint_path" not in run.manifest
    assert run.manifest["checkpoints"] == [0, 10, 20, 30]
    assert sorted(run.manifest["checkpoint_fingerprints"], key=int) == ["0", "10", "20", "30"]
    assert run.manifest["record"]["batch_axis"] == 0 and run.manifest["config"]["steps"] == STEPS
    names = run.schema.tensor_names
    assert names[0] == "state/step" and "grad/dense_0.w" in names and "forward/dense_1" in names
    assert names[-1].startswith("update/")
    kinds = [k for _, k in run.schema.tensors]
    assert kinds == sorted(kinds, key=("state", "forward", "backward", "update").index)  # causal order
    assert run.schema.metric_names == ("loss", "grad_norm", "lr") and run.schema.example_metrics == ("loss",)
    rec = run.trace.read(0)
    assert rec.fingerprints is not None and len(rec.fingerprints) == len(names) and rec.rng.shape == (2,)


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


@pytest.mark.parametrize("steps", ["0", "29"])
def test_single_steps_and_the_tail_replay_exactly(recorded, steps):
    result = invoke("run", str(recorded), "--steps", steps, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["all_bit_exact"]


def test_a_replay_of_another_runs_trace_is_caught(runs, tmp_path):
    """The replay compares bits: the lr-bug run's trace with the clean run's code and checkpoints differs."""
    copy = tmp_path / "run"
    shutil.copytree(runs["clean"], copy)
    shutil.rmtree(copy / "trace")
    shutil.copytree(runs["lr"] / "trace", copy / "trace")
    result = invoke("run", str(copy), "--steps", "15:18", "--json")
    assert result.exit_code == 1, result.output
    first = json.loads(result.stdout)["first_mismatch"]
    assert first["step"] == 17 and first["fields"][0]["kind"] == "update"


def test_flipped_parameter_bit_in_a_checkpoint_is_refused(recorded, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(recorded, copy)
    loop = optax_loop.make(Run.open(copy).manifest["config"])
    mgr = ocp.CheckpointManager(copy / "checkpoints", options=ocp.CheckpointManagerOptions(
        enable_async_checkpointing=False))
    state = mgr.restore(20, args=ocp.args.StandardRestore(loop.state_shapes()))
    w = np.asarray(state.params["dense_1"]["w"]).copy()
    w.view(np.uint32)[3, 5] ^= 1 << 20
    state.params["dense_1"]["w"] = w
    mgr.delete(20)
    mgr.save(20, args=ocp.args.StandardSave(state), force=True)
    mgr.close()
    result = invoke("run", str(copy), "--steps", "21:23")
    assert result.exit_code == 2, result.output
    assert "checkpoint 20 is damaged" in result.stderr and "fingerprint" in result.stderr
    assert invoke("run", str(copy), "--steps", "12:15").exit_code == 0  # the other checkpoints stand


def test_a_changed_trace_record_is_refused(recorded, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(recorded, copy)
    segment = sorted((copy / "trace").glob("*.seg"))[0]
    # A bit in the middle of step 13's frame: a record the replay of 12..14 reads (a record it does
    # not read is found by `verify` and `audit`, and on opening only where the tail has no sidecar).
    from traces.segment import SegmentFile, walk_frames

    with SegmentFile(segment) as f:
        offsets = walk_frames(f, bodies=False).offsets
    data = bytearray(segment.read_bytes())
    data[(offsets[13] + offsets[14]) // 2] ^= 0x40
    segment.write_bytes(bytes(data))
    result = invoke("run", str(copy), "--steps", "12:14")
    assert result.exit_code == 2, result.output
    assert "damaged" in result.stderr


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


def test_bisect_names_the_learning_rate_bug_at_its_step(runs):
    result = invoke("bisect", str(runs["clean"]), str(runs["lr"]), "--json")
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert report["first_step"] == 17, report
    assert report["cause"] == "update", report
    op = report["refinement"]["op"]  # the schedule's `step == lr_bump_at`: the constant the config changed
    assert (op["op"], op["first_differing_input"]) == ("eq", None) and "optax_loop.py:" in op["where"], op


def test_bisect_names_a_refed_batch_as_data(runs):
    result = invoke("bisect", str(runs["clean"]), str(runs["refeed"]), "--json")
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert report["first_step"] == 23 and report["cause"] == "data", report


def test_bisect_of_identical_runs_exits_0(runs):
    result = invoke("bisect", str(runs["clean"]), str(runs["clean2"]), "--json")
    assert result.exit_code == 0, result.output


def test_to_record_takes_the_schemas_example_metric_names():
    metrics = {"loss": np.float32(1.5), "rng": np.array([1, 2], np.uint32), "example_acc": np.ones(4, np.float32)}
    hashes = np.arange(4, dtype=np.uint64)
    rec = to_record(Schema(4, 2, (("loss", "loss"),), example_metrics=("acc",)), 7, metrics, hashes)
    assert rec.example_metrics.shape == (1, 4) and rec.fingerprints is None
    assert to_record(Schema(4, 2, (("loss", "loss"),)), 7, metrics, hashes).example_metrics is None


@pytest.mark.slow
def test_script_records_and_cli_replays_in_fresh_processes(tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(EXAMPLES), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", "import optax_loop as o; o.train(o.Config(steps=12, checkpoint_every=5), "
                    f"{str(run)!r})"], check=True, capture_output=True, cwd=tmp_path, env=env)
    replayed = subprocess.run([sys.executable, "-m", "replay.cli.app", "run", str(run), "--steps", "6:11", "--json"],
                              capture_output=True, text=True, cwd=tmp_path, env=env)
    assert replayed.returncode == 0, replayed.stderr
    report = json.loads(replayed.stdout)
    assert report["checkpoint"] == 5 and report["bit_exact"] == 6 and report["all_bit_exact"]
