"""The numpy reference fingerprint: spec conformance, sensitivity, shard invariance."""

import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from traces import fingerprint as fpm
from traces.fingerprint import combine_lanes, fingerprint, fingerprint_hex, shard_lanes

try:
    import ml_dtypes
except ImportError:  # the reference must work without it
    ml_dtypes = None

M32 = 0xFFFFFFFF


def spec_fingerprint(x, dtype_name=None) -> int:
    """The docstring's definition, written out literally in pure Python (slow, small inputs)."""
    a = np.asarray(x)
    name = dtype_name or a.dtype.name
    shape = ",".join(str(d) for d in a.shape) or "()"
    raw = np.ascontiguousarray(a).tobytes()
    assert sys.byteorder == "little"
    width = min(a.dtype.itemsize, 4)
    words = [int.from_bytes(raw[j:j + width], "little") for j in range(0, len(raw), width)]
    out = 0
    for k in (0, 1):
        seed = zlib.crc32(f"{name}|{shape}|{k}".encode())
        lane = 0
        for i, b in enumerate(words):
            h = (b + i * 0x9E3779B9 + seed) & M32
            h ^= h >> 16
            h = (h * 0x85EBCA6B) & M32
            h ^= h >> 13
            h = (h * 0xC2B2AE35) & M32
            h ^= h >> 16
            lane = (lane + h) & M32
        out = (out << 32) | lane
    return out


def _random(shape, dtype, rng):
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.random(shape) < 0.5
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    if dtype.kind == "c":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
    return (rng.standard_normal(shape) * 100).astype(dtype)


ALL_DTYPES = [np.float32, np.float16, np.float64, np.int8, np.uint8, np.int16, np.uint16,
              np.int32, np.uint32, np.int64, np.uint64, np.bool_, np.complex64, np.complex128]
if ml_dtypes is not None:
    ALL_DTYPES += [ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn]
SHAPES = [(), (1,), (5,), (3, 5), (2, 3, 4), (7, 1, 3), (1, 1, 1, 2)]


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: np.dtype(d).name)
def test_matches_literal_spec(dtype):
    rng = np.random.default_rng(1)
    for shape in SHAPES:
        x = _random(shape, dtype, rng)
        assert fingerprint(x) == spec_fingerprint(x), shape


def test_known_answers():
    # Pinned values: if one of these changes, the trace format changed.
    assert fpm.lane_seeds("float32", (3, 4)) == (511068532, 1769044450)
    assert fpm.lane_seeds("bool", ()) == (1425280400, 603143430)
    f32 = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert fingerprint_hex(fingerprint(f32)) == "8aa7c45d8e00723d"
    i32 = np.arange(12, dtype=np.int32).reshape(3, 4)
    assert fingerprint_hex(fingerprint(i32)) == "533889ac7cacfbaf"
    assert fingerprint_hex(fingerprint(np.array([True, False, True]))) == "1846eed982f306bb"
    assert fingerprint_hex(fingerprint(np.arange(-3, 3, dtype=np.int64))) == "f477f4280dd1835e"
    assert fingerprint_hex(fingerprint(np.float64(-0.0))) == "882878c62908f4c4"
    bf = np.array(0x3FC0, dtype=np.uint16)  # 1.5 in bfloat16
    assert fingerprint_hex(fingerprint(bf, dtype_name="bfloat16")) == "f40395e08f7eee1c"


def _flip_bits(x):
    """Every single-bit flip of x (bool: every element toggled)."""
    if x.dtype == np.bool_:
        for j in range(x.size):
            y = x.copy().reshape(-1)
            y[j] = ~y[j]
            yield y.reshape(x.shape)
        return
    u = x.view(f"u{x.dtype.itemsize}")
    for j in range(x.size):
        for b in range(8 * x.dtype.itemsize):
            y = u.copy().reshape(-1)
            y[j] ^= y.dtype.type(1 << b)
            yield y.reshape(x.shape).view(x.dtype)


FLIP_DTYPES = [np.float32, np.float16, np.int32, np.uint32, np.int8, np.bool_, np.float64]
if ml_dtypes is not None:
    FLIP_DTYPES.append(ml_dtypes.bfloat16)


@pytest.mark.parametrize("dtype", FLIP_DTYPES, ids=lambda d: np.dtype(d).name)
def test_every_single_bit_flip_changes_it(dtype):
    x = _random((3, 5), dtype, np.random.default_rng(2))
    fps = [fingerprint(x)] + [fingerprint(y) for y in _flip_bits(x)]
    assert len(set(fps)) == len(fps)  # no flip collides with the original or another flip


def test_bfloat16_via_uint16_carrier():
    bits = np.random.default_rng(3).integers(0, 1 << 16, size=(4, 6), dtype=np.uint16)
    ref = fingerprint(bits, dtype_name="bfloat16")
    assert ref != fingerprint(bits)  # the name is in the seed
    fps = {ref} | {fingerprint(y, dtype_name="bfloat16") for y in _flip_bits(bits)}
    assert len(fps) == 1 + bits.size * 16
    if ml_dtypes is not None:
        assert fingerprint(bits.view(ml_dtypes.bfloat16)) == ref


@pytest.mark.parametrize("dtype", [np.float32, np.int8, np.bool_, np.float64])
def test_element_swaps_change_it(dtype):
    x = np.arange(12).reshape(3, 4).astype(dtype) if dtype != np.bool_ else np.arange(12) % 3 == 0
    base = fingerprint(x)
    flat = x.reshape(-1)
    for i in range(flat.size):
        for j in range(i + 1, flat.size):
            if flat[i] == flat[j]:
                continue
            y = flat.copy()
            y[i], y[j] = y[j], y[i]
            assert fingerprint(y.reshape(x.shape)) != base, (i, j)


def test_signed_zero_reshape_and_dtype_change():
    floats = [np.float16, np.float32, np.float64] + ([ml_dtypes.bfloat16] if ml_dtypes else [])
    for dt in floats:
        z = np.zeros((2, 3), dtype=dt)
        nz = z.copy()
        nz[1, 2] = -nz[1, 2]
        assert fingerprint(z) != fingerprint(nz)
        assert fingerprint(dt(0.0)) != fingerprint(dt(-0.0))
    x = np.arange(24, dtype=np.float32)
    fps = {fingerprint(x.reshape(s)) for s in [(24,), (2, 12), (12, 2), (4, 6), (2, 3, 4), (1, 24)]}
    assert len(fps) == 6
    same_bits = [x.view(t) for t in (np.float32, np.int32, np.uint32)]
    assert len({fingerprint(v) for v in same_bits}) == 3
    assert fingerprint(x.view(np.uint16)) != fingerprint(x.view(np.float16))


def test_scalars_odd_shapes_and_layouts():
    assert fingerprint(np.float32(1.0)) == fingerprint(np.array(1.0, np.float32))
    assert fingerprint(2.5) == fingerprint(np.float64(2.5))
    assert fingerprint([[1, 2, 3]]) == fingerprint(np.array([[1, 2, 3]]))
    assert fingerprint(np.zeros((2, 0, 3), np.float32)) == 0  # empty: no words, both lanes 0
    a = _random((7, 13, 3), np.float32, np.random.default_rng(4))
    for view in (a.T, a[::2, 3:, ::-1], np.asfortranarray(a)):
        assert fingerprint(view) == fingerprint(np.ascontiguousarray(view))
    assert fingerprint(a.astype(">f4")) == fingerprint(a)  # byte order is not part of the value
    assert fingerprint(a.astype(np.float64).astype(">f8")) == fingerprint(a.astype(np.float64))


def test_chunking_does_not_change_it(monkeypatch):
    rng = np.random.default_rng(5)
    xs = [_random(s, d, rng) for s, d in [((5, 7, 3), np.float32), ((11,), np.float64),
                                           ((4, 3, 2), np.complex128), ((3, 1, 4), np.int8)]]
    want = [fingerprint(x) for x in xs]
    for chunk in (1, 2, 3, 5, 8, 20):
        monkeypatch.setattr(fpm, "CHUNK_ELEMENTS", chunk)
        assert [fingerprint(x) for x in xs] == want


def test_large_tensor_crosses_chunks():
    x = _random((3, 700_001), np.float32, np.random.default_rng(6))
    parts = [shard_lanes(x[:, :350_000], (0, 0), x.shape),
             shard_lanes(x[:, 350_000:], (0, 350_000), x.shape)]
    assert combine_lanes(parts) == fingerprint(x)


def _guillotine(shape, rng):
    """Random partition of a box into rectangular boxes by recursive axis-aligned cuts."""
    start = (0,) * len(shape)
    boxes, todo = [], [(start, shape)]
    while todo:
        off, size = todo.pop()
        axes = [a for a, n in enumerate(size) if n > 1]
        if not axes or rng.random() < 0.25:
            boxes.append((off, size))
            continue
        ax = int(rng.choice(axes))
        cut = int(rng.integers(1, size[ax]))
        for o, n in ((0, cut), (cut, size[ax] - cut)):
            todo.append((off[:ax] + (off[ax] + o,) + off[ax + 1:],
                         size[:ax] + (n,) + size[ax + 1:]))
    return boxes


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(1, 6), min_size=0, max_size=4).map(tuple),
    dtype=st.sampled_from([np.float32, np.int8, np.bool_, np.float64, np.float16, np.uint32]),
    seed=st.integers(0, 2**32 - 1),
)
def test_shards_in_any_order_combine_to_the_whole(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    x = _random(shape, dtype, rng)
    boxes = _guillotine(shape, rng)
    rng.shuffle(boxes)
    parts = [shard_lanes(x[tuple(slice(o, o + n) for o, n in zip(off, size))], off, shape)
             for off, size in boxes]
    assert combine_lanes(parts) == fingerprint(x)
    assert sum(int(np.prod(s)) for _, s in boxes) == x.size


def test_shard_lanes_rejects_bad_placement_and_dtypes():
    x = np.zeros((4, 4), np.float32)
    with pytest.raises(ValueError):
        shard_lanes(x, (1, 0), (4, 4))
    with pytest.raises(ValueError):
        shard_lanes(x, (0,), (4, 4))
    with pytest.raises(ValueError):
        fingerprint(x, dtype_name="float16")  # a carrier must have the named dtype's width
    for bad in (np.array(["a"]), np.array([object()])):
        with pytest.raises(TypeError):
            fingerprint(bad)
    if ml_dtypes is not None:
        with pytest.raises(TypeError):
            fingerprint(np.zeros(3, ml_dtypes.int4))


def test_traces_imports_without_jax():
    code = ("import sys; sys.modules['jax'] = None; sys.modules['ml_dtypes'] = None\n"
            "import traces.fingerprint as f, numpy as np\n"
            "assert f.fingerprint(np.arange(3, dtype=np.float32)) != 0\n")
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=root)
