"""Moving a step's arrays to other devices with their layout kept: what `replay verify` re-runs on.

A rotation by r replaces every device by the one r places further in this process's device list
(jax.local_devices(), cyclic). A NamedSharding keeps its mesh shape, axis names and partition
spec on a mesh whose devices are so replaced, so mesh position p (the same shard of every array)
is computed by another chip; a single-device array moves to the device r further. The same
program on the same shards of data must give the same bits on another chip: a shard that
differs between rotations names the chip that computed it wrongly (replay/verify/rotation.py).

Only one process: a rotation across hosts would move shards between processes, which a
`device_put` cannot do; `rotation_problem` says so in one line.

Cost: `rotated` copies every array once (device to device), holding a second copy of the state
and the batch while the re-run lasts; nothing depends on the run's length.
"""

from __future__ import annotations

from typing import Any


def rotation_problem(rotate: int) -> str | None:
    """Why arrays cannot be rotated by `rotate` here (None: they can)."""
    import jax

    if jax.process_count() > 1:
        return (f"re-running on rotated devices moves shards between devices of one process; this run has "
                f"{jax.process_count()} processes: verify from one process with enough devices")
    if rotate % jax.local_device_count() == 0 and rotate != 0:
        return f"a rotation by {rotate} of {jax.local_device_count()} devices moves nothing"
    return None


def rotate_device(device: Any, rotate: int) -> Any:
    import jax

    devices = sorted(jax.local_devices(), key=lambda d: d.id)
    return devices[(devices.index(device) + rotate) % len(devices)]


def rotated_sharding(sharding: Any, rotate: int) -> Any:
    """`sharding` with every device replaced by the one `rotate` further (see the module doc)."""
    import jax
    import numpy as np

    if isinstance(sharding, jax.sharding.NamedSharding):
        mesh = sharding.mesh
        moved = np.vectorize(lambda d: rotate_device(d, rotate), otypes=[object])(mesh.devices)
        return jax.sharding.NamedSharding(jax.sharding.Mesh(moved, mesh.axis_names), sharding.spec,
                                          memory_kind=sharding.memory_kind)
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        (device,) = sharding.device_set
        return jax.sharding.SingleDeviceSharding(rotate_device(device, rotate), memory_kind=sharding.memory_kind)
    raise ValueError(f"an array laid out by {type(sharding).__name__} cannot be moved to rotated devices; "
                     "lay the step's arrays out with NamedSharding (or on one device)")


def rotated(tree: Any, rotate: int) -> Any:
    """Every jax.Array leaf of `tree` on `rotated_sharding(leaf.sharding, rotate)`, as a new array
    (also for rotate 0: a donating step consumes the copy, never the caller's); other leaves (numpy
    batches, Python scalars) as they are: the step places them as it did when recording."""
    import jax

    devices = sorted(jax.local_devices(), key=lambda d: d.id)
    to = {d: devices[(i + rotate) % len(devices)] for i, d in enumerate(devices)}

    def move(x: Any) -> Any:
        if not isinstance(x, jax.Array):
            return x
        if rotate == 0:  # fresh buffers where they are (Array.copy compiles a program per leaf shape)
            return jax.device_put(x, x.sharding, may_alias=False)
        sharding = rotated_sharding(x.sharding, rotate)
        if not x.is_fully_addressable:
            return jax.device_put(x, sharding)
        # Shard by shard, each a plain copy onto the device its mesh position now names: a
        # device_put of the whole array onto other devices compiles a program per leaf's shape and
        # layout, as many small compiles as the state has leaves, for every rotation.
        shards = [jax.device_put(s.data, jax.sharding.SingleDeviceSharding(
            to[s.device], memory_kind=s.data.sharding.memory_kind), may_alias=False) for s in x.addressable_shards]
        return jax.make_array_from_single_device_arrays(x.shape, sharding, shards)

    return jax.tree.map(move, tree)
