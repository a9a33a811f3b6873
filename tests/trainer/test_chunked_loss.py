"""trainer/chunked_loss.py: the LM head in chunks of positions gives the unchunked head's
logz and target logits bit for bit; its gradients differ at rounding level only (bounded here:
another matmul shape and summation order); and the compiled backward needs far less memory."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainer import model
from trainer.chunked_loss import head_logits, head_loss
from trainer.config import apply_overrides
from trainer.presets import get_preset


@functools.lru_cache(maxsize=None)  # three tests start from the same untied fp32 setup: traced once
def _setup(tied: bool, dtype: str = "float32", seq: int = 64):
    cfg = apply_overrides(get_preset("tiny"), [f"model.tied_embeddings={str(tied).lower()}", f"model.dtype={dtype}",
                                               f"model.seq_len={seq}", "model.n_layers=1"]).model
    params = model.init_params(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (3, cfg.seq_len), 0, cfg.vocab_size)
    targets = jnp.roll(tokens, -1, axis=1)
    logits, layers = jax.jit(lambda p, t: model.apply(cfg, p, t, capture=True))(params, tokens)
    return cfg, params, layers["final_norm"], targets, logits


def _loss(cfg, chunk):
    def f(params, hidden, targets):
        logz, target = head_loss(cfg, params, hidden, targets, chunk)
        return jnp.mean(logz - target) + 1e-4 * jnp.mean(jnp.square(logz))
    return f


@pytest.mark.parametrize("tied,dtype", [(False, "float32"), (True, "float32"), (False, "bfloat16")])
def test_chunks_give_the_unchunked_bits_forward_and_rounding_level_gradients(tied, dtype):
    cfg, params, hidden, targets, logits = _setup(tied, dtype)
    assert np.array_equal(jax.jit(lambda p, h: head_logits(cfg, p, h))(params, hidden), logits)  # the model's head
    full = jax.jit(lambda p, h, t: head_loss(cfg, p, h, t, 0))(params, hidden, targets)
    grad_full = jax.jit(jax.grad(_loss(cfg, 0), argnums=(0, 1)))(params, hidden, targets)
    for chunk in (8, 16):
        got = jax.jit(lambda p, h, t: head_loss(cfg, p, h, t, chunk))(params, hidden, targets)
        for a, b in zip(got, full):
            assert a.shape == b.shape and np.array_equal(a, b), chunk
        grads = jax.jit(jax.grad(_loss(cfg, chunk), argnums=(0, 1)))(params, hidden, targets)
        key = "embed" if tied else "lm_head"
        (k_got,), (k_full,) = jax.tree.leaves(grads[0][key]), jax.tree.leaves(grad_full[0][key])
        # d/d hidden: the matmul over V has fewer rows (XLA:CPU picks its kernel by shape); d/d kernel:
        # the sum over positions is one matmul per chunk added in order. Measured: ~1e-7 and ~5e-7
        # of the largest element (float32); bounded at 1e-5 (bfloat16 compute: its ulp).
        bound = 1e-5 if dtype == "float32" else 2 ** -7
        for got_g, want_g in ((grads[1], grad_full[1]), (k_got, k_full)):
            scale = float(jnp.max(jnp.abs(want_g)))
            assert float(jnp.max(jnp.abs(got_g - want_g))) <= bound * scale, chunk


def test_the_comparison_sees_a_changed_chunk():
    cfg, params, hidden, targets, _ = _setup(False)
    ref = jax.jit(lambda p, h, t: head_loss(cfg, p, h, t, 0))(params, hidden, targets)[0]
    bumped = hidden.at[:, 17].multiply(1.01)  # one position of chunk 2 (of 8)
    got = jax.jit(lambda p, h, t: head_loss(cfg, p, h, t, 8))(params, bumped, targets)[0]
    diff = np.nonzero(np.asarray(got != ref).any(axis=0))[0]
    assert list(diff) == [17]


def test_a_chunk_must_divide_the_sequence():
    cfg, params, hidden, targets, _ = _setup(False)
    with pytest.raises(ValueError, match="divide"):
        head_loss(cfg, params, hidden, targets, 24)


def test_the_chunked_backward_keeps_one_chunk_of_logits():
    cfg = apply_overrides(get_preset("tiny"), ["model.vocab_size=4096", "model.seq_len=256", "model.n_layers=1"]).model
    params = jax.eval_shape(lambda: model.init_params(cfg, jax.random.key(0)))
    hidden = jax.ShapeDtypeStruct((4, 256, cfg.d_model), jnp.float32)
    targets = jax.ShapeDtypeStruct((4, 256), jnp.int32)
    logits_bytes = 4 * 256 * cfg.vocab_size * 4  # 16 MiB

    def temp(chunk):
        fn = jax.jit(jax.grad(_loss(cfg, chunk), argnums=(0, 1)))
        return fn.lower(params, hidden, targets).compile().memory_analysis().temp_size_in_bytes

    whole, chunked = temp(0), temp(32)
    assert whole >= logits_bytes  # the unchunked backward holds at least the whole logits
    assert chunked <= whole / 4, (whole, chunked)
