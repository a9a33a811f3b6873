"""`replay.Loop(checkpoints=...)`: a loop that keeps its own checkpoints (another layout, folder or
numbering; MaxText's for one) gives them to replay instead of saving copies with `run.save`.

examples/optax_loop.py's run of the session (tests/examples/loops.py: 30 steps, recorded once for
every file that reads it) is copied without its checkpoint folder, so replay holds no checkpoint of
its own; the original folder plays the loop's own checkpoints, read by the loop's own code. Replay
starts from the loop's state entering step 10, checks it against the trace's fingerprints of that
state, and replays bit-exact; a state that is not the one entering that step (the wrong label) is
refused in one line. Cost beyond the shared run: two replays' compiles (about 2 CPU s).
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
from pathlib import Path

import pytest

import replay
from replay.record import checkpoints as ckpts
from replay.record.errors import RecordError
from tests.cli_util import invoke, last_json
from traces import Run

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))  # the example is "installed": its module imports by name
import optax_loop  # noqa: E402

MAKE = optax_loop.make  # the example's own factory (the fixture puts make_held in its place)
HELD: dict = {"folder": None, "shift": 0}  # the loop's own checkpoint folder, and a label error to inject


class Held:
    """The loop's own checkpoints, restored by its own code (here orbax, from a folder outside the run)."""

    def __init__(self, loop: replay.Loop):
        self.loop = loop

    def steps(self) -> list[int]:
        return [10, 20]

    def restore(self, k: int):
        manager = ckpts.open_manager(HELD["folder"], read_only=True)
        return ckpts.restore(manager, k - HELD["shift"], self.loop.state_shapes(), None)

    def describe(self, k: int) -> str:
        return f"{HELD['folder'] / str(k - HELD['shift'])}: the loop's checkpoint"


def make_held(config: dict) -> replay.Loop:
    base = MAKE(config)
    return dataclasses.replace(base, checkpoints=Held(base))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from tests.examples import loops

    shared = loops.shared_runs(optax_loop, ("clean",))["clean"]
    copy = tmp_path_factory.mktemp("held") / "run"
    shutil.copytree(shared, copy, ignore=lambda d, names: ["checkpoints"] if Path(d) == shared else [])
    HELD["folder"] = shared / "checkpoints"
    patch = pytest.MonkeyPatch()
    # the run's entry point, optax_loop:make, as a loop that gives replay its own checkpoints
    patch.setattr(optax_loop, "make", replay.entrypoint(make_held))
    yield copy
    patch.undo()


def test_replay_starts_from_the_loops_own_checkpoint_verified_and_bit_exact(run):
    HELD["shift"] = 0
    assert not (run / "checkpoints").exists() and Run.open(run).trace.end == 30  # replay holds no checkpoint
    result = invoke("run", str(run), "--steps", "12:14", "--json")
    assert result.exit_code == 0, result.output
    report = last_json(result)
    assert report["checkpoint"] == 10 and (report["replayed"], report["bit_exact"]) == (3, 3), report
    assert (report["warmup_replayed"], report["warmup_bit_exact"]) == (2, 2), report
    assert report["all_bit_exact"] and not any("unverified" in n for n in report["notes"]), report["notes"]


def test_a_loop_checkpoint_that_is_not_the_state_entering_its_step_is_refused_in_one_line(run):
    # The label off by ten (the state entering step 10 given as step 20's): every bit of it is a real
    # state of this run, but not the one the trace recorded entering step 20.
    HELD["shift"] = 10
    try:
        result = invoke("run", str(run), "--steps", "21:22", "--json")
    finally:
        HELD["shift"] = 0
    # (the contract and progress lines come before it, as for replay's own damaged checkpoints)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.exit_code == 2 and len(errors) == 1, result.output
    for needle in ("checkpoints/10: the loop's checkpoint", "entering step 20", "differs", "first at state/step"):
        assert needle in errors[0], errors[0]
    assert "Traceback" not in result.output


def test_the_hook_is_checked_when_the_loop_is_built():
    base = replay.Loop(step=lambda s, b: (s, {}), batch_at=lambda k: k, init=lambda: {"w": 0})
    assert dataclasses.replace(base, checkpoints=Held(base)).checkpoints is not None
    with pytest.raises(RecordError, match="has no restore method"):
        dataclasses.replace(base, checkpoints=type("OnlySteps", (), {"steps": lambda self: [0]})())
    with pytest.raises(RecordError, match="data iterator only from its own checkpoints"):
        replay.Loop(step=base.step, data=lambda: iter([]), init=base.init, checkpoints=Held(base))


def test_without_the_traces_state_fingerprints_the_runs_checkpoint_fingerprint_checks_else_a_note():
    # A step-level run (or a step outside the trace) records no state fingerprints: the run's checkpoint
    # fingerprint of k is used when it has one; with none the state is restored unverified, said in a note.
    import jax.numpy as jnp

    from replay.record.fingerprint import state_fingerprint
    from replay.record.loop_checkpoints import verify
    from replay.record.orbax_io import CheckpointDamagedError
    from traces import Schema

    state = {"w": jnp.arange(3, dtype=jnp.float32)}
    run = type("StepLevelRun", (), {"schema": Schema(examples_per_step=1, rng_words=0, metrics=(("loss", "loss"),)), "trace": [], "manifest": {}})()
    assert "restored unverified" in verify(state, 4, run, "its checkpoint 4")
    run.manifest = {"checkpoint_fingerprints": {"4": state_fingerprint(state)}}
    assert verify(state, 4, run, "its checkpoint 4") is None
    with pytest.raises(CheckpointDamagedError, match="its checkpoint 4: .* has fingerprint"):
        verify({"w": state["w"].at[1].set(7.0)}, 4, run, "its checkpoint 4")
