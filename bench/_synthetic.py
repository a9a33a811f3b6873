"""Synthetic step-level records for the trace benchmarks (no JAX): the shape a trainer writes."""

from __future__ import annotations

import numpy as np

from traces import Schema, StepRecord

SCHEMA = Schema(
    examples_per_step=16,
    rng_words=2,
    metrics=(("loss", "loss"), ("grad_norm", "backward"), ("lr", "update"), ("param_norm", "update")),
)


def records(n: int, seed: int, start: int = 0, chunk: int = 65536):
    """Yields records start..start+n-1; record k depends only on (seed, k), drawn in chunks for speed."""
    for lo in range((start // chunk) * chunk, start + n, chunk):
        rng = np.random.default_rng([seed, lo // chunk])
        m = chunk
        keys = rng.integers(0, 2**32, (m, 2), dtype=np.uint32)
        batch = rng.integers(0, 2**63, m, dtype=np.uint64)
        examples = rng.integers(0, 2**63, (m, 16), dtype=np.uint64)
        metrics = rng.standard_normal((m, 4)).astype(np.float32)
        for i in range(max(start, lo) - lo, min(chunk, start + n - lo)):
            yield StepRecord(lo + i, keys[i], int(batch[i]), examples[i], metrics[i])
