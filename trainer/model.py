"""Decoder-only transformer LM of the OLMo-2/3 family, in Flax linen.

Why linen and not NNX: linen's `apply(variables, ...)` is a pure function of plain nested
dicts, which is exactly what a pure jitted `train_step(state, batch)` wants and what
optax and orbax take as they are. NNX modules are mutable objects whose RNG streams are
hidden counters inside the module; every jit boundary needs split/merge, and the
"dropout key of step k is a pure function of (seed, k)" contract would live in object
state instead of in an argument. Here the dropout key is passed in, nothing else.

Why OLMo-2's norm placement (x + norm(f(x)), the "reordered" post-norm inside the
residual) rather than Llama's pre-norm: the presets are OLMo-2/3 shapes and the tool's
motivating case is reproducing an OLMo run; this placement plus QK-norm is OLMo-2's fix
for loss spikes, which `replay spike` is meant to study. OLMo-2 normalises q and k over
the whole projection (all heads at once), not per head, and so does this model.

Layout: this file holds the numerics every layer shares (fixed-order sums, softmax, RMSNorm and
their fixed-order backward passes, which tests patch here), the taps and the public API
(apply, init_params, param_names, counts; the name functions are trainer/model_names.py's,
imported here); trainer/attention.py the attention and RoPE; trainer/layers.py the blocks, the
network, remat and the scan over layers.

Shape suffixes: B batch, L query positions, S key positions, D d_model, N query heads,
K key/value heads, G = N / K query heads per kv head, H head_dim, F d_ff, V vocab.

Intermediates: every interesting activation is `sow`n under a stable dotted name. Sowing
into a collection that is not mutable is a no-op, so the same traced program computes the
logits whether or not anything is captured; `apply(..., capture=...)` only makes the
collection mutable. Layer-level names (`layer_names`) go to "intermediates"; the finer
names inside one block (`block_capture_names`) go to a collection of that block alone,
so asking for block_03's internals does not keep every block's attention matrix alive.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from trainer.config import Config, ModelConfig
from trainer.model_names import block_capture_names, block_names, layer_names, model_cfg

LAYERS = "intermediates"  # collection holding the layer-level outputs
_TAP = "tap:"  # prefix of sown variable names: they then never collide with submodule names


def _fine_collection(block: str) -> str:
    return f"fine_{block}"


def _tap(mod: nn.Module, leaf: str, x: jax.Array, *, layer: bool = False) -> None:
    """Sow `x` as "<module path>.<leaf>" into its block's fine collection, and into the
    layer-level collection when `layer`."""
    path = tuple(mod.path) + ((leaf,) if leaf else ())
    name = _TAP + ".".join(path)
    if path and path[0].startswith("block_"):
        mod.sow(_fine_collection(path[0]), name, x, **_SOW_ONCE)
    if layer:
        mod.sow(LAYERS, name, x, **_SOW_ONCE)


def _sow_once(prev: Any, x: jax.Array) -> jax.Array:
    if prev is not None:  # a module called twice would silently overwrite its capture
        raise RuntimeError("an intermediate was sown twice in one forward pass")
    return x


_SOW_ONCE = dict(init_fn=lambda: None, reduce_fn=_sow_once)


def _dtype(name: str) -> jnp.dtype:
    return jnp.dtype(name)


def drawn_flat(draw, key: jax.Array, shape: tuple[int, ...], *args) -> jax.Array:
    """`draw(key, shape, *args)` (a jax.random sampler or an initializer) drawn as one flat vector
    and reshaped: the same bits, since with jax_threefry_partitionable (JAX's default, recorded in
    the manifest) the bits of a shape are those of its row-major flat index. XLA:CPU compiles the
    threefry of a rank-3 iota in about three times the time of a flat one (measured, jax 0.10.2:
    0.59 s vs 0.21 s for 16 x 32 x 64), and every step program and init_params holds such draws."""
    return draw(key, (math.prod(shape),), *args).reshape(shape)


def _init(cfg: ModelConfig) -> nn.initializers.Initializer:
    # OLMo-2: every weight N(0, 0.02), truncated at 3 std so no init outlier starts a spike.
    normal = nn.initializers.truncated_normal(stddev=cfg.init_std, lower=-3.0, upper=3.0)

    def init(key: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
        # flat (drawn_flat): init_params compiles in ~60% of the time (tiny's 17 matrices, 1.35 s vs 2.2 s)
        return drawn_flat(normal, key, shape, dtype)

    return init


@jax.custom_vjp
def tree_sum(x: jax.Array) -> jax.Array:
    """Sum over the last axis (kept, size 1) in a fixed pairwise order.

    XLA:CPU vectorises a plain reduction differently depending on the array's shape, so
    jnp.sum over the same row gave different bits when the per-device batch changed (1 vs
    4 devices). Elementwise adds of halves have one order on every shape and device count.
    Zero padding to a power of two is exact (only an all -0.0 row would become +0.0).

    The backward pass is the upstream gradient broadcast over the row, as for any sum (its
    derivative is 1 for every element). Spelled out so: autodiff of the halving adds gives a pad
    and an add per level, and XLA:CPU then takes 40% longer to compile every gradient (measured,
    jax 0.10.2: tiny's one-block loss gradient 2.9 s instead of 2.0 s). The values are autodiff's but
    for a zero's sign (its pad-and-add made an upstream -0.0 +0.0); mesh-invariant mode's stored
    digests are unchanged (tests/trainer/test_invariant_scatter.py).
    """
    return _halving_sum(x)


def _halving_sum(x: jax.Array) -> jax.Array:
    n = x.shape[-1]
    width = 1 << (n - 1).bit_length()
    if width != n:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - n)])
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x


def _tree_sum_fwd(x: jax.Array):
    return _halving_sum(x), x.shape


def _tree_sum_bwd(shape: tuple[int, ...], g: jax.Array):
    return (jnp.broadcast_to(g, shape),)


tree_sum.defvjp(_tree_sum_fwd, _tree_sum_bwd)


def softmax(logits: jax.Array, fixed_backward: bool = False) -> jax.Array:
    """Softmax over the last axis with a shape-independent sum (see tree_sum); `fixed_backward`:
    its hand-written backward (below)."""
    if fixed_backward:
        return _softmax_fixed(logits)
    return _softmax(logits)


def _softmax(logits: jax.Array) -> jax.Array:
    # max is exact in any order; softmax does not depend on it, so no gradient through it.
    m = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    e = jnp.exp(logits - m)
    return e / tree_sum(e)


# ------------------------------------------------- fixed-order backward (mesh-invariant mode)
# Autodiff turns every broadcast of a [..., 1] statistic (softmax's sum, RMSNorm's rms) or of a
# norm's [D] scale into a plain XLA reduce in the backward pass, and XLA:CPU emits the same
# reduce with a different summation order depending on the surrounding program (measured: the
# softmax backward of one microbatch differed between a 1-device and a 4-device program).
# With `fixed_backward` (an argument of apply, and a field of the modules down to softmax and
# RMSNorm; trainer/microbatches.py sets it in mesh-invariant mode) softmax and RMSNorm use
# hand-written backward passes whose only sums are tree_sum. The forward bits are the same
# either way. An argument, not a flag read while tracing, so jit's and compile_step's caches see it.


@jax.custom_vjp
def _softmax_fixed(logits: jax.Array) -> jax.Array:
    return _softmax(logits)


def _softmax_fixed_fwd(logits: jax.Array):
    p = _softmax(logits)
    return p, p


def _softmax_fixed_bwd(p: jax.Array, g: jax.Array):
    return ((g - tree_sum(g * p)) * p,)


_softmax_fixed.defvjp(_softmax_fixed_fwd, _softmax_fixed_bwd)


def _rms_norm(x32: jax.Array, scale32: jax.Array, eps: float) -> tuple[jax.Array, jax.Array]:
    """(x * rms * scale, rms) with rms = 1/sqrt(mean(x^2) + eps) over the last axis; float32."""
    rms = jax.lax.rsqrt(tree_sum(jnp.square(x32)) / x32.shape[-1] + eps)
    return x32 * rms * scale32, rms


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _rms_norm_fixed(x32: jax.Array, scale32: jax.Array, eps: float) -> jax.Array:
    return _rms_norm(x32, scale32, eps)[0]


def _rms_norm_fixed_fwd(x32: jax.Array, scale32: jax.Array, eps: float):
    y, rms = _rms_norm(x32, scale32, eps)
    return y, (x32, scale32, rms)


def _rms_norm_fixed_bwd(eps: float, res, g: jax.Array):
    x32, scale32, rms = res
    gs = g * scale32
    # d/dx of x * rms(x): gs * rms - x * rms^3 * sum(gs * x) / D, the sum in fixed order.
    dx = gs * rms - x32 * (rms * rms * rms) * (tree_sum(gs * x32) / x32.shape[-1])
    # d/dscale: sum over every leading axis, as a fixed-order sum over the rows. The scale may
    # span the last two axes (QK-norm per head: scale [N, H], statistics over H).
    rows = (g * x32 * rms).reshape(-1, scale32.size)
    dscale = tree_sum(rows.T)[:, 0].reshape(scale32.shape)
    return dx, dscale


_rms_norm_fixed.defvjp(_rms_norm_fixed_fwd, _rms_norm_fixed_bwd)


def logsumexp(logits: jax.Array) -> jax.Array:
    """log(sum(exp(x))) over the last axis (kept), with the same fixed-order sum; for the
    loss and z-loss, so the loss bits do not depend on the per-device batch either."""
    m = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    return m + jnp.log(tree_sum(jnp.exp(logits - m)))


class RMSNorm(nn.Module):
    cfg: ModelConfig
    group: int = 0  # statistics over groups of this many trailing elements (one head); 0 = all
    fixed_backward: bool = False  # the fixed-order backward (mesh-invariant mode), see above

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],),
                           _dtype(self.cfg.param_dtype))
        # Statistics in float32 whatever the activation dtype: bf16 mean-of-squares loses
        # ~3 significant digits over d_model=4096 elements.
        x32 = x.astype(jnp.float32)
        scale32 = scale.astype(jnp.float32)
        if self.group:  # the scale keeps its [D] shape, so the weights convert either way
            x32 = x32.reshape(x.shape[:-1] + (x.shape[-1] // self.group, self.group))
            scale32 = scale32.reshape(x32.shape[-2:])
        if self.fixed_backward:
            y32 = _rms_norm_fixed(x32, scale32, self.cfg.norm_eps)
        else:
            y32 = _rms_norm(x32, scale32, self.cfg.norm_eps)[0]
        return y32.reshape(x.shape).astype(_dtype(self.cfg.dtype))


def _dense(cfg: ModelConfig, features: int, name: str) -> nn.Dense:
    return nn.Dense(features, use_bias=False, dtype=_dtype(cfg.dtype),
                    param_dtype=_dtype(cfg.param_dtype), kernel_init=_init(cfg), name=name)


# ------------------------------------------------------------------------ public API

def _collect(tree: Mapping[str, Any], out: dict[str, jax.Array]) -> dict[str, jax.Array]:
    for key, value in tree.items():
        if key.startswith(_TAP):
            out[key[len(_TAP):]] = value
        else:
            _collect(value, out)
    return out


def apply(cfg: Config | ModelConfig, params: Any, tokens_BxL: jax.Array, *,
          dropout_key: jax.Array | None = None, capture: bool | str = False, head: bool = True,
          fixed_backward: bool = False, batch_sharding: Any = None) -> Any:
    """Forward pass: float32 logits [B, L, V] (head=False: the final norm's output [B, L, D]
    instead, for trainer/chunked_loss.py; then no "logits" is captured).

    dropout_key: None runs without dropout (evaluation); a key enables it, and that key is
      the only randomness used.
    capture: False -> logits. True (or "layers") -> (logits, {layer_names(cfg)[i]: array}).
      A block name such as "block_03" -> (logits, {block_capture_names(cfg, "block_03")[i]:
      array}). Capturing never changes the logits' bits. Dict keys are in execution order
      when called eagerly; jit returns dicts with sorted keys, so take the order from the
      name functions.
    fixed_backward: softmax's and RMSNorm's fixed-order backward passes (mesh-invariant mode).
    batch_sharding: the batch axis's sharding, kept on the scanned blocks' activations
      (trainer/layers.py); None: no constraint.
    """
    from trainer.layers import Transformer

    m = model_cfg(cfg)
    model = Transformer(m, fixed_backward, batch_sharding)
    variables = {"params": params}
    rngs = {} if dropout_key is None else {"dropout": dropout_key}
    deterministic = dropout_key is None
    if capture is False:
        return model.apply(variables, tokens_BxL, deterministic, head, rngs=rngs)
    if capture is True or capture == "layers":
        collection, names = LAYERS, [n for n in layer_names(m) if head or n != "logits"]
    elif isinstance(capture, str) and capture in block_names(m):
        collection, names = _fine_collection(capture), block_capture_names(m, capture)
    else:
        raise ValueError(f"capture must be False, True, 'layers' or a block name "
                         f"({block_names(m)[0]}..{block_names(m)[-1]}), got {capture!r}")
    logits_BxLxV, state = model.apply(variables, tokens_BxL, deterministic, head, rngs=rngs,
                                      mutable=[collection])
    captured = _collect(state[collection], {})
    # Checked at trace time, costs nothing per step: flax keeps insertion (= execution) order,
    # except that a lifted transform (nn.remat) rebuilds the collection with sorted keys; then
    # only the set is checked, and the order comes from the names.
    got, want = (list(captured), names) if m.remat == "none" else (sorted(captured), sorted(names))
    if got != want:
        raise RuntimeError(f"captured {list(captured)} != declared {names}")
    return logits_BxLxV, {n: captured[n] for n in names}


@functools.partial(jax.jit, static_argnums=0)
def init_params(cfg: Config | ModelConfig, key: jax.Array) -> Any:
    """Parameters as a plain nested dict; a pure function of (cfg, key). Jitted so the bits
    are the same whether the caller runs it eagerly or inside its own jit with shardings
    (threefry_partitionable makes random bits independent of the sharding)."""
    from trainer.layers import Transformer

    m = model_cfg(cfg)
    tokens_BxL = jnp.zeros((1, 1), jnp.int32)  # parameter shapes do not depend on L
    return Transformer(m).init({"params": key}, tokens_BxL, True, mutable=["params"])["params"]


@functools.lru_cache(maxsize=32)
def param_names(cfg: Config | ModelConfig) -> tuple[str, ...]:
    """Dotted paths of every parameter leaf, in execution order ("embed.embedding",
    "block_00.attn.q.kernel", ...). jax's tree functions sort dict keys, so use this for
    the order of anything recorded per parameter."""
    from trainer.layers import Transformer

    m = model_cfg(cfg)
    order: list[str] = []

    def walk(tree: Mapping[str, Any], prefix: str) -> None:
        for k, v in tree.items():
            if isinstance(v, Mapping):
                walk(v, prefix + k + ".")
            else:
                order.append(prefix + k)

    def trace(key: jax.Array) -> Any:
        # Runs once, abstractly; flax builds the dict in creation (= execution) order.
        params = Transformer(m).init({"params": key}, jnp.zeros((1, 1), jnp.int32), True,
                                     mutable=["params"])["params"]
        walk(params, "")
        return params

    jax.eval_shape(trace, jax.random.key(0))
    return tuple(order)


def param_count(cfg: Config | ModelConfig) -> int:
    """Exact number of parameters (tested against the initialised tree)."""
    m = model_cfg(cfg)
    D, F, V, KH = m.d_model, m.d_ff, m.vocab_size, m.n_kv_heads * m.head_dim
    attn = D * D + 2 * D * KH + D * D + ((D + KH) if m.qk_norm else 0)
    block = attn + 3 * D * F + 2 * D  # + attn_norm and mlp_norm scales
    return V * D + m.n_layers * block + D + (0 if m.tied_embeddings else D * V)


def flops_per_token(cfg: Config | ModelConfig) -> float:
    """Training FLOPs per token, forward + backward, for MFU.

    PaLM (Chowdhery et al. 2022), appendix B: 6 * N + 12 * n_layers * d_model * seq_len.
    N counts the parameters that take part in a matmul, so the embedding lookup is left out
    unless it is tied (then it is the lm_head matmul); the 1-D norm scales are included and
    negligible. 6N = 2 (multiply-add) x 3 (forward, grad wrt inputs, grad wrt weights).
    The attention term is q.k^T and probs.v: 2 matmuls x 2 flops x 3 passes x d_model x
    seq_len per layer = 12 * L * D * T, counted for the full (not causal-halved) square, as
    PaLM does; GQA does not change it because every query head still attends.
    """
    m = model_cfg(cfg)
    from trainer.attention import layer_window

    n_matmul = param_count(m) - (0 if m.tied_embeddings else m.vocab_size * m.d_model)
    # A sliding-window layer's query attends to at most `window` keys (OLMo 3: equal to full
    # attention up to 4096 tokens).
    keys = sum(min(m.seq_len, layer_window(m, i) or m.seq_len) for i in range(m.n_layers))
    return float(6 * n_matmul + 12 * m.d_model * keys)
