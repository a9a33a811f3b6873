"""trainer/sdc_watch.py: a re-run that disagreed in training is one warning line on stderr naming
the step and the device, read one step late (after the next step was dispatched)."""

from __future__ import annotations

import numpy as np

import traces
from trainer.config import apply_overrides, to_dict
from trainer.presets import get_preset
from trainer.sdc_watch import RerunWatch

SCHEMA = traces.Schema(examples_per_step=0, rng_words=0, metrics=(),
                       tensors=(("grad/x", "backward"), ("check/rerun", "backward")))


def _manifest(every: int) -> dict:
    cfg = apply_overrides(get_preset("tiny"), ["mesh.mesh_invariant=true", "mesh.n_microbatches=8",
                                               f"check.rerun_every={every}"])
    return {"config": to_dict(cfg), "mesh": {"devices": 8}}


def _metrics(step: int, every: int, mask: int = 0) -> dict:
    """A step's layer-level outputs as the step program returns them: uint32 lanes, float32 RMS."""
    lanes = np.array([[0, 123], [mask >> 32, mask & 0xFFFFFFFF]], np.uint32)
    return {"fingerprints": lanes, "rms": np.array([0.5, 1.0 if step % every == 0 else 0.0], np.float32)}


def test_a_disagreeing_rerun_is_one_warning_line_one_step_late(tmp_path, capsys):
    watch = RerunWatch.for_run(_manifest(2), SCHEMA, str(tmp_path / "run"))
    for step in range(3):  # device 3 computes microbatch 3 in the step and 4 in the re-run (rotate 1)
        watch.dispatched(step, _metrics(step, 2, mask=(1 << 3 | 1 << 4) if step == 2 else 0))
    assert capsys.readouterr().err == ""  # step 2's result is not waited for while it is the newest step
    watch.dispatched(3, _metrics(3, 2))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning: step 2: silent data corruption")
    assert "device(s) 3 computed wrongly" in err[0] and f"replay verify {tmp_path / 'run'} --steps 1:2" in err[0]
    assert [f["step"] for f in watch.found] == [2]


def test_agreeing_reruns_and_runs_without_the_check_say_nothing(tmp_path, capsys):
    said = []
    watch = RerunWatch.for_run(_manifest(2), SCHEMA, "run", warn=said.append)
    for step in range(5):
        watch.dispatched(step, _metrics(step, 2))
    watch.flush()
    idle = RerunWatch.for_run(_manifest(0), SCHEMA, "run", warn=said.append)
    idle.dispatched(0, _metrics(0, 1, mask=1 << 3 | 1 << 4))
    idle.flush()
    assert said == [] and capsys.readouterr().err == ""


def test_the_last_rerun_is_read_by_flush(tmp_path):
    said = []
    watch = RerunWatch.for_run(_manifest(2), SCHEMA, "run", warn=said.append)
    watch.dispatched(4, _metrics(4, 2, mask=1 << 5))  # one microbatch: one of two devices, not a chip
    assert said == []
    watch.flush()
    assert len(said) == 1 and "step 4" in said[0] and "one of devices 5 or 4" in said[0]
