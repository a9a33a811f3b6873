"""A full disk, then `replay train --resume` on the still-full disk (issue 30, 8).

The resume's first write is run.json (the resume's record); on a full disk it fails before the
trace writer opened, and the message used to count the steps this process had recorded: "no step
was recorded yet", on a run holding every step up to 3. It must name the last recorded step and
say the disk is still full, and leave the run as it was. Reproduced by hand on a 6 MiB tmpfs
filled with a file; here the full disk is injected (orbax's writes, then every fsync: ENOSPC)."""

from __future__ import annotations

import os

from tests.cli_util import invoke
from tests.trainer.full_disk import full_after_checkpoint_0, no_space
from traces import Run


def test_a_resume_on_the_still_full_disk_names_the_last_recorded_step(tmp_path, monkeypatch):
    path = tmp_path / "run"
    full_after_checkpoint_0(monkeypatch, path)
    first = invoke("train", "--out", str(path), "--steps", "4", "--set", "checkpoint.every_steps=2")
    assert first.exit_code == 2 and "every step up to 3 is recorded" in first.stderr, first.output
    manifest = (path / "run.json").read_bytes()

    monkeypatch.setattr(os, "fsync", no_space)  # still full: run.json cannot be replaced either
    result = invoke("train", "--resume", str(path))
    assert result.exit_code == 2, result.output
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and result.stderr.strip().splitlines()[-1] == errors[0], result.stderr
    line = errors[0]
    for needle in (f"{path}/run.json: no space left", "the disk is still full", "every step up to 3 is recorded",
                   f"`replay train --resume {path}`"):
        assert needle in line, line
    assert "no step was recorded" not in line
    assert "Traceback" not in result.output
    monkeypatch.undo()
    assert (path / "run.json").read_bytes() == manifest  # the old one is kept
    run = Run.open(path)
    assert run.status == "crashed" and run.trace.end == 4 and run.manifest["checkpoints"] == [0]
