"""The rolling median behind `replay spike` (issue 12: a 1.4M-step loss curve scored in seconds):
the fast row median is numpy's nanmedian, value for value, NaN rows and even widths included."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from replay.spike import detect
from replay.spike.detect import (MIN_WINDOW, ROLLING_CHUNK, _finite_rows_median_mad, _row_nanmedian,
                                 rolling_scores, scan_values)


@pytest.mark.parametrize("width", [1, 5, 6, 50, 51])
def test_row_median_is_nanmedian(width):
    rng = np.random.default_rng(width)
    rows = rng.standard_normal((3000, width)) * 100
    rows[rng.random(rows.shape) < 0.3] = np.nan
    rows[:4] = np.nan  # rows with no finite value
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        expected = np.nanmedian(rows, axis=1)
    assert np.array_equal(_row_nanmedian(rows), expected, equal_nan=True)
    i = int(np.flatnonzero(np.isfinite(rows).any(axis=1))[0])
    rows[i] += 1.0  # the comparison sees a changed median
    assert _row_nanmedian(rows)[i] != expected[i]


def test_rolling_scores_match_a_direct_computation():
    rng = np.random.default_rng(3)
    v = rng.standard_normal(400) + 5
    v[[50, 51, 52, 53, 54, 55]] = np.nan
    v[200] = np.inf
    window = 8
    base, spread, score = rolling_scores(v, window)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for i in range(window, v.size):
            w = v[i - window : i]
            w = w[np.isfinite(w)]
            if w.size < MIN_WINDOW:
                assert np.isnan(base[i]) and np.isnan(spread[i])
                continue
            med = np.median(w)
            assert base[i] == med
            sp = max(1.4826 * np.median(np.abs(w - med)), 1e-3 * abs(med), 1e-12)
            assert spread[i] == sp
            assert score[i] == (np.inf if not np.isfinite(v[i]) else (v[i] - med) / sp)


@pytest.mark.parametrize("width", [5, 6, 7, 50, 51])
def test_one_sort_median_and_mad_equal_two_sorts(width):
    """The NaN-free path (one sort a row, the MAD from runs of the sorted row) gives the bits of
    _row_nanmedian's two sorts: ties, signed zeros, quantized values, deviations that overflow."""
    rng = np.random.default_rng(width)
    rows = np.concatenate([
        rng.standard_normal((500, width)) * 100,
        rng.integers(-3, 4, (500, width)).astype(np.float64),  # many ties
        np.where(rng.random((200, width)) < 0.5, -0.0, 0.0),  # signed zeros
        np.exp(rng.standard_normal((300, width)) * 5),  # skewed: the MAD's run sits off centre
        rng.choice([-1.7e308, 1.7e308, 1.0], (100, width)),  # |x - median| overflows to inf
    ])
    rows = np.ascontiguousarray(rng.permuted(rows, axis=1))
    with np.errstate(all="ignore"):
        med, mad = _finite_rows_median_mad(rows, np.empty((2, rows.shape[0], width)))
        want_med = _row_nanmedian(rows)
        want_mad = _row_nanmedian(np.abs(rows - want_med[:, None]))
    assert med.tobytes() == want_med.tobytes() and mad.tobytes() == want_mad.tobytes()


def test_rolling_scores_without_nan_match_a_direct_computation():
    """The chunks with no NaN take the one-sort path; its scores equal numpy's median and MAD."""
    rng = np.random.default_rng(5)
    v = np.exp(rng.standard_normal(3000)) + np.round(rng.standard_normal(3000), 1)
    window = 10
    base, spread, score = rolling_scores(v, window)
    for i in range(window, v.size):
        w = v[i - window : i]
        med = np.median(w)
        sp = max(1.4826 * np.median(np.abs(w - med)), 1e-3 * abs(med), 1e-12)
        assert (base[i], spread[i], score[i]) == (med, sp, (v[i] - med) / sp)


@pytest.mark.parametrize("workers", [1, 3])
def test_chunks_scored_in_threads_match_numpy_median_and_mad(monkeypatch, workers):
    """Chunks are scored side by side in threads (traces.parallel) and sorted as float32 when the
    column is float32: every step of a multi-chunk float32 column has numpy's float64 median and
    MAD of its window, bit for bit, in step order, with one thread or several. The comparison
    sees chunks put out of order."""
    monkeypatch.setattr(detect, "WORKERS", workers)
    rng = np.random.default_rng(11)
    n, window = 3 * ROLLING_CHUNK + 333, 50
    v = (3 + np.exp(-np.arange(n) / 5e3) + 0.05 * rng.standard_normal(n)).astype(np.float32)
    v[rng.integers(0, n, 20)] *= 2
    base, spread, score = rolling_scores(v, window)
    wins = np.lib.stride_tricks.sliding_window_view(v.astype(np.float64), window)[:-1]
    med = np.median(wins, axis=1)
    sp = np.maximum(np.maximum(1.4826 * np.median(np.abs(wins - med[:, None]), axis=1), 1e-3 * np.abs(med)), 1e-12)
    assert base[window:].tobytes() == med.tobytes() and spread[window:].tobytes() == sp.tobytes()
    assert score[window:].tobytes() == ((v[window:].astype(np.float64) - med) / sp).tobytes()

    chunks = list(detect._scored_chunks(v, window))
    assert [lo for lo, *_ in chunks] == list(range(0, n - window, ROLLING_CHUNK))
    swapped = np.concatenate([c[1] for c in (chunks[1], chunks[0], *chunks[2:])])
    assert swapped.tobytes() != med.tobytes()


def _fields(spike) -> tuple:
    return (spike.step, spike.loss, spike.baseline, spike.spread, spike.score)


def _whole_run(start: int, v: np.ndarray, window: int, threshold: float) -> tuple[list, tuple]:
    """The spikes and the first highest score as rolling_scores' whole-run arrays give them."""
    base, spread, score = rolling_scores(v.astype(np.float64), window)
    at = lambda i: (start + i, float(v[i]), float(base[i]), float(spread[i]), float(score[i]))  # noqa: E731
    scored = ~np.isnan(score)
    return ([at(i) for i in np.flatnonzero(scored & (score >= threshold))],
            at(int(np.flatnonzero(scored)[np.argmax(score[scored])])))


def _bits(rows) -> bytes:
    return np.array(rows, np.float64).tobytes()


def test_scan_chunk_by_chunk_gives_the_whole_run_scores():
    """`replay spike` scores ROLLING_CHUNK steps at a time and keeps only the spikes and the highest
    score (no whole-run arrays: at 1.4M steps they were ~110 MB of fresh pages): the same steps,
    losses, baselines, spreads and scores, bit for bit, as the whole-run arrays, across chunks
    with and without NaN, an inf, a float32 column; the first of two equal highest scores in
    different chunks is the run's. The comparison sees a changed loss."""
    window, threshold, start = 50, 6.0, 100
    rng = np.random.default_rng(7)
    v = (5 + 0.05 * rng.standard_normal(3 * ROLLING_CHUNK + 777)).astype(np.float32)
    v[[ROLLING_CHUNK - 1, ROLLING_CHUNK, ROLLING_CHUNK + 60]] = np.nan  # NaNs at a chunk's edge: the NaN path
    v[2 * ROLLING_CHUNK + 5] = np.inf
    v[[500, 3 * ROLLING_CHUNK + 100]] = 6.0  # spikes in the first and last chunks
    got = scan_values("run", start, v, window, threshold)
    spikes, best = _whole_run(start, v, window, threshold)
    assert len(got.spikes) >= 5 and got.scanned == (start + window, start + v.size - 1)
    assert _bits([_fields(s) for s in got.spikes]) == _bits(spikes)
    assert _bits(_fields(got.max_score)) == _bits(best) and got.max_score.score == np.inf

    changed = v.copy()
    changed[3 * ROLLING_CHUNK + 100] = 6.5
    assert _bits(_whole_run(start, changed, window, threshold)[0]) != _bits(spikes)

    flat = np.full(3 * ROLLING_CHUNK, 5.0, np.float32)
    flat[[500, 2 * ROLLING_CHUNK + 500]] = 6.0  # the same baseline and spread: equal scores in two chunks
    got = scan_values("run", 0, flat, window, threshold)
    assert [s.step for s in got.spikes] == [500, 2 * ROLLING_CHUNK + 500]
    assert _fields(got.max_score) == _whole_run(0, flat, window, threshold)[1] and got.max_score.step == 500
