"""Random byte flips and truncations of trace files and run.json: always detected, never read as valid."""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from traces import Run, TraceError, same_bits
from tests.traces.helpers import make_record, make_schema

N_STEPS = 40


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz") / "run"
    schema = make_schema()
    run = Run.create(path, schema, {})
    w = run.writer(segment_records=15)  # two sealed segments and an open one
    for k in range(N_STEPS):
        w.append(make_record(schema, k))
    run.finish()
    files = sorted((path / "trace").glob("*.seg"))
    return path, schema, files


@pytest.fixture(scope="module")
def damaged(pristine, tmp_path_factory):
    """One copy of the run that every example damages in one file and puts back afterwards (a fresh
    copy per example cost most of the fuzz tests' time). Afterwards every file of the copy must
    still be the pristine run's: an example that left damage behind, or a reader that wrote into
    the run, would show here."""
    path, schema, files = pristine
    copy = tmp_path_factory.mktemp("fuzz_copy") / "run"
    shutil.copytree(path, copy, ignore=shutil.ignore_patterns(".lock"))
    expected = {k: make_record(schema, k) for k in range(N_STEPS)}  # made once, not per record read
    yield copy, schema, [copy / "trace" / f.name for f in files], expected
    assert _tree_bytes(copy) == _tree_bytes(path, skip=".lock")


def _tree_bytes(root, skip: str = "") -> dict[str, bytes]:
    return {str(f.relative_to(root)): f.read_bytes() for f in sorted(root.rglob("*")) if f.is_file() and f.name != skip}


def _check_damaged(damaged, file_index, position, mutation, value):
    copy, schema, targets, expected = damaged
    target = targets[file_index % len(targets)]
    original = target.read_bytes()
    data = bytearray(original)
    at = position % len(data)
    if mutation == "flip":
        data[at] ^= value or 1
    else:
        del data[at:]
    target.write_bytes(bytes(data))
    try:
        _assert_detected_and_never_wrong(copy, schema, expected)
    finally:
        target.write_bytes(original)


def _assert_detected_and_never_wrong(copy, schema, expected):
    try:
        run = Run.open(copy)
        trace = run.trace
        damage = trace.verify()
        readable = []
        for step in range(trace.start, trace.end):
            try:
                readable.append(trace.read(step))
            except TraceError:
                pass
    except TraceError:
        return  # refused with a one-line error: detected
    assert damage, "damage went unnoticed"
    for rec in readable:
        assert same_bits(schema, rec, expected[rec.step]), f"wrong record returned for step {rec.step}"


settings_ = settings(max_examples=1200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
                     derandomize=True)


@pytest.mark.slow
@settings_
@given(file_index=st.integers(0, 2), position=st.integers(0, 10**6), value=st.integers(1, 255))
def test_byte_flips_are_detected(damaged, file_index, position, value):
    _check_damaged(damaged, file_index, position, "flip", value)


@pytest.mark.slow
@settings_
@given(file_index=st.integers(0, 2), position=st.integers(0, 10**6))
def test_truncations_are_detected(damaged, file_index, position):
    _check_damaged(damaged, file_index, position, "truncate", 0)


def test_the_fuzz_oracle_sees_damage_it_should(pristine, damaged):
    # A flip in the first record's body must be reported; an untouched copy must not be, nor the
    # shared copy once the damage is put back (what every fuzz example relies on).
    path, schema, files = pristine
    copy, _, targets, _ = damaged
    original = targets[0].read_bytes()
    data = bytearray(original)
    data[40] ^= 0x10
    targets[0].write_bytes(bytes(data))
    try:
        assert Run.open(copy).trace.verify()
    finally:
        targets[0].write_bytes(original)
    assert Run.open(copy).trace.verify() == []
    assert Run.open(path).trace.verify() == []


# ------------------------------------------------------------------------------ run.json

MANIFEST = {
    "config": {"preset": "tiny", "seed": 7, "steps": 40, "lr": 0.0003, "model": {"n_layers": 2, "d_model": 64},
               "mesh": {"data": 1, "mesh_invariant": False}, "name": "fuzz ünïcode"},
    "environment": {"backend": "cpu", "device_count": 1, "xla_flags": "", "versions": {"jax": "0.4.30"}},
    "data": {"source": "embedded", "fingerprint": "0123456789abcdef", "tokens": 123456},
    "program_hash": "9f" * 32,
    "faults": [],
}


@pytest.fixture(scope="module")
def pristine_manifest(tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz_manifest") / "run"
    schema = make_schema()
    run = Run.create(path, schema, MANIFEST)
    run.writer().append(make_record(schema, 0))
    run.update_manifest(checkpoints=[0, 10, 20])
    run.finish()
    return path, (path / "run.json").read_bytes(), _canonical(Run.open(path).manifest)


def _canonical(manifest: dict) -> str:
    return json.dumps(manifest, sort_keys=True, separators=(",", ":"))


def _open_damaged_manifest(path, fd: int, data: bytes, original: str) -> str:
    """'refused' (one line naming run.json) or 'identical' (parses to exactly the recorded content)."""
    # In place through one open fd, never growing it back: re-opening with O_TRUNC, or truncating
    # to zero and rewriting, costs milliseconds on some filesystems and this runs ~16,000 times.
    if os.fstat(fd).st_size != len(data):
        os.ftruncate(fd, len(data))
    os.pwrite(fd, data, 0)
    try:
        run = Run.open(path)
    except TraceError as e:
        assert "\n" not in str(e) and f"{path}" in str(e) and "run.json" in str(e), str(e)
        return "refused"
    assert _canonical(run.manifest) == original, "a damaged run.json was read as different content"
    assert run.notes == [], run.notes  # never mistaken for a manifest from before checksums
    return "identical"


@pytest.fixture(scope="module")
def manifest_copy(pristine_manifest, tmp_path_factory):
    path, data, original = pristine_manifest
    copy = tmp_path_factory.mktemp("fuzz_manifest_copy") / "run"
    shutil.copytree(path, copy, ignore=shutil.ignore_patterns(".lock"))
    fd = os.open(copy / "run.json", os.O_RDWR)
    yield copy, fd, data, original
    os.close(fd)


def test_every_bit_flip_and_truncation_of_run_json_is_refused_or_identical(manifest_copy):
    copy, fd, data, original = manifest_copy
    seen = Counter()
    for at in range(len(data)):
        for bit in range(8):
            damaged = bytearray(data)
            damaged[at] ^= 1 << bit
            seen[_open_damaged_manifest(copy, fd, bytes(damaged), original)] += 1
    for at in reversed(range(len(data))):  # shortest last, so the file only ever shrinks
        seen[_open_damaged_manifest(copy, fd, data[:at], original)] += 1
    # Only flips and cuts in whitespace may leave the content as recorded; everything else is refused.
    assert seen["refused"] > 0.9 * 9 * len(data), seen
    assert _open_damaged_manifest(copy, fd, data, original) == "identical" and seen["identical"] > 0


@pytest.mark.slow
@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
          derandomize=True)
@given(damage=st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)), min_size=1, max_size=4),
       cut=st.one_of(st.none(), st.integers(0, 10**6)))
def test_random_damage_to_run_json_is_refused_or_identical(manifest_copy, damage, cut):
    copy, fd, data, original = manifest_copy
    damaged = bytearray(data)
    for position, value in damage:
        damaged[position % len(data)] ^= value
    if cut is not None:
        del damaged[cut % len(data):]
    _open_damaged_manifest(copy, fd, bytes(damaged), original)
