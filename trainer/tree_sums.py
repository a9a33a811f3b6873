"""Fixed-order sums for mesh-invariant mode: one pairwise tree, whatever holds the terms.

`pair_tree` is the tree; `Counter` builds the same tree online, one term at a time (a scan
step's), holding log2(K) + 1 partial sums instead of the K terms; `split_axis` the axis a
gradient leaf is cut along for the reduce-scatter; `fixed_order_sums` the gradient's norm from
its shards; `sharded_norm` the same norm of any tree on a mesh (the updated parameters'). No XLA
reduce anywhere: XLA:CPU picks a reduce's order from the shape it sees, which follows the device
count; elementwise adds of slices have one order (trainer/model.py tree_sum).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from trainer.constants import BATCH_AXES


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


def split_axis(shape: tuple[int, ...], n_devices: int) -> int | None:
    """The axis a gradient leaf is cut along into `n_devices` shards: axis 0 (whole rows, so a
    shard is contiguous and gathers back without a transpose) if n_devices divides it, else None
    (the leaf stays whole on every device). The same axis on every count, so the norm's order
    (fixed_order_sums) is too."""
    return 0 if shape and shape[0] % n_devices == 0 else None


def pair_tree_along(x: jax.Array, axis: int) -> jax.Array:
    """pair_tree over `axis` of x, keeping that axis (size 1): the same adds on every other index."""
    while x.shape[axis] > 1:
        k = x.shape[axis]
        pairs = lax.slice_in_dim(x, 0, k - 1, 2, axis) + lax.slice_in_dim(x, 1, k, 2, axis)
        x = jnp.concatenate([pairs, lax.slice_in_dim(x, k - 1, k, 1, axis)], axis) if k % 2 else pairs
    return x


def row_sums_of_squares(x: jax.Array) -> jax.Array:
    """[rows] sums of x's squares over every axis but 0, by pairwise trees one axis after another
    ([1] for a scalar). Each row's adds are the same whether x holds every row or a shard of them:
    elementwise ops only, no XLA reduce."""
    sq = jnp.square(x)
    if x.ndim == 0:
        return sq.reshape(1)
    for axis in range(1, x.ndim):
        sq = pair_tree_along(sq, axis)
    return sq.reshape(x.shape[0])


def fixed_order_sums(leaves: list[jax.Array], cut: list[bool], gather) -> tuple[jax.Array, jax.Array]:
    """(global L2 norm, [leaves] sums of squares) of gradient leaves in one order whatever the
    device count: each leaf's row sums (row_sums_of_squares), all rows in global order (`gather(rows)`
    where the leaf is this device's shard of rows, cut[i]), a pair_tree over them; the norm is the
    sqrt of a pair_tree over the leaves' sums (tree order). The same adds as on one device holding
    every leaf whole."""
    totals = jnp.stack([pair_tree(gather(row_sums_of_squares(x)) if is_cut else row_sums_of_squares(x))
                        for x, is_cut in zip(leaves, cut)])
    return jnp.sqrt(pair_tree(totals)), totals


def sharded_norm(tree, mesh) -> jax.Array:
    """The global L2 norm of `tree` by fixed_order_sums, its leaves cut into rows over `mesh`'s batch
    axes as the gradient is (split_axis): the bits of one device holding every leaf whole, on any
    device count. A plain optax norm is an XLA reduce over whatever layout the leaves have, so its
    bits followed the device count (1 ULP, measured). No leaf is gathered whole: a replicated or
    row-sharded leaf is sliced in place, and only its per-row sums are all-gathered."""
    leaves = jax.tree.leaves(tree)
    n = int(mesh.devices.size)
    cut = [n > 1 and split_axis(x.shape, n) is not None for x in leaves]
    specs = tuple(P(BATCH_AXES) if is_cut else P() for is_cut in cut)  # split_axis is 0 where it cuts

    def per_device(*shards):  # in float32: bfloat16 parameters' squares summed in bfloat16 lose the norm
        gather = lambda rows: lax.all_gather(rows, BATCH_AXES, axis=0, tiled=True)  # noqa: E731
        return fixed_order_sums([x.astype(jnp.float32) for x in shards], cut, gather)[0]

    return jax.shard_map(per_device, mesh=mesh, in_specs=specs, out_specs=P(), check_vma=False)(*leaves)
