"""The data order: which example fills each slot of each batch, as a pure function.

Epoch e of a source with n examples is a keyed pseudo-random permutation of range(n): a
Feistel network over the bits of the position (as Levanter's `PermutationDataset` does),
with cycle-walking for sizes that are not a power of two. Nothing is materialized: looking
up a batch of B positions costs O(B) time and memory at any n (a billion examples or more),
where a shuffled int64 array would hold 8 bytes per example per epoch.

    the network: positions are w-bit numbers, w = max(2, bits of n - 1), so 2^w < 2n. The
      high a = w // 2 bits (L) and the low b = w - a bits (R) are mixed by ROUNDS half-rounds,
      alternately L ^= F(R, k_i) mod 2^a and R ^= F(L, k_i) mod 2^b, F a 64-bit murmur3
      finalizer of (half XOR round key). Each half-round is invertible, so the network is a
      bijection of [0, 2^w);
    cycle-walking: a result >= n is fed through the network again until it lands below n.
      Following the network's cycle from a position < n must reach one, so this is a
      bijection of [0, n); since 2^w < 2n, fewer than 2 applications are expected per
      position (measured in tests/trainer/test_order.py);
    the keys: ROUNDS 64-bit round keys per epoch, xxh3_64 of (data seed, epoch, round) under a
      domain tag; the data seed is the root seed's "data" stream (trainer/rng.py).

Cost: a 1,024-example batch's ids take about 0.4 ms at n = 10^9 (measured, 2-core CPU) and under
100 KB, the same at step 0 and at step 10^6 of a 1.4M-step run: nothing is kept between steps.

Samplers say which slots a host reads (`SAMPLERS`):

    global                the default. Slot g = step*B + j of the global batch lives in epoch
                          g // n at position g % n; each host loads its contiguous slice of the
                          global batch. The batch at step k is a pure function of (source size,
                          seed, k, B): the same on any host count, so a resume on other hosts
                          continues the very same stream.
    contiguous-per-host   a real bug, kept to be found: each of P hosts owns a contiguous slice of
                          every epoch's permutation (n // P positions) and reads B/P examples a
                          step from it, its position being step * (B/P), as the MaxText OLMo
                          loader did on resume. Uninterrupted it is a valid order (on one host it
                          is the global order), but resumed at step k on 2P hosts half of every
                          batch is data already fed (for k more steps), and on P/2 hosts part of
                          the epoch is skipped.
"""

from __future__ import annotations

import functools
import struct

import numpy as np
import xxhash

from trainer.errors import DataError

SAMPLERS = ("global", "contiguous-per-host")
ROUNDS = 8  # half-rounds: 4 per half, more than the 3-4 a Luby-Rackoff permutation needs

# Domain tag of the round keys, so the data order can never equal another component's stream
# derived from the same integer seed.
_KEY_TAG = xxhash.xxh3_64_intdigest(b"replay.data.feistel_permutation.v1")
_M1, _M2 = np.uint64(0xFF51AFD7ED558CCD), np.uint64(0xC4CEB9FE1A85EC53)
_S33 = np.uint64(33)


def _fail(message: str):
    raise DataError(message)


def _mix(x: np.ndarray) -> np.ndarray:
    """murmur3's 64-bit finalizer: every output bit depends on every input bit."""
    x = x ^ (x >> _S33)
    x = x * _M1
    x = x ^ (x >> _S33)
    x = x * _M2
    return x ^ (x >> _S33)


class KeyedPermutation:
    """A bijection of range(n) given by its round keys; calling it on positions gives ids.

    O(1) memory whatever n is; each lookup is ROUNDS half-rounds per network application and
    fewer than 2 applications expected (cycle-walking over a domain under 2n)."""

    __slots__ = ("n", "keys", "_b", "_mask_l", "_mask_r")

    def __init__(self, n: int, keys: tuple[int, ...]):
        if not 1 <= n <= 1 << 62:
            raise ValueError(f"a keyed permutation has 1 to 2^62 elements, not {n}")
        self.n = int(n)
        self.keys = tuple(np.uint64(k) for k in keys)
        width = max(2, (self.n - 1).bit_length())
        a = width // 2
        self._b = np.uint64(width - a)
        self._mask_l = np.uint64((1 << a) - 1)
        self._mask_r = np.uint64((1 << (width - a)) - 1)

    def network(self, x: np.ndarray) -> np.ndarray:
        """One application of the Feistel network to uint64 values in [0, 2^w)."""
        left, right = x >> self._b, x & self._mask_r
        for i, key in enumerate(self.keys):
            if i % 2 == 0:
                left = left ^ (_mix(right ^ key) & self._mask_l)
            else:
                right = right ^ (_mix(left ^ key) & self._mask_r)
        return (left << self._b) | right

    def __call__(self, positions) -> np.ndarray:
        """The ids at `positions` (any integer array in [0, n)), as int64 of the same shape."""
        return self._walk(positions)[0]

    def walks(self, positions) -> np.ndarray:
        """How many network applications each position needed (1 when it lands below n at once)."""
        return self._walk(positions)[1]

    def _walk(self, positions) -> tuple[np.ndarray, np.ndarray]:
        pos = np.asarray(positions)
        if pos.size and (not np.issubdtype(pos.dtype, np.integer) or pos.min() < 0 or pos.max() >= self.n):
            raise ValueError(f"positions must be integers in [0, {self.n})")
        with np.errstate(over="ignore"):  # the mixing multiplies wrap modulo 2^64 on purpose
            x = self.network(pos.astype(np.uint64).reshape(-1))
            walks = np.ones(x.shape, np.int64)
            outside = np.flatnonzero(x >= self.n)
            while outside.size:
                x[outside] = self.network(x[outside])
                walks[outside] += 1
                outside = outside[x[outside] >= self.n]
        return x.astype(np.int64).reshape(pos.shape), walks.reshape(pos.shape)


def round_keys(data_seed: int, epoch: int) -> tuple[int, ...]:
    """The round keys of `epoch`: xxh3_64 of (data seed, epoch, round), a pure function of both."""
    return tuple(xxhash.xxh3_64_intdigest(struct.pack("<QQI", data_seed, epoch, i), seed=_KEY_TAG)
                 for i in range(ROUNDS))


@functools.lru_cache(maxsize=64)
def epoch_order(n_examples: int, data_seed: int, epoch: int) -> KeyedPermutation:
    """The order of examples in `epoch`: position -> example id, lazily (a few hundred bytes)."""
    return KeyedPermutation(n_examples, round_keys(data_seed, epoch))


def epoch_permutation(n_examples: int, data_seed: int, epoch: int) -> np.ndarray:
    """The whole order of `epoch` as an int64 array: O(n) memory, for tests and small sources;
    the trainer never materializes it."""
    return epoch_order(n_examples, data_seed, epoch)(np.arange(n_examples, dtype=np.int64))


def lookup(n_examples: int, data_seed: int, epochs_B: np.ndarray, positions_B: np.ndarray) -> np.ndarray:
    """ids of (epoch, position) pairs; a batch spans at most two epochs, each looked up once."""
    ids_B = np.empty(positions_B.shape, np.int64)
    for epoch in np.unique(epochs_B):
        mask = epochs_B == epoch
        ids_B[mask] = epoch_order(n_examples, data_seed, int(epoch))(positions_B[mask])
    return ids_B


def check_nonneg_int(name: str, value) -> int:
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 0:
        return int(value)
    _fail(f"{name} must be a non-negative integer, got {value!r}")


def host_slice(global_batch: int, process_index: int, process_count: int) -> slice:
    """The contiguous positions of the global batch that this process loads."""
    if process_count < 1 or not 0 <= process_index < process_count:
        _fail(f"process_index {process_index} is not in [0, {process_count})")
    if global_batch % process_count:
        _fail(
            f"global batch {global_batch} does not split evenly over {process_count} processes; "
            f"use a global batch that is a multiple of {process_count}"
        )
    per_host = global_batch // process_count
    return slice(process_index * per_host, (process_index + 1) * per_host)


def check_seed(data_seed) -> int:
    seed = check_nonneg_int("data_seed", data_seed)
    if seed >= 1 << 64:
        _fail(f"data_seed must be below 2^64, got {seed}")
    return seed


def example_ids(n_examples: int, data_seed: int, step: int, global_batch: int) -> np.ndarray:
    """Global example ids of the batch at `step` under the `global` sampler: int64 (B,), in
    global order, the same on any host count. O(B) time and memory at any n."""
    n_examples = check_nonneg_int("n_examples", n_examples)
    data_seed = check_seed(data_seed)
    step = check_nonneg_int("step", step)
    global_batch = check_nonneg_int("global_batch", global_batch)
    if global_batch == 0:
        _fail("global_batch must be at least 1")
    if n_examples < global_batch:
        # A batch would hold some example twice; also keeps a batch within 2 epochs.
        _fail(f"{n_examples} examples is fewer than one global batch of {global_batch}")
    slots_B = step * global_batch + np.arange(global_batch, dtype=np.int64)
    epochs_B, positions_B = np.divmod(slots_B, n_examples)
    return lookup(n_examples, data_seed, epochs_B, positions_B)


def contiguous_per_host_ids(n_examples: int, data_seed: int, step: int, global_batch: int,
                            process_index: int, process_count: int) -> np.ndarray:
    """This host's example ids at `step` under `contiguous-per-host`: int64 (B/P,). Host h owns
    positions [h*m, (h+1)*m) of every epoch's permutation, m = n // P (the n % P last positions
    are read by no host), and reads B/P of them a step from position step * (B/P) on."""
    n_examples = check_nonneg_int("n_examples", n_examples)
    data_seed = check_seed(data_seed)
    step = check_nonneg_int("step", step)
    local = host_slice(global_batch, process_index, process_count)
    per_host = local.stop - local.start
    if n_examples < global_batch:  # then each host owns at least a step's share: n // P >= B / P
        _fail(f"{n_examples} examples is fewer than one global batch of {global_batch}")
    owned = n_examples // process_count
    slots_b = step * per_host + np.arange(per_host, dtype=np.int64)
    epochs_b, positions_b = np.divmod(slots_b, owned)
    return lookup(n_examples, data_seed, epochs_b, process_index * owned + positions_b)
