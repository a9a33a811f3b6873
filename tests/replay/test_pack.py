"""`replay pack` / `replay unpack` and bundles accepted wherever a run is (replay/bundle/__init__.py).

Fast tests use synthetic runs (traces only); the slow ones train `tiny` runs: a bundle of steps
10:20 replays 11 of 11 steps bit-exactly in another folder after the run and its token file are
deleted, and a --lite bundle of a 1,000-step run is small and accepted by show and bisect.

The REPORT.md fixture (fixtures/REPORT.md) is the report of a real bundle: steps 10..20 of a
tiny run, packed with --from-bisect against the same run fed repeated data from step 15;
fixtures/tiny-10-20.lite.rpk is the --lite bundle of the same steps, whose trace holds the
records the report's numbers must match. Regenerate both with
`python -m tests.replay.test_pack /tmp/replay-fixture` (trains two tiny runs, about a minute).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import traces
from replay import bundle
from replay.cli.app import app
from tests.traces.helpers import make_record, make_schema

FIXTURES = Path(__file__).parent / "fixtures"
REPORT_FIXTURE = FIXTURES / "REPORT.md"
LITE_FIXTURE = FIXTURES / "tiny-10-20.lite.rpk"
SECTIONS = ("## Summary", "## The run", "## Environment", "## Steps covered", "## Metrics", "## How to replay")


def invoke(*args: str, cwd: Path | None = None):
    old = os.getcwd()
    if cwd is not None:
        os.chdir(cwd)
    try:
        return CliRunner().invoke(app, [str(a) for a in args], env={"REPLAY_DEBUG": None})
    finally:
        os.chdir(old)


def one_error_line(result, code: int = 2) -> str:
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and "Traceback" not in result.stderr + result.stdout
    return lines[0]


def synthetic_run(path: Path, steps: int = 30, change=None) -> Path:
    """A complete run of synthetic records; `change(step, record)` may alter a record."""
    schema = make_schema()
    manifest = {"config": {"seed": 3, "steps": steps, "model": {"n_layers": 1}}, "environment": {"backend": "cpu"},
                "checkpoints": []}
    run = traces.Run.create(path, schema, manifest)
    w = run.writer()
    for k in range(steps):
        rec = make_record(schema, k)
        w.append(change(k, rec) if change else rec)
    run.finish()
    return path


def check_report(text: str, records: dict, schema: traces.Schema, first: int, last: int, name: str, lite: bool) -> None:
    """REPORT.md has every section, and its numbers are the trace's."""
    assert text.startswith(f"# Bug report: steps {first}..{last} of ")
    for section in SECTIONS:
        assert f"\n{section}\n" in text, section
    assert f"- Steps covered: {first}..{last} ({last - first + 1} steps)" in text
    loss = schema.metric_index("loss")
    assert f"- Loss: {records[first].metrics[loss]!s} at step {first}, {records[last].metrics[loss]!s} at step {last}" in text
    table = text.split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]
    header = next(line for line in table.splitlines() if line.startswith("| step |"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    assert columns == ["step", *schema.metric_names, "batch hash"]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines() if re.match(r"\| \d+ \|", line)]
    assert [int(r[0]) for r in rows] == list(range(first, last + 1)) or len(rows) == bundle.MAX_TABLE_ROWS
    for row in rows:
        rec = records[int(row[0])]
        assert row[1:-1] == [str(v) for v in rec.metrics], row  # exact float32 reprs
        assert row[-1] == f"{rec.batch_hash:016x}"
    if lite:
        assert f"replay show {name}" in text and "does not replay" in text
    else:
        assert f"replay run {name} --steps {first}:{last}" in text
        assert f"Expected: `{last - first + 1} of {last - first + 1}` steps bit-exact" in text


def read_report(path: Path, tmp: Path) -> tuple[str, traces.Run]:
    dest = tmp / f"unpacked-{path.name}"
    bundle.unpack(path, dest)
    return (dest / bundle.REPORT).read_text(), traces.Run.open(dest)


# ------------------------------------------------------------------------------ the format


@pytest.fixture
def lite(tmp_path) -> tuple[Path, Path]:
    run = synthetic_run(tmp_path / "run")
    out = tmp_path / "b.rpk"
    result = invoke("pack", run, "--steps", "5:24", "--lite", "-o", out)
    assert result.exit_code == 0, result.stderr
    return run, out


def test_lite_bundle_holds_the_trace_bit_for_bit_and_show_reads_it(lite, tmp_path):
    run, out = lite
    header = bundle.verify(out)
    assert header.format_version == bundle.FORMAT_VERSION and header.lite
    dest = tmp_path / "u"
    result = invoke("unpack", out, dest)
    assert result.exit_code == 0, result.stderr
    # FROM_BUNDLE.json: unpack's mark that the folder came from a bundle (replay/engine/code.py)
    assert sorted(p.name for p in dest.iterdir()) == ["COMPLETE", "FROM_BUNDLE.json", "REPORT.md", "run.json", "trace"]
    original, unpacked = traces.Run.open(run), traces.Run.open(dest)
    assert unpacked.status == "complete" and (unpacked.trace.start, unpacked.trace.end) == (5, 25)
    for step in range(5, 25):
        assert traces.same_bits(original.schema, original.trace.read(step), unpacked.trace.read(step))
    assert unpacked.manifest["bundle"]["steps"] == [5, 24] and unpacked.manifest["checkpoints"] == []
    shown = invoke("show", out, "--json")
    assert shown.exit_code == 0, shown.stderr
    assert json.loads(shown.stdout)["steps"] == {"start": 5, "end": 25, "last": 24, "count": 20}
    recs = {s: original.trace.read(s) for s in range(5, 25)}
    check_report((dest / "REPORT.md").read_text(), recs, original.schema, 5, 24, "b.rpk", lite=True)


def test_pack_prints_size_and_what_takes_the_space(tmp_path):
    run = synthetic_run(tmp_path / "run")
    result = invoke("pack", run, "--steps", "0:29", "--lite", "-o", tmp_path / "x.rpk")
    assert result.exit_code == 0, result.stderr
    size = (tmp_path / "x.rpk").stat().st_size
    assert f"({size} bytes)" in result.stdout and "what takes the space" in result.stdout
    assert "trace" in result.stdout and "manifest and report" in result.stdout
    data = json.loads(invoke("pack", run, "--steps", "0:29", "--lite", "-o", tmp_path / "x.rpk", "--force",
                             "--json").stdout)
    assert data["size"] == size and sum(p["packed_bytes"] for p in data["parts"]) == size
    assert data["format_version"] == bundle.FORMAT_VERSION


def test_packing_twice_gives_the_same_bytes(lite, tmp_path):
    run, out = lite
    (tmp_path / "again").mkdir()
    again = tmp_path / "again" / out.name  # the report names the file
    assert invoke("pack", run, "--steps", "5:24", "--lite", "-o", again).exit_code == 0
    assert again.read_bytes() == out.read_bytes()


def test_pack_refuses_to_overwrite_without_force(lite):
    run, out = lite
    before = out.read_bytes()
    line = one_error_line(invoke("pack", run, "--steps", "0:3", "--lite", "-o", out))
    assert "already exists" in line and "--force" in line
    assert out.read_bytes() == before
    assert invoke("pack", run, "--steps", "0:3", "--lite", "-o", out, "--force").exit_code == 0
    assert out.read_bytes() != before


def _rewrite_prefix(data: bytes, version: int) -> bytes:
    prefix = struct.pack("<8sHH", bundle.MAGIC, version, bundle.HEADER_SIZE)
    head = prefix + struct.pack("<I", zlib.crc32(prefix)) + data[16:60]
    return head + struct.pack("<I", zlib.crc32(head)) + data[64:]


@pytest.mark.parametrize("damage, expected", [
    ("flip-payload", "content checksum mismatch"),
    ("flip-last", "content checksum mismatch"),
    ("flip-header", "header checksum"),
    ("truncate", "truncated bundle"),
    ("truncate-header", "truncated bundle"),
    ("trailing", "bytes after its end"),
    ("newer", "format_version 2, this replay reads up to 1: upgrade replay"),
    ("text", "not a replay bundle"),
    ("empty", "not a replay bundle"),
])
def test_bad_bundles_are_one_clear_line_and_exit_2(lite, tmp_path, damage, expected):
    _, out = lite
    data = out.read_bytes()
    bad = tmp_path / f"{damage}.rpk"
    if damage == "flip-payload":
        i = len(data) // 2
        bad.write_bytes(data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1:])
    elif damage == "flip-last":
        bad.write_bytes(data[:-1] + bytes([data[-1] ^ 0x80]))
    elif damage == "flip-header":
        bad.write_bytes(data[:9] + bytes([data[9] ^ 0x04]) + data[10:])
    elif damage == "truncate":
        bad.write_bytes(data[: len(data) - 100])
    elif damage == "truncate-header":
        bad.write_bytes(data[:20])
    elif damage == "trailing":
        bad.write_bytes(data + b"\0")
    elif damage == "newer":
        bad.write_bytes(_rewrite_prefix(data, 2))
    elif damage == "text":
        bad.write_text("step,loss\n0,2.3\n")
    else:
        bad.write_bytes(b"")
    for command in (("show", bad), ("unpack", bad, tmp_path / "dest"), ("bisect", bad, out), ("run", bad)):
        line = one_error_line(invoke(*command))
        assert expected in line and str(bad) in line, line
    assert not (tmp_path / "dest").exists()  # a failed unpack leaves nothing behind


def test_newer_bundle_is_told_apart_from_a_damaged_one(lite, tmp_path):
    _, out = lite
    newer = tmp_path / "newer.rpk"
    newer.write_bytes(_rewrite_prefix(out.read_bytes(), 7))
    with pytest.raises(bundle.NewerBundleError):
        bundle.read_header(newer)
    assert isinstance(bundle.NewerBundleError("x"), traces.NewerFormatError)


def test_replay_run_of_a_lite_bundle_says_it_cannot_replay(lite):
    _, out = lite
    line = one_error_line(invoke("run", out))
    assert "--lite bundle" in line and "not replayed" in line


def test_unpack_refuses_a_folder_that_is_not_empty(lite, tmp_path):
    _, out = lite
    dest = tmp_path / "full"
    dest.mkdir()
    (dest / "keep.txt").write_text("mine")
    line = one_error_line(invoke("unpack", out, dest))
    assert "not empty" in line
    assert [p.name for p in dest.iterdir()] == ["keep.txt"]


def test_bad_pack_requests_are_one_line(tmp_path):
    run = synthetic_run(tmp_path / "run")
    assert "outside the recorded steps 0..29" in one_error_line(invoke("pack", run, "--steps", "20:40", "--lite",
                                                                       "-o", tmp_path / "a.rpk"))
    assert "no checkpoint at or before step 5" in one_error_line(invoke("pack", run, "--steps", "5:9",
                                                                        "-o", tmp_path / "a.rpk"))
    assert "--steps A:B is required" in one_error_line(invoke("pack", run, "-o", tmp_path / "a.rpk"))
    assert "no such" in one_error_line(invoke("pack", tmp_path / "nope", "--steps", "1:2", "-o", tmp_path / "a.rpk"))
    assert not (tmp_path / "a.rpk").exists()


def test_spike_requests_that_cannot_work_are_one_line(tmp_path):
    run = synthetic_run(tmp_path / "run")
    out = tmp_path / "s.rpk"
    assert "outside the recorded steps" in one_error_line(invoke("pack", run, "--spike", "40", "--lite", "-o", out))
    assert "only 2 recorded steps before it" in one_error_line(invoke("pack", run, "--spike", "2", "--lite", "-o", out))
    assert not out.exists()


def test_from_bisect_puts_the_finding_in_the_report(tmp_path):
    """B feeds, at step 7, an example A and B already fed at step 3: bisect names data and the repeat."""
    a = synthetic_run(tmp_path / "a")

    def repeat(step, rec):
        if step == 7:
            rec.example_hashes[2] = make_record(make_schema(), 3).example_hashes[5]
        return rec

    b = synthetic_run(tmp_path / "b", change=repeat)
    out = tmp_path / "a.rpk"
    result = invoke("pack", a, "--from-bisect", b, "--lite", "-o", out)
    assert result.exit_code == 0, result.stderr
    assert "first divergence at step 7: data" in result.stdout
    text, unpacked = read_report(out, tmp_path)
    info = unpacked.manifest["bundle"]
    assert info["steps"] == [2, 9]  # around the divergence by default
    assert info["finding"]["step"] == 7 and info["finding"]["cause"] == "data"
    assert "\n## Finding\n" in text
    assert "| first divergent step | 7 |" in text and "| cause (first field in causal order) | data |" in text
    assert "at positions 2" in text and "already seen by B | 1 of them, first fed at steps 3" in text
    same = invoke("pack", a, "--from-bisect", a, "--lite", "-o", tmp_path / "same.rpk")
    assert "do not differ" in one_error_line(same)


def test_bisect_accepts_a_bundle_in_either_place(lite, tmp_path):
    run, out = lite
    for args in ((out, run), (run, out)):
        result = invoke("bisect", *args, "--json", "--no-refine")
        assert result.exit_code == 0, result.stderr
        report = json.loads(result.stdout)
        assert report["identical_in_compared_steps"] is True and report["compared"] == [5, 25]
        # Steps 5..24 cannot vouch for the runs' states, and a lite bundle cannot be replayed:
        # without --no-refine that is an error after the trace scan's report, never "identical".
        refused = invoke("bisect", *args, "--json")
        assert "could not replay the runs here" in one_error_line(refused)
        assert json.loads(refused.stdout)["identical"] is False


def test_sample_steps_keeps_ends_and_the_finding():
    assert bundle.sample_steps(3, 9) == list(range(3, 10))
    many = bundle.sample_steps(0, 999, keep=[517])
    assert many[0] == 0 and many[-1] == 999 and 517 in many and len(many) <= bundle.MAX_TABLE_ROWS + 1


def test_example_source_serves_the_carried_batches_with_the_original_permutation(tmp_path):
    from trainer.data import Batcher, DataError, open_example_file, open_source, write_example_file

    full = open_source("embedded:default")
    batcher = Batcher(full, 32, 16, data_seed=5)
    ids = np.concatenate([batcher.global_ids(s) for s in (3, 4, 900)])
    meta = write_example_file(tmp_path / "ex.npz", full, ids, 32)
    assert meta["examples"] == len(set(ids.tolist())) and meta["fingerprint"] == full.fingerprint()
    carried = open_example_file(tmp_path / "ex.npz", vocab_size=320)
    assert carried.n_tokens == full.n_tokens and carried.fingerprint() == full.fingerprint()
    small = Batcher(carried, 32, 16, data_seed=5)
    assert small.n_examples == batcher.n_examples
    for step in (3, 4, 900):
        a, b = batcher.batch_at(step), small.batch_at(step)
        assert np.array_equal(a.inputs_BxL, b.inputs_BxL) and np.array_equal(a.example_hashes, b.example_hashes)
    with pytest.raises(DataError, match="not among the"):
        small.batch_at(5)
    with pytest.raises(DataError, match="seq_len 32"):
        Batcher(carried, 16, 16, data_seed=5).batch_at(3)
    damaged = tmp_path / "bad.npz"
    damaged.write_bytes((tmp_path / "ex.npz").read_bytes()[:200])
    with pytest.raises(DataError, match="damaged"):
        open_example_file(damaged)
    with pytest.raises(DataError, match="vocab_size 7"):
        open_example_file(tmp_path / "ex.npz", vocab_size=7)


# ------------------------------------------------------------------------------ the fixture


def test_report_fixture_has_its_sections_and_the_traces_numbers(tmp_path):
    """fixtures/REPORT.md, a real bug report, against the trace of the same steps (the lite fixture)."""
    text = REPORT_FIXTURE.read_text()
    with pytest.raises(traces.UncheckedManifestError):  # packed before manifests had checksums
        read_report(LITE_FIXTURE, tmp_path)
    with traces.trusting_unchecked_manifests():  # what `replay --trust-unchecked-manifest` does
        (tmp_path / "trusted").mkdir()
        lite_text, run = read_report(LITE_FIXTURE, tmp_path / "trusted")
    info = run.manifest["bundle"]
    first, last = info["steps"]
    records = {s: run.trace.read(s) for s in range(first, last + 1)}
    check_report(text, records, run.schema, first, last, "tiny-10-20.rpk", lite=False)
    check_report(lite_text, records, run.schema, first, last, LITE_FIXTURE.name, lite=True)
    assert "\n## Finding\n" in text and "| first divergent step | 15 |" in text
    assert "| cause (first field in causal order) | data |" in text and "already seen by B" in text
    assert "| faults injected | none |" in text and "| trace level | layer" in text
    # The bundle's own environment and config, not the reader's, are in the report.
    env = run.manifest["environment"]
    assert f"| backend | {env['backend']} |" in text and f"| jax | {env['versions']['jax']} |" in text
    assert "replayed from the checkpoint at step 10" in text


# ------------------------------------------------------------------------------ real runs


def _train(root: Path, name: str, steps: int, *sets: str, faults=None):
    from trainer.config import apply_overrides
    from trainer.presets import get_preset
    from trainer.loop import train

    cfg = apply_overrides(get_preset("tiny"), [f"steps={steps}", *sets])
    train(cfg, root / name, preset="tiny", faults=faults(cfg) if faults else None)
    return root / name


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """Steps 10:20 of a tiny run on a token file, packed; then the run and the token file are deleted."""
    from trainer.data import open_source, write_token_file

    root = tmp_path_factory.mktemp("pack")
    tokens = root / "tokens.bin"
    write_token_file(tokens, np.asarray(open_source("embedded:default").tokens[:60000]), "uint16")
    run = _train(root, "run", 21, f"data.source={tokens}")
    out = root / "bug.rpk"
    result = invoke("pack", run, "--steps", "10:20", "-o", out)
    spiked = invoke("pack", run, "--spike", "18", "--lite", "-o", root / "spike.rpk")
    opened = traces.Run.open(run)
    records = {s: opened.trace.read(s) for s in range(opened.trace.start, opened.trace.end)}
    schema = opened.schema
    shutil.rmtree(run)
    tokens.unlink()
    return root, out, result, records, schema, spiked


@pytest.mark.slow
def test_full_bundle_replays_bit_exactly_elsewhere_without_the_run_or_its_data(packed, tmp_path):
    root, out, result, records, schema, _ = packed
    assert result.exit_code == 0, result.stderr
    assert "checkpoint" in result.stdout and "batch data" in result.stdout and "176 examples" in result.stdout
    assert not (root / "run").exists() and not (root / "tokens.bin").exists()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(out, elsewhere / "bug.rpk")
    proc = subprocess.run([sys.executable, "-m", "replay.cli.app", "run", "bug.rpk", "--steps", "10:20", "--json"],
                          cwd=elsewhere, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert (report["replayed"], report["bit_exact"], report["checkpoint"]) == (11, 11, 10)
    assert report["all_bit_exact"] and report["contract"]["expect_bits"]
    assert list(elsewhere.iterdir()) == [elsewhere / "bug.rpk"]  # nothing written next to it


@pytest.mark.slow
def test_full_bundle_report_numbers_match_the_trace(packed, tmp_path):
    root, out, result, records, schema, _ = packed
    text, run = read_report(out, tmp_path)
    check_report(text, records, schema, 10, 20, "bug.rpk", lite=False)
    assert "| faults injected | none |" in text and "checkpoint at step 10" in text
    assert sorted(p.name for p in run.path.iterdir()) == ["COMPLETE", "FROM_BUNDLE.json", "REPORT.md", "checkpoints",
                                                         "data", "run.json", "trace"]
    assert run.manifest["bundle"]["example_count"] == 11 * 16
    data = run.path / "data" / "examples.npz"
    from trainer.data import open_example_file

    source = open_example_file(data)
    assert source.n_tokens == 60000 and source.fingerprint() == run.manifest["data"]["fingerprint"]


@pytest.mark.slow
def test_spike_finding_replays_the_window_and_goes_into_the_report(packed, tmp_path):
    root, *_, records, schema, spiked = packed
    assert spiked.exit_code == 0, spiked.stderr
    text, run = read_report(root / "spike.rpk", tmp_path)
    finding = run.manifest["bundle"]["finding"]
    assert finding["kind"] == "spike" and finding["step"] == 18 and finding["window"] == 18
    assert run.manifest["bundle"]["steps"] == [0, 20]  # the baseline window and the step after
    assert finding["replay"]["all_bit_exact"] and finding["replay"]["checkpoint"] == 10
    assert finding["loss"]["loss"] == float(records[18].metrics[schema.metric_index("loss")])
    assert "\n## Finding\n" in text and "replay spike" in text and "| step | 18 |" in text
    assert "Examples with the largest loss at step 18" in text
    positions = [int(line.split("|")[1]) for line in text.split("Examples with the largest loss")[1].splitlines()
                 if re.match(r"\| \d+ \|", line)]
    losses = records[18].example_metrics[0]
    assert positions[0] == int(np.argmax(losses))


SMALLER_THAN_TINY = ("model.n_layers=1", "model.d_model=16", "model.d_ff=32", "model.n_heads=2", "model.n_kv_heads=1")


@pytest.mark.slow
def test_lite_bundle_of_1000_steps_is_small_and_show_and_bisect_accept_it(tmp_path):
    # A model smaller than tiny: at trace level step a record holds the step's metrics and its
    # examples' hashes and losses, nothing of the model's size, and its 1000 steps train 4x faster.
    run = _train(tmp_path, "long", 1000, "trace.level=step", "checkpoint.every_steps=0", *SMALLER_THAN_TINY)
    out = tmp_path / "long.rpk"
    result = invoke("pack", run, "--steps", "0:999", "--lite", "-o", out, "--json")
    assert result.exit_code == 0, result.stderr
    size = out.stat().st_size
    print(f"lite bundle of 1000 tiny steps (trace.level=step): {size} bytes")
    assert size < 300_000  # ~16 incompressible 8-byte example hashes and 16 float32 example losses a step
    assert json.loads(result.stdout)["size"] == size
    shown = invoke("show", out, "--json")
    assert shown.exit_code == 0, shown.stderr
    assert json.loads(shown.stdout)["steps"]["count"] == 1000
    bisected = invoke("bisect", out, run, "--json", "--no-refine")
    assert bisected.exit_code == 0, bisected.stderr
    # A trace at level step does not vouch for the states and a lite bundle cannot be replayed to
    # check them: without --no-refine, an error after the report, not "identical".
    assert "--lite bundle" in one_error_line(invoke("bisect", out, run))
    assert json.loads(bisected.stdout)["compared"] == [0, 1000]
    text, unpacked = read_report(out, tmp_path)
    records = {s: unpacked.trace.read(s) for s in range(1000)}
    check_report(text, records, unpacked.schema, 0, 999, "long.rpk", lite=True)


# ------------------------------------------------------------------------------ regenerate the fixture


def regenerate_fixture(root: Path) -> None:
    """Trains tiny and tiny with data-repeat@15, packs steps 10:20 with --from-bisect, writes the fixtures."""
    from trainer.faults import Fault, FaultPlan

    root.mkdir(parents=True, exist_ok=True)
    clean = _train(root, "tiny-clean", 25)
    faulty = _train(root, "tiny-data-repeat", 25, faults=lambda cfg: FaultPlan([Fault("data-repeat", 15)], cfg))
    for extra, name in (((), "tiny-10-20.rpk"), (("--lite",), LITE_FIXTURE.name)):
        result = invoke("pack", clean, "--steps", "10:20", "--from-bisect", faulty, *extra, "-o", root / name, "--force")
        assert result.exit_code == 0, result.stderr
    shutil.copy(root / LITE_FIXTURE.name, LITE_FIXTURE)
    dest = root / "unpacked"
    shutil.rmtree(dest, ignore_errors=True)
    bundle.unpack(root / "tiny-10-20.rpk", dest)
    shutil.copy(dest / bundle.REPORT, REPORT_FIXTURE)


if __name__ == "__main__":
    regenerate_fixture(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/replay-fixture"))
