"""A Flax NNX run (examples/nnx_loop.py: nnx.Rngs keeps the Dropout stream's typed PRNG key in the
state) replays bit-exactly from its exported program: the key crosses the exported signature as
its raw words (replay/record/export.py), orbax restores it as a typed key whose words are fed.
Before, a typed key in the state refused the export, so an NNX run always needed the user's code.
The slow test replays in a fresh process, from another folder, where nnx_loop is not importable."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import replay
from replay.cli.app import app
from replay.record.exported import ExportedReplay
from traces import Run

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))
import nnx_loop  # noqa: E402

STEPS, EVERY = 12, 5
KEY = "0.drop.rngs.key.value"
MISSING = "_replay_no_such_module_:make"  # nothing imports it: only the exported program can replay


def record(path: Path, entrypoint=MISSING) -> Path:
    """examples/nnx_loop.py's train(), keeping its examples (store_examples=True)."""
    cfg = nnx_loop.Config(steps=STEPS, checkpoint_every=EVERY)
    loop = nnx_loop.make(dataclasses.asdict(cfg))
    run = replay.init(path, config=dataclasses.asdict(cfg), entrypoint=entrypoint, store_examples=True)
    step = run.step(batch_axis=0, metric_kinds={"grad_norm": "backward"})(loop.step)
    state = loop.init()
    for k in range(STEPS):
        if k % EVERY == 0:
            run.save(k, state)
        state, _ = step(state, loop.batch_at(k))
    run.save(STEPS, state)
    run.finish()
    return path


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    return record(tmp_path_factory.mktemp("nnx") / "run")


def test_the_dropout_streams_key_is_exported_as_its_raw_words(run):
    ex = Run.open(run).manifest["exported"]
    assert "error" not in ex, ex
    keys = [s for s in ex["state"] if "key" in s]
    assert keys == [{"path": KEY, "dtype": "uint32", "shape": [2], "key": "threefry2x32"}]


def test_an_nnx_run_replays_bit_exact_from_its_exported_program(run):
    result = CliRunner().invoke(app, ["run", str(run), "--steps", "6:11", "--json"])
    assert result.exit_code == 0, result.output
    j = json.loads(result.stdout)
    assert j["all_bit_exact"] and (j["checkpoint"], j["replayed"], j["bit_exact"]) == (5, 6, 6), j
    assert j["notes"][0].startswith("replayed from the exported program")


def test_the_restored_key_drives_the_step(run):
    """The words fed are the checkpoint's: other words give another RNG record and another loss,
    so a key lost or zeroed on the way would not replay bit-exactly."""
    rep = ExportedReplay(Run.open(run))
    state = rep.restore(5)
    i = rep.paths.index(KEY)
    assert np.asarray(state.leaves[i]).dtype == np.uint32
    recorded = Run.open(run).trace.read(5)
    _, rec, _ = rep.step(state, 5)
    assert np.array_equal(np.asarray(rec["rng"]), recorded.rng)
    state = rep.restore(5)
    state.leaves[i] = state.leaves[i] ^ np.uint32(1)
    _, other, _ = rep.step(state, 5)
    assert not np.array_equal(np.asarray(other["rng"]), recorded.rng)
    assert np.asarray(other["loss"]).tobytes() != np.asarray(rec["loss"]).tobytes()


@pytest.mark.slow
def test_a_fresh_process_elsewhere_without_the_module_replays_it(tmp_path):
    run = record(tmp_path / "run", entrypoint=nnx_loop.make)  # the example's own entry point
    assert Run.open(run).manifest["entrypoint"] == "nnx_loop:make"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    probe = subprocess.run([sys.executable, "-c", "import nnx_loop"], cwd=elsewhere, env=env, capture_output=True)
    assert probe.returncode != 0  # the user's module is not importable there
    result = subprocess.run([sys.executable, "-m", "replay.cli.app", "run", str(run), "--steps", "6:11", "--json"],
                            cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    j = json.loads(result.stdout)
    assert j["all_bit_exact"] and (j["replayed"], j["bit_exact"]) == (6, 6), j
    assert j["notes"][0].startswith("replayed from the exported program") and "nnx_loop" in j["notes"][0]
