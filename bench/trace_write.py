"""Sustained trace-writer throughput, step-level records with 16 per-example hashes.

Prints one JSON object on its last line: records_per_second, bytes_per_step, records.
Budget (issue 2): >= 20,000 records/s, so writing is never what a trainer waits on.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from bench._synthetic import SCHEMA, records
from traces import TraceWriter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--records", type=int, default=200_000)
    args = parser.parse_args()
    recs = list(records(args.records, seed=0))  # generated up front: only the writer is timed
    with tempfile.TemporaryDirectory() as tmp:
        writer = TraceWriter(Path(tmp) / "trace", SCHEMA)
        t0 = time.perf_counter()
        for rec in recs:
            writer.append(rec)
        writer.close()
        seconds = time.perf_counter() - t0
        files = list((Path(tmp) / "trace").iterdir())
        size = sum(p.stat().st_size for p in files if p.suffix != ".idx")  # the records
        index_size = sum(p.stat().st_size for p in files if p.suffix == ".idx")  # their indexes, apart
    print(json.dumps({
        "bench": "trace_write", "records": args.records, "seconds": round(seconds, 3),
        "records_per_second": round(args.records / seconds), "bytes_per_step": round(size / args.records, 2),
        "index_bytes_per_step": round(index_size / args.records, 2),
        "budget_records_per_second": 20000,
    }))


if __name__ == "__main__":
    main()
