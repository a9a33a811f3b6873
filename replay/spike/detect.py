"""Loss-spike detection (`replay spike RUN`): reads only the trace, never imports JAX.

A step's loss is compared with the steps before it:

    baseline  = median of the finite losses of the previous `window` steps
    spread    = 1.4826 * MAD of those losses (the MAD scaled to a normal's sigma), at least
                REL_FLOOR * |baseline| so a flat loss cannot make any wobble a spike
    score     = (loss - baseline) / spread        a spike when score >= threshold

The median and MAD are robust: a spike inside the window barely moves them, and a falling
loss (early training) only lowers scores. A non-finite loss is always a spike.
See replay/spike/__init__.py for the whole feature and its measured numbers.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from traces import Run, columns
from traces.parallel import WORKERS, ordered_map
from replay.engine.damage import shown_path


def shown(run: Run) -> str:
    """The run as messages name it: a bundle by its file (BUNDLE), never the temporary folder it
    was unpacked to; a run by its folder."""
    return shown_path(run)

DEFAULT_WINDOW = 50
DEFAULT_THRESHOLD = 6.0
MIN_WINDOW = 5
MAD_SCALE = 1.4826  # MAD -> sigma of a normal distribution
REL_FLOOR = 1e-3  # the loss spread never counts as less than 0.1% of the baseline
LOG_FLOOR = 0.01  # a layer's RMS spread never counts as less than 1% (on the log scale)
DEFAULT_TOP = 8
DECODE_TOKENS = 48


class SpikeInputError(ValueError):
    """A step, window or run that spike analysis cannot use; one line, exit 2."""


# ------------------------------------------------------------------------------- robust statistics

def robust(values: np.ndarray, floor: float = 0.0) -> tuple[float, float]:
    """(median, spread) of the finite values; spread = 1.4826 * MAD, at least `floor`."""
    v = np.asarray(values, np.float64)
    v = v[np.isfinite(v)]
    if v.size == 0:
        return math.nan, math.nan
    med = float(np.median(v))
    return med, max(MAD_SCALE * float(np.median(np.abs(v - med))), floor, 1e-12)


ROLLING_CHUNK = 8192  # windows scored at once: bounds the (chunk, window) working arrays (~3.3 MB each a thread)


def _row_nanmedian(rows: np.ndarray) -> np.ndarray:
    """np.nanmedian(rows, axis=1), the same values, ~20x faster: short rows sort fast (numpy's
    SIMD sort) and NaNs sort last, so each row's median sits at its count of finite values."""
    s = np.sort(rows, axis=1)
    k = np.count_nonzero(~np.isnan(s), axis=1)
    lo = np.take_along_axis(s, np.maximum(k - 1, 0)[:, None] // 2, axis=1)[:, 0]
    hi = np.take_along_axis(s, np.minimum(k // 2, max(s.shape[1] - 1, 0))[:, None], axis=1)[:, 0]
    out = (lo + hi) / 2
    out[k == 0] = np.nan
    return out


def _finite_rows_median_mad(rows: np.ndarray, work: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(_row_nanmedian(rows), _row_nanmedian(|rows - median|)) of rows with no NaN, the same
    values with one sort instead of two: each row sorted, its deviations |s - median| fall then
    rise along it (rounding is monotone), so their k smallest are a contiguous run of s and the
    k-th smallest is the least, over runs of k, of the larger end's deviation (a run's largest
    is at an end; every run of k holds one at least the k-th). The values picked are elements
    of the same deviations the second sort ordered: the same bits. Rows are sorted in their own
    dtype (a float32 loss column: numpy's SIMD sort ~4x faster a row than float64) and widened
    after, which is exact and keeps the order (equal values aside: a median between -0.0 and 0.0
    may take either sign). `work`: (2, >= rows, width) float64, reused chunk after chunk (fresh
    arrays of this size cost page faults a chunk)."""
    m, w = rows.shape
    lo, hi = (w - 1) // 2, w // 2  # _row_nanmedian's indices when every value counts
    s = work[0, :m]
    s[...] = np.sort(rows, axis=1)
    med = (s[:, lo] + s[:, hi]) / 2
    # Deviations held a column of s a row (w, m): the runs' ends and their least are then
    # whole-row operations (~2x faster than along each short row); s's memory is free for them.
    dev, ends = (work[k].reshape(-1)[: w * m].reshape(w, m) for k in (1, 0))
    np.subtract(s.T, med, out=dev)
    np.abs(dev, out=dev)
    kth = [np.maximum(dev[: w - j], dev[j:], out=ends[: w - j]).min(axis=0) for j in (lo, hi)]  # runs of j + 1
    return med, (kth[0] + kth[1]) / 2


def rolling_scores(values_N: np.ndarray, window: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(baseline, spread, score) of each value against the `window` values before it (NaN for
    the first `window`, and where fewer than MIN_WINDOW of them are finite): whole-run arrays,
    24 bytes a step (the plot's curves); `scan` reads the same chunks without holding them."""
    v = _floats(values_N)
    n = v.size
    base, spread, score = (np.full(n, np.nan) for _ in range(3))
    for lo, med, sp, s in _scored_chunks(v, window):
        at = slice(window + lo, window + lo + s.size)
        base[at], spread[at], score[at] = med, sp, s
    return base, spread, score


def _floats(values_N: Any) -> np.ndarray:
    """The values as a float array, float32 kept (a run's metric column: each chunk is widened
    to float64 exactly, so the whole run is never held twice)."""
    v = np.asarray(values_N)
    return v if v.dtype in (np.float32, np.float64) else v.astype(np.float64)


def _scored_chunks(v: np.ndarray, window: int):
    """(lo, baseline, spread, score) for ROLLING_CHUNK values at a time: those of v[window + lo:]
    against the `window` values before each, as float64 (NaN where fewer than MIN_WINDOW of
    them are finite), in order. Chunks are independent, so they are scored on every core
    (traces.parallel: numpy's sorts and array passes release the GIL). Memory: each thread's
    chunk working set (two (chunk, window) float64 arrays, ~6.6 MB at --window 50), nothing a
    step: at 1.4M steps the whole-run temporaries (finite copy, running counts, three outputs)
    were ~110 MB of fresh pages, written once and faulted in first."""
    n = v.size
    if n <= window:
        return
    windows = np.lib.stride_tricks.sliding_window_view(v, window)[:-1]  # row i = v[i : i+window], before i+window
    starts = range(0, windows.shape[0], ROLLING_CHUNK)
    kept = threading.local()  # a thread's working arrays, reused chunk after chunk

    def scored(lo: int) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
        work = getattr(kept, "work", None)
        if work is None:
            work = kept.work = np.empty((2, min(ROLLING_CHUNK, windows.shape[0]), window))
        m = min(ROLLING_CHUNK, windows.shape[0] - lo)
        span = v[lo : lo + m + window].astype(np.float64)  # the chunk's windows, then the values they score
        finite = np.isfinite(span)
        counted = np.r_[0, np.cumsum(finite)]
        enough = counted[window : window + m] - counted[:m] >= MIN_WINDOW  # finite values in each row's window
        with np.errstate(all="ignore"):  # all-NaN windows: masked out below
            if finite[: m + window - 1].all():  # no NaN: one sort a row
                med, mad = _finite_rows_median_mad(windows[lo : lo + m], work)
            else:
                win = np.lib.stride_tricks.sliding_window_view(np.where(finite, span, np.nan)[: m + window - 1], window)
                med = _row_nanmedian(win)
                mad = _row_nanmedian(np.abs(win - med[:, None]))
            sp = np.maximum(np.maximum(MAD_SCALE * mad, REL_FLOOR * np.abs(med)), 1e-12)
            med[~enough], sp[~enough] = np.nan, np.nan
            s = (span[window:] - med) / sp
        s[~finite[window:] & enough] = np.inf  # a NaN or inf loss is always a spike
        return lo, med, sp, s

    yield from ordered_map(scored, starts, workers=min(WORKERS, len(starts)), name="replay-spike")


def _json_safe(obj: Any) -> Any:
    """`obj` with every non-finite float replaced by its string (JSON has no NaN or inf)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else str(obj)
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def _num(x: float | None) -> float | str | None:
    """A JSON-safe number: non-finite values become strings ("nan", "inf", "-inf")."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else str(x)


# ------------------------------------------------------------------------------- detection

@dataclass
class Spike:
    step: int
    loss: float
    baseline: float  # median loss of the previous window
    spread: float  # 1.4826 * MAD of the previous window (floored)
    score: float  # (loss - baseline) / spread

    @property
    def rise(self) -> float:
        return self.loss / self.baseline - 1.0 if self.baseline else math.inf

    def to_json(self) -> dict:
        return {"step": self.step, "loss": _num(self.loss), "baseline": _num(self.baseline),
                "spread": _num(self.spread), "score": _num(self.score), "rise": _num(self.rise)}


@dataclass
class Scan:
    run: str
    window: int
    threshold: float
    scanned: tuple[int, int]  # [first, last] steps with a full baseline window
    spikes: list[Spike] = field(default_factory=list)
    max_score: Spike | None = None  # the highest-scoring step, spike or not: the margin of a clean run

    def to_json(self) -> dict:
        return {"run": self.run, "window": self.window, "threshold": self.threshold,
                "scanned": list(self.scanned), "spikes": [s.to_json() for s in self.spikes],
                "max_score": self.max_score.to_json() if self.max_score else None}


def check_window(window: int, threshold: float) -> None:
    if window < MIN_WINDOW:
        raise SpikeInputError(f"--window {window} is too small for a median and MAD: use at least {MIN_WINDOW}")
    if not threshold > 0:
        raise SpikeInputError(f"--threshold {threshold} must be > 0 (a robust score: spreads above the baseline)")


DEFAULT_METRIC = "loss"  # the convention: a run's training loss is the metric named "loss"


def check_metric(run: Run, name: str = DEFAULT_METRIC) -> int:
    """The index of metric `name` in the run's schema; a one-line error naming the metrics the
    run has when it has no such metric (a loop that calls its loss something else)."""
    names = run.schema.metric_names
    if name in names:
        return run.schema.metric_index(name)
    have = ", ".join(names) or "none"
    how = (f"pass --metric NAME to choose one" if name == DEFAULT_METRIC
           else "pass --metric with one of them")
    raise SpikeInputError(f"{shown(run)}: records no metric named {name!r} (its metrics: {have}); {how}")


def _loss_column(run: Run, name: str = DEFAULT_METRIC) -> tuple[int, np.ndarray]:
    """(the first step, the metric's column in its recorded dtype), read from the segments'
    indexes (traces.columns): at 1.4M steps ~75 MB of index columns read and 4 bytes a step
    held, no record decoded."""
    trace = run.trace
    check_metric(run, name)
    if len(trace) == 0:
        raise SpikeInputError(f"{shown(run)}: the trace holds no steps (was it recorded with trace.level=off?)")
    return trace.start, columns.metric(trace, name)


def _loss_curve(run: Run, name: str = DEFAULT_METRIC) -> tuple[np.ndarray, np.ndarray]:
    """(steps, the metric as float64): the whole curve, for plots."""
    start, loss = _loss_column(run, name)
    return np.arange(start, start + loss.size), loss.astype(np.float64)


def scan(run: Run, window: int = DEFAULT_WINDOW, threshold: float = DEFAULT_THRESHOLD,
         metric: str = DEFAULT_METRIC) -> Scan:
    """Every recorded step whose `metric` (the loss) scores at least `threshold` against the previous window.

    Vectorised over the run (rows of windows sorted by numpy: one sort a row where no value is
    NaN, _finite_rows_median_mad; two, _row_nanmedian, where some are), ROLLING_CHUNK steps at a
    time, keeping only the spikes and the highest score: memory is the metric's column (4 bytes
    a step) and a chunk's working set. At 1.4M float32 losses, --window 50, in a fresh process on
    this 2-core VM: 0.28-0.32 s and 75 MB peak with the chunks scored in two threads, float32
    columns sorted as float32 (one thread, 2,048-window chunks, float64 sorts: 0.48-0.50 s, 58 MB;
    whole-run arrays: 0.67-1.18 s, 130 MB; the same spikes). Cost at a million steps: ~0.2 s of
    scoring, 4 bytes a step held."""
    check_window(window, threshold)
    start, loss = _loss_column(run, metric)
    return scan_values(shown(run), start, loss, window, threshold)


def scan_values(name: str, start: int, values_N: np.ndarray, window: int = DEFAULT_WINDOW,
                threshold: float = DEFAULT_THRESHOLD) -> Scan:
    """`scan` of values recorded at steps start, start + 1, ...; `name` names the run in messages."""
    loss = _floats(values_N)
    if loss.size <= window:
        raise SpikeInputError(f"{name} records {loss.size} steps ({start}..{start + loss.size - 1}), too few for a "
                              f"baseline of --window {window} previous steps: pass a smaller --window (at least {MIN_WINDOW})")
    result = Scan(name, window, threshold, (start + window, start + loss.size - 1))
    for lo, base, spread, score in _scored_chunks(loss, window):
        def spike(j: int) -> Spike:
            i = window + lo + j
            return Spike(start + i, float(loss[i]), float(base[j]), float(spread[j]), float(score[j]))

        scored = ~np.isnan(score)
        result.spikes += [spike(j) for j in np.flatnonzero(scored & (score >= threshold)).tolist()]
        if scored.any():
            best = spike(int(np.flatnonzero(scored)[np.argmax(score[scored])]))  # the chunk's first of its highest
            if result.max_score is None or best.score > result.max_score.score:  # the run's first of the highest
                result.max_score = best
    return result
