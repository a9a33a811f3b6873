"""replay/engine/replayer.py `_copy`: the copy of a state a donating step may consume is fresh
buffers with the same bits and placement, and costs no compile (x.copy() compiled one program per
leaf shape: 7 or 8 of a bisect's compiles on the example loops)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from replay.engine.replayer import _copy
from tests.replay.test_first_op_compiles import compiles

ROOT = Path(__file__).resolve().parents[2]


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


_ON_FOUR_DEVICES = """
import jax, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from replay.engine.replayer import _copy
from tests.replay.test_first_op_compiles import compiles
mesh = jax.make_mesh((4,), ("d",))
state = {"key": jax.device_put(jax.random.key(3), NamedSharding(mesh, P())),
         "w": jax.device_put(np.arange(8, dtype=np.float32), NamedSharding(mesh, P("d")))}
with compiles() as names:
    copy = _copy(state)
assert names == [], names
for k in state:
    assert copy[k].sharding == state[k].sharding, (k, copy[k].sharding)
assert np.array_equal(jax.random.key_data(copy["key"]), jax.random.key_data(state["key"]))
print("ok")
"""


def test_a_copy_on_a_mesh_keeps_every_leafs_sharding_typed_keys_included():
    # A fresh 4-device process: a typed key replicated over the mesh came back on device 0 alone
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PJRT_NPROC")}
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", _ON_FOUR_DEVICES], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
