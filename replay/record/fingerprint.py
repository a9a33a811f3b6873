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
from traces.fingerprint import fingerprint as host_fingerprint
from traces.sketch import CHUNK_ROWS, ROW_SEED, SIGN_SEED, check_width
import hashlib

__all__ = ["fingerprint_lanes", "fingerprints_and_sums_of_squares", "fingerprint_tree", "lanes_to_int", "norms_from_rms",
           "sketch_and_norm", "sketch_rows",
           "state_fingerprint", "tree_to_ints"]

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


def _u32(c: int) -> np.uint32:
    """`c` mod 2**32 as a uint32 scalar operand (lax refuses it beside any other dtype)."""
    return np.uint32(c % (1 << 32))


# Written with lax primitives, not jnp operators: the same uint32 ops (exact, so the same bits),
# but jnp's operator dispatch (promotion, weak types, broadcasting checks) was more than half the
# time tracing a layer-level step, which every process that builds one pays.
def _fmix32(h):
    h = lax.bitwise_xor(h, lax.shift_right_logical(h, _u32(16)))
    h = lax.mul(h, _u32(0x85EBCA6B))
    h = lax.bitwise_xor(h, lax.shift_right_logical(h, _u32(13)))
    h = lax.mul(h, _u32(0xC2B2AE35))
    return lax.bitwise_xor(h, lax.shift_right_logical(h, _u32(16)))


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


def _global_index(shape: tuple[int, ...], scale: int = 1):
    """(row-major flat index * scale) mod 2**32, as a sum of per-axis iotas.

    Built from one iota per axis (broadcasted_iota over the whole shape) rather than a
    reshape of a flat iota, so nothing forces a relayout of a sharded operand; XLA fuses it.
    Wrapping uint32 arithmetic is a ring, so `scale` folds into the per-axis constants
    (index * GOLDEN costs no extra multiply per element).
    """
    idx = None
    stride = 1
    for ax in reversed(range(len(shape))):
        iota = lax.broadcasted_iota(jnp.uint32, shape, ax)
        term = lax.mul(iota, _u32(stride * scale))
        idx = term if idx is None else lax.add(idx, term)
        stride *= shape[ax]
    return lax.full(shape, 0, jnp.uint32) if idx is None else idx


def _lane_terms(x: jax.Array, dtype: np.dtype) -> list[jax.Array]:
    """The per-word terms fmix32(bits + index * GOLDEN + seed_k) whose sums are the two lanes."""
    s0, s1 = lane_seeds(dtype.name, x.shape)
    w = _words(x)
    base = lax.add(w, _global_index(w.shape, GOLDEN))
    return [_fmix32(lax.add(base, _u32(s))) for s in (s0, s1)]


def _add(a: tuple, b: tuple) -> tuple:
    return tuple(p + q for p, q in zip(a, b))


def _reduce_all(terms: list[jax.Array], inits: list[jax.Array]) -> tuple[jax.Array, ...]:
    # One variadic reduce: both lanes (and any extra sum) in a single pass over the tensor.
    # On XLA:CPU this is several times faster than one reduce per lane (measured on the demo
    # preset's layer record: ~2.5 ms instead of ~38 ms for 9M elements), and under sharding
    # each device still reduces its own elements first. Integer lane sums are exact in any order.
    return lax.reduce(tuple(terms), tuple(inits), _add, tuple(range(terms[0].ndim)))


def fingerprint_lanes(x) -> jax.Array:
    """uint32[2] (lane_0, lane_1) of `x` viewed as the global (unsharded) tensor."""
    dtype = _check_dtype(x.dtype if hasattr(x, "dtype") else jnp.asarray(x).dtype)
    x = jnp.asarray(x)
    return jnp.stack(_reduce_all(_lane_terms(x, dtype), [jnp.uint32(0)] * 2))


def fingerprints_and_sums_of_squares(xs) -> tuple[jax.Array, jax.Array]:
    """uint32[T, 2] fingerprint lanes and float32[T] sums of squares of T tensors.

    Row t of the lanes is exactly `fingerprint_lanes(xs[t])`; both come from one fused pass over
    each tensor, and the T results are gathered by one concatenation per output rather than one
    per tensor (on XLA:CPU every small op is a separate kernel, which adds up over hundreds of
    tensors). The sums of squares are accumulated in float32 in whatever order XLA's reduce
    picks (deterministic for a given program): they feed the RMS a record shows for reports,
    not a bit-exact quantity.
    """
    l0s, l1s, sss = [], [], []
    for x in xs:
        dtype = _check_dtype(x.dtype if hasattr(x, "dtype") else jnp.asarray(x).dtype)
        x = jnp.asarray(x)
        terms = _lane_terms(x, dtype)
        xf = x.astype(jnp.float32)
        if xf.shape == terms[0].shape:
            l0, l1, ss = _reduce_all(terms + [xf * xf], [jnp.uint32(0), jnp.uint32(0), jnp.float32(0)])
        else:  # 8-byte dtypes: two words per element
            (l0, l1), ss = _reduce_all(terms, [jnp.uint32(0)] * 2), jnp.sum(jnp.square(xf))
        l0s.append(l0)
        l1s.append(l1)
        sss.append(ss)
    if not xs:
        return jnp.zeros((0, 2), jnp.uint32), jnp.zeros((0,), jnp.float32)
    return jnp.stack([jnp.stack(l0s), jnp.stack(l1s)], axis=-1), jnp.stack(sss)


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


# ------------------------------------------------------------------------ a whole state

@jax.jit
def _leaf_lanes(leaves: list) -> list:
    return [fingerprint_lanes(x) for x in leaves]


def _as_bits(x):
    """A leaf as an array of its stored bits: typed PRNG keys as their raw key words."""
    if hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(x)
    return x if isinstance(x, jax.Array) else jnp.asarray(x)


def _host(lanes: jax.Array) -> np.ndarray:
    # Replicated output; in a multi-process run it is not fully addressable, so read this
    # process's copy rather than the global value.
    return np.asarray(lanes.addressable_shards[0].data, np.uint32)


def leaf_fingerprints(state) -> list[int]:
    """Every leaf's 64-bit fingerprint in tree order (typed PRNG keys as their key words), as the
    trace records the state entering a step. On device, 8 bytes a leaf reach the host; the same
    for any sharding, device or process count. Every process of a multi-process run must call it."""
    leaves = [_as_bits(x) for x in jax.tree_util.tree_leaves(state)]
    on_device = [i for i, x in enumerate(leaves) if x.dtype.itemsize < 8 or jax.config.jax_enable_x64]
    lanes = _leaf_lanes([leaves[i] for i in on_device])
    values: dict[int, int] = {i: lanes_to_int(_host(l)) for i, l in zip(on_device, lanes)}
    # 8-byte leaves without x64: the numpy reference, same definition
    return [values[i] if i in values else host_fingerprint(np.asarray(jax.device_get(x))) for i, x in enumerate(leaves)]


def state_fingerprint(state) -> str:
    """16 hex digits: a 64-bit fingerprint of every leaf of `state` (its path, dtype, shape and
    exact bits), in tree order (`leaf_fingerprints`, hashed with each leaf's path, dtype and shape).
    In a multi-process run every process must call it (the fingerprints are a collective)."""
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    paths = [jax.tree_util.keystr(p, simple=True, separator=".") for p, _ in flat]
    leaves = [_as_bits(x) for _, x in flat]
    values = leaf_fingerprints(state)
    h = hashlib.blake2b(digest_size=8)
    for path, x, value in zip(paths, leaves, values):
        h.update(f"{path}|{np.dtype(x.dtype).name}|{list(x.shape)}|{value:016x};".encode())
    return h.hexdigest()


# ------------------------------------------------------------------------ distance sketches
#
# Why not in the fingerprint's own reduce (issue 34): one variadic reduce a tensor over the rows of
# [chunks, CHUNK_ROWS, W], with outputs per (chunk, bucket) for the two lanes, the sum of squares and
# the sketch (each row's columns gathered by c XOR offset(r)), does read each tensor once (one loop
# fusion a tensor in the HLO), but XLA:CPU emits that partial variadic reduce with its gather as a
# scalar loop: 8.4 ms wall / 15.9 ms CPU for 6 x [1024, 512] float32 against 2.4 / 4.3 ms for the
# fingerprint plus `sketch_rows` below (`python -m bench.sketch_overhead --shapes 6x1024x512
# --one-pass`, idle machine, 2026-12-06). So the fingerprint stays the full reduce it was (same
# bits) and the sketch is a scatter-add of whole signed rows, with what depends on the index only
# hashed once a program, and its norm from the fingerprint's sum of squares (trainer/sketches.py).

# The sign table is shared up to this many elements (1 byte each); larger tensors hash their own.
SHARED_SIGN_ELEMENTS = 1 << 24


def _negative_rows(rows: int, width: int) -> jax.Array:
    """bool[rows, W]: element e = r * W + c has sign -1 (traces/sketch.py). It depends on e only, so
    one table serves every tensor of a program (a slice of the first rows), hashed once."""
    e = lax.add(lax.mul(lax.broadcasted_iota(jnp.uint32, (rows, width), 0), _u32(width)),
                lax.broadcasted_iota(jnp.uint32, (rows, width), 1))
    return lax.shift_right_logical(_fmix32(lax.add(lax.mul(e, _u32(GOLDEN)), _u32(SIGN_SEED))), _u32(31)) == _u32(1)


def _as_rows(x, width: int) -> jax.Array:
    """float32[rows, W]: the values in row-major order, zero-padded to whole rows (at least one)."""
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        raise TypeError(f"sketch: complex dtype {x.dtype} has no distance sketch")
    v = x.astype(jnp.float32).reshape(-1)
    n = v.shape[0]
    rows = max(1, -(-n // width))
    if rows * width != n:
        v = jnp.pad(v, (0, rows * width - n))
    return v.reshape(rows, width)


def _segments(rows: int, width: int) -> jax.Array:
    """int32[rows]: row r's segment, chunk * W + offset(r); like the signs, a function of r only."""
    r = lax.iota(jnp.uint32, rows)
    offset = lax.bitwise_and(_fmix32(lax.add(lax.mul(r, _u32(GOLDEN)), _u32(ROW_SEED))), _u32(width - 1))
    return lax.convert_element_type(lax.add(lax.mul(lax.div(r, _u32(CHUNK_ROWS)), _u32(width)), offset), jnp.int32)


def _offset_table(v: jax.Array, negative: jax.Array, segments: jax.Array, width: int) -> jax.Array:
    """float32[W, W]: table[k, c] = sum of the signed v[r, c] over the rows r of offset k. ONE scatter-add
    of whole rows into segment (row chunk, row offset): float32 sums of at most CHUNK_ROWS / W rows on
    average, then a reduce over chunks."""
    chunks = -(-v.shape[0] // CHUNK_ROWS)
    table = jax.ops.segment_sum(jnp.where(negative, -v, v), segments, num_segments=chunks * width)
    return table if chunks == 1 else table.reshape(chunks, width, width).sum(axis=0)


def sketch_rows(xs, width: int) -> jax.Array:
    """float32[T, W] distance sketches of T tensors (traces/sketch.py), as global tensors, without
    their norms (a caller that fingerprints the same tensors has their sums of squares).

    What depends on the element index only (the signs, each row's segment) is hashed once, for the
    largest tensor up to SHARED_SIGN_ELEMENTS, and sliced for the others; the XOR permutation of
    the T [W, W] offset tables (sketch[b] = sum over k of table[k, b XOR k]) is one gather for all.
    On XLA:CPU every small op is a kernel of its own: per tensor, only the signed rows and their
    scatter remain. Within traces/sketch.py's tolerance of the float64 reference. Global indices
    (iota): call it outside shard_map."""
    width = check_width(width)
    if not xs:
        return jnp.zeros((0, width), jnp.float32)
    vs = [_as_rows(jnp.asarray(x), width) for x in xs]
    shared = max((v.shape[0] for v in vs if v.size <= SHARED_SIGN_ELEMENTS), default=0)
    negative, segments = (_negative_rows(shared, width), _segments(shared, width)) if shared else (None, None)
    tables = []
    for v in vs:
        rows = v.shape[0]
        if v.size <= SHARED_SIGN_ELEMENTS:
            tables.append(_offset_table(v, negative[:rows], segments[:rows], width))
        else:
            tables.append(_offset_table(v, _negative_rows(rows, width), _segments(rows, width), width))
    k = np.arange(width, dtype=np.int32)
    return jnp.stack(tables)[:, k[:, None], k[:, None] ^ k[None, :]].sum(axis=1)  # [t, k, b] = table_t[k, b XOR k]


def sketch_and_norm(x, width: int) -> tuple[jax.Array, jax.Array]:
    """float32[W] distance sketch and float32 L2 norm of `x` (traces/sketch.py), as the global tensor:
    `sketch_rows` of one tensor, and the norm of its float32 values."""
    x = jnp.asarray(x)
    sketch = sketch_rows([x], width)[0]
    flat = x.astype(jnp.float32)
    return sketch, jnp.sqrt(jnp.sum(flat * flat))


def norms_from_rms(rms, sizes) -> jax.Array:
    """float32[T] L2 norms of T tensors from the RMS their fingerprint pass already took
    (`fingerprints_and_sums_of_squares`): rms * sqrt(elements), within a few float32 roundings of
    sqrt(sum of squares), without a second pass over the tensors. `sizes`: their element counts."""
    return rms * jnp.asarray([float(max(1, int(n))) ** 0.5 for n in sizes], jnp.float32)
