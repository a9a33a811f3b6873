"""replay/engine/placement.py `rotated` copies (rotation 0) or moves a step's arrays with no program
compiled: Array.copy, like a device_put of a whole array onto other devices, compiled a small
program per leaf's shape and layout, as many compiles as the state has leaves, for every rotation
`replay verify` re-runs a step on. One device here; the moves across devices are judged by
tests/examples/test_verify_loops.py (4 devices: each loop's clean run verifies clean on three
rotations, and a bad chip is named)."""

from __future__ import annotations

import jax
import numpy as np

from replay.engine.placement import rotated
from tests.replay.test_first_op_compiles import compiles


def test_a_rotation_0_copy_compiles_nothing_and_holds_its_own_buffers():
    tree = {"w": jax.device_put(np.arange(3 * 7 * 11, dtype=np.float32).reshape(3, 7, 11) + 0.5),
            "b": jax.device_put(np.arange(13, dtype=np.int32) - 4), "key": jax.random.key(5), "host": np.ones(2)}
    with compiles() as names:
        copied = jax.block_until_ready(rotated(tree, 0))
    assert names == []
    assert copied["host"] is tree["host"]  # not a jax.Array: placed by the step as when recording
    assert np.array_equal(jax.random.key_data(copied["key"]), jax.random.key_data(tree["key"]))
    for name in ("w", "b"):
        before = np.asarray(tree[name]).copy()
        assert copied[name].sharding == tree[name].sharding and np.array_equal(np.asarray(copied[name]), before)
        copied[name].delete()  # a donating step consumes the copy, never the caller's array
        assert not tree[name].is_deleted() and np.array_equal(np.asarray(tree[name]), before)
