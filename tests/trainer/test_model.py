import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainer import model as M
from trainer.config import apply_overrides
from trainer.presets import get_preset

CFG = get_preset("tiny")  # dropout 0.1, GQA (4 query / 2 kv heads), qk-norm, untied
B, L = 2, CFG.model.seq_len


def bits(x) -> np.ndarray:
    """The exact bits of a float array, for comparisons where -0.0 != 0.0 and nan == nan."""
    x = np.asarray(x)
    return x.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize])


def same_bits(a, b) -> bool:
    return np.asarray(a).dtype == np.asarray(b).dtype and np.array_equal(bits(a), bits(b))


@pytest.fixture(scope="module")
def params():
    return M.init_params(CFG, jax.random.key(0))


@pytest.fixture(scope="module")
def tokens():
    return jax.random.randint(jax.random.key(1), (B, L), 0, CFG.model.vocab_size)


apply_jit = jax.jit(M.apply, static_argnums=0, static_argnames="capture")


def test_forward_shape_and_dtype(params, tokens):
    logits = apply_jit(CFG, params, tokens)
    assert logits.shape == (B, L, CFG.model.vocab_size) and logits.dtype == jnp.float32
    assert np.isfinite(np.asarray(logits)).all()
    # Shorter sequences than seq_len work (positions are built from the input). Jitted: eagerly,
    # every primitive compiles on its own (about 10 s of this file's CPU).
    assert apply_jit(CFG, params, tokens[:, :5]).shape == (B, 5, CFG.model.vocab_size)


def test_causal(params, tokens):
    t = 10
    changed = tokens.at[:, t].set((tokens[:, t] + 1) % CFG.model.vocab_size)
    a, b = np.asarray(apply_jit(CFG, params, tokens)), np.asarray(apply_jit(CFG, params, changed))
    assert same_bits(a[:, :t], b[:, :t])  # the past cannot see the future
    # The same comparison does catch the change where it is visible.
    assert not np.array_equal(a[:, t], b[:, t])
    assert not np.array_equal(a[:, -1], b[:, -1])


def test_examples_do_not_depend_on_their_batch_neighbours(params):
    # What each device computes under data parallelism: its slice of the global batch.
    # A shape-dependent reduction (e.g. jnp.sum in RMSNorm on XLA:CPU) breaks this; the
    # model's fixed-order tree sums keep it, from 2 tiny examples per slice upwards.
    toks = jax.random.randint(jax.random.key(7), (16, L), 0, CFG.model.vocab_size)
    full = np.asarray(apply_jit(CFG, params, toks))
    for chunk in (2, 4, 8):
        parts = [np.asarray(apply_jit(CFG, params, toks[i:i + chunk]))
                 for i in range(0, 16, chunk)]
        assert same_bits(full, np.concatenate(parts)), chunk


def test_tree_sum_and_softmax():
    x = jax.random.uniform(jax.random.key(0), (3, 5, 48), minval=-4.0, maxval=4.0)
    np.testing.assert_allclose(jax.jit(M.tree_sum)(x)[..., 0], x.sum(-1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(jax.jit(M.softmax)(x), jax.nn.softmax(x, axis=-1),
                               rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(jax.jit(M.logsumexp)(x)[..., 0], jax.nn.logsumexp(x, axis=-1),
                               rtol=1e-6, atol=1e-6)
    g_ours = jax.jit(jax.grad(lambda v: (M.softmax(v) * jnp.arange(48.0)).sum()))(x)
    g_ref = jax.jit(jax.grad(lambda v: (jax.nn.softmax(v, axis=-1) * jnp.arange(48.0)).sum()))(x)
    np.testing.assert_allclose(g_ours, g_ref, rtol=1e-4, atol=1e-5)


def test_tree_sum_backward_is_the_autodiff_of_its_halving_adds():
    # tree_sum's custom backward (a broadcast, cheaper to compile) is the exact derivative of a sum,
    # and has the bits of autodiff through the halving adds it replaced, on a row width that is
    # padded (48 -> 64), except a zero's sign (autodiff's pad-and-add turns an upstream -0.0 into
    # +0.0); a backward off by one ulp is seen.
    x = jax.random.uniform(jax.random.key(0), (3, 5, 48), minval=-4.0, maxval=4.0)
    w = jax.random.normal(jax.random.key(1), (3, 5, 1)).at[0, 0, 0].set(-0.0).at[1, 1, 0].set(0.0)
    grad = jax.jit(jax.grad(lambda f, v: (f(v) * w).sum(), argnums=1), static_argnums=0)
    ours, autodiff = grad(M.tree_sum, x), grad(M._halving_sum, x)
    assert same_bits(ours, jnp.broadcast_to(w, x.shape))
    nonzero = np.asarray(ours) != 0
    assert np.array_equal(ours, autodiff) and same_bits(np.asarray(ours)[nonzero], np.asarray(autodiff)[nonzero])
    assert not np.array_equal(ours, grad(lambda v: M._halving_sum(v) * np.float32(1 + 2**-23), x))


def test_dropout_draws_flaxs_mask_from_a_flat_vector():
    # trainer.layers.Dropout: the key, mask and output bits of flax's nn.Dropout under the same
    # module name, for a rank-3 input; another key gives another mask.
    import flax.linen as nn

    from trainer.layers import Dropout

    x = jax.random.normal(jax.random.key(2), (4, 6, 10))

    def run(cls, key):
        return jax.jit(lambda k: cls(0.3, name="d").apply({}, x, deterministic=False, rngs={"dropout": k}))(key)

    ours, flax_ = run(Dropout, jax.random.key(3)), run(nn.Dropout, jax.random.key(3))
    assert same_bits(ours, flax_) and 0 < int((np.asarray(ours) == 0).sum()) < x.size
    assert not same_bits(ours, run(Dropout, jax.random.key(4)))


def test_layer_names_and_param_order_are_execution_order(params):
    names = M.layer_names(CFG)
    assert names == ["embed", "block_00.attn", "block_00.mlp", "block_00",
                     "block_01.attn", "block_01.mlp", "block_01", "final_norm", "logits"]
    pnames = M.param_names(CFG)
    # The set matches the real tree ...
    flat = {".".join(k.key for k in path)
            for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]}
    assert set(pnames) == flat and len(pnames) == len(flat)
    # ... and the order of modules owning parameters follows the forward outputs.
    modules = list(dict.fromkeys(n.split(".")[0] for n in pnames))
    outputs = list(dict.fromkeys(n.split(".")[0] for n in names))
    assert modules == [("lm_head" if o == "logits" else o) for o in outputs]
    block = list(dict.fromkeys(n.split(".")[1] for n in pnames if n.startswith("block_00.")))
    assert block == ["attn", "attn_norm", "mlp", "mlp_norm"]
    assert [n.split(".")[2] for n in pnames if n.startswith("block_00.attn.")] == [
        "q", "k", "v", "q_norm", "k_norm", "o"]
    # Zero-padding keeps lexical order == execution order even past 100 layers.
    many = dataclasses.replace(CFG.model, n_layers=120)
    assert M.block_names(many)[:2] == ["block_000", "block_001"]
    assert sorted(M.block_names(many)) == M.block_names(many)


def test_capture_returns_declared_names_without_changing_bits(params, tokens):
    plain = apply_jit(CFG, params, tokens)
    logits, acts = apply_jit(CFG, params, tokens, capture=True)
    assert same_bits(plain, logits)
    assert set(acts) == set(M.layer_names(CFG))
    assert same_bits(acts["logits"], logits)
    assert acts["block_00"].shape == (B, L, CFG.model.d_model)
    # Finer capture inside one block, same logits bits, consistent with the layer level.
    blk = "block_01"
    fine_logits, fine = apply_jit(CFG, params, tokens, capture=blk)
    assert same_bits(plain, fine_logits)
    assert set(fine) == set(M.block_capture_names(CFG, blk))
    for name in (f"{blk}.attn", f"{blk}.mlp", blk):
        assert same_bits(fine[name], acts[name])
    probs = np.asarray(fine[f"{blk}.attn.probs"])
    assert probs.dtype == np.float32 and np.allclose(probs.sum(-1), 1.0, atol=1e-5)
    assert (np.triu(probs[0, 0, 0], k=1) == 0).all()  # causal mask
    # With dropout on, capture still changes nothing.
    key = jax.random.key(5)
    assert same_bits(apply_jit(CFG, params, tokens, dropout_key=key),
                     apply_jit(CFG, params, tokens, dropout_key=key, capture=True)[0])


def test_capture_order_is_checked_at_trace_time(params, tokens, monkeypatch):
    # apply() compares the order flax sowed in (execution order) with the declared names
    # while tracing, so a passing capture above proves the order, not just the set.
    shuffled = M.layer_names(CFG)
    shuffled[1], shuffled[2] = shuffled[2], shuffled[1]
    monkeypatch.setattr(M, "layer_names", lambda cfg: shuffled)
    with pytest.raises(RuntimeError, match="declared"):
        jax.eval_shape(lambda p, t: M.apply(CFG, p, t, capture=True), params, tokens)


def test_bit_comparison_catches_one_ulp(params, tokens):
    logits = np.asarray(apply_jit(CFG, params, tokens))
    nudged = logits.copy()
    nudged[1, 3, 7] = np.nextafter(nudged[1, 3, 7], np.float32(np.inf))
    assert not same_bits(logits, nudged)
    signed = logits.copy()
    signed.flat[0] = 0.0
    negzero = signed.copy()
    negzero.flat[0] = -0.0
    assert np.array_equal(signed, negzero) and not same_bits(signed, negzero)


def test_bad_capture_argument(params, tokens):
    with pytest.raises(ValueError, match="block_07"):
        M.apply(CFG, params, tokens, capture="block_07")


def test_init_is_a_pure_function_of_the_key():
    a = M.init_params(CFG, jax.random.key(0))
    b = M.init_params(CFG, jax.random.key(0))
    c = M.init_params(CFG, jax.random.key(1))
    assert all(same_bits(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    assert all(not np.array_equal(x, y)
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(c)) if x.ndim == 2)
    # Legacy uint32 keys work too.
    assert jax.tree.structure(M.init_params(CFG, jax.random.PRNGKey(0))) == jax.tree.structure(a)


def test_init_draws_flaxs_truncated_normal_bits(monkeypatch):
    # model._init draws each weight flat and reshapes it (cheaper to compile): the bits of flax's
    # truncated_normal initializer drawn at the weight's shape, for every leaf of the model.
    import flax.linen as nn

    key = jax.random.key(0)
    ours = M.init_params(CFG, key)
    monkeypatch.setattr(M, "_init", lambda m: nn.initializers.truncated_normal(stddev=m.init_std, lower=-3.0,
                                                                              upper=3.0))
    theirs = jax.jit(lambda k: M.init_params.__wrapped__(CFG, k))(key)  # a new function: traced anew
    assert all(same_bits(x, y) for x, y in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)))
    other = M.init_params(CFG, jax.random.key(1))
    assert not same_bits(jax.tree.leaves(ours)[0], jax.tree.leaves(other)[0])


def test_dropout_uses_only_the_passed_key(params, tokens):
    k1, k2 = jax.random.key(11), jax.random.key(12)
    a = apply_jit(CFG, params, tokens, dropout_key=k1)
    b = apply_jit(CFG, params, tokens, dropout_key=k1)
    c = apply_jit(CFG, params, tokens, dropout_key=k2)
    off = apply_jit(CFG, params, tokens)
    assert same_bits(a, b)  # no hidden state between calls
    # Eagerly too (eager and jitted bits may differ from each other: XLA fuses differently).
    assert same_bits(M.apply(CFG, params, tokens, dropout_key=k1),
                     M.apply(CFG, params, tokens, dropout_key=k1))
    assert not np.array_equal(a, c)
    assert not np.array_equal(a, off)
    # With dropout 0 the key is irrelevant.
    no_drop = apply_overrides(CFG, ["model.dropout=0"])
    assert same_bits(apply_jit(no_drop, params, tokens, dropout_key=k1),
                     apply_jit(no_drop, params, tokens, dropout_key=k2))
    assert same_bits(apply_jit(no_drop, params, tokens, dropout_key=k1), off)


@pytest.mark.parametrize("overrides", [
    [], ["model.tied_embeddings=true"], ["model.qk_norm=false"],
    ["model.n_kv_heads=1"], ["model.n_kv_heads=4", "model.d_ff=100"],
])
def test_param_count_equals_actual(overrides):
    cfg = apply_overrides(CFG, overrides)
    shapes = jax.eval_shape(M.init_params, cfg, jax.random.key(0))
    assert M.param_count(cfg) == sum(int(np.prod(s.shape)) for s in jax.tree.leaves(shapes))


def test_tied_vs_untied():
    tied = apply_overrides(CFG, ["model.tied_embeddings=true"])
    m = CFG.model
    assert M.param_count(CFG) - M.param_count(tied) == m.vocab_size * m.d_model
    shapes = jax.eval_shape(M.init_params, tied, jax.random.key(0))
    assert "lm_head" not in shapes and "lm_head" in jax.eval_shape(
        M.init_params, CFG, jax.random.key(0))
    # The matmul count is the same either way: the tied table is used as the lm_head.
    assert M.flops_per_token(tied) == M.flops_per_token(CFG)


def test_olmo_preset_sizes_abstractly():
    # Only shapes: nothing is allocated.
    for name, lo, hi in (("olmo-1b", 1.3e9, 1.6e9), ("olmo3-7b", 7.0e9, 7.5e9)):
        cfg = get_preset(name)
        n = M.param_count(cfg)
        assert lo < n < hi, (name, n)
        shapes = jax.eval_shape(M.init_params, cfg, jax.random.key(0))
        assert n == sum(int(np.prod(s.shape)) for s in jax.tree.leaves(shapes))


def test_flops_formula():
    m = CFG.model
    n_matmul = M.param_count(CFG) - m.vocab_size * m.d_model  # untied: lookup is free
    assert M.flops_per_token(CFG) == 6 * n_matmul + 12 * m.n_layers * m.d_model * m.seq_len
    # 7B at 4k context: dominated by 6N, attention adds roughly 10%.
    big = get_preset("olmo3-7b")
    f, n = M.flops_per_token(big), M.param_count(big)
    assert 6 * 6.5e9 < f < 6 * 8.5e9
    attn = 12 * 32 * 4096 * 4096
    assert 0.05 < attn / f < 0.2


def test_bf16_activations_fp32_logits(tokens):
    cfg = apply_overrides(CFG, ["model.dtype=bfloat16"])
    p = M.init_params(cfg, jax.random.key(0))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(p))  # param_dtype
    logits, acts = apply_jit(cfg, p, tokens, capture="block_00")
    assert logits.dtype == jnp.float32
    assert acts["block_00"].dtype == jnp.bfloat16 and acts["block_00.mlp.act"].dtype == jnp.bfloat16
    assert acts["block_00.attn.logits"].dtype == jnp.float32
    assert acts["block_00.attn.probs"].dtype == jnp.float32
    assert same_bits(logits, apply_jit(cfg, p, tokens))


def test_tiny_forward_and_grad(params, tokens):
    def loss(p, toks, key, capture=False):
        out = M.apply(CFG, p, toks[:, :-1], dropout_key=key, capture=capture)
        logits, acts = out if capture else (out, {})
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.take_along_axis(logp, toks[:, 1:, None], axis=-1).mean(), acts

    grad_fn = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=3)
    (value, _), grads = grad_fn(params, tokens, jax.random.key(3))
    # Capturing the layer outputs inside a training step changes no gradient bit either.
    (value2, acts), grads2 = grad_fn(params, tokens, jax.random.key(3), True)
    assert same_bits(value, value2) and set(acts) == set(M.layer_names(CFG))
    assert all(same_bits(a, b) for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads2)))
    assert np.isfinite(float(value))
    assert abs(float(value) - np.log(CFG.model.vocab_size)) < 1.0  # near uniform at init
    assert jax.tree.structure(grads) == jax.tree.structure(params)
    for g in jax.tree.leaves(grads):
        assert np.isfinite(np.asarray(g)).all() and np.abs(np.asarray(g)).max() > 0
