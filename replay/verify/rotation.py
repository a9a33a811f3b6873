"""`replay verify` for any loop: re-run a step on rotated devices and compare it shard by shard.

The general method for a step recorded with its shardings: the step is re-executed from the same
state with every array moved r devices further (r = 0, K, 2K: replay/engine/placement.py), the
mesh shape, the partition specs and the program unchanged, so mesh position p (the same shard of
data, the same work) is computed by three different chips. On healthy hardware the three give the
same bits. Every output shard (the new state's and the metrics', each copy of a replicated one
too) is fingerprinted where it was computed; per shard the value the most distinct devices gave
is taken as right, and a device that gave another is an event (replay/verify/classify.py turns
events into findings: a device wrong again in the re-executions is a bad chip, named). A
single-device step re-runs on the device r further.

What this cannot see: damage that a reduction has already spread to every device (a wrong
gradient contribution all-reduced into replicated parameters) differs in every execution that
included the bad chip, so no shard has a majority; those shards are "unresolved", never
clean. The trainer's mesh-invariant replica mode (per-microbatch gradients before any
reduction) names such a chip; this names chips whose damage shows in their own shards
(activations, per-example losses, sharded parameters and optimizer state).

Cost per verified step: three executions of the step (each on copies of the state and the batch,
so two states' worth of memory at once), and every output shard fetched to the host once per
execution and hashed (xxh3-64): three times the step's output bytes over the device-host link.
Nothing depends on the run's length.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from replay.verify.classify import Event, majority

CAPABILITY = "rotated_step"  # what the general method asks of a run's replayable (replay/engine/protocol.py)


def shard_fingerprints(outputs: Any) -> dict[tuple[str, str], list[tuple[int, int]]]:
    """{(leaf name, shard index): [(device id, xxh3-64 of the shard's bytes), ...]} of every
    jax.Array leaf of `outputs`, one entry per addressable shard (a replicated leaf's copies share
    an index). The one place results leave the devices, so a test can stand a faulty chip here."""
    import jax
    import xxhash

    out: dict[tuple[str, str], list[tuple[int, int]]] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(outputs)[0]:
        if not isinstance(leaf, jax.Array):
            continue
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        name = jax.tree_util.keystr(path, simple=True, separator="/")
        for shard in leaf.addressable_shards:
            data = np.ascontiguousarray(np.asarray(shard.data))
            out.setdefault((name, _index(shard.index)), []).append(
                (shard.device.id, xxhash.xxh3_64_intdigest(data.tobytes() + str(data.dtype).encode())))
    return out


def _index(index: tuple) -> str:
    return ",".join(f"{s.start or 0}:{'' if s.stop is None else s.stop}" if isinstance(s, slice) else str(s)
                    for s in index)


def step_events(step: int, executions: dict[int, dict]) -> tuple[list[Event], list[int], list[str]]:
    """(events, unresolved shard numbers, shard names) of one step from its executions (rotation ->
    shard_fingerprints). An event's `microbatch` is the shard's number in the sorted shard names and
    its `layers` that number too, so classify names the shards a device computed wrongly."""
    keys = sorted({k for fps in executions.values() for k in fps})
    names = [f"{leaf}[{index}]" for leaf, index in keys]
    events, unresolved = [], []
    for slot, key in enumerate(keys):
        values = [(device, np.asarray([fp], np.uint64)) for fps in executions.values() for device, fp in fps.get(key, ())]
        if all(np.array_equal(v, values[0][1]) for _, v in values):
            continue
        right = majority(values)
        if right is None:
            unresolved.append(slot)
            continue
        wrong = sorted({device for device, value in values if not np.array_equal(value, right)})
        events += [Event(step, slot, device, False, [slot]) for device in wrong]
    return events, unresolved, names


def devices_used(executions: dict[int, dict]) -> int:
    return len({device for fps in executions.values() for values in fps.values() for device, _ in values})
