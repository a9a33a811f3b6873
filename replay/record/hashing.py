"""Per-example hashes of a batch, on the host, before it is fed.

The convention is trainer/data.py's: xxh3_64 of each example's bytes, seeded by the dtype and
row shape (bytes alone are ambiguous). A batch that is a pytree hashes every leaf's row of an
example in tree order into one hash, with the seed covering each leaf's path, dtype and row
shape; a batch that is one array hashes exactly as the trainer's `example_hashes` does, so the
same rows give the same hashes whichever loop fed them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import xxhash

from replay.record.errors import RecordError


def _leaves(batch: Any, batch_axis: int) -> list[tuple[str, np.ndarray]]:
    import jax

    flat = jax.tree_util.tree_flatten_with_path(batch)[0]
    if not flat:
        raise RecordError("the batch has no arrays; pass the step's batch (a pytree of arrays with a batch axis)")
    out = []
    for path, leaf in flat:
        name = jax.tree_util.keystr(path, simple=True, separator=".") or "batch"
        if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
            raise RecordError(f"batch leaf {name} is a {type(leaf).__name__}, not an array with batch axis "
                              f"{batch_axis}; make it an array, or keep it out of the batch")
        a = np.asarray(leaf)  # a device array is copied to the host here: feed numpy batches to avoid that
        if a.ndim <= batch_axis:
            raise RecordError(f"batch leaf {name} has shape {list(a.shape)}, without batch axis {batch_axis}; "
                              "every batch leaf needs it (set run.step(batch_axis=...))")
        out.append((name, np.moveaxis(a, batch_axis, 0)))
    sizes = {n: a.shape[0] for n, a in out}
    if len(set(sizes.values())) != 1:
        raise RecordError(f"the batch leaves disagree on the batch size along axis {batch_axis}: "
                          + ", ".join(f"{n}={s}" for n, s in sizes.items()))
    return out


def batch_size(batch: Any, batch_axis: int) -> int:
    return _leaves(batch, batch_axis)[0][1].shape[0]


def example_hashes(batch: Any, batch_axis: int = 0) -> np.ndarray:
    """uint64[B]: one hash per example (index along `batch_axis`), in batch order."""
    leaves = [(n, np.ascontiguousarray(a.astype(a.dtype.newbyteorder("<"), copy=False))) for n, a in _leaves(batch, batch_axis)]
    return leaf_hashes(leaves)


def leaf_hashes(leaves: list[tuple[str, np.ndarray]]) -> np.ndarray:
    """uint64[B] of (name, little-endian contiguous array with the examples on axis 0) leaves: the
    one definition, shared by recording and by the example store's check of rebuilt batches."""
    if len(leaves) == 1 and leaves[0][0] == "batch":  # one array: trainer.data.example_hashes, bit for bit
        rows = leaves[0][1]
        seed = xxhash.xxh3_64_intdigest(f"{rows.dtype.name}{rows.shape[1:]}".encode())
        return np.array([xxhash.xxh3_64_intdigest(row, seed=seed) for row in rows], np.uint64)
    seed = xxhash.xxh3_64_intdigest(";".join(f"{n}={a.dtype.name}{a.shape[1:]}" for n, a in leaves).encode())
    # One contiguous row of bytes per example (the leaves' rows side by side): the hash of the
    # concatenation, one xxh3 call per example rather than one per leaf and example.
    rows = np.concatenate([a.reshape(a.shape[0], -1).view(np.uint8).reshape(a.shape[0], -1) for _, a in leaves], axis=1)
    return np.array([xxhash.xxh3_64_intdigest(row, seed=seed) for row in rows], np.uint64)
