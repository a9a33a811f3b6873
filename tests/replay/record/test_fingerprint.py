"""The JAX fingerprint must equal the numpy reference bit for bit, under jit and under sharding."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from replay.record.fingerprint import fingerprint_lanes, fingerprint_tree, lanes_to_int, tree_to_ints
from traces.fingerprint import fingerprint

ROOT = Path(__file__).resolve().parents[3]
DTYPES = [np.float32, ml_dtypes.bfloat16, np.float16, np.int32, np.uint32, np.int8, np.uint8,
          np.bool_, ml_dtypes.float8_e4m3fn]
SHAPES = [(), (1,), (7,), (3, 5), (2, 3, 4), (1, 13, 1), (0, 4)]
EAGER_SHAPES = [(), (2, 3, 4), (0, 4)]  # a scalar, several axes, empty


def _random(shape, dtype, rng):
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.random(shape) < 0.5
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    # Raw random bits, so NaN payloads, infinities, subnormals and -0.0 all occur.
    bits = rng.integers(0, 1 << (8 * dtype.itemsize), size=shape, dtype=f"u{dtype.itemsize}")
    return bits.view(dtype)


_jitted = jax.jit(fingerprint_lanes)
# Every shape of one dtype fingerprinted in one jitted program (a list in, a list of lanes out): one
# compile per dtype instead of one per shape and dtype (63 -> 9; each array's lanes come from its own
# ops, as in a train step's program, which fingerprints many tensors in one program).
_jitted_each = jax.jit(lambda xs: [fingerprint_lanes(x) for x in xs])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_matches_reference_eager_and_jit(dtype):
    rng = np.random.default_rng(0)
    xs = [_random(shape, dtype, rng) for shape in SHAPES]
    # numpy in: jit places its arguments without a program; jnp.asarray compiled a copy per shape and dtype
    for shape, x, lanes in zip(SHAPES, xs, _jitted_each(xs)):
        want = fingerprint(x)
        assert lanes.dtype == jnp.uint32 and lanes.shape == (2,)
        assert lanes_to_int(lanes) == want, shape
        if shape in EAGER_SHAPES:  # numpy input, eager: every op compiled on its own, per shape
            assert lanes_to_int(fingerprint_lanes(x)) == want, shape


def test_inside_a_jitted_step_and_over_a_tree():
    rng = np.random.default_rng(1)
    params = {"w": rng.standard_normal((16, 8)).astype(np.float32),
              "b": rng.standard_normal(8).astype(ml_dtypes.bfloat16),
              "step": np.int32(7), "mask": rng.random((3, 3)) < 0.5}

    @jax.jit
    def step(p, x):
        h = jnp.tanh(x @ p["w"] + p["b"].astype(jnp.float32))
        new = {**p, "w": p["w"] - 0.1 * x.T @ h, "step": p["step"] + 1}
        return new, h, fingerprint_tree({"h": h, "params": new})

    new, h, fps = step(params, rng.standard_normal((4, 16)).astype(np.float32))
    got = tree_to_ints(fps)
    # Compare against the values the step actually produced: recomputing them outside
    # jit need not be bit-identical (different fusion), which is not what is tested here.
    assert got["h"] == fingerprint(np.asarray(h))
    assert got["params"]["w"] == fingerprint(np.asarray(new["w"]))
    assert got["params"]["b"] == fingerprint(params["b"])
    assert got["params"]["step"] == fingerprint(np.int32(8))
    assert got["params"]["mask"] == fingerprint(params["mask"])


def test_a_flipped_bit_is_caught():
    x = _random((32, 17), np.float32, np.random.default_rng(2))
    y = x.copy()
    y.view(np.uint32)[5, 9] ^= np.uint32(1 << 22)
    fx, fy = lanes_to_int(_jitted(x)), lanes_to_int(_jitted(y))
    assert fx != fy
    assert (fx, fy) == (fingerprint(x), fingerprint(y))
    z = x.copy()
    z[[0, 1]] = z[[1, 0]]  # swapped rows
    assert lanes_to_int(_jitted(z)) not in (fx, fy)


def test_rejects_what_it_cannot_do_exactly():
    with pytest.raises(TypeError, match="jax_enable_x64"):
        fingerprint_lanes(np.zeros(3, np.float64))  # would silently become float32 otherwise
    with pytest.raises(TypeError):
        fingerprint_lanes(np.zeros(3, np.complex64))
    with pytest.raises(TypeError):
        fingerprint_lanes(jnp.zeros(3, jnp.int4))
    with pytest.raises(ValueError):
        lanes_to_int(np.zeros(3, np.uint32))


_SHARDED = textwrap.dedent("""
    import numpy as np, jax, jax.numpy as jnp, ml_dtypes
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    from replay.record.fingerprint import fingerprint_lanes, fingerprint_tree, lanes_to_int, tree_to_ints
    from traces.fingerprint import fingerprint
    assert jax.device_count() == 8, jax.devices()
    rng = np.random.default_rng(0)
    def rand(shape, dt):
        dt = np.dtype(dt)
        if dt == np.bool_:
            return rng.random(shape) < 0.5
        n = dt.itemsize
        return rng.integers(0, 1 << (8 * n), size=shape, dtype=f"u{n}").view(dt)
    f = jax.jit(fingerprint_lanes)
    each = jax.jit(lambda xs: [fingerprint_lanes(x) for x in xs])
    checked = 0
    for at in (AxisType.Auto, AxisType.Explicit):
        m1 = jax.make_mesh((8,), ("x",), axis_types=(at,))
        m2 = jax.make_mesh((4, 2), ("a", "b"), axis_types=(at, at))
        cases = [((16, 7), P("x", None), m1), ((3, 40), P(None, "x"), m1), ((8,), P("x"), m1),
                 ((8, 6, 5), P("a", "b", None), m2), ((5, 4, 8), P(None, "b", "a"), m2),
                 ((8, 12), P(("a", "b"), None), m2), ((6, 5), P(), m2)]
        dts = (np.float32, ml_dtypes.bfloat16, np.float16, np.int32, np.uint32, np.int8, np.bool_)
        for dt in dts:
            # the cases of one mesh in one jitted program (a list in, a list of lanes out): one compile
            # per axis type, dtype and mesh (28) instead of one per case (98)
            for mesh in (m1, m2):
                mine = [(shape, spec, rand(shape, dt)) for shape, spec, m in cases if m is mesh]
                with jax.set_mesh(mesh):
                    lanes = each([jax.device_put(x, NamedSharding(mesh, spec)) for _, spec, x in mine])
                for (shape, spec, x), got in zip(mine, lanes):
                    assert lanes_to_int(got) == fingerprint(x), (at, np.dtype(dt).name, shape, spec)
                    checked += 1
        # A flipped bit on one shard is seen in the global fingerprint.
        x = rand((16, 8), np.float32)
        y = x.copy()
        y.view(np.uint32)[13, 6] ^= np.uint32(1)
        s = NamedSharding(m2, P("a", "b"))
        with jax.set_mesh(m2):
            fx, fy = (lanes_to_int(f(jax.device_put(v, s))) for v in (x, y))
            tree = tree_to_ints(jax.jit(fingerprint_tree)({"x": jax.device_put(x, s)}))
        assert fx != fy and (fx, fy) == (fingerprint(x), fingerprint(y)) and tree["x"] == fx
    # 64-bit dtypes work on device only with x64 enabled.
    jax.config.update("jax_enable_x64", True)
    for dt in (np.float64, np.int64, np.uint64):
        x = rand((8, 3), dt)
        xs = jax.device_put(x, NamedSharding(m1, P("x", None)))
        assert lanes_to_int(jax.jit(fingerprint_lanes)(xs)) == fingerprint(x), np.dtype(dt).name
        assert lanes_to_int(jax.jit(fingerprint_lanes)(x[0, 0])) == fingerprint(x[0, 0])
    print("checked", checked)
""")


@pytest.mark.slow
def test_sharded_over_8_devices_matches_reference():
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags.strip())
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    r = subprocess.run([sys.executable, "-c", _SHARDED], env=env, cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "checked 98" in r.stdout
