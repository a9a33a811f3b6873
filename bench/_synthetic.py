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


# ------------------------------------------------------------------------------ a real run's shape (bench/scale.py)


def scale_schema(examples: int) -> Schema:
    """A trainer's step-level record: per-example hashes and losses, three scalar metrics."""
    return Schema(examples_per_step=examples, rng_words=2,
                  metrics=(("loss", "loss"), ("grad_norm", "backward"), ("lr", "update")), example_metrics=("loss",))


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def epoch_hashes(slots: np.ndarray, n_examples: int, seed: int = 0) -> np.ndarray:
    """The hash of the example fed at each global slot: a fresh permutation of the N examples per
    epoch (an affine bijection mod N, O(1) memory), then a 64-bit mix of the example id."""
    assert n_examples < 2**31, "a * pos must fit in int64"
    slots = np.asarray(slots, np.int64)
    epoch, pos = np.divmod(slots, n_examples)
    a = (_splitmix64(epoch.astype(np.uint64) + np.uint64(seed)) % np.uint64(max(n_examples - 1, 1))).astype(np.int64) + 1
    while True:  # a multiplier coprime with N: a bijection of 0..N-1
        bad = np.gcd(a, n_examples) != 1
        if not bad.any():
            break
        a[bad] += 1
    ids = (a * pos + epoch * 7919) % n_examples
    return _splitmix64(ids.astype(np.uint64) ^ np.uint64(seed * 0x9E37))


def batch_hash(row: np.ndarray) -> int:
    """A stand-in for the trainer's hash of a whole batch: changes with any example."""
    return int(_splitmix64(np.array([np.bitwise_xor.reduce(row * np.uint64(0x9E3779B97F4A7C15))], np.uint64))[0])


def scale_records(schema: Schema, start: int, stop: int, n_examples: int, seed: int = 0, chunk: int = 1024):
    """Step-level records start..stop-1: a falling loss with noise, per-example losses around it."""
    B = schema.examples_per_step
    for lo in range(start, stop, chunk):
        hi = min(stop, lo + chunk)
        steps = np.arange(lo, hi)
        hashes = epoch_hashes((steps[:, None] * B + np.arange(B)).ravel(), n_examples, seed).reshape(-1, B)
        rng = np.random.default_rng([seed, lo])
        per_example = rng.random((hi - lo, B), np.float32) + np.float32(2.0)
        loss = per_example.mean(axis=1, dtype=np.float32) * np.float32(1) + (1 / (1 + steps / 1000)).astype(np.float32)
        keys = rng.integers(0, 2**32, (hi - lo, 2), dtype=np.uint32)
        for k, step in enumerate(steps.tolist()):
            metrics = np.array([loss[k], 1.0 + 0.01 * (step % 7), 1e-4], np.float32)
            yield StepRecord(step, keys[k], batch_hash(hashes[k]), hashes[k], metrics,
                             example_metrics=per_example[k][None, :])
