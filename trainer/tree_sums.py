"""Fixed-order sums for mesh-invariant mode: one pairwise tree, whatever holds the terms.

`pair_tree` is the tree; `Counter` builds the same tree online, one term at a time (a scan
step's), holding log2(K) + 1 partial sums instead of the K terms; `split_axis` the axis a
gradient leaf is cut along for the reduce-scatter. No XLA reduce anywhere: XLA:CPU picks a
reduce's order from the shape it sees, which follows the device count; elementwise adds of slices have one order (trainer/model.py tree_sum).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def pair_tree(x_Kx: jax.Array, levels: int | None = None) -> jax.Array:
    """Sum over axis 0 by a fixed pairwise tree: each level adds adjacent pairs (0+1, 2+3, ...),
    an odd last element is carried up unpaired. `levels` stops early (the result keeps axis 0).

    Consecutive blocks of 2^k elements are complete subtrees, so devices holding such blocks
    can reduce them locally and finish the tree on the gathered partial sums: the same adds,
    in the same order, as one device doing all of it.
    """
    done = 0
    while x_Kx.shape[0] > 1 and (levels is None or done < levels):
        k = x_Kx.shape[0]
        pairs = x_Kx[0:k - 1:2] + x_Kx[1:k:2]
        x_Kx = jnp.concatenate([pairs, x_Kx[k - 1:]], axis=0) if k % 2 else pairs
        done += 1
    return x_Kx if levels is not None else x_Kx[0]


class Counter:
    """pair_tree over K terms that arrive one at a time (term t at scan step t), as a binary counter.

    Slot l holds the complete subtree of the last 2^l terms whose block is not yet merged. Term t
    is merged with the slots of t's trailing one-bits, low to high (slot + running sum: the
    earlier terms are the left operand, as in pair_tree), and the result lands in the slot of
    the first zero bit. After the K terms the slots of K's one-bits hold the aligned complete
    subtrees of K's binary expansion; `finish` adds them low to high. That is pair_tree's tree:
    at level l pair_tree holds the complete 2^l-subtrees and, if K mod 2^l != 0, one remainder R_l
    (the tree of the last K mod 2^l terms); where K's bit l is set the last complete subtree
    pairs with R_l (subtree + R_l) or, with no R_l, is carried up alone; where it is clear R_l is
    carried up. (Proved by a test against pair_tree on random data for K = 1..33.)

    `cap` stops the tree at level cap (pair_tree(x, cap)): a subtree of 2^cap terms is complete
    and is written to row t >> cap of `partials` [K >> cap, ...] instead of a slot (K must be a
    multiple of 2^cap). Memory: (log2 K + 1) terms, or cap terms + K / 2^cap partials, instead
    of K; the price is a select per slot per step (the level a term stops at is not static).
    """

    def __init__(self, k: int, cap: int | None = None):
        if cap is not None and k % (1 << cap):
            raise ValueError(f"{k} terms do not split into complete subtrees of 2^{cap}")
        self.k, self.cap = k, cap
        self.n_slots = k.bit_length() if cap is None else cap

    def init(self, x: jax.ShapeDtypeStruct | jax.Array) -> tuple:
        slots = tuple(jnp.zeros(x.shape, x.dtype) for _ in range(self.n_slots))
        if self.cap is None:
            return slots, None
        return slots, jnp.zeros((self.k >> self.cap,) + tuple(x.shape), x.dtype)

    def push(self, state: tuple, x: jax.Array, t: jax.Array) -> tuple:
        """The state after term `x`, the t-th (int32 scalar, 0-based)."""
        slots, partials = state
        run = True  # every bit of t below l is one: x is still climbing at level l (host-side if t is)
        out = []
        for level, slot in enumerate(slots):
            one = (t >> level) & 1 == 1
            out.append(jnp.where(run & ~one, x, slot))  # first zero bit: x rests here
            x = jnp.where(run & one, slot + x, x)
            run = run & one
        if partials is not None:
            # Row t >> cap is written at every step of its block and last when the block
            # completes (run true), so what remains is the complete subtree; no row is revisited.
            partials = lax.dynamic_update_index_in_dim(partials, x, t >> self.cap, 0)
        return tuple(out), partials

    def finish(self, state: tuple) -> jax.Array:
        """The whole tree's sum (cap None) or the [K >> cap, ...] complete subtrees (pair_tree(x, cap))."""
        slots, partials = state
        if partials is not None:
            return partials
        total = None
        for level, slot in enumerate(slots):
            if self.k >> level & 1:
                total = slot if total is None else slot + total
        return total


def canonical_axis(shape: tuple[int, ...]) -> int | None:
    """The axis a leaf is split along when it is split: its largest (the first on a tie); None for
    a scalar. Independent of the device count, so the norm's order is too."""
    return max(range(len(shape)), key=lambda a: (shape[a], -a)) if shape else None


def split_axis(shape: tuple[int, ...], n_devices: int) -> int | None:
    """The axis a gradient leaf is cut along into `n_devices` shards: canonical_axis if n_devices
    divides it, else None (the leaf stays whole on every device)."""
    axis = canonical_axis(shape)
    return axis if axis is not None and shape[axis] % n_devices == 0 else None
