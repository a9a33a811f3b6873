"""From a step's device outputs to a trace record, written behind the device.

The recorder holds a step's outputs on device and copies them to the host only once they are
ready (WRITE_BATCH at a time; with more than MAX_HELD held it waits for the oldest), so the host
never waits on a running step to record it: on a CPU backend that wait cost 2-5% of a 62 ms step
(it competes with the step for the cores; bench/overhead.py's "api" section, 2026-12-01). Only process 0
writes; every process contributes its slice of the per-example hashes, so the record holds what
each host really fed, in global order. On several hosts the hashes arrive as a gather still
running on device (replay/record/gather.py): such a record is read no earlier than the next
step's `record` call, i.e. after the next step was dispatched, and only once the gather is
ready. A kill loses the records not yet written (at most MAX_HELD + 1 steps), which a resume
re-records from its checkpoint; a program that exits without finishing the run (an uncaught
exception, Ctrl-C) writes them at exit (replay/record/at_exit.py).

One recording path: `run.step` (replay/record/step.py) and the trainer (trainer/loop.py) both
hand their step's metrics to `Recorder.record`. Cost: at most MAX_HELD records held, O(1) in
the run's length.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from replay.record.deferred_hashes import DeferredHashes
from replay.record.gather import GatheredHashes, Timeline, hashes_ready
from replay.record.hashing import batch_hash
from replay.record.packed import PackedRecord
from traces import Schema, StepRecord, TraceWriter


def lanes_to_uint64(lanes_Tx2: np.ndarray) -> np.ndarray:
    lanes = np.asarray(lanes_Tx2, np.uint32).astype(np.uint64)
    return (lanes[:, 0] << np.uint64(32)) | lanes[:, 1]


class RecordSchemaError(ValueError):
    """A step's outputs do not fit the run's schema (tensor names, order or count): exit 2."""


def _tensors(schema: Schema, step: int, metrics: dict, key: str) -> np.ndarray:
    """metrics[key] ("fingerprints" or "rms") in schema order, checked against the schema's tensor
    names: given as {name: value}, the names must be the schema's; given as an array in schema
    order, its length must be, and "tensor_names" (when the step says which tensors it measured)
    must be the schema's names in the schema's order. A count alone cannot tell two tensors
    swapped, or a renamed one, from the schema: their fingerprints would be filed under the
    wrong names and every later comparison would blame the wrong layer."""
    value = metrics[key]
    if isinstance(value, dict):  # by name (a jitted step's dict outputs come back sorted by key)
        names = schema.tensor_names
        missing = [n for n in names if n not in value]
        extra = [str(n) for n in value if n not in names]
        if missing or extra:
            raise RecordSchemaError(
                f"step {step}: the step's {key} name tensors the schema does not ({', '.join(extra[:4]) or 'none'}) "
                f"or lack some it does ({', '.join(missing[:4]) or 'none'}); record exactly the schema's tensors")
        return np.stack([np.asarray(value[n]) for n in names]) if names else np.zeros((0,), np.float32)
    # The names are built only to check given ones: run.step's records give none, and building a
    # schema's hundreds of names every step cost more than the rest of the record.
    given = metrics.get("tensor_names")
    if given is not None:
        names = schema.tensor_names
        given = tuple(str(n) for n in given)
        if given != names:
            at = next((i for i, (g, n) in enumerate(zip(given, names)) if g != n), min(len(given), len(names)))
            got = given[at] if at < len(given) else "nothing"
            want = names[at] if at < len(names) else "nothing"
            raise RecordSchemaError(
                f"step {step}: the step's tensors are not the schema's: at position {at} it measured {got!r} where "
                f"the schema has {want!r} ({len(given)} tensors, schema {len(names)}); measure them in the schema's order")
    arr = np.asarray(value)
    count = len(schema.tensors)
    if arr.ndim == 0 or arr.shape[0] != count:
        n = 0 if arr.ndim == 0 else arr.shape[0]
        raise RecordSchemaError(f"step {step}: the step returned {n} {key} for the schema's {count} tensors; "
                                "measure exactly the schema's tensors, in its order")
    return arr


def to_record(schema: Schema, step: int, metrics: dict, example_hashes: np.ndarray) -> StepRecord:
    """A host-side record from a step's metrics (already device_get) and global example hashes.

    `metrics` holds every schema metric by name, "rng", "example_<name>" (float32[batch]) for
    each of the schema's example_metrics, and "fingerprints"/"rms" for a layer-level record:
    arrays in schema order (with "tensor_names", the names measured, checked against the
    schema), or {tensor name: value} dicts. A record that does not fit raises RecordSchemaError.
    """
    example_hashes = np.asarray(example_hashes, np.uint64)  # a multi-host gather (gather.py) reads here
    if isinstance(metrics, PackedRecord) and isinstance(metrics.words, np.ndarray):
        plan = _packed_plan(metrics.layout, schema.metric_names, schema.example_metrics)
        if plan is not None:
            return _from_packed(schema, step, metrics.words, plan, example_hashes)
    layer = "fingerprints" in metrics
    if layer:
        metrics = {**metrics, "fingerprints": _tensors(schema, step, metrics, "fingerprints"),
                   "rms": _tensors(schema, step, metrics, "rms")}
    return StepRecord(
        step=step,
        rng=np.asarray(metrics["rng"], np.uint32),
        batch_hash=batch_hash(example_hashes),
        example_hashes=np.asarray(example_hashes, np.uint64),
        metrics=np.array([np.asarray(metrics[name], np.float32) for name in schema.metric_names], np.float32),
        fingerprints=lanes_to_uint64(metrics["fingerprints"]) if layer else None,
        rms=np.asarray(metrics["rms"], np.float32) if layer else None,
        sketches=np.asarray(metrics["sketches"], np.float32) if layer and "sketches" in metrics else None,
        norms=np.asarray(metrics["norms"], np.float32) if layer and "sketches" in metrics else None,
        example_metrics=np.stack([np.asarray(metrics[f"example_{name}"], np.float32) for name in schema.example_metrics])
        if schema.example_metrics else None,
    )


@functools.lru_cache(maxsize=64)
def _packed_plan(layout: tuple, metric_names: tuple, example_metrics: tuple) -> dict | None:
    """{field: (start, stop, shape)} of a record packed as run.step packs it (replay/record/packed.py):
    the schema's metrics as consecutive float32 scalars in schema order, its example metrics as
    consecutive float32 [B] vectors, "rng" uint32, and at the layer level "fingerprints" uint32
    [T, 2] and "rms" (and "sketches", "norms") float32. None for any other layout (then to_record
    reads the values by name). Once per recorded program: a record then costs slices of one vector,
    not a lookup and a copy per value (measured at the optax example's ~1 ms step: 11.3 -> 6.6 us
    a record at the step level, 19.3 -> 9.9 us at the layer level, on the loop's thread)."""
    at, fields = 0, {}
    for key, shape, dtype in layout:
        n = int(np.prod(shape, dtype=np.int64))
        fields[key] = (at, at + n, tuple(shape), dtype)
        at += n
    want = {"rng": "uint32", "fingerprints": "uint32", "rms": "float32", "sketches": "float32", "norms": "float32"}
    if any(k in fields and fields[k][3] != d for k, d in want.items()) or "rng" not in fields:
        return None
    names = [*metric_names, *(f"example_{n}" for n in example_metrics)]
    if any(n not in fields or fields[n][3] != "float32" for n in names) or set(fields) - set(names) - set(want):
        return None
    plan = {k: fields[k][:3] for k in want if k in fields}
    for group, keys in (("metrics", list(metric_names)), ("example_metrics", [f"example_{n}" for n in example_metrics])):
        spans = [fields[k] for k in keys]
        if not spans:
            continue
        if any(b[0] != a[1] for a, b in zip(spans, spans[1:])) or len({s[2] for s in spans}) != 1:
            return None  # not consecutive, or of different shapes: read by name
        plan[group] = (spans[0][0], spans[-1][1], (len(spans), *spans[0][2]))
    return plan


def _from_packed(schema: Schema, step: int, words: np.ndarray, plan: dict, example_hashes: np.ndarray) -> StepRecord:
    """to_record of a host PackedRecord, by `_packed_plan`'s slices (views of the one vector)."""
    def part(key: str, dtype: type) -> np.ndarray | None:
        if key not in plan:
            return None
        a, b, shape = plan[key]
        return words[a:b].view(dtype).reshape(shape)

    fingerprints = part("fingerprints", np.uint32)
    if fingerprints is not None:
        count = len(schema.tensors)
        if fingerprints.shape[0] != count or "rms" not in plan or plan["rms"][2] != (count,):
            raise RecordSchemaError(f"step {step}: the step returned {fingerprints.shape[0]} fingerprints for the "
                                    f"schema's {count} tensors; measure exactly the schema's tensors, in its order")
        fingerprints = lanes_to_uint64(fingerprints)
    metrics = part("metrics", np.float32)
    sketched = fingerprints is not None and "sketches" in plan
    return StepRecord(
        step=step, rng=part("rng", np.uint32), batch_hash=batch_hash(example_hashes), example_hashes=example_hashes,
        metrics=metrics if metrics is not None else np.zeros((0,), np.float32),
        fingerprints=fingerprints, rms=part("rms", np.float32) if fingerprints is not None else None,
        sketches=part("sketches", np.float32) if sketched else None,
        norms=part("norms", np.float32) if sketched else None,
        example_metrics=part("example_metrics", np.float32))


@dataclass
class Pending:
    step: int
    metrics: dict  # device arrays, not yet fetched
    example_hashes: np.ndarray | GatheredHashes | DeferredHashes  # global order; still being gathered, or a device batch

    def ready(self) -> bool:
        return hashes_ready(self.example_hashes) and _ready(self.metrics)


class Recorder:
    """Writes records behind the device. `writer` is None on processes other than 0.

    A record is fetched only once its buffers are ready, so the host does not wait on a step
    still running (on a CPU backend that wait competes with the step for the cores). Records are
    written in step order, WRITE_BATCH at a time once that many are ready: the fetch, encode,
    compress and write path then runs warm on the loop's thread for all but the first of them
    (one at a time, each step ran it cold: ~120 us of the loop's CPU a step at the optax
    example's ~1 ms step, ~40 with 8 together; bench.record_overhead). At most MAX_HELD are held
    (then the oldest WRITE_BATCH are waited for), and `flush()` writes them all (before a
    checkpoint, at the end)."""

    WRITE_BATCH = 8  # ready records written together
    MAX_PENDING = 4  # records still running held beyond a batch: how far the host may run ahead of it
    MAX_HELD = WRITE_BATCH + MAX_PENDING  # records held at most (what a kill -9 loses, with the step dispatching)

    def __init__(self, schema: Schema, writer: TraceWriter | None, level: str, timeline: Timeline | None = None):
        self.schema = schema
        self.writer = writer
        self.level = level
        self.timeline = timeline  # debug: when each step was dispatched, gathered, written
        self._queue: list[Pending] = []
        self.last: StepRecord | None = None  # the newest record written (for progress display)
        self.rewritten = 0  # steps that were already in the trace and re-recorded bit-identically

    def record(self, step: int, metrics: dict, example_hashes: np.ndarray | GatheredHashes | DeferredHashes) -> None:
        """Queues step `step`'s record (called right after the step was dispatched) and writes
        those of earlier steps that are ready."""
        if self.timeline is not None:
            self.timeline.mark("dispatched", step)
            self.timeline.watch(step, metrics)
        if self.level == "off":
            return
        queue = self._queue
        queue.append(Pending(step, metrics, example_hashes))
        if isinstance(example_hashes, DeferredHashes):
            self._settle()
        # The newest record is never in the batch written (more than WRITE_BATCH are held), so a
        # gather still in flight is never read in the call that queued it: step k's hashes reach
        # the host after step k+1 was dispatched, by construction rather than by timing. Steps
        # finish in the order they were dispatched, so the batch's newest being ready says the
        # rest are (on several devices, an older one may still be waited for a moment).
        if len(queue) > self.MAX_HELD or (len(queue) > self.WRITE_BATCH and queue[self.WRITE_BATCH - 1].ready()):
            for _ in range(self.WRITE_BATCH):
                self._write_oldest()

    def _settle(self) -> None:
        """Hashes the device batches of earlier steps that are ready, oldest first, without waiting:
        their buffers are released about a step after their step, not when the record is written."""
        for pending in self._queue[:-1]:
            hashes = pending.example_hashes
            if isinstance(hashes, DeferredHashes) and not hashes.fetched:
                if not hashes.is_ready():
                    return
                hashes.fetch()

    @property
    def held(self) -> int:
        """Records queued and not yet written (what a crash now would lose)."""
        return len(self._queue)

    def flush(self) -> None:
        while self._queue:
            self._write_oldest()

    def _write_oldest(self) -> None:
        # Dequeued once written: a Ctrl-C in the fetch (where the loop's thread waits) leaves the
        # record queued, so the close that follows writes it, and the ones after it without a gap
        # (a popped, unwritten record made the writer refuse every later one: all of them lost).
        self._write(self._queue[0])
        self._queue.pop(0)

    def _write(self, pending: Pending) -> None:
        hashes = pending.example_hashes
        if isinstance(hashes, DeferredHashes):
            hashes = hashes.fetch()
        elif isinstance(hashes, GatheredHashes):
            hashes = hashes.fetch()
            if self.timeline is not None:
                self.timeline.mark("gathered", pending.step)
        host = _fetch(pending.metrics)
        rec = to_record(self.schema, pending.step, host, np.asarray(hashes, np.uint64))
        if self.writer is not None and not self.writer.append(rec):
            self.rewritten += 1
        if self.timeline is not None:
            self.timeline.mark("written", pending.step)
        self.last = rec


def _fetch(metrics: Any) -> Any:
    """The record on the host: a PackedRecord's one vector copied directly (jax.device_get's tree
    walk cost more than the copy of this one small buffer), anything else by jax.device_get."""
    if isinstance(metrics, PackedRecord) and isinstance(metrics.words, jax.Array):
        return PackedRecord(np.asarray(metrics.words), metrics.layout)
    return jax.device_get(metrics)


def _ready(tree) -> bool:
    if isinstance(tree, PackedRecord) and isinstance(tree.words, jax.Array):  # run.step's record: one buffer
        return tree.words.is_ready()
    return all(x.is_ready() for x in jax.tree.leaves(tree) if hasattr(x, "is_ready"))
