"""A user loop on several processes (jax.distributed: one per host): the per-example hashes of a
global batch, each process hashing only the rows it holds and the global order gathered on
device, off the critical path (replay/record/gather.py, as the trainer does).

The batch a multi-process step is fed is a pytree of global `jax.Array`s (made with
`jax.make_array_from_process_local_data` or `jax.device_put` onto a NamedSharding), each sharded
along its first axis, the example axis: each process holds a contiguous block of examples, in
process order, on its devices (data parallelism). Anything else is refused in one line.
Cost per step: this process's rows copied to the host once and hashed (as one process does for
the whole batch), one small all-gather on device.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from replay.record.errors import RecordError
from replay.record.gather import start_gather
from replay.record.hashing import example_hashes, refuse_typed_keys


def gathered_hashes(batch: Any, batch_axis: int) -> Any:
    """The global per-example hashes of `batch` (a GatheredHashes in flight)."""
    import jax

    if batch_axis != 0:
        raise RecordError(f"run.step(batch_axis={batch_axis}) on {jax.process_count()} processes: the examples must "
                          "be the first axis of every batch leaf (each process holds a block of them)")
    refuse_typed_keys(batch)  # before their rows are copied: numpy has no view of them
    leaves, treedef = jax.tree_util.tree_flatten(batch)
    local, sharding = [], None
    for leaf in leaves:
        if not isinstance(leaf, jax.Array) or not isinstance(leaf.sharding, jax.sharding.NamedSharding):
            raise RecordError(f"a run of {jax.process_count()} processes is fed global jax.Arrays on a NamedSharding "
                              f"(jax.make_array_from_process_local_data), not {type(leaf).__name__}; build the batch so")
        spec = tuple(leaf.sharding.spec) + (None,)
        if spec[0] is None:
            raise RecordError("a batch leaf of a multi-process run is not sharded along its example axis; shard axis 0 "
                              "over the data-parallel mesh axes")
        sharding = sharding or jax.sharding.NamedSharding(leaf.sharding.mesh, jax.sharding.PartitionSpec(spec[0]))
        local.append(_local_rows(leaf))
    lengths = {len(x) for x in local}
    if len(lengths) != 1:
        raise RecordError("the batch leaves of this process hold different numbers of examples; shard every leaf's "
                          "example axis alike")
    hashes = example_hashes(jax.tree_util.tree_unflatten(treedef, local), 0)
    return start_gather(hashes, sharding.mesh, sharding)


def _local_rows(leaf: Any) -> np.ndarray:
    """This process's rows of a global array, in global order (one copy of each row block: the
    replicas of a block on this process's other devices are the same rows)."""
    blocks: dict[int, Any] = {}
    for shard in leaf.addressable_shards:
        index = tuple(shard.index)
        rows, rest = (index[0], index[1:]) if index else (slice(None), ())
        if any(r != slice(None) and (r.start, r.stop) != (0, n) for r, n in zip(rest, leaf.shape[1:])):
            raise RecordError("a batch leaf of a multi-process run is sharded along an axis other than its examples; "
                              "replicate its other axes")
        blocks.setdefault(rows.start or 0, shard)
    return np.concatenate([np.asarray(blocks[k].data) for k in sorted(blocks)])
