"""A fast stable argsort of uint64 hashes: what the segment index and the audit sort with."""

from __future__ import annotations

import numpy as np


def stable_argsort(flat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """np.argsort(flat, kind="stable") and flat in that order, about 3x faster.

    A stable argsort of 16M uint64 is numpy's slow merge sort. Instead the slot index is
    packed into the low bits of each hash and the keys go through numpy's SIMD value sort.
    Different hashes that agree on the remaining high bits can interleave; those few
    buckets are re-sorted exactly afterwards.
    """
    bits = max(1, (flat.size - 1).bit_length())
    if bits > 40:  # the key would keep fewer than 24 hash bits: too many clashes to fix up
        order = np.argsort(flat, kind="stable")
        return order, flat[order]
    low = np.uint64((1 << bits) - 1)
    key = flat & ~low
    key |= np.arange(flat.size, dtype=np.uint64)
    key.sort()
    order = (key & low).view(np.int64)  # slots < 2**40: the bits are the same as int64
    hs = flat[order]
    high = key
    high &= ~low  # in place: fresh full-size arrays are a large part of the cost
    clash = np.flatnonzero((high[1:] == high[:-1]) & (hs[1:] != hs[:-1]))
    if clash.size:
        values = high[clash]  # the clashing buckets: runs of equal high bits, found by bisection
        lo, hi = np.searchsorted(high, values, "left"), np.searchsorted(high, values, "right")
        at = np.unique(np.concatenate([np.arange(a, b) for a, b in zip(lo.tolist(), hi.tolist())]))
        fix = np.lexsort((order[at], hs[at]))  # by full hash, then slot; buckets keep their place
        order[at], hs[at] = order[at][fix], hs[at][fix]
    return order, hs
