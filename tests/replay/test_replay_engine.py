"""`replay run`: re-run recorded steps from checkpoints and verify them bit for bit."""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest
from typer.testing import CliRunner

from replay.cli.app import app
from replay.engine.contract import evaluate
from replay.engine.engine import ReplayInputError, check_range, parse_steps, replay
from traces import Run
from trainer import rng
from replay.record.checkpointer import Checkpointer
from trainer.config import apply_overrides
from trainer.presets import get_preset
from trainer.data import Batcher, open_source, write_token_file
from trainer.loop import train
from trainer.replayable import TrainerReplay
from tests.cli_util import dir_digest

pytestmark = pytest.mark.slow
STEPS = 40


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """40 steps of tiny on a token file, checkpoints every 10."""
    root = tmp_path_factory.mktemp("replay")
    tokens = root / "tokens.bin"
    write_token_file(tokens, np.asarray(open_source("embedded:default").tokens[:60000]), "uint16")
    cfg = apply_overrides(get_preset("tiny"), [f"steps={STEPS}", f"data.source={tokens}", "checkpoint.every_steps=10"])
    train(cfg, root / "run")
    return root / "run", tokens, cfg


@pytest.fixture(scope="module")
def replayer(recorded):
    run = Run.open(recorded[0])
    return run, TrainerReplay(run)


def contract_here(run, rep):
    return evaluate(run.manifest["environment"], rep.environment(), run.manifest["program_hash"], rep.program_hash())


def test_range_replays_bit_exactly_and_nothing_in_the_run_changes(recorded, replayer):
    path = recorded[0]
    before = dir_digest(path)
    run, rep = replayer
    contract = contract_here(run, rep)
    assert contract.expect_bits, contract.differences
    report = replay(run, rep, 12, 31, contract)
    assert report.checkpoint == 10 and len(report.in_range) == 20
    assert all(s.exact for s in report.steps), report.first_mismatch
    assert dir_digest(path) == before


def test_every_step_replays_alone(replayer):
    run, rep = replayer
    contract = contract_here(run, rep)
    for step in range(12, 32):
        report = replay(run, rep, step, step, contract)
        assert report.exact and len(report.in_range) == 1, step


def test_cli_reports_20_of_20(recorded):
    path = recorded[0]
    before = dir_digest(path)
    result = CliRunner().invoke(app, ["run", str(path), "--steps", "12:31", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert (report["replayed"], report["bit_exact"], report["all_bit_exact"]) == (20, 20, True)
    assert report["contract"]["expect_bits"] is True
    assert dir_digest(path) == before


def test_a_flipped_parameter_bit_in_a_checkpoint_is_caught(recorded, tmp_path):
    """A checkpoint whose state is not the one saved is named as damaged (exit 2), never "a real
    divergence"; the same state with its own fingerprint recorded is caught by the trace (exit 1)."""
    from traces.run import write_manifest
    from replay.record.checkpoints import FINGERPRINTS_KEY
    from replay.record.fingerprint import state_fingerprint

    path, _, cfg = recorded
    copy = tmp_path / "run"
    shutil.copytree(path, copy, ignore=shutil.ignore_patterns(".lock"))
    run = Run.open(copy)
    rep = TrainerReplay(run)
    state = jax.device_get(rep.restore(20))
    state = jax.tree.map(np.array, state)
    state.params["block_01"]["mlp"]["up"]["kernel"].view(np.uint32)[2, 3] ^= 1 << 4
    shutil.rmtree(copy / "checkpoints" / "20")
    with Checkpointer(copy / "checkpoints") as ckpt:
        ckpt.save(20, state)
    damaged = CliRunner().invoke(app, ["run", str(copy), "--steps", "21:24", "--json"])
    assert damaged.exit_code == 2, damaged.output
    errors = [line for line in damaged.stderr.splitlines() if line.startswith("error: ")]  # after the status lines
    assert len(errors) == 1 and "checkpoint 20 is damaged" in errors[0], damaged.stderr
    assert "Traceback" not in damaged.output and "divergence" not in damaged.output and damaged.stdout == ""
    manifest = Run.open(copy).manifest
    manifest[FINGERPRINTS_KEY]["20"] = state_fingerprint(state)
    write_manifest(copy / "run.json", manifest)
    result = CliRunner().invoke(app, ["run", str(copy), "--steps", "21:24", "--json"])
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    first = report["first_mismatch"]
    assert first["step"] == 20 and first["warmup"] is True  # the first step after that checkpoint
    names = [f["name"] for f in first["fields"]]
    assert names[0] == "state/params"
    forward = [f["name"] for f in first["fields"] if f["kind"] == "forward"]
    assert forward[0] == "block_01.mlp"  # the layer that holds the flipped weight, nothing before it
    assert "param/block_01.mlp.up.kernel" in names


def test_a_changed_token_is_refused_then_located(recorded, tmp_path):
    path, tokens, cfg = recorded
    source = open_source(str(tokens))
    batcher = Batcher(source, cfg.model.seq_len, cfg.data.global_batch_size, rng.data_seed(cfg.seed))
    example = int(batcher.global_ids(25)[3])
    changed = np.array(source.tokens)
    changed[example * (cfg.model.seq_len + 1) + 5] ^= 1
    moved = tmp_path / "tokens.bin"
    write_token_file(moved, changed, "uint16")
    refused = CliRunner().invoke(app, ["run", str(path), "--steps", "21:26", "--data", str(moved)])
    assert refused.exit_code == 2 and "changed" in refused.stderr and len(refused.stderr.strip().splitlines()) == 1
    result = CliRunner().invoke(app, ["run", str(path), "--steps", "21:26", "--data", str(moved),
                                      "--allow-data-change", "--json"])
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["first_mismatch"]["step"] == 25
    data = report["first_mismatch"]["fields"][0]
    assert data["kind"] == "data" and data["positions"] == [3]


@pytest.mark.parametrize("steps, needle", [("35:45", "outside"), ("9:5", "A <= B"), ("x", "not A:B")])
def test_bad_ranges_are_refused(recorded, steps, needle):
    path = recorded[0]
    before = dir_digest(path)
    result = CliRunner().invoke(app, ["run", str(path), "--steps", steps])
    assert result.exit_code == 2, result.output
    assert needle in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert dir_digest(path) == before


def test_a_range_before_the_first_checkpoint_is_refused(recorded, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(recorded[0], copy, ignore=shutil.ignore_patterns(".lock"))
    shutil.rmtree(copy / "checkpoints" / "0")  # as if the run had kept only its later checkpoints
    before = dir_digest(copy)
    result = CliRunner().invoke(app, ["run", str(copy), "--steps", "5:8"])
    assert result.exit_code == 2 and "no checkpoint at or before step 5" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and dir_digest(copy) == before


def test_missing_data_source_is_refused(recorded, tmp_path):
    path = recorded[0]
    result = CliRunner().invoke(app, ["run", str(path), "--steps", "12", "--data", str(tmp_path / "gone.bin")])
    assert result.exit_code == 2 and "--data" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_parse_and_check_range_units(recorded):
    assert parse_steps("12:31") == (12, 31) and parse_steps("7") == (7, 7)
    run = Run.open(recorded[0])
    assert check_range(run, 12, 31, [0, 10, 20, 30, 40]) == 10
    assert check_range(run, 3, 5, [0, 10]) == 0
    with pytest.raises(ReplayInputError):
        check_range(run, 0, 3, [10])


def test_contract_lines():
    env = {"backend": "cpu", "device_kind": "cpu", "device_count": 1, "process_count": 1, "cpu_count": 2,
           "xla_flags": "", "versions": {"jax": "1"}, "random": {"jax_threefry_partitionable": True}}
    assert evaluate(env, env, "h", "h").expect_bits
    gpu = {**env, "backend": "gpu", "device_kind": "H100"}
    c = evaluate(env, gpu, "h", "g")
    assert not c.expect_bits and "backends" in c.line
    two = {**env, "device_count": 2}
    assert not evaluate(env, two, "h", "g").expect_bits
    assert evaluate(env, two, "h", "g", mesh_invariant=True, invariant_counts=(1, 2)).expect_bits
    flipped = {**env, "random": {"jax_threefry_partitionable": False}}
    assert evaluate(env, flipped, "h", "h").fatal
