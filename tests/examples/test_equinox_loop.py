"""examples/equinox_loop.py (Equinox + optax, eqx.filter_jit, eqx.partition/combine) records,
replays bit-exactly from a checkpoint, and bisect names injected bugs."""

from __future__ import annotations

import pytest

from tests.examples import loops

pytest.importorskip("equinox")
import equinox_loop  # noqa: E402

PARAM = "params.dense_0.weight"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return loops.record_runs(equinox_loop, tmp_path_factory.mktemp("eqx"))


def test_lines_only_for_replay_are_few():
    assert 0 < len(loops.replay_lines(equinox_loop)) <= 12, loops.replay_lines(equinox_loop)


def test_the_state_is_arrays_only_and_taps_reach_the_record(runs):
    from traces import Run

    run = Run.open(runs["clean"])
    names = run.schema.tensor_names
    assert f"state/{PARAM}" in names and f"update/{PARAM}" in names and "grad/dense_0.weight" in names
    assert run.trace.read(0).rng.shape == (2,)  # rng=["key"]: the dropout key's raw words


def test_replay_is_bit_exact_from_a_checkpoint(runs):
    loops.check_replay_from_a_checkpoint(runs["clean"])


def test_replay_without_the_user_code_is_bit_exact(runs):
    loops.check_replay_without_code(runs["clean"])


def test_a_replay_against_another_trace_is_caught(runs, tmp_path):
    loops.check_replay_catches_another_trace(runs, tmp_path)


def test_bisect_names_the_learning_rate_change_as_update(runs):
    loops.check_bisect_lr(runs)


def test_bisect_names_a_refed_batch_as_data_and_where_it_was_first_fed(runs):
    loops.check_bisect_refeed(runs)


def test_bisect_of_identical_runs_exits_0(runs):
    loops.check_identical_runs(runs)


def test_the_recorded_entering_state_is_the_initial_state(runs):
    loops.check_entering_state_is_the_state_entering(runs["clean"], equinox_loop, PARAM)


def test_compare_eval_of_identical_runs_agrees(runs):
    loops.check_compare_eval_of_identical_runs(runs)


def test_compare_eval_finds_the_learning_rate_change_at_the_next_checkpoint(runs):
    loops.check_compare_eval_finds_the_learning_rate_change(runs)


def test_compare_eval_of_a_loop_without_evaluate_names_the_field(runs, monkeypatch):
    loops.check_compare_eval_names_the_loop_field_to_add(runs, monkeypatch)


def test_spike_attributes_the_poisoned_example(runs):
    loops.check_spike_names_the_poisoned_example(runs, equinox_loop.POISONED)
