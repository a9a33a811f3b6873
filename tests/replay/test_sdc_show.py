"""`replay show` and `replay spike --step` read the in-training SDC re-run check (check/rerun,
trainer/sdc.py) back from a trace: a synthetic run whose step 4 re-run disagreed on two
microbatches computed by one device."""

from __future__ import annotations

import numpy as np

import traces
from replay.cli.show import summarize
from replay.cli.spike import _sdc_check_at
from replay.verify.classify import executor, owner

M, N = 8, 4  # microbatches, devices


def _run(tmp_path, bad_microbatches: list[int]):
    schema = traces.Schema(examples_per_step=2, rng_words=2, metrics=(("loss", "loss"),),
                           tensors=(("grad/w", "backward"), ("check/rerun", "backward")))
    manifest = {"config": {"mesh": {"mesh_invariant": True, "n_microbatches": M}, "check": {"rerun_every": 2, "rotate": 1}},
                "mesh": {"devices": N}, "data": {}}
    run = traces.Run.create(tmp_path / "run", schema, manifest)
    w = run.writer(4)
    for k in range(6):
        checked = k % 2 == 0
        mask = sum(1 << i for i in bad_microbatches) if k == 4 else 0
        w.append(traces.StepRecord(k, np.array([k, 0], np.uint32), k, np.array([2 * k, 2 * k + 1], np.uint64),
                                   np.array([1.0], np.float32), fingerprints=np.array([7, mask], np.uint64),
                                   rms=np.array([0.5, 1.0 if checked else 0.0], np.float32)))
    run.finish()
    return tmp_path / "run"


def test_show_lists_the_disagreeing_rerun_only_with_verify_and_spike_names_it_at_its_step(tmp_path):
    # two microbatches that device d computed in the step (or in the re-run): a bad chip
    d = owner(0, N, M)
    bad = [i for i in range(M) if owner(i, N, M) == d or executor(i, N, M, 1) == d][:2]
    path = _run(tmp_path, bad)
    assert summarize(path)["sdc_checks"] == {"rerun_every": 2, "disagreements": None}  # O(segments) without --verify
    found = summarize(path, verify=True)["sdc_checks"]["disagreements"]
    assert len(found) == 1 and f"microbatch(es) {', '.join(map(str, bad))}" in found[0]
    run = traces.Run.open(path)
    assert _sdc_check_at(run, 4) == found[0]
    assert _sdc_check_at(run, 2) is None  # re-run there and agreed
    assert _sdc_check_at(run, 3) is None  # not re-run


def test_a_clean_run_shows_every_rerun_agreed(tmp_path):
    path = _run(tmp_path, [])
    assert summarize(path, verify=True)["sdc_checks"]["disagreements"] == []
