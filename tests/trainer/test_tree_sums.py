"""trainer/tree_sums.py: the online Counter is pair_tree's tree; the split axis; the gradient's norm from shards
is its norm whole, bit for bit. Eager or one small jit: a few hundred small ops."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainer.tree_sums import Counter, fixed_order_sums, pair_tree, row_sums_of_squares, split_axis


def _terms(k: int, seed: int) -> np.ndarray:
    """k terms of mixed magnitudes: two summation orders round differently somewhere."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((k, 3, 4)) * 10.0 ** rng.integers(-3, 4, (k, 3, 4))).astype(np.float32)


def _bits(x) -> bytes:
    return np.asarray(x).tobytes()


@jax.jit
def _prefix_sums(terms_Kx):
    """For every k: Counter(k)'s sum of the first k terms, and pair_tree's. One Counter(K) runs in a
    scan (as the trainer's does) and emits its slots after each term: after term k-1 its low slots
    are Counter(k)'s state (the higher ones are untouched). One compile for every k."""
    big = Counter(terms_Kx.shape[0])

    def body(state, xt):
        state = big.push(state, xt[0], xt[1])
        return state, state[0]

    _, slots_K = jax.lax.scan(body, big.init(terms_Kx[0]), (terms_Kx, jnp.arange(terms_Kx.shape[0], dtype=jnp.int32)))
    online, tree = [], []
    for k in range(1, terms_Kx.shape[0] + 1):
        small = Counter(k)
        online.append(small.finish((tuple(s[k - 1] for s in slots_K[:small.n_slots]), None)))
        tree.append(pair_tree(terms_Kx[:k]))
    return jnp.stack(online), jnp.stack(tree)


def test_the_counter_adds_in_pair_trees_order_for_every_count_up_to_33():
    """Bit for bit; a left-to-right sum differs from the tree on most prefixes of these terms, so
    equal bits mean the same adds (float adds commute, so only the grouping can differ)."""
    terms = _terms(33, 1)
    online, tree = (np.asarray(x) for x in _prefix_sums(jnp.asarray(terms)))
    for k in range(1, 34):
        assert _bits(online[k - 1]) == _bits(tree[k - 1]), k
    left = np.cumsum(terms, axis=0, dtype=np.float32)  # sequential adds, in order
    assert sum(_bits(left[k]) != _bits(tree[k]) for k in range(33)) >= 20


@pytest.mark.parametrize("k,cap", [(8, 3), (12, 2), (6, 1), (5, 0)])
def test_a_capped_counter_stops_where_pair_tree_with_levels_stops(k, cap):
    terms = _terms(k, 100 + k)
    counter = Counter(k, cap)
    state = counter.init(jax.ShapeDtypeStruct(terms.shape[1:], terms.dtype))
    for t in range(k):
        state = counter.push(state, jnp.asarray(terms[t]), np.int32(t))
    want = pair_tree(jnp.asarray(terms), cap)
    assert want.shape[0] == k >> cap and _bits(counter.finish(state)) == _bits(want)


def test_a_counter_holds_log2_terms_not_all_of_them():
    assert (Counter(64).n_slots, Counter(5).n_slots, Counter(1).n_slots, Counter(64, 3).n_slots) == (7, 3, 1, 3)
    with pytest.raises(ValueError):
        Counter(6, 2)


def test_the_split_axis_is_axis_0_or_none():
    assert split_axis((64, 320), 8) == 0 and split_axis((320, 64), 8) == 0 and split_axis((64,), 64) == 0
    assert split_axis((12, 8), 8) is None  # 8 divides axis 1, not axis 0: whole, on every count alike
    assert split_axis((6, 10), 4) is None and split_axis((), 2) is None and split_axis((7,), 1) == 0


def _np_pair_tree(x: np.ndarray) -> np.ndarray:
    """pair_tree over axis 0 in numpy float32: the reference the jax code must equal."""
    while x.shape[0] > 1:
        k = x.shape[0]
        pairs = x[0:k - 1:2] + x[1:k:2]
        x = np.concatenate([pairs, x[k - 1:]]) if k % 2 else pairs
    return x[0]


def _leaves(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    shapes = [(24, 7), (8, 5, 3), (16,), (12, 9)]
    return [(rng.standard_normal(s) * 10.0 ** rng.integers(-3, 4, s)).astype(np.float32) for s in shapes]


@pytest.mark.parametrize("n", [2, 8])
def test_the_norm_from_row_shards_is_the_norm_of_the_whole_leaves_bit_for_bit(n):
    leaves = _leaves(0)
    # eager, op by op: within one fused kernel XLA:CPU may contract a square and an add into an FMA
    # (mesh-invariant mode turns FMA off for the process, trainer/invariant.py; this process has it)
    leaves = [jnp.asarray(x) for x in leaves]
    whole_norm, whole_sums = fixed_order_sums(leaves, [False] * len(leaves), None)
    # n devices: device d holds rows d*R/n.. of each leaf axis 0 divides; the gather puts the
    # devices' row sums back in device order (what the trainer's all_gather does)
    cut = [split_axis(x.shape, n) is not None for x in leaves]

    def on_devices(ls):  # device 0's fixed_order_sums, its gather handing it every device's row sums in order
        shards = [jnp.split(x, n) if c else [x] * n for x, c in zip(ls, cut)]
        gathered = iter([jnp.concatenate([row_sums_of_squares(part) for part in parts])
                         for parts, c in zip(shards, cut) if c])
        return fixed_order_sums([parts[0] for parts in shards], cut, lambda rows: next(gathered))

    norm, sums = on_devices(leaves)
    assert _bits(norm) == _bits(whole_norm) and _bits(sums) == _bits(whole_sums)
    # the order is the documented one: per row a pairwise tree over the other axes, then over rows
    def rows(x):
        sq = np.square(x)
        for _ in range(1, x.ndim):
            sq = np.moveaxis(sq, 1, 0)
            sq = _np_pair_tree(sq)
        return sq
    want = np.stack([_np_pair_tree(rows(np.asarray(x))) for x in leaves])
    assert _bits(whole_sums) == _bits(want)
    assert _bits(whole_norm) == _bits(np.sqrt(_np_pair_tree(want)))


def test_another_order_gives_other_norm_bits():
    """The bit comparison above can fail: a plain sequential float32 sum of the same squares
    rounds differently for these leaves."""
    leaves = _leaves(0)
    _, sums = fixed_order_sums([jnp.asarray(x) for x in leaves], [False] * 4, None)
    sequential = [np.float32(0)] * 4
    for i, x in enumerate(leaves):
        acc = np.float32(0)
        for v in np.square(x).ravel():
            acc = np.float32(acc + v)
        sequential[i] = acc
    assert _bits(sums) != _bits(np.asarray(sequential, np.float32))
