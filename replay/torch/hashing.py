"""Per-example hashes of a torch batch, identical to the JAX side's for the same rows.

The rules are replay/record/hashing.py's and trainer/data.py's (FORMAT.md, "Example hashes
across frameworks"): xxh3_64 of each example's row bytes, little-endian, C order, seeded by
the dtype name and the row shape; a batch that is one tensor hashes as one array, a dict (or
list, tuple) of tensors by the pytree rule. One canonical change on the way: int64 leaves are
hashed as int32 (torch indexes embeddings with int64, a JAX device holds the same tokens as
int32), so the token rows a torch loop feeds hash like the trainer's int32 rows. The batch
hash is replay/record/hashing.py's batch_hash (that module imports no JAX at module level, so
replay.torch can share the one definition).

Cost per step: one device-to-host copy of the batch (its token rows, a few KB to MB) and one
xxh3 call per example.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import xxhash

from replay.record.hashing import batch_hash  # noqa: F401 (the one definition; replay.torch exports it)
from replay.torch.errors import TorchRecordError
from replay.torch.fingerprint import dtype_name

_INT32 = (-(2**31), 2**31 - 1)


def _flatten(batch: Any, path: tuple[str, ...] = ()) -> list[tuple[str, torch.Tensor]]:
    """(dotted path, tensor) leaves in jax.tree_util's order: dict keys sorted, sequences by index."""
    if isinstance(batch, torch.Tensor):
        return [(".".join(path), batch)]
    if isinstance(batch, dict):
        return [leaf for k in sorted(batch) for leaf in _flatten(batch[k], path + (str(k),))]
    if isinstance(batch, (list, tuple)):
        return [leaf for i, x in enumerate(batch) for leaf in _flatten(x, path + (str(i),))]
    where = ".".join(path) or "the batch"
    raise TorchRecordError(f"{where} is a {type(batch).__name__}, not a tensor; run.step(batch) takes the step's "
                           "token rows as a tensor (or a dict, list or tuple of tensors) with the examples on axis 0")


def canonical_rows(t: torch.Tensor, name: str) -> tuple[np.ndarray, str]:
    """(uint8 [B, row bytes] little-endian C order, dtype name for the seed) of one leaf."""
    t = t.detach()
    if t.dim() == 0:
        raise TorchRecordError(f"batch leaf {name or 'batch'} is a scalar; every batch leaf needs the examples on axis 0")
    if t.dtype == torch.int64:
        lo, hi = (int(v) for v in torch.aminmax(t)) if t.numel() else (0, 0)
        if lo < _INT32[0] or hi > _INT32[1]:
            raise TorchRecordError(f"batch leaf {name or 'batch'} holds int64 values outside int32 ({lo}..{hi}); "
                                   "example hashes take token ids as int32: feed ids that fit, or another dtype")
        t = t.to(torch.int32)
    if t.is_complex() or t.dtype.is_floating_point and t.element_size() not in (2, 4, 8):
        raise TorchRecordError(f"batch leaf {name or 'batch'} has dtype {dtype_name(t.dtype)}; hash token rows "
                               "(integers) or float16/bfloat16/float32/float64 tensors")
    host = t.cpu().contiguous()
    n = host.element_size()
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[n]
    a = host.view(view).numpy().astype(np.dtype(f"<i{n}") if n > 1 else np.uint8, copy=False)
    return a.reshape(a.shape[0], -1).view(np.uint8).reshape(a.shape[0], -1), dtype_name(t.dtype)


def example_hashes(batch: Any) -> np.ndarray:
    """uint64[B]: one hash per example (index along axis 0), in batch order."""
    leaves = _flatten(batch)
    if not leaves:
        raise TorchRecordError("the batch has no tensors; pass the step's token rows to run.step(batch)")
    rows = []
    for name, t in leaves:
        data, dt = canonical_rows(t, name)
        rows.append((name, data, dt, tuple(int(d) for d in t.shape[1:])))
    sizes = {name or "batch": data.shape[0] for name, data, _, _ in rows}
    if len(set(sizes.values())) != 1:
        raise TorchRecordError("the batch leaves disagree on the batch size along axis 0: "
                               + ", ".join(f"{n}={s}" for n, s in sizes.items()))
    if len(rows) == 1 and rows[0][0] in ("", "batch"):  # one array: trainer.data.example_hashes, bit for bit
        # ("batch" too: replay/record/hashing.py names a lone root leaf "batch", so {"batch": x} hashes alike)
        _, data, dt, shape = rows[0]
        seed = xxhash.xxh3_64_intdigest(f"{dt}{shape}".encode())
    else:
        seed = xxhash.xxh3_64_intdigest(";".join(f"{n}={dt}{shape}" for n, _, dt, shape in rows).encode())
        data = np.concatenate([d for _, d, _, _ in rows], axis=1)
    return np.array([xxhash.xxh3_64_intdigest(row, seed=seed) for row in data], np.uint64)


