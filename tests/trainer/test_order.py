"""The data order (trainer/order.py): a lazy keyed permutation per epoch, and the samplers.

Each epoch is a bijection of range(n) at every size; a billion examples cost what ten do
(memory and network applications per lookup); the first outputs are pinned; the default
sampler is host-count invariant at that scale, and contiguous-per-host is the real bug it
reproduces: resumed on twice the hosts, half of every batch was already fed.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from trainer import data, order
from trainer.data import Batcher, DataError, TokenSource

BILLION = 10**9
SEED = 1234


def _peak_bytes(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


# --------------------------------------------------------------------- a permutation at every size


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 9, 63, 64, 65, 100, 101, 1000, 4097])
def test_each_epoch_is_a_permutation(n):
    orders = [order.epoch_permutation(n, SEED, e) for e in range(3)]
    for e, ids in enumerate(orders):
        np.testing.assert_array_equal(np.sort(ids), np.arange(n), err_msg=f"n={n} epoch {e}")
    if n >= 8:  # each epoch and each seed reshuffles
        assert not np.array_equal(orders[0], orders[1])
        assert not np.array_equal(orders[0], order.epoch_permutation(n, SEED + 1, 0))


def test_the_permutation_check_catches_a_map_that_is_not_one():
    # The network alone, folded into range(n) instead of cycle-walked, is not a bijection: the
    # check above would fail on it.
    n = 1000
    p = order.epoch_order(n, SEED, 0)
    with np.errstate(over="ignore"):
        folded = p.network(np.arange(n, dtype=np.uint64)).astype(np.int64) % n
    assert not np.array_equal(np.sort(folded), np.arange(n))


def test_the_order_is_well_shuffled():
    n = 10_000
    ids = order.epoch_permutation(n, SEED, 0)
    assert np.count_nonzero(ids == np.arange(n)) < 10  # about 1 fixed point for a random permutation
    assert np.median(np.abs(np.diff(ids))) > n / 5  # neighbours land far apart (random: n/3.4)
    # Where example 0 lands over 400 seeds: spread over the epoch, not clumped (chi-square, 10 bins).
    where = [int(np.flatnonzero(order.epoch_permutation(100, s, 0) == 0)[0]) for s in range(400)]
    counts = np.bincount(np.asarray(where) // 10, minlength=10)
    assert ((counts - 40) ** 2 / 40).sum() < 30  # 9 dof: p < 0.0005 by chance


# --------------------------------------------------------------------- a billion examples


def test_a_billion_examples_in_constant_memory():
    B = 1024
    last = BILLION // B  # the batch that crosses into epoch 1
    steps = (0, 1, 123_456, last - 1, last, 5 * last + 7)

    def lookups():
        for step in steps:
            ids = data.example_ids(BILLION, SEED, step, B)
            assert ids.shape == (B,) and 0 <= ids.min() and ids.max() < BILLION
            assert np.unique(ids).size == B

    np.unique(data.example_ids(10_000, SEED + 1, 0, B))  # one-time costs (numpy's first calls)
    budget = 1 << 20  # 1 MiB; a materialized epoch would be 8 GB
    assert _peak_bytes(lookups) < budget
    # The measurement sees O(n) memory where there is some: materializing 200k ids exceeds it.
    assert _peak_bytes(lambda: order.epoch_permutation(200_000, SEED, 0)) > budget


@pytest.mark.parametrize("n", [10**3, 10**6, BILLION, 10**12, 2**29 + 1])
def test_a_lookup_is_a_bounded_number_of_rounds(n):
    # Cycle-walking needs fewer than 2 network applications a lookup on average, whatever n is:
    # the network's domain is under 2n (2^29 + 1 is the worst case, a domain of almost 2n).
    positions = np.unique(np.random.default_rng(0).integers(0, n, 20_000))
    walks = order.epoch_order(n, SEED, 3).walks(positions)
    assert walks.min() == 1 and walks.mean() < 2.1 and walks.max() < 40


def test_first_outputs_are_pinned():
    # Golden values: a change to the network, its keys or the sampler would silently feed old
    # runs other data on replay or resume; this fails first.
    assert order.epoch_order(BILLION, SEED, 0)(np.arange(6)).tolist() == [
        709709112, 766825211, 790918055, 386248679, 60199384, 39147514]
    assert order.epoch_order(BILLION, SEED, 1)(np.array([0, BILLION - 1])).tolist() == [866240275, 973253399]
    assert order.epoch_permutation(10, SEED, 0).tolist() == [4, 6, 9, 1, 2, 7, 3, 0, 5, 8]
    assert order.round_keys(SEED, 0)[:2] == (7154750634659847953, 1801449516436127202)


def _synthetic_source(n_examples: int, seq_len: int) -> TokenSource:
    # A billion examples without a byte of data: one token broadcast over the whole stream.
    tokens = np.broadcast_to(np.array(7, data.DTYPES["uint16"]), (n_examples * (seq_len + 1),))
    return TokenSource("file", "synthetic", "uint16", tokens)


@pytest.mark.parametrize("count", [2, 4, 8])
def test_the_default_sampler_is_host_count_invariant_at_a_billion_examples(count):
    source = _synthetic_source(BILLION, 1)
    single = Batcher(source, 1, 64, SEED)
    for step in (0, 9_999_999, BILLION // 64, 3 * BILLION // 64 + 5):
        hosts = [Batcher(source, 1, 64, SEED, i, count) for i in range(count)]
        ids = np.concatenate([h.batch_at(step).ids for h in hosts])
        np.testing.assert_array_equal(ids, single.batch_at(step).ids, err_msg=f"step {step}")
        for h in hosts:
            np.testing.assert_array_equal(h.global_ids(step), ids)


# --------------------------------------------------------------------- contiguous-per-host


N, B = 1000, 16


def _fed(steps, count: int) -> list[np.ndarray]:
    """The global batch of each step when `count` hosts read with contiguous-per-host."""
    return [np.concatenate([order.contiguous_per_host_ids(N, SEED, k, B, h, count) for h in range(count)])
            for k in steps]


def test_contiguous_per_host_on_one_host_is_the_global_order():
    for k in range(0, 200, 7):
        np.testing.assert_array_equal(_fed([k], 1)[0], data.example_ids(N, SEED, k, B))


@pytest.mark.parametrize("count", [2, 4])
def test_contiguous_per_host_without_a_resume_feeds_each_example_at_most_once_an_epoch(count):
    owned = N // count  # each host's share of an epoch; N % count positions are read by no host
    steps = owned // (B // count)
    ids = np.concatenate(_fed(range(steps), count))
    assert np.unique(ids).size == ids.size


def test_resumed_on_twice_the_hosts_half_of_every_batch_was_already_fed():
    k = 20
    before = np.concatenate(_fed(range(k), 1))  # one host, steps 0..k-1
    after = _fed(range(k, 2 * k), 2)  # resumed at step k on two hosts
    for step, batch in zip(range(k, 2 * k), after):
        seen = np.isin(batch, before)
        # Host 0 jumps to position k * B/2 of its slice: data one host fed at steps k/2..k-1.
        assert seen[: B // 2].all() and not seen[B // 2:].any(), step
    # The host-invariant sampler resumed the same way feeds nothing twice.
    fresh = [data.example_ids(N, SEED, s, B) for s in range(k, 2 * k)]
    assert not np.isin(np.concatenate(fresh), before).any()


def test_resumed_on_half_the_hosts_part_of_the_epoch_is_skipped():
    k, steps = 10, N // B  # one epoch's worth of steps: 992 of the 1000 slots
    fed = np.concatenate(_fed(range(k), 2) + _fed(range(k, steps), 1))
    epoch = order.epoch_permutation(N, SEED, 0)
    skipped = np.setdiff1d(epoch, fed)
    # Host 0 had read positions 0..k*B/2 - 1; alone it jumps to k*B: positions k*B/2..k*B-1 are
    # never fed (nor the 8 beyond the last whole step, which no sampler reaches in this epoch),
    # while host 1's positions N/2.. are fed twice.
    np.testing.assert_array_equal(np.sort(skipped), np.sort(np.r_[epoch[k * B // 2 : k * B], epoch[steps * B:]]))
    assert fed.size - np.unique(fed).size == k * B // 2


def test_samplers_refuse_bad_arguments():
    with pytest.raises(DataError, match="fewer than one global batch"):
        order.contiguous_per_host_ids(15, SEED, 0, 16, 0, 2)
    with pytest.raises(DataError, match="multiple of 3"):
        order.contiguous_per_host_ids(N, SEED, 0, 16, 0, 3)
    with pytest.raises(DataError, match="below 2"):
        data.example_ids(N, 1 << 64, 0, B)
    with pytest.raises(DataError, match="unknown sampler"):
        Batcher(_synthetic_source(100, 1), 1, 16, SEED, sampler="per-host")
