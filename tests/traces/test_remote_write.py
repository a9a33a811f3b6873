"""Runs written to object storage (a real emulator on 127.0.0.1: tests/traces/emulators.py): sealed
segments as whole objects, the unsealed tail as checksummed tail objects, the lease lock, the
markers; a run written to a bucket reads as the same run written to disk, a writer that stops
without finishing loses only what it had not uploaded (named on the next open), a resume
continues it, and a second writer is refused."""

from __future__ import annotations

import json
import time

import pytest

import traces
from tests.cli_util import invoke
from tests.traces.helpers import make_record, make_schema
from traces import storage
from traces.errors import RunLockedError
from traces.storage import lease, mirror

SCHEMA = make_schema()


@pytest.fixture(params=["gcs", "s3"])
def bucket(request):
    return request.getfixturevalue(request.param)


@pytest.fixture(autouse=True)
def small_tails(tmp_path, monkeypatch):
    """A tail object every 4 records; staging folders under the test's own folder."""
    monkeypatch.setattr(mirror, "TAIL_RECORDS", 4)
    monkeypatch.setenv("REPLAY_STAGING", str(tmp_path))


def write(where, steps, segment_records=5, finish=True, start=0):
    run = traces.Run.create(where, SCHEMA, {"config": {"synthetic": True}})
    writer = run.writer(segment_records)
    for k in range(start, steps):
        writer.append(make_record(SCHEMA, k))
    if finish:
        run.finish()
    return run, writer


def objects(url: str, folder: str = "") -> list[str]:
    store, key = storage.open_store(url)
    return sorted(store.list(f"{key}/{folder}".rstrip("/") + "/")[0])


def same_shown(local, url) -> None:
    here, there = invoke("show", "--json", str(local)), invoke("show", "--json", url)
    assert here.exit_code == there.exit_code == 0, there.output
    assert json.loads(there.stdout.replace(url, str(local))) == json.loads(here.stdout)


def test_a_run_written_to_a_bucket_reads_as_the_same_run_written_to_disk(tmp_path, bucket):
    url = f"{bucket}/{tmp_path.name}/run"
    run, writer = write(url, 13, finish=False)
    writer.flush()  # the uploads done (they run on a thread), and the third segment's 3 records sent
    trace = [name for name in objects(url, "trace") if not name.endswith(".idx")]  # indexes: once built
    assert trace == ["000000000000.seg", "000000000005.seg", "000000000010.seg.tail-000000"], trace
    live = traces.Run.open(url)
    assert (live.status, live.trace.end, live.damage) == ("running", 13, [])
    run.finish()
    # Sealed segments and their indexes; the last segment whole with its sidecar, as on disk.
    assert objects(url, "trace") == ["000000000000.idx", "000000000000.seg", "000000000005.idx", "000000000005.seg",
                                     "000000000010.seg", "000000000010.tix"]
    assert "COMPLETE" in objects(url) and "INCOMPLETE" not in objects(url) and ".lock" not in objects(url)
    local, _ = write(tmp_path / "local", 13)
    same_shown(local.path, url)
    bisect = invoke("bisect", "--no-refine", "--json", str(local.path), url)
    assert bisect.exit_code == 0, bisect.output
    assert not list(tmp_path.glob("replay-staging-*")), "the staging folder outlived its run"


def test_a_writer_stopped_mid_run_loses_only_what_it_had_not_uploaded_and_a_resume_continues(
        tmp_path, bucket, monkeypatch):
    monkeypatch.setattr(lease, "LEASE_S", 0.5)
    url = f"{bucket}/{tmp_path.name}/run"
    write(url, 13, segment_records=100, finish=False)  # tails after records 4, 8, 12: step 12 not uploaded
    assert traces.Run.open(url).status == "running"  # its lease is live
    time.sleep(0.6)  # the writer is gone (never closed): its lease runs out
    crashed = traces.Run.open(url)
    assert (crashed.status, crashed.trace.end, crashed.damage) == ("crashed", 12, [])
    assert any("fewer than 8 records" in note for note in crashed.notes), crashed.notes
    shown = invoke("show", "--json", url)
    assert json.loads(shown.stdout)["status"] == "crashed"
    resumed = traces.Run.resume(url)
    writer = resumed.writer(100)
    for k in range(8, 20):  # the re-computed steps already recorded must be bit-identical
        writer.append(make_record(SCHEMA, k))
    resumed.finish()
    local, _ = write(tmp_path / "local", 20, segment_records=100)
    same_shown(local.path, url)


def test_a_damaged_tail_object_is_named_on_open_and_a_resume_rewrites_the_tail(tmp_path, bucket, monkeypatch):
    monkeypatch.setattr(lease, "LEASE_S", 0.5)
    url = f"{bucket}/{tmp_path.name}/run"
    write(url, 12, segment_records=100, finish=False)
    store, key = storage.open_store(url)
    name = f"{key}/trace/000000000000.seg.tail-000001"
    data = bytearray(store.read(name))
    data[-3] ^= 0x10
    store.write_if_generation(name, bytes(data), store.stat(name).generation)
    time.sleep(0.6)
    damaged = traces.Run.open(url)
    assert damaged.trace.end == 4 and len(damaged.damage) == 1, damaged.damage
    assert "000000000000.seg.tail-000001: its bytes do not match its checksum" in str(damaged.damage[0])
    resumed = traces.Run.resume(url)
    writer = resumed.writer(100)
    for k in range(4, 12):
        writer.append(make_record(SCHEMA, k))
    resumed.finish()
    local, _ = write(tmp_path / "local", 12, segment_records=100)
    same_shown(local.path, url)


def test_a_second_writer_is_refused_and_takes_over_only_an_expired_lease(tmp_path, bucket):
    """On moto, which enforces conditional writes, and on the GCS emulator, whose uploads the
    fixture makes honour ifGenerationMatch as GCS's do (tests/traces/emulators.py)."""
    url = f"{bucket}/{tmp_path.name}/run"
    first, writer = write(url, 3, finish=False)
    writer.flush()
    with pytest.raises(RunLockedError, match=r"is being written by .* pid \d+ \(its lease ends in"):
        traces.Run.resume(url)
    with pytest.raises(traces.TraceError, match="already exists and is not empty"):
        traces.Run.create(url, SCHEMA, {"config": {}})
    # The lease runs out (the writer stalled); a resume takes it over, and the stalled writer's
    # next conditional write (its lease's renewal, its manifest) is refused, never overwrites.
    store, key = storage.open_store(url)
    stale = json.loads(store.read(f"{key}/.lock"))
    stale["expires"] = time.time() - 1
    first.mirror.lease.generation = store.write_if_generation(f"{key}/.lock", json.dumps(stale).encode(),
                                                              first.mirror.lease.generation)
    second = traces.Run.resume(url)
    with pytest.raises(storage.PreconditionFailed):
        first.mirror.lease.renew(force=True)
    with pytest.raises(storage.PreconditionFailed):
        first.update_manifest(note="the stalled writer")
    second.writer(5).append(make_record(SCHEMA, 3))
    second.finish()
    assert traces.Run.open(url).trace.end == 4


def test_a_finished_remote_run_resumed_continues_its_last_segment_object_with_tail_objects(tmp_path, bucket, monkeypatch):
    monkeypatch.setattr(lease, "LEASE_S", 0.5)
    url = f"{bucket}/{tmp_path.name}/run"
    write(url, 7, segment_records=100)  # finished: 000000000000.seg (unsealed) and its sidecar, whole
    opened = traces.Run.open(url)
    assert (opened.status, opened.trace.end) == ("complete", 7)
    assert opened.trace.segments[-1].columns is not None, "opened by walking its frames, not by its sidecar"
    resumed = traces.Run.resume(url)
    writer = resumed.writer(100)
    for k in range(7, 16):
        writer.append(make_record(SCHEMA, k))  # tails after 4 and 8 records: from byte N of the object
    time.sleep(0.6)  # never closed: the writer is gone
    crashed = traces.Run.open(url)
    assert (crashed.status, crashed.trace.end, crashed.damage) == ("crashed", 15, [])
    again = traces.Run.resume(url)
    writer = again.writer(100)
    for k in range(15, 20):
        writer.append(make_record(SCHEMA, k))
    again.finish()
    assert objects(url, "trace") == ["000000000000.seg", "000000000000.tix"]
    local, _ = write(tmp_path / "local", 20, segment_records=100)
    same_shown(local.path, url)


def test_uploads_run_off_the_writers_thread_and_a_failed_one_stops_the_writer(tmp_path, s3, monkeypatch):  # noqa: F811
    import threading

    url = f"{s3}/{tmp_path.name}/run"
    run = traces.Run.create(url, SCHEMA, {"config": {"synthetic": True}})
    writer = run.writer(100)
    put, calls = mirror.Mirror.put, []

    def watched(self, rel, data, replace=False):
        calls.append((rel, threading.current_thread() is threading.main_thread()))
        if rel.endswith("tail-000001"):
            raise storage.StorageError(f"{self.url}/{rel}: cannot be written (injected)")
        return put(self, rel, data, replace)

    monkeypatch.setattr(mirror.Mirror, "put", watched)
    for k in range(8):  # tail objects after records 4 and 8: the second fails
        writer.append(make_record(SCHEMA, k))
    with pytest.raises(storage.StorageError, match="tail-000001: cannot be written"):
        writer.flush()
    with pytest.raises(storage.StorageError):  # and every later write: nothing is uploaded past the hole
        writer.append(make_record(SCHEMA, 8))
    assert [rel for rel, _ in calls] == ["trace/000000000000.seg.tail-000000", "trace/000000000000.seg.tail-000001"]
    assert not any(on_main for _, on_main in calls), calls
    with pytest.raises(storage.StorageError):
        run.close()
    monkeypatch.setattr(mirror.Mirror, "put", put)
    resumed = traces.Run.resume(url)  # the failed writer gave its lease back
    assert resumed.trace.end == 4
    resumed.close()


def test_a_compacted_segment_never_reaches_the_bucket_before_its_index(tmp_path, s3, monkeypatch):  # noqa: F811
    """The seal thread compacts a sealed segment (renaming the compacted copy over it) while its
    sealed upload may still wait in the upload queue: that upload must be the sealed bytes, not the
    compacted copy, whose example hashes live only in the index uploaded later. Here each segment's
    upload waits for the seal thread, so the compaction has always happened first (a writer killed
    between the two uploads once left a compacted segment without its index: CI of f63c92d)."""
    from traces.segment import COMPACT_VERSION, HEADER_SIZE, header_version

    url = f"{s3}/{tmp_path.name}/run"
    run = traces.Run.create(url, SCHEMA, {"config": {"synthetic": True}})
    writer = run.writer(5)
    put, stored, early = mirror.Mirror.put, set(), []

    def after_the_seal_thread(self, rel, data, replace=False):
        name = rel.rsplit("/", 1)[-1]
        if name.endswith(".seg"):
            sealing = writer._sealing
            if sealing is not None:
                sealing.join()  # the compaction is done: the name holds the compacted copy now
            if header_version(data[:HEADER_SIZE]) >= COMPACT_VERSION and name[:-4] + ".idx" not in stored:
                early.append(name)
        out = put(self, rel, data, replace)
        stored.add(name)
        return out

    monkeypatch.setattr(mirror.Mirror, "put", after_the_seal_thread)
    for k in range(12):  # two segments sealed (and compacted), two records in the open one
        writer.append(make_record(SCHEMA, k))
    writer.flush()
    assert early == [], f"compacted segments uploaded before their index: {early}"
    assert {"000000000000.idx", "000000000005.idx"} <= stored  # (both were compacted and indexed)
    run.close()
    opened = traces.Run.open(url)
    for k in range(12):
        assert traces.same_bits(SCHEMA, opened.trace.read(k), make_record(SCHEMA, k))


def test_a_resume_uploads_the_index_a_killed_writer_never_uploaded_and_its_compacted_segment(
        tmp_path, s3, monkeypatch):  # noqa: F811
    from traces.segment import COMPACT_VERSION, HEADER_SIZE, header_version

    monkeypatch.setattr(lease, "LEASE_S", 0.5)
    url = f"{s3}/{tmp_path.name}/run"
    upload_indexes = mirror.MirroredTraceWriter._upload_indexes
    monkeypatch.setattr(mirror.MirroredTraceWriter, "_upload_indexes", lambda self, wait=False: None)
    _, stopped = write(url, 9, finish=False)  # killed after its first seal, before that segment's index went up
    stopped.flush()
    monkeypatch.setattr(mirror.MirroredTraceWriter, "_upload_indexes", upload_indexes)
    time.sleep(0.6)  # its lease runs out
    assert "000000000000.idx" not in objects(url, "trace")
    resumed = traces.Run.resume(url)
    writer = resumed.writer(5)
    for k in range(8, 12):
        writer.append(make_record(SCHEMA, k))
    resumed.finish()
    assert "000000000000.idx" in objects(url, "trace")
    store, key = storage.open_store(url)
    assert header_version(store.read(f"{key}/trace/000000000000.seg")[:HEADER_SIZE]) >= COMPACT_VERSION
    local, _ = write(tmp_path / "local", 12)
    same_shown(local.path, url)


def test_a_resume_uploads_the_compacted_segment_a_killed_writer_indexed_but_never_uploaded(
        tmp_path, s3, monkeypatch):  # noqa: F811
    """Killed between a segment's index and its compacted copy: the bucket holds the index of the
    compacted segment beside the sealed one, which readers index in memory; a resume compacts it
    again and uploads both."""
    from traces.segment import COMPACT_VERSION, HEADER_SIZE, header_version

    monkeypatch.setattr(lease, "LEASE_S", 0.5)
    url = f"{s3}/{tmp_path.name}/run"
    upload_indexes = mirror.MirroredTraceWriter._upload_indexes

    def indexes_only(self, wait=False):  # the kill falls after each index, before its compacted segment
        if self._index_due and not (self._sealing is not None and self._sealing.is_alive() and not wait):
            self._wait_seal()
            for seg in self._index_due:
                self._uploads.submit(self._put_file, seg.with_suffix(".idx"))
            self._index_due = []

    monkeypatch.setattr(mirror.MirroredTraceWriter, "_upload_indexes", indexes_only)
    _, stopped = write(url, 9, finish=False)
    stopped._upload_indexes(wait=True)  # (the seal thread may still be at work: its index goes up once it is done)
    stopped.flush()
    monkeypatch.setattr(mirror.MirroredTraceWriter, "_upload_indexes", upload_indexes)
    time.sleep(0.6)
    store, key = storage.open_store(url)

    def compacted() -> bool:
        return header_version(store.read(f"{key}/trace/000000000000.seg")[:HEADER_SIZE]) >= COMPACT_VERSION

    assert "000000000000.idx" in objects(url, "trace") and not compacted()
    crashed = traces.Run.open(url)  # the sealed segment beside its compacted copy's index: read all the same
    assert all(traces.same_bits(SCHEMA, crashed.trace.read(k), make_record(SCHEMA, k)) for k in range(crashed.trace.end))
    resumed = traces.Run.resume(url)
    writer = resumed.writer(5)
    for k in range(8, 12):
        writer.append(make_record(SCHEMA, k))
    resumed.finish()
    assert compacted()
    local, _ = write(tmp_path / "local", 12)
    same_shown(local.path, url)
