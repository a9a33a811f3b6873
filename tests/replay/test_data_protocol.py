"""The data side of the loop protocol (replay/rundata.py, trainer/replay_data.py): audit, pack,
spike and compare's held-out rows reach a run's data through its loop, never by importing trainer/."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import traces
from replay import rundata
from tests.traces.helpers import BLOCK_JAX

ROOT = Path(__file__).resolve().parents[2]
DATA_SIDE = ("replay/audit/", "replay/spike/", "replay/bundle/pack.py", "replay/compare/heldout.py", "replay/rundata.py")


def test_the_data_side_of_replay_imports_nothing_from_trainer():
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "check_layers.py"), str(ROOT)], capture_output=True,
                          text=True, timeout=60)
    crossing = [line for line in done.stdout.splitlines() if line.startswith(DATA_SIDE)]
    assert crossing == [], "\n".join(crossing)


def test_a_loop_without_a_data_entry_is_told_what_to_provide(tmp_path):
    with pytest.raises(rundata.NoDataEntry, match=r"replay\.record\.replayable:from_run"):
        rundata.data_of({"replayable": "replay.record.replayable:from_run"}, tmp_path)
    view = rundata.data_of({"config": {}}, tmp_path)  # no "replayable": a trainer run, its entry opens nothing yet
    for name in ("example_rows", "example_hashes", "batch_ids", "fed_hashes", "write_examples", "carried"):
        assert callable(rundata.capability(view, name, "")), name
    with pytest.raises(rundata.NoDataEntry, match="does not provide evaluate_rows .the contract."):
        rundata.capability(view, "evaluate_rows", "the contract")


AUDIT_WITHOUT_JAX = BLOCK_JAX + r"""
import runpy
sys.argv = ["replay", "audit", sys.argv[1], "--source", "--json"]
try:
    runpy.run_module("replay.cli.app", run_name="__main__")
except SystemExit as e:
    code = e.code
heavy = sorted({m.split(".")[0] for m in sys.modules} & {"jax", "jaxlib", "orbax", "optax", "flax"})
print("exit", code, "heavy", heavy, file=sys.stderr)
"""


@pytest.mark.slow
def test_audit_hashes_a_trainer_runs_source_through_its_data_entry_without_jax(tmp_path):
    from trainer import data

    seq_len, batch, n = 4, 8, 64
    tokens = np.random.default_rng(0).integers(0, 250, n * (seq_len + 1)).reshape(n, seq_len + 1)
    tokens[20] = tokens[7]  # one window twice in the corpus: only the source can tell
    data.write_token_file(str(tmp_path / "tokens.bin"), tokens.ravel())
    source = data.open_source(str(tmp_path / "tokens.bin"))
    batcher = data.Batcher(source, seq_len, batch, 3)
    schema = traces.Schema(examples_per_step=batch, rng_words=2, metrics=(("loss", "loss"),))
    run = traces.Run.create(tmp_path / "run", schema, {"config": {"model": {"seq_len": seq_len}}, "data": source.describe()})
    writer = run.writer()
    for k in range(16):
        writer.append(traces.StepRecord(k, np.array([k, 1], np.uint32), k + 1, batcher.global_example_hashes(k),
                                        np.array([1.0], np.float32)))
    run.finish()
    done = subprocess.run([sys.executable, "-c", AUDIT_WITHOUT_JAX, str(tmp_path / "run")], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    assert done.stderr.strip().splitlines()[-1] in ("exit 0 heavy []", "exit None heavy []"), done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["dataset_size_from"] == "source", report
