"""bench/accelerator.py: a failing part and the deadline still give the one JSON line.

Its run on the CPU with tiny sizes (every part runs; the pair's bits equal, the no-copy check
for every level, the three levels training identically) is in tests/test_bench_overhead.py,
after the overhead bench: their lanes are the same programs (bench/overhead.py's Lane at the
same config), which the session's compile cache then serves from one file's run to the other.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def bench(*args: str, timeout: int = 600) -> tuple[subprocess.CompletedProcess, dict]:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PJRT_NPROC")}
    env["JAX_PLATFORMS"] = "cpu"
    done = subprocess.run([sys.executable, "-m", "bench.accelerator", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return done, json.loads(lines[-1])


@pytest.mark.slow
def test_a_failing_part_and_the_deadline_still_print_the_json():
    _, r = bench("--preset", "tiny", "--skip", "pair", "--set", "model.no_such_field=1")
    assert "lanes" in r["errors"] and "no_such_field" in r["errors"]["lanes"] and not r["complete"]
    assert r["environment"]["backend"] == "cpu" and "mfu" not in r
    _, r = bench("--preset", "tiny", "--deadline-s", "3")
    assert not r["complete"] and any("deadline" in n for n in r["notes"]), r
