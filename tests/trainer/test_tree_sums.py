"""trainer/tree_sums.py: the online Counter is pair_tree's tree; the split axis. Eager, a few hundred small ops: no compile."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainer.tree_sums import Counter, canonical_axis, pair_tree, split_axis


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


def test_the_split_axis_is_the_canonical_one_or_none():
    assert canonical_axis((64, 320)) == 1 and canonical_axis((64, 64)) == 0 and canonical_axis(()) is None
    assert split_axis((64, 320), 8) == 1 and split_axis((320, 64), 8) == 0
    assert split_axis((12, 8), 8) is None  # 8 divides axis 1, but the canonical axis is 0
    assert split_axis((6, 10), 4) is None and split_axis((), 2) is None and split_axis((7,), 1) == 0
