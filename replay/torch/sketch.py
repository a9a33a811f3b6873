"""The distance sketch of traces/sketch.py, in torch ops, on the tensor's own device.

Bucket and sign are the definition's uint32 hashes (int32 wrapping arithmetic where the device's
kernels wrap, checked once per device as for the fingerprint; else exact int64); the values are
summed in float64 (a bincount of W-wide rows into a [W, W] table by row offset, then the XOR permutation),
so a torch sketch is within rounding of the float64 reference. tests/torch/test_sketch.py checks
it against numpy and JAX. Cost: a few elementwise ops per element in chunks of CHUNK_ELEMENTS
elements, nothing leaves the device until the recorder reads the record.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from replay.torch import fingerprint as _fp
from replay.torch.fingerprint import _fmix32_i32, _fmix32_i64, _int32_wraps, _mul32, _s32
from traces.fingerprint import GOLDEN
from traces.sketch import ROW_SEED, SIGN_SEED, check_width

__all__ = ["sketch_and_norm", "sketch"]

CHUNK_ELEMENTS = 1 << 22
_M32 = 0xFFFFFFFF


# A recorder sketches the same few hundred small tensors every step, and their signs and row offsets
# are a function of the element positions alone: kept for chunks that start at element 0 and are at
# most this many elements (under 1 MiB a size), they are hashed once, not once per tensor and step
# (about 40% of sketching a small tensor; an OLMo-core fit records ~300 a step).
_CACHED_ELEMENTS = 1 << 16


def _negative_and_offsets(lo: int, rows: int, width: int, device: torch.device, fast: bool):
    """(bool [rows, W] sign is -1, int64 [rows] row offsets) of the elements lo .. lo + rows * W - 1
    (shared: a caller must not write into them)."""
    if lo == 0 and rows * width <= _CACHED_ELEMENTS:
        return _first_rows(rows, width, device, fast)
    return _hashed(lo, rows, width, device, fast)


@functools.lru_cache(maxsize=256)
def _first_rows(rows: int, width: int, device: torch.device, fast: bool):
    return _hashed(0, rows, width, device, fast)


def _hashed(lo: int, rows: int, width: int, device: torch.device, fast: bool):
    n = rows * width
    if fast and lo + n < 1 << 31:  # int32 indices; the hash's top bit is the int32 sign bit
        e = torch.arange(lo, lo + n, dtype=torch.int32, device=device)
        negative = _fmix32_i32(e * _s32(GOLDEN) + _s32(SIGN_SEED)) < 0
        r = torch.arange(lo // width, lo // width + rows, dtype=torch.int32, device=device)
        offset = (_fmix32_i32(r * _s32(GOLDEN) + _s32(ROW_SEED)) & (width - 1)).long()
        return negative.reshape(rows, width), offset
    e = torch.arange(lo, lo + n, dtype=torch.int64, device=device) & _M32
    negative = (_fmix32_i64((_mul32(e, GOLDEN) + SIGN_SEED) & _M32) >> 31) == 1
    r = torch.arange(lo // width, lo // width + rows, dtype=torch.int64, device=device) & _M32
    offset = _fmix32_i64((_mul32(r, GOLDEN) + ROW_SEED) & _M32) & (width - 1)
    return negative.reshape(rows, width), offset


def sketch_and_norm(t: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(float64[W] sketch, float64 sum of squares) of `t` as traces/sketch.py defines them."""
    width = check_width(width)
    t = t.detach()
    if t.is_complex():
        raise TypeError(f"sketch: complex dtype {t.dtype} has no distance sketch")
    device = t.device
    fast = not _fp.EXACT and _int32_wraps(device)  # read at call time: tests switch it
    flat = t.reshape(-1)
    table = torch.zeros((width, width), dtype=torch.float64, device=device)
    ss = torch.zeros((), dtype=torch.float64, device=device)
    columns = torch.arange(width, device=device)[None, :]
    step = max(width, CHUNK_ELEMENTS // width * width)  # whole rows a chunk
    for lo in range(0, flat.numel(), step):
        v = flat[lo:lo + step].to(torch.float32).to(torch.float64)
        n = v.numel()
        rows = -(-n // width)
        if rows * width != n:
            v = torch.nn.functional.pad(v, (0, rows * width - n))
        negative, offset = _negative_and_offsets(lo, rows, width, device, fast)
        signed = torch.where(negative, -v.reshape(rows, width), v.reshape(rows, width))
        # bincount, not index_add_ or a one-hot matmul: on 2 shared CPU cores a [W, W] float64
        # index_add_ of 320 rows measured ~150 ms, the matmul ~40 ms, bincount 0.05 ms.
        seg = (offset[:, None] * width + columns).reshape(-1)
        table += torch.bincount(seg, weights=signed.reshape(-1), minlength=width * width).reshape(width, width)
        ss = ss + v.square().sum()
    k = torch.arange(width, device=device)
    sketch = torch.gather(table, 1, k[None, :] ^ k[:, None]).sum(dim=0)
    return sketch, ss


def sketch(t: torch.Tensor, width: int) -> tuple:
    """(numpy float32[W] sketch, float32 norm): syncs; for tests and one-off checks."""
    s, ss = sketch_and_norm(t, width)
    return s.cpu().numpy().astype(np.float32), np.float32(np.sqrt(float(ss)))
