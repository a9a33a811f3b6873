"""`replay verify` refuses what it cannot check from the manifest alone, before it loads (and
compiles) anything or prints a line: a run that is not mesh-invariant, a run of a user's own loop
(replay.init, the legacy protocol, replay.torch). Before issue 30 it compiled the train step and
printed the contract line first, and a user loop's run was an AttributeError (exit 3).
Runs are written with the traces API alone: nothing here trains or compiles.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import traces
from replay.cli import replaying
from tests.cli_util import assert_one_line_error, invoke

MANIFESTS = {
    "not mesh-invariant": ({"config": {"mesh": {"mesh_invariant": False, "n_microbatches": 1}}, "data": {}},
                           ("is not a mesh-invariant run", "mesh.mesh_invariant=true")),
    "no mesh section": ({"config": {"model": {"seq_len": 4}}, "data": {}}, ("is not a mesh-invariant run",)),
    "replay.init": ({"config": {"mesh": {"mesh_invariant": True}}, "replayable": "replay.record.replayable:from_run",
                     "recorded_by": "replay"}, ("recorded with replay.init", "not yet available", "mesh-invariant")),
    "legacy loop": ({"config": {}, "replayable": "tinyloop:replayable"}, ("their own loop (tinyloop:replayable)",)),
    "replay.torch": ({"config": {}, "recorded_by": "replay.torch"}, ("recorded by replay.torch",)),
}


def _write(path: Path, manifest: dict) -> Path:
    schema = traces.Schema(examples_per_step=2, rng_words=2, metrics=(("loss", "loss"),))
    r = traces.Run.create(path, schema, manifest)
    writer = r.writer(8)
    for k in range(4):
        writer.append(traces.StepRecord(k, np.array([k, 1], np.uint32), k + 1,
                                        np.arange(2 * k, 2 * k + 2, dtype=np.uint64) + 7,
                                        np.array([1.0 / (k + 1)], np.float32)))
    r.finish()
    return path


@pytest.mark.parametrize("name", list(MANIFESTS))
def test_verify_refuses_from_the_manifest_before_loading_anything(tmp_path, monkeypatch, name):
    manifest, needles = MANIFESTS[name]
    run = _write(tmp_path / "run", manifest)

    def loads(*args, **kwargs):  # loading compiles the step (trainer) or restores a program (exported)
        raise AssertionError("verify loaded the run before refusing it")

    monkeypatch.setattr(replaying, "load_replayable", loads)
    line = assert_one_line_error(invoke("verify", str(run), "--steps", "1:2"), str(run), *needles)
    assert "internal error" not in line
