"""The LM head and cross-entropy in chunks of positions, so [B, L, V] logits never live whole.

At OLMo sizes the float32 logits are the largest activation of the step (olmo3-7b at 256
devices: 4 x 4096 x 100352 x 4 B = 6.6 GB a device, and the backward holds their gradient and
the softmax's exp beside them). `head_loss(cfg, params, hidden_BxLxD, chunk)` computes what
trainer/step.py's loss_fn needs from the logits, the log-partition logz [B, L] and the target's
logit [B, L], from the final-norm output `hidden_BxLxD`, `chunk` positions at a time: a lax.map
over L / chunk chunks whose body is rematerialised (jax.checkpoint), so the forward keeps no
chunk's logits and the backward recomputes one chunk's at a time. Peak logits memory is then
B x chunk x V instead of B x L x V (measured in tests/trainer/test_chunked_loss.py).

Bits (XLA:CPU, tests/trainer/test_chunked_loss.py): logz, the target logits and so the loss,
z-loss and per-example losses are identical to the unchunked head's (each row's dot products
over D and its fixed-order logsumexp, model.logsumexp, do not depend on how many rows there
are). The gradients are not, and cannot be made so here: the kernel's is a sum over every
position, one matmul unchunked and one matmul per chunk added in chunk order chunked (another
summation order); the hidden's is a matmul over V whose row count changes, and XLA:CPU picks
its matmul kernel by shape (~7% of elements differ by an ulp, also without FMA). Measured:
~1e-7 (hidden) and ~5e-7 (kernel) of the largest element. Training with and without chunks is
therefore not bit-identical; each is deterministic, and `replay run` compares like with like.

The train step uses it when model.loss_chunk > 0: trainer/layers.py's Transformer then stops
at the final norm (head=False) and trainer/step.py's loss_fn calls head_loss. At trace level
"layer" the record's "logits" tensor is computed beside the gradient (head_logits, the head's
bits), so every level trains the same bits and layer-level steps still hold the whole logits
once. `replay plan --preset olmo-1b --devices 256 --remat full --scan`: 26.13 GB per device,
20.52 GB with --set model.loss_chunk=512 (XLA:CPU estimate). Cost: a second head matmul per
chunk in the backward (the rematerialisation): +2 B L D V FLOPs a step, about +1/3 of the head's.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from trainer import model
from trainer.config import Config, ModelConfig


def head_logits(cfg: ModelConfig, params: Any, hidden: jax.Array) -> jax.Array:
    """The LM head as trainer/layers.py's Transformer applies it (flax Dense lm_head, or the
    tied embedding's attend), in cfg.dtype, then float32: the same ops, so the same bits."""
    dtype = model._dtype(cfg.dtype)
    if cfg.tied_embeddings:  # flax Embed.attend: jnp.dot(query, embedding.T) after promote_dtype
        table = params["embed"]["embedding"]
        return jnp.dot(hidden.astype(dtype), table.astype(dtype).T).astype(jnp.float32)
    kernel = params["lm_head"]["kernel"]  # flax Dense: dot_general over the last axis, no bias
    x = hidden.astype(dtype)
    out = jax.lax.dot_general(x, kernel.astype(dtype), (((x.ndim - 1,), (0,)), ((), ())))
    return out.astype(jnp.float32)


def _head_stats(cfg: ModelConfig, params: Any, hidden_BxLxD: jax.Array,
                targets_BxL: jax.Array) -> tuple[jax.Array, jax.Array]:
    logits_BxLxV = head_logits(cfg, params, hidden_BxLxD)
    logz_BxL = model.logsumexp(logits_BxLxV)[..., 0]
    target_logit_BxL = jnp.take_along_axis(logits_BxLxV, targets_BxL[..., None], axis=-1)[..., 0]
    return logz_BxL, target_logit_BxL


def head_loss(cfg: Config | ModelConfig, params: Any, hidden_BxLxD: jax.Array, targets_BxL: jax.Array,
              chunk: int) -> tuple[jax.Array, jax.Array]:
    """(logz [B, L], target logit [B, L]) of the LM head, `chunk` positions at a time (0 or L:
    all at once, the unchunked head). `params`: the model's whole parameter tree."""
    m = model.model_cfg(cfg)
    B, L, D = hidden_BxLxD.shape
    if chunk <= 0 or chunk >= L:
        return _head_stats(m, params, hidden_BxLxD, targets_BxL)
    if L % chunk:
        raise ValueError(f"loss chunk {chunk} does not divide the sequence length {L}")
    n = L // chunk
    # [B, L, ...] -> [n, B, chunk, ...]: chunk c holds positions c * chunk ... (c + 1) * chunk - 1
    hidden_NxBxCxD = jnp.moveaxis(hidden_BxLxD.reshape(B, n, chunk, D), 1, 0)
    targets_NxBxC = jnp.moveaxis(targets_BxL.reshape(B, n, chunk), 1, 0)
    head = {k: params[k] for k in (("embed",) if m.tied_embeddings else ("lm_head",))}

    @jax.checkpoint  # keep nothing of a chunk but its inputs: the backward recomputes its logits
    def one(xs: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        return _head_stats(m, head, *xs)

    logz_NxBxC, target_NxBxC = jax.lax.map(one, (hidden_NxBxCxD, targets_NxBxC))
    return (jnp.moveaxis(logz_NxBxC, 0, 1).reshape(B, L), jnp.moveaxis(target_NxBxC, 0, 1).reshape(B, L))
