"""Element-wise comparison of two tensors and their distances (abs, relative, ULP), for
`bisect`'s layer refinement (replay/bisect/refine.py)."""

from __future__ import annotations

import contextlib
import functools
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
    a, b = (np.asarray(jax.device_get(x) if isinstance(x, jax.Array) else x) for x in (a, b))
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


# ------------------------------------------------------------------------ on device, before any fetch

class DeviceDiff:
    """Compares pairs of tensors where they live, fetching as little as possible to the host.

    For each pair: the recording's own 64-bit fingerprint (replay/record/fingerprint.py) of both
    on device, 16 bytes to the host; equal fingerprints (and dtype and shape) count as equal
    (a false "equal" needs a 64-bit collision: odds 2**-64 a leaf). Where they differ,
    `summary` computes the row statistics on device (differing count, max ULP, max abs and
    relative distance in float32, NaN counts: ~30 bytes to the host); only `exact` fetches a
    pair, and `refine_step` calls it once, for the first differing leaf, to give today's exact
    float64 numbers and the position of the largest difference.

    Cost at 7B (OLMo 3 7B: ~7e9 float32 parameters, the same again in gradients and twice in
    Adam moments, ~112 GB a run): comparing every parameter, optimizer and gradient leaf of both
    runs moves ~16 bytes per leaf pair (a few hundred leaves: a few KB) plus ~30 bytes per
    differing leaf, and then one leaf pair: at most 2 x 1.6 GB (the 100k x 4096 embedding), a
    block weight 2 x 180 MB -- instead of every leaf of both runs (~224 GB, then float64 copies).
    Host inputs (numpy values, python scalars) are compared on the host; they move nothing.
    `fetched_bytes` / `fetched_leaves` count what came from the device.
    """

    def __init__(self) -> None:
        self.fetched_bytes = 0
        self.fetched_leaves = 0

    def _get(self, tree: Any) -> Any:
        host = jax.device_get(tree)
        self.fetched_bytes += sum(np.asarray(x).nbytes for x in jax.tree.leaves(host))
        return host

    def fingerprints(self, values: list[Any]) -> list[int | None]:
        """64-bit fingerprints of the device arrays among `values` (None for the others), in
        one jitted call and one fetch."""
        from replay.engine.replayer import _device_fingerprints

        at = [i for i, v in enumerate(values) if _on_device(v)]
        out: list[int | None] = [None] * len(values)
        if not at:
            return out
        try:
            lanes = self._get(_device_fingerprints([values[i] for i in at]))
        except (ValueError, TypeError):  # arrays on different device sets: one at a time
            lanes = [None] * len(at)
            for j, i in enumerate(at):
                with contextlib.suppress(ValueError, TypeError):
                    lanes[j] = self._get(_device_fingerprints([values[i]]))[0]
        for i, l in zip(at, lanes):
            if l is not None:
                out[i] = (int(l[0]) << 32) | int(l[1])
        return out

    def summary(self, a: Any, b: Any, fp: tuple[int | None, int | None] = (None, None)) -> dict:
        """compare_tensors' row fields (equal, share_differing, max_ulp, max_abs, dtypes, ...)
        without fetching the tensors; `fp`: their fingerprints, if already computed."""
        return self.summaries([(a, b)], [fp])[0]

    def summaries(self, pairs: list[tuple[Any, Any]], fps: list | None = None) -> list[dict]:
        """[summary(a, b, fp) for each pair and its fingerprints], the statistics of every pair
        that needs them computed in one program and one fetch: one compile for the lot, not one
        per leaf shape (a bisect's update leaves that all differ: 4 to 7 compiles on the example
        loops). The same per-pair computation either way, so the same numbers."""
        out: list = [None] * len(pairs)
        fps = list(fps) if fps is not None else [(None, None)] * len(pairs)
        pending: list[tuple[int, dict, Any, Any, bool]] = []
        for i, ((a, b), fp) in enumerate(zip(pairs, fps)):
            if not (_on_device(a) and _on_device(b)):
                out[i] = self.exact(a, b)  # on the host already (or 8-byte): little or nothing to move
                continue
            row: dict = {"shape": list(a.shape), "dtype_a": str(a.dtype), "dtype_b": str(b.dtype), "elements": int(a.size)}
            if a.shape != b.shape:
                row.update(equal=False, shape_b=list(b.shape), differing=None, share_differing=1.0,
                           max_abs=None, max_rel=None, max_ulp=None, note="shapes differ")
                out[i] = row
                continue
            if a.dtype == b.dtype:
                fa, fb = fp
                fa = self.fingerprints([a])[0] if fa is None else fa
                fb = self.fingerprints([b])[0] if fb is None else fb
                if fa is not None and fa == fb:
                    row.update(equal=True, differing=0, share_differing=0.0, max_abs=0.0, max_rel=0.0, max_ulp=0)
                    out[i] = row
                    continue
            float_ = _is_float(a.dtype) or _is_float(b.dtype)
            if not float_ and a.dtype != b.dtype:
                out[i] = self.exact(a, b)  # integers of two widths: rare, small; the host's int64 arithmetic
                continue
            pending.append((i, row, a, _beside(b, a), float_))
        for (i, row, a, b, float_), stats in zip(pending, self._stats([(a, b, f) for _, _, a, b, f in pending])):
            n_differ = int(stats["differing"])
            row.update(equal=n_differ == 0 and a.dtype == b.dtype, differing=n_differ,
                       share_differing=n_differ / a.size if a.size else 0.0, max_abs=float(stats["max_abs"]),
                       max_rel=float(stats["max_rel"]), max_ulp=int(stats["max_ulp"]), precision="float32")
            if float_ and (int(stats["nan_a"]) or int(stats["nan_b"])):
                row["nan_a"], row["nan_b"] = int(stats["nan_a"]), int(stats["nan_b"])
            out[i] = row
        return out

    def _stats(self, pending: list[tuple[Any, Any, bool]]) -> list[dict]:
        """_float_stats or _int_stats of each (a, b, is float), in one jitted call and one fetch;
        pair by pair where the pairs live on different device sets."""
        if not pending:
            return []
        try:
            return self._get(_stats_of_pairs([(a, b) for a, b, _ in pending], tuple(f for _, _, f in pending)))
        except (ValueError, TypeError):  # arrays on different device sets: one program each
            return [self._get(_float_stats(a, b) if f else _int_stats(a, b)) for a, b, f in pending]

    def exact(self, a: Any, b: Any) -> dict:
        """compare_tensors on the host (float64 distances, the position of the largest): fetches the pair."""
        if _on_device(a) or _on_device(b):
            self.fetched_leaves += 1
        a = self._get(a) if _on_device(a) else a
        b = self._get(b) if _on_device(b) else b
        return compare_tensors(a, b)


def _on_device(x: Any) -> bool:
    # 8-byte arrays (x64 off) cannot be fingerprinted on device: they are compared on the host.
    return isinstance(x, jax.Array) and x.dtype.itemsize < 8 and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _beside(b: jax.Array, a: jax.Array) -> jax.Array:
    """b on a's devices (a device-to-device copy), where the two runs' meshes put them apart."""
    if b.sharding.device_set == a.sharding.device_set:
        return b
    return jax.device_put(b, a.sharding)


def _u32_abs_diff(x: jax.Array, y: jax.Array) -> jax.Array:
    # |x - y| exactly, as uint32 (it can exceed int32's range; it never exceeds 2**32 - 1).
    ux, uy = x.astype(jnp.uint32) if x.dtype != jnp.uint32 else x, y.astype(jnp.uint32) if y.dtype != jnp.uint32 else y
    return jnp.where(x >= y, ux - uy, uy - ux)


def _float_stats_of(a: jax.Array, b: jax.Array) -> dict:
    """compare_tensors' float statistics in float32 on device; ULPs and counts exact."""
    fa, fb = a.astype(jnp.float32), b.astype(jnp.float32)
    ba, bb = jax.lax.bitcast_convert_type(fa, jnp.int32), jax.lax.bitcast_convert_type(fb, jnp.int32)
    nan_a, nan_b = jnp.isnan(fa), jnp.isnan(fb)
    ok = ~(nan_a | nan_b)
    absd = jnp.where(ok, jnp.abs(fa - fb), 0.0)
    scale = jnp.maximum(jnp.abs(fa), jnp.abs(fb))
    rel = jnp.where(ok & (scale > 0), absd / jnp.where(scale > 0, scale, 1.0), 0.0)
    lowest = jnp.int32(-(2**31))
    oa, ob = jnp.where(ba >= 0, ba, lowest - ba), jnp.where(bb >= 0, bb, lowest - bb)  # as _ordered
    ulp = jnp.where(ok, _u32_abs_diff(oa, ob), jnp.uint32(0))
    return {"differing": jnp.sum(ba != bb, dtype=jnp.int32), "max_abs": jnp.max(absd, initial=0.0),
            "max_rel": jnp.max(rel, initial=0.0), "max_ulp": jnp.max(ulp, initial=jnp.uint32(0)),
            "nan_a": jnp.sum(nan_a, dtype=jnp.int32), "nan_b": jnp.sum(nan_b, dtype=jnp.int32)}


def _int_stats_of(a: jax.Array, b: jax.Array) -> dict:
    """compare_tensors' integer statistics (same dtype) on device, exact but the relative one."""
    if a.dtype == jnp.bool_:
        a, b = a.astype(jnp.int32), b.astype(jnp.int32)
    elif a.dtype.itemsize < 4:
        a, b = a.astype(jnp.int32), b.astype(jnp.int32)
    absd = _u32_abs_diff(a, b)
    zero = jnp.zeros((), a.dtype)
    scale = jnp.maximum(_u32_abs_diff(a, zero), _u32_abs_diff(b, zero)).astype(jnp.float32)
    rel = jnp.where(scale > 0, absd.astype(jnp.float32) / jnp.where(scale > 0, scale, 1.0), 0.0)
    biggest = jnp.max(absd, initial=jnp.uint32(0))
    return {"differing": jnp.sum(a != b, dtype=jnp.int32), "max_abs": biggest, "max_rel": jnp.max(rel, initial=0.0),
            "max_ulp": biggest}


_float_stats = jax.jit(_float_stats_of)
_int_stats = jax.jit(_int_stats_of)


@functools.partial(jax.jit, static_argnums=1)
def _stats_of_pairs(pairs: list, floats: tuple[bool, ...]) -> list[dict]:
    """Each pair's _float_stats or _int_stats (the same functions), in one program."""
    return [_float_stats_of(a, b) if f else _int_stats_of(a, b) for (a, b), f in zip(pairs, floats)]
