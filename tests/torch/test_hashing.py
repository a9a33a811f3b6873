"""A torch batch's example hashes are the JAX side's for the same rows (trainer/data.py and
replay/record/hashing.py); the batch hash is trainer.data.batch_hash."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from replay.record import hashing as jax_hashing  # noqa: E402
from replay.torch import TorchRecordError, batch_hash, example_hashes  # noqa: E402
from trainer import data  # noqa: E402


@pytest.fixture
def rows() -> np.ndarray:
    """Token rows [B, L+1] as the trainer loads them: int32."""
    return np.random.default_rng(0).integers(0, 320, size=(6, 33)).astype(np.int32)


def test_int64_token_rows_hash_as_the_trainers_int32_rows(rows):
    want = data.example_hashes(rows)
    assert np.array_equal(example_hashes(torch.from_numpy(rows).long()), want)  # torch's index dtype
    assert np.array_equal(example_hashes(torch.from_numpy(rows)), want)
    assert np.array_equal(jax_hashing.example_hashes(rows), want)


def test_a_changed_token_changes_that_examples_hash_only(rows):
    t = torch.from_numpy(rows).long()
    changed = t.clone()
    changed[2, 17] += 1
    a, b = example_hashes(t), example_hashes(changed)
    assert a[2] != b[2]
    assert np.array_equal(np.delete(a, 2), np.delete(b, 2))
    assert example_hashes(t[:, :-1]).tolist() != a.tolist()  # the row length is in the seed


def test_pytree_batches_hash_as_the_jax_api_does(rows):
    inputs, targets = rows[:, :-1], rows[:, 1:]
    floats = np.random.default_rng(1).standard_normal((6, 3)).astype(np.float32)
    for jax_batch, torch_batch in [
        ({"targets": targets, "inputs": inputs}, {"inputs": torch.from_numpy(inputs).long(),
                                                  "targets": torch.from_numpy(targets).long()}),
        ((inputs, {"w": floats}), (torch.from_numpy(inputs), {"w": torch.from_numpy(floats)})),
        ({"batch": rows}, {"batch": torch.from_numpy(rows)}),
    ]:
        assert np.array_equal(example_hashes(torch_batch), jax_hashing.example_hashes(jax_batch)), jax_batch.__class__


def test_batch_hash_is_the_trainers(rows):
    h = data.example_hashes(rows)
    assert batch_hash(h) == data.batch_hash(h)
    assert batch_hash(h[::-1].copy()) != batch_hash(h)


def test_refusals(rows):
    with pytest.raises(TorchRecordError, match="outside int32"):
        example_hashes(torch.tensor([[2**40, 1]]))
    with pytest.raises(TorchRecordError, match="disagree on the batch size"):
        example_hashes({"a": torch.zeros(3, 2), "b": torch.zeros(4, 2)})
    with pytest.raises(TorchRecordError, match="not a tensor"):
        example_hashes({"a": [1, 2]})
    with pytest.raises(TorchRecordError, match="scalar"):
        example_hashes(torch.tensor(3))
