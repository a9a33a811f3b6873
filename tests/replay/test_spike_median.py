"""The rolling median behind `replay spike` (issue 12: a 1.4M-step loss curve scored in seconds):
the fast row median is numpy's nanmedian, value for value, NaN rows and even widths included."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from replay.spike.detect import MIN_WINDOW, _finite_rows_median_mad, _row_nanmedian, rolling_scores


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
