"""The trace schema and the binary layout of one step record.

The schema lives in the run manifest: which metrics a record holds (and where each sits in
causal order), which tensors are fingerprinted, in the model's execution order, and how many
examples a step has. Records store values only, so names are written once per run, not once
per step. The byte layout is specified in FORMAT.md; `encode_record`/`decode_record` are its
only implementation.
"""

from __future__ import annotations

import functools
import json
import struct
import zlib
from dataclasses import dataclass, field

import numpy as np

from traces.errors import SchemaError

# Causal order of what can differ between two runs at one step. Compare reports the first.
CAUSAL_KINDS = ("data", "rng", "state", "forward", "loss", "backward", "update")
METRIC_KINDS = ("state", "forward", "loss", "backward", "update")
TENSOR_KINDS = ("state", "forward", "backward", "update")
METRIC_DTYPES = {"float32": (np.dtype("<f4"), np.dtype("<u4")), "float64": (np.dtype("<f8"), np.dtype("<u8"))}

FLAG_LAYER = 1  # the record carries per-tensor fingerprints and RMS values
FLAG_EXAMPLE_METRICS = 2  # the record carries per-example metric vectors
_HEAD = struct.Struct("<QB")
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class Schema:
    examples_per_step: int  # global batch size: one hash (and example metric) per example
    rng_words: int  # uint32 words of the step's RNG key (2 for a threefry key)
    metrics: tuple[tuple[str, str], ...]  # (name, causal kind) of each scalar metric, in order
    tensors: tuple[tuple[str, str], ...] = ()  # (name, causal kind) fingerprinted, execution order
    example_metrics: tuple[str, ...] = ()  # per-example float32 vectors, e.g. ("loss",)
    metric_dtype: str = "float32"  # every scalar metric is stored as the exact bits of this dtype
    sketch_width: int = 0  # format_version 2: float32 distance sketch per tensor (traces/sketch.py); 0 = none

    def __post_init__(self):
        if self.examples_per_step < 0 or self.rng_words < 0:
            raise SchemaError("schema: examples_per_step and rng_words must be >= 0")
        if self.metric_dtype not in METRIC_DTYPES:
            raise SchemaError(f"schema: metric_dtype {self.metric_dtype!r} is not one of {sorted(METRIC_DTYPES)}")
        if self.sketch_width:
            from traces.sketch import check_width

            try:
                check_width(self.sketch_width)
            except ValueError as e:
                raise SchemaError(f"schema: {e}") from None
        for what, items, kinds in (("metric", self.metrics, METRIC_KINDS), ("tensor", self.tensors, TENSOR_KINDS)):
            names = [n for n, _ in items]
            if len(set(names)) != len(names):
                raise SchemaError(f"schema: duplicate {what} names in {names}")
            for name, kind in items:
                if kind not in kinds:
                    raise SchemaError(f"schema: {what} {name!r} has kind {kind!r}, expected one of {kinds}")

    # Names and positions -------------------------------------------------------------
    @functools.cached_property
    def metric_names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.metrics)

    @functools.cached_property
    def tensor_names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.tensors)

    def metric_index(self, name: str) -> int:
        try:
            return self.metric_names.index(name)
        except ValueError:
            raise SchemaError(f"schema: no metric named {name!r}; recorded: {', '.join(self.metric_names)}") from None

    # Serialization -------------------------------------------------------------------
    def to_json(self) -> dict:
        d = {
            "examples_per_step": self.examples_per_step,
            "rng_words": self.rng_words,
            "metric_dtype": self.metric_dtype,
            "metrics": [{"name": n, "kind": k} for n, k in self.metrics],
            "tensors": [{"name": n, "kind": k} for n, k in self.tensors],
            "example_metrics": list(self.example_metrics),
        }
        if self.sketch_width:  # absent without sketches, so a version-1 schema keeps its digest
            d["sketch_width"] = self.sketch_width
        return d

    @classmethod
    def from_json(cls, d: dict) -> "Schema":
        try:
            return cls(
                examples_per_step=int(d["examples_per_step"]),
                rng_words=int(d["rng_words"]),
                metric_dtype=str(d.get("metric_dtype", "float32")),
                metrics=tuple((str(m["name"]), str(m["kind"])) for m in d["metrics"]),
                tensors=tuple((str(t["name"]), str(t["kind"])) for t in d.get("tensors", [])),
                example_metrics=tuple(str(x) for x in d.get("example_metrics", [])),
                sketch_width=int(d.get("sketch_width", 0)),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise SchemaError(f"schema in manifest is malformed ({e!r}): the run.json was edited or damaged") from None

    def digest(self) -> int:
        """crc32 of the canonical JSON: segment headers carry it so foreign segments are refused."""
        return zlib.crc32(json.dumps(self.to_json(), sort_keys=True).encode())

    # Record layout -------------------------------------------------------------------
    def layout(self, flags: int) -> np.dtype:
        """The numpy structured dtype of a record body after the (step, flags) head."""
        layout = self._layouts.get(flags)
        if layout is None:
            layout = self._layouts[flags] = self._build_layout(flags)
        return layout

    @functools.cached_property
    def _layouts(self) -> dict[int, np.dtype]:
        """{flags: layout}, built once per schema: records are encoded on the loop's thread every step."""
        return {}

    def _build_layout(self, flags: int) -> np.dtype:
        bits = METRIC_DTYPES[self.metric_dtype][1]
        fields = [
            ("rng", "<u4", (self.rng_words,)),
            ("batch_hash", "<u8"),
            ("example_hashes", "<u8", (self.examples_per_step,)),
            ("metrics", bits, (len(self.metrics),)),
        ]
        if flags & FLAG_LAYER:
            fields += [("fingerprints", "<u8", (len(self.tensors),)), ("rms", "<f4", (len(self.tensors),))]
            if self.sketch_width:
                fields += [("sketches", "<f4", (len(self.tensors), self.sketch_width)),
                           ("norms", "<f4", (len(self.tensors),))]
        if flags & FLAG_EXAMPLE_METRICS:
            fields += [("example_metrics", "<f4", (len(self.example_metrics), self.examples_per_step))]
        return np.dtype(fields)


@dataclass(frozen=True, eq=False)
class StepRecord:
    """Everything recorded about one training step. Arrays hold exact bits; compare with `same_bits`."""

    step: int  # the step this record describes (the state before it is step `step`'s input)
    rng: np.ndarray  # uint32[rng_words]: raw words of the step's RNG key
    batch_hash: int  # uint64 hash of the whole global batch
    example_hashes: np.ndarray  # uint64[examples_per_step], in global example order
    metrics: np.ndarray  # metric_dtype[len(metrics)], exact float bits
    fingerprints: np.ndarray | None = None  # uint64[len(tensors)] when layer-level
    rms: np.ndarray | None = None  # float32[len(tensors)] when layer-level
    example_metrics: np.ndarray | None = field(default=None)  # float32[n_example_metrics, examples]
    sketches: np.ndarray | None = None  # float32[len(tensors), sketch_width] when layer-level and sketched
    norms: np.ndarray | None = None  # float32[len(tensors)]: each tensor's L2 norm, beside its sketch

    @property
    def flags(self) -> int:
        return (FLAG_LAYER if self.fingerprints is not None else 0) | (
            FLAG_EXAMPLE_METRICS if self.example_metrics is not None else 0
        )

    def metric(self, schema: Schema, name: str) -> float:
        return float(self.metrics[schema.metric_index(name)])

    def metrics_dict(self, schema: Schema) -> dict[str, float]:
        return {n: float(v) for n, v in zip(schema.metric_names, self.metrics)}


def encode_record(schema: Schema, rec: StepRecord) -> bytes:
    """Uncompressed record bytes: the (step, flags) head, then the body in `schema.layout` order."""
    flags = rec.flags
    if rec.fingerprints is not None and rec.rms is None:
        raise SchemaError(f"step {rec.step}: layer-level record has fingerprints but no rms values")
    if flags & FLAG_LAYER and schema.sketch_width and (rec.sketches is None or rec.norms is None):
        raise SchemaError(f"step {rec.step}: the schema records {schema.sketch_width}-wide distance sketches, the "
                          "layer-level record has none: record sketches and norms with the fingerprints")
    if rec.sketches is not None and not schema.sketch_width:
        raise SchemaError(f"step {rec.step}: the record has distance sketches but the schema has no sketch_width")
    value_dtype, _ = METRIC_DTYPES[schema.metric_dtype]
    parts = {
        "rng": (rec.rng, np.uint32),
        "batch_hash": (rec.batch_hash, np.uint64),
        "example_hashes": (rec.example_hashes, np.uint64),
        "metrics": (rec.metrics, value_dtype),
        "fingerprints": (rec.fingerprints, np.uint64),
        "rms": (rec.rms, np.float32),
        "example_metrics": (rec.example_metrics, np.float32),
        "sketches": (rec.sketches, np.float32),
        "norms": (rec.norms, np.float32),
    }
    # The layout's fields are packed (no padding), so the body is each field's little-endian bytes
    # in layout order: joined directly, a record costs a third of filling a structured array (it
    # is encoded on the loop's thread every step; tests/traces/test_schema.py holds it to that array).
    out = [_HEAD.pack(rec.step, flags)]
    for name, store, shape in _fields(schema.layout(flags)):
        value, dtype = parts[name]
        if name == "batch_hash":
            if not 0 <= int(value) < 2**64:
                raise SchemaError(f"step {rec.step}: batch_hash {value} is not a uint64")
            out.append(_U64.pack(int(value)))
            continue
        arr = np.asarray(value)
        # Only lossless conversions: the bits must be stored exactly as given.
        if not np.can_cast(arr.dtype, dtype, casting="safe"):
            raise SchemaError(f"step {rec.step}: field {name} has dtype {arr.dtype}, expected {np.dtype(dtype)}")
        if arr.shape != shape:
            raise SchemaError(f"step {rec.step}: field {name} has shape {arr.shape}, the schema says {shape}")
        # metrics: the value dtype's bytes are the stored bits (the layout names the bits' dtype)
        out.append(arr.astype(value_dtype if name == "metrics" else store, copy=False).tobytes())
    return b"".join(out)


@functools.lru_cache(maxsize=256)
def _fields(layout: np.dtype) -> tuple[tuple[str, np.dtype, tuple[int, ...]], ...]:
    """(name, little-endian scalar dtype, shape) of each field of a record layout, in order."""
    return tuple((name, layout[name].base, layout[name].shape) for name in layout.names)


def decode_record(schema: Schema, data: bytes) -> StepRecord:
    """Inverse of encode_record. Raises SchemaError when the bytes do not fit the schema."""
    if len(data) < _HEAD.size:
        raise SchemaError("record shorter than its header")
    step, flags = _HEAD.unpack_from(data)
    if flags & ~(FLAG_LAYER | FLAG_EXAMPLE_METRICS):
        raise SchemaError(f"step {step}: unknown record flags {flags:#x}")
    layout = schema.layout(flags)
    if len(data) - _HEAD.size != layout.itemsize:
        raise SchemaError(f"step {step}: record has {len(data) - _HEAD.size} body bytes, the schema says {layout.itemsize}")
    body = np.frombuffer(data, dtype=layout, count=1, offset=_HEAD.size)[0]
    value_dtype, _ = METRIC_DTYPES[schema.metric_dtype]
    return StepRecord(
        step=int(step),
        rng=body["rng"].copy(),
        batch_hash=int(body["batch_hash"]),
        example_hashes=body["example_hashes"].copy(),
        metrics=body["metrics"].copy().view(value_dtype),
        fingerprints=body["fingerprints"].copy() if flags & FLAG_LAYER else None,
        rms=body["rms"].copy() if flags & FLAG_LAYER else None,
        example_metrics=body["example_metrics"].copy() if flags & FLAG_EXAMPLE_METRICS else None,
        sketches=body["sketches"].copy() if "sketches" in layout.names else None,
        norms=body["norms"].copy() if "norms" in layout.names else None,
    )


def same_bits(schema: Schema, a: StepRecord, b: StepRecord) -> bool:
    """True when two records are bit-identical in every field (NaN payloads and -0.0 included)."""
    return encode_record(schema, a) == encode_record(schema, b)


# The SDC re-run check's tensors (FORMAT.md "SDC checks"): "check/rerun", then "check/rerun_1", ...
# for every further 64 microbatches. Here, beside the schema, so that reading them needs no JAX.
CHECK_TENSOR = "check/rerun"


def check_tensors(schema: Schema) -> list[int]:
    """Indices of the record's "check/rerun" tensors, in order ([] when the run has no check)."""
    return [i for i, n in enumerate(schema.tensor_names) if n == CHECK_TENSOR or n.startswith(CHECK_TENSOR + "_")]
