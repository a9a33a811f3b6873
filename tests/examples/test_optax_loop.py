"""examples/optax_loop.py through the commands every example's runs are checked with that
tests/replay/test_user_loop.py does not cover: `replay compare --eval` (the loop's own evaluate
and held-out batches, a floor measured on its weights) and `replay spike` naming a poisoned example."""

from __future__ import annotations

import pytest

from tests.cli_util import assert_one_line_error, invoke
from tests.examples import loops

import optax_loop  # noqa: E402  (importable: tests/examples/loops.py puts examples/ on the path)


@pytest.fixture(scope="module")
def runs():
    # The session's runs of the example, which tests/replay/test_user_loop.py replays and bisects too:
    # recorded once for both files (the poisoned example rides on the refeed run).
    return loops.shared_runs(optax_loop, names=("clean", "clean2", "lr", "poison"))


def test_lines_only_for_replay_are_few():
    assert 0 < len(loops.replay_lines(optax_loop)) <= 12, loops.replay_lines(optax_loop)


def test_compare_eval_of_identical_runs_agrees(runs):
    loops.check_compare_eval_of_identical_runs(runs)


def test_compare_eval_finds_the_learning_rate_change_at_the_next_checkpoint(runs):
    loops.check_compare_eval_finds_the_learning_rate_change(runs)


def test_compare_eval_of_a_loop_without_evaluate_names_the_field(runs, monkeypatch):
    loops.check_compare_eval_names_the_loop_field_to_add(runs, monkeypatch)


def test_bisect_names_the_learning_rate_change_at_lr_and_all_parameters(runs):
    loops.check_bisect_lr(runs)  # the example records lr: the layer named is lr, every parameter summarized


def test_spike_attributes_the_poisoned_example(runs):
    loops.check_spike_names_the_poisoned_example(runs, optax_loop.POISONED)


def test_compare_eval_without_the_loops_code_says_it_needs_it(runs, monkeypatch):
    """Replayed from its exported program (no user code), a run cannot be evaluated: one line
    saying to install the module or pass --allow-code."""
    from replay.record.exported import ExportedReplay
    from traces import Run

    exported = ExportedReplay(Run.open(runs["clean"]))
    monkeypatch.setattr("replay.engine.replayer.open_replayable", lambda run: exported)
    result = invoke("compare", str(runs["clean"]), str(runs["clean2"]), "--eval")
    assert_one_line_error(result, str(runs["clean"]), "loop's own code", "--allow-code")


def test_compare_eval_refuses_states_of_different_shapes(runs, monkeypatch):
    """Run B's state as another model's (every matrix half as wide): one line, exit 2, naming the
    first leaf that differs, before anything is restored."""
    import jax

    from replay.engine.replayer import open_replayable
    from traces import Run

    rep = open_replayable(Run.open(runs["clean2"]))
    narrow = jax.tree.map(lambda s: jax.ShapeDtypeStruct((*s.shape[:-1], s.shape[-1] // 2), s.dtype)
                          if s.ndim == 2 else s, rep.state_shapes())
    monkeypatch.setattr(rep, "state_shapes", lambda: narrow)
    monkeypatch.setattr(rep, "restore", None)  # nothing may be restored
    result = invoke("compare", str(runs["clean"]), str(runs["clean2"]), "--eval")
    assert_one_line_error(result, "states of different shapes", "float32[16, 64] in A and float32[16, 32] in B")
