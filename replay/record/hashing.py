"""Per-example hashes of a batch, on the host, before it is fed.

The convention is trainer/data.py's: xxh3_64 of each example's bytes, seeded by the dtype and
row shape (bytes alone are ambiguous). A batch that is a pytree hashes every leaf's row of an
example in tree order into one hash, with the seed covering each leaf's path, dtype and row
shape; a batch that is one array hashes exactly as the trainer's `example_hashes` does, so the
same rows give the same hashes whichever loop fed them.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Any

import numpy as np
import xxhash

from replay.record.errors import RecordError


# FORMAT.md: batch_hash is xxh3-64 over the batch size and the per-example hashes, in global order.
_BATCH_HASH_TAG = xxhash.xxh3_64_intdigest(b"replay.data.batch_hash.v1")


def batch_hash(example_hashes_B: np.ndarray) -> int:
    """One uint64 over the per-example hashes in global order, and their count."""
    hashes = np.ascontiguousarray(example_hashes_B, dtype="<u8")
    h = xxhash.xxh3_64(seed=_BATCH_HASH_TAG)
    h.update(np.uint64(hashes.shape[0]).astype("<u8").tobytes())
    h.update(hashes)
    return h.intdigest()


_names: dict = {}  # batch treedef -> leaf names


def _leaves(batch: Any, batch_axis: int) -> list[tuple[str, np.ndarray]]:
    import jax

    leaves, treedef = jax.tree_util.tree_flatten(batch)
    if not leaves:
        raise RecordError("the batch has no arrays; pass the step's batch (a pytree of arrays with a batch axis)")
    names = _names.get(treedef)
    if names is None:  # once per batch structure: paths are slow to build, and every step has the same
        names = _names[treedef] = [jax.tree_util.keystr(path, simple=True, separator=".") or "batch"
                                   for path, _ in jax.tree_util.tree_flatten_with_path(batch)[0]]
    out = []
    for name, leaf in zip(names, leaves):
        if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
            raise RecordError(f"batch leaf {name} is a {type(leaf).__name__}, not an array with batch axis "
                              f"{batch_axis}; make it an array, or keep it out of the batch")
        if is_extended_dtype(leaf.dtype):
            raise _typed_keys(name, leaf.dtype)
        a = np.asarray(leaf)  # a device array is copied to the host here: feed numpy batches to avoid that
        if a.ndim <= batch_axis:
            raise RecordError(f"batch leaf {name} has shape {list(a.shape)}, without batch axis {batch_axis}; "
                              "every batch leaf needs it (set run.step(batch_axis=...))")
        out.append((name, np.moveaxis(a, batch_axis, 0) if batch_axis else a))
    sizes = {n: a.shape[0] for n, a in out}
    if len(set(sizes.values())) != 1:
        raise RecordError(f"the batch leaves disagree on the batch size along axis {batch_axis}: "
                          + ", ".join(f"{n}={s}" for n, s in sizes.items()))
    return out


def refuse_typed_keys(batch: Any) -> None:
    """RecordError naming the first leaf of `batch` that holds typed PRNG keys, if any (a path that
    copies rows itself before hashing them: several processes' local rows)."""
    import jax

    leaves = jax.tree_util.tree_leaves(batch)
    if any(is_extended_dtype(getattr(leaf, "dtype", None)) for leaf in leaves):  # paths only then: slow to build
        for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
            if is_extended_dtype(getattr(leaf, "dtype", None)):
                raise _typed_keys(jax.tree_util.keystr(path, simple=True, separator=".") or "batch", leaf.dtype)


def _typed_keys(name: str, dtype) -> RecordError:
    return RecordError(f"batch leaf {name} holds {dtype} (typed PRNG keys, which have no bytes to hash); "
                       "put jax.random.key_data(keys) in the batch instead, or keep the keys out of it")


def is_extended_dtype(dtype) -> bool:
    """Whether `dtype` is one of JAX's extended dtypes (typed PRNG keys): no numpy view of its bytes."""
    if dtype is None or isinstance(dtype, np.dtype):  # every numpy dtype, and a jax.Array's of numbers (~0.1 us)
        return False
    import jax

    try:
        return bool(jax.dtypes.issubdtype(dtype, jax.dtypes.extended))
    except TypeError:  # a dtype JAX does not know (object arrays): numpy's own error path below
        return False


def batch_size(batch: Any, batch_axis: int) -> int:
    import jax

    leaves = jax.tree_util.tree_leaves(batch)
    if leaves and all(isinstance(x, jax.Array) and x.ndim > batch_axis for x in leaves):
        return int(leaves[0].shape[batch_axis])  # read from the shape: a global array of several hosts has no host copy
    return _leaves(batch, batch_axis)[0][1].shape[0]


def example_hashes(batch: Any, batch_axis: int = 0) -> np.ndarray:
    """uint64[B]: one hash per example (index along `batch_axis`), in batch order."""
    return leaf_hashes([(n, little_endian_rows(a)) for n, a in _leaves(batch, batch_axis)])


def little_endian_rows(a: np.ndarray) -> np.ndarray:
    """`a` as a little-endian C-contiguous array: itself when it is one (every step of a loop
    feeding native arrays on a little-endian host: a dtype built per step cost more than its hash)."""
    if a.dtype.byteorder == ">" or (a.dtype.byteorder == "=" and not np.little_endian):
        a = a.astype(a.dtype.newbyteorder("<"))
    return np.ascontiguousarray(a)


def leaf_hashes(leaves: list[tuple[str, np.ndarray]]) -> np.ndarray:
    """uint64[B] of (name, little-endian contiguous array with the examples on axis 0) leaves: the
    one definition, shared by recording and by the example store's check of rebuilt batches."""
    if len(leaves) == 1 and leaves[0][0] == "batch":  # one array: trainer.data.example_hashes, bit for bit
        rows = leaves[0][1]
        seed = _layout_seed((("", rows.dtype, rows.shape[1:]),), True)
        return _row_hashes(_flat_rows(rows).view(np.uint8), seed)
    seed = _layout_seed(tuple((n, a.dtype, a.shape[1:]) for n, a in leaves), False)
    # One contiguous row of bytes per example (the leaves' rows side by side): the hash of the
    # concatenation, one xxh3 call per example rather than one per leaf and example.
    rows = np.concatenate([_flat_rows(a).view(np.uint8) for _, a in leaves], axis=1)
    return _row_hashes(rows, seed)


def _flat_rows(a: np.ndarray) -> np.ndarray:
    """`a` as [examples, elements of a row] (a reshape with -1 is ambiguous for a batch of none)."""
    return a.reshape(a.shape[0], math.prod(a.shape[1:]))  # math's: numpy's prod of a tuple cost ~3 us a call


@functools.lru_cache(maxsize=256)
def _layout_seed(layout: tuple, one_array: bool) -> int:
    """The seed of a batch layout ((name, dtype, row shape) per leaf), its text built once per
    layout rather than every step (dtype.name alone cost ~4 us a leaf)."""
    if one_array:
        (_, dtype, shape), = layout
        return xxhash.xxh3_64_intdigest(f"{dtype.name}{shape}".encode())
    return xxhash.xxh3_64_intdigest(";".join(f"{n}={dtype.name}{shape}" for n, dtype, shape in layout).encode())


def _row_hashes(rows: np.ndarray, seed: int) -> np.ndarray:
    """xxh3_64 of each row of a C-contiguous uint8 [B, W] array. Slices of one memoryview are
    ~3x cheaper to hash than numpy row views (measured: 0.21 vs 0.61 us a row at 1,024 x 260 B),
    and this runs on the host every step."""
    b = rows.shape[0]
    w = rows.shape[1] if rows.ndim == 2 else 0
    if b == 0:
        return np.zeros((0,), np.uint64)
    if not w:
        return np.full((b,), xxhash.xxh3_64_intdigest(b"", seed), np.uint64)
    mv = memoryview(np.ascontiguousarray(rows)).cast("B")
    # map over the slices (no Python frame per row) and fromiter (no list of ints): ~35% less than
    # a comprehension into np.array at 128 rows of 260 B; the row slices made once per batch shape:
    # ~20% less again.
    return np.fromiter(map(xxhash.xxh3_64_intdigest, map(mv.__getitem__, _row_slices(b, w)), itertools.repeat(seed, b)),
                       np.uint64, b)


@functools.lru_cache(maxsize=64)
def _row_slices(b: int, w: int) -> tuple[slice, ...]:
    """The byte slices of `b` rows of `w` bytes (every step of a loop has the same batch shape)."""
    return tuple(slice(i, i + w) for i in range(0, w * b, w))
