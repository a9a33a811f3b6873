"""`replay verify` refuses what it cannot check before it loads (and compiles) anything or prints
a line: a run of a PyTorch loop (replay.torch: no JAX program), from its manifest; any other run
(the trainer's, mesh-invariant or not, replay.init's, a legacy loop's) in a process with fewer than
three devices, which cannot out-vote a bad one. Before issue 30 it compiled the train step and
printed the contract line first, and a user loop's run was an AttributeError (exit 3); before
issue 31's general method, runs that were not mesh-invariant trainer runs were refused outright.
Runs are written with the traces API alone: nothing here trains or compiles (this process has
one device; the four examples' and the trainer's runs are verified on four:
tests/examples/test_verify_loops.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import traces
from replay.cli import replaying
from tests.cli_util import assert_one_line_error, invoke

FEW_DEVICES = ("needs at least 3 devices", "this process has 1", "xla_force_host_platform_device_count")
MANIFESTS = {
    "not mesh-invariant": ({"config": {"mesh": {"mesh_invariant": False, "n_microbatches": 1}}, "data": {}},
                           FEW_DEVICES),
    "no mesh section": ({"config": {"model": {"seq_len": 4}}, "data": {}}, FEW_DEVICES),
    "replay.init": ({"config": {"mesh": {"mesh_invariant": True}}, "replayable": "replay.record.replayable:from_run",
                     "recorded_by": "replay"}, FEW_DEVICES),
    "legacy loop": ({"config": {}, "replayable": "tinyloop:replayable"}, FEW_DEVICES),
    "replay.torch": ({"config": {}, "recorded_by": "replay.torch"}, ("recorded by a PyTorch loop (replay.torch)",)),
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
