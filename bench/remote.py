"""Runs on object storage (issue 35): requests and seconds of `show`, `audit` and a bisect's
trace scan of a run in a bucket, and of recording it there, against the same run on local disk.

Two runs of bench.scale's step-level shape (A, and B whose loss is one part in 1000 higher from
90% of the run on) are written to a temporary folder and copied into an emulator started here on
127.0.0.1 (`--store s3`: moto's server, the default; `--store gcs`: gcp-storage-emulator, which serves
one request at a time, so its figures for parallel reads are the emulator's, not the design's). Every
request a Store makes first sleeps `--latency-ms` (in the calling thread, so requests made in
parallel overlap as they would on the network): the latency a VM sees to its region's bucket, in
front of an emulator that answers in well under a millisecond.

Commands (with --json) run in this process (typer's CliRunner, as the tests run them), after one warm-up `show`
of the local run, so the seconds are the command's own, without the CLI's start-up; the request
counts are the Stores' (traces.storage.request_counts). `open` is Run.open(url).trace alone.

Prints one JSON line a measurement, then one JSON object on the last line with the budgets
(open <= 2 s, bisect <= 5 s at 20 ms a request) beside the figures. Only what ran is reported.

    python -m bench.remote [--steps 100000] [--examples 16] [--latency-ms 20] [--store s3|gcs]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

import numpy as np

from bench._synthetic import scale_schema
from traces import Run, storage
from traces.segment import DEFAULT_SEGMENT_RECORDS

BUCKET = "replay-bench"
BUDGETS = {"open_s": 2.0, "bisect_s": 5.0}  # issue 35, at 20 ms a request


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_emulator(kind: str):
    """(the bucket's URL, a function that stops the emulator)."""
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    port = _free_port()
    if kind == "gcs":
        from gcp_storage_emulator.server import create_server

        server = create_server("127.0.0.1", port, in_memory=True, default_bucket=BUCKET)
        server.start()
        os.environ["STORAGE_EMULATOR_HOST"] = f"http://127.0.0.1:{port}"
        return f"gs://{BUCKET}", server.stop
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    os.environ.update({"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "bench",
                       "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"})
    storage.open_store(f"s3://{BUCKET}")[0].client.create_bucket(Bucket=BUCKET)
    return f"s3://{BUCKET}", server.stop


def upload(local: Path, url: str) -> None:
    store, key = storage.open_store(url)
    for p in sorted(local.rglob("*")):
        if p.is_file() and p.name != ".lock":
            store.write_if_absent(f"{key}/{p.relative_to(local).as_posix()}", p.read_bytes())


def add_latency(url: str, seconds: float) -> None:
    """Every request of the bucket's Store sleeps first: each one counts itself exactly once (base.Store._count)."""
    store = storage.open_store(url)[0]
    count = type(store)._count

    def slow(kind: str, nbytes: int = 0) -> None:
        time.sleep(seconds)
        count(store, kind, nbytes)

    store._count = slow


def timed(name: str, where: str, fn) -> dict:
    storage.reset_counts()
    t = time.perf_counter()
    code = fn()
    row = {"command": name, "where": where, "seconds": round(time.perf_counter() - t, 3), "exit_code": code,
           "requests": {k: v for k, v in storage.request_counts().items() if k != "bytes"},
           "bytes_requested": storage.request_counts().get("bytes", 0)}
    print(json.dumps(row), flush=True)
    return row


OUTPUTS: dict[tuple, str] = {}  # each command's stdout, to check a remote run reads as its local copy


def cli(*args: str):
    from typer.testing import CliRunner

    from replay.cli.app import app

    def run() -> int:
        result = CliRunner().invoke(app, list(args))
        if result.exit_code not in (0, 1):
            raise SystemExit(f"bench.remote: `replay {' '.join(args)}` failed: {result.output.strip()[-400:]}")
        OUTPUTS[args] = result.stdout
        return result.exit_code
    return run


def same_output(local: tuple, remote: tuple, names: dict[str, str]) -> bool:
    """Whether the remote command printed what the local one did, its URLs read as the local paths."""
    out = OUTPUTS[remote]
    for url, path in names.items():
        out = out.replace(url, path)
    return json.loads(out) == json.loads(OUTPUTS[local])


def open_only(where: str) -> int:
    run = Run.open(where)
    return 0 if not run.damage and len(run.trace) else 2


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--examples", type=int, default=16, help="example hashes a step (the trainer's real runs: 1,024)")
    ap.add_argument("--segment-records", type=int, default=DEFAULT_SEGMENT_RECORDS)
    ap.add_argument("--latency-ms", type=float, default=20.0)
    ap.add_argument("--store", choices=("s3", "gcs"), default="s3")
    args = ap.parse_args(argv)

    root = Path(tempfile.mkdtemp(prefix="bench-remote-"))
    bucket, stop = start_emulator(args.store)
    try:
        schema = scale_schema(args.examples)
        n = args.steps * args.examples
        diverge = int(args.steps * 0.9)

        def louder(rec):
            if rec.step < diverge:
                return rec
            m = rec.metrics.copy()
            m[0] *= np.float32(1.001)
            return dataclasses.replace(rec, metrics=m)

        t = time.perf_counter()
        _write(root / "A", schema, args, n)
        _write(root / "B", schema, args, n, louder)
        upload(root / "A", f"{bucket}/A")
        upload(root / "B", f"{bucket}/B")
        setup_s = time.perf_counter() - t
        add_latency(bucket, args.latency_ms / 1000)
        a, b, ra, rb = str(root / "A"), str(root / "B"), f"{bucket}/A", f"{bucket}/B"
        segments = len(Run.open(a).trace.segments)
        cli("show", "--json", a)()  # warm-up: imports, the CLI group
        rows = [
            timed("open", "local", lambda: open_only(a)), timed("open", "remote", lambda: open_only(ra)),
            timed("show", "local", cli("show", "--json", a)), timed("show", "remote", cli("show", "--json", ra)),
            timed("audit", "local", cli("audit", "--json", a)), timed("audit", "remote", cli("audit", "--json", ra)),
            timed("bisect", "local", cli("bisect", "--no-refine", "--json", a, b)),
            timed("bisect", "local+remote", cli("bisect", "--no-refine", "--json", a, rb)),
            timed("bisect", "remote", cli("bisect", "--no-refine", "--json", ra, rb)),
            # the write path: the same run recorded again, to disk and to the bucket (tail objects
            # every REPLAY_TAIL_RECORDS records, sealed segments whole; traces/storage/mirror.py)
            timed("record", "local", lambda: _write(root / "W", schema, args, n) or 0),
            timed("record", "remote", lambda: _write(f"{bucket}/W", schema, args, n) or 0),
        ]
    finally:
        stop()
        shutil.rmtree(root, ignore_errors=True)
    names = {ra: a, rb: b}
    same = {cmd: same_output((cmd, *flags, *here), (cmd, *flags, *there), names) for cmd, flags, here, there in (
        ("show", ["--json"], [a], [ra]), ("audit", ["--json"], [a], [ra]), ("bisect", ["--no-refine", "--json"], [a, b], [ra, rb]))}
    remote = {f"{r['command']}:{r['where']}": r for r in rows}
    summary = {
        "bench": "remote", "store": args.store, "latency_ms": args.latency_ms, "steps": args.steps,
        "examples_per_step": args.examples, "segments": segments, "setup_s": round(setup_s, 1),
        "same_output_as_local": same,
        "figures": {k: {"seconds": r["seconds"], "requests": sum(r["requests"].values())} for k, r in remote.items()},
        "budgets": {"open_s": BUDGETS["open_s"], "open_remote_s": remote["open:remote"]["seconds"],
                    "bisect_s": BUDGETS["bisect_s"], "bisect_remote_s": remote["bisect:remote"]["seconds"],
                    "within": remote["open:remote"]["seconds"] <= BUDGETS["open_s"]
                    and remote["bisect:remote"]["seconds"] <= BUDGETS["bisect_s"]},
        "note": "seconds in this process after a warm-up (no CLI start-up); latency injected before every request",
    }
    print(json.dumps(summary), flush=True)
    return summary


def _write(path, schema, args, n_examples: int, change=None) -> None:
    from bench._synthetic import scale_records

    run = Run.create(path, schema, {"config": {"synthetic": "bench.remote", "steps": args.steps}, "dataset_size": n_examples})
    writer = run.writer(args.segment_records)
    for rec in scale_records(schema, 0, args.steps, n_examples):
        writer.append(change(rec) if change else rec)
    run.finish()


if __name__ == "__main__":
    main()
