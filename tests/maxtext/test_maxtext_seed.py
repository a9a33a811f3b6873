"""The seed's bug on MaxText itself (issue 33, part 3a): OLMo 3 with MaxText's olmo_grain loader,
trained to step 4 on one process with MaxText's own checkpointing, resumed from MaxText's
checkpoint on two processes and, as a control, on one. The recording continues the same run.

Runs in the venv tools/maxtext-env.sh builds (skips elsewhere). Sizes: OLMo 3's decoder with 4
layers, 64 wide, vocabulary 256, 64-token windows; a numpy token file of 64 windows made here;
global batch 4 (one process with two CPU devices, or two processes with one each), 8 steps.
The seed table's MaxText row is printed as one JSON line and, where REPLAY_MAXTEXT_SEED names a
file, written there (tools/maxtext-env.sh puts it into its final JSON line).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("maxtext", reason="MaxText is not installed here: run tools/maxtext-env.sh "
                    "(a Python 3.12 venv with maxtext[tpu]==0.2.5)")

from tools import seed_maxtext  # noqa: E402 - the scenario, also runnable alone (tools/seed_table.py uses it)
from tools.seed_maxtext import PERIOD, STEPS, STOP, WINDOWS  # noqa: E402

pytestmark = pytest.mark.slow
_cli, _refed = seed_maxtext.cli, seed_maxtext.refed


@pytest.fixture(scope="module")
def seed(tmp_path_factory) -> dict:
    return seed_maxtext.train(tmp_path_factory.mktemp("seed"))


def test_the_recording_resumes_the_same_run_from_maxtexts_own_checkpoint(seed):
    # MaxText's checkpoint s holds the state after step s (its optimizer count s + 1, where its loop
    # restarts); replay's checkpoint k the state entering step k. The stop before step 4 leaves MaxText's
    # checkpoints 0 and 3, the run steps 0-3; the resumes continue it at 4, the trace end.
    assert sorted(int(p.name) for p in seed["maxtext"].iterdir()) == [0, PERIOD]
    first = _cli("show", str(seed["first"]))
    assert first["steps"]["end"] == STOP, first["steps"]
    for name, processes in (("one", None), ("two", 2)):
        shown = _cli("show", str(seed[name]))
        assert shown["status"] == "complete" and shown["steps"] == {"start": 0, "end": STEPS, "last": STEPS - 1,
                                                                    "count": STEPS}, shown["steps"]
        assert shown["schema"]["examples_per_step"] == 4, shown["schema"]
        manifest = json.loads((seed[name] / "run.json").read_text())
        resumed = manifest.get("resumed_programs")
        # two processes compile another program (their mesh spans two hosts): kept, and said where it starts
        assert ([(r["step"], r["process_count"]) for r in resumed] if resumed else None) == (
            [(STOP, 2)] if processes else None), resumed
        # the one-process run stored its examples; no process of two holds a whole batch: the store ends at 4
        assert manifest["example_store"].get("until_step") == (STOP if processes else None), manifest["example_store"]


def test_audit_flags_the_examples_refed_after_the_resume_on_two_processes(seed):
    audit = _cli("audit", str(seed["two"]))
    refed = _refed(audit)
    assert audit["ok"] is False and audit["dataset_size"] == WINDOWS, audit  # the olmo index's instances
    assert refed and all(r["step"] >= STOP and r["first_fed"] < STOP for r in refed), refed
    # process 0 holds the first half of each global batch and re-reads the start of the epoch's shuffle
    assert {r["position"] for r in refed} <= {0, 1}, refed


def test_bisect_of_the_two_resumes_names_the_resume_step_data_and_the_refed_examples(seed):
    report = _cli("bisect", str(seed["two"]), str(seed["one"]))
    assert (report["identical"], report["first_step"], report["cause"]) == (False, STOP, "data"), report
    two = [e for e in report["examples"] if e["run"] == "A" and e["seen_before"]]
    assert two and all(s["step"] < STOP for e in two for s in e["seen_before"]), report["examples"]
    row = seed_maxtext.row(seed, report)  # the seed table's MaxText row
    print(json.dumps(row))
    if os.environ.get("REPLAY_MAXTEXT_SEED"):
        Path(os.environ["REPLAY_MAXTEXT_SEED"]).write_text(json.dumps(row))
