"""model.loss_chunk in the train step (trainer/chunked_loss.py): every trace level trains the same
bits with it, the first step's loss is the unchunked step's, and a chunk must divide seq_len."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.trainer.loop_programs import loop_step
from trainer.config import ConfigError, apply_overrides
from trainer.presets import get_preset
from trainer.step import init_state


def _train(cfg, level, steps=3):
    rng = np.random.default_rng(0)
    state, losses = init_state(cfg), []
    fn = loop_step(cfg, level)  # the trainer's own program for the level
    for _ in range(steps):
        batch = {k: jnp.asarray(rng.integers(0, cfg.model.vocab_size, (16, cfg.model.seq_len)), jnp.int32)
                 for k in ("inputs", "targets")}
        state, metrics = fn(state, batch)
        losses.append(np.asarray(metrics["loss"]))
    return jax.device_get(state.params), losses


@pytest.fixture(scope="module")
def runs():
    # One block: the chunks are in the head, after the blocks; each program here is a compile (this
    # file's cost), and one block makes each about half as long. The programs are the trainer loop's
    # (tests/trainer/loop_programs.py): the unchunked one at level off is that of the one-block tiny
    # run tests/replay/test_bisect.py trains at trace.level=off, so in a whole suite run it is the
    # session's compilation cache's (tests/conftest.py).
    plain = apply_overrides(get_preset("tiny"), ["model.n_layers=1"])
    chunked = apply_overrides(plain, ["model.loss_chunk=8"])
    return {level: _train(chunked, level) for level in ("off", "step", "layer")}, _train(plain, "off")


def test_every_level_trains_the_same_bits_with_chunks(runs):
    chunked, _ = runs
    for level in ("step", "layer"):
        for a, b in zip(jax.tree.leaves(chunked["off"][0]), jax.tree.leaves(chunked[level][0])):
            assert np.array_equal(a, b), level


def test_the_first_loss_is_the_unchunked_one_and_training_stays_close(runs):
    chunked, (plain_params, plain_losses) = runs
    assert np.array_equal(chunked["off"][1][0], plain_losses[0])  # same forward bits
    for a, b in zip(jax.tree.leaves(chunked["off"][0]), jax.tree.leaves(plain_params)):
        assert np.allclose(a, b, rtol=0, atol=1e-5)  # the gradients differ at rounding level only


def test_a_chunk_that_does_not_divide_the_sequence_is_refused():
    with pytest.raises(ConfigError, match="loss_chunk=24 must divide model.seq_len=32"):
        apply_overrides(get_preset("tiny"), ["model.loss_chunk=24"])
