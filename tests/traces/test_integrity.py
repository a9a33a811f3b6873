"""run.json's checksum, where the trace starts, and how damage is reported (issue 10: 2, 4, 5, 6)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from traces import (
    FORMAT_VERSION, Damage, ManifestCorruptError, NewerFormatError, Run, TraceCorruptError, TraceError, describe_damage,
    UncheckedManifestError, manifest_checksum, same_bits, trusting_unchecked_manifests, write_manifest,
)
from tests.traces.helpers import BytesRead, make_record, make_schema

MANIFEST = {
    "config": {"seed": 7, "steps": 30, "model": {"n_layers": 2, "d_model": 16}, "lr": 0.001},
    "environment": {"backend": "cpu", "device_count": 1, "versions": {"jax": "0.0-test"}},
    "data": {"source": "embedded", "fingerprint": "0123456789abcdef"},
    "program_hash": "ab" * 32,
    "checkpoints": [0, 10, 20],
}


def write_run(path, n=30, segment_records=7, finish=True, manifest=MANIFEST):
    schema = make_schema()
    run = Run.create(path, schema, manifest)
    w = run.writer(segment_records=segment_records)
    for k in range(n):
        w.append(make_record(schema, k))
    run.finish() if finish else run.close()
    return schema


def edit_manifest(path, change):
    """Edits run.json as a person would: load, change, dump (the stored checksum kept as it was)."""
    mpath = Path(path) / "run.json"
    manifest = json.loads(mpath.read_text())
    change(manifest)
    mpath.write_text(json.dumps(manifest, indent=2))


def assert_refused_naming_run_json(path, error=ManifestCorruptError):
    with pytest.raises(error) as info:
        Run.open(path)
    message = str(info.value)
    assert "\n" not in message and f"{path}/run.json" in message
    return message


# ------------------------------------------------------------------------------ run.json checksum


def test_manifest_carries_a_checksum_of_its_content(tmp_path):
    write_run(tmp_path / "run")
    stored = json.loads((tmp_path / "run" / "run.json").read_text())
    assert stored["manifest_sha256"] == manifest_checksum(stored)
    run = Run.open(tmp_path / "run")
    assert "manifest_sha256" not in run.manifest and run.manifest["config"] == MANIFEST["config"]
    assert run.notes == []


@pytest.mark.parametrize("change", [
    lambda m: m["config"].update(seed=8),
    lambda m: m["config"]["model"].update(d_model=32),
    lambda m: m["data"].update(fingerprint="fedcba9876543210"),
    lambda m: m.update(program_hash="cd" * 32),
    lambda m: m["checkpoints"].append(30),
    lambda m: m.update(trace_first_step=7),
    lambda m: m.update(extra="added later"),
    lambda m: m.pop("environment"),
], ids=["config", "nested-config", "data-fingerprint", "program-hash", "checkpoints", "trace-first-step", "added-key",
        "removed-key"])
def test_an_edited_manifest_is_refused_naming_run_json(tmp_path, change):
    write_run(tmp_path / "run", n=3)
    edit_manifest(tmp_path / "run", change)
    message = assert_refused_naming_run_json(tmp_path / "run")
    assert "changed or damaged after recording" in message
    with pytest.raises(ManifestCorruptError):
        Run.resume(tmp_path / "run")


@pytest.mark.parametrize("version", [-1, 0, "1", 1.5, True, None])
def test_a_format_version_that_is_not_a_positive_integer_is_refused(tmp_path, version):
    write_run(tmp_path / "run", n=3)
    edit_manifest(tmp_path / "run", lambda m: m.update(format_version=version))
    assert "format_version" in assert_refused_naming_run_json(tmp_path / "run")


def test_a_newer_format_version_asks_to_upgrade_before_checking_the_checksum(tmp_path):
    write_run(tmp_path / "run", n=3)
    edit_manifest(tmp_path / "run", lambda m: m.update(format_version=FORMAT_VERSION + 1))
    with pytest.raises(NewerFormatError, match="upgrade replay"):
        Run.open(tmp_path / "run")


def test_missing_schema_is_refused(tmp_path):
    write_run(tmp_path / "run", n=3)
    mpath = tmp_path / "run" / "run.json"
    manifest = json.loads(mpath.read_text())
    del manifest["schema"]
    write_manifest(mpath, manifest)  # a valid checksum over a manifest without a schema
    assert "schema" in assert_refused_naming_run_json(tmp_path / "run")


@pytest.mark.parametrize("first_step", [-1, "0", None, 1.0])
def test_a_trace_first_step_that_is_not_a_step_is_refused(tmp_path, first_step):
    write_run(tmp_path / "run", n=3)
    mpath = tmp_path / "run" / "run.json"
    write_manifest(mpath, {**json.loads(mpath.read_text()), "trace_first_step": first_step})  # checksum valid
    assert "trace_first_step" in assert_refused_naming_run_json(tmp_path / "run")


def test_a_null_checksum_is_refused(tmp_path):
    write_run(tmp_path / "run", n=3)
    edit_manifest(tmp_path / "run", lambda m: m.update(manifest_sha256=None))
    assert "does not match" in assert_refused_naming_run_json(tmp_path / "run")


def test_a_current_manifest_without_its_checksum_keys_is_refused(tmp_path):
    # Issue 30 (3): removing the two keys used to pass for "recorded before checksums" (two notes, exit 0),
    # after which any edit (seed, lr, program hash, checkpoints) and deleted leading segments were accepted.
    write_run(tmp_path / "run", n=3)
    edit_manifest(tmp_path / "run", lambda m: (m.pop("manifest_sha256"), m.pop("trace_first_step"),
                                               m["config"].update(seed=8)))
    message = assert_refused_naming_run_json(tmp_path / "run")
    assert "manifest_sha256 is missing or its key damaged" in message or f"every format_version {FORMAT_VERSION} run" in message
    with trusting_unchecked_manifests():  # the flag is for old runs only: a version-2 manifest always had its keys
        assert_refused_naming_run_json(tmp_path / "run")


def test_a_current_manifest_with_a_valid_checksum_but_no_trace_start_is_refused(tmp_path):
    write_run(tmp_path / "run", n=3)
    mpath = tmp_path / "run" / "run.json"
    manifest = json.loads(mpath.read_text())
    del manifest["trace_first_step"]
    write_manifest(mpath, manifest)  # re-checksummed, as a tool that edits and re-signs would
    assert "no trace_first_step" in assert_refused_naming_run_json(tmp_path / "run")


def test_a_downgraded_manifest_without_a_checksum_is_refused_even_when_trusted(tmp_path):
    write_run(tmp_path / "run", n=3)
    edit_manifest(tmp_path / "run", lambda m: (m.pop("manifest_sha256"), m.pop("trace_first_step"),
                                               m.update(format_version=1)))
    message = assert_refused_naming_run_json(tmp_path / "run", UncheckedManifestError)
    assert "--trust-unchecked-manifest" in message
    with trusting_unchecked_manifests():
        message = assert_refused_naming_run_json(tmp_path / "run")
    assert "its trace was written by format_version 2" in message


def _old_run_without_checksum(tmp_path) -> Path:
    """The version-1 fixture as a run recorded before checksums: no manifest_sha256, no trace_first_step."""
    import shutil

    shutil.copytree(Path(__file__).parent / "fixtures" / "v1_run", tmp_path / "old")
    edit_manifest(tmp_path / "old", lambda m: (m.pop("manifest_sha256"), m.pop("trace_first_step")))
    return tmp_path / "old"


def test_an_old_manifest_without_a_checksum_needs_the_explicit_trust(tmp_path):
    old = _old_run_without_checksum(tmp_path)
    message = assert_refused_naming_run_json(old, UncheckedManifestError)
    assert "--trust-unchecked-manifest" in message
    with trusting_unchecked_manifests():
        run = Run.open(old)
    assert run.manifest["format_version"] == 1 and run.trace.end == 3
    [note] = run.notes  # one line that says what is then unchecked
    assert "has no checksum" in note and "--trust-unchecked-manifest" in note
    assert "learning rate" in note and "where the trace starts" in note
    with pytest.raises(UncheckedManifestError):  # the trust ends with its context
        Run.open(old)


@pytest.mark.parametrize("damage", [
    lambda m: m.pop("manifest_sha256"),  # a checksum removed to get an edit accepted
    lambda m: m.update(manifest_sha257=m.pop("manifest_sha256"), config={}),  # a damaged key name, and content
    lambda m: (m.update(manifest_sha257=m.pop("manifest_sha256")), m.pop("trace_first_step")),
    lambda m: m.update(xyz=m.pop("manifest_sha256")),
], ids=["removed", "key-and-content", "key-and-first-step-key", "renamed"])
def test_a_lost_checksum_is_not_mistaken_for_a_manifest_from_before_checksums(tmp_path, damage):
    write_run(tmp_path / "run", n=3)
    edit_manifest(tmp_path / "run", damage)
    assert "manifest_sha256 is missing or its key damaged" in assert_refused_naming_run_json(tmp_path / "run")


def test_a_renamed_checksum_key_is_recognised_by_its_value(tmp_path):
    # An old run resumed by this replay: a checksum, but no trace_first_step to give a lost key away.
    write_run(tmp_path / "run", n=3)
    mpath = tmp_path / "run" / "run.json"
    manifest = json.loads(mpath.read_text())
    del manifest["trace_first_step"]
    write_manifest(mpath, manifest)
    edit_manifest(tmp_path / "run", lambda m: m.update(xyz=m.pop("manifest_sha256")))
    assert "manifest_sha256 is missing or its key damaged" in assert_refused_naming_run_json(tmp_path / "run")


def test_update_manifest_keeps_the_checksum_valid(tmp_path):
    schema = make_schema()
    run = Run.create(tmp_path / "run", schema, MANIFEST)
    run.writer().append(make_record(schema, 0))
    run.update_manifest(checkpoints=[0, 1], faults=("a", "b"))  # a tuple is stored as what JSON reads back
    assert run.manifest["faults"] == ["a", "b"]
    run.finish()
    assert Run.open(tmp_path / "run").manifest["checkpoints"] == [0, 1]


def test_write_manifest_replaces_a_stale_checksum(tmp_path):
    # A bundle copies a run's manifest, checksum included, then changes it: the copy must verify.
    write_run(tmp_path / "run", n=3)
    stale = json.loads((tmp_path / "run" / "run.json").read_text())
    stale["checkpoints"] = [0]
    write_manifest(tmp_path / "run" / "run.json", stale)
    assert Run.open(tmp_path / "run").manifest["checkpoints"] == [0]


# ------------------------------------------------------------------------------ where the trace starts


def test_deleted_leading_segments_are_damage(tmp_path):
    write_run(tmp_path / "run", n=30)  # segments at 0, 7, 14, 21, 28
    for name in ("000000000000.seg", "000000000007.seg"):
        (tmp_path / "run" / "trace" / name).unlink()
    run = Run.open(tmp_path / "run")
    assert run.first_step == 0 and run.trace.start == 14
    [damage] = run.damage
    assert damage.path == str(tmp_path / "run" / "trace" / "000000000000.seg") and damage.step == 0
    assert "steps 0..13" in damage.reason and "000000000014.seg" in damage.reason
    assert run.verify()[0] == damage
    with pytest.raises(TraceCorruptError, match="steps 0..13"):
        Run.resume(tmp_path / "run").writer()


def test_deleted_first_segment_of_a_crashed_run_is_damage(tmp_path):
    write_run(tmp_path / "run", n=10, finish=False)
    (tmp_path / "run" / "trace" / "000000000000.seg").unlink()
    [damage] = Run.open(tmp_path / "run").damage
    assert damage.step == 0 and "steps 0..6" in damage.reason


def test_a_run_may_start_its_trace_later_and_the_writer_holds_it_to_that(tmp_path):
    schema = make_schema()
    run = Run.create(tmp_path / "run", schema, {}, first_step=5)
    w = run.writer(segment_records=4)
    with pytest.raises(TraceError, match="starts at step 5"):
        w.append(make_record(schema, 0))
    for k in range(5, 12):
        w.append(make_record(schema, k))
    run.finish()
    run = Run.open(tmp_path / "run")
    assert (run.trace.start, run.trace.end, run.damage) == (5, 12, [])


def test_an_old_run_without_a_recorded_first_step_is_not_checked_and_says_so(tmp_path):
    old = _old_run_without_checksum(tmp_path)
    (old / "trace" / "000000000000.seg").unlink()
    with trusting_unchecked_manifests():
        run = Run.open(old)
    assert run.first_step is None and run.trace.start == 2
    assert run.damage == []  # nothing recorded to check against, and the note says so
    assert any("where the trace starts" in n for n in run.notes)


# ------------------------------------------------------------------------------ damage reports


def test_damage_before_many_segments_is_one_entry_for_all_of_them(tmp_path):
    write_run(tmp_path / "run", n=60)  # 9 segments
    seg = tmp_path / "run" / "trace" / "000000000007.seg"
    seg.write_bytes(seg.read_bytes()[: seg.stat().st_size // 2])  # loses its seal: scanned, torn
    damage = Run.open(tmp_path / "run").damage
    assert len(damage) == 2, damage
    assert damage[0].path == str(seg) and damage[0].step is not None
    assert damage[1].path.endswith("000000000014.seg")
    assert "7 later segment(s) unreachable: 000000000014.seg .. 000000000056.seg" in damage[1].reason
    line = describe_damage(damage)
    assert "\n" not in line and str(seg) in line and "(and 1 more damage)" in line


def test_describe_damage_names_file_byte_and_step():
    d = Damage("RUN/trace/000000000000.seg", 123, 4, "record checksum mismatch")
    assert describe_damage([d]) == "RUN/trace/000000000000.seg: damaged from byte 123 at step 4: record checksum mismatch"
    assert describe_damage([d, d, d]).endswith("(and 2 more damages)")


def test_damage_is_computed_once_per_run(tmp_path):
    write_run(tmp_path / "run", n=30)
    run = Run.open(tmp_path / "run")
    run.damage
    with BytesRead() as read:
        assert run.damage == []
    assert read.count < 200  # the counter's own reads of /proc/self/io, nothing of the run


def test_a_segment_path_that_is_a_directory_is_damage_not_a_crash(tmp_path):
    schema = write_run(tmp_path / "run", n=14, finish=False)  # two sealed segments; the next is 000000000014.seg
    (tmp_path / "run" / "trace" / "000000000014.seg").mkdir()
    run = Run.open(tmp_path / "run")
    [damage] = run.damage
    assert damage.path.endswith("000000000014.seg") and "is a directory" in damage.reason
    assert run.verify() == [damage]
    assert same_bits(schema, run.trace.read(13), make_record(schema, 13))
    with pytest.raises(TraceCorruptError, match="is a directory"):
        Run.resume(tmp_path / "run").writer()


def test_a_directory_in_place_of_a_middle_segment_is_damage(tmp_path):
    write_run(tmp_path / "run", n=30)
    seg = tmp_path / "run" / "trace" / "000000000007.seg"
    seg.unlink()
    seg.mkdir()
    damage = Run.open(tmp_path / "run").damage
    assert damage[0].path == str(seg) and damage[0].step == 7 and "is a directory" in damage[0].reason
    assert len(damage) == 2 and "3 later segment(s) unreachable" in damage[1].reason


def test_an_unreadable_segment_is_damage_naming_it(tmp_path, monkeypatch):
    import traces.segment

    write_run(tmp_path / "run", n=30)
    run = Run.open(tmp_path / "run")
    assert run.damage == []  # opened while readable
    real = traces.segment.open_fd

    def open_fd(p):
        if p.name == "000000000014.seg":
            raise PermissionError(13, "Permission denied", str(p))
        return real(p)

    monkeypatch.setattr(traces.segment, "open_fd", open_fd)
    with pytest.raises(TraceCorruptError, match=r"000000000014.seg: cannot be read \(Permission denied\)"):
        run.trace.read(15)  # a sealed segment, first read after opening
    assert "cannot be read" in run.verify()[0].reason


def test_opening_a_run_reads_headers_and_seals_not_whole_segments(tmp_path):
    write_run(tmp_path / "run", n=30)  # four sealed segments and an open one holding steps 28, 29
    trace = tmp_path / "run" / "trace"
    tail = (trace / "000000000028.seg").stat().st_size
    with BytesRead() as read:
        run = Run.open(tmp_path / "run")
        assert run.damage == [] and run.trace.end == 30
    small = sum(p.stat().st_size for p in (tmp_path / "run").iterdir() if p.is_file())  # run.json, COMPLETE
    # 28 + 20 bytes a sealed segment; the unsealed tail whole (its frames' checksums are checked)
    assert read.count <= small + 4 * 48 + 48 + tail + 200, read.count
    assert read.count < small + sum(p.stat().st_size for p in trace.glob("*.seg")) // 2
