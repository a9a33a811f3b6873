"""`replay train` refuses bad input with one line and exit 2, before touching any run."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from replay.cli.app import app
from traces import Run
from trainer.config import to_dict
from trainer.presets import get_preset
from trainer.data import write_token_file
from trainer.loop import make_schema
from tests.cli_util import assert_one_line_error, dir_digest


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


@pytest.fixture
def existing_run(tmp_path) -> Path:
    """A run directory made by the tiny preset (no steps needed to test refusals)."""
    cfg = get_preset("tiny")
    run = Run.create(tmp_path / "run", make_schema(cfg.data.global_batch_size, "step"), {"config": to_dict(cfg)})
    run.close()
    return tmp_path / "run"


def test_unknown_preset(tmp_path):
    assert_one_line_error(invoke("train", "--preset", "huge", "--out", str(tmp_path / "r")), "huge", "tiny")
    assert not (tmp_path / "r").exists()


def test_unknown_override_key(tmp_path):
    assert_one_line_error(invoke("train", "--out", str(tmp_path / "r"), "--set", "model.depth=3"), "model.depth")
    assert not (tmp_path / "r").exists()


def test_token_ids_beyond_the_vocabulary(tmp_path):
    tokens = tmp_path / "tokens.bin"
    write_token_file(tokens, np.arange(5000) % 1000, "uint16")
    result = invoke("train", "--out", str(tmp_path / "r"), "--set", f"data.source={tokens}")
    assert_one_line_error(result, "vocab")
    assert not (tmp_path / "r").exists()


def test_data_smaller_than_one_batch(tmp_path):
    tokens = tmp_path / "tokens.bin"
    write_token_file(tokens, np.arange(100) % 200, "uint16")
    assert_one_line_error(invoke("train", "--out", str(tmp_path / "r"), "--set", f"data.source={tokens}"), "batch")
    assert not (tmp_path / "r").exists()


def test_mesh_larger_than_the_machine(tmp_path):
    assert_one_line_error(invoke("train", "--out", str(tmp_path / "r"), "--set", "mesh.data=4"), "device")
    assert not (tmp_path / "r").exists()


def test_out_that_already_exists(existing_run):
    before = dir_digest(existing_run)
    assert_one_line_error(invoke("train", "--out", str(existing_run)), "--resume")
    assert dir_digest(existing_run) == before


def test_resume_of_a_missing_run(tmp_path):
    assert_one_line_error(invoke("train", "--resume", str(tmp_path / "nope")), "no such run")


def test_resume_with_a_different_config(existing_run):
    before = dir_digest(existing_run)
    result = invoke("train", "--resume", str(existing_run), "--preset", "tiny", "--set", "model.n_layers=3")
    assert_one_line_error(result, "model.n_layers")
    assert dir_digest(existing_run) == before


def test_resume_of_a_run_made_by_another_preset(existing_run):
    before = dir_digest(existing_run)
    assert_one_line_error(invoke("train", "--resume", str(existing_run), "--preset", "demo"), "was made with")
    assert dir_digest(existing_run) == before


def test_resume_with_fewer_steps_than_configured_is_refused(existing_run):
    # --steps on resume is the run's new total: it may grow, never shrink (config.steps stays 20).
    before = dir_digest(existing_run)
    assert_one_line_error(invoke("train", "--resume", str(existing_run), "--steps", "10"),
                          "--steps 10", "configured for 20 steps", "--steps 20 or more")
    assert dir_digest(existing_run) == before
    assert Run.open(existing_run).manifest["config"]["steps"] == 20


@pytest.fixture
def no_compile(monkeypatch):
    """Any compile is a failure: a refusal must come before it."""
    import trainer.loop

    def build(*args, **kwargs):
        raise AssertionError("compiled before refusing")

    monkeypatch.setattr(trainer.loop, "build", build)


def test_a_second_writer_is_refused_before_compiling(existing_run, no_compile):
    writer = Run.resume(existing_run)  # a live writer holds the run's lock
    try:
        before = dir_digest(existing_run)
        for args in (["--resume", str(existing_run)], ["--out", str(existing_run)]):
            result = invoke("train", *args)
            assert_one_line_error(result, "is being written by pid")  # one line: no status, no progress bar
        assert dir_digest(existing_run) == before
    finally:
        writer.close()
