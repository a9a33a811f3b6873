"""The recording trainer end to end: killed and resumed, it records the uninterrupted run's bytes.

Tiny with one block (the claims are about the loop, not the model; it compiles faster). What 1
vs 8 devices record is tests/replay/test_noise.py's (the same batches, keys and forward bits;
the rest differs by noise only); what 2 processes record, tests/trainer/test_invariant_claims.py's
(every byte of the 1-device run, in mesh-invariant mode). The helpers here start those processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from traces import Run, compare
from trainer.config import apply_overrides
from trainer.presets import get_preset
from trainer.loop import train

ROOT = Path(__file__).resolve().parents[2]
STEPS = 30
OVERRIDES = ["checkpoint.every_steps=5", f"steps={STEPS}", "model.n_layers=1"]
CFG = apply_overrides(get_preset("tiny"), OVERRIDES)
pytestmark = pytest.mark.slow


def replay_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "replay.cli.app", *args]


def env(devices: int = 1) -> dict:
    e = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    e["JAX_PLATFORMS"] = "cpu"
    if devices > 1:
        e["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    return e


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ref") / "run"
    train(CFG, path, preset="tiny")
    return path


def trace_end(path: Path) -> int:
    try:
        return Run.open(path).trace.end
    except Exception:
        return 0


def start_and_kill_at(args: list[str], path: Path, kill_at: int) -> None:
    proc = subprocess.Popen(replay_cmd(*args), cwd=ROOT, env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    # Each look opens the run (~0.5 ms CPU): every 20 ms costs this process little while the trainer
    # starts, and still kills it steps before its end (it takes far longer to checkpoint and close).
    while trace_end(path) < kill_at and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, f"trainer ended before the kill point {kill_at}: {proc.stderr.read()}"
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def test_killed_and_resumed_run_records_the_same_trace(reference, tmp_path):
    path = tmp_path / "victim"
    kill_points = sorted(np.random.default_rng(3).choice(np.arange(3, STEPS - 2), size=3, replace=False).tolist())
    sets = [a for o in OVERRIDES for a in ("--set", o)]
    start_and_kill_at(["train", "--preset", "tiny", "--out", str(path), *sets], path, kill_points[0])
    for point in kill_points[1:]:
        assert Run.open(path).status == "crashed"
        start_and_kill_at(["train", "--resume", str(path)], path, point)
    done = subprocess.run(replay_cmd("train", "--resume", str(path), "--json"), cwd=ROOT, env=env(),
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    run, ref = Run.open(path), Run.open(reference)
    assert run.status == "complete" and run.trace.end == STEPS and not run.trace.damage
    result = compare(ref.trace, run.trace)
    assert result.identical and result.compared == (0, STEPS)
    # Record for record, the stored bytes are the same, not only the decoded fields.
    assert all(ref.trace.raw_frame(k) == run.trace.raw_frame(k) for k in range(STEPS))


def test_compare_catches_a_run_with_another_seed(reference, tmp_path):
    other = apply_overrides(CFG, ["seed=1", "steps=2"])
    train(other, tmp_path / "other")
    result = compare(Run.open(reference).trace, Run.open(tmp_path / "other").trace)
    assert not result.identical and result.first_step == 0 and result.first.kind == "data"


def test_batch_not_divisible_by_devices_is_refused(tmp_path):
    path = tmp_path / "bad"
    proc = subprocess.run(replay_cmd("train", "--preset", "tiny", "--out", str(path), "--set",
                                     "data.global_batch_size=12"), cwd=ROOT, env=env(8), capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "12" in proc.stderr
    assert not path.exists()
