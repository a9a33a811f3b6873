"""Time traces.compare finding the first divergence between two long synthetic traces.

Writes two step-level traces (16 per-example hashes a step) that are identical up to a
random step and differ from it on, then opens both and compares. Prints one JSON object on
its last line: steps, first_divergence, found_step, seconds, bytes_per_step (records;
index_bytes_per_step: the segments' index files, apart).
Budget (issue 2): seconds <= 1.0 for 1,000,000 steps; bytes_per_step <= 200.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import tempfile
import time
from pathlib import Path

from bench._synthetic import SCHEMA, records
from traces import TraceReader, TraceWriter, compare


def write(path: Path, steps: int, diverge_at: int | None) -> int:
    writer = TraceWriter(path, SCHEMA)
    same = records(steps if diverge_at is None else diverge_at, seed=0)
    rest = records(steps - diverge_at, seed=1, start=diverge_at) if diverge_at is not None else ()
    for rec in itertools.chain(same, rest):
        writer.append(rec)
    writer.close()
    return _sizes(path)


def _sizes(path: Path) -> dict[str, int]:
    """Bytes of the records (segment files) and of their indexes (.idx sidecars), apart."""
    sizes = {"records": 0, "index": 0}
    for p in path.iterdir():
        sizes["index" if p.suffix == ".idx" else "records"] += p.stat().st_size
    return sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=1_000_000)
    parser.add_argument("--seed", type=int, default=None, help="picks the divergence step (default: random)")
    args = parser.parse_args()
    first = random.Random(args.seed).randrange(args.steps)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        size = write(Path(tmp) / "a", args.steps, None)
        write(Path(tmp) / "b", args.steps, first)
        write_seconds = time.perf_counter() - t0
        t0 = time.perf_counter()
        result = compare(TraceReader(Path(tmp) / "a", SCHEMA), TraceReader(Path(tmp) / "b", SCHEMA))
        seconds = time.perf_counter() - t0
    print(json.dumps({
        "bench": "trace_compare", "steps": args.steps, "first_divergence": first, "found_step": result.first_step,
        "found_fields": [d.name for d in result.diffs], "seconds": round(seconds, 4),
        # The budget is the records'; the index (sorted example hashes, scalar columns) is reported apart.
        "bytes_per_step": round(size["records"] / args.steps, 2),
        "index_bytes_per_step": round(size["index"] / args.steps, 2), "write_seconds_both": round(write_seconds, 1),
        "budget_seconds": 1.0, "budget_bytes_per_step": 200,
    }))


if __name__ == "__main__":
    main()
