"""`replay bisect` shows the in-training SDC re-run check (check.rerun_every, trainer/sdc.py) of each
run that has one, and names the chip it found as the hardware cause when the runs carry no replica
fingerprints: synthetic 8-microbatch, 4-device runs whose gradients first differ at step 3 and whose
re-run at step 4 (rerun_every=2) disagreed in run A only, on the microbatches of one device."""

from __future__ import annotations

import numpy as np
from rich.console import Console

import traces
from replay.bisect import bisect
from replay.cli import console
from replay.cli.bisect import render
from replay.verify.classify import executor, owner
from trainer.config import apply_overrides, to_dict
from trainer.presets import get_preset

M, N, EVERY, STEPS = 8, 4, 2, 6


def _run(path, chip: int | None, bad_from: int | None):
    """A run whose grad/w fingerprint changes from step `bad_from`, and whose re-run at step 4
    disagreed on the microbatches device `chip` computed (in the step or in the re-run)."""
    schema = traces.Schema(examples_per_step=2, rng_words=2, metrics=(("loss", "loss"),),
                           tensors=(("grad/w", "backward"), ("check/rerun", "backward")))
    cfg = apply_overrides(get_preset("tiny"), ["mesh.mesh_invariant=true", f"mesh.n_microbatches={M}",
                                               f"check.rerun_every={EVERY}"])
    manifest = {"config": to_dict(cfg), "mesh": {"devices": N}, "data": {}}
    run = traces.Run.create(path, schema, manifest)
    w = run.writer(4)
    bad = [i for i in range(M) if chip is not None and chip in (owner(i, N, M), executor(i, N, M, 1))]
    for k in range(STEPS):
        mask = sum(1 << i for i in bad) if k == 4 else 0
        grad = 7 + (1000 + k if bad_from is not None and k >= bad_from else 0)
        w.append(traces.StepRecord(k, np.array([k, 0], np.uint32), k, np.array([2 * k, 2 * k + 1], np.uint64),
                                   np.array([1.0], np.float32), fingerprints=np.array([grad, mask], np.uint64),
                                   rms=np.array([0.5, 1.0 if k % EVERY == 0 else 0.0], np.float32)))
    run.finish()
    return path


def test_bisect_shows_each_runs_rerun_check_and_names_the_chip_it_found(tmp_path, capsys, monkeypatch):
    a = traces.Run.open(_run(tmp_path / "a", chip=2, bad_from=3))
    b = traces.Run.open(_run(tmp_path / "b", chip=None, bad_from=None))
    report = bisect(a, b, refine=False)
    assert report.first_step == 3
    checks = report.rerun_checks
    assert set(checks) == {"A", "B"} and checks["A"]["step"] == checks["B"]["step"] == 4  # the first re-run from step 3
    assert checks["A"]["bad_devices"] == [2] and checks["B"]["microbatches"] == []
    assert report.cause == "hardware" and report.hardware["device"] == 2 and report.hardware["run"] == "A"
    assert report.to_json()["rerun_checks"]["A"]["bad_devices"] == [2]
    monkeypatch.setattr(console, "out", Console(width=200, highlight=False))  # rows unwrapped
    render(report)  # what `replay bisect` prints (its CLI would restart JAX with mesh-invariant settings)
    shown = " ".join(capsys.readouterr().out.split())
    assert "run A's re-run check at step 4" in shown and "device(s) 2 computed wrongly" in shown
    assert "run B's re-run check at step 4" in shown and "every microbatch agreed" in shown


def test_a_difference_the_rerun_did_not_see_is_not_called_hardware(tmp_path):
    # both re-runs agreed: the check shows that, and the cause stays the traces' own (a gradient)
    a = traces.Run.open(_run(tmp_path / "a", chip=None, bad_from=3))
    b = traces.Run.open(_run(tmp_path / "b", chip=None, bad_from=None))
    report = bisect(a, b, refine=False)
    assert report.first_step == 3 and report.hardware is None and report.cause == "backward"
    assert [c["microbatches"] for c in report.rerun_checks.values()] == [[], []]
