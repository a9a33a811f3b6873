"""Reading the in-training re-run check (check.rerun_every=N) back from a trace.

A checked step records "check/rerun" tensors (trainer/sdc.py, traces/FORMAT.md "SDC checks"):
RMS 1.0, and a 64-bit mask per 64 microbatches of those whose gradient fingerprints differed
between the step and its re-run with the work rotated by check.rotate devices. Microbatch i was
computed by owner(i) in the step and by executor(i) in the re-run. The devices named bad
(`_bad_devices`) are the fewest that explain every differing microbatch, each explaining two or
more: a device that computed wrongly both times, a bad chip. A single differing microbatch is one of
its two devices (a transient fault): `replay verify` tells which.

`describe` reads one record; `scan` streams the records it is given (callers pass a range; the
column of one tensor at a million steps is 8 MB, so a whole-run scan belongs to a column reader).
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from replay.verify.names import mask_microbatches
from traces.schema import check_tensors  # noqa: F401  (its callers read it from here too)
from replay.verify.classify import executor, owner
from traces import columns
from traces.schema import StepRecord


def describe(manifest: dict, schema, record) -> dict | None:
    """{"step", "checked", "microbatches", "bad_devices", "pairs", "line"} of one record, None
    without a check (or a record without tensors: trace.layer_every skipped it)."""
    where = check_tensors(schema)
    if not where or record.fingerprints is None:
        return None
    def section(d: object, key: str) -> dict:  # a user loop's config (or manifest) need not have the trainer's
        value = d.get(key) if isinstance(d, dict) else None
        return value if isinstance(value, dict) else {}

    m = _count(section(section(manifest, "config"), "mesh").get("n_microbatches"))
    n = _count(section(manifest, "mesh").get("devices"))
    rotate = _count(section(section(manifest, "config"), "check").get("rotate")) % n
    checked = bool(record.rms[where[0]] == 1.0)
    mbs = mask_microbatches([int(record.fingerprints[i]) for i in where])
    pairs = [(i, owner(i, n, m), executor(i, n, m, rotate)) for i in mbs]
    bad = _bad_devices([(a, b) for _, a, b in pairs])
    if not checked:
        line = "not re-run"
    elif not mbs:
        line = "re-run on rotated devices: every microbatch agreed"
    else:
        line = (f"re-run disagreed on microbatch(es) {', '.join(map(str, mbs))}: "
                + (f"device(s) {', '.join(map(str, bad))} computed wrongly (a bad chip)" if bad else
                   "one of devices " + " / ".join(f"{a} or {b}" for _, a, b in pairs) + " (run `replay verify`)"))
    return {"step": record.step, "checked": checked, "microbatches": mbs, "bad_devices": bad,
            "pairs": [{"microbatch": i, "step_device": a, "rerun_device": b} for i, a, b in pairs], "line": line}


def _count(value: object) -> int:
    """A positive count from the manifest, 1 when it records none (or none that is one)."""
    return value if type(value) is int and value >= 1 else 1


def _bad_devices(pairs: list[tuple[int, int]]) -> list[int]:
    """The devices that explain the differing microbatches, (step device, re-run device) each: greedily
    the one in the most unexplained microbatches, while it is in two or more. Counting every device
    in two would also name a bad chip's neighbours once a device computes several microbatches (chip
    d is in all four of its differing microbatches, d - 1 and d + 1 in two each)."""
    left, bad = list(pairs), []
    while left:
        counts = Counter(d for pair in left for d in set(pair))
        device, hits = min(counts.items(), key=lambda kv: (-kv[1], kv[0]))
        if hits < 2:
            break
        bad.append(device)
        left = [pair for pair in left if device not in pair]
    return sorted(bad)


def scan(manifest: dict, schema, records) -> list[dict]:
    """The checked steps whose re-run disagreed, in step order, from `records` (an iterable)."""
    out = []
    for rec in records:
        d = describe(manifest, schema, rec)
        if d is not None and d["microbatches"]:
            out.append(d)
    return out


def scan_run(run, start: int | None = None, stop: int | None = None) -> list[dict]:
    """`scan` over steps start..stop-1 of `run`, streamed by traces.columns in bounded memory: it
    decodes the fingerprint columns of every record in the range (at a million steps, the whole
    trace's tensor columns once: give `show` a range, or read the disagreeing steps it lists)."""
    where = check_tensors(run.schema)
    if not where:
        return []
    out = []
    for first, fps, rms, layer in columns.fingerprints(run.trace, start, stop):
        hit = np.flatnonzero(layer & (rms[:, where[0]] == 1.0) & np.any(fps[:, where] != 0, axis=1))
        for j in hit:
            rec = StepRecord(int(first + j), np.zeros(0, np.uint32), 0, np.zeros(0, np.uint64), np.zeros(0),
                             fingerprints=fps[j], rms=rms[j])
            out.append(describe(run.manifest, run.schema, rec))
    return out
