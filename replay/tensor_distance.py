"""Element-wise comparison of two tensors and their distances (abs, relative, ULP), for
`bisect`'s layer refinement (replay/bisect/refine.py)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def _is_float(dtype: np.dtype) -> bool:
    return bool(jnp.issubdtype(dtype, jnp.floating))


def _ordered(bits: np.ndarray, width: int) -> np.ndarray:
    """Sign-magnitude float bits (as signed ints) mapped onto a monotonic integer line."""
    i = bits.astype(np.int64)
    return np.where(i >= 0, i, -(2 ** (width - 1)) - i) if width < 64 else np.where(i >= 0, i, np.int64(-(2**63)) - i)


def compare_tensors(a: Any, b: Any) -> dict:
    """Element-wise comparison of two tensors: equal (bits and dtype), the share of elements
    whose bits differ, and max abs, relative and ULP distance (where the max ULP is, with both
    values). Floats of different dtypes (bfloat16 vs float32) compare as float32 values and
    never count as equal; ULPs are counted in the wider of the two dtypes."""
    a, b = np.asarray(jax.device_get(a)), np.asarray(jax.device_get(b))
    out: dict = {"shape": list(a.shape), "dtype_a": str(a.dtype), "dtype_b": str(b.dtype), "elements": int(a.size)}
    if a.shape != b.shape:
        out.update(equal=False, shape_b=list(b.shape), differing=None, share_differing=1.0,
                   max_abs=None, max_rel=None, max_ulp=None, note="shapes differ")
        return out
    if _is_float(a.dtype) or _is_float(b.dtype):
        wide = np.float64 if np.dtype(np.float64) in (a.dtype, b.dtype) else np.float32
        bits_t, width = (np.int64, 64) if wide is np.float64 else (np.int32, 32)
        fa, fb = a.astype(wide), b.astype(wide)
        differ = fa.view(bits_t) != fb.view(bits_t)
        nan = np.isnan(fa) | np.isnan(fb)
        ok = ~nan
        absd = np.where(ok, np.abs(fa.astype(np.float64) - fb.astype(np.float64)), 0.0)
        scale = np.maximum(np.abs(fa.astype(np.float64)), np.abs(fb.astype(np.float64)))
        rel = np.where(ok & (scale > 0), absd / np.where(scale > 0, scale, 1.0), 0.0)
        oa, ob = _ordered(fa.view(bits_t), width), _ordered(fb.view(bits_t), width)
        ulp = np.where(ok, np.abs(oa.astype(np.float64) - ob.astype(np.float64)) if width == 64 else np.abs(oa - ob), 0)
        if nan.any():
            out["nan_a"], out["nan_b"] = int(np.isnan(fa).sum()), int(np.isnan(fb).sum())
    elif a.dtype.kind in "iub" and b.dtype.kind in "iub":
        ia, ib = a.astype(np.int64), b.astype(np.int64)
        differ = ia != ib
        absd = np.abs(ia - ib).astype(np.float64)
        scale = np.maximum(np.abs(ia), np.abs(ib)).astype(np.float64)
        rel = np.where(scale > 0, absd / np.where(scale > 0, scale, 1.0), 0.0)
        ulp = absd
    else:  # anything else: bytes only
        differ = np.asarray(a.tobytes() != b.tobytes()).reshape((1,) * a.ndim) if a.size else np.zeros(a.shape, bool)
        absd = rel = ulp = np.zeros(differ.shape)
    n_differ = int(np.count_nonzero(differ))
    out.update(equal=n_differ == 0 and a.dtype == b.dtype, differing=n_differ,
               share_differing=n_differ / a.size if a.size else 0.0,
               max_abs=float(absd.max()) if absd.size else 0.0, max_rel=float(rel.max()) if rel.size else 0.0,
               max_ulp=int(ulp.max()) if ulp.size else 0)
    if n_differ and a.size:
        where = np.unravel_index(int(np.argmax(np.where(differ, ulp, -1))), a.shape)
        out.update(at=[int(i) for i in where], a_value=_scalar(a[where]), b_value=_scalar(b[where]))
    return out


def _scalar(x: Any) -> float | int:
    x = np.asarray(x)
    return int(x) if x.dtype.kind in "iub" else float(x.astype(np.float64))


def _brief(name: str, d: dict) -> dict:
    """One row of a `compared` list."""
    row = {"name": name, "equal": bool(d["equal"])}
    if not d["equal"]:
        row.update(share_differing=d["share_differing"], max_ulp=d["max_ulp"], max_abs=d["max_abs"])
        if d["dtype_a"] != d["dtype_b"]:
            row.update(dtype_a=d["dtype_a"], dtype_b=d["dtype_b"])
    return row
