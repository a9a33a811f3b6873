"""Damaged runs and bundles are refused by bisect, run, pack and show, one line naming the damage;
--allow-damaged compares what can be read and says so; a replay bisect needs that fails is an
error after the trace scan's report, never a note and exit 0; --json never crashes on NaN.

Synthetic runs only (traces, no training): every test here runs in well under a second.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from replay.bundle.pack import _write_bundle
from replay.engine.engine import ReplayReport, StepResult
from tests.cli_util import assert_one_line_error, dir_digest, invoke
from tests.traces.helpers import make_record, make_schema
from traces import FieldDiff, Run

STEPS, PER_SEGMENT = 12, 4  # three segment files: 000000000000.seg, 000000000004.seg, 000000000008.seg
FIRST_SEGMENT = "000000000000.seg"


@pytest.fixture(autouse=True)
def _no_debug(monkeypatch):
    monkeypatch.delenv("REPLAY_DEBUG", raising=False)


def make_run(path: Path, schema=None, change=None, environment=None) -> Path:
    """A complete synthetic run of STEPS steps in segments of PER_SEGMENT records."""
    schema = schema or make_schema()
    manifest = {"config": {"seed": 3, "steps": STEPS}, "environment": environment or {"backend": "cpu"},
                "checkpoints": []}
    run = Run.create(path, schema, manifest)
    w = run.writer(segment_records=PER_SEGMENT)
    for k in range(STEPS):
        rec = make_record(schema, k)
        w.append(change(k, rec) if change else rec)
    run.finish()
    return path


def truncate(path: Path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


@pytest.fixture
def pair(tmp_path):
    return make_run(tmp_path / "A"), make_run(tmp_path / "B")


# ------------------------------------------------------------------------------ bisect


def test_bisect_refuses_a_truncated_trace_naming_the_file(pair):
    a, b = pair
    seg = b / "trace" / FIRST_SEGMENT
    truncate(seg, seg.stat().st_size // 2)
    before = dir_digest(b)
    result = invoke("bisect", str(a), str(b))
    assert_one_line_error(result, "run B", str(seg), "byte", "--allow-damaged")
    assert "identical" not in result.stdout
    assert dir_digest(b) == before


def test_bisect_refuses_a_trace_with_no_readable_step(pair):
    a, b = pair
    truncate(b / "trace" / FIRST_SEGMENT, 10)  # shorter than the segment header
    assert_one_line_error(invoke("bisect", str(a), str(b), "--no-refine"), str(b / "trace" / FIRST_SEGMENT))
    # Allowed, there is still nothing both traces hold: never "identical".
    allowed = invoke("bisect", str(a), str(b), "--no-refine", "--allow-damaged")
    assert_one_line_error(allowed, "nothing to compare")
    assert "identical" not in allowed.stdout


def test_allow_damaged_compares_the_readable_steps_and_says_so(pair):
    a, b = pair
    truncate(b / "trace" / FIRST_SEGMENT, (b / "trace" / FIRST_SEGMENT).stat().st_size // 2)
    text = invoke("bisect", str(a), str(b), "--no-refine", "--allow-damaged")
    assert text.exit_code == 0, text.output
    readable = Run.open(b).trace.end
    assert 0 < readable < PER_SEGMENT
    assert f"steps 0..{readable - 1} of A are identical to B" in text.stdout
    assert "B's trace is damaged" in text.stdout and FIRST_SEGMENT in text.stdout
    assert "identical:" not in text.stdout and "bit-identical" not in text.stdout
    report = json.loads(invoke("bisect", str(a), str(b), "--no-refine", "--allow-damaged", "--json").stdout)
    assert report["identical"] is False and report["identical_in_compared_steps"] is True
    assert report["compared"] == [0, readable] and FIRST_SEGMENT in report["damage"]["B"]


def test_allow_damaged_still_finds_a_divergence_before_the_damage(tmp_path):
    def change(step, rec):
        if step == 1:
            rec.metrics[0] += 1
        return rec

    a, b = make_run(tmp_path / "A"), make_run(tmp_path / "B", change=change)
    truncate(b / "trace" / "000000000008.seg", 40)
    result = invoke("bisect", str(a), str(b), "--no-refine", "--allow-damaged", "--json")
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert report["first_step"] == 1 and "000000000008.seg" in report["damage"]["B"]


def test_a_missing_leading_segment_is_damage_for_show_bisect_and_run(pair):
    a, b = pair
    (b / "trace" / FIRST_SEGMENT).unlink()
    before = dir_digest(b)
    shown = invoke("show", str(b), "--verify")
    assert_one_line_error(shown, "damaged", "missing")
    assert_one_line_error(invoke("bisect", str(a), str(b), "--no-refine"), "run B", "missing", "--allow-damaged")
    assert_one_line_error(invoke("run", str(b), "--steps", "5:6"), "damaged", "missing")
    assert dir_digest(b) == before


def test_run_on_a_damaged_trace_says_it_is_damaged_not_out_of_range(pair):
    _, b = pair
    seg = b / "trace" / FIRST_SEGMENT
    truncate(seg, seg.stat().st_size // 2)
    assert_one_line_error(invoke("run", str(b), "--steps", "2:3"), "is damaged", str(seg), "--allow-damaged")
    line = assert_one_line_error(invoke("run", str(b), "--steps", "2:3", "--allow-damaged"), "is damaged", str(seg))
    assert "outside" not in line


def test_spike_step_refuses_a_damaged_run(pair):
    _, b = pair
    (b / "trace" / FIRST_SEGMENT).unlink()
    assert_one_line_error(invoke("spike", str(b), "--step", "10", "--window", "5"), "is damaged", "missing")


# ------------------------------------------------------------------------------ bundles


def _rebundle_with_damaged_trace(tmp_path: Path, run: Path) -> Path:
    """A --lite bundle of `run` whose trace is cut short, with a valid header and sha256."""
    out = tmp_path / "good.rpk"
    assert invoke("pack", str(run), "--steps", "2:9", "--lite", "-o", str(out)).exit_code == 0
    staged = tmp_path / "staged"
    assert invoke("unpack", str(out), str(staged)).exit_code == 0
    seg = sorted((staged / "trace").iterdir())[0]
    truncate(seg, seg.stat().st_size // 2)
    damaged = tmp_path / "damaged.rpk"
    files = sorted(p for p in staged.rglob("*") if p.is_file() and p.name != "FROM_BUNDLE.json")  # unpack's mark
    _write_bundle(damaged, [("all", "", files, staged)], lite=True)
    return damaged


def test_a_bundle_with_a_damaged_trace_and_a_valid_checksum_is_refused(pair, tmp_path):
    a, _ = pair
    bundle = _rebundle_with_damaged_trace(tmp_path, a)
    from replay.bundle import verify

    verify(bundle)  # the checksum holds: the damage is inside
    line = assert_one_line_error(invoke("bisect", str(a), str(bundle), "--no-refine"), f"{bundle}:trace/", "damaged")
    assert "replay-bundle-" not in line  # the bundle file, not its temporary folder
    assert_one_line_error(invoke("show", str(bundle)), "damaged", f"{bundle}:trace/")
    dest = tmp_path / "out"
    assert_one_line_error(invoke("unpack", str(bundle), str(dest)), "damaged")
    assert not dest.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_unpack_that_fails_after_extracting_leaves_nothing(pair, tmp_path):
    a, _ = pair
    out = tmp_path / "b.rpk"
    assert invoke("pack", str(a), "--steps", "2:9", "--lite", "-o", str(out)).exit_code == 0
    staged = tmp_path / "staged"
    assert invoke("unpack", str(out), str(staged)).exit_code == 0
    manifest = json.loads((staged / "run.json").read_text())
    manifest["config"]["seed"] = 4  # edited after packing: the manifest's checksum no longer matches
    (staged / "run.json").write_text(json.dumps(manifest))
    bad = tmp_path / "edited.rpk"
    files = sorted(p for p in staged.rglob("*") if p.is_file() and p.name != "FROM_BUNDLE.json")  # unpack's mark
    _write_bundle(bad, [("all", "", files, staged)], lite=True)
    for dest in (tmp_path / "new", tmp_path / "empty"):
        if dest.name == "empty":
            dest.mkdir()
        assert_one_line_error(invoke("unpack", str(bad), str(dest)), "run.json")
        assert (not dest.exists()) if dest.name == "new" else not any(dest.iterdir())
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".new", ".empty"))]


def test_unpacked_bundle_manifest_verifies_and_records_where_the_trace_starts(pair, tmp_path):
    a, _ = pair
    out = tmp_path / "b.rpk"
    assert invoke("pack", str(a), "--steps", "2:9", "--lite", "-o", str(out)).exit_code == 0
    dest = tmp_path / "u"
    assert invoke("unpack", str(out), str(dest)).exit_code == 0
    raw = json.loads((dest / "run.json").read_text())
    assert "manifest_sha256" in raw and raw["trace_first_step"] == 2
    run = Run.open(dest)
    assert not run.notes and run.damage == []


def test_pack_refuses_a_damaged_run(pair, tmp_path):
    a, b = pair
    (b / "trace" / FIRST_SEGMENT).unlink()
    out = tmp_path / "b.rpk"
    assert_one_line_error(invoke("pack", str(b), "--steps", "5:6", "--lite", "-o", str(out)), "damaged")
    assert not out.exists()
    assert_one_line_error(invoke("pack", str(a), "--from-bisect", str(b), "--lite", "-o", str(out)), "damaged")
    assert not out.exists()


def test_pack_from_bisect_refuses_a_run_of_another_model(tmp_path):
    a = make_run(tmp_path / "A")
    other = make_schema()
    other = type(other)(**{**other.__dict__, "tensors": other.tensors[:-1]})
    b = make_run(tmp_path / "B", schema=other)
    out = tmp_path / "b.rpk"
    assert_one_line_error(invoke("pack", str(a), "--from-bisect", str(b), "--lite", "-o", str(out)), "different models")
    assert not out.exists()


# ------------------------------------------------------------------------------ failed replays


def test_a_replay_bisect_needs_that_fails_is_an_error_not_identical(tmp_path):
    """Traces without state fingerprints cannot vouch for the runs: bisect must replay, and the
    synthetic runs cannot be replayed here (no trainer config)."""
    schema = make_schema(layer=False)
    a, b = make_run(tmp_path / "A", schema), make_run(tmp_path / "B", schema)
    result = invoke("bisect", str(a), str(b))
    assert_one_line_error(result, "cannot be replayed here", "--no-refine")
    assert "steps 0..11 of A are identical to B" in result.stdout  # what the trace scan found ...
    assert "not known to be identical" in result.stdout and "identical:" not in result.stdout  # ... and no more
    js = invoke("bisect", str(a), str(b), "--json")
    assert js.exit_code == 2 and json.loads(js.stdout)["identical"] is False and json.loads(js.stdout)["error"]
    # --no-refine is the explicit opt-out: the trace scan alone, with a note.
    assert invoke("bisect", str(a), str(b), "--no-refine").exit_code == 0


def test_a_bug_in_the_refinement_replay_exits_3(tmp_path, monkeypatch):
    import replay.bisect.refine

    def broken(*args, **kwargs):
        raise ZeroDivisionError("boom")

    monkeypatch.setattr(replay.bisect.refine, "search_first_divergence", broken)
    monkeypatch.setattr("replay.engine.replayer.open_replayable", lambda run: object())
    schema = make_schema(layer=False)
    a, b = make_run(tmp_path / "A", schema), make_run(tmp_path / "B", schema)
    result = invoke("bisect", str(a), str(b))
    assert result.exit_code == 3, result.output
    assert "bug" in result.stderr and "ZeroDivisionError" in result.stderr
    assert "identical:" not in result.stdout and "not known to be identical" in result.stdout


def test_a_damaged_checkpoint_in_the_refinement_is_named_as_itself(tmp_path, monkeypatch):
    import replay.bisect.refine
    from replay.record.orbax_io import CheckpointDamagedError

    def damaged(*args, **kwargs):
        raise CheckpointDamagedError(f"{tmp_path}/B/checkpoints/10: checkpoint 10 is damaged: fingerprint mismatch")

    monkeypatch.setattr(replay.bisect.refine, "search_first_divergence", damaged)
    schema = make_schema(layer=False)
    a, b = make_run(tmp_path / "A", schema), make_run(tmp_path / "B", schema)
    line = assert_one_line_error(invoke("bisect", str(a), str(b)), "checkpoint 10 is damaged")
    assert "could not replay" not in line


def test_replayer_lets_a_damaged_checkpoint_and_a_bug_through(tmp_path, monkeypatch):
    from replay.engine import replayer
    from replay.record.orbax_io import CheckpointDamagedError

    class Rep:
        built = None

        def checkpoint_steps(self):
            return [10]

        def restore(self, k):
            raise CheckpointDamagedError(f"checkpoint {k} is damaged")

    r = replayer.Replayer("A", Run.open(make_run(tmp_path / "A")))
    r._rep = Rep()
    with pytest.raises(CheckpointDamagedError):
        r.restore(10)
    monkeypatch.setattr("replay.engine.protocol.load", lambda run: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        replayer.open_replayable(Run.open(tmp_path / "A"))


def test_unjudged_noise_floor_is_an_error(tmp_path):
    """Another backend: bits are not promised, so bisect judges the difference against the noise
    floor, which needs a replay; that failing must not leave the differences unjudged, exit 0 or 1."""
    def change(step, rec):
        if step == 5:
            rec.metrics[0] = np.nextafter(rec.metrics[0], np.float32(10))
        return rec

    a = make_run(tmp_path / "A")
    b = make_run(tmp_path / "B", change=change, environment={"backend": "gpu"})
    result = invoke("bisect", str(a), str(b))
    assert_one_line_error(result, "noise floor", "--no-refine")
    assert invoke("bisect", str(a), str(b), "--no-refine").exit_code == 1


# ------------------------------------------------------------------------------ run --json


def test_run_json_encodes_non_finite_values():
    from replay.engine.contract import Contract

    diff = FieldDiff("loss", "loss", a=1.5, b=math.nan, distance={"abs": None, "rel": None, "ulp": None, "nan": True})
    inf = FieldDiff("backward", "grad_norm", a=math.inf, b=2.0, distance={"abs": math.inf, "rel": math.nan, "ulp": 7})
    report = ReplayReport("run", 3, 3, 0, Contract(True, "bit-exact expected"), [StepResult(3, False, False, [diff, inf])])
    text = json.dumps(report.to_json(), allow_nan=False)  # strict JSON, as console.print_json writes it
    fields = json.loads(text)["first_mismatch"]["fields"]
    assert fields[0]["replayed"] is None and fields[0]["replayed_repr"] == "nan" and fields[0]["replayed_bits"]
    assert fields[0]["recorded"] == 1.5 and fields[0]["recorded_bits"] == "0x3fc00000"
    assert fields[1]["recorded"] is None and fields[1]["recorded_repr"] == "inf"
    assert fields[1]["distance"]["abs"] is None and fields[1]["distance"]["abs_repr"] == "inf"


def test_bisect_json_encodes_a_nan_metric(tmp_path):
    def nan_loss(step, rec):
        if step == 4:
            rec.metrics[0] = np.float32("nan")
        return rec

    a, b = make_run(tmp_path / "A"), make_run(tmp_path / "B", change=nan_loss)
    result = invoke("bisect", str(a), str(b), "--no-refine", "--json")
    assert result.exit_code == 1, result.output
    loss = next(f for f in json.loads(result.stdout)["fields"] if f["name"] == "loss")
    assert loss["b"] is None and loss["b_repr"] == "nan" and isinstance(loss["a"], float)
