"""examples/nnx_loop.py (Flax NNX: BatchNorm, Dropout through nnx.Rngs, nnx.Optimizer) records,
replays bit-exactly from a checkpoint, and bisect names injected bugs; the state recorded as
entering a step is the state that entered it (the NNX aliasing bug of issue 11 cannot recur)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from tests.examples import loops

import nnx_loop  # noqa: E402  (importable: tests/examples/loops.py puts examples/ on the path)
from flax import nnx  # noqa: E402

import replay  # noqa: E402

PARAM = "0.dense_0.kernel.value"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return loops.record_runs(nnx_loop, tmp_path_factory.mktemp("nnx"))


def test_lines_only_for_replay_are_few():
    assert 0 < len(loops.replay_lines(nnx_loop)) <= 12, loops.replay_lines(nnx_loop)


def test_the_state_tree_holds_batchnorm_statistics_and_the_dropout_stream(runs):
    from traces import Run

    run = Run.open(runs["clean"])
    names = run.schema.tensor_names
    for leaf in ("0.norm.mean.value", "0.norm.var.value", "0.drop.rngs.count.value", PARAM):
        assert f"state/{leaf}" in names and f"update/{leaf}" in names
    assert any(n.startswith("grad/") for n in names)
    assert run.trace.read(0).rng.shape == (2,)  # the Dropout stream's typed key, found without being named
    fp = loops.fingerprints(runs["clean"], 3)
    assert fp["state/0.norm.mean.value"] != fp["update/0.norm.mean.value"]  # statistics move


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


def test_spike_attributes_to_examples_and_names_the_token_rows_it_lacks(runs, tmp_path):
    loops.check_spike_names_what_the_loop_does_not_provide(runs["clean"], tmp_path)


def test_the_recorded_entering_state_is_the_initial_state(runs):
    """nnx.merge shares the State's Variables, so the step's in-place update rewrites the State it
    was handed: a recorder fingerprinting that object after the step records the new values as
    the entering ones (then replay agrees with itself and bisect names `state`, not `update`)."""
    loops.check_entering_state_is_the_state_entering(runs["clean"], nnx_loop, PARAM)


def test_a_step_that_updates_its_input_in_place_is_not_recorded_as_truth(tmp_path):
    """The deliberately aliased step: it merges, updates in place and returns the very State it
    was handed (an in-place nnx.jit step, written functionally). What is recorded as entering
    step 0 must still be the initial state, and must differ from the updated one."""
    cfg = nnx_loop.Config(steps=2, checkpoint_every=10)
    graphdef, state = nnx.split(nnx_loop.create(cfg))
    init_fps = loops.state_fingerprints(state)

    def in_place_step(state, batch):
        model, opt = nnx.merge(graphdef, state)  # model's Variables are the State's
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(jnp.square(m(batch["x"]) - batch["y"])))(model)
        opt.update(model, grads)
        return state, {"loss": loss}  # the input, mutated

    run = replay.init(tmp_path / "aliased", config={}, entrypoint="nnx_loop:make")
    step = run.step(jax.jit(in_place_step))
    new_state, _ = step(state, nnx_loop.batch_at(cfg, 0))
    step(new_state, nnx_loop.batch_at(cfg, 1))
    run.finish()
    fp = loops.fingerprints(tmp_path / "aliased", 0)
    assert loops.entering(fp) == init_fps
    assert fp[f"state/{PARAM}"] != fp[f"update/{PARAM}"]


def test_compare_eval_of_identical_runs_agrees(runs):
    loops.check_compare_eval_of_identical_runs(runs)


def test_compare_eval_finds_the_learning_rate_change_at_the_next_checkpoint(runs):
    loops.check_compare_eval_finds_the_learning_rate_change(runs)


def test_compare_eval_of_a_loop_without_evaluate_names_the_field(runs, monkeypatch):
    loops.check_compare_eval_names_the_loop_field_to_add(runs, monkeypatch)


def test_spike_attributes_the_poisoned_example(runs):
    loops.check_spike_names_the_poisoned_example(runs, nnx_loop.POISONED)
