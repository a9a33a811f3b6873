"""`replay demo`, the README's main job, in a fresh process: it finds the planted data bug."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_demo_names_the_step_the_cause_and_the_repeated_examples(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, "-m", "replay.cli.app", "demo", "--out", str(out), "--steps", "48", "--json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["fault"] == "data-repeat@24"
    assert result["first_step"] == 24 and result["cause"] == "data"
    # Every example of B's batch at step 24 was fed by B one step earlier (and by A, at the same step).
    assert result["examples_differing"] == 16 and result["already_seen_in_b"] == 16
    assert result["first_seen_steps"] == [24 - 8]  # the broken sampler cycles over the 8 batches before 24
    assert result["audit_a_ok"] is True and result["audit_b_ok"] is False and result["audit_b_first_repeat"] == 24
    assert Path(result["plot"]).stat().st_size > 10_000
    assert (out / "run-A" / "COMPLETE").exists() and (out / "run-B" / "COMPLETE").exists()
    # A second demo into the same folder is refused without --force: nothing is overwritten.
    again = subprocess.run([sys.executable, "-m", "replay.cli.app", "demo", "--out", str(out)], cwd=ROOT,
                           capture_output=True, text=True)
    assert again.returncode == 2 and "--force" in again.stderr
