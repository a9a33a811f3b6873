"""From a step's device outputs to a trace record, written behind the device.

The recorder holds a step's outputs on device and copies them to the host only once they are
ready (up to MAX_PENDING steps later; then it waits for the oldest), so the host never waits on
a running step to record it: on a CPU backend that wait cost 2-5% of a 62 ms step (it competes
with the step for the cores; bench/overhead.py's "api" section, 2026-12-01). Only process 0
writes; every process contributes its slice of the per-example hashes, so the record holds what
each host really fed, in global order. On several hosts the hashes arrive as a gather still
running on device (replay/record/gather.py): such a record is read no earlier than the next
step's `record` call, i.e. after the next step was dispatched, and only once the gather is
ready. A crash loses the records not yet written (at most MAX_PENDING + 1 steps), which a resume
re-records from its checkpoint.

One recording path: `run.step` (replay/record/step.py) and the trainer (trainer/loop.py) both
hand their step's metrics to `Recorder.record`. Cost: at most MAX_PENDING records held, O(1) in
the run's length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

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


@dataclass
class Pending:
    step: int
    metrics: dict  # device arrays, not yet fetched
    example_hashes: np.ndarray | GatheredHashes  # global order; on several hosts still being gathered

    def ready(self) -> bool:
        return hashes_ready(self.example_hashes) and _ready(self.metrics)


class Recorder:
    """Writes records behind the device. `writer` is None on processes other than 0.

    A record is fetched only once its buffers are ready, so the host does not wait on a step
    still running (on a CPU backend that wait competes with the step for the cores). Records are
    written in step order; at most MAX_PENDING wait (then the oldest is waited for), and
    `flush()` writes them all (before a checkpoint, at the end)."""

    MAX_PENDING = 4  # records held on device at most: bounds how far the host runs ahead

    def __init__(self, schema: Schema, writer: TraceWriter | None, level: str, timeline: Timeline | None = None):
        self.schema = schema
        self.writer = writer
        self.level = level
        self.timeline = timeline  # debug: when each step was dispatched, gathered, written
        self._queue: list[Pending] = []
        self.last: StepRecord | None = None  # the newest record written (for progress display)
        self.rewritten = 0  # steps that were already in the trace and re-recorded bit-identically

    def record(self, step: int, metrics: dict, example_hashes: np.ndarray | GatheredHashes) -> None:
        """Queues step `step`'s record (called right after the step was dispatched) and writes
        those of earlier steps that are ready."""
        if self.timeline is not None:
            self.timeline.mark("dispatched", step)
            self.timeline.watch(step, metrics)
        if self.level == "off":
            return
        self._queue.append(Pending(step, metrics, example_hashes))
        # A gather still in flight is never read in the call that queued it: step k's hashes reach
        # the host after step k+1 was dispatched, by construction rather than by timing.
        newest_waits = isinstance(example_hashes, GatheredHashes)
        while self._queue and (len(self._queue) > self.MAX_PENDING or (
                self._queue[0].ready() and not (newest_waits and len(self._queue) == 1))):
            self._write(self._queue.pop(0))

    def flush(self) -> None:
        while self._queue:
            self._write(self._queue.pop(0))

    def _write(self, pending: Pending) -> None:
        hashes = pending.example_hashes
        if isinstance(hashes, GatheredHashes):
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
    return all(x.is_ready() for x in jax.tree.leaves(tree) if hasattr(x, "is_ready"))
