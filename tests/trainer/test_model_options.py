"""Issue 14's model options: fused attention, remat, a scan over layers, OLMo 3's sliding window
and bf16 compute. With each on, recording stays free (the parameters after two steps are the same
bits at trace levels off and layer) and the layer-level record still names every layer;
each option is shown to be in the program, not silently ignored."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.trainer.loop_programs import loop_step
from trainer import attention, model, step as steplib
from trainer.config import ConfigError, apply_overrides
from trainer.presets import get_preset

# Smaller than tiny (compiles dominate): 2 blocks, so the scan, the sliding/full pattern and a
# faulty block all have something to act on; dropout on, so the scan's per-layer keys matter.
# tiny's vocabulary (the byte tokenizer's): tests/replay/test_model_options_replay.py trains these
# option sets on the embedded corpus, so its runs' layer-level steps are this file's programs.
BASE = ["model.dropout=0.1", "data.global_batch_size=4", "model.seq_len=16", "model.d_model=32",
        "model.n_heads=2", "model.n_kv_heads=1", "model.d_ff=64"]
SLIDING = ["model.sliding_window=4", "model.full_attention_every=2"]  # block_00 sliding, block_01 full
# Every option is on in at least one combination, and each combination is two compiled programs
# (trace levels off and layer; compiles are this file's cost. Level step records a subset of what
# layer does, and every level, step included, is compared on the plain step in test_step.py and with
# loss chunks in test_loss_chunk_step.py): all+bf16 has every option at once (remat as
# dots, with microbatches); scan+remat-full keeps explicit attention under remat=full and the scan in
# fp32. (A third, fused+sliding+remat-dots+microbatches in fp32, was ~20 s of CPU for options both
# of these already hold.)
OPTIONS = {
    "scan+remat-full": ["model.scan_layers=true", "model.remat=full"],
    "all+bf16": ["model.attention=fused", "model.remat=dots", "optimizer.microbatches=2", "model.scan_layers=true",
                 "model.dtype=bfloat16"] + SLIDING,
}
PLAIN = BASE + SLIDING  # no remat, no scan, explicit attention


def _cfg(name: str, *more: str):
    return apply_overrides(get_preset("tiny"), (PLAIN if name == "plain" else BASE + OPTIONS[name]) + list(more))


def _batch(cfg, seed: int = 0) -> dict:
    tok = np.random.default_rng(seed).integers(0, cfg.model.vocab_size, (4, cfg.model.seq_len + 1)).astype(np.int32)
    return {"inputs": jnp.asarray(tok[:, :-1]), "targets": jnp.asarray(tok[:, 1:])}


# jitted: eager application compiles every primitive on its own, many times slower here
_apply = jax.jit(model.apply, static_argnums=0, static_argnames=("capture",))


def _bits(tree) -> list[bytes]:
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


def _in_program(cfg) -> str:
    """The gradient's jaxpr as text, to see which constructs the option put in it."""
    params = jax.eval_shape(lambda: model.init_params(cfg.model, jax.random.key(0)))
    b = _batch(cfg)
    fn = lambda p: steplib.loss_fn(p, cfg, b["inputs"], b["targets"], jax.random.key(1), False)[0]  # noqa: E731
    return str(jax.make_jaxpr(jax.grad(fn))(params))


@pytest.mark.parametrize("name", OPTIONS)
def test_each_option_trains_the_same_bits_with_layer_recording_on_and_off(name):
    cfg = _cfg(name)
    state0 = steplib.init_state(cfg)
    finals, layer_metrics = {}, None
    for level in ("off", "layer"):
        # the trainer's programs: tests/replay/test_model_options_replay.py's runs compile them too
        fn = loop_step(cfg, level)
        state = jax.tree.map(jnp.copy, state0)  # a copy: the step donates it
        for k in range(2):
            state, metrics = fn(state, _batch(cfg, k))
        finals[level] = _bits(state)
        layer_metrics = metrics if level == "layer" else layer_metrics
    assert finals["off"] == finals["layer"]
    n = len(steplib.tensor_schema(cfg))
    assert np.asarray(layer_metrics["fingerprints"]).shape == (n, 2)  # one fingerprint per named tensor
    assert np.all(np.isfinite(np.asarray(layer_metrics["rms"])))


def test_each_option_is_in_the_program():
    plain = _in_program(_cfg("plain"))
    assert "checkpoint" not in plain and "remat" not in plain and "scan" not in plain
    assert "remat" in _in_program(_cfg("plain", "model.remat=full"))  # jax.checkpoint's primitive
    assert "scan" in _in_program(_cfg("plain", "model.scan_layers=true"))
    bf16 = _cfg("plain", "model.dtype=bfloat16")
    params = model.init_params(bf16.model, jax.random.key(0))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))  # fp32 master weights
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(steplib.init_state(bf16).opt_state)
               if jnp.issubdtype(x.dtype, jnp.floating))  # and optimizer state
    _, layers = _apply(bf16.model, params, _batch(bf16)["inputs"], capture=True)
    assert layers["block_00"].dtype == jnp.bfloat16 and layers["logits"].dtype == jnp.float32


def test_the_scan_records_every_layer_by_name_as_the_loop_does():
    loop, scan = _cfg("plain"), _cfg("plain", "model.scan_layers=true")
    params = model.init_params(loop.model, jax.random.key(0))
    assert jax.tree.structure(params) == jax.tree.structure(model.init_params(scan.model, jax.random.key(0)))
    tokens = _batch(loop)["inputs"]
    logits_l, layers_l = _apply(loop.model, params, tokens, capture=True)
    logits_s, layers_s = _apply(scan.model, params, tokens, capture=True)
    assert sorted(layers_s) == sorted(model.layer_names(scan.model))
    for name in model.layer_names(loop.model):
        np.testing.assert_allclose(np.asarray(layers_s[name]), np.asarray(layers_l[name]), rtol=2e-5, atol=2e-6)
    # each layer's slot of the stacked output is its own layer's, not a neighbour's
    assert not np.allclose(np.asarray(layers_s["block_00"]), np.asarray(layers_s["block_01"]))
    _, fine = _apply(scan.model, params, tokens, capture="block_01")  # a block's internals: unrolled
    assert sorted(fine) == sorted(model.block_capture_names(scan.model, "block_01"))  # jit sorts the keys


def test_the_sliding_window_is_hfs_and_only_in_sliding_layers():
    mask = np.asarray(attention.attention_mask(10, 4))
    q, k = np.meshgrid(np.arange(10), np.arange(10), indexing="ij")
    assert np.array_equal(mask, (k <= q) & (k > q - 4))  # transformers' sliding_window_overlay
    traced = jax.jit(lambda w: attention.attention_mask(10, w))
    assert np.array_equal(np.asarray(traced(jnp.int32(4))), mask)
    assert np.array_equal(np.asarray(traced(jnp.int32(0))), k <= q)  # 0 = full causal
    m = get_preset("olmo3-7b").model
    assert [attention.layer_window(m, i) for i in range(8)] == [4096, 4096, 4096, 0] * 2  # 3 sliding, 1 full

    cfg = _cfg("plain")
    full = apply_overrides(cfg, ["model.sliding_window=0"])
    params = model.init_params(cfg.model, jax.random.key(0))
    tokens = _batch(cfg)["inputs"]
    _, win = _apply(cfg.model, params, tokens, capture="block_00")
    _, ref = _apply(full.model, params, tokens, capture="block_00")
    assert not np.array_equal(np.asarray(win["block_00.attn.ctx"]), np.asarray(ref["block_00.attn.ctx"]))
    np.testing.assert_array_equal(np.asarray(win["block_00.attn.q_rope"]), np.asarray(ref["block_00.attn.q_rope"]))
    wide = apply_overrides(cfg, [f"model.sliding_window={cfg.model.seq_len}"])  # a window as long as the sequence
    assert _bits(_apply(wide.model, params, tokens)) == _bits(_apply(full.model, params, tokens))


def test_fused_attention_is_the_same_function_and_refused_where_order_is_fixed():
    cfg, fused = _cfg("plain"), _cfg("plain", "model.attention=fused")
    params = model.init_params(cfg.model, jax.random.key(0))
    tokens = _batch(cfg)["inputs"]
    a = np.asarray(_apply(cfg.model, params, tokens))
    b = np.asarray(_apply(fused.model, params, tokens))
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
    assert "block_00.attn.probs" not in model.block_capture_names(fused.model, "block_00")
    with pytest.raises(ConfigError, match="model.attention=explicit"):
        jax.jit(lambda p: model.apply(fused.model, p, tokens, fixed_backward=True))(params)


def test_flops_count_a_sliding_layers_window():
    m = dataclasses.replace(get_preset("olmo3-7b").model, seq_len=8192)
    full = dataclasses.replace(m, sliding_window=0)
    attn_full = 12 * m.d_model * m.seq_len * m.n_layers
    saved = 12 * m.d_model * (m.seq_len - m.sliding_window) * (m.n_layers * 3 // 4)
    assert model.flops_per_token(full) - model.flops_per_token(m) == saved
    assert model.flops_per_token(full) == 6 * (model.param_count(m) - m.vocab_size * m.d_model) + attn_full


def test_gradient_accumulation_is_the_mean_of_the_microbatches():
    one = ("model.dropout=0", "model.n_layers=1")  # one block: accumulation is about the step, not the model
    whole, split = _cfg("plain", *one), _cfg("plain", *one, "optimizer.microbatches=2")
    state, b = steplib.init_state(whole), _batch(whole)
    run = lambda cfg: jax.jit(lambda s: steplib.train_step(s, b, cfg=cfg, level="step"))(state)  # noqa: E731
    (s1, m1), (s2, m2) = run(whole), run(split)
    np.testing.assert_allclose(float(m2["loss"]), float(m1["loss"]), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(m2["example_loss"]), np.asarray(m1["example_loss"]), rtol=1e-5)
    np.testing.assert_allclose(float(m2["grad_norm"]), float(m1["grad_norm"]), rtol=1e-4)
    with pytest.raises(ConfigError, match="divisible"):
        jax.eval_shape(lambda s: steplib.train_step(s, b, cfg=_cfg("plain", *one, "optimizer.microbatches=3")), state)
