"""A writer killed with SIGKILL at random moments leaves a readable trace and a repairable tail.

Each kill waits until the writer says it has appended a random number of records (1 to 30) in
this round, then a random fraction of a record's time more, so the kill lands at a random point
of an append (or of a seal, every 50 records), and at a different trace length every round
however loaded the machine is: a kill after a fixed delay could land before the writer wrote
anything when the machine is busy. Records the writer had appended before the kill must all be
there after it."""

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
    print(step, flush=True)  # appended: the record's bytes are in the file (os.write, no user-space buffer)
"""

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _kill_writer_after(path, resume, appends, delay) -> int:
    """Kill the writer `delay` seconds after it reported `appends` appended records; returns the
    step it had reported as appended last (+1: the trace end it had at least reached)."""
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path), "1" if resume else "0"], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        for _ in range(appends):
            line = proc.stdout.readline()
            assert line, "the writer ended before it was killed"
        time.sleep(delay)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    return int(line)


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
    rng = np.random.default_rng(7)
    appends, delays = rng.integers(1, 31, size=24), rng.uniform(0.0, 0.002, size=24)
    ends = []
    for i in range(24):  # 24 kill points, each followed by a resume of the same run
        reported = _kill_writer_after(path, resume=i > 0, appends=int(appends[i]), delay=float(delays[i]))
        end = _check(path, schema)
        assert end >= reported and (not ends or end >= ends[-1] + appends[i]), (ends, end, reported)  # nothing lost
        ends.append(end)
    assert len(set(ends)) == 24 and ends[-1] > 2 * 50, ends  # the kills landed at different points, over several seals
    run = Run.resume(path)
    w = run.writer(segment_records=50)
    assert w.next_step == ends[-1]
    w.append(make_record(schema, ends[-1]))
    run.finish()
    assert Run.open(path).trace.end == ends[-1] + 1
