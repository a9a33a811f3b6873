"""The distance sketch's numpy definition (traces/sketch.py): what it is, and that it estimates."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from traces.sketch import (DEFAULT_WIDTH, ROW_SEED, SIGN_SEED, bucket_and_sign, check_width, exact_relative_distance,
                           relative_distance, shard_sketch, sketch)


def _fmix32_py(h: int) -> int:
    m = 0xFFFFFFFF
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & m
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & m
    return h ^ (h >> 16)


def test_the_definition_in_plain_python_integers():
    # Independent of numpy's uint32 wrapping: bucket and sign from Python ints mod 2**32.
    assert ROW_SEED == zlib.crc32(b"replay-sketch-v2|row") and SIGN_SEED == zlib.crc32(b"replay-sketch-v2|sign")
    x = np.random.default_rng(0).standard_normal((5, 7)).astype(np.float32)
    want = np.zeros(16)
    for e, v in enumerate(x.reshape(-1)):
        bucket = (e % 16) ^ (_fmix32_py((e // 16 * 0x9E3779B9 + ROW_SEED) & 0xFFFFFFFF) & 15)
        negative = _fmix32_py((e * 0x9E3779B9 + SIGN_SEED) & 0xFFFFFFFF) >> 31
        want[bucket] += (-1.0 if negative else 1.0) * float(v)
    s, norm = sketch(x, 16)
    np.testing.assert_array_equal(s, want.astype(np.float32))
    assert norm == np.float32(np.sqrt(np.sum(x.astype(np.float64) ** 2)))


def test_a_sharded_tensor_sketches_as_the_gathered_one():
    x = np.random.default_rng(1).standard_normal((6, 10)).astype(np.float32)
    parts = [shard_sketch(x[r:r + 2, c:c + 5], (r, c), x.shape) for r in (0, 2, 4) for c in (0, 5)]
    s = sum(p[0] for p in parts).astype(np.float32)
    whole, norm = sketch(x)
    np.testing.assert_allclose(s, whole, rtol=0, atol=1e-6)
    assert np.float32(np.sqrt(sum(p[1] for p in parts))) == pytest.approx(norm, rel=1e-7)


def test_the_sketch_is_linear_and_its_distance_estimates_the_exact_one():
    g = np.random.default_rng(2)
    for shape in [(64, 64), (1000,), (8, 16, 32)]:
        a = g.standard_normal(shape).astype(np.float32)
        for scale in (1e-1, 1e-3, 1e-5):
            b = (a + scale * g.standard_normal(shape)).astype(np.float32)
            (sa, na), (sb, nb) = sketch(a), sketch(b)
            est, exact = float(relative_distance(sa, na, sb, nb)), exact_relative_distance(a, b)
            assert exact / 2 <= est <= exact * 2, (shape, scale, est, exact)


def test_a_difference_in_one_column_is_spread_over_buckets_not_piled_in_one():
    # Rows scattered by a hashed XOR, not bucket = index mod W: a [n, W] tensor differing in one
    # column would put the whole difference in one bucket under index mod W (an estimate off by far more).
    a = np.random.default_rng(3).standard_normal((512, DEFAULT_WIDTH)).astype(np.float32)
    b = a.copy()
    b[:, 5] += 1e-2
    e = np.arange(a.size, dtype=np.uint32).reshape(a.shape)[:, 5]
    buckets, _ = bucket_and_sign(e, DEFAULT_WIDTH)
    assert len(set(buckets.tolist())) > DEFAULT_WIDTH // 2
    est = float(relative_distance(*sketch(a), *sketch(b)))
    assert exact_relative_distance(a, b) / 2 <= est <= 2 * exact_relative_distance(a, b)


def test_equal_tensors_are_at_distance_zero_and_a_changed_one_is_not():
    a = np.random.default_rng(4).standard_normal(300).astype(np.float32)
    assert relative_distance(*sketch(a), *sketch(a.copy())) == 0
    b = a.copy()
    b[17] = np.nextafter(b[17], np.float32(10))
    assert relative_distance(*sketch(a), *sketch(b)) > 0
    assert relative_distance(*sketch(np.zeros(4)), *sketch(np.zeros(4))) == 0


def test_dtypes_are_sketched_by_float32_value():
    a = np.arange(-8, 8, dtype=np.int32).reshape(4, 4)
    np.testing.assert_array_equal(sketch(a)[0], sketch(a.astype(np.float32))[0])
    with pytest.raises(TypeError, match="complex"):
        sketch(np.zeros(3, np.complex64))


@pytest.mark.parametrize("width", [0, 7, 12, 1 << 17])
def test_a_width_must_be_a_power_of_two_in_range(width):
    with pytest.raises(ValueError, match="power of two"):
        check_width(width)
