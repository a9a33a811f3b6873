"""bench/replay_speed.py runs and prints its JSON (its timings are a budget, never tested here)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # each run compiles a train step and a replay step in a new process


def test_replay_speed_bench_reports_the_ratio_and_its_budget():
    # At the step level: the bench and its JSON do not depend on the level, and the step level's
    # programs (no per-tensor fingerprints) compile faster; the bench uses a compile cache of its own.
    out = subprocess.run([sys.executable, "-m", "bench.replay_speed", "--preset", "tiny", "--steps", "3", "--rounds", "2",
                          "--warmup-rounds", "0", "--set", "model.n_layers=1", "--set", "trace.level=step"],
                         cwd=ROOT, capture_output=True, text=True, check=True, timeout=600)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert (result["bench"], result["preset"], result["steps"], result["rounds"]) == ("replay_speed", "tiny", 3, 2)
    assert result["trace_level"] == "step"
    assert len(result["train_s"]) == len(result["replay_s"]) == 2 and min(result["train_s"] + result["replay_s"]) > 0
    ratio = result["replay_over_train"]
    assert isinstance(ratio, float) and ratio > 0 and result["replay_over_train_budget"] == 0.95
    assert result["all_bit_exact"] is True  # every replayed step matched the trace
    assert result["ok"] is (ratio >= 0.95)
    assert result["replay_steps_per_s"] / result["train_steps_per_s"] == pytest.approx(ratio, rel=1e-2)


def test_replay_speed_bench_rejects_an_unknown_preset():
    out = subprocess.run([sys.executable, "-m", "bench.replay_speed", "--preset", "nope"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [out.stderr.strip()] and "nope" in out.stderr
