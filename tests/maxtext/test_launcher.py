"""python -m replay.maxtext where MaxText resumes from its own checkpoint: the recording continues
the run only where MaxText restarts at the run's trace end; otherwise one line, exit 2. Runs in the
default venv (no MaxText: the launcher's checks, on a tiny run of the recording API's test loop);
the resume with MaxText itself is tests/maxtext/test_maxtext_seed.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from replay.maxtext import MaxTextError, RecordedMaxTextStep, main
from tests.replay.test_record_api import record


def _step(run_dir) -> RecordedMaxTextStep:
    return RecordedMaxTextStep(jitted=None, run_dir=run_dir, config=SimpleNamespace(), argv=[])


def test_a_resume_that_restarts_elsewhere_than_the_trace_end_is_refused(tmp_path):
    record(tmp_path / "a", steps=4, finish=True)  # the trace ends at step 4
    with pytest.raises(MaxTextError, match="MaxText resumed at step 2 .* recorded up to step 3"):
        _step(tmp_path / "a")._open(2)


def test_maxtext_starting_afresh_on_a_folder_holding_a_run_is_refused_naming_maxtexts_checkpoints(tmp_path):
    record(tmp_path / "a", steps=2, finish=True)
    with pytest.raises(MaxTextError, match="MaxText starts at step 0 .* run_name"):
        _step(tmp_path / "a")._open(0)


def test_a_resume_into_a_folder_without_the_run_is_refused(tmp_path):
    with pytest.raises(MaxTextError, match="holds no run to continue"):
        _step(tmp_path / "none")._open(4)


@pytest.mark.parametrize("argv", [["RUN", "--stop-at", "x", "base.yml"], ["RUN", "--stop-at", "3"]],
                         ids=["not-a-step", "no-maxtext-argv"])
def test_bad_launcher_arguments_are_one_line(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and ("--stop-at" in err[0]), err
