"""Which microbatches a device computes in mesh-invariant mode, and one microbatch's gradient.

Shared by the step (trainer/invariant.py) and the SDC re-runs (trainer/sdc.py), so that a
microbatch's gradient is the same program whichever device computes it and whichever of the two
computes it: that is what makes one device's work comparable bit for bit with another's.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from trainer.constants import BATCH_AXES


def microbatch(params: Any, cfg: Config, base: jax.Array, capture: bool, x: tuple,
               fixed_backward: bool = True) -> tuple[Any, dict]:
    """One microbatch's (grads, aux): the same program on any device and layout. `fixed_backward`:
    no plain reduces in softmax's and RMSNorm's backward (trainer/model.py); False only to measure
    what that buys."""
    from trainer import step as steplib

    inputs_mb, targets_mb, index = x
    key = jax.random.fold_in(base, index.astype(jnp.uint32))
    loss_fn = functools.partial(steplib.loss_fn, fixed_backward=fixed_backward)
    (_, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, cfg, inputs_mb, targets_mb, key, capture)
    return grads, aux



class Layout:
    """Which microbatches a device computes and how per-device results go to global order."""

    def __init__(self, n: int, local: int, m_total: int, stride: bool):
        self.n, self.local, self.m_total, self.stride = n, local, m_total, stride

    def tokens(self, inputs_bxL, targets_bxL, gathered: bool):
        """The tokens a device picks its work from: the whole batch (all-gathered: int32, small
        beside a gradient) when strided or rotated, else its own rows."""
        if not gathered:
            return inputs_bxL, targets_bxL, False
        return (lax.all_gather(inputs_bxL, BATCH_AXES, axis=0, tiled=True),
                lax.all_gather(targets_bxL, BATCH_AXES, axis=0, tiled=True), True)

    def work(self, tokens, w: jax.Array) -> tuple:
        """(inputs, targets, global microbatch index, local slot) of device w's microbatches."""
        inputs, targets, gathered = tokens
        n, local = self.n, self.local
        slots = jnp.arange(local, dtype=jnp.int32)
        if not gathered:
            mb = inputs.shape[0] // local
            return (inputs.reshape(local, mb, -1), targets.reshape(local, mb, -1), w * local + slots, slots)
        mb = inputs.shape[0] // self.m_total
        if self.stride:
            def mine(x):
                return lax.dynamic_index_in_dim(x.reshape(local, n, mb, -1), w, axis=1, keepdims=False)

            return mine(inputs), mine(targets), slots * n + w, slots
        def mine(x):  # consecutive: device w's `local` microbatches
            return lax.dynamic_slice_in_dim(x.reshape(self.m_total, mb, -1), w * local, local, axis=0)

        return mine(inputs), mine(targets), w * local + slots, slots

    def in_order(self, x_Kx: jax.Array) -> jax.Array:
        """[local microbatches, ...] on every device -> [M, ...] in global order."""
        if not self.stride:
            return lax.all_gather(x_Kx, BATCH_AXES, axis=0, tiled=True)
        x_NKx = lax.all_gather(x_Kx, BATCH_AXES, axis=0)  # [device, step]: microbatch step * n + device
        return jnp.swapaxes(x_NKx, 0, 1).reshape((self.m_total,) + x_Kx.shape[1:])

    def owner_order(self, x_Kx: jax.Array, rotate) -> jax.Array:
        """As in_order for results computed rotated: device d holds the work of (d + rotate) % n."""
        x_NKx = jnp.roll(lax.all_gather(x_Kx, BATCH_AXES, axis=0), rotate, axis=0)  # row o: owner o's work
        if not self.stride:
            return x_NKx.reshape((self.m_total,) + x_Kx.shape[1:])
        return jnp.swapaxes(x_NKx, 0, 1).reshape((self.m_total,) + x_Kx.shape[1:])
