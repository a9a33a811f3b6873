"""Every random stream derives from the one root seed, by name.

    init_key(seed)          parameters at step 0
    data_seed(seed)         the data order: a 63-bit integer (data loading never touches JAX) from
                            which each epoch's Feistel round keys derive (trainer/order.py)
    dropout_key(seed)       the base key held in the train state; step k uses fold_in(base, k)

Folding the step into the base key (instead of splitting a carried key every step) means
the key of any step is known without replaying the steps before it, which is what lets the
replay engine start anywhere and check the recorded key words.
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np


def _name_id(name: str) -> int:
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


def stream_key(seed: int, name: str) -> jax.Array:
    """A typed threefry key for the stream `name` of the run with root `seed`."""
    return jax.random.fold_in(jax.random.key(seed, impl="threefry2x32"), _name_id(name))


def init_key(seed: int) -> jax.Array:
    return stream_key(seed, "init")


def dropout_key(seed: int) -> jax.Array:
    return stream_key(seed, "dropout")


def data_seed(seed: int) -> int:
    """The seed of the data order: a 63-bit mix of (root seed, "data"); trainer/order.py keys each
    epoch's permutation with xxh3 of (this, epoch, round)."""
    return int(np.random.SeedSequence([seed, _name_id("data")]).generate_state(2, np.uint32).view(np.uint64)[0] >> 1)


def step_key(base: jax.Array, step: jax.Array | int) -> jax.Array:
    """The key a step's dropout uses; a pure function of (base key, step)."""
    return jax.random.fold_in(base, jnp.asarray(step, jnp.uint32))


def key_words(key: jax.Array) -> jax.Array:
    """The raw uint32 words of a typed key: what the trace records."""
    return jax.random.key_data(key).reshape(-1)


def random_settings() -> dict:
    """JAX settings that change random values; recorded in the manifest, checked on replay."""
    return {
        "jax_threefry_partitionable": bool(jax.config.jax_threefry_partitionable),
        "jax_default_prng_impl": str(jax.config.jax_default_prng_impl),
        "key_impl": "threefry2x32",
    }
