"""A writer killed with SIGKILL at random moments leaves a readable trace and a repairable tail."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from traces import Run, same_bits
from tests.traces.helpers import make_record, make_schema

WRITER = r"""
import sys
from traces import Run
from tests.traces.helpers import make_record, make_schema
path, resume = sys.argv[1], sys.argv[2] == "1"
schema = make_schema()
run = Run.resume(path) if resume else Run.create(path, schema, {})
w = run.writer(segment_records=50)
step = w.next_step or 0
print("ready", flush=True)
while True:
    w.append(make_record(schema, step))
    step += 1
"""

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _kill_writer_after(path, resume, delay):
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path), "1" if resume else "0"], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def _check(path, schema):
    run = Run.open(path)
    assert run.status == "crashed"
    trace = run.trace
    for damage in trace.damage:  # only ever a damaged tail, never a hole
        assert damage.step == trace.end and "trace" in damage.path
    for step in range(trace.start, trace.end):
        assert same_bits(schema, trace.read(step), make_record(schema, step))
    assert trace.verify() == trace.damage
    return trace.end


@pytest.mark.slow
def test_sigkill_at_random_points_then_resume(tmp_path):
    schema = make_schema()
    path = tmp_path / "run"
    delays = np.random.default_rng(7).uniform(0.0, 0.08, size=24)
    ends = []
    for i, delay in enumerate(delays):  # 24 kill points, each followed by a resume of the same run
        _kill_writer_after(path, resume=i > 0, delay=float(delay))
        end = _check(path, schema)
        assert not ends or end >= ends[-1]
        ends.append(end)
    assert ends[-1] > 0 and len(set(ends)) > 10, ends  # the kills really landed at different points
    run = Run.resume(path)
    w = run.writer(segment_records=50)
    assert w.next_step == ends[-1]
    w.append(make_record(schema, ends[-1]))
    run.finish()
    assert Run.open(path).trace.end == ends[-1] + 1
