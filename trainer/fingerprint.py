"""Device-side tensor fingerprint, bit-identical to the numpy reference in `traces.fingerprint`.

The definition (words, global index, seeds, fmix32, wrapping lane sums) is specified
in `traces/fingerprint.py`. Everything here is written against the *global* array,
so under `jax.jit` with sharded inputs XLA partitions it: each device mixes its own
elements with their global indices, and the wrapping uint32 sum (associative and
commutative) is reduced across devices in whatever order XLA picks, with the same
result on 1 or N devices.

Python scalars become JAX's default dtypes (int32/float32 without x64) before being
fingerprinted, while numpy makes them int64/float64: pass arrays to compare across the two.

Caveat: inside `shard_map` (manual partitioning) an array is the local shard, so
iota would give local indices; call these functions outside of it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from traces.fingerprint import GOLDEN, SUB_BYTE_RE, lane_seeds

__all__ = ["fingerprint_lanes", "fingerprint_tree", "lanes_to_int", "tree_to_ints"]

_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def _check_dtype(dtype) -> np.dtype:
    dtype = np.dtype(dtype)
    name = dtype.name
    if SUB_BYTE_RE.match(name):
        raise TypeError(f"fingerprint_lanes: sub-byte dtype {name!r} is not supported")
    if dtype.kind == "c" or dtype.itemsize not in (1, 2, 4, 8):
        raise TypeError(f"fingerprint_lanes: dtype {name!r} is not supported on device")
    if dtype.itemsize == 8 and not jax.config.jax_enable_x64:
        # Converting would silently fingerprint a float32/int32 copy, not the tensor given.
        raise TypeError(
            f"fingerprint_lanes: {name} needs jax_enable_x64; fingerprint it on the host "
            "with traces.fingerprint.fingerprint instead"
        )
    return dtype


def _fmix32(h):
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _words(x):
    """uint32 words of `x`; 8-byte dtypes get a trailing axis of 2 (low word, high word)."""
    if x.dtype == jnp.bool_:
        return lax.convert_element_type(x, jnp.uint32)
    n = x.dtype.itemsize
    u = lax.bitcast_convert_type(x, _UINT[n])
    if n < 8:
        return lax.convert_element_type(u, jnp.uint32)
    # Split arithmetically: bitcast to a narrower type would leave the word order to XLA.
    lo = lax.convert_element_type(u & jnp.uint64(0xFFFFFFFF), jnp.uint32)
    hi = lax.convert_element_type(u >> jnp.uint64(32), jnp.uint32)
    return jnp.stack([lo, hi], axis=-1)


def _global_index(shape: tuple[int, ...]):
    """Row-major flat index mod 2**32 as a sum of per-axis iotas.

    Built from small broadcastable iotas (one non-1 axis each) rather than a reshape
    of a flat iota, so nothing forces a relayout of a sharded operand; XLA fuses it.
    """
    idx = jnp.uint32(0)
    stride = 1
    for ax in reversed(range(len(shape))):
        shp = [1] * len(shape)
        shp[ax] = shape[ax]
        iota = lax.broadcasted_iota(jnp.uint32, tuple(shp), ax)
        idx = idx + iota * jnp.uint32(stride % (1 << 32))
        stride *= shape[ax]
    return idx


def fingerprint_lanes(x) -> jax.Array:
    """uint32[2] (lane_0, lane_1) of `x` viewed as the global (unsharded) tensor."""
    dtype = _check_dtype(x.dtype if hasattr(x, "dtype") else jnp.asarray(x).dtype)
    x = jnp.asarray(x)
    s0, s1 = lane_seeds(dtype.name, x.shape)
    w = _words(x)
    base = w + _global_index(w.shape) * jnp.uint32(GOLDEN)
    lanes = [jnp.sum(_fmix32(base + jnp.uint32(s)), dtype=jnp.uint32) for s in (s0, s1)]
    return jnp.stack(lanes)


def fingerprint_tree(tree):
    """The same pytree structure with a uint32[2] fingerprint at every array leaf."""
    return jax.tree.map(fingerprint_lanes, tree)


def lanes_to_int(lanes) -> int:
    """Pack device lanes (host-side) into the 64-bit int `traces.fingerprint` returns."""
    a = np.asarray(lanes, dtype=np.uint32)
    if a.shape != (2,):
        raise ValueError(f"expected uint32[2] lanes, got shape {a.shape}")
    return (int(a[0]) << 32) | int(a[1])


def tree_to_ints(lanes_tree):
    """Host-side: fingerprint_tree output -> same tree with 64-bit ints."""
    return jax.tree.map(lanes_to_int, jax.device_get(lanes_tree))
