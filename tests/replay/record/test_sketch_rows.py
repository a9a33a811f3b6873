"""The JAX distance sketch of many tensors at once (replay.record.fingerprint.sketch_rows: one sign
table a program, sliced for each tensor) against the numpy definition (traces/sketch.py)."""

from __future__ import annotations

import jax
import ml_dtypes
import numpy as np
import pytest

import replay.record.fingerprint as fp
from traces.sketch import bucket_and_sign, sketch

WIDTH = 64
SHAPES = [(), (5,), (3, 7), (64, 64), (4, 33, 17), (0, 4), (300, 1024), (70001,)]  # odd sizes, pads, > CHUNK_ROWS rows


def _tensors() -> list[np.ndarray]:
    g = np.random.default_rng(0)
    xs = [g.standard_normal(s).astype(np.float32) for s in SHAPES]
    return xs + [g.standard_normal((33, 65)).astype(ml_dtypes.bfloat16), g.standard_normal(777).astype(np.float16),
                 np.arange(-50, 50, dtype=np.int32), g.random(130) < 0.5]


def _within(got: np.ndarray, x: np.ndarray) -> bool:
    """traces/sketch.py's tolerance: |S_jax - S_ref| <= 2**-22 * sum of |v| over the bucket."""
    v = np.asarray(x).reshape(-1).astype(np.float32).astype(np.float64)
    bucket, _ = bucket_and_sign(np.arange(v.size, dtype=np.uint32), WIDTH)
    bound = 2.0 ** -22 * np.bincount(bucket, weights=np.abs(v), minlength=WIDTH)
    return bool(np.all(np.abs(got.astype(np.float64) - sketch(x, WIDTH)[0].astype(np.float64)) <= bound))


_jitted = jax.jit(lambda xs: fp.sketch_rows(xs, WIDTH))


def test_each_row_is_the_numpy_sketch_within_float32_rounding_and_a_change_is_seen():
    xs = _tensors()
    got = np.asarray(_jitted(xs))
    assert got.shape == (len(xs), WIDTH)
    for x, row in zip(xs, got):
        assert _within(row, x), (x.shape, x.dtype)
    # The tolerance is tight enough to see one element of 300k changed by 0.01 (the same program).
    i = SHAPES.index((300, 1024))
    changed = [x.copy() for x in xs]
    changed[i][123, 45] += 0.01
    again = np.asarray(_jitted(changed))
    assert not _within(again[i], xs[i]) and _within(again[i], changed[i])
    assert np.array_equal(np.delete(again, i, axis=0), np.delete(got, i, axis=0))  # the others keep their bits


def test_the_shared_sign_table_gives_the_bits_of_each_tensor_hashing_its_own(monkeypatch):
    xs = _tensors()
    shared = np.asarray(_jitted(xs))
    monkeypatch.setattr(fp, "SHARED_SIGN_ELEMENTS", 0)  # every tensor hashes its own signs
    own = np.asarray(jax.jit(lambda xs: fp.sketch_rows(xs, WIDTH))(xs))
    assert shared.tobytes() == own.tobytes()
    # one tensor alone (sketch_and_norm: the last reduce has another shape, so not always the same bits)
    s, norm = jax.jit(lambda x: fp.sketch_and_norm(x, WIDTH))(xs[3])
    assert _within(np.asarray(s), xs[3])
    assert float(norm) == pytest.approx(float(np.linalg.norm(xs[3].astype(np.float64))), rel=1e-6)
