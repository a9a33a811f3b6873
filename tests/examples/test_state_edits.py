"""A loop that changes its state between two steps (examples/optax_loop.py's reset_opt_at: the
optimizer state reset before step k) is named as such, never called a divergence: `replay run`
follows the edit from a checkpoint saved after it, or stops before it in one line; `bisect`
against the same loop without the edit names the step, the cause "edit" and the leaves."""

from __future__ import annotations

import pytest

from tests.cli_util import invoke, last_json
from tests.examples import loops  # noqa: F401  (puts examples/ on sys.path)

import optax_loop  # noqa: E402

pytestmark = pytest.mark.slow
SIZES = dict(steps=9, batch=8, hidden=(16,), checkpoint_every=3)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("edits")
    return {name: optax_loop.train(optax_loop.Config(**SIZES, **bug), str(root / name))
            for name, bug in (("clean", {}), ("at_checkpoint", {"reset_opt_at": 6}), ("between", {"reset_opt_at": 5}))}


def test_replay_follows_an_edit_saved_in_the_next_checkpoint(runs):
    result = invoke("run", runs["at_checkpoint"], "--steps", "3:8", "--json")
    assert result.exit_code == 0, result.output
    report = last_json(result)
    assert report["all_bit_exact"] and report["replayed"] == 6, report
    assert report["edit"]["step"] == 6 and report["edit"]["followed"], report
    assert any(leaf.startswith("opt_state") for leaf in report["edit"]["leaves"]), report["edit"]
    assert not any(leaf.startswith("params") for leaf in report["edit"]["leaves"]), report["edit"]


def test_replay_stops_before_an_edit_no_checkpoint_holds_in_one_line(runs):
    result = invoke("run", runs["between"], "--steps", "3:8")
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    lines = result.stderr.strip().splitlines()  # the replay's status lines, then its one error line
    errors = [line for line in lines if line.startswith("error: ")]
    assert errors == [lines[-1]], result.stderr
    for needle in ("steps 5..8 not replayed", "your loop changed opt_state", "between steps 4 and 5",
                   "run.save(5, state)"):
        assert needle in errors[0], errors[0]
    assert "real divergence" not in result.output
    assert "all 2 replayed steps are bit-identical" in result.stdout  # steps 3 and 4, before the edit
    # The clean run, replayed over the same steps, has no edit: the check can tell them apart.
    result = invoke("run", runs["clean"], "--steps", "3:8", "--json")
    assert result.exit_code == 0 and last_json(result)["edit"] is None, result.output


def test_bisect_names_the_edit_its_step_and_leaves(runs):
    result = invoke("bisect", runs["clean"], runs["between"], "--json")
    assert result.exit_code == 1, result.output
    report = last_json(result)
    assert report["first_step"] == 5 and report["cause"] == "edit", report
    assert report["edits"]["run"] == "B" and report["layer"].startswith("state/opt_state"), report
    assert any("run B's loop changed" in note and "between steps 4 and 5" in note for note in report["notes"])
