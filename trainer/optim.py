"""AdamW with linear warmup, cosine decay and global-norm clipping (optax)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from trainer.config import OptimizerConfig


def lr_schedule(cfg: OptimizerConfig) -> optax.Schedule:
    """Linear warmup from 0 to `lr`, cosine down to `lr * min_lr_ratio` at `decay_steps`, then flat.

    decay_steps is explicit (not the run's length) so that extending a run on resume
    keeps the schedule of the steps already taken.
    """
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.lr,
        warmup_steps=cfg.warmup_steps,
        decay_steps=cfg.decay_steps,
        end_value=cfg.lr * cfg.min_lr_ratio,
    )


def _adamw(cfg: OptimizerConfig) -> optax.GradientTransformation:
    # Weight decay skips 1-D parameters (norm scales), as OLMo and most LM trainers do.
    def decay_mask(params):
        return jax.tree.map(lambda p: p.ndim > 1, params)

    # inject_hyperparams keeps the learning rate each update used in the optimizer state, so
    # the step records the rate that was applied, not one recomputed beside it.
    # eps_placement "inside" (a port bug, issue 13) is optax's eps_root: m / sqrt(v + eps). The
    # default passes no eps_root, so its optimizer state has the structure it always had.
    eps = {"eps": cfg.eps} if cfg.eps_placement == "outside" else {"eps": 0.0, "eps_root": cfg.eps}
    return optax.inject_hyperparams(optax.adamw, static_args=("mask",))(
        learning_rate=lr_schedule(cfg), b1=cfg.b1, b2=cfg.b2, **eps,
        weight_decay=cfg.weight_decay, mask=decay_mask,
    )


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
    adamw = _adamw(cfg)
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), adamw) if cfg.grad_clip > 0 else adamw


def update(cfg: OptimizerConfig, grads, opt_state, params, grad_norm: jax.Array | None = None):
    """make_optimizer(cfg).update(grads, opt_state, params); with `grad_norm`, the clip divides by
    that norm instead of computing optax's (mesh-invariant mode's fixed-order norm of gradient
    shards, trainer/tree_sums.py), with optax's arithmetic; the state keeps its structure."""
    if grad_norm is None or cfg.grad_clip <= 0:
        return make_optimizer(cfg).update(grads, opt_state, params)
    trigger = jnp.squeeze(grad_norm < cfg.grad_clip)  # as optax.clip_by_global_norm
    clipped = jax.tree.map(lambda t: jax.lax.select(trigger, t, (t / grad_norm.astype(t.dtype)) * cfg.grad_clip),
                           grads)
    clip_state, adamw_state = opt_state
    updates, adamw_state = _adamw(cfg).update(clipped, adamw_state, params)
    return updates, (clip_state, adamw_state)


def applied_lr(opt_state) -> jax.Array:
    """The learning rate the last update used (kept in the state by inject_hyperparams)."""
    return optax.tree_utils.tree_get(opt_state, "learning_rate", filtering=lambda _, v: isinstance(v, jax.Array))
