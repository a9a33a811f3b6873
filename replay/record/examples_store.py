"""The run's example store: every distinct example's rows, keyed by its per-example hash.

`run.step` sees every batch, so it can keep what a replay without user code needs: the rows of
each example the first time it is fed (an example fed again costs nothing), under the hash the
trace records for it. The batch of step k is then rebuilt from the trace's hashes, and the
rebuilt rows are hashed again and must give those hashes (a row that does not is damage, named).
Size: the distinct examples fed, compressed, not the steps (an epoch of the data at most once).
Cost while recording: the rows of new examples copied to the host and zstd-compressed (level 3)
on the step's host thread. Opt-in, `replay.init(..., store_examples=True)`: without it a replay
needs the loop's `batch_at`, i.e. the user's code. At pretraining scale the distinct examples are
the dataset (terabytes), and opening the store scans its frame headers (no index file yet).

File RUN/examples/rows.bin, append-only, one frame per example (integers little-endian):

    u32 magic b"RXMP" | u64 example hash | u32 compressed size | u32 raw size | u32 crc32
    of the 20 header bytes before it and the compressed bytes | compressed bytes (zstd frame)

The raw bytes are the example's row of every batch leaf (moved to axis 0), in leaf order, as
the manifest's "example_store" lists them: {"format", "file", "batch_axis", "leaves": [{"path",
"dtype", "shape" (of one row)}]}. After a crash, a torn last frame is what the crash left (a
resumed run truncates it; a reader ignores it); a bad frame anywhere else is damage.
"""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import zstandard

from traces.errors import TraceError

FORMAT = 1
FILE = "examples/rows.bin"
KEY = "example_store"
MAGIC = b"RXMP"
_HEAD = struct.Struct("<4sQII")
_FRAME = _HEAD.size + 4
LEVEL = 3


class ExampleStoreError(TraceError):
    """The example store is damaged or lacks an example a replay needs (bad input, exit 2: a TraceError,
    as any damaged file of a run is)."""


def rows_of(batch: Any, batch_axis: int) -> list[tuple[str, np.ndarray]]:
    """(path, little-endian contiguous array with the examples on axis 0) of every batch leaf."""
    from replay.record.hashing import _leaves

    return [(n, np.ascontiguousarray(a.astype(a.dtype.newbyteorder("<"), copy=False)))
            for n, a in _leaves(batch, batch_axis)]


def layout_of(batch: Any, batch_axis: int) -> dict:
    """The manifest entry for batches like `batch` (arrays or jax.ShapeDtypeStructs), leaves named
    as replay.record.hashing names them."""
    import jax

    leaves = []
    for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
        shape = list(x.shape)
        del shape[batch_axis]
        leaves.append({"path": jax.tree_util.keystr(path, simple=True, separator=".") or "batch",
                       "dtype": np.dtype(x.dtype).name, "shape": shape})
    return {"format": FORMAT, "enabled": True, "file": FILE, "batch_axis": batch_axis, "leaves": leaves}


def hashes_of(leaves: list[tuple[str, np.ndarray]]) -> np.ndarray:
    """replay.record.hashing's per-example hashes of the batch these leaves form."""
    from replay.record.hashing import leaf_hashes

    return leaf_hashes(leaves)


def _frame(h: int, raw: bytes, cctx) -> bytes:
    comp = cctx.compress(raw)
    head = _HEAD.pack(MAGIC, h, len(comp), len(raw))
    return head + struct.pack("<I", zlib.crc32(comp, zlib.crc32(head))) + comp


def scan(path: Path, tolerate_tail: bool = True) -> tuple[dict[int, tuple[int, int, int]], int]:
    """({hash: (offset of the compressed bytes, compressed size, raw size)}, end of the last good
    frame). A torn last frame is left out when `tolerate_tail`; any other bad frame raises."""
    index: dict[int, tuple[int, int, int]] = {}
    size = path.stat().st_size
    with open(path, "rb") as f:
        pos = 0
        while pos < size:
            head = f.read(_FRAME)
            torn = len(head) < _FRAME
            if not torn:
                magic, h, clen, rlen = _HEAD.unpack_from(head)
                torn = magic == MAGIC and pos + _FRAME + clen > size
            if torn and tolerate_tail:
                break
            if torn or magic != MAGIC:
                raise ExampleStoreError(f"{path}: damaged example store at byte {pos} (not a frame); restore the "
                                        "run's files from a copy, or replay with your code (--allow-code)")
            comp = f.read(clen)
            if zlib.crc32(comp, zlib.crc32(head[:_HEAD.size])) != struct.unpack_from("<I", head, _HEAD.size)[0]:
                raise ExampleStoreError(f"{path}: damaged example store: the frame at byte {pos} fails its checksum; "
                                        "restore the run's files from a copy, or replay with your code (--allow-code)")
            index.setdefault(h, (pos + _FRAME, clen, rlen))
            pos += _FRAME + clen
    return index, pos


class ExampleWriter:
    """Appends the rows of examples not stored yet; opened by `replay.init` (resume: continues)."""

    def __init__(self, run_path: Path, batch_axis: int, resume: bool = False):
        self.path = Path(run_path) / FILE
        self.batch_axis = batch_axis
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.seen: set[int] = set()
        if resume and self.path.exists():
            index, end = scan(self.path)
            self.seen = set(index)
            with open(self.path, "r+b") as f:
                f.truncate(end)  # the frame a crash tore
        self._f = open(self.path, "ab")
        self._cctx = zstandard.ZstdCompressor(level=LEVEL)

    def add(self, batch: Any, hashes: np.ndarray) -> None:
        new = [i for i, h in enumerate(hashes.tolist()) if h not in self.seen]
        if not new:
            return
        leaves = rows_of(batch, self.batch_axis)
        out = []
        for i in new:
            h = int(hashes[i])
            if h in self.seen:  # twice in one batch
                continue
            self.seen.add(h)
            out.append(_frame(h, b"".join(a[i].tobytes() for _, a in leaves), self._cctx))
        self._f.write(b"".join(out))  # one write per step: a crash tears at most the last frame
        self._f.flush()

    def close(self) -> None:
        if not self._f.closed:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()


class ExampleReader:
    """The batch of a step, rebuilt from its recorded example hashes and checked against them."""

    def __init__(self, run_path: Path, entry: dict, shown: str | None = None, complete: bool = True):
        self.path = Path(run_path) / entry.get("file", FILE)
        self.shown = shown or str(self.path)
        if not self.path.is_file():
            raise ExampleStoreError(f"{self.shown}: the run's example store is missing; restore it, or replay with "
                                    "your code (--allow-code, or the entry point installed)")
        self.leaves = [(s["path"], np.dtype(s["dtype"]).newbyteorder("<"), tuple(s["shape"])) for s in entry["leaves"]]
        self.batch_axis = int(entry.get("batch_axis", 0))
        try:
            self.index, _ = scan(self.path, tolerate_tail=not complete)  # a finished run has no torn frame
        except ExampleStoreError as e:
            raise ExampleStoreError(str(e).replace(str(self.path), self.shown)) from None
        self._dctx = zstandard.ZstdDecompressor()
        self._sizes = [int(np.prod(shape, dtype=np.int64)) * dt.itemsize for _, dt, shape in self.leaves]

    def batch(self, step: int, hashes: np.ndarray) -> list[np.ndarray]:
        """The batch leaves (batch axis where it was) of the step that fed these examples."""
        rows: list[list[np.ndarray]] = [[] for _ in self.leaves]
        with open(self.path, "rb") as f:
            for pos, h in enumerate(np.asarray(hashes, np.uint64).tolist()):
                where = self.index.get(h)
                if where is None:
                    raise ExampleStoreError(f"{self.shown}: holds no rows for example {pos} of step {step} (hash "
                                            f"{h:016x}); it was not stored, so replay this step with your code")
                off, clen, rlen = where
                f.seek(off)
                try:
                    raw = self._dctx.decompress(f.read(clen), max_output_size=rlen)
                except zstandard.ZstdError as e:
                    raise ExampleStoreError(f"{self.shown}: damaged example store: example {h:016x} does not "
                                            f"decompress ({e})") from None
                if len(raw) != sum(self._sizes):
                    raise ExampleStoreError(f"{self.shown}: damaged example store: example {h:016x} holds {len(raw)} "
                                            f"bytes, its layout {sum(self._sizes)}")
                start = 0
                for j, (_, dt, shape) in enumerate(self.leaves):
                    rows[j].append(np.frombuffer(raw, dt, count=self._sizes[j] // dt.itemsize, offset=start).reshape(shape))
                    start += self._sizes[j]
        stacked = [(n, np.stack(r)) for (n, _, _), r in zip(self.leaves, rows)]
        got = hashes_of(stacked)
        want = np.asarray(hashes, np.uint64)
        if not np.array_equal(got, want):
            bad = int(np.flatnonzero(got != want)[0])
            raise ExampleStoreError(f"{self.shown}: damaged example store: the rows stored for example {bad} of step "
                                    f"{step} hash to {int(got[bad]):016x}, the trace recorded {int(want[bad]):016x}")
        return [np.moveaxis(a, 0, self.batch_axis) for _, a in stacked]

    def write_subset(self, dest: Path, hashes: set[int]) -> int:
        """Copies the frames of `hashes` (all must be here) into a new store at `dest`; their count."""
        dest.parent.mkdir(parents=True, exist_ok=True)
        missing = [h for h in hashes if h not in self.index]
        if missing:
            raise ExampleStoreError(f"{self.shown}: holds no rows for example {missing[0]:016x}, which the packed "
                                    "steps feed; pack with --lite, or a range whose examples were stored")
        with open(self.path, "rb") as src, open(dest, "wb") as out:
            for h in sorted(hashes, key=lambda h: self.index[h][0]):
                off, clen, _ = self.index[h]
                src.seek(off - _FRAME)
                out.write(src.read(_FRAME + clen))
        return len(hashes)
