"""Runs on object storage, read: `replay show`, `audit` and `bisect` of a run in a bucket (a real
emulator on 127.0.0.1: tests/traces/emulators.py) say what they say of the same run on disk, open
it in O(segments) requests, and report a damaged object instead of reading it."""

from __future__ import annotations

import json

import numpy as np
import pytest

import traces
from tests.cli_util import assert_one_line_error, invoke
from tests.replay.test_audit import make_run as make_audit_run
from tests.replay.test_audit import resume_repeat
from tests.traces.emulators import upload
from tests.traces.helpers import make_record, make_schema
from traces import storage

SEGMENT = 7  # records a segment: resume_repeat()'s 30 steps make 4 sealed segments and an unsealed tail


@pytest.fixture(params=["gcs", "s3"])
def bucket(request):
    return request.getfixturevalue(request.param)


def remote_copy(tmp_path, bucket, name="run", hashes=None):
    """(a local run of the audit tests' kind, its copy in the bucket's folder for this test)."""
    local = make_audit_run(tmp_path / name, resume_repeat() if hashes is None else hashes, 1000, segment_records=SEGMENT)
    return local, upload(local, f"{bucket}/{tmp_path.name}/{name}")


def as_local(result, url, local) -> str:
    return result.stdout.replace(url, str(local))


@pytest.mark.parametrize("verify", [False, True])
def test_show_of_a_remote_run_says_what_show_of_the_local_run_says(tmp_path, bucket, verify):
    local, url = remote_copy(tmp_path, bucket)
    flags = ["--json", "--verify"] if verify else ["--json"]
    here, there = invoke("show", *flags, str(local)), invoke("show", *flags, url)
    assert here.exit_code == there.exit_code == 0, there.output
    shown = json.loads(there.stdout)
    assert shown["path"] == url and shown["status"] == "complete" and shown["steps"]["count"] == 30
    assert json.loads(as_local(there, url, local)) == json.loads(here.stdout)


def test_audit_of_a_remote_run_finds_the_same_repeats(tmp_path, bucket):
    local, url = remote_copy(tmp_path, bucket)
    here, there = invoke("audit", "--json", str(local)), invoke("audit", "--json", url)
    assert here.exit_code == there.exit_code == 1, there.output  # resume_repeat() feeds steps 10..19 again
    assert json.loads(there.stdout)["first_early_repeat_step"] == 20
    assert json.loads(as_local(there, url, local)) == json.loads(here.stdout)


def test_bisect_of_a_local_run_against_a_remote_one(tmp_path, bucket):
    schema = make_schema()
    runs = {}
    for name, changed in (("a", None), ("b", 9)):
        run = traces.Run.create(tmp_path / name, schema, {"config": {"synthetic": True}})
        writer = run.writer(5)
        for k in range(14):
            rec = make_record(schema, k)
            if k == changed:
                rec.metrics[0] += 1
            writer.append(rec)
        run.finish()
        runs[name] = (tmp_path / name, upload(tmp_path / name, f"{bucket}/{tmp_path.name}/{name}"))
    (a, url_a), (b, url_b) = runs["a"], runs["b"]
    here = invoke("bisect", "--no-refine", "--json", str(a), str(b))
    assert here.exit_code == 1, here.output
    assert json.loads(here.stdout)["first_step"] == 9
    for pair in ((str(a), url_b), (url_a, url_b)):
        there = invoke("bisect", "--no-refine", "--json", *pair)
        assert there.exit_code == 1, there.output
        assert json.loads(there.stdout.replace(url_a, str(a)).replace(url_b, str(b))) == json.loads(here.stdout)


def test_opening_costs_requests_per_segment_and_a_step_one_range(tmp_path, bucket):
    local, url = remote_copy(tmp_path, bucket)
    segments = len(list((local / "trace").glob("*.seg")))
    storage.reset_counts()
    run = traces.Run.open(url)
    reader = run.trace
    assert (reader.start, reader.end, run.damage) == (0, 30, [])
    opened = storage.request_counts()
    # run.json and COMPLETE whole; each segment's header and seal (the tail's sidecar whole, its
    # last frame checked): nothing grows with the steps a segment holds.
    assert opened["range"] <= 2 * segments + 2 and opened.get("get", 0) <= 3 and opened["list"] <= 3, opened
    storage.reset_counts()
    # In the second sealed segment: the index headers of the segments from there on (one parallel
    # wave: a scan reads them next), its offsets column, then the frame; the segment being compacted
    # (traces/compaction.py), its hashes from its index too: the examples key column, the block
    # heads and the table (of 7 records, all of it at once: kept for the next read).
    assert reader.read(9).batch_hash == 10
    first = storage.request_counts()
    assert reader.segments[1].version == 3
    assert first["range"] <= 2 + (segments - 1) + 3 and first.get("get", 0) == first.get("list", 0) == 0, first
    held = sum((local / "trace" / f"000000000007.{x}").stat().st_size for x in ("seg", "idx"))
    assert first["bytes"] < held, first  # less than the segment and its index (the hashes' only copy)
    storage.reset_counts()
    assert reader.read(12).batch_hash == 13
    assert storage.request_counts()["range"] == 1  # a step: one object range


def test_a_damaged_remote_segment_is_reported_not_read(tmp_path, bucket):
    local, url = remote_copy(tmp_path, bucket)
    name = "trace/000000000007.seg"  # sealed: opening reads only its header and seal
    data = bytearray((local / name).read_bytes())
    data[len(data) // 2] ^= 0x40
    (local / name).write_bytes(bytes(data))
    store, key = storage.open_store(f"{url}/{name}")
    store.write_if_generation(key, bytes(data), store.stat(key).generation)
    here, there = invoke("show", "--verify", str(local)), invoke("show", "--verify", url)
    assert here.exit_code == there.exit_code == 2
    assert_one_line_error(there, f"{url}/{name}")
    assert there.stderr.replace(url, str(local)) == here.stderr
    audit = invoke("audit", "--verify", url)
    assert_one_line_error(audit, f"{url}/{name}")


def test_a_segment_missing_from_the_bucket_is_reported_as_on_disk(tmp_path, bucket):
    local, url = remote_copy(tmp_path, bucket)
    name = "trace/000000000014.seg"
    (local / name).unlink()
    store, key = storage.open_store(f"{url}/{name}")
    store.delete(key)
    here, there = invoke("show", str(local)), invoke("show", url)
    assert here.exit_code == there.exit_code == 2
    assert_one_line_error(there, f"{url}/trace/")
    assert there.stderr.replace(url, str(local)) == here.stderr


def test_a_missing_remote_run_is_one_line(bucket):
    result = invoke("show", f"{bucket}/no/such/run")
    assert_one_line_error(result, f"{bucket}/no/such/run: no such run")


@pytest.mark.parametrize("where", ["local", "s3", "gcs"])
def test_conditional_writes_refuse_a_second_writer(tmp_path, request, where):
    """What the writer lock and the COMPLETE marker stand on. On gs:// the emulator honours
    ifGenerationMatch as GCS does only through the fixture (tests/traces/emulators.py; by itself
    it overwrites), so this also checks GCSStore sends it."""
    url = str(tmp_path / "obj") if where == "local" else f"{request.getfixturevalue(where)}/{tmp_path.name}/obj"
    store, key = storage.open_store(url)
    first = store.write_if_absent(key, b"one")
    with pytest.raises(storage.PreconditionFailed):
        store.write_if_absent(key, b"two")
    second = store.write_if_generation(key, b"three", first)
    with pytest.raises(storage.PreconditionFailed):
        store.write_if_generation(key, b"four", first)  # the generation moved on
    assert store.read(key) == b"three" and store.stat(key).generation == second
    assert store.read_range(key, 1, 3) == b"hre" and store.read_range(key, 10, 3) == b""
    store.delete(key)
    assert store.stat(key) is None


def test_identical_remote_runs_agree_and_their_checkpoints_are_named_unchecked(tmp_path, bucket):
    schema = make_schema()
    run = traces.Run.create(tmp_path / "a", schema, {"config": {"synthetic": True}})
    writer = run.writer(5)
    for k in range(12):
        writer.append(make_record(schema, k))
    run.update_manifest(checkpoints=[10])  # listed; its folder is not in the bucket, and nothing checks it there
    run.finish()
    one, two = (upload(tmp_path / "a", f"{bucket}/{tmp_path.name}/{name}") for name in ("one", "two"))
    result = invoke("bisect", "--no-refine", "--json", one, two)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["identical"] is True and report["checkpoints"]["unchecked"] == ["A", "B"]
    shown = invoke("bisect", "--no-refine", one, two)
    assert "those of A and B (on object storage) were not checked either" in " ".join(shown.stdout.split())
    local = invoke("bisect", "--no-refine", str(tmp_path / "a"), one)  # locally the missing folder is found
    assert_one_line_error(local, "checkpoint 10 is damaged (its folder is missing)")


def test_an_unreachable_store_is_one_line_not_damage(tmp_path, monkeypatch):
    pytest.importorskip("boto3", reason="pip install -e '.[dev]' brings boto3 (without it: one line naming the extra)")
    with __import__("socket").socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    for k, v in (("AWS_ACCESS_KEY_ID", "x"), ("AWS_SECRET_ACCESS_KEY", "x"), ("AWS_DEFAULT_REGION", "us-east-1")):
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(storage, "_STORES", {})  # a store made now, for the dead endpoint
    result = invoke("show", "s3://replay-unreachable/run")
    assert_one_line_error(result, "s3://replay-unreachable/run/", "cannot be read from S3", "AWS_ENDPOINT_URL")
    assert "damage" not in result.stderr


def test_spike_and_a_lite_pack_read_a_remote_run_and_replaying_one_answers_as_its_local_copy(tmp_path, bucket):
    local, url = remote_copy(tmp_path, bucket)
    here, there = invoke("spike", "--json", "--window", "5", str(local)), invoke("spike", "--json", "--window", "5", url)
    assert here.exit_code == there.exit_code == 0, there.output
    assert json.loads(as_local(there, url, local)) == json.loads(here.stdout)
    packed = invoke("pack", url, "--steps", "3:9", "--lite", "-o", str(tmp_path / "lite.rpk"))
    assert packed.exit_code == 0, packed.output
    shown = json.loads(invoke("show", "--json", str(tmp_path / "lite.rpk")).stdout)
    assert shown["steps"]["start"] == 3 and shown["steps"]["end"] == 10 and shown["damage"] == []
    # Replaying restores from a local copy of the run (this one has no checkpoints: refused as locally).
    for args in (("run", "RUN", "--steps", "3:5"), ("pack", "RUN", "--steps", "3:5", "-o", str(tmp_path / "b.rpk")),
                 ("spike", "RUN", "--step", "20", "--window", "5")):
        here = invoke(*[str(local) if a == "RUN" else a for a in args])
        there = invoke(*[url if a == "RUN" else a for a in args])
        assert_one_line_error(there, url)
        assert there.stderr.replace(url, str(local)) == here.stderr, args
    # compare --eval reads the remote run as the local one (this run's config is no trainer's: refused alike).
    there, here = invoke("compare", url, str(local), "--eval"), invoke("compare", str(local), url, "--eval")
    assert_one_line_error(there, f"{url}: its manifest config is not a trainer config")
    assert there.stderr.replace(url, str(local)) == here.stderr


def test_a_remote_file_opened_reads_by_ranges(tmp_path, bucket):
    local, url = remote_copy(tmp_path, bucket)
    path = storage.as_path(f"{url}/trace/000000000007.seg")
    storage.reset_counts()
    with path.open("rb") as f:
        head = f.read(10)
        f.seek(-16, 2)
        tail = f.read()
    data = (local / "trace" / "000000000007.seg").read_bytes()
    assert (head, tail) == (data[:10], data[-16:])
    assert storage.request_counts()["bytes"] == 26  # what was asked for, not the object
    assert storage.as_path(f"{url}/run.json").open("r").read() == (local / "run.json").read_text()


def test_an_object_deleted_after_opening_is_named_damage_not_a_crash(tmp_path, bucket):
    local, url = remote_copy(tmp_path, bucket)
    reader = traces.Run.open(url).trace
    store, key = storage.open_store(f"{url}/trace/000000000007.seg")
    store.delete(key)
    with pytest.raises(traces.TraceCorruptError, match=f"{url}/trace/000000000007.seg: cannot be read"):
        reader.read(9)
