"""A device batch's per-example hashes, taken after the step that reads it was dispatched.

`run.step` hashes a batch before it dispatches the step. A batch of `jax.Array`s (a loop that
prefetches to device, or builds its batch with a jitted function) would then be copied to the
host first: the loop's thread waits for the batch to exist on device (the computation that
makes it, queued behind the previous step) and for the copy, every step, so it can never run
ahead of the device, and on an accelerator the device idles while the host hashes and
dispatches. `DeferredHashes` keeps the batch's arrays instead (they are immutable) and hashes
them once they are ready: the recorder settles them at each later step, without waiting, and
in any case before the record is written. The hashes are the same bytes' (replay/record/hashing.py).

Only where it is safe and single-process: a step that donates its batch (its buffers may be
reused once the step runs), a run that stores its examples (it needs the hashes at once) and a
multi-process run (replay/record/multihost.py: every process must dispatch its gathers in the
same order) hash before the step, as before. Cost: the batch's device buffers live until the
recorder settles them, usually one step later; at most Recorder.MAX_HELD steps' batches.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from replay.record.hashing import batch_size, example_hashes, is_extended_dtype


class DeferredHashes:
    """uint64[B] per-example hashes of a device batch, computed on first `fetch()`; `is_ready()`
    says whether that would wait for the device."""

    def __init__(self, batch: Any, batch_axis: int):
        self._batch = batch
        self._axis = batch_axis
        self._size = batch_size(batch, batch_axis)
        self._host: np.ndarray | None = None

    def __len__(self) -> int:
        return self._size

    def is_ready(self) -> bool:
        import jax

        return self._host is not None or all(x.is_ready() for x in jax.tree_util.tree_leaves(self._batch))

    @property
    def fetched(self) -> bool:
        return self._host is not None

    def fetch(self) -> np.ndarray:
        if self._host is None:
            self._host = example_hashes(self._batch, self._axis)
            self._batch = None  # the device buffers are the loop's again
        return self._host

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        host = self.fetch()
        return host if dtype is None else host.astype(dtype, copy=False)


def deferrable(batch: Any, batch_axis: int, jit_options: dict) -> bool:
    """Whether `batch`'s hashes may be taken after the step: every leaf a jax.Array with the batch
    axis, all of one batch size, and a step that does not donate its batch (argument 1, or any
    argument by name). Anything else is hashed at once, where a bad batch is refused."""
    import jax

    leaves = jax.tree_util.tree_leaves(batch)
    if not leaves or not all(isinstance(x, jax.Array) and x.ndim > batch_axis for x in leaves):
        return False
    if any(is_extended_dtype(x.dtype) for x in leaves):
        return False  # PRNG key arrays have no host bytes: the immediate path fails at this step, not later
    if len({x.shape[batch_axis] for x in leaves}) != 1:
        return False  # leaves disagreeing on the batch size: the immediate path says so at this step
    donated = jit_options.get("donate_argnums", ())
    donated = (donated,) if isinstance(donated, int) else tuple(donated)
    return 1 not in donated and not jit_options.get("donate_argnames")
