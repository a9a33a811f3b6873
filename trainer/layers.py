"""The blocks and the whole network: MLP, Block, Transformer, with remat and a scan over layers.

Remat (model.remat): "full" recomputes a block's whole forward in the backward pass (only its
input is saved), "dots" saves the outputs of the matmuls without batch dimensions (the
projections; attention scores are recomputed), "none" saves everything autodiff wants.

Scan (model.scan_layers): the blocks run as one lax.scan over their parameters stacked along a
new leading axis, so the program holds one block body instead of n_layers copies (compile time
and code size at 7B). The parameters stay one subtree per block in the state (block_00, ...):
they are stacked inside the step, so checkpoints, the optimizer state, the reference converter
and every parameter and gradient fingerprint keep their per-layer names, whatever the option.
The scan's stacked per-layer outputs (attn, mlp, block) are split back into the layer-level
names (block_03.attn, ...), so a trace records, and bisect names, layers, not the scan. A block
whose internals are captured (bisect's refinement) runs unrolled, and the bf16_block fault
splits the scan around its block, which then computes in bfloat16 as in the loop.
Cost: the stacked copy of the blocks' parameters (and of their gradients in the backward) is
transient, params / devices bytes per device under FSDP.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from trainer import model
from trainer.attention import Attention, layer_window, rope_tables
from trainer.config import ModelConfig

def constrain_batch(x: jax.Array, sharding: Any) -> jax.Array:
    """x with its leading (batch) axis kept at `sharding` (trainer/step.py passes the mesh's batch
    sharding); None: no constraint. XLA's SPMD partitioner does not carry the carry's sharding into
    a while loop's body on its own: without this constraint the scanned blocks computed the whole
    global batch on every device (measured: olmo3-7b, 1 block, 256 devices: 164 GB of temporaries
    per device vs 50 unrolled)."""
    return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)


_POLICIES = {
    "full": None,  # jax.checkpoint's default: save nothing but the block's inputs
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class Dropout(nn.Dropout):
    """flax's Dropout with the same key, mask and output bits, its mask drawn flat
    (model.drawn_flat: cheaper to compile; tests/trainer/test_model.py checks it against flax's)."""

    @nn.compact
    def __call__(self, inputs: jax.Array, deterministic: bool | None = None, rng: jax.Array | None = None):
        deterministic = nn.merge_param("deterministic", self.deterministic, deterministic)
        if self.rate == 0.0 or deterministic or self.broadcast_dims or self.rate == 1.0:
            return super().__call__(inputs, deterministic, rng)
        keep_prob = 1.0 - self.rate
        rng = self.make_rng(self.rng_collection) if rng is None else rng
        mask = model.drawn_flat(lambda k, shape: jax.random.bernoulli(k, keep_prob, shape), rng, inputs.shape)
        return jax.lax.select(mask, inputs / keep_prob, jnp.zeros_like(inputs))


class MLP(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        cfg = self.cfg
        gate_BxLxF = model._dense(cfg, cfg.d_ff, "gate")(x_BxLxD)
        model._tap(self, "gate", gate_BxLxF)
        up_BxLxF = model._dense(cfg, cfg.d_ff, "up")(x_BxLxD)
        model._tap(self, "up", up_BxLxF)
        act_BxLxF = nn.silu(gate_BxLxF) * up_BxLxF  # SwiGLU
        model._tap(self, "act", act_BxLxF)
        down_BxLxD = model._dense(cfg, cfg.d_model, "down")(act_BxLxF)
        model._tap(self, "down", down_BxLxD)
        return down_BxLxD


class Block(nn.Module):
    cfg: ModelConfig
    fixed_backward: bool = False  # its norms' and attention's fixed-order backward (trainer/model.py)

    @nn.compact
    def __call__(self, x_BxLxD: jax.Array, sin_LxH2: jax.Array, cos_LxH2: jax.Array,
                 deterministic: bool, window: int | jax.Array = 0) -> jax.Array:
        cfg = self.cfg
        h_BxLxD = Attention(cfg, self.fixed_backward, name="attn")(x_BxLxD, sin_LxH2, cos_LxH2, window)
        h_BxLxD = model.RMSNorm(cfg, fixed_backward=self.fixed_backward, name="attn_norm")(h_BxLxD)
        model._tap(self, "attn_norm", h_BxLxD)
        h_BxLxD = Dropout(cfg.dropout, name="attn_dropout")(h_BxLxD, deterministic=deterministic)
        model._tap(self, "attn", h_BxLxD, layer=True)  # the branch as added to the residual
        x_BxLxD = x_BxLxD + h_BxLxD
        h_BxLxD = MLP(cfg, name="mlp")(x_BxLxD)
        h_BxLxD = model.RMSNorm(cfg, fixed_backward=self.fixed_backward, name="mlp_norm")(h_BxLxD)
        model._tap(self, "mlp_norm", h_BxLxD)
        h_BxLxD = Dropout(cfg.dropout, name="mlp_dropout")(h_BxLxD, deterministic=deterministic)
        model._tap(self, "mlp", h_BxLxD, layer=True)
        x_BxLxD = x_BxLxD + h_BxLxD
        model._tap(self, "", x_BxLxD, layer=True)
        return x_BxLxD


def _block_cfg(cfg: ModelConfig, layer: int) -> ModelConfig:
    # bf16_block exists for the layer-bf16 fault (trainer/faults.py): one block computes in
    # bfloat16 while its parameters and the residual stream stay as configured.
    return dataclasses.replace(cfg, dtype="bfloat16") if layer == cfg.bf16_block else cfg


class Transformer(nn.Module):
    cfg: ModelConfig
    fixed_backward: bool = False  # see model.apply
    batch_sharding: Any = None  # see model.apply and constrain_batch

    @nn.compact
    def __call__(self, tokens_BxL: jax.Array, deterministic: bool = True, head: bool = True) -> jax.Array:
        cfg = self.cfg
        embed = nn.Embed(cfg.vocab_size, cfg.d_model, embedding_init=model._init(cfg),
                         dtype=model._dtype(cfg.dtype), param_dtype=model._dtype(cfg.param_dtype),
                         name="embed")
        x_BxLxD = embed(tokens_BxL)
        model._tap(self, "embed", x_BxLxD, layer=True)
        sin_LxH2, cos_LxH2 = rope_tables(tokens_BxL.shape[1], cfg.head_dim, cfg.rope_theta)
        names = model.block_names(cfg)
        fine = any(self.is_mutable_collection(model._fine_collection(n)) for n in names)
        if cfg.scan_layers and not self.is_initializing() and not fine:
            x_BxLxD = self._scanned(x_BxLxD, sin_LxH2, cos_LxH2, deterministic)
        else:
            block_cls = Block
            if cfg.remat != "none":  # self is argument 0: deterministic and window are static
                block_cls = nn.remat(Block, policy=_POLICIES[cfg.remat], static_argnums=(4, 5))
            for i, name in enumerate(names):
                x_BxLxD = block_cls(_block_cfg(cfg, i), self.fixed_backward, name=name)(x_BxLxD, sin_LxH2, cos_LxH2, deterministic,
                                                                    layer_window(cfg, i))
        x_BxLxD = model.RMSNorm(cfg, fixed_backward=self.fixed_backward, name="final_norm")(x_BxLxD)
        model._tap(self, "final_norm", x_BxLxD, layer=True)
        if not head and not self.is_initializing():  # the caller applies the head (trainer/chunked_loss.py)
            return x_BxLxD
        if cfg.tied_embeddings:
            logits_BxLxV = embed.attend(x_BxLxD)
        else:
            logits_BxLxV = model._dense(cfg, cfg.vocab_size, "lm_head")(x_BxLxD)
        # The loss (log-softmax, z-loss) is computed in float32 from here on.
        logits_BxLxV = logits_BxLxV.astype(jnp.float32)
        model._tap(self, "logits", logits_BxLxV, layer=True)
        return logits_BxLxV

    def _scanned(self, x_BxLxD: jax.Array, sin_LxH2: jax.Array, cos_LxH2: jax.Array,
                 deterministic: bool) -> jax.Array:
        cfg = self.cfg
        names = model.block_names(cfg)
        params = self.variables["params"]
        key = None if deterministic else self.make_rng("dropout")
        capture = self.is_mutable_collection(model.LAYERS)
        n, b = cfg.n_layers, cfg.bf16_block
        bounds = [0, b, b + 1, n] if 0 <= b < n else [0, n]
        taps: list[Any] = []
        for lo, hi in zip(bounds, bounds[1:]):
            if lo == hi:
                continue
            x_BxLxD, seg_taps = _scan_blocks(_block_cfg(cfg, lo), [params[m] for m in names[lo:hi]],
                                             list(range(lo, hi)), x_BxLxD, sin_LxH2, cos_LxH2, key, capture,
                                             self.fixed_backward, self.batch_sharding)
            taps.append(seg_taps)
        if capture:  # the stacked outputs, split back into the per-layer names in execution order
            stacked = [jnp.concatenate(parts) for parts in zip(*taps)]
            for i, name in enumerate(names):
                for leaf, x_nxBxLxD in zip((".attn", ".mlp", ""), stacked):
                    self.sow(model.LAYERS, model._TAP + name + leaf, x_nxBxLxD[i], **model._SOW_ONCE)
        return x_BxLxD


def _scan_blocks(cfg: ModelConfig, block_params: list[Any], layers: list[int], x_BxLxD: jax.Array,
                 sin_LxH2: jax.Array, cos_LxH2: jax.Array, key: jax.Array | None,
                 capture: bool, fixed_backward: bool = False, sharding: Any = None) -> tuple[jax.Array, Any]:
    """lax.scan of one Block body over the stacked parameters of `layers`; with `capture`, also
    their (attn, mlp, block) outputs stacked [len(layers), B, L, D]."""
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *block_params)
    index = jnp.asarray(layers, jnp.int32)
    windows = jnp.asarray([layer_window(cfg, i) for i in layers], jnp.int32)
    block = Block(cfg, fixed_backward)  # unbound: applied to one layer's parameters per iteration
    deterministic = key is None

    def body(x, xs):
        p, i, window = xs
        x = constrain_batch(x, sharding)
        rngs = {} if key is None else {"dropout": jax.random.fold_in(key, i)}
        if not capture:
            y = block.apply({"params": p}, x, sin_LxH2, cos_LxH2, deterministic, window, rngs=rngs)
            return constrain_batch(y, sharding), None
        y, state = block.apply({"params": p}, x, sin_LxH2, cos_LxH2, deterministic, window, rngs=rngs,
                               mutable=[model.LAYERS])
        t = model._collect(state[model.LAYERS], {})  # an unbound block taps "attn", "mlp", ""
        return constrain_batch(y, sharding), tuple(constrain_batch(t[k], sharding) for k in ("attn", "mlp", ""))

    if cfg.remat != "none":
        body = jax.checkpoint(body, policy=_POLICIES[cfg.remat], prevent_cse=False)
    return jax.lax.scan(body, x_BxLxD, (stacked, index, windows))
