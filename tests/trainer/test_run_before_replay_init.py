"""A trainer run recorded before the trainer recorded through `replay.init` still reads, replays
bit for bit and resumes.

fixtures/run-before-replay-init.tar.gz is such a run, made at commit 7e1a950 (the last one whose
trainer wrote its own run.json and trace) with
`replay train --preset tiny --steps 4 --set checkpoint.every_steps=4 --set model.d_model=32
--set model.d_ff=64 --set model.n_heads=2 --set model.n_kv_heads=1` (its .lock removed): its
manifest names no "recorded_by", "replayable" nor "entrypoint", and checkpoints 0 and 4.
"""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest

from tests.cli_util import invoke, last_json
from traces import Run
from traces.schema import same_bits

FIXTURE = Path(__file__).parent / "fixtures" / "run-before-replay-init.tar.gz"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def legacy(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("legacy")
    with tarfile.open(FIXTURE) as tar:
        tar.extractall(root, filter="data")
    return root / "legacy"


def test_the_fixture_is_a_run_from_before_replay_init(legacy):
    manifest = json.loads((legacy / "run.json").read_text())
    assert not {"recorded_by", "replayable", "entrypoint"} & set(manifest)
    assert manifest["preset"] == "tiny" and manifest["config"]["steps"] == 4


def test_replays_bit_for_bit_then_resumes_and_the_resumed_steps_replay(legacy):
    result = invoke("run", str(legacy), "--steps", "0:3", "--json")
    report = last_json(result)
    contract = report["contract"]
    if contract["expect_bits"]:
        assert result.exit_code == 0, result.output
        assert report["replayed"] == 4 and report["bit_exact"] == 4 and report["all_bit_exact"], report
    else:  # the fixture was recorded on another CPU (an AMD EPYC): XLA:CPU's bits follow the CPU, and the
        # contract says so; nothing else may differ. The resumed steps below are recorded here: bit-exact.
        assert {d["key"] for d in contract["differences"]} <= {"cpu_isa", "cpu_model"}, contract
        assert result.exit_code in (0, 1) and report["replayed"] == 4, result.output

    before = Run.open(legacy).trace
    recorded = [before.read(k) for k in range(4)]
    result = invoke("train", "--resume", str(legacy), "--steps", "6", "--json")
    assert result.exit_code == 0, result.output
    run = Run.open(legacy)
    assert run.status == "complete" and run.trace.end == 6
    assert all(same_bits(run.schema, run.trace.read(k), rec) for k, rec in enumerate(recorded))  # the old steps are untouched
    assert [r["step"] for r in run.manifest["resumes"]] == [4]

    result = invoke("run", str(legacy), "--steps", "4:5", "--json")
    assert result.exit_code == 0, result.output
    report = last_json(result)
    assert report["checkpoint"] == 4 and report["bit_exact"] == 2 and report["all_bit_exact"], report
