"""`replay train` asked to train nothing (issue 30, 7): a run of 0 steps, or a resume of a complete
run to a step count it already reached, is bad input: one `error:` line, exit 2, refused before
anything compiles or is written (the run folder unchanged byte for byte, COMPLETE marker included).

The session's 20-step tiny run (tests/tiny_run.py, shared with other files) is the complete run; the
tests only read it (each refusal is checked to leave it unchanged)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli_util import assert_one_line_error, dir_digest, invoke
from tests.tiny_run import tiny_run
from traces import Run
from trainer.config import ConfigError, apply_overrides
from trainer.presets import get_preset

STEPS = 20  # the tiny preset's


@pytest.fixture(scope="module")
def complete() -> Path:
    """The session's tiny run (tests/tiny_run.py), complete at STEPS steps: read only."""
    path = tiny_run()
    run = Run.open(path)
    assert run.status == "complete" and run.manifest["config"]["steps"] == STEPS
    return path


@pytest.mark.parametrize("args", [["--steps", "0"], ["--steps", "-3"], ["--set", "steps=0"]])
def test_a_new_run_of_no_steps_is_refused_and_nothing_is_created(tmp_path, args):
    out = tmp_path / "new"
    result = invoke("train", "--preset", "tiny", "--out", str(out), *args)
    assert_one_line_error(result, "at least 1 step", "--steps 1 or more")
    assert not out.exists()


def test_the_library_refuses_a_run_of_no_steps(tmp_path):
    from trainer.loop import prepare

    with pytest.raises(ConfigError, match="at least 1 step"):
        prepare(apply_overrides(get_preset("tiny"), ["steps=0"]), tmp_path / "new")
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("args", [[], ["--steps", str(STEPS)]])
def test_resuming_a_complete_run_to_the_steps_it_has_is_refused_unchanged(complete, args):
    before = dir_digest(complete)
    result = invoke("train", "--resume", str(complete), *args)
    assert_one_line_error(result, f"{complete} already has {STEPS} steps and is complete",
                          f"pass a larger --steps (more than {STEPS}) to continue it")
    assert dir_digest(complete) == before
    assert (complete / "COMPLETE").is_file() and Run.open(complete).status == "complete"


def test_resuming_with_steps_0_is_refused_unchanged(complete):
    before = dir_digest(complete)
    assert_one_line_error(invoke("train", "--resume", str(complete), "--steps", "0"), "at least 1 step")
    assert dir_digest(complete) == before
