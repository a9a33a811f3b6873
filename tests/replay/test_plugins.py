"""Plugins of the `replay` CLI (replay/plugins.py): the trainer's commands arrive through the
`replay.plugins` entry point, a broken plugin is one warning line, and a run's manifest reaches the
plugins' `prepare_process` before a command that replays it starts. In-process, on runs written
with the traces API alone: nothing here trains or compiles.
"""

from __future__ import annotations

from importlib.metadata import EntryPoint
from pathlib import Path

import numpy as np
import pytest

import traces
from replay import plugins
from tests.cli_util import assert_one_line_error, invoke

SEEN: list[dict] = []  # manifests given to this module's prepare_process, as a plugin


def prepare_process(manifest: dict) -> None:
    SEEN.append(manifest)


def _use(monkeypatch, *values: str) -> None:
    """These plugins and no others (the installed trainer's entry point included only if named)."""
    eps = tuple(EntryPoint(name=f"p{i}", value=v, group=plugins.GROUP) for i, v in enumerate(values))
    monkeypatch.setattr(plugins, "_entry_points", eps)
    monkeypatch.setattr(plugins, "_loaded", {})


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("plugins") / "run"
    schema = traces.Schema(examples_per_step=2, rng_words=2, metrics=(("loss", "loss"),))
    r = traces.Run.create(path, schema, {"config": {"mesh": {"mesh_invariant": False}, "tag": "seen"}, "data": {}})
    writer = r.writer()
    for k in range(4):
        writer.append(traces.StepRecord(k, np.array([k, 1], np.uint32), k + 1, np.arange(2, dtype=np.uint64) + 2 * k,
                                        np.array([1.0], np.float32)))
    r.finish()
    return path


def test_the_trainer_commands_come_from_its_entry_point(monkeypatch):
    result = invoke("--help")
    assert result.exit_code == 0 and all(f"\n  {c} " in result.stdout for c in ("train", "plan", "demo"))
    _use(monkeypatch)  # a checkout that was never installed: no plugins, replay's own commands only
    result = invoke("--help")
    assert result.exit_code == 0 and "\n  show " in result.stdout and "\n  train " not in result.stdout
    assert_one_line_error(invoke("train", "--preset", "tiny"), "no such command 'train'", "replay --help")


def test_a_broken_plugin_is_one_warning_line(monkeypatch):
    _use(monkeypatch, "tests.replay.no_such_plugin_module", "trainer.plugin")
    result = invoke("plan", "--help")
    assert result.exit_code == 0 and "--devices" in result.stdout, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: replay plugin p0 (tests.replay.no_such_plugin_module)"), lines
    assert "ModuleNotFoundError" in lines[0] and "Traceback" not in result.output


def test_a_replayed_run_reaches_the_plugins_before_the_command(monkeypatch, run):
    from replay.cli import replaying

    _use(monkeypatch, __name__)
    SEEN.clear()
    invoke("show", str(run))  # never runs a step: no plugin is asked
    assert SEEN == []
    invoke("spike", str(run), "--json")  # the scan reads the trace only (4 steps: refused, too few for a window)
    assert SEEN == []
    invoke("spike", str(run), "--step=2")  # a replay is prepared (this run has no checkpoint: refused after that)
    assert [m["config"]["tag"] for m in SEEN][:1] == ["seen"]
    SEEN.clear()
    invoke("bisect", str(run), f"{run}/")  # each run an argument names, before the command starts JAX
    assert [m["config"]["tag"] for m in SEEN] == ["seen", "seen"]
    SEEN.clear()
    replaying.prepare_process(traces.Run.open(run))  # what run, spike and verify call before loading
    assert [m["config"]["tag"] for m in SEEN] == ["seen"]


def test_the_trainer_prepares_only_mesh_invariant_runs(monkeypatch):
    from trainer import invariant, plugin

    calls = []
    monkeypatch.setattr(invariant, "prepare_process", lambda: calls.append(1))
    for manifest in ({"config": None}, {"config": {"mesh": {"mesh_invariant": False}}}, {}, {"config": {"mesh": 3}}):
        plugin.prepare_process(manifest)
    assert calls == []
    plugin.prepare_process({"config": {"mesh": {"mesh_invariant": True}}})
    assert calls == [1]
