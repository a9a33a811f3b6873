"""64-bit tensor fingerprint: the numpy reference implementation.

This docstring is part of the trace format specification. Any implementation
(e.g. ``trainer.fingerprint`` on device) must produce bit-identical results.

All arithmetic below is on uint32 and wraps modulo 2**32.

Words. A tensor of dtype ``D`` and shape ``S`` (the full, unsharded shape) is read
as a sequence of uint32 *words*, one per element for dtypes of 1, 2 or 4 bytes:

* 4-byte dtypes (float32, int32, uint32, ...): the element's bits as uint32.
* 2-byte dtypes (bfloat16, float16, int16, uint16): the bits as uint16,
  zero-extended to uint32.
* 1-byte dtypes (int8, uint8, float8_*) and bool: the bits as uint8,
  zero-extended (bool is therefore 0 or 1).
* 8-byte dtypes (float64, int64, uint64, complex64): two words per element, the
  low 32 bits of the little-endian representation first, then the high 32 bits.
  Generally an element of ``4*W`` bytes is ``W`` words in little-endian order
  (complex128: W=4). This is the same as viewing the tensor as uint32 with the
  last axis multiplied by W (a 0-d tensor becomes shape ``(W,)``).

Sub-byte dtypes (int2, int4, uint2, uint4, float4_*, float6_*) are rejected: their
byte-level storage differs between numpy and devices.

Index. The word of element ``e`` at position ``w`` has index
``i = (W * e + w) mod 2**32``, where ``e`` is the element's row-major (C order)
flat index in the full tensor. So ``i`` is the global flat index of the word in
the uint32 view; it does not depend on how the tensor is sharded.

Seeds. ``shape_str`` is the shape's sizes in decimal joined by ``","`` with no
spaces (``"4,8"``, ``"5"``), or ``"()"`` for a 0-d tensor. ``dtype_name`` is the
numpy dtype name (``"float32"``, ``"bfloat16"``, ``"bool"``). For lanes k = 0, 1::

    s_k = zlib.crc32(f"{dtype_name}|{shape_str}|{k}".encode("ascii"))

Dtype and shape enter the seed so a reshape or a dtype change (with the same
bytes) changes the fingerprint.

Mix. ``fmix32`` is the murmur3 finalizer::

    h ^= h >> 16; h *= 0x85EBCA6B; h ^= h >> 13; h *= 0xC2B2AE35; h ^= h >> 16

Lanes and fingerprint::

    lane_k = sum over words of fmix32(bits + i * 0x9E3779B9 + s_k)   (mod 2**32)
    fingerprint = (lane_0 << 32) | lane_1                              (uint64)

A sum is used (not a sequential hash) because it is independent of reduction
order, so shards can be reduced anywhere, in any order, and combined by a
wrapping add of their partial lanes. An empty tensor has fingerprint 0.
"""

from __future__ import annotations

import re
import sys
import zlib
from typing import Iterable, Iterator, Sequence

import numpy as np

GOLDEN = 0x9E3779B9
CHUNK_ELEMENTS = 1 << 20
_M32 = 0xFFFFFFFF
SUB_BYTE_RE = re.compile(r"^(u?int[24]|float[46]_)")

__all__ = [
    "fingerprint",
    "fingerprint_hex",
    "shard_lanes",
    "combine_lanes",
    "lane_seeds",
    "shape_str",
]


def shape_str(shape: Sequence[int]) -> str:
    shape = tuple(int(d) for d in shape)
    return ",".join(str(d) for d in shape) if shape else "()"


def lane_seeds(dtype_name: str, shape: Sequence[int]) -> tuple[int, int]:
    s = shape_str(shape)
    return tuple(zlib.crc32(f"{dtype_name}|{s}|{k}".encode("ascii")) for k in (0, 1))


def _fmix32(h: np.ndarray) -> np.ndarray:
    # In-place to keep peak memory at a couple of chunk-sized buffers.
    h ^= h >> np.uint32(16)
    h *= np.uint32(0x85EBCA6B)
    h ^= h >> np.uint32(13)
    h *= np.uint32(0xC2B2AE35)
    h ^= h >> np.uint32(16)
    return h


def _words_per_element(dtype: np.dtype, dtype_name: str) -> int:
    # ml_dtypes (bfloat16, float8_*) report kind "V", so only plain/structured voids are refused.
    plain_void = dtype.names is not None or dtype.name.startswith("void")
    if dtype.kind in "OSUMm" or plain_void or SUB_BYTE_RE.match(dtype_name):
        raise TypeError(f"fingerprint: unsupported dtype {dtype_name!r}")
    n = dtype.itemsize
    if n in (1, 2, 4):
        return 1
    if n % 4 == 0:
        return n // 4
    raise TypeError(f"fingerprint: unsupported itemsize {n} of dtype {dtype_name!r}")


def _check_carrier(dtype: np.dtype, name: str) -> None:
    """A `dtype_name` override must name a dtype of the carrier's width, or the words differ."""
    try:
        named = np.dtype(name)
    except TypeError:  # e.g. "bfloat16" without ml_dtypes: trust the caller
        return
    if named.itemsize != dtype.itemsize:
        raise ValueError(f"dtype_name {name!r} ({named.itemsize} bytes) cannot be carried "
                         f"in {dtype.name} ({dtype.itemsize} bytes)")


def _as_little_endian(a: np.ndarray) -> np.ndarray:
    bo = a.dtype.byteorder
    if bo == ">" or (bo == "=" and sys.byteorder == "big"):
        return a.byteswap().view(a.dtype.newbyteorder("<"))
    return a


def _words(block: np.ndarray) -> np.ndarray:
    """Flat uint32 words of a block, in the order the spec defines."""
    flat = np.ascontiguousarray(_as_little_endian(block)).reshape(-1)
    n = flat.dtype.itemsize
    if n == 1 or n == 2:
        return flat.view(f"<u{n}").astype(np.uint32)
    # Explicit '<u4' keeps the low-word-first order independent of host endianness.
    return flat.view("<u4").astype(np.uint32)


Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offset, size)


def _blocks(shape: tuple[int, ...], chunk: int) -> Iterator[Box]:
    """Yield (offset, size) boxes tiling `shape`, each of at most `chunk` elements."""
    if not shape:
        yield (), ()
        return
    inner = int(np.prod(shape[1:], dtype=np.int64))
    if inner <= chunk:
        step = max(1, chunk // max(inner, 1))
        for o in range(0, shape[0], step):
            yield (o,) + (0,) * (len(shape) - 1), (min(step, shape[0] - o),) + shape[1:]
        return
    for o in range(shape[0]):
        for off, size in _blocks(shape[1:], chunk):
            yield (o,) + off, (1,) + size


def _element_index(start: tuple[int, ...], size: tuple[int, ...], strides: list[int]) -> np.ndarray:
    """Global row-major flat index (mod 2**32) of each element of a box, flattened."""
    idx = np.zeros(size, dtype=np.uint32)
    for ax, (s0, n) in enumerate(zip(start, size)):
        r = (np.arange(n, dtype=np.uint64) + np.uint64(s0)) * np.uint64(strides[ax])
        shp = [1] * len(size)
        shp[ax] = n
        idx += (r & np.uint64(_M32)).astype(np.uint32).reshape(shp)
    return idx.reshape(-1)


def shard_lanes(
    shard,
    start: Sequence[int],
    global_shape: Sequence[int],
    dtype_name: str | None = None,
) -> tuple[int, int]:
    """Partial (lane_0, lane_1) of `shard`, which sits at `start` in a tensor of `global_shape`.

    `dtype_name` overrides the name that goes into the seed; use it when the data is
    carried in a stand-in dtype of the same width (e.g. bfloat16 bits as uint16).
    """
    a = np.asarray(shard)
    gshape = tuple(int(d) for d in global_shape)
    start = tuple(int(s) for s in start)
    if len(start) != len(gshape) or a.ndim != len(gshape):
        raise ValueError(f"shard ndim {a.ndim}, start {start} and global_shape {gshape} disagree")
    for s, n, g in zip(start, a.shape, gshape):
        if s < 0 or s + n > g:
            raise ValueError(f"shard of shape {a.shape} at {start} exceeds global shape {gshape}")
    name = dtype_name or a.dtype.name
    W = _words_per_element(a.dtype, name)
    _check_carrier(a.dtype, name)
    seeds = [np.uint32(s) for s in lane_seeds(name, gshape)]
    strides, acc = [], 1
    for g in reversed(gshape):
        strides.append(acc % (1 << 32))
        acc *= g
    strides.reverse()

    lanes = [0, 0]
    chunk = max(1, CHUNK_ELEMENTS // W)
    for off, size in _blocks(a.shape, chunk):
        if 0 in size:
            continue
        block = a[tuple(slice(o, o + n) for o, n in zip(off, size))]
        e = _element_index(tuple(s + o for s, o in zip(start, off)), size, strides)
        if W == 1:
            i = e
        else:
            i = (e[:, None] * np.uint32(W) + np.arange(W, dtype=np.uint32)).reshape(-1)
        base = _words(block)
        base += i * np.uint32(GOLDEN)
        del i, e
        for k in (0, 1):
            h = base + seeds[k]
            lanes[k] = (lanes[k] + int(_fmix32(h).sum(dtype=np.uint64))) & _M32
    return lanes[0], lanes[1]


def combine_lanes(parts: Iterable[Sequence[int]]) -> int:
    """Wrapping-add partial lanes (in any order) and pack them into the 64-bit fingerprint."""
    l0 = l1 = 0
    for p in parts:
        a, b = (int(v) for v in p)
        l0 = (l0 + a) & _M32
        l1 = (l1 + b) & _M32
    return (l0 << 32) | l1


def fingerprint(x, dtype_name: str | None = None) -> int:
    """64-bit fingerprint of a whole array-like (0-d scalars included)."""
    a = np.asarray(x)
    return combine_lanes([shard_lanes(a, (0,) * a.ndim, a.shape, dtype_name)])


def fingerprint_hex(fp: int) -> str:
    return "%016x" % fp
