"""The record's batch hash is the format's (FORMAT.md: xxh3-64 over the batch size and the
per-example hashes): pinned, so moving or rewriting it cannot change what old runs hold."""

import numpy as np

from replay.record.recorder import batch_hash

GOLDEN_BATCH_HASH = 4446074722206199714  # as tests/trainer/test_data.py pins trainer.data's


def test_batch_hash_is_the_recorded_format():
    assert batch_hash(np.array([1, 2, 3], dtype=np.uint64)) == GOLDEN_BATCH_HASH
    assert batch_hash(np.array([3, 2, 1], dtype=np.uint64)) != GOLDEN_BATCH_HASH  # order counts
