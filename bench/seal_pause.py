"""How long sealing a segment pauses the loop that appends, and the writer's peak memory.

A loop appends step-level records of 1,024 example hashes (a real run's shape) to a TraceWriter,
with `--step-ms` of sleep between appends standing in for the step (a real loop waits on its
device with the GIL released). It writes one full segment and then keeps appending while the
sealed one's index is built, so a seal done anywhere (the loop's thread or the writer's) shows
up in the loop's append times. Records are drawn on the fly: none are held by the bench.

Prints one JSON object on its last line: max_pause_ms (the longest append, which includes any
wait for a seal), seal_append_ms (the append that filled the segment), p99_append_ms,
seal_peak_mb (the process's peak RSS, sampled every ms, above its RSS just before the seal: what
sealing costs beyond the hashes the writer already holds; its budget is the size of the segment's
index file), peak_mb (the same above the RSS before the first append), max_pause_during_seal_ms
(the longest append from the filling one until the index file exists), max_pause_before_seal_ms
(the longest append with no seal in flight: the machine's noise), seal_seconds (from the filling
append until the segment's index file exists), with the budgets beside them (issue 34).
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
    def __init__(self):
        super().__init__(daemon=True)
        self.peak, self._done = 0.0, threading.Event()

    def run(self) -> None:
        while not self._done.wait(0.001):
            self.peak = max(self.peak, _rss_mb())

    def stop(self) -> float:
        self._done.set()
        self.join()
        return max(self.peak, _rss_mb())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--examples", type=int, default=1024)
    parser.add_argument("--segment-records", type=int, default=16384)
    parser.add_argument("--after", type=int, default=8000, help="records appended after the seal (outlasting it)")
    parser.add_argument("--step-ms", type=float, default=1.0)
    args = parser.parse_args()
    schema = scale_schema(args.examples)
    rng = np.random.default_rng(0)
    rng_words = np.array([1, 2], np.uint32)

    def record(step: int) -> StepRecord:
        hashes = rng.integers(0, 2**63, args.examples, dtype=np.uint64)
        metrics = np.array([1.5, 0.25, 1e-3], np.float32)
        return StepRecord(step, rng_words, step * 7919, hashes, metrics, example_metrics=np.ones((1, args.examples), np.float32))

    n = args.segment_records + args.after
    times = np.zeros(n)
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace"
        writer = TraceWriter(trace, schema, segment_records=args.segment_records)
        idx = index_path(trace / segment_name(0))
        base = _rss_mb()
        before_seal = base
        sampler = _PeakRss()
        sampler.start()
        sealed_at = indexed_at = None
        indexed_step = n - 1
        for step in range(n):
            rec = record(step)
            t0 = time.perf_counter()
            writer.append(rec)
            t1 = time.perf_counter()
            times[step] = t1 - t0
            if step == args.segment_records - 2:
                before_seal = _rss_mb()  # the filled builder's hashes are in it: the seal's own peak is above
            if step == args.segment_records - 1:
                sealed_at = t0
            if sealed_at is not None and indexed_at is None and idx.exists():
                indexed_at, indexed_step = t1, step
            time.sleep(args.step_ms / 1000)
        writer.close()
        if indexed_at is None and idx.exists():
            indexed_at = time.perf_counter()
        peak_rss = sampler.stop()
        peak, seal_peak = peak_rss - base, peak_rss - before_seal
        index_mb = idx.stat().st_size / 2**20 if idx.exists() else None
    seal = times[args.segment_records - 1]
    print(json.dumps({
        "bench": "seal_pause", "examples_per_step": args.examples, "segment_records": args.segment_records,
        "appends": n, "step_ms": args.step_ms,
        "max_pause_ms": round(times.max() * 1e3, 2), "budget_max_pause_ms": 20,
        "seal_append_ms": round(seal * 1e3, 2),
        "p99_append_ms": round(float(np.percentile(times, 99)) * 1e3, 3),
        "median_append_ms": round(float(np.median(times)) * 1e3, 3),
        "max_pause_during_seal_ms": round(times[args.segment_records - 1 : indexed_step + 1].max() * 1e3, 2),
        "appends_during_seal": int(indexed_step + 2 - args.segment_records),
        "max_pause_before_seal_ms": round(times[: args.segment_records - 1].max() * 1e3, 2),
        "seal_peak_mb": round(seal_peak, 1), "budget_seal_peak_mb": round(index_mb, 1) if index_mb is not None else None,
        "peak_mb": round(peak, 1),
        "seal_seconds": round(indexed_at - sealed_at, 3) if indexed_at is not None else None,
    }))


if __name__ == "__main__":
    main()
