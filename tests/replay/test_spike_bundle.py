"""`replay spike` on a bundle names the bundle file (BUNDLE, BUNDLE:member), never the temporary
folder it was unpacked to, in its errors, its report and its notes (issue 30: it named the folder).
And the note saying why a run's entry point was not imported keeps its whole instruction: it was
cut at 160 characters, mid-word ("pass --allow-cod").
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.cli_util import assert_one_line_error, invoke, last_json
from tests.replay.test_exported import record
from traces.run import write_manifest

TEMP = "replay-bundle-"  # replay/bundle/format.py's prefix for the folder a bundle is unpacked to


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Path:
    return record(tmp_path_factory.mktemp("spike_bundle") / "run")  # 12 steps, checkpoints 0, 5, 10, 12


@pytest.fixture(scope="module")
def bundle(recorded) -> Path:
    out = recorded.parent / "bug.rpk"
    assert invoke("pack", str(recorded), "--steps", "8:11", "-o", str(out)).exit_code == 0  # checkpoint 5, trace 5..11
    return out


@pytest.mark.parametrize("args, needles", [
    (("--metric", "nope"), ("records no metric named 'nope'",)),
    ((), ("too few for a baseline",)),
])
def test_spike_errors_name_the_bundle(bundle, args, needles):
    line = assert_one_line_error(invoke("spike", str(bundle), *args), f"{bundle}", *needles)
    assert TEMP not in line


def test_spike_scan_and_step_reports_name_the_bundle(bundle):
    scan = invoke("spike", str(bundle), "--window", "5", "--json")
    assert scan.exit_code == 0, scan.output
    assert last_json(scan)["run"] == str(bundle)
    step = invoke("spike", str(bundle), "--step", "10", "--window", "5", "--json")
    assert step.exit_code == 0, step.output
    report = last_json(step)
    assert report["run"] == str(bundle) and report["replay"]["all_bit_exact"], report
    assert TEMP not in step.stdout and TEMP not in step.stderr
    assert any("exported program" in n for n in report["notes"])


def test_the_entry_point_note_keeps_its_whole_instruction(recorded, tmp_path):
    """A run whose entry point is in a folder replay imports from only with --allow-code: replayed
    from its exported program, with a note that ends in what to do, whole, in JSON and in the table."""
    run = tmp_path / "run"
    shutil.copytree(recorded, run)
    folder = tmp_path / ("a_checkout_folder_with_a_rather_long_name_" * 3) / "src"
    folder.mkdir(parents=True)
    (folder / "issue30_note_loop.py").write_text("def make(config):\n    raise SystemExit('never called')\n")
    manifest = json.loads((run / "run.json").read_text())
    manifest.update(entrypoint="issue30_note_loop:make", entrypoint_path=str(folder))
    write_manifest(run / "run.json", manifest)
    result = invoke("run", str(run), "--steps", "9:10", "--json")
    assert result.exit_code == 0, result.output
    note = last_json(result)["notes"][0]
    assert note.startswith("replayed from the exported program") and len(note) > 200, note
    assert note.endswith("pass --allow-code to run that code, or install issue30_note_loop)"), note
    table = invoke("run", str(run), "--steps", "9:10")
    assert table.exit_code == 0, table.output
    words = " ".join(w for line in table.stdout.splitlines() for w in line.strip("│ ").split())
    assert "install issue30_note_loop)" in words, table.stdout
