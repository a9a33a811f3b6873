"""A writer recording to a bucket (moto's S3 server on 127.0.0.1) killed with SIGKILL mid-run:
what it had uploaded is readable, it lost fewer than 2 x REPLAY_TAIL_RECORDS records (one tail
object in flight at most), the run opens
as crashed with one note saying so, a second writer is refused while the killed one's lease is
live, and resumes from the bucket end bit-identical to an uninterrupted run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.cli_util import invoke
from tests.traces.helpers import make_record, make_schema
from traces import Run, same_bits
from traces.errors import RunLockedError

WRITER = r"""
import sys
from traces import Run
from tests.traces.helpers import make_record, make_schema
url, resume = sys.argv[1], sys.argv[2] == "1"
schema = make_schema()
run = Run.resume(url) if resume else Run.create(url, schema, {"config": {"synthetic": True}})
w = run.writer(segment_records=10)
step = w.next_step or 0
print("ready", flush=True)
while True:
    w.append(make_record(schema, step))
    step += 1
    print(step, flush=True)  # appended (its tail object, when its turn came, handed to the upload thread)
"""

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TAIL, LEASE = 4, 1.0


def _kill_after(url: str, resume: bool, appends: int, env: dict) -> int:
    proc = subprocess.Popen([sys.executable, "-c", WRITER, url, "1" if resume else "0"], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "ready"
        for _ in range(appends):
            line = proc.stdout.readline()
            assert line, "the writer ended before it was killed"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    return int(line)


@pytest.mark.slow
def test_a_remote_writer_killed_mid_run_loses_less_than_a_tail_and_resumes_bit_identical(tmp_path, s3):  # noqa: F811
    env = {**os.environ, "REPLAY_TAIL_RECORDS": str(TAIL), "REPLAY_LEASE_SECONDS": str(LEASE),
           "REPLAY_STAGING": str(tmp_path), "PYTHONPATH": ROOT}
    url, schema = f"{s3}/{tmp_path.name}/run", make_schema()
    end = 0
    for i, appends in enumerate((7, 13, 6)):  # kills inside a segment's tail and across seals
        reported = _kill_after(url, resume=i > 0, appends=appends, env=env)
        if i == 0:
            with pytest.raises(RunLockedError, match="is being written by"):
                Run.resume(url)  # the killed writer's lease is still live
        time.sleep(LEASE + 0.2)
        run = Run.open(url)
        assert run.status == "crashed" and run.damage == [], run.damage
        assert any(f"fewer than {2 * TAIL} records" in note for note in run.notes), run.notes
        end = run.trace.end
        assert reported - 2 * TAIL < end <= reported, (reported, end)
        for step in range(end):
            assert same_bits(schema, run.trace.read(step), make_record(schema, step))
    resumed = Run.resume(url)
    writer = resumed.writer(10)
    for step in range(end - 2, 40):  # the last steps again, as a loop resumed from a checkpoint does
        writer.append(make_record(schema, step))
    resumed.finish()
    local = Run.create(tmp_path / "local", schema, {"config": {"synthetic": True}})
    w = local.writer(10)
    for step in range(40):
        w.append(make_record(schema, step))
    local.finish()
    bisect = invoke("bisect", "--no-refine", "--json", str(tmp_path / "local"), url)
    assert bisect.exit_code == 0, bisect.output
    assert Run.open(url).status == "complete"
