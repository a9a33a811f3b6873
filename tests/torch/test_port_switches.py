"""The port-bug switches (issue 13): each default is the reference's behaviour (HF OLMo 3's forward,
torch.optim.AdamW's update), and each other value changes the forward or the update, at the layer
trainer.port_bugs says bisect should name."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from trainer import model as jmodel  # noqa: E402
from trainer import port_bugs, reference  # noqa: E402
from trainer.config import (ConfigError, ModelConfig, OptimizerConfig, apply_overrides, from_dict,  # noqa: E402
                            to_dict)
from trainer.presets import get_preset  # noqa: E402
from trainer.optim import make_optimizer  # noqa: E402
from trainer.reference_parity import KL_BAR, token_kl  # noqa: E402

M = ModelConfig(init_std=0.2, seq_len=128)  # logits of magnitude ~8, as test_reference's parity
FORWARD_BUGS = {"rope": {"rope_style": "interleaved"}, "norm_eps": {"norm_eps": 1e-5},
                "qk_norm": {"qk_norm_scope": "head"}}


@pytest.fixture(scope="module")
def reference_forward():
    """The reference's logits and layer outputs on its own random init, and that init converted."""
    hf = reference.hf_model(M, seed=0)
    params = jax.tree.map(jnp.asarray, reference.to_jax(reference.hf_tensors(hf, M), M))
    tokens = np.random.default_rng(0).integers(0, M.vocab_size, size=(2, M.seq_len), dtype=np.int32)
    with torch.no_grad():
        logits = hf(torch.from_numpy(tokens).long()).logits.float().numpy()
    return params, tokens, logits


def _forward(m: ModelConfig, params, tokens):
    logits, layers = jmodel.apply(m, params, jnp.asarray(tokens), capture=True)
    return np.asarray(logits), {k: np.asarray(v) for k, v in layers.items()}


def test_the_defaults_are_the_reference_forward(reference_forward):
    params, tokens, ref_logits = reference_forward
    logits, _ = _forward(M, params, tokens)
    assert token_kl(ref_logits, logits).max() <= KL_BAR
    assert np.abs(ref_logits - logits).max() < 1e-4


@pytest.mark.parametrize("bug", FORWARD_BUGS)
def test_each_forward_switch_parts_from_the_reference_at_the_first_attention(reference_forward, bug):
    params, tokens, ref_logits = reference_forward
    clean_logits, clean_layers = _forward(M, params, tokens)
    logits, layers = _forward(dataclasses.replace(M, **FORWARD_BUGS[bug]), params, tokens)
    noise = np.abs(ref_logits - clean_logits).max()
    assert np.abs(ref_logits - logits).max() > 100 * noise  # far outside the two frameworks' rounding
    parted = [n for n in jmodel.layer_names(M) if not np.array_equal(layers[n], clean_layers[n])]
    assert parted[0] == port_bugs.PORT_BUGS[bug].first_tensor


def _adam_trajectory(cfg: OptimizerConfig, grads: list[np.ndarray], p0: np.ndarray) -> np.ndarray:
    opt = make_optimizer(cfg)
    params = {"w": jnp.asarray(p0)}
    state = opt.init(params)
    for g in grads:
        updates, state = opt.update({"w": jnp.asarray(g)}, state, params)
        params = jax.tree.map(lambda p, u: p + u, params, updates)
    return np.asarray(params["w"])


def test_adam_eps_outside_is_torch_adamw_and_inside_is_not():
    # Constant lr (no warmup, min_lr_ratio 1) and no clipping, so torch's AdamW sees the same rate.
    cfg = OptimizerConfig(lr=1e-2, warmup_steps=0, decay_steps=10, min_lr_ratio=1.0, grad_clip=0.0,
                          weight_decay=0.1, b1=0.9, b2=0.95, eps=1e-8)
    rng = np.random.default_rng(1)
    p0 = rng.standard_normal((8, 16)).astype(np.float32)  # 2-D: weight-decayed on both sides
    grads = [(1e-3 * rng.standard_normal((8, 16))).astype(np.float32) for _ in range(4)]  # v ~ eps's scale

    w = torch.nn.Parameter(torch.from_numpy(p0.copy()))
    opt = torch.optim.AdamW([w], lr=cfg.lr, betas=(cfg.b1, cfg.b2), eps=cfg.eps, weight_decay=cfg.weight_decay)
    for g in grads:
        w.grad = torch.from_numpy(g.copy())
        opt.step()
    torch_w = w.detach().numpy()

    outside = _adam_trajectory(cfg, grads, p0)
    inside = _adam_trajectory(dataclasses.replace(cfg, eps_placement="inside"), grads, p0)
    close = np.abs(outside - torch_w).max()
    assert close < 1e-6  # float32 rounding of the same formula
    assert np.abs(inside - torch_w).max() > 100 * max(close, 1e-8)


def test_z_loss_off_changes_the_gradient_and_its_term_is_the_mean_of_log_z_squared():
    from trainer import step

    cfg = apply_overrides(get_preset("tiny"), ["model.dropout=0", "optimizer.z_loss=1e-2"])
    params = jmodel.init_params(cfg.model, jax.random.key(0))
    tokens = np.random.default_rng(2).integers(0, cfg.model.vocab_size, (4, cfg.model.seq_len + 1)).astype(np.int32)
    inputs, targets = jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:])

    def grads(c):
        fn = jax.jit(jax.value_and_grad(lambda p: step.loss_fn(p, c, inputs, targets, None, False), has_aux=True))
        (_, aux), g = fn(params)
        return aux, g

    aux, g_on = grads(cfg)
    aux_off, g_off = grads(port_bugs.with_bug(cfg, "z_loss"))
    logits = np.asarray(jax.jit(lambda p: jmodel.apply(cfg.model, p, inputs))(params), np.float64)
    m = logits.max(-1, keepdims=True)
    log_z = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[..., 0]
    assert float(aux["z_loss"]) == pytest.approx(1e-2 * np.mean(log_z ** 2), rel=1e-5)
    assert float(aux_off["z_loss"]) == 0.0 and float(aux_off["loss"]) == float(aux["loss"])
    assert not np.array_equal(np.asarray(g_on["lm_head"]["kernel"]), np.asarray(g_off["lm_head"]["kernel"]))


def test_per_head_qk_norm_has_a_fixed_order_backward_equal_to_autodiffs():
    m = dataclasses.replace(M, qk_norm_scope="head", init_std=0.02, seq_len=16)
    params = jmodel.init_params(m, jax.random.key(1))
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, m.vocab_size, (2, 16)), jnp.int32)

    def grad(fixed_backward: bool):
        fn = jax.jit(jax.grad(lambda p: jnp.mean(jmodel.apply(m, p, tokens, fixed_backward=fixed_backward) ** 2)))
        return fn(params)["block_00"]["attn"]["q_norm"]

    plain = grad(False)
    fixed = grad(True)
    np.testing.assert_allclose(np.asarray(fixed["scale"]), np.asarray(plain["scale"]), rtol=1e-4, atol=1e-9)


def test_the_switches_are_config_fields_overridable_and_saved():
    clean = apply_overrides(get_preset("tiny"), ["optimizer.z_loss=1e-4"])
    assert (clean.model.rope_style, clean.model.qk_norm_scope, clean.optimizer.eps_placement) == \
        ("rotate_half", "projection", "outside")
    for name in port_bugs.PORT_BUGS:
        bug = port_bugs.with_bug(clean, name)
        assert bug != clean and from_dict(to_dict(bug)) == bug  # the manifest holds the switch
    with pytest.raises(ConfigError, match="rope_style"):
        apply_overrides(clean, ["model.rope_style=sideways"])
    with pytest.raises(ConfigError, match="z_loss > 0"):
        port_bugs.with_bug(get_preset("tiny"), "z_loss")
