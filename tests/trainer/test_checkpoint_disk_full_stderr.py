"""A disk that fills while orbax writes a checkpoint in the background: `replay train` says so in
one `error:` line (exit 2), and nothing else reaches stderr but the command's own progress.

Orbax's writer threads log the failure through absl when it happens (three ERROR records with
~70-line tracebacks each, 212 lines), which is after `save(wait=False)` has returned and before
the next save waits for it; before issue 30 they went to the terminal. They print from threads
to the process's real stderr, so the command runs in a fresh process, as a user runs it. The full
disk is simulated where tests/trainer/test_checkpoint_integrity.py simulates it (orbax's write
of the array bytes raises ENOSPC once checkpoint 0 is complete); a real full tmpfs gave the same
212 lines and, fixed, the same single line.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from traces import Run

ROOT = Path(__file__).resolve().parents[2]

_TRAIN_ON_A_FULL_DISK = r"""
import sys
from pathlib import Path

import pytest

from tests.trainer.full_disk import full_after_checkpoint_0

out = Path(sys.argv[1])
full_after_checkpoint_0(pytest.MonkeyPatch(), out)  # checkpoint 0 is complete, 2 fails
from replay.cli.app import main
sys.argv = ["replay", "train", "--out", str(out), "--steps", "4", "--set", "checkpoint.every_steps=2"]
main()
"""


@pytest.mark.slow
def test_a_full_disk_during_an_async_orbax_save_is_one_stderr_line(tmp_path):
    path = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("REPLAY_DEBUG", "XLA_FLAGS")}
    done = subprocess.run([sys.executable, "-c", _TRAIN_ON_A_FULL_DISK, str(path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    errors = [l for l in lines if l.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], done.stderr[-3000:]
    for needle in ("no space left", "saving checkpoint 2", "every step up to 3 is recorded", f"--resume {path}"):
        assert needle in errors[0], errors[0]
    # Everything else is the command's own progress: its compile status line and its progress bar.
    others = [l for l in lines[:-1] if not (l.startswith("compiling the train step") or l.startswith("train run"))]
    assert others == [] and len(lines) <= 3, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "absl" not in done.stderr
    run = Run.open(path)  # intact: every step recorded, checkpoint 2's partial folder not listed
    assert run.status == "crashed" and run.trace.end == 4 and run.trace.damage == []
    assert run.manifest["checkpoints"] == [0] and sorted(run.manifest["checkpoint_fingerprints"]) == ["0"]
    assert sorted(p.name for p in (path / "checkpoints").iterdir() if p.name.isdigit()) == ["0"]


def test_the_quiet_kept_for_a_write_in_flight_ends_with_its_release():
    """Quiet sections open and close while an asynchronous write is in flight (steps(), the next
    save); absl is silenced until the last of them ends, then gets its own level back."""
    import logging

    from replay.record.orbax_io import _quiet_orbax, quiet_until_released

    absl = logging.getLogger("absl")
    before = absl.level
    absl.setLevel(logging.INFO)
    try:
        release = quiet_until_released()
        with _quiet_orbax():
            assert absl.level > logging.CRITICAL
        assert absl.level > logging.CRITICAL  # the write is still in flight
        release()
        release()  # idempotent: a second release does not unbalance the count
        assert absl.level == logging.INFO
    finally:
        absl.setLevel(before)
