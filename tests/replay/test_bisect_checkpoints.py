"""`replay bisect` when the traces agree (issue 30, 8): traces say nothing of the checkpoint files,
so before an agreeing verdict every listed checkpoint of both runs is checked present and
structurally intact (replay/record/checkpoint_check.py, no restore); a damaged one is one `error:`
line naming it, exit 2, and nothing vouching on stdout. What is not read (the array bytes) the
verdict says it did not compare.

The session's 20-step tiny run (checkpoints 0, 10, 20; tests/tiny_run.py) is A; B is a copy of it,
damaged per case (checkpoint 10).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.cli_util import assert_one_line_error, invoke
from tests.tiny_run import tiny_run
from traces import Run

VOUCHING = ("identical", "bit-exact", "complete")
MID = 10  # the damaged checkpoint: the middle one of three


@pytest.fixture(scope="module")
def trained() -> Path:
    """The session's tiny run (tests/tiny_run.py): read only."""
    path = tiny_run()
    assert Run.open(path).manifest["checkpoints"] == [0, MID, 2 * MID]
    return path


def data_files(run: Path, step: int) -> list[Path]:
    """Checkpoint `step`'s OCDBT data files, smallest first (the largest holds parameter bytes)."""
    files = [p for p in (run / "checkpoints" / str(step)).rglob("*") if p.is_file() and p.parent.name == "d"]
    return sorted(files, key=lambda p: (p.stat().st_size, p.name))


def test_agreeing_traces_are_identical_and_say_the_checkpoint_contents_were_not_compared(trained, tmp_path):
    b = shutil.copytree(trained, tmp_path / "B")
    result = invoke("bisect", str(trained), str(b))
    assert result.exit_code == 0, result.output
    assert "identical: steps 0..19" in result.stdout
    assert "checkpoints not compared: the 3 of A and 3 of B are present and structurally intact" in result.stdout
    assert "contents unread" in result.stdout
    data = json.loads(invoke("bisect", str(trained), str(b), "--json").stdout)
    assert data["identical"] is True
    assert data["checkpoints"] == {"A": 3, "B": 3, "checked": "structure", "contents_compared": False}


def _delete_folder(b: Path) -> str:
    shutil.rmtree(b / "checkpoints" / str(MID))
    return "its folder is missing"


def _delete_item_metadata(b: Path) -> str:
    (b / "checkpoints" / str(MID) / "default" / "_METADATA").unlink()
    return "default/_METADATA is missing"


def _garble_commit_record(b: Path) -> str:
    (b / "checkpoints" / str(MID) / "_CHECKPOINT_METADATA").write_text("{")
    return "_CHECKPOINT_METADATA is unreadable"


def _truncate_ocdbt_manifest(b: Path) -> str:
    os.truncate(b / "checkpoints" / str(MID) / "default" / "manifest.ocdbt", 50)
    return "default: "


def _delete_largest_data_file(b: Path) -> str:
    data_files(b, MID)[-1].unlink()
    return "is missing or cut short"


def _truncate_largest_data_file(b: Path) -> str:
    target = data_files(b, MID)[-1]
    os.truncate(target, target.stat().st_size // 3)
    return "default: "


@pytest.mark.parametrize("damage", [_delete_folder, _delete_item_metadata, _garble_commit_record,
                                    _truncate_ocdbt_manifest, _delete_largest_data_file, _truncate_largest_data_file])
def test_a_structurally_damaged_checkpoint_is_never_called_identical(trained, tmp_path, damage):
    b = shutil.copytree(trained, tmp_path / "B")
    needle = damage(b)
    for args in ([], ["--no-refine"], ["--json"]):
        result = invoke("bisect", str(trained), str(b), *args)
        assert_one_line_error(result, f"run B: {b}/checkpoints/{MID}: checkpoint {MID} is damaged", needle)
        assert not any(word in result.stdout for word in VOUCHING), result.stdout
    # Either order: the damaged run is named as itself.
    assert_one_line_error(invoke("bisect", str(b), str(trained)), "run A: ", f"checkpoint {MID} is damaged")
