"""A full disk while recording, and a resume that does not reproduce the run (issue 10: 7, 10)."""

from __future__ import annotations

import errno
import json
import os

import pytest

from traces import DiskFullError, ResumeDivergedError, Run, StepOrderError, TraceError, same_bits
from tests.traces.helpers import make_record, make_schema

SEGMENT_RECORDS = 7


class FullDisk:
    """os.write that stores `budget` more bytes, short-writes the one that crosses it, then ENOSPC."""

    def __init__(self, budget: int):
        self.left = budget
        self.real = os.write

    def write(self, fd, data):
        if self.left <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        n = self.real(fd, bytes(data[: self.left]))
        self.left -= n
        return n


def trace_bytes(path) -> int:
    return sum(p.stat().st_size for p in (path / "trace").glob("*.seg"))


def record_until_full(path, monkeypatch, steps: int, extra: int):
    """Records steps until the disk holds `extra` bytes past the first `steps` records."""
    schema = make_schema()
    scratch = path.parent / "scratch"
    run = Run.create(scratch, schema, {})
    w = run.writer(segment_records=SEGMENT_RECORDS)
    counted = FullDisk(1 << 62)  # every byte the writer writes: segments and the tail's sidecar
    monkeypatch.setattr(os, "write", counted.write)
    for k in range(steps):
        w.append(make_record(schema, k))
    monkeypatch.setattr(os, "write", counted.real)
    run.close()
    disk = FullDisk((1 << 62) - counted.left + extra)
    run = Run.create(path, schema, {})
    w = run.writer(segment_records=SEGMENT_RECORDS)
    monkeypatch.setattr(os, "write", disk.write)
    with pytest.raises(DiskFullError) as info:
        for k in range(steps + 5):
            w.append(make_record(schema, k))
    monkeypatch.setattr(os, "write", disk.real)
    with pytest.raises(StepOrderError, match="stopped after an earlier failure"):
        w.append(make_record(schema, 99))
    with pytest.raises(TraceError, match="cannot mark the run complete"):
        run.finish()
    run.close()  # the error was raised already; closing must not raise again
    return schema, info.value


def test_a_full_disk_mid_record_is_one_line_with_the_last_recorded_step(tmp_path, monkeypatch):
    path = tmp_path / "run"
    schema, error = record_until_full(path, monkeypatch, steps=10, extra=30)  # step 10's frame is torn
    message = str(error)
    assert "\n" not in message
    assert message.startswith(f"{path}/trace/000000000007.seg: no space left on the filesystem mounted at ")
    assert "(device " in message and "every step up to 9 is recorded" in message
    assert f"`replay train --resume {path}`" in message and error.last_step == 9
    run = Run.open(path)
    assert (run.trace.start, run.trace.end) == (0, 10)
    assert all(same_bits(schema, run.trace.read(k), make_record(schema, k)) for k in range(10))
    [damage] = run.damage  # the torn record of step 10, and nothing earlier
    assert damage.step == 10 and damage.path.endswith("000000000007.seg")

    run = Run.resume(path)
    w = run.writer(segment_records=SEGMENT_RECORDS)
    assert w.next_step == 10 and [d.step for d in w.repaired] == [10]
    for k in range(8, 20):  # a resumed trainer re-records from its checkpoint
        w.append(make_record(schema, k))
    run.finish()
    run = Run.open(path)
    assert (run.trace.start, run.trace.end, run.damage, run.verify()) == (0, 20, [], [])
    assert all(same_bits(schema, run.trace.read(k), make_record(schema, k)) for k in range(20))


def test_a_full_disk_while_sealing_a_segment_is_repaired_on_resume(tmp_path, monkeypatch):
    path = tmp_path / "run"
    schema, error = record_until_full(path, monkeypatch, steps=SEGMENT_RECORDS, extra=-15)  # 5 of the seal's 20
    assert "sealing 000000000000.seg" in str(error) and error.last_step == SEGMENT_RECORDS - 1
    run = Run.resume(path)
    w = run.writer(segment_records=SEGMENT_RECORDS)
    assert w.next_step == SEGMENT_RECORDS
    for k in range(SEGMENT_RECORDS, 12):
        w.append(make_record(schema, k))
    run.finish()
    run = Run.open(path)
    assert (run.trace.end, run.damage, run.verify()) == (12, [], [])  # segment 0 was sealed by the resume


def test_a_full_disk_while_replacing_run_json_keeps_the_old_one(tmp_path, monkeypatch):
    schema = make_schema()
    run = Run.create(tmp_path / "run", schema, {"checkpoints": [0]})
    run.writer().append(make_record(schema, 0))

    def no_space(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(DiskFullError, match=r"run.json: no space left .* every step up to 0 is recorded"):
        run.update_manifest(checkpoints=[0, 1])
    monkeypatch.undo()
    run.close()
    assert not (tmp_path / "run" / "run.json.tmp").exists()
    assert Run.open(tmp_path / "run").manifest["checkpoints"] == [0]
    assert "manifest_sha256" in json.loads((tmp_path / "run" / "run.json").read_text())


def test_a_resume_that_records_different_content_is_a_divergence(tmp_path):
    schema = make_schema()
    run = Run.create(tmp_path / "run", schema, {})
    w = run.writer()
    for k in range(5):
        w.append(make_record(schema, k))
    run.close()
    run = Run.resume(tmp_path / "run")
    with pytest.raises(ResumeDivergedError, match=r"step 3 is already recorded with different content") as info:
        run.writer().append(make_record(schema, 3, seed=1))
    assert isinstance(info.value, StepOrderError) and str(tmp_path / "run") in str(info.value)
    with pytest.raises(StepOrderError) as gap:
        run.writer().append(make_record(schema, 9))
    assert not isinstance(gap.value, ResumeDivergedError)  # a gap is bad input, not a divergence
    run.close()
