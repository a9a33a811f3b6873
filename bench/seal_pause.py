"""How long sealing a segment pauses the loop that appends, and the writer's peak memory.

A loop appends step-level records of 1,024 example hashes (a real run's shape) to a TraceWriter,
with `--step-ms` of sleep between appends standing in for the step (a real loop waits on its
device with the GIL released). It fills `--segments` segments and then keeps appending while the
last one's index is built, so a seal done anywhere (the loop's thread or the writer's) shows up in
the loop's append times, and so does a seal that waits for the previous one (one is in flight at
a time: a segment filled faster than its predecessor is indexed waits). Records are drawn on the
fly: none are held by the bench.

Prints one JSON object on its last line: max_pause_ms (the longest append), max_pause_during_seal_ms
(the longest append from a filling one until its index file exists) with seal_pause_within_budget,
max_pause_without_seal_ms (no seal in flight: the machine's noise), the p99 append and the number
of appends over 20 ms with a seal in flight and without (a seal that pauses the loop shows as more
of them, where a lone 20 ms pause may be the machine's noise), seal_append_ms (the longest
filling append, which includes any wait for the previous seal), p50/p99_append_ms, seal_peak_mb
(the process's peak RSS, sampled every ms, above its RSS just before a seal: what sealing costs
beyond the hashes the writer already holds; its budget is the size of a segment's index file),
peak_mb (the same above the RSS before the first append), seal_seconds (from a filling append
until its index file exists), the largest over the seals of each, and per_seal, with the budgets
beside them (issue 34: a pause <= 20 ms).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from bench._synthetic import scale_schema
from traces import StepRecord, TraceWriter
from traces.index import index_path
from traces.trace import segment_name


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


class _PeakRss(threading.Thread):
    """The process's peak RSS, sampled every ms: overall, and over windows opened and closed by
    the loop (one a seal; a seal's window stays open until its index exists, even past the next)."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak, self._done = 0.0, threading.Event()
        self._lock, self._windows = threading.Lock(), {}

    def run(self) -> None:
        while not self._done.wait(0.001):
            rss = _rss_mb()
            with self._lock:
                self.peak = max(self.peak, rss)
                for k, v in self._windows.items():
                    self._windows[k] = max(v, rss)

    def open(self, key) -> float:
        rss = _rss_mb()
        with self._lock:
            self._windows[key] = rss
        return rss

    def close(self, key) -> float:
        rss = _rss_mb()
        with self._lock:
            return max(self._windows.pop(key), rss)

    def stop(self) -> float:
        self._done.set()
        self.join()
        return max(self.peak, _rss_mb())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--examples", type=int, default=1024)
    parser.add_argument("--segment-records", type=int, default=16384)
    parser.add_argument("--segments", type=int, default=2, help="segments filled (each sealed under the loop)")
    parser.add_argument("--after", type=int, default=8000, help="records appended after the last seal (outlasting it)")
    parser.add_argument("--step-ms", type=float, default=1.0)
    parser.add_argument("--no-compact", action="store_true",
                        help="seal as a format-2 run's writer does (no compaction: traces/compaction.py)")
    args = parser.parse_args()
    if args.segments < 1 or args.segment_records < 2 or args.after < 0:
        parser.error("--segments >= 1, --segment-records >= 2 and --after >= 0")
    schema = scale_schema(args.examples)
    rng = np.random.default_rng(0)
    rng_words = np.array([1, 2], np.uint32)

    def record(step: int) -> StepRecord:
        hashes = rng.integers(0, 2**63, args.examples, dtype=np.uint64)
        metrics = np.array([1.5, 0.25, 1e-3], np.float32)
        return StepRecord(step, rng_words, step * 7919, hashes, metrics, example_metrics=np.ones((1, args.examples), np.float32))

    R = args.segment_records
    n = args.segments * R + args.after
    times = np.zeros(n)
    fills = [(k + 1) * R - 1 for k in range(args.segments)]  # the appends that fill (and seal) a segment
    seals = [{"filled_at": f, "before_rss": None, "t0": None, "done_t": None, "done_step": None, "peak_rss": None}
             for f in fills]
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace"
        writer = TraceWriter(trace, schema, segment_records=R, compact=not args.no_compact)
        idxs = [index_path(trace / segment_name(f - R + 1)) for f in fills]
        base = _rss_mb()
        sampler = _PeakRss()
        sampler.start()
        pending: list[int] = []  # seals whose index file is not there yet

        def done(k: int, t: float, step: int) -> None:
            seals[k].update(done_t=t, done_step=step, peak_rss=sampler.close(k))
            pending.remove(k)

        for step in range(n):
            rec = record(step)
            t0 = time.perf_counter()
            writer.append(rec)
            t1 = time.perf_counter()
            times[step] = t1 - t0
            k = step // R
            if k < args.segments and step == fills[k] - 1:
                # the filled builder's hashes are in it: the seal's own peak is above
                seals[k]["before_rss"] = sampler.open(k)
            if k < args.segments and step == fills[k]:
                seals[k]["t0"] = t0
                pending.append(k)
            for j in [j for j in pending if idxs[j].exists()]:
                done(j, t1, step)
            time.sleep(args.step_ms / 1000)
        writer.close()
        for j in list(pending):
            if idxs[j].exists():
                done(j, time.perf_counter(), n - 1)
        peak_rss = sampler.stop()
        index_mb = idxs[0].stat().st_size / 2**20 if idxs[0].exists() else None
    per_seal = []
    for s in seals:
        f, last = s["filled_at"], s["done_step"] if s["done_step"] is not None else n - 1
        per_seal.append({
            "append_ms": round(times[f] * 1e3, 2),  # includes any wait for the previous seal
            "max_pause_during_ms": round(times[f : last + 1].max() * 1e3, 2),
            "appends_during": int(last + 1 - f),
            "seconds": round(s["done_t"] - s["t0"], 3) if s["done_t"] is not None else None,
            "peak_mb": round(s["peak_rss"] - s["before_rss"], 1) if s["peak_rss"] is not None else None,
        })
    quiet = np.ones(n, bool)  # appends with no seal in flight: the machine's own noise
    for s, p in zip(seals, per_seal):
        quiet[s["filled_at"] : s["filled_at"] + p["appends_during"]] = False
    during = max(p["max_pause_during_ms"] for p in per_seal)
    seconds = [p["seconds"] for p in per_seal if p["seconds"] is not None]
    peaks = [p["peak_mb"] for p in per_seal if p["peak_mb"] is not None]
    print(json.dumps({
        "bench": "seal_pause", "examples_per_step": args.examples, "segment_records": R, "compacted": not args.no_compact,
        "seals": args.segments, "appends": n, "step_ms": args.step_ms,
        "max_pause_ms": round(times.max() * 1e3, 2), "budget_max_pause_ms": 20,
        "max_pause_during_seal_ms": during, "seal_pause_within_budget": bool(during <= 20),
        "max_pause_without_seal_ms": round(times[quiet].max() * 1e3, 2) if quiet.any() else None,
        # this machine's noise alone passes 20 ms now and then: how often, with and without a seal
        "p99_append_during_seal_ms": round(float(np.percentile(times[~quiet], 99)) * 1e3, 3),
        "p99_append_without_seal_ms": round(float(np.percentile(times[quiet], 99)) * 1e3, 3) if quiet.any() else None,
        "appends_over_budget_during_seal": int((times[~quiet] > 0.020).sum()),
        "appends_over_budget_without_seal": int((times[quiet] > 0.020).sum()),
        "appends_during_seal": int((~quiet).sum()), "appends_without_seal": int(quiet.sum()),
        "seal_append_ms": max(p["append_ms"] for p in per_seal),
        "p50_append_ms": round(float(np.percentile(times, 50)) * 1e3, 3),
        "p99_append_ms": round(float(np.percentile(times, 99)) * 1e3, 3),
        "seal_peak_mb": max(peaks) if peaks else None,
        "budget_seal_peak_mb": round(index_mb, 1) if index_mb is not None else None,
        "peak_mb": round(peak_rss - base, 1),
        "seal_seconds": max(seconds) if seconds else None,
        "per_seal": per_seal,
    }))


if __name__ == "__main__":
    main()
