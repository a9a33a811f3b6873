"""A run.json without its checksum keys is refused by every command that reads a run (issue 30, 3).

Before: removing `manifest_sha256` and `trace_first_step` made any manifest pass for one
"recorded before checksums" (two notes, exit 0), after which edited seeds, learning rates,
program hashes and checkpoint lists were believed, and deleted leading segments called
complete. Now a current-format manifest without them is damage for every command, with or
without `--trust-unchecked-manifest`; a genuinely old (format_version 1) manifest without a
checksum is refused unless that flag is given, and then read with one note saying what is
unchecked. The intact copy is accepted by the same commands, so a check that refused every
run would fail here too.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import traces

from tests.cli_util import assert_one_line_error, invoke
from tests.replay.test_cli_show import make_run
from traces import write_manifest

V1_RUN = Path(__file__).resolve().parents[1] / "traces" / "fixtures" / "v1_run"
VOUCHING = ("identical", "bit-exact", "complete")


def _strip(run: Path, **changes) -> Path:
    manifest = json.loads((run / "run.json").read_text())
    del manifest["manifest_sha256"], manifest["trace_first_step"]
    manifest.update(changes)
    (run / "run.json").write_text(json.dumps(manifest, indent=2))
    return run


def _without_checkpoints(run: Path) -> Path:
    """make_run's manifest lists checkpoints it never wrote; bisect checks the listed ones exist."""
    manifest = json.loads((run / "run.json").read_text())
    manifest["checkpoints"] = []
    write_manifest(run / "run.json", manifest)
    return run


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("unchecked")
    intact = _without_checkpoints(make_run(root / "intact"))
    _without_checkpoints(make_run(root / "intact2"))  # a second, equal run: bisect compares two runs
    stripped = make_run(root / "stripped")
    _strip(stripped, config={"preset": "tiny", "seed": 8, "steps": 6, "model": {"n_layers": 1, "d_model": 8}})
    (stripped / "trace" / "000000000000.seg").rename(root / "moved-away.seg")  # and its leading segment deleted
    old = root / "old"
    shutil.copytree(V1_RUN, old)
    _strip(old)
    return {"intact": intact, "stripped": stripped, "old": old, "root": root}


def _commands(run: Path, other: Path, out: Path) -> dict[str, list[str]]:
    return {
        "show": ["show", str(run)],
        "show --verify": ["show", str(run), "--verify", "--json"],
        "run": ["run", str(run), "--steps", "1:2"],
        "bisect A": ["bisect", str(run), str(other)],
        "bisect B": ["bisect", str(other), str(run)],
        "audit": ["audit", str(run)],
        "spike": ["spike", str(run)],
        "verify": ["verify", str(run), "--steps", "1:2"],
        "compare": ["compare", str(run), str(other), "--eval"],
        "pack": ["pack", str(run), "--steps", "1:2", "--out", str(out)],
    }


COMMANDS = list(_commands(Path("r"), Path("o"), Path("x")))


@pytest.mark.parametrize("trust", [False, True], ids=["plain", "trusted"])
@pytest.mark.parametrize("command", COMMANDS)
def test_a_current_run_json_without_its_checksum_keys_is_refused_by_every_command(runs, command, trust, tmp_path):
    args = _commands(runs["stripped"], runs["intact"], tmp_path / "b.rpk")[command]
    result = invoke(*(["--trust-unchecked-manifest"] if trust else []), *args)
    line = assert_one_line_error(result, f"{runs['stripped']}/run.json")
    assert f"every format_version {traces.FORMAT_VERSION} run records" in line or "missing or its key damaged" in line
    assert not any(word in result.stdout.lower() for word in VOUCHING), result.stdout
    assert not (tmp_path / "b.rpk").exists()


def test_the_intact_copy_is_read_by_the_same_commands(runs):
    assert invoke("show", str(runs["intact"])).exit_code == 0
    result = invoke("bisect", str(runs["intact"]), str(runs["root"] / "intact2"), "--no-refine")
    assert result.exit_code == 0 and "identical" in result.stdout.lower(), result.output
    audit = invoke("audit", str(runs["intact"]))  # its made-up hashes repeat examples: a finding (1), not a refusal
    assert audit.exit_code == 1 and "error:" not in audit.stderr, audit.output


@pytest.mark.parametrize("command", ["show", "bisect A", "bisect B", "audit", "run", "pack"])
def test_an_old_run_without_a_checksum_is_refused_without_the_flag(runs, command, tmp_path):
    args = _commands(runs["old"], runs["intact"], tmp_path / "b.rpk")[command]
    assert_one_line_error(invoke(*args), f"{runs['old']}/run.json", "--trust-unchecked-manifest")


def test_an_old_run_is_read_with_the_flag_and_one_note_saying_what_is_unchecked(runs):
    result = invoke("--trust-unchecked-manifest", "show", str(runs["old"]))
    assert result.exit_code == 0, result.output
    notes = [line for line in result.stderr.splitlines() if "run.json" in line]
    assert len(notes) == 1 and "has no checksum" in notes[0], result.stderr
    assert "program hash" in notes[0] and "checkpoint list" in notes[0] and "where the trace starts" in notes[0]
    assert invoke("show", str(runs["old"])).exit_code == 2  # the flag held for that command only
