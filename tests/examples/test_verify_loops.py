"""`replay verify --steps A:B` on runs of the four example loops and of `replay train --preset tiny` (one block)
(issue 31): each re-run on rotated devices and compared shard by shard (replay/verify/rotation.py).

One fresh 4-device process (tests/examples/verify_probe.py) records and verifies; this judges its
reports. On every loop: the clean run verifies clean (exit 0); with one chip returning every
result with a flipped bit the same range exits 1 naming that chip and no other; the clean run's
code and checkpoints with a trace that no re-execution reproduces exit 1 with a "trace" finding at
the first step the traces differ (what a fault in training alone leaves), naming no device.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.examples.verify_probe import BAD_DEVICE, CHANGED_AT, EXAMPLES

ROOT = Path(__file__).resolve().parents[2]
LOOPS = EXAMPLES + ("tiny",)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("verify-loops")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PJRT_NPROC")}
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-m", "tests.examples.verify_probe", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "results.json").read_text())


def _report(results: dict, loop: str, case: str, code: int) -> dict:
    got = results[loop][case]
    assert got["exit"] == code, (loop, case, got["exit"], got["stderr"])
    report = got["report"]
    assert report["mode"] == "shards" and report["steps_verified"] == 2 and report["devices_used"] >= 3, report
    return report


@pytest.mark.parametrize("loop", LOOPS)
def test_a_clean_run_verifies_clean(results, loop):
    report = _report(results, loop, "clean", 0)
    assert report["clean"] and not report["findings"] and not report["unresolved"] and not report["trace_differs"]
    assert report["shards"] > 0


@pytest.mark.parametrize("loop", LOOPS)
def test_a_faulty_chip_is_named(results, loop):
    report = _report(results, loop, "chip", 1)
    named = {(f["class"], f["device"]) for f in report["findings"]}
    assert named == {("persistent", BAD_DEVICE)}, report["findings"]
    assert not report["unresolved"] and not report["trace_differs"], report


@pytest.mark.parametrize("loop", LOOPS)
def test_a_recorded_step_no_re_execution_reproduces_is_the_traces_finding(results, loop):
    report = _report(results, loop, "trace", 1)
    assert [(f["class"], f["device"], f["step"]) for f in report["findings"]] == [("trace", None, CHANGED_AT)], report
    assert report["findings"][0]["fields"] and "odd one out" in report["findings"][0]["why"]
    assert report["trace_differs"][0] == CHANGED_AT
