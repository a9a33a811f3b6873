"""The tensor fingerprint of traces/fingerprint.py, in torch ops, on the tensor's own device.

The definition (words, global index, seeds, fmix32, wrapping lane sums) is the one specified in
traces/fingerprint.py; tests/torch/test_fingerprint.py checks both paths below against the numpy
reference bit for bit.

Two paths compute the same bits. The fast one holds each uint32 word in an int32 and relies on
int32 multiply and add wrapping modulo 2**32, as they do on every CPU and GPU torch runs on
(and as XLA defines them) but as C++ does not promise; so it is used on a device only after
`_int32_wraps` has checked that device's kernels on values that overflow. The exact one holds
words in int64 and builds each product mod 2**32 from 16-bit halves (no partial product over
2**49): about 8x slower (1.2 s against 0.15 s for 4M float32 elements on 2 CPU cores).

Cost: ~30 elementwise int32 ops per 32-bit word, unfused (torch eager), in chunks of
CHUNK_ELEMENTS elements, so a few chunk-sized buffers whatever the tensor's size; nothing leaves
the device until the caller reads the lanes, so a recorder can fetch them a step late.
"""

from __future__ import annotations

import functools
import re

import torch

from traces.fingerprint import GOLDEN, SUB_BYTE_RE, lane_seeds

__all__ = ["dtype_name", "fingerprint", "lanes_and_sum_of_squares", "words_lanes", "CHUNK_ELEMENTS"]

CHUNK_ELEMENTS = 1 << 22
_STACKED_WORDS = 1 << 16  # chunks up to this many words compute both lanes in one pass (_lanes_i32)
EXACT = False  # True forces the exact int64 path (tests run both)
_M32 = 0xFFFFFFFF
_C1, _C2 = 0x85EBCA6B, 0xC2B2AE35
_SUB_BYTE_TORCH = re.compile(r"^u?int[1-7]$")  # torch.uint1..uint7, int1..int7: packed below a byte
_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MASK = {1: 0xFF, 2: 0xFFFF, 4: _M32}


def dtype_name(dtype: torch.dtype) -> str:
    """The numpy/ml_dtypes name of a torch dtype ("float32", "bfloat16", "bool"): the name the
    fingerprint's seed and the example hashes' seed are made of."""
    return str(dtype).removeprefix("torch.")


def _s32(c: int) -> int:
    """A uint32 constant as the int32 with the same bits."""
    c &= _M32
    return c - (1 << 32) if c >= 1 << 31 else c


# ------------------------------------------------------------------------------ int32, wrapping

def _lshr(h: torch.Tensor, k: int) -> torch.Tensor:
    return (h >> k) & ((1 << (32 - k)) - 1)  # a logical shift: int32 >> is arithmetic


def _fmix32_i32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ _lshr(h, 16)
    h = h * _s32(_C1)
    h = h ^ _lshr(h, 13)
    h = h * _s32(_C2)
    return h ^ _lshr(h, 16)


@functools.lru_cache(maxsize=None)
def _int32_wraps(device: torch.device) -> bool:
    """Whether this device's int32 multiply and add wrap modulo 2**32 (checked once per device)."""
    vals = [0x7FFFFFFF, 0x80000000, 0xDEADBEEF, 0x9E3779B9, 1, 0xFFFFFFFF]
    a = torch.tensor([_s32(v) for v in vals], dtype=torch.int32, device=device)
    got = ((a * _s32(_C1)) + a * _s32(GOLDEN) + _s32(0xC0FFEE11)).cpu().tolist()
    want = [_s32(v * _C1 + v * GOLDEN + 0xC0FFEE11) for v in vals]
    return got == want


def _words_i32(flat: torch.Tensor) -> torch.Tensor:
    """int32 words of a contiguous flat chunk, W per element, low word first (little-endian)."""
    if flat.dtype == torch.bool:
        return flat.to(torch.int32)
    if flat.is_complex():  # real then imaginary part: the little-endian layout of a complex element
        return torch.view_as_real(flat).reshape(-1).view(torch.int32)
    n = flat.element_size()
    if n == 4:
        return flat.view(torch.int32)
    if n == 8:
        return flat.view(torch.int32)  # a contiguous chunk: each element's low word, then its high word
    return flat.view(_VIEW[n]).to(torch.int32) & _MASK[n]


def _lanes_i32(flat: torch.Tensor, word0: int, seeds: tuple[int, int]) -> list[torch.Tensor]:
    words = _words_i32(flat)
    i = torch.arange(words.numel(), dtype=torch.int32, device=flat.device) + _s32(word0)
    base = words + i * _s32(GOLDEN)
    del i
    # int32 sums come back as int64; signed and unsigned sums agree mod 2**32.
    if words.numel() > _STACKED_WORDS:
        return [_fmix32_i32(base + _s32(s)).sum() for s in seeds]
    # Both lanes in one [2, n] pass: half the elementwise calls, which is most of the cost for the
    # small tensors a recorder fingerprints every step (big chunks keep one lane's buffers at a time).
    seeded = base[None, :] + torch.tensor([[_s32(s)] for s in seeds], dtype=torch.int32, device=flat.device)
    l0, l1 = _fmix32_i32(seeded).sum(dim=1)
    return [l0, l1]


# ------------------------------------------------------------------------------ int64, exact

def _mul32(a: torch.Tensor, c: int) -> torch.Tensor:
    """(a * c) mod 2**32 for int64 `a` in [0, 2**32) and a constant c < 2**32, exactly."""
    lo, hi = c & 0xFFFF, c >> 16
    return (a * lo + (((a * hi) & 0xFFFF) << 16)) & _M32


def _fmix32_i64(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, _C1)
    h = h ^ (h >> 13)
    h = _mul32(h, _C2)
    return h ^ (h >> 16)


def _words_i64(flat: torch.Tensor) -> torch.Tensor:
    if flat.dtype == torch.bool:
        return flat.to(torch.int64)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    n = flat.element_size()
    v = flat.view(_VIEW[n]).to(torch.int64)
    if n < 8:
        return v & _MASK[n]
    return torch.stack([v & _M32, (v >> 32) & _M32], dim=-1).reshape(-1)


def _lanes_i64(flat: torch.Tensor, word0: int, seeds: tuple[int, int]) -> list[torch.Tensor]:
    return _mix_i64(_words_i64(flat), word0, seeds)


def _mix_i64(words: torch.Tensor, word0: int, seeds: tuple[int, int]) -> list[torch.Tensor]:
    """Lane sums of flat int64 words (uint32 values), the first at global word index word0."""
    i = (torch.arange(words.numel(), dtype=torch.int64, device=words.device) + word0) & _M32
    base = (words + _mul32(i, GOLDEN)) & _M32
    del i
    return [_fmix32_i64((base + s) & _M32).sum() for s in seeds]


# ------------------------------------------------------------------------------ both

def _words_per_element(t: torch.Tensor) -> int:
    name = dtype_name(t.dtype)
    if t.is_quantized or SUB_BYTE_RE.match(name) or _SUB_BYTE_TORCH.match(name):
        raise TypeError(f"fingerprint: unsupported dtype {name!r}")
    n = t.element_size()
    if t.is_complex() and n < 8:  # complex32 has no numpy counterpart to be checked against
        raise TypeError(f"fingerprint: unsupported dtype {name!r}")
    if n in (1, 2, 4):
        return 1
    if n % 4:
        raise TypeError(f"fingerprint: unsupported itemsize {n} of dtype {name!r}")
    return n // 4


def _chunks(t: torch.Tensor, chunk: int):
    """(flat element offset, contiguous flat chunk) over `t` in row-major order; a non-contiguous
    tensor (a transposed weight) is copied one block of rows at a time, never whole."""
    if t.dim() == 0:
        yield 0, t.reshape(1)
        return
    if t.is_contiguous():
        flat = t.reshape(-1)
        for o in range(0, flat.numel(), chunk):
            yield o, flat[o:o + chunk]
        return
    inner = max(1, t[0].numel()) if t.shape[0] else 1
    rows = max(1, chunk // inner)
    for r in range(0, t.shape[0], rows):
        yield r * inner, t[r:r + rows].reshape(-1)


def lanes_and_sum_of_squares(t: torch.Tensor, name: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(int64[2] lanes, float64 sum of squares) of `t`, on its device, without a host sync.

    `name` overrides the dtype name in the seed (bits carried in a stand-in dtype of the same
    width). The sum of squares (accumulated in float32, as the JAX side) is for the record's
    RMS, a magnitude for reports."""
    t = t.detach()
    W = _words_per_element(t)
    seeds = lane_seeds(name or dtype_name(t.dtype), tuple(t.shape))
    lanes_of = _lanes_i64 if EXACT or not _int32_wraps(t.device) else _lanes_i32
    lanes = torch.zeros(2, dtype=torch.int64, device=t.device)
    ss = torch.zeros((), dtype=torch.float32, device=t.device)
    for o, flat in _chunks(t, max(1, CHUNK_ELEMENTS // W)):
        if flat.numel() == 0:
            continue
        l0, l1 = lanes_of(flat, o * W, seeds)
        lanes = (lanes + torch.stack([l0, l1])) & _M32
        ss = ss + (flat.abs() if flat.is_complex() else flat).to(torch.float32).square().sum()
    return lanes, ss.to(torch.float64)


def words_lanes(words: torch.Tensor, name: str) -> torch.Tensor:
    """int64[2] lanes of a tensor of uint32 values held in int64 (a stack of fingerprint lanes),
    fingerprinted as the uint32 array `name` says it is: the trainer's pytree summary."""
    seeds = lane_seeds(name, tuple(words.shape))
    return torch.stack(_mix_i64(words.reshape(-1) & _M32, 0, seeds)) & _M32


def fingerprint(t: torch.Tensor, name: str | None = None) -> int:
    """The 64-bit fingerprint (syncs: for tests and one-off checks; recorders keep the lanes)."""
    lanes, _ = lanes_and_sum_of_squares(t, name)
    l0, l1 = (int(v) for v in lanes.cpu())
    return (l0 << 32) | l1
