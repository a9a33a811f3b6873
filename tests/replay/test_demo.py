"""`replay demo`, the README's main job, in a fresh process: it finds the real host-count bug
(run B resumed on 2 processes with the contiguous-per-host sampler, trainer/demo.py). It runs
the fewest steps the command takes (32: the resume at 16), so the test costs the compiles and
three processes' start, not minutes of training."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli_util import dir_digest, invoke
from traces import Run

ROOT = Path(__file__).resolve().parents[2]
STEPS = 16  # the fewest `replay demo` accepts
S = STEPS // 2  # the resume step


@pytest.mark.slow
def test_demo_names_the_step_the_cause_and_the_repeated_examples(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, "-m", "replay.cli.app", "demo", "--out", str(out), "--steps", str(STEPS), "--json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["sampler"] == "contiguous-per-host" and result["resume_step"] == S and result["processes"] == [1, 2]
    run_b = Run.open(out / "run-B")
    assert run_b.manifest["faults"] == [] and run_b.manifest["config"]["data"]["sampler"] == "contiguous-per-host"
    assert run_b.manifest["environment"]["process_count"] == 1  # trained to step S on one process ...
    assert run_b.manifest.get("resumes", [{}])[-1].get("process_count") == 2  # ... and resumed on two
    assert result["first_step"] == S and result["cause"] == "data"
    # Host 0 of 2 jumps to position S x 8 of its slice, which the one host fed at step S / 2 (A too):
    # half of the batch; host 1's half is new data, not A's either.
    assert result["examples_differing"] == 16 and result["already_seen_in_b"] == 8
    assert result["share_already_seen"] == 0.5 and result["first_seen_steps"] == [S // 2]
    assert result["audit_a_ok"] is True and result["audit_b_ok"] is False and result["audit_b_first_repeat"] == S
    assert result["audit_b_share_per_step"] == [0.5]  # every batch from the resume on
    assert result["loss_b_seen"] is not None and result["loss_b_new"] is not None
    assert Path(result["plot"]).stat().st_size > 10_000
    assert (out / "run-A" / "COMPLETE").exists() and (out / "run-B" / "COMPLETE").exists()
    # A second demo into the same folder is refused without --force (in this process: the refusal
    # comes before any training), and nothing is overwritten.
    before = dir_digest(out)
    again = invoke("demo", "--out", str(out))
    assert again.exit_code == 2 and "--force" in again.stderr, again.output
    assert dir_digest(out) == before
