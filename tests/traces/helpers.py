"""Deterministic synthetic records: record(step) is a pure function of (seed, step)."""

from __future__ import annotations

import numpy as np

from traces import Schema, StepRecord

EXAMPLES = 16

# The start of a `python -c` script that runs as if JAX and its libraries were not installed.
BLOCK_JAX = r"""
import sys
class NoJax:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("jax", "jaxlib", "flax", "optax", "orbax"):
            raise ImportError(f"{name} is blocked for this test")
sys.meta_path.insert(0, NoJax())
"""


def make_schema(layer: bool = True) -> Schema:
    tensors = (
        (("state/params", "state"), ("embed", "forward"), ("block_00", "forward"), ("logits", "forward"),
         ("grad/block_00", "backward"), ("grad/embed", "backward"), ("param/block_00", "update"), ("param/embed", "update"))
        if layer else ()
    )
    return Schema(
        examples_per_step=EXAMPLES,
        rng_words=2,
        metrics=(("loss", "loss"), ("grad_norm", "backward"), ("lr", "update"), ("param_norm", "update")),
        tensors=tensors,
        example_metrics=("loss",) if layer else (),
    )


def make_record(schema: Schema, step: int, seed: int = 0, layer_every: int = 3) -> StepRecord:
    rng = np.random.default_rng([seed, step])
    layer = bool(schema.tensors) and step % layer_every == 0
    n = len(schema.tensors)
    return StepRecord(
        step=step,
        rng=rng.integers(0, 2**32, schema.rng_words, dtype=np.uint32),
        batch_hash=int(rng.integers(0, 2**63)) * 2 + 1,
        example_hashes=rng.integers(0, 2**64 - 1, schema.examples_per_step, dtype=np.uint64, endpoint=True),
        metrics=rng.standard_normal(len(schema.metrics)).astype(np.float32),
        fingerprints=rng.integers(0, 2**64 - 1, n, dtype=np.uint64, endpoint=True) if layer else None,
        rms=rng.random(n).astype(np.float32) if layer else None,
        example_metrics=rng.random((len(schema.example_metrics), schema.examples_per_step)).astype(np.float32)
        if layer and schema.example_metrics else None,
    )


class BytesRead:
    """Bytes this process reads (read/pread syscalls: /proc/self/io rchar) while in the block.

    Counts every way of reading a file, so it bounds what a reader reads whatever its code;
    the trace reader reads with pread; only an index's example filter is memory-mapped
    (traces/filter.py: rchar does not see it), and only searches for examples use it.
    """

    def __enter__(self) -> "BytesRead":
        self.count, self._start = 0, self._rchar()
        return self

    def __exit__(self, *exc) -> None:
        self.count = self._rchar() - self._start

    @property
    def so_far(self) -> int:
        return self._rchar() - self._start

    @staticmethod
    def _rchar() -> int:
        with open("/proc/self/io") as f:  # read with one small read, counted the same at start and end
            return int(next(line for line in f if line.startswith("rchar:")).split()[1])


class FileReads:
    """Bytes read from each file of a trace while in the block, by file: every pread of a
    segment or index file (they all go through SegmentFile.read) and, for an index's memory-
    mapped example filter, 64 bytes a hash asked about (the one block it touches).

    Use it with pytest's monkeypatch: `FileReads(monkeypatch)`, then `reads.of(path)`."""

    def __init__(self, monkeypatch) -> None:
        from traces import index_file, segment

        self.bytes: dict[str, int] = {}
        self.filter_blocks: dict[str, int] = {}
        read, maybe = segment.SegmentFile.read, index_file.FileIndex.maybe

        def counted_read(f, offset: int, size: int) -> bytes:
            data = read(f, offset, size)
            self.bytes[str(f.path)] = self.bytes.get(str(f.path), 0) + len(data)
            return data

        def counted_maybe(index, queries):
            found = maybe(index, queries)
            if found is not None:
                self.filter_blocks[str(index.path)] = self.filter_blocks.get(str(index.path), 0) + len(queries)
            return found

        monkeypatch.setattr(segment.SegmentFile, "read", counted_read)
        monkeypatch.setattr(index_file.FileIndex, "maybe", counted_maybe)

    def of(self, path) -> int:
        """Bytes read from `path`, its filter's blocks included."""
        return self.bytes.get(str(path), 0) + 64 * self.filter_blocks.get(str(path), 0)


def sketched_record(step: int, tensors: list, loss: float, width: int) -> StepRecord:
    """A layer-level record of `tensors` (float32 arrays, the schema's order) with their distance
    sketches of `width`, as a sketched JAX or torch step records them (the cross-framework bisect's
    trace-only path): fingerprints, RMS, sketches and norms from the tensors themselves."""
    from traces.fingerprint import fingerprint
    from traces.sketch import sketch

    sk = [sketch(x, width) for x in tensors]
    return StepRecord(step=step, rng=np.array([step, 0], np.uint32), batch_hash=step + 1,
                      example_hashes=np.array([2 * step, 2 * step + 1], np.uint64),
                      metrics=np.array([loss], np.float32),
                      fingerprints=np.array([fingerprint(x) for x in tensors], np.uint64),
                      rms=np.array([np.sqrt(np.mean(x * x)) for x in tensors], np.float32),
                      sketches=np.stack([s for s, _ in sk]), norms=np.array([n for _, n in sk], np.float32))


def at_step_level(record: StepRecord) -> StepRecord:
    """`record` as a step-level record holds it (metrics, no tensors): what the trainer's trace.layer_every
    writes between its layer-level steps."""
    import dataclasses

    return dataclasses.replace(record, fingerprints=None, rms=None, sketches=None, norms=None)


def drifting_run(path, schema: Schema, manifest: dict, steps: int, drift=lambda k: 0.0, layer_every: int = 1):
    """A finished run of `schema`'s tensors (step k's drawn from seed k, so two such runs share them), the
    second scaled by 1 + drift(k): that relative distance from a run with no drift, as a cross-framework pair
    or a rounding-level twin would record it (the floor tests' synthetic traces). `layer_every`: the steps
    k % layer_every != 0 are step-level records (metrics only), as the trainer's trace.layer_every writes."""
    from traces import Run

    run = Run.create(path, schema, manifest)
    w = run.writer()
    for k in range(steps):
        g = np.random.default_rng(k)
        ts = [g.standard_normal((8, 16)).astype(np.float32) for _ in schema.tensors]
        ts[1] = (ts[1].astype(np.float64) * (1 + drift(k))).astype(np.float32)
        record = sketched_record(k, ts, 2.0, schema.sketch_width)
        w.append(at_step_level(record) if k % layer_every else record)
    w.close()
    run.finish()
    return Run.open(path)
