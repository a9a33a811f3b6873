"""Grouped-query attention with rotary embeddings and OLMo 3's sliding-window layers.

Two implementations of the same function (model.attention):

- "explicit": scores and a hand-written softmax whose sums are model.tree_sum, so with
  fixed_backward (trainer/model.py) its backward has one summation order on every device count.
  Mesh-invariant mode (trainer/invariant.py) needs it; it materialises float32 [B, K, G, L, S]
  logits and probabilities, and can tap both (bisect's refinement looks at them).
- "fused": jax.nn.dot_product_attention, the form XLA fuses and cuDNN / TPU kernels replace
  (softmax in float32, probabilities never returned). Its backward is autodiff's, so it is
  refused under the fixed-order backward, where it would silently break the mesh-invariant bits.

Sliding window (OLMo 3, HF's create_sliding_window_causal_mask): in a sliding layer query q
sees keys k with q - W < k <= q; every `full_attention_every`-th layer (index i with
(i + 1) % N == 0) is full causal attention. The window may be a traced int32 (0 = full), so
one scanned block body serves both kinds of layer (trainer/layers.py).

Shape suffixes as trainer/model.py: B batch, L query positions, S key positions, N query heads,
K kv heads, G = N / K, H head_dim.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from trainer import model
from trainer.config import ConfigError, ModelConfig


def layer_window(cfg: ModelConfig, layer: int) -> int:
    """Keys a query of block `layer` sees in its window, 0 for full causal attention."""
    if cfg.sliding_window and (layer + 1) % cfg.full_attention_every:
        return cfg.sliding_window
    return 0


def rope_tables(seq_len: int, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """sin and cos, each [L, H/2] float32 (the HF layout's frequencies)."""
    inv_freq_H2 = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angle_LxH2 = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inv_freq_H2[None, :]
    return jnp.sin(angle_LxH2), jnp.cos(angle_LxH2)


def apply_rope(x: jax.Array, sin_LxH2: jax.Array, cos_LxH2: jax.Array,
               style: str = "rotate_half") -> jax.Array:
    """Rotate x of shape [B, L, ..., H] by position; computed in float32.

    style "rotate_half" (HF, OLMo) rotates the pairs (i, i + H/2); "interleaved" (the original
    RoFormer / Meta Llama layout) the pairs (2i, 2i + 1): a port bug when the weights come from
    the other convention (model.rope_style)."""
    extra = x.ndim - 3  # head axes between L and H
    sin = sin_LxH2.reshape(sin_LxH2.shape[:1] + (1,) * extra + sin_LxH2.shape[1:])
    cos = cos_LxH2.reshape(cos_LxH2.shape[:1] + (1,) * extra + cos_LxH2.shape[1:])
    x32 = x.astype(jnp.float32)
    if style == "interleaved":
        x1, x2 = x32[..., 0::2], x32[..., 1::2]
        out = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(x.shape)
    else:
        x1, x2 = jnp.split(x32, 2, axis=-1)
        out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def attention_mask(length: int, window: int | jax.Array) -> jax.Array:
    """bool [L, S]: causal, and within `window` keys when window > 0 (static or traced)."""
    causal_LxS = jnp.tril(jnp.ones((length, length), dtype=jnp.bool_))
    if isinstance(window, int) and window == 0:
        return causal_LxS  # full attention: the mask the model always had, the same ops
    q_Lx1 = jnp.arange(length)[:, None]
    k_1xS = jnp.arange(length)[None, :]
    return causal_LxS & ((window == 0) | (k_1xS > q_Lx1 - window))


class Attention(nn.Module):
    cfg: ModelConfig
    fixed_backward: bool = False  # softmax's and the QK-norms' fixed-order backward (trainer/model.py)

    @nn.compact
    def __call__(self, x_BxLxD: jax.Array, sin_LxH2: jax.Array, cos_LxH2: jax.Array,
                 window: int | jax.Array = 0) -> jax.Array:
        cfg = self.cfg
        N, K, H = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        B, L, _ = x_BxLxD.shape
        q_BxLxNH = model._dense(cfg, N * H, "q")(x_BxLxD)
        model._tap(self, "q", q_BxLxNH)
        k_BxLxKH = model._dense(cfg, K * H, "k")(x_BxLxD)
        model._tap(self, "k", k_BxLxKH)
        v_BxLxKH = model._dense(cfg, K * H, "v")(x_BxLxD)
        model._tap(self, "v", v_BxLxKH)
        if cfg.qk_norm:  # OLMo-2: over the full projection width, before splitting heads
            group = H if cfg.qk_norm_scope == "head" else 0  # per head: a port bug (issue 13)
            q_BxLxNH = model.RMSNorm(cfg, group, self.fixed_backward, name="q_norm")(q_BxLxNH)
            model._tap(self, "q_norm", q_BxLxNH)
            k_BxLxKH = model.RMSNorm(cfg, group, self.fixed_backward, name="k_norm")(k_BxLxKH)
            model._tap(self, "k_norm", k_BxLxKH)
        # Query head n = k * G + g uses kv head k (the layout of HF's repeat_kv, and the grouping
        # jax.nn.dot_product_attention makes of N query heads over K kv heads).
        q_BxLxKxGxH = apply_rope(q_BxLxNH.reshape(B, L, K, N // K, H), sin_LxH2, cos_LxH2, cfg.rope_style)
        model._tap(self, "q_rope", q_BxLxKxGxH)
        k_BxSxKxH = apply_rope(k_BxLxKH.reshape(B, L, K, H), sin_LxH2, cos_LxH2, cfg.rope_style)
        model._tap(self, "k_rope", k_BxSxKxH)
        v_BxSxKxH = v_BxLxKH.reshape(B, L, K, H)
        mask_LxS = attention_mask(L, window)
        if cfg.attention == "fused":
            if self.fixed_backward:
                raise ConfigError("model.attention=fused has no fixed-order backward, which mesh-invariant mode "
                                  "needs; set model.attention=explicit with mesh.mesh_invariant=true")
            ctx_BxLxNxH = jax.nn.dot_product_attention(
                q_BxLxKxGxH.reshape(B, L, N, H), k_BxSxKxH, v_BxSxKxH, mask=mask_LxS[None, None],
                scale=H ** -0.5)
            ctx_BxLxNH = ctx_BxLxNxH.reshape(B, L, N * H)
        else:
            ctx_BxLxNH = self._explicit(q_BxLxKxGxH, k_BxSxKxH, v_BxSxKxH, mask_LxS).reshape(B, L, N * H)
        model._tap(self, "ctx", ctx_BxLxNH)
        out_BxLxD = model._dense(cfg, cfg.d_model, "o")(ctx_BxLxNH)
        model._tap(self, "out", out_BxLxD)
        return out_BxLxD

    def _explicit(self, q_BxLxKxGxH: jax.Array, k_BxSxKxH: jax.Array, v_BxSxKxH: jax.Array,
                  mask_LxS: jax.Array) -> jax.Array:
        H = self.cfg.head_dim
        # Scores and softmax in float32: bf16 logits lose the small differences between
        # nearby keys that attention is made of, and softmax's exp amplifies the error.
        logits_BxKxGxLxS = jnp.einsum("blkgh,bskh->bkgls", q_BxLxKxGxH, k_BxSxKxH,
                                      preferred_element_type=jnp.float32) * (H ** -0.5)
        # Finite fill, not -inf: -inf - (-inf) = nan in a fully masked row (none here, but
        # a future padding mask could make one).
        logits_BxKxGxLxS = jnp.where(mask_LxS, logits_BxKxGxLxS, jnp.finfo(jnp.float32).min)
        model._tap(self, "logits", logits_BxKxGxLxS)
        probs_BxKxGxLxS = model.softmax(logits_BxKxGxLxS, self.fixed_backward)
        model._tap(self, "probs", probs_BxKxGxLxS)
        return jnp.einsum("bkgls,bskh->blkgh", probs_BxKxGxLxS.astype(model._dtype(self.cfg.dtype)), v_BxSxKxH)
