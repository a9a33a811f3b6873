"""replay/engine/replayer.py `_copy`: the copy of a state a donating step may consume is fresh
buffers with the same bits and placement, and costs no compile (x.copy() compiled one program per
leaf shape: 7 or 8 of a bisect's compiles on the example loops)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from replay.engine.replayer import _copy
from tests.replay.test_first_op_compiles import compiles


def test_a_state_copy_is_fresh_buffers_of_the_same_bits_and_compiles_nothing():
    state = {"w": jnp.arange(12, dtype=jnp.float32).reshape(3, 4) + 0.5, "b": jnp.ones((7,), jnp.bfloat16),
             "n": jnp.int32(3), "key": jax.random.key(1), "host": np.arange(3), "step": 5}
    with compiles() as names:
        copy = _copy(state)
    assert names == []
    for k in ("w", "b", "n"):
        assert copy[k] is not state[k] and copy[k].sharding == state[k].sharding
        assert copy[k].unsafe_buffer_pointer() != state[k].unsafe_buffer_pointer()
        assert copy[k].dtype == state[k].dtype and np.array_equal(np.asarray(copy[k]), np.asarray(state[k]))
    assert jax.dtypes.issubdtype(copy["key"].dtype, jax.dtypes.prng_key)
    assert np.array_equal(jax.random.key_data(copy["key"]), jax.random.key_data(state["key"]))
    assert copy["host"] is not state["host"] and np.array_equal(copy["host"], state["host"]) and copy["step"] == 5
    state["w"].delete()  # what a donating step does to its input: the copy lives on
    assert float(copy["w"][0, 0]) == 0.5
