"""DeviceDiff.summaries (replay/engine/tensor_distance.py): the rows of many tensor pairs with one
statistics program for all of them, not one compile per leaf shape, and the same rows as
summary() pair by pair."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from replay.engine.tensor_distance import DeviceDiff
from tests.replay.test_first_op_compiles import compiles


def _pairs() -> list[tuple]:
    rng = np.random.default_rng(1)
    pairs = [(np.float32([1.0, -0.0, 3.0, np.nan]), np.float32([1.0, 0.0, -3.0, 1.0])),
             (np.float32([1.0, 1.5]), np.array([1.0, 1.5], ml_dtypes.bfloat16)),
             (np.int32([15, -2**31, 7]), np.int32([0, 2**31 - 1, 7])),
             (np.array([True, False]), np.array([True, True])),
             (np.float32([[1.0, 2.0]]), np.float32([[1.0, 2.0, 3.0]])),  # shapes differ
             (np.arange(6, dtype=np.float32), np.arange(6, dtype=np.float32))]  # equal
    for shape in ((7, 5), (3,), (2, 3, 4)):  # floats of three more shapes that differ in a few elements
        x = rng.standard_normal(shape).astype(np.float32)
        y = x.copy()
        y.reshape(-1)[::3] *= np.float32(1.0001)
        pairs.append((x, y))
    return [(jnp.asarray(a), jnp.asarray(b)) for a, b in pairs]


def test_summaries_compute_every_pairs_statistics_in_one_program_with_summarys_rows():
    pairs = _pairs()
    one_by_one = [DeviceDiff().summary(a, b) for a, b in pairs]
    assert sum(not r["equal"] for r in one_by_one) == len(pairs) - 1
    diff = DeviceDiff()
    fps = list(zip(diff.fingerprints([a for a, _ in pairs]), diff.fingerprints([b for _, b in pairs])))
    with compiles() as names:
        rows = diff.summaries(pairs, fps)
    assert rows == one_by_one
    # The statistics of the 7 same-shape pairs that differ (float, int and bool, 6 shapes and dtypes): one program.
    assert len([n for n in names if "stats" in n]) == 1, names
