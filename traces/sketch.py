"""Distance sketch of a tensor: the numpy reference implementation (trace format_version 2).

This docstring is part of the trace format specification (FORMAT.md, "Distance sketches").
A fingerprint says only whether two tensors are equal; the sketch says how far apart they are,
from the two traces alone, without replaying either run. Implementations: this one (numpy),
`replay.record.fingerprint.sketch_and_norm` (JAX, on device) and `replay.torch.sketch` (PyTorch).

Width. ``W`` is a power of two, ``MIN_WIDTH <= W <= MAX_WIDTH``; a run's schema fixes it
(``sketch_width``; ``DEFAULT_WIDTH`` = 64).

Element index. ``e`` is the element's row-major (C order) flat index in the full, unsharded
tensor, modulo 2**32, exactly as in `traces/fingerprint.py` (one index per element, not per
word), so a sharded tensor gives the sketch of the gathered one.

Bucket and sign (uint32 arithmetic, wrapping), with ``fmix32`` the murmur3 finalizer of
`traces/fingerprint.py`. The flat index space is cut into rows of W consecutive elements,
``r = e // W`` and ``c = e mod W``; each row is scattered over the buckets by a hashed XOR::

    bucket = c XOR (fmix32(r * 0x9E3779B9 + ROW_SEED) & (W - 1))
    sign   = -1 if fmix32(e * 0x9E3779B9 + SIGN_SEED) >> 31 else +1

``ROW_SEED = zlib.crc32(b"replay-sketch-v2|row")``, ``SIGN_SEED = zlib.crc32(b"replay-sketch-v2|sign")``;
neither depends on dtype or shape, so a tensor recorded in another framework's layout
(replay.torch's name map) sketches alike. Why rows: the W elements of a row never share a
bucket and different rows collide at random (probability 1/W a pair, as a hashed bucket), so a
difference confined to one column of a matrix is spread over the buckets; and computing it is a
scatter-add of W-wide rows, not of single elements (XLA:CPU, 1M float32 elements: ~0.5 ms
against ~8 ms for a per-element hashed bucket, measured 2026-12-01).

Values. ``v_e`` is the element converted to float32 (bfloat16 and float16 exactly, float64
rounded to nearest, integers and bool by value). Then::

    sketch[j] = sum over e with bucket(e) == j of sign(e) * v_e     (float32[W])
    norm      = sqrt(sum over e of v_e ** 2)                         (float32)

The sums are real sums; implementations may accumulate in any order and precision. This
reference accumulates in float64 and rounds once. JAX accumulates in float32 (rows in chunks of
CHUNK_ROWS, then across chunks), torch in float64. So two implementations
agree to the rounding of a float32 sum: ``|S_x[j] - S_y[j]| <= 2**-22 * sum_{bucket j} |v_e|``
for the tensors the tests use (the worst case of a float32 sum of m terms is ~m * 2**-24 times
that bound; chunked sums stay far below it); the norm likewise.

Estimate. For two tensors a, b of one shape, ``E ||S_a - S_b||^2 = ||a - b||^2`` (a signed
count-sketch of the difference, linear in the tensor), with a relative standard deviation of
about ``sqrt(2 / W)`` for the squared norm when the difference is spread over many buckets (less
when a few elements dominate it: a single element is measured exactly). `relative_distance`
is ``||S_a - S_b|| / max(norm_a, norm_b)``, an estimate of ``||a - b|| / max(||a||, ||b||)``.
Its floor is the sketches' own rounding (about 2**-24 * sqrt(elements / W) relative) when two
frameworks sketch equal tensors; equal fingerprints mean distance 0 exactly.

Cost: ``W`` float32 and one float32 a tensor a record (W = 64: 260 bytes, against the 12 of its
fingerprint and RMS); computing it reads the tensor once more, fused with the fingerprint.
"""

from __future__ import annotations

import zlib

import numpy as np

from traces.fingerprint import GOLDEN, _fmix32

ROW_SEED = zlib.crc32(b"replay-sketch-v2|row")
SIGN_SEED = zlib.crc32(b"replay-sketch-v2|sign")
DEFAULT_WIDTH = 64
MIN_WIDTH, MAX_WIDTH = 8, 1 << 16
CHUNK_ROWS = 1 << 10  # rows a chunk, for implementations that sum chunk by chunk in float32
_M32 = 0xFFFFFFFF

__all__ = ["row_offsets", "signs_negative", "DEFAULT_WIDTH", "ROW_SEED", "SIGN_SEED", "bucket_and_sign", "check_width", "exact_relative_distance",
           "relative_distance", "shard_sketch", "sketch"]


def check_width(width: int) -> int:
    w = int(width)
    if w < MIN_WIDTH or w > MAX_WIDTH or w & (w - 1):
        raise ValueError(f"sketch width {width!r} must be a power of two from {MIN_WIDTH} to {MAX_WIDTH}")
    return w


def row_offsets(rows: np.ndarray, width: int) -> np.ndarray:
    """uint32 XOR offset of each row index (uint32)."""
    return _fmix32(np.asarray(rows, np.uint32) * np.uint32(GOLDEN) + np.uint32(ROW_SEED)) & np.uint32(width - 1)


def signs_negative(e: np.ndarray) -> np.ndarray:
    """bool: the element's sign is -1."""
    return (_fmix32(np.asarray(e, np.uint32) * np.uint32(GOLDEN) + np.uint32(SIGN_SEED)) >> np.uint32(31)) == 1


def bucket_and_sign(e: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """(int64 bucket, float64 sign) of uint32 element indices `e`."""
    e = np.asarray(e, np.uint32)
    w = np.uint32(width)
    bucket = ((e % w) ^ row_offsets(e // w, width)).astype(np.int64)
    return bucket, np.where(signs_negative(e), -1.0, 1.0)


def _values(a: np.ndarray) -> np.ndarray:
    if a.dtype.kind == "c":
        raise TypeError(f"sketch: complex dtype {a.dtype.name} has no distance sketch")
    return np.ascontiguousarray(a).reshape(-1).astype(np.float32).astype(np.float64)


def shard_sketch(shard, start, global_shape, width: int = DEFAULT_WIDTH) -> tuple[np.ndarray, float]:
    """float64 partial (sketch[W], sum of squares) of `shard` at `start` in a tensor of `global_shape`.
    Partials of disjoint shards add up to the whole tensor's (then round to float32)."""
    width = check_width(width)
    a = np.asarray(shard)
    gshape = tuple(int(d) for d in global_shape)
    start = tuple(int(s) for s in start)
    if a.ndim != len(gshape) or len(start) != len(gshape):
        raise ValueError(f"shard ndim {a.ndim}, start {start} and global_shape {gshape} disagree")
    strides, acc = [], 1
    for g in reversed(gshape):
        strides.append(acc)
        acc *= g
    strides.reverse()
    e = np.zeros(a.shape, np.uint64)
    for ax, (s0, n) in enumerate(zip(start, a.shape)):
        shp = [1] * a.ndim
        shp[ax] = n
        e = e + ((np.arange(n, dtype=np.uint64) + np.uint64(s0)) * np.uint64(strides[ax])).reshape(shp)
    e = (e.reshape(-1) & np.uint64(_M32)).astype(np.uint32)
    v = _values(a)
    bucket, sign = bucket_and_sign(e, width)
    return np.bincount(bucket, weights=sign * v, minlength=width), float(np.dot(v, v))


def sketch(x, width: int = DEFAULT_WIDTH) -> tuple[np.ndarray, np.float32]:
    """(float32[W] sketch, float32 norm) of a whole array-like."""
    a = np.asarray(x)
    s, ss = shard_sketch(a, (0,) * a.ndim, a.shape, width)
    return s.astype(np.float32), np.float32(np.sqrt(ss))


def relative_distance(sketch_a, norm_a, sketch_b, norm_b) -> np.ndarray:
    """Estimated ||a - b|| / max(||a||, ||b||) from two sketches (broadcasts over leading axes).
    0 where both tensors are zero; inf where one is and the other's sketch differs."""
    sa, sb = np.asarray(sketch_a, np.float64), np.asarray(sketch_b, np.float64)
    num = np.sqrt(np.sum((sa - sb) ** 2, axis=-1))
    den = np.maximum(np.asarray(norm_a, np.float64), np.asarray(norm_b, np.float64))
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(num == 0, 0.0, num / den)


def exact_relative_distance(a, b) -> float:
    """||a - b|| / max(||a||, ||b||) of two tensors' float32 values, in float64: what the estimate estimates."""
    va, vb = _values(np.asarray(a)), _values(np.asarray(b))
    num = float(np.sqrt(np.sum((va - vb) ** 2)))
    den = max(float(np.sqrt(np.dot(va, va))), float(np.sqrt(np.dot(vb, vb))))
    return 0.0 if num == 0 else (num / den if den > 0 else float("inf"))
