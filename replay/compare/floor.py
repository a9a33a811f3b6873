"""The tolerance of an eval-loss difference: the float32 noise floor, measured on the pair itself.

Two correct float32 implementations of one model differ only by rounding, so the floor is how
far float32 arithmetic moves this model's eval loss at these weights: the run's PyTorch
reference (a plugin's TorchReference, sides.py; the trainer's is its OLMo) evaluates each run's
checkpoint in float32 and in float64 on the same rows, and e_X = mean over rows of
|loss32 - loss64| for run X. Each implementation's error is about
e_X (the reference's rounding stands for both frameworks'), so by the triangle inequality
|L_A - L_B| <= e_A + e_B for two correct forwards on the same weights. Training rounds too, so
two correct runs' weights part by rounding that grows over the steps; GROWTH covers it, with
the margin measured on the clean pair (below). Below one float32 ulp of the loss nothing is
resolved, so the tolerance is never less than that.

    tolerance(k) = max(GROWTH * (e_A(k) + e_B(k)), ulp(L_A(k)))

Measured on this machine (tiny preset without dropout, embedded corpus, 64 held-out rows, 100
steps of AdamW, the torch reference vs the JAX trainer from the same weights; the trace level did
not matter): e_A, e_B = 1.3e-7 .. 1.5e-7 at steps 25, 50, 100, so the tolerance is 1.1e-6 ..
1.2e-6; the clean pair's |B - A| was 1.1e-8, 5.6e-8, 2.0e-7 (at most 1/5 of it: GROWTH = 4 has
room for longer runs without being a blanket); port bugs on the JAX side (another 64 rows):
AdamW epsilon inside the square root 1.8e-3 at step 10 and 2.5e-3 at 100, RMSNorm epsilon 1e-5
for 1e-6 8.8e-3 at step 1: 1,000x the tolerance or more.

Cost: two more forward passes of the reference (float32, float64) per run and evaluated step.

A pair of JAX loops with no PyTorch reference (replay/compare/jaxloop.py) measures its floor on
itself instead (WEIGHTS_ULP): e_X = mean over the held-out examples of |evaluate(w) - evaluate(w')|
at run X's weights w, where w' moves every floating-point element of the state by one ulp
(jnp.nextafter towards +inf or -inf, the direction of each element drawn from a fixed key named
"compare/floor", so the floor is the same every time): how far rounding the weights alone moves
the eval loss. Same tolerance rule. Cost: one more state in memory and one more evaluation pass
per run and evaluated step; nothing grows with the run's length.
"""

from __future__ import annotations

from typing import Any

import numpy as np

GROWTH = 4.0
TORCH_FLOAT64, WEIGHTS_ULP = "torch-float64", "weights-ulp"  # the floor rules, as the report names them
RULES = {
    TORCH_FLOAT64: f"max({GROWTH:g} * (e_A + e_B), ulp(loss_a)); e_X = mean |loss32 - loss64| of the reference at run "
                   "X's weights",
    WEIGHTS_ULP: f"max({GROWTH:g} * (e_A + e_B), ulp(loss_a)); e_X = mean |evaluate(w) - evaluate(w')| over the "
                 "held-out examples at run X's weights w, w' = w with every float moved one ulp (signs from the key "
                 "'compare/floor')",
}
FLOOR_KEY = "compare/floor"


def rounding_error(reference: Any, weights: dict[str, np.ndarray], rows: np.ndarray) -> float:
    """e: mean over rows of |loss in float32 - loss in float64| of `reference` (a
    replay.compare.sides.TorchReference) at these weights (by the reference's names)."""
    import torch

    model = reference.model()
    reference.load(model, weights)
    l32 = reference_losses(model, rows, reference.batch_size).astype(np.float64)
    l64 = reference_losses(model.to(torch.float64), rows, reference.batch_size)
    return float(np.mean(np.abs(l32 - l64)))


def reference_losses(model: Any, rows: np.ndarray, batch: int) -> np.ndarray:
    """[N] each row's mean next-token cross-entropy under the torch `model`, in the model's dtype
    (float32 losses as float32; a float64 model's as float64)."""
    import torch

    out = []
    model.eval()
    with torch.no_grad():
        for i in range(0, len(rows), batch):
            t = torch.from_numpy(np.ascontiguousarray(rows[i:i + batch])).long()
            logits = model(t[:, :-1]).logits
            ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), t[:, 1:], reduction="none")
            out.append(ce.mean(dim=1).numpy())
    return np.concatenate(out)


def tolerance(e_a: float, e_b: float, loss: float) -> float:
    return max(GROWTH * (e_a + e_b), float(np.spacing(np.float32(abs(loss)))))


def one_ulp_away(state: Any) -> Any:
    """`state` with every floating-point element moved one ulp (jnp.nextafter), towards +inf or
    -inf as a fixed key (FLOOR_KEY, folded with the leaf's index) draws it; other leaves (integers,
    PRNG keys) as they are. Deterministic: the same state gives the same bits every time."""
    import jax
    import jax.numpy as jnp
    import xxhash

    root = jax.random.key(xxhash.xxh32_intdigest(FLOOR_KEY.encode()) & 0x7FFFFFFF, impl="threefry2x32")
    leaves, tree = jax.tree.flatten(state)
    moved = []
    for i, x in enumerate(leaves):
        if isinstance(x, (jax.Array, np.ndarray)) and jnp.issubdtype(x.dtype, jnp.floating):
            up = jax.random.bernoulli(jax.random.fold_in(root, i), 0.5, x.shape)
            if isinstance(x, jax.Array):  # laid out as the leaf is (a sharded state stays sharded)
                up = jax.device_put(up, x.sharding)
            x = jnp.nextafter(x, jnp.where(up, jnp.inf, -jnp.inf).astype(x.dtype))
        moved.append(x)
    return jax.tree.unflatten(tree, moved)
