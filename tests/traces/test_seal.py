"""Sealing off the loop's thread (issue 34): the append that fills a segment returns before its
index is built, the files are byte for byte what sealing on the loop wrote (a fixture written by
that code), a seal that fails is raised on the caller's thread, a kill while the seal thread
works leaves a run that reopens, and building an index needs less memory than its file.

Regenerate the fixture (only on purpose, with the code whose bytes it pins):
`python -m tests.traces.test_seal tests/traces/fixtures/seal_bytes`."""

from __future__ import annotations

import dataclasses
import errno
import os
import signal
import subprocess
import sys
import threading
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from traces import DiskFullError, Schema, TraceReader, TraceWriter, same_bits, write_indexes
from traces import filter as example_filter
from traces import index as index_mod
from traces.index import IndexBuilder, index_path
from tests.traces.helpers import make_record, make_schema

FIXTURE = Path(__file__).parent / "fixtures" / "seal_bytes"
SEGMENT = 30
RECORDS = 75  # two sealed segments and a tail
ROOT = Path(__file__).resolve().parents[2]


def fixture_record(schema: Schema, step: int):
    """make_record, with example hashes that clash on their high bits, repeat within and across
    steps, and are fed every step: the cases the index's sort re-sorts or keeps in slot order."""
    rec = make_record(schema, step)
    h = rec.example_hashes.copy()
    h[:4] = (np.uint64(step % 3) << np.uint64(62)) | np.arange(4, dtype=np.uint64) * np.uint64(step % 5)
    h[4] = h[5] = np.uint64(0xFEED)
    return dataclasses.replace(rec, example_hashes=h)


def write_trace(trace: Path, compact: bool = False) -> None:
    schema = make_schema()
    w = TraceWriter(trace, schema, segment_records=SEGMENT, compact=compact)
    for step in range(RECORDS):
        assert w.append(fixture_record(schema, step))
    w.close()


def _files(trace: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(trace.iterdir()) if p.suffix != ".tix"}  # the tail's sidecar: tests/traces/test_sidecar.py


def _expected() -> dict[str, bytes]:
    files = _files(FIXTURE)
    assert sorted(files) == ["000000000000.idx", "000000000000.seg", "000000000030.idx", "000000000030.seg",
                             "000000000060.seg"]
    return files


@pytest.mark.parametrize("chunked", [False, True], ids=["one-chunk", "chunk-a-block"])
def test_files_byte_for_byte_as_sealing_on_the_loop_wrote(tmp_path, monkeypatch, chunked):
    if chunked:  # every chunk boundary of the sort, the table and the filter crosses clash buckets
        monkeypatch.setattr(index_mod, "TABLE_CHUNK_BLOCKS", 1)
        monkeypatch.setattr(example_filter, "_BUILD_ENTRIES", 100)
        monkeypatch.setattr(example_filter, "_CRC_ROWS", 3)
    write_trace(tmp_path / "trace")
    assert _files(tmp_path / "trace") == _expected()


def test_write_indexes_writes_the_same_bytes(tmp_path):
    write_trace(tmp_path / "trace")
    for p in (tmp_path / "trace").glob("*.idx"):
        p.unlink()
    assert len(write_indexes(tmp_path / "trace", make_schema())) == 2
    assert _files(tmp_path / "trace") == _expected()


def test_the_filling_append_returns_before_the_index_is_built(tmp_path, monkeypatch):
    """The index's builder is held until the test lets it go: the loop appends on meanwhile."""
    schema, started, release = make_schema(), threading.Event(), threading.Event()
    real = IndexBuilder.write

    def slow_write(self, *args, **kwargs):
        started.set()
        release.wait(30)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(IndexBuilder, "write", slow_write)
    w = TraceWriter(tmp_path / "trace", schema, segment_records=4)
    done = threading.Event()

    def loop():
        for step in range(6):
            w.append(make_record(schema, step))
        w.flush()  # waits for the sealed segment's fsync, not for its index
        done.set()

    t = threading.Thread(target=loop)
    t.start()
    try:
        assert done.wait(10), "the append that sealed waited for the segment's index"
        assert started.wait(10)
        assert not index_path(tmp_path / "trace" / "000000000000.seg").exists()
        reader = TraceReader(tmp_path / "trace", schema)  # sealed already: read without its index
        assert reader.segments[0].sealed and reader.end == 6 and not reader.damage
    finally:
        release.set()
        t.join()
    w.close()  # waits for the seal thread
    assert index_path(tmp_path / "trace" / "000000000000.seg").exists()
    assert not w.notes


def _join_seal_threads() -> None:
    for t in threading.enumerate():
        if t.name.startswith("replay-seal-"):
            t.join()


@pytest.fixture
def failing_seal_fsync(monkeypatch):
    """fsync fails with ENOSPC off the main thread (the seal thread's fsync of the sealed segment)."""
    real = os.fsync

    def fsync(fd):
        if threading.current_thread() is not threading.main_thread():
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


def test_a_failed_seal_is_raised_by_the_next_append(tmp_path, failing_seal_fsync):
    schema = make_schema()
    w = TraceWriter(tmp_path / "trace", schema, segment_records=4)
    for step in range(4):
        assert w.append(make_record(schema, step))  # the 4th seals: its fsync fails on the thread
    _join_seal_threads()  # else the failure may come one append later, when the thread is done
    with pytest.raises(DiskFullError) as e:
        w.append(make_record(schema, 4))
    msg = str(e.value)
    assert "\n" not in msg and "while sealing 000000000000.seg" in msg and "every step up to 3 is recorded" in msg
    assert w.broken
    with pytest.raises(Exception, match="stopped after an earlier failure"):
        w.append(make_record(schema, 4))
    w.close()


def test_a_failed_seal_is_raised_by_close(tmp_path, failing_seal_fsync):
    schema = make_schema()
    w = TraceWriter(tmp_path / "trace", schema, segment_records=4)
    for step in range(4):
        w.append(make_record(schema, step))
    with pytest.raises(DiskFullError, match="while sealing 000000000000.seg"):
        w.close()
    assert w.broken


def test_a_failed_seal_is_raised_by_flush(tmp_path, failing_seal_fsync):
    schema = make_schema()
    w = TraceWriter(tmp_path / "trace", schema, segment_records=4)
    for step in range(4):
        assert w.append(make_record(schema, step))
    with pytest.raises(DiskFullError, match="every step up to 3 is recorded"):  # flush waits for the fsync
        w.flush()
    w.close()


def test_a_bug_in_the_seal_thread_is_raised_not_lost(tmp_path, monkeypatch):
    def broken_write(self, *args, **kwargs):
        raise RuntimeError("index builder bug")

    monkeypatch.setattr(IndexBuilder, "write", broken_write)
    schema = make_schema()
    w = TraceWriter(tmp_path / "trace", schema, segment_records=4)
    for step in range(4):
        assert w.append(make_record(schema, step))
    with pytest.raises(RuntimeError, match="index builder bug"):
        w.close()
    assert w.broken


KILLED_WRITER = r"""
import os, sys, time
from traces import TraceWriter
from traces.index import IndexBuilder
from tests.traces.helpers import make_record, make_schema
def stuck(self, path, *args, **kwargs):
    path.with_name(path.name + ".tmp").write_bytes(b"half an index")
    os.write(1, b"indexing\n")  # one write a line: two threads print
    time.sleep(600)
IndexBuilder.write = stuck
schema = make_schema()
w = TraceWriter(sys.argv[1], schema, segment_records=5)
for step in range(8):
    w.append(make_record(schema, step))
os.write(1, b"appended 8\n")
time.sleep(60)
"""


def test_killed_while_the_seal_thread_indexes(tmp_path):
    trace = tmp_path / "trace"
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(trace)], cwd=ROOT, stdout=subprocess.PIPE,
                            text=True)
    timer = threading.Timer(20, proc.kill)  # a filling append that waits for the index never says "appended"
    timer.start()
    try:
        lines = {proc.stdout.readline().strip() for _ in range(2)}
    finally:
        timer.cancel()
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert lines == {"indexing", "appended 8"}  # the loop went on while the index was being built
    schema = make_schema()
    reader = TraceReader(trace, schema)
    assert not reader.damage and reader.end == 8 and reader.segments[0].sealed
    assert all(same_bits(schema, reader.read(s), make_record(schema, s)) for s in range(8))
    w = TraceWriter(trace, schema, segment_records=5)  # a resume writes the index the kill left unwritten
    assert index_path(trace / "000000000000.seg").exists()
    w.append(make_record(schema, 8))
    w.close()
    assert TraceReader(trace, schema).end == 9


def test_building_an_index_needs_less_memory_than_its_file(tmp_path):
    """The seal's working memory: ~4 bytes an example beside the hashes it consumes (they were
    ~40 with the whole sort's arrays and the filter's 1M-hash chunks at once)."""
    schema = Schema(examples_per_step=4096, rng_words=2, metrics=(("loss", "loss"),))
    builder = IndexBuilder(schema, 0, 512)
    rng = np.random.default_rng(0)
    raw_rec = np.zeros(1, index_mod.record_prefix(schema))
    for k in range(512):
        raw_rec["step"] = k
        raw_rec["example_hashes"] = rng.integers(0, 2**63, 4096, dtype=np.uint64)
        builder.add(raw_rec.tobytes(), 100 + k, k)
    hash_bytes = builder.hashes().nbytes  # 16 MB
    path = tmp_path / "x.idx"
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        builder.write(path, 100 + 512, 0, 1000, consume=True)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert peak < path.stat().st_size, (peak, path.stat().st_size)
    assert peak < 0.5 * hash_bytes + (24 << 20), (peak, hash_bytes)  # 24 MB: a chunk's fixed working arrays


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not Path("/sys/kernel/mm/transparent_hugepage").exists() or not Path("/proc/self/smaps").exists(),
                    reason="needs Linux's transparent huge pages and /proc/self/smaps")
def test_the_rows_appends_fill_are_not_in_huge_pages():
    """The builder's hashes, which the loop's appends fill, are mapped without transparent huge
    pages (numpy asks for them for any array of 4 MB or more): the first write into a huge page
    zeroes 2 MB on the loop's thread, 20-70 ms a fault on this project's VM (bench.seal_pause)."""
    schema = Schema(examples_per_step=1024, rng_words=2, metrics=(("loss", "loss"),))
    builder = IndexBuilder(schema, 0, 1024)  # 8 MB of hashes
    raw_rec = np.zeros(1, index_mod.record_prefix(schema))
    builder.add(raw_rec.tobytes(), 100, 0)
    flags = _vm_flags(builder.hashes().ctypes.data)
    assert "nh" in flags and "hg" not in flags, flags
    assert _vm_flags(np.empty((1024, 1024), np.uint64).ctypes.data) != flags  # the check tells them apart


if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True)
    write_trace(out)
