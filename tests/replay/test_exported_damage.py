"""A run.json whose "exported" or "example_store" entry is damaged, re-checksummed as a damage
harness (or an attacker) does, is refused in one line naming run.json and the entry (exit 2), by
`run` and by `pack`, before anything compiles. Before issue 30 a missing sha256 was
`KeyError: 'sha256'`, an internal error (exit 3), and a file named "../x" was read and written
outside the run. And `replay verify` on a replay.init run is one line (exit 2) before anything
compiles or prints (it was `AttributeError: ... 'built'`, exit 3, after a status line).
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest

from tests.cli_util import assert_one_line_error, dir_digest, invoke
from tests.replay.test_exported import record
from traces.run import write_manifest


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    return record(tmp_path_factory.mktemp("exported_damage") / "run", steps=6)


def _without(entry: dict, key: str) -> dict:
    return {k: v for k, v in entry.items() if k != key}


def _leaf(entry: dict, what: str, **change) -> dict:
    leaves = copy.deepcopy(entry[what])
    leaves[0].update(change)
    return {**entry, what: leaves}


# (name, change to the "exported" entry, change to the "example_store" entry, words of the line)
DAMAGES = [
    ("no sha256", lambda e: _without(e, "sha256"), None, "sha256 is missing"),
    ("sha256 a number", lambda e: {**e, "sha256": 12}, None, "sha256 is 12"),
    ("no file", lambda e: _without(e, "file"), None, "file is missing"),
    ("file outside the run", lambda e: {**e, "file": "../../elsewhere.jaxexport"}, None, "file is"),
    ("absolute file", lambda e: {**e, "file": "/etc/passwd"}, None, "file is"),
    ("devices a bool", lambda e: {**e, "devices": True}, None, "devices is True"),
    ("no devices", lambda e: {**e, "devices": 0}, None, "devices is 0"),
    ("state not a list", lambda e: {**e, "state": {"a": 1}}, None, "state is not a list"),
    ("a state leaf without a shape", lambda e: _leaf(e, "state", shape="3"), None, "state[0]"),
    ("a batch leaf without a path", lambda e: _leaf(e, "batch", path=None), None, "batch[0]"),
    ("no record keys", lambda e: _without(e, "record"), None, "record is missing"),
    ("a mesh over other devices", lambda e: {**e, "mesh": {"axes": ["d"], "shape": [4]}}, None, "mesh"),
    ("another format", lambda e: {**e, "format": 7}, None, "format 7"),
    ("not an object", lambda e: "program/step.jaxexport", None, "a str, not an object"),
    ("store file outside the run", None, lambda s: {**s, "file": "../rows.bin"}, "file '../rows.bin'"),
    ("store leaf of object dtype", None, lambda s: _leaf(s, "leaves", dtype="object"), "leaves[0]"),
    ("store batch axis text", None, lambda s: {**s, "batch_axis": "0"}, "batch_axis"),
]


def _damaged(run: Path, tmp_path: Path, exported, store) -> Path:
    out = tmp_path / "damaged"
    shutil.copytree(run, out)
    manifest = json.loads((out / "run.json").read_text())
    if exported is not None:
        manifest["exported"] = exported(manifest["exported"])
    if store is not None:
        manifest["example_store"] = store(manifest["example_store"])
    write_manifest(out / "run.json", manifest)  # a valid checksum over the damaged manifest
    return out


@pytest.mark.parametrize("name, exported, store, words", DAMAGES, ids=[d[0] for d in DAMAGES])
def test_a_damaged_exported_entry_is_one_line_naming_run_json(run, tmp_path, name, exported, store, words):
    damaged = _damaged(run, tmp_path, exported, store)
    before = dir_digest(damaged)
    entry = "exported" if exported is not None else "example_store"
    line = assert_one_line_error(invoke("run", str(damaged), "--steps", "1:3"),
                                 str(damaged / "run.json"), f'"{entry}" entry is damaged', words)
    assert "internal error" not in line
    assert dir_digest(damaged) == before


@pytest.mark.parametrize("name, exported, store, words", [DAMAGES[0], DAMAGES[3], DAMAGES[14]],
                         ids=[DAMAGES[i][0] for i in (0, 3, 14)])
def test_pack_refuses_a_damaged_exported_entry(run, tmp_path, name, exported, store, words):
    damaged = _damaged(run, tmp_path, exported, store)
    entry = "exported" if exported is not None else "example_store"
    assert_one_line_error(invoke("pack", str(damaged), "--steps", "2:3", "-o", str(tmp_path / "b.rpk")),
                          str(damaged), f'"{entry}" entry is damaged', words)
    assert not (tmp_path / "b.rpk").exists() and not (tmp_path / "rows.bin").exists()


def test_verify_refuses_a_replay_init_run_before_compiling(run):
    """In this one-device process: one line naming what verify needs (three devices to out-vote a bad
    one); nothing printed before it (no contract line, no bar). On four devices the same run is
    verified (tests/examples/test_verify_loops.py)."""
    line = assert_one_line_error(invoke("verify", str(run), "--steps", "1:3"), str(run), "at least 3 devices",
                                 "xla_force_host_platform_device_count")
    assert "internal error" not in line


@pytest.mark.parametrize("name, exported, store, words", DAMAGES[:3] + DAMAGES[-2:], ids=[d[0] for d in DAMAGES[:3] + DAMAGES[-2:]])
def test_a_damaged_exported_entry_is_refused_by_commands_that_replay_nothing(run, tmp_path, name, exported, store, words):
    """The traces of a run and its damaged copy agree, so bisect used to call them identical (exit 0)
    over a manifest no replay could use; show and audit read it as intact."""
    damaged = _damaged(run, tmp_path, exported, store)
    entry = "exported" if exported is not None else "example_store"
    for args in (("bisect", str(run), str(damaged)), ("bisect", str(damaged), str(run)), ("show", str(damaged)),
                 ("audit", str(damaged))):
        assert_one_line_error(invoke(*args), str(damaged / "run.json"), f'"{entry}" entry is damaged', words)
    assert invoke("show", str(run)).exit_code == 0  # the intact run is read
