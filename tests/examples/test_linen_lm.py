"""examples/linen_lm.py (a Flax linen decoder-only LM, optax, the batch sharded with a
NamedSharding, a donated jitted step) records, replays bit-exactly from a checkpoint, and
bisect names injected bugs. (The entering-state check of the NNX test is left out: the step is
functional, nothing can alias its input, and it would add ~3.5 s of compiles to a ~25 s module.)"""

from __future__ import annotations

from tests.examples import loops

import linen_lm  # noqa: E402  (importable: tests/examples/loops.py puts examples/ on the path)

import pytest  # noqa: E402

PARAM = "params.params.block_0.attn.query.kernel"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return loops.record_runs(linen_lm, tmp_path_factory.mktemp("linen"))


def test_lines_only_for_replay_are_few():
    assert 0 < len(loops.replay_lines(linen_lm)) <= 12, loops.replay_lines(linen_lm)


def test_the_batch_is_sharded_along_its_batch_axis_and_a_pure_function_of_the_step():
    import numpy as np
    from jax.sharding import NamedSharding

    cfg = linen_lm.Config()
    batch = linen_lm.batch_at(cfg, 3)
    for x in batch.values():
        assert isinstance(x.sharding, NamedSharding) and x.sharding.spec[0] == "batch"
        assert x.shape == (cfg.batch, cfg.seq)
    again, other = linen_lm.batch_at(cfg, 3), linen_lm.batch_at(cfg, 4)
    assert all(np.array_equal(batch[k], again[k]) for k in batch)
    assert not np.array_equal(batch["inputs"], other["inputs"])


def test_the_state_and_taps_reach_the_record(runs):
    from traces import Run

    run = Run.open(runs["clean"])
    names = run.schema.tensor_names
    assert f"state/{PARAM}" in names and f"update/{PARAM}" in names
    assert any(n.startswith("grad/") for n in names)


def test_replay_is_bit_exact_from_a_checkpoint(runs):
    loops.check_replay_from_a_checkpoint(runs["clean"])


def test_a_replay_against_another_trace_is_caught(runs, tmp_path):
    loops.check_replay_catches_another_trace(runs, tmp_path)


def test_bisect_names_the_learning_rate_change_as_update(runs):
    loops.check_bisect_lr(runs)


def test_bisect_names_a_refed_batch_as_data_and_where_it_was_first_fed(runs):
    loops.check_bisect_refeed(runs)


def test_bisect_of_identical_runs_exits_0(runs):
    loops.check_identical_runs(runs)
