"""Real-run scale (issue 12): `show`, `audit`, `spike` and `bisect` on step-level traces of
growing length, timed and measured each in its own process, fitted, extrapolated to 1.4M steps.

For each size a run A is written (1,024 example hashes and per-example losses a step, the
trainer's step-level record, ~12 KB a step; one epoch of a declared dataset), and two runs
that part from it late (at 90% of the run): B_metric (the loss one part in 1000 higher from
there) and B_data (from there half of every batch is data fed before, as when a contiguous
per-host sampler resumes on twice the hosts). B's segments before the divergence are hard
links to A's, as a copied run's would be bytes equal. Each command runs in a fresh process
(`python -m replay.cli.app ...`); its wall seconds, peak RSS and what it read from the disk
(getrusage of the child, in a wrapper process of its own: ru_inblock, so what the page cache
served is not counted) are recorded, with the CLI's start-up (`replay show --help`)
measured apart.
Free disk is checked first; everything is removed after each size (unless --keep).

The page cache decides what these numbers mean, so each size reports its footprint on disk
(hard links once), MemAvailable, whether the footprint fits, and for each command the share
of its files resident just before it ran (fincore), its CPU seconds beside the wall seconds
and the load average (on a shared machine the wall seconds include waiting for a core).
`--cache warm` (default) reads each command's files just before it; `--cache cold` evicts them
(posix_fadvise DONTNEED, no root needed), so the command reads from disk.

At these sizes the unsealed tail (848, 2544, 5536 records) still grows with the run; it is
read whole on opening and its buffers saturate at one segment, so peak RSS fits overstate.

Index bytes per example (the `.idx` files over the examples recorded) are reported a size, the
budget (issue 34: 4 bytes beyond the record) beside them. A run's sealed segments are compacted
(traces/compaction.py): their records hold no example hashes, which the index holds instead, so
what the index adds beyond the record is its size less what the records no longer hold. That is
measured, not assumed: the first compacted segment's records are compressed again with their
hashes put back, as an uncompacted segment holds them (`record_bytes_saved_per_example`), and
`index_bytes_beyond_record_per_example` is index bytes per indexed example less that. Once per invocation a run whose whole
trace is one full unsealed tail (`--tail-records`, a segment less one by default) is written and
`show` timed on it, from the same cache state, with the tail's sidecar (traces/sidecar.py) and
without it (set aside: how every run opened before sidecars): `full_tail` in the last line.

Prints one JSON line a size, then one JSON object on the last line: per command the seconds
and peak RSS at each size, the fitted growth exponent of (seconds - start-up) against steps,
the seconds and RSS extrapolated to 1.4M steps, and the budgets beside them (issue 12's; issue 34's
as budget_34_* and within_budget_34, for the commands it names). Commands under 5 s
run 3 times (the median run is reported); where a command's own part is within noise of the
start-up at some size, it is extrapolated by a straight line instead of the power law (`fit`).
The packages are byte-compiled first, as an installed package is (`byte_compiled` says whether
they could be): with PYTHONDONTWRITEBYTECODE set, a checkout's modules were compiled from source
in every command's process.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench._synthetic import batch_hash, epoch_hashes, scale_records, scale_schema
from traces import Run, compaction
from traces.segment import COMPACT_VERSION, _compressor, _decompressor
from traces.index import index_path
from traces.sidecar import SIDECAR_SUFFIX
from traces.trace import DEFAULT_SEGMENT_RECORDS

SIZES = (50_000, 150_000, 350_000)
TARGET_STEPS = 1_400_000
REPEATS, REPEAT_BELOW_S = 3, 5.0  # commands under 5 s run 3 times, the median reported (measure)
RESOLUTION_S, RESOLUTION_MB = 0.05, 5.0  # below these a command's own part is noise (fit)
EXAMPLES = 1024
# command -> (seconds at 1.4M steps, peak RSS MB), issue 12's budgets on this machine
BUDGETS = {"show": (1.0, 1024), "audit": (120.0, 2048), "spike": (10.0, 1024), "bisect_metric": (5.0, 1024),
           "bisect_data": (5.0, 1024)}
# issue 34's tighter ones (audit from a cold cache: run with --cache cold); it names no bisect of a metric
BUDGETS_34 = {"show": (1.0, 512), "audit": (30.0, 512), "spike": (1.0, 512), "bisect_data": (2.0, 512)}
DIVERGE_AT = 0.9
INDEX_BUDGET_BYTES_PER_EXAMPLE = 4.0  # issue 34: the per-example index beyond the record
_WRAPPER = r"""
import json, resource, subprocess, sys, time
t = time.perf_counter()
with open(sys.argv[1], "wb") as out:
    r = subprocess.run(sys.argv[2:], stdout=out, stderr=subprocess.PIPE)
seconds = time.perf_counter() - t
use = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"seconds": seconds, "cpu_seconds": use.ru_utime + use.ru_stime, "peak_rss_mb": use.ru_maxrss / 1024,
                  "disk_read_mb": use.ru_inblock * 512 / 1e6,
                  "exit_code": r.returncode, "stderr": r.stderr.decode(errors="replace")[-400:]}))
"""


def measure(args: list[str], stdout: Path, repeats: int = 1, before=None) -> dict:
    """Seconds and peak RSS of one command in a fresh process (its stdout kept in `stdout`).

    A command that takes under REPEAT_BELOW_S runs `repeats` times and the run of median seconds
    is reported: at a fraction of a second, one run's wall time is mostly when the shared cores
    were free, and the fits below extrapolate it four-fold. `before()` runs before each run (a
    cold-cache measurement evicts the command's files again, so every run reads them from disk)."""
    runs = []
    for _ in range(repeats):
        if before is not None:
            before()
        done = subprocess.run([sys.executable, "-c", _WRAPPER, str(stdout), *args], capture_output=True, text=True,
                              check=True)
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        if runs[0]["seconds"] >= REPEAT_BELOW_S:
            break
    return sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2]


def byte_compile() -> bool:
    """Byte-compiles the packages the commands import, as installing them does, so each command's
    process reads bytecode. A checkout imported with PYTHONDONTWRITEBYTECODE set (this machine)
    compiled every module from source in every process: ~0.25 s of each command's start-up here
    (0.58-0.69 against 0.35 s). False when a package folder is not writable (then as it is)."""
    import compileall
    import importlib.util

    done = True
    for name in ("replay", "traces", "trainer"):
        spec = importlib.util.find_spec(name)
        for folder in (spec.submodule_search_locations or []) if spec else []:
            try:
                done = bool(compileall.compile_dir(folder, quiet=2)) and done
            except OSError:
                done = False
    return done


def replay_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "replay.cli.app", *args]


def run_bytes(steps: int, examples: int) -> int:
    return steps * (26 * examples + 200)  # records (~12 B an example), index table (12 B) and filter (1.6 B)


def meminfo(field: str) -> int | None:
    """A field of /proc/meminfo, bytes."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def mem_available() -> int | None:
    """MemAvailable (what the page cache can hold besides what runs), bytes."""
    return meminfo("MemAvailable")


def files_of(*runs: Path) -> list[Path]:
    """The runs' trace files, a hard-linked file (B's shared segments) once."""
    by_inode = {}
    for r in runs:
        for p in sorted((r / "trace").iterdir()):
            if p.is_file():
                by_inode.setdefault(p.stat().st_ino, p)
    return sorted(by_inode.values())


def resident(paths: list[Path]) -> float | None:
    """The share of the files' bytes in the page cache now (util-linux fincore), None without it."""
    if not paths or not shutil.which("fincore"):
        return None
    done = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "-o", "RES,SIZE", *map(str, paths)],
                          capture_output=True, text=True)
    rows = [line.split() for line in done.stdout.splitlines() if len(line.split()) == 2]
    size = sum(int(b) for _, b in rows)
    return round(sum(int(a) for a, _ in rows) / size, 3) if size else None


def drop_cache(paths: list[Path]) -> None:
    """Evicts the files' pages from the page cache (posix_fadvise DONTNEED: no root needed for
    files one can open; dirty pages are written first)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm(paths: list[Path]) -> None:
    """Reads the files once, so a command finds them in the page cache if they fit."""
    for p in paths:
        with open(p, "rb") as f:
            while f.read(1 << 24):
                pass


def write_run(path: Path, schema, steps: int, n_examples: int, start: int | None = None, change=None) -> float:
    """Writes a run, or continues one from `start`; returns the seconds it took."""
    t = time.perf_counter()
    run = Run.create(path, schema, {"config": {"synthetic": "bench.scale", "steps": steps}, "dataset_size": n_examples}) \
        if start is None else Run.resume(path)
    writer = run.writer()
    for rec in scale_records(schema, start or 0, steps, n_examples):
        writer.append(change(rec) if change else rec)
    run.finish()
    return time.perf_counter() - t


def fork_run(a: Path, b: Path, schema, steps: int, n_examples: int, diverge: int, change) -> float:
    """B: A's sealed segments wholly before `diverge` hard-linked, the rest written with `change`."""
    Run.create(b, schema, {"config": {"synthetic": "bench.scale", "steps": steps}, "dataset_size": n_examples}).close()
    trace = Run.open(a).trace
    start = 0
    for seg in trace.segments:
        if not seg.sealed or seg.first_step + seg.count > diverge:
            break
        os.link(seg.path, b / "trace" / seg.path.name)
        if index_path(seg.path).exists():
            os.link(index_path(seg.path), b / "trace" / index_path(seg.path).name)
        start = seg.first_step + seg.count
    (b / "INCOMPLETE").touch()
    return write_run(b, schema, steps, n_examples, start, change)


def hashes_in_records(run: Path) -> float | None:
    """Bytes an example that the first compacted segment's records would hold more with their example
    hashes in them: each record compressed again with its hashes put back (as an uncompacted
    segment's record holds them), less the frame it is. None without a compacted segment."""
    trace = Run.open(run).trace
    at = next((i for i, seg in enumerate(trace.segments) if seg.version >= COMPACT_VERSION), None)
    if at is None:
        return None
    seg, cctx, dctx = trace.segments[at], _compressor(), _decompressor()
    rows = trace.segment_hashes(at, 0, seg.count)
    more = 0
    for k in range(seg.count):
        body = trace.raw_frame(seg.first_step + k)
        more += len(cctx.compress(compaction.splice(trace.schema, dctx.decompress(body), rows[k]))) - len(body)
    return round(more / (seg.count * trace.schema.examples_per_step), 3)


def bench_size(root: Path, steps: int, examples: int, cache: str = "warm", repeats: int = REPEATS) -> dict:
    schema = scale_schema(examples)
    n_examples = steps * examples  # one epoch over the run
    diverge = int(steps * DIVERGE_AT)
    a, b_metric, b_data = root / "A", root / "B_metric", root / "B_data"
    written = {"A": write_run(a, schema, steps, n_examples)}

    def louder(rec):
        if rec.step >= diverge:
            m = rec.metrics.copy()
            m[0] *= np.float32(1.001)
            return dataclasses.replace(rec, metrics=m)
        return rec

    def resampled(rec):
        if rec.step < diverge:
            return rec
        row = rec.example_hashes.copy()
        back = rec.step - diverge + max(0, diverge - 1000)  # steps fed a thousand steps before the resume, again
        slots = back * examples + np.arange(examples // 2)
        row[: examples // 2] = epoch_hashes(slots, n_examples)
        return dataclasses.replace(rec, example_hashes=row, batch_hash=batch_hash(row))

    written["B_metric"] = fork_run(a, b_metric, schema, steps, n_examples, diverge, louder)
    written["B_data"] = fork_run(a, b_data, schema, steps, n_examples, diverge, resampled)
    commands = {
        "show": replay_cmd("show", str(a)),
        "audit": replay_cmd("audit", str(a), "--json"),
        "spike": replay_cmd("spike", str(a), "--json"),
        "bisect_metric": replay_cmd("bisect", str(a), str(b_metric), "--no-refine", "--json"),
        "bisect_data": replay_cmd("bisect", str(a), str(b_data), "--no-refine", "--json"),
    }
    reads = {"show": [a], "audit": [a], "spike": [a], "bisect_metric": [a, b_metric], "bisect_data": [a, b_data]}
    footprint = sum(p.stat().st_size for p in files_of(a, b_metric, b_data))  # hard links counted once
    available = mem_available()
    out: dict = {"steps": steps, "examples_per_step": examples, "diverge_at": diverge,
                 "trace_gb": round(sum(p.stat().st_size for p in (a / "trace").glob("*.seg")) / 1e9, 3),
                 "index_gb": round(sum(p.stat().st_size for p in (a / "trace").glob("*.idx")) / 1e9, 3),
                 "index_bytes_per_example": round(sum(p.stat().st_size for p in (a / "trace").glob("*.idx"))
                                                  / (steps * examples), 2),
                 # over the examples of sealed segments only (the tail has no index yet): what the budget is for
                 "index_bytes_per_indexed_example": round(
                     sum(p.stat().st_size for p in (a / "trace").glob("*.idx"))
                     / max(1, examples * sum(s.count for s in Run.open(a).trace.segments if s.sealed)), 2),
                 "record_bytes_saved_per_example": hashes_in_records(a),
                 "index_budget_bytes_per_example": INDEX_BUDGET_BYTES_PER_EXAMPLE,
                 "footprint_gb": round(footprint / 1e9, 3),
                 "mem_available_gb": None if available is None else round(available / 1e9, 2),
                 "fits_in_page_cache": None if available is None else footprint < available,
                 "cache": cache, "write_seconds": {k: round(v, 1) for k, v in written.items()},
                 "commands": {}}
    # the three runs just written leave GBs dirty in the page cache; written back while a command
    # runs, they would compete with its reads (and its time would be the writer's, not its own)
    os.sync()
    for name, args in commands.items():
        paths = files_of(*reads[name])
        (drop_cache if cache == "cold" else warm)(paths)
        share = resident(paths)
        dirty = meminfo("Dirty")
        # cold: the files are evicted again before each repeat (a run finds none of the last one's reads)
        evict = (lambda: drop_cache(paths)) if cache == "cold" else None
        result = measure(args, root / f"{name}.out", repeats, before=evict)
        text = (root / f"{name}.out").read_text(errors="replace")
        row = {"seconds": round(result["seconds"], 3), "cpu_seconds": round(result["cpu_seconds"], 3),
               "load_average": round(os.getloadavg()[0], 1),
               "peak_rss_mb": round(result["peak_rss_mb"], 1), "disk_read_mb": round(result["disk_read_mb"], 1),
               "resident_before": share, "dirty_mb_before": None if dirty is None else round(dirty / 1e6, 1),
               "exit_code": result["exit_code"]}
        if name.startswith("bisect"):
            try:
                report = json.loads(text)
                row.update(found_step=report.get("first_step"), cause=report.get("cause"),
                           repeated_in_b=report.get("repeated_in_b"))
            except ValueError:
                row["stderr"] = result["stderr"]
        elif result["exit_code"] not in (0, 1):
            row["stderr"] = result["stderr"]
        out["commands"][name] = row
    return out


_OPEN = r"""
import sys, time
from traces import Run
t = time.perf_counter()
trace = Run.open(sys.argv[1]).trace
trace.columns(len(trace.segments) - 1)  # what show and compare read of the tail
print(time.perf_counter() - t)
"""


def bench_tail(root: Path, examples: int, records: int, cache: str, repeats: int) -> dict:
    """`show` of a run that is one unsealed tail of `records` records, with its sidecar and without."""
    schema = scale_schema(examples)
    path = root / "tail"
    write_run(path, schema, records, records * examples)
    [seg] = (path / "trace").glob("*.seg")
    tix = seg.with_suffix(SIDECAR_SUFFIX)
    out = {"tail_records": records, "examples_per_step": examples, "tail_mb": round(seg.stat().st_size / 1e6, 1),
           "sidecar_mb": round(tix.stat().st_size / 1e6, 2) if tix.exists() else None, "cache": cache}
    for name in ("with_sidecar", "without_sidecar"):
        if name == "without_sidecar" and tix.exists():
            tix.rename(root / "set-aside.tix")
        paths = files_of(path)
        (drop_cache if cache == "cold" else warm)(paths)
        opened = measure([sys.executable, "-c", _OPEN, str(path)], root / "open.out", 1)
        (drop_cache if cache == "cold" else warm)(paths)
        result = measure(replay_cmd("show", str(path)), root / "show.out", repeats,
                         before=(lambda: drop_cache(paths)) if cache == "cold" else None)
        out[name] = {"open_seconds": round(float((root / "open.out").read_text()), 4),  # in process: Run.open, tail columns
                     "open_disk_read_mb": round(opened["disk_read_mb"], 1),
                     "show_seconds": round(result["seconds"], 3), "show_cpu_seconds": round(result["cpu_seconds"], 3),
                     "show_peak_rss_mb": round(result["peak_rss_mb"], 1), "show_disk_read_mb": round(result["disk_read_mb"], 1),
                     "exit_code": result["exit_code"], "load_average": round(os.getloadavg()[0], 1)}
    return out


def fit(sizes: list[int], values: list[float], startup: float, resolution: float) -> tuple[float | None, float | None]:
    """(exponent k of (value - start-up) = c * steps**k, the value extrapolated to TARGET_STEPS).

    The power law is fitted only where the command's own part (value - start-up) is above
    `resolution` at every size; below it that part is measurement noise (0.29 s vs a 0.31 s
    start-up gave an exponent of 2.6), so the value is extrapolated by a straight line through the
    sizes (start-up plus work proportional to the run), and the exponent is that of the part
    floored at the resolution."""
    if len(sizes) < 2:
        return None, None
    n, v = np.array(sizes, float), np.array(values, float)
    k, c = np.polyfit(np.log(n), np.log(np.maximum(v - startup, resolution)), 1)
    if np.min(v - startup) >= resolution:
        return float(k), float(startup + math.exp(c) * TARGET_STEPS ** k)
    slope, intercept = np.polyfit(n, v, 1)
    return float(k), float(intercept + max(slope, 0.0) * TARGET_STEPS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="steps of each size, comma separated")
    parser.add_argument("--examples", type=int, default=EXAMPLES, help="examples a step")
    parser.add_argument("--dir", default=None, help="where to write the runs (default: a temporary folder)")
    parser.add_argument("--keep", action="store_true", help="keep the runs")
    parser.add_argument("--cache", choices=("warm", "cold"), default="warm",
                        help="warm: each command's files are read just before it (in the page cache when they fit, "
                             "'resident_before' says how much); cold: evicted from it (posix_fadvise), so read from disk")
    parser.add_argument("--tail-records", type=int, default=DEFAULT_SEGMENT_RECORDS - 1,
                        help="records of the full-tail run whose opening is timed (0: skip it)")
    parser.add_argument("--repeats", type=int, default=REPEATS,
                        help=f"runs of a command under {REPEAT_BELOW_S:g} s, the median reported (1: the smoke test's)")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    sizes = sorted(int(s) for s in args.sizes.split(","))
    base = Path(args.dir) if args.dir else Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    need = int(run_bytes(max(sizes), args.examples) * (1 + 2 * (1 - DIVERGE_AT) + 0.4))  # A, two B tails, margin
    free = shutil.disk_usage(base).free
    if need > free - (2 << 30):
        raise SystemExit(f"error: the largest size needs ~{need / 1e9:.1f} GB on {base}, {free / 1e9:.1f} GB are free: "
                         "pass smaller --sizes or another --dir")
    compiled = byte_compile()
    startup = measure(replay_cmd("show", "--help"), base / "startup.out", args.repeats)  # the interpreter and the CLI
    (base / "startup.out").unlink(missing_ok=True)
    results = []
    for steps in sizes:
        root = Path(tempfile.mkdtemp(prefix=f"replay-scale-{steps}-", dir=base))
        try:
            result = bench_size(root, steps, args.examples, args.cache, args.repeats)
        finally:
            if not args.keep:
                shutil.rmtree(root, ignore_errors=True)
        results.append(result)
        print(json.dumps(result), flush=True)
    full_tail = None
    if args.tail_records > 0:
        root = Path(tempfile.mkdtemp(prefix="replay-scale-tail-", dir=base))
        try:
            full_tail = bench_tail(root, args.examples, args.tail_records, args.cache, args.repeats)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    summary = {}
    for name, (budget_s, budget_mb) in BUDGETS.items():
        secs = [r["commands"][name]["seconds"] for r in results]
        cpu = [r["commands"][name]["cpu_seconds"] for r in results]
        ck, cpu_target = fit(sizes, cpu, startup["cpu_seconds"], RESOLUTION_S)
        rss = [r["commands"][name]["peak_rss_mb"] for r in results]
        k, at_target = fit(sizes, secs, startup["seconds"], RESOLUTION_S)
        rk, rss_target = fit(sizes, rss, startup["peak_rss_mb"], RESOLUTION_MB)
        summary[name] = {
            "seconds": secs, "cpu_seconds": cpu, "resident_before": [r["commands"][name]["resident_before"] for r in results],
            "cpu_seconds_at_1.4M": None if cpu_target is None else round(cpu_target, 2),
            "exponent": None if k is None else round(k, 2),
            "seconds_at_1.4M": None if at_target is None else round(at_target, 2), "budget_seconds": budget_s,
            "rss_exponent": None if rk is None else round(rk, 2),
            "peak_rss_mb_at_1.4M": None if rss_target is None else round(rss_target, 1), "budget_rss_mb": budget_mb,
            "within_budget": None if at_target is None else bool(at_target <= budget_s and rss_target <= budget_mb),
            # the wall seconds wait for a core on a shared machine; CPU seconds do not (nor do they count the disk)
            "within_budget_cpu": None if cpu_target is None else bool(cpu_target <= budget_s and rss_target <= budget_mb),
        }
        if name in BUDGETS_34:
            s34, mb34 = BUDGETS_34[name]
            summary[name].update(budget_34_seconds=s34, budget_34_rss_mb=mb34, within_budget_34=None if at_target is None
                                 else bool(at_target <= s34 and rss_target <= mb34))
    beyond = {r["steps"]: None if r["record_bytes_saved_per_example"] is None else
              round(r["index_bytes_per_indexed_example"] - r["record_bytes_saved_per_example"], 2) for r in results}
    indexed = [b for b in beyond.values() if b is not None]  # sizes that sealed (and compacted) a segment
    target_gb, mem_gb = run_bytes(TARGET_STEPS, args.examples) / 1e9, _mem_total_gb()
    cache_note = None if mem_gb is None or target_gb < mem_gb else (
        f"a {TARGET_STEPS}-step run is ~{target_gb:.0f} GB on disk, more than this machine's {mem_gb} GB of memory: "
        "it cannot sit in the page cache, so a command that reads the whole run (audit) reads it from disk there, "
        "and the fits from cached sizes understate it; run with --cache cold for the disk-bound figures")
    print(json.dumps({"bench": "scale", "steps": sizes, "page_cache_note": cache_note, "examples_per_step": args.examples,
                      "target_steps": TARGET_STEPS, "startup_seconds": round(startup["seconds"], 3), "byte_compiled": compiled,
                      "startup_rss_mb": round(startup["peak_rss_mb"], 1), "cache": args.cache, "repeats": args.repeats,
                      "footprint_gb": {r["steps"]: r["footprint_gb"] for r in results},
                      "fits_in_page_cache": {r["steps"]: r["fits_in_page_cache"] for r in results},
                      "target_footprint_gb": round(run_bytes(TARGET_STEPS, args.examples) / 1e9, 1),
                      "mem_total_gb": _mem_total_gb(), "commands": summary,
                      "found": {r["steps"]: {n: [r["commands"][n].get("found_step"), r["commands"][n].get("cause")]
                                             for n in ("bisect_metric", "bisect_data")} for r in results},
                      "diverge_at": {r["steps"]: r["diverge_at"] for r in results},
                      "index_bytes_per_example": {r["steps"]: r["index_bytes_per_example"] for r in results},
                      "index_bytes_per_indexed_example": {r["steps"]: r["index_bytes_per_indexed_example"] for r in results},
                      "record_bytes_saved_per_example": {r["steps"]: r["record_bytes_saved_per_example"] for r in results},
                      "index_bytes_beyond_record_per_example": beyond,
                      "index_budget_bytes_per_example": INDEX_BUDGET_BYTES_PER_EXAMPLE,
                      # None when no size sealed a segment (no index yet: nothing measured)
                      "index_within_budget": None if not indexed else all(b <= INDEX_BUDGET_BYTES_PER_EXAMPLE for b in indexed),
                      "full_tail": full_tail}))


def _mem_total_gb() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9, 1)
    except (ValueError, OSError):
        return None


if __name__ == "__main__":
    main()
