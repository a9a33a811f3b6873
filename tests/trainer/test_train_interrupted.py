"""`replay train` stopped by Ctrl-C: every step it dispatched is in the trace (the records still
held on device are written by the close), one line says what the run holds and how to continue
it, and the exit code is SIGINT's (130)."""

from __future__ import annotations

from tests.cli_util import invoke
from traces import Run

STOP_AFTER = 5  # Ctrl-C arrives while step 5's progress is shown


def test_ctrl_c_keeps_every_dispatched_step_says_so_and_exits_130(tmp_path, monkeypatch):
    import trainer.loop

    real = trainer.loop.run_prepared

    def interrupted(job, on_step=None):
        def step_then_ctrl_c(info):
            on_step(info)
            if info.step == STOP_AFTER:
                raise KeyboardInterrupt

        return real(job, step_then_ctrl_c)

    monkeypatch.setattr(trainer.loop, "run_prepared", interrupted)
    out = tmp_path / "run"
    done = invoke("train", "--preset", "tiny", "--steps", "20", "--set", "model.n_layers=1", "--out", str(out))
    assert done.exit_code == 130, done.output
    run = Run.open(out)
    assert (run.status, run.trace.end) == ("crashed", STOP_AFTER + 1)
    said = [line for line in done.stderr.splitlines() if "interrupted" in line]
    assert len(said) == 1 and f"interrupted: {out} holds steps 0..{STOP_AFTER} and stays incomplete" in said[0], said
    assert f"replay train --resume {out}" in said[0]

