"""Compare two traces: the first step where any recorded field differs, and which fields.

Fields are reported in causal order (data -> rng -> state -> forward by layer -> loss ->
backward by layer -> update), because the first field to differ is the best guess at the
cause and the later ones are usually its consequences. Traces with the same schema are
compared on their segments' index columns first, so only the steps where they may part
are read and decoded (see `compare`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from traces.schema import CAUSAL_KINDS, METRIC_DTYPES, Schema, StepRecord
from traces.trace import TraceReader


@dataclass
class FieldDiff:
    """One recorded field that differs at the compared step."""

    kind: str  # causal kind: data, rng, state, forward, loss, backward, update
    name: str  # metric or tensor name, or batch_hash / example_hashes / rng
    a: object = None  # value in trace A (metric value, rms, ...), when it is a value
    b: object = None  # value in trace B
    distance: dict | None = None  # abs, rel, ulp for floats
    positions: list[int] | None = None  # differing example positions, for data

    @property
    def rank(self) -> int:
        return CAUSAL_KINDS.index(self.kind)


@dataclass
class Comparison:
    identical: bool  # every step both traces hold compared equal, bit for bit
    first_step: int | None  # first step whose records differ
    diffs: list[FieldDiff] = field(default_factory=list)  # in causal order
    compared: tuple[int, int] = (0, 0)  # [start, end) of the steps both traces hold
    a_range: tuple[int, int] = (0, 0)
    b_range: tuple[int, int] = (0, 0)
    schema_notes: list[str] = field(default_factory=list)  # fields only one trace records

    @property
    def first(self) -> FieldDiff | None:
        return self.diffs[0] if self.diffs else None

    def to_json(self) -> dict:
        d = asdict(self)
        d["first_field"] = asdict(self.first) if self.first else None
        return d


def float_distance(a: float, b: float, dtype: str = "float32") -> dict:
    """Absolute, relative and ULP distance of two floats of `dtype` (ULP counts representable steps)."""
    value_dtype, bits_dtype = METRIC_DTYPES[dtype]
    av, bv = np.array(a, value_dtype), np.array(b, value_dtype)
    if np.isnan(av) or np.isnan(bv):
        return {"abs": None, "rel": None, "ulp": None, "nan": True}
    width = bits_dtype.itemsize * 8
    signed = np.dtype(f"<i{bits_dtype.itemsize}")

    def ordered(x: np.ndarray) -> int:
        # Map the sign-magnitude float bits onto a monotonic integer line.
        i = int(x.view(signed))
        return i if i >= 0 else -(2 ** (width - 1)) - i

    absd = abs(float(av) - float(bv))
    scale = max(abs(float(av)), abs(float(bv)))
    return {"abs": absd, "rel": absd / scale if scale else 0.0, "ulp": abs(ordered(av) - ordered(bv))}


def diff_records(sa: Schema, ra: StepRecord, sb: Schema, rb: StepRecord) -> list[FieldDiff]:
    """Every field recorded by both traces that differs between the two records, in causal order."""
    diffs: list[FieldDiff] = []
    if ra.batch_hash != rb.batch_hash or not np.array_equal(ra.example_hashes, rb.example_hashes):
        n = min(len(ra.example_hashes), len(rb.example_hashes))
        pos = [int(i) for i in np.nonzero(ra.example_hashes[:n] != rb.example_hashes[:n])[0]]
        pos += list(range(n, max(len(ra.example_hashes), len(rb.example_hashes))))
        diffs.append(FieldDiff("data", "example_hashes", positions=pos))
    if not np.array_equal(ra.rng, rb.rng):
        diffs.append(FieldDiff("rng", "rng", a=[int(x) for x in ra.rng], b=[int(x) for x in rb.rng]))
    kinds_b = dict(sb.metrics)
    for i, (name, kind) in enumerate(sa.metrics):
        if name not in kinds_b:
            continue
        va, vb = ra.metrics[i], rb.metrics[sb.metric_index(name)]
        if va.tobytes() != np.asarray(vb, va.dtype).tobytes() or va.dtype != vb.dtype:
            diffs.append(FieldDiff(kind, name, a=float(va), b=float(vb), distance=float_distance(va, vb, sa.metric_dtype)))
    if ra.fingerprints is not None and rb.fingerprints is not None:
        index_b = {n: j for j, n in enumerate(sb.tensor_names)}
        for i, (name, kind) in enumerate(sa.tensors):
            j = index_b.get(name)
            if j is not None and ra.fingerprints[i] != rb.fingerprints[j]:
                rms_a, rms_b = float(ra.rms[i]), float(rb.rms[j])
                diffs.append(FieldDiff(kind, name, a=rms_a, b=rms_b, distance=float_distance(rms_a, rms_b)))
    if ra.example_metrics is not None and rb.example_metrics is not None:
        index_b = {n: j for j, n in enumerate(sb.example_metrics)}
        for i, name in enumerate(sa.example_metrics):
            j = index_b.get(name)
            if j is not None and ra.example_metrics[i].tobytes() != rb.example_metrics[j].tobytes():
                pos = [int(p) for p in np.nonzero(ra.example_metrics[i].view(np.uint32) != rb.example_metrics[j].view(np.uint32))[0]]
                diffs.append(FieldDiff("loss", f"example_{name}", positions=pos))
    return sorted(diffs, key=lambda d: d.rank)  # stable: execution order kept within a kind


def _schema_notes(sa: Schema, sb: Schema) -> list[str]:
    notes = []
    for what, na, nb in (
        ("metric", sa.metric_names, sb.metric_names),
        ("tensor", sa.tensor_names, sb.tensor_names),
        ("example metric", sa.example_metrics, sb.example_metrics),
    ):
        only_a = [n for n in na if n not in nb]
        only_b = [n for n in nb if n not in na]
        if only_a:
            notes.append(f"{what}s only in A (not compared): {', '.join(only_a)}")
        if only_b:
            notes.append(f"{what}s only in B (not compared): {', '.join(only_b)}")
    if sa.examples_per_step != sb.examples_per_step:
        notes.append(f"examples per step differ: A {sa.examples_per_step}, B {sb.examples_per_step}")
    return notes


def _chunks(a: TraceReader, b: TraceReader, lo: int, hi: int):
    """[s, e) pieces of lo..hi that lie in one segment of each trace."""
    cuts = {lo, hi}
    for r in (a, b):
        cuts.update(seg.first_step for seg in r.segments if lo < seg.first_step < hi)
    cuts = sorted(cuts)
    return list(zip(cuts[:-1], cuts[1:]))


def _columns(r: TraceReader, s: int, e: int):
    i = r._segment_index(s)
    c, first = r.columns(i), r.segments[i].first_step
    return c, s - first, e - first


def _same_summary(a: TraceReader, b: TraceReader, s: int, e: int) -> bool:
    """Whether s..e-1 is one whole segment in each trace and the two segments' summaries (a
    blake2b-128 of the columns _candidates compares, in the index header) are equal: then no
    step there is a candidate, and neither segment's columns need be read."""
    i, j = a._segment_index(s), b._segment_index(s)
    sa, sb = a.segments[i], b.segments[j]
    if (sa.first_step, sa.count, sb.first_step, sb.count) != (s, e - s, s, e - s):
        return False
    summary = a.summary(i)
    return summary is not None and summary == b.summary(j)


def _candidates(a: TraceReader, b: TraceReader, s: int, e: int) -> np.ndarray:
    """Steps of s..e-1 whose records may differ, from the index columns: any scalar field or the
    frame checksum differs (same schema), or every step (schemas differ)."""
    if a.schema != b.schema:
        return np.arange(s, e)
    if _same_summary(a, b, s, e):
        return np.zeros(0, np.int64)
    (ca, la, ha), (cb, lb, hb) = _columns(a, s, e), _columns(b, s, e)
    differ = ca.frame_crc[la:ha] != cb.frame_crc[lb:hb]
    for name in ("flags", "batch_hash", "examples_key"):
        differ |= getattr(ca, name)[la:ha] != getattr(cb, name)[lb:hb]
    for name in ("rng", "metric_bits"):
        x, y = getattr(ca, name)[la:ha], getattr(cb, name)[lb:hb]
        if x.shape[1]:
            differ |= (x != y).any(axis=1)
    return s + np.flatnonzero(differ)


def compare(a: TraceReader, b: TraceReader, start: int | None = None, stop: int | None = None) -> Comparison:
    """Compares the steps both traces hold (optionally limited to [start, stop)).

    The first difference is searched in the segments' index columns (scalar fields and each
    frame's checksum; ~50 bytes a step), and only candidate steps are read and decoded. Two
    whole segments whose index summaries are equal are skipped without reading their columns,
    so at 1.4M steps a difference late in the run reads 86 index headers a trace and the
    differing segment's columns (~0.9 MB), not the records. A step whose records
    differ only in fields the columns do not hold (example hashes, fingerprints, per-example
    metrics) is a candidate through its frame checksum, so a difference there is missed only
    when two different records share a CRC-32 and every scalar field (odds 2**-32 a step). An
    "identical" verdict reads and checks every frame of both traces over the compared steps;
    a difference found at step k does not vouch for the bytes before k (the index columns,
    checksummed, do), so damage there is left to `Run.verify`. Traces of different schemas
    are compared record by record.
    """
    lo, hi = max(a.start, b.start), min(a.end, b.end)
    if start is not None:
        lo = max(lo, start)
    if stop is not None:
        hi = min(hi, stop)
    result = Comparison(True, None, compared=(lo, max(lo, hi)), a_range=(a.start, a.end), b_range=(b.start, b.end),
                        schema_notes=_schema_notes(a.schema, b.schema))
    for s, e in _chunks(a, b, lo, hi) if lo < hi else []:
        for step in _candidates(a, b, s, e).tolist():
            if a.schema == b.schema and (a.raw_frame(step) == b.raw_frame(step) or
                                         a.raw_record(step) == b.raw_record(step)):
                continue  # the same record (compressed differently)
            diffs = diff_records(a.schema, a.read(step), b.schema, b.read(step))
            if diffs:
                result.identical, result.first_step, result.diffs = False, step, diffs
                return result
    if lo < hi:  # "identical" vouches for every record compared: their checksums first
        a.check_bytes(lo, hi)
        b.check_bytes(lo, hi)
    return result
