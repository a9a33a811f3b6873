"""Refinement compares where the tensors live (replay/engine/tensor_distance.py DeviceDiff): fingerprints
first, statistics on device for the leaves that differ, and one leaf pair fetched to the host --
not every parameter and gradient of both runs. End to end (a bisect of a bitflip run fetches one
leaf pair): tests/replay/test_bisect.py's bitflip test, on the runs that file trains anyway."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from replay.bisect.refine import _walk
from replay.engine.tensor_distance import DeviceDiff, compare_tensors


@pytest.fixture
def count_fetches(monkeypatch):
    """Bytes that reach the host through jax.device_get (how every comparison fetches)."""
    fetched = {"bytes": 0}
    real = jax.device_get

    def counting(tree):
        host = real(tree)
        fetched["bytes"] += sum(np.asarray(x).nbytes for x in jax.tree.leaves(host))
        return host

    monkeypatch.setattr(jax, "device_get", counting)
    return fetched


def test_walk_fetches_only_the_first_differing_leaf(count_fetches):
    rng = np.random.default_rng(0)
    leaves = [rng.standard_normal((64, 64)).astype(np.float32) for _ in range(12)]
    other = [x.copy() for x in leaves]
    for i in (4, 7, 9):  # three leaves differ; the first of them is 4
        other[i][i, 1] = np.nextafter(other[i][i, 1], np.float32(10))
    a = [jnp.asarray(x) for x in leaves]
    b = [jnp.asarray(x) for x in other]
    expected = compare_tensors(leaves[4], other[4])
    count_fetches["bytes"] = 0
    diff = DeviceDiff()
    first, pair, rows = _walk([(f"w{i}", (lambda i=i: a[i]), (lambda i=i: b[i])) for i in range(12)], diff)
    assert first == "w4" and [r["name"] for r in rows if not r["equal"]] == ["w4", "w7", "w9"]
    assert [r["max_ulp"] for r in rows if not r["equal"]] == [1, 1, 1]  # on device, ULPs exact
    assert diff.fetched_leaves == 0 and count_fetches["bytes"] < 1024  # fingerprints and statistics only
    detail = diff.exact(*pair)
    assert detail == expected  # the host's float64 figures, unchanged
    assert diff.fetched_leaves == 1 and count_fetches["bytes"] < 2 * leaves[4].nbytes + 1024
    assert count_fetches["bytes"] == diff.fetched_bytes


def test_device_summary_matches_the_host_comparison():
    import ml_dtypes

    cases = [(np.float32([1.0, -0.0, 3.0, np.nan]), np.float32([1.0, 0.0, -3.0, 1.0])),
             (np.float32([1.0, 1.5]), np.array([1.0, 1.5], ml_dtypes.bfloat16)),
             (np.int32([15, -2**31, 7]), np.int32([0, 2**31 - 1, 7])),
             (np.uint32([5, 2**32 - 1]), np.uint32([2**32 - 1, 0])),
             (np.array([True, False]), np.array([True, True]))]
    for x, y in cases:
        host, dev = compare_tensors(x, y), DeviceDiff().summary(jnp.asarray(x), jnp.asarray(y))
        for key in ("equal", "differing", "share_differing", "max_ulp", "max_abs", "nan_a", "nan_b"):
            assert host.get(key) == dev.get(key), (x, y, key)
        assert dev["max_rel"] == pytest.approx(host["max_rel"], rel=1e-6)
    same = np.arange(6, dtype=np.float32)
    assert DeviceDiff().summary(jnp.asarray(same), jnp.asarray(same.copy()))["equal"]
