"""The run's example store: every distinct example's rows, keyed by its per-example hash.

`run.step` sees every batch, so it can keep what a replay without user code needs: the rows of
each example the first time it is fed (an example fed again costs nothing), under the hash the
trace records for it. The batch of step k is then rebuilt from the trace's hashes, and the
rebuilt rows are hashed again and must give those hashes (a row that does not is damage, named).
Size: the distinct examples fed, compressed, not the steps (an epoch of the data at most once).
Cost while recording: the rows of new examples copied to the host and zstd-compressed (level 3)
on the step's host thread. Opt-in, `replay.init(..., store_examples=True)`: without it a replay
needs the loop's `batch_at`, i.e. the user's code. At pretraining scale the distinct examples are
the dataset (terabytes): opening reads the index (replay/record/examples_index.py, with its
format and its cost at a million steps), not rows.bin, and rebuilding a step's batch reads that
step's frames only. A store without a valid index (a bundle's, or after damage) is scanned.

File RUN/examples/rows.bin, append-only, one frame per example (integers little-endian):

    u32 magic b"RXMP" | u64 example hash | u32 compressed size | u32 raw size | u32 crc32
    of the 20 header bytes before it and the compressed bytes | compressed bytes (zstd frame)

The raw bytes are the example's row of every batch leaf (moved to axis 0), in leaf order, as
the manifest's "example_store" lists them: {"format", "file", "batch_axis", "leaves": [{"path",
"dtype", "shape" (of one row)}]}. After a crash, a torn last frame is what the crash left (a
resumed run truncates it; a reader ignores it); a bad frame anywhere else is damage, reported
when a replay reads it (through the index) or when a scan passes it.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
import zstandard

from replay.record import examples_index as ix
from traces.checksum import crc32
from traces.errors import TraceError
import contextlib
from replay.record.examples_frames import HEAD as _HEAD, MAGIC, SIZE as _FRAME  # the frame layout

FORMAT = 1
FILE = "examples/rows.bin"
KEY = "example_store"
LEVEL = 3
PERIOD = 1 << 16  # the index is rewritten when this many frames (and a quarter of it) are new
_DAMAGED = "restore the run's files from a copy, or replay with your code (--allow-code)"


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
    return head + struct.pack("<I", crc32(comp, crc32(head))) + comp


def scan(path: Path, tolerate_tail: bool = True, start: int = 0) -> tuple[dict[int, tuple[int, int, int]], int]:
    """({hash: (offset of the compressed bytes, compressed size, raw size)}, end of the last good
    frame) of the frames from byte `start` on. A torn last frame is left out when `tolerate_tail`;
    any other bad frame raises."""
    index, end, _last = _scan(path, tolerate_tail, start)
    return index, end


def _scan(path: Path, tolerate_tail: bool, start: int) -> tuple[dict[int, tuple[int, int, int]], int, tuple[int, int]]:
    """scan's result and (offset, crc32 field) of the last good frame ((0, 0): none after `start`)."""
    index: dict[int, tuple[int, int, int]] = {}
    size = path.stat().st_size
    last = (0, 0)
    with open(path, "rb") as f:
        f.seek(start)
        pos = start
        while pos < size:
            head = f.read(_FRAME)
            torn = len(head) < _FRAME
            if not torn:
                magic, h, clen, rlen = _HEAD.unpack_from(head)
                torn = magic == MAGIC and pos + _FRAME + clen > size
            if torn and tolerate_tail:
                break
            if torn or magic != MAGIC:
                raise ExampleStoreError(f"{path}: damaged example store at byte {pos} (not a frame); {_DAMAGED}")
            comp = f.read(clen)
            crc = struct.unpack_from("<I", head, _HEAD.size)[0]
            if crc32(comp, crc32(head[:_HEAD.size])) != crc:
                raise ExampleStoreError(f"{path}: damaged example store: the frame at byte {pos} fails its checksum; "
                                        f"{_DAMAGED}")
            index.setdefault(h, (pos + _FRAME, clen, rlen))
            last = (pos, crc)
            pos += _FRAME + clen
    return index, pos, last


def _entries(frames: dict[int, tuple[int, int, int]] | list[tuple[int, int, int, int]]) -> np.ndarray:
    """ENTRY rows (examples_index.py) of scan's {hash: (compressed offset, clen, rlen)} or of
    (hash, frame offset, clen, rlen) tuples."""
    rows = ([(h, off - _FRAME, c, r) for h, (off, c, r) in frames.items()] if isinstance(frames, dict) else frames)
    return np.array(rows, ix.ENTRY) if rows else np.zeros(0, ix.ENTRY)


class _Frames:
    """Where each stored example's frame is: the index (if it fits rows.bin) for the frames it
    covers, a scan for the frames after them, or a scan of the whole store without an index."""

    def __init__(self, rows: Path, tolerate_tail: bool):
        self.rows, self.tolerate_tail = rows, tolerate_tail
        try:
            self.disk: ix.DiskIndex | None = ix.DiskIndex.open(rows.with_name(Path(ix.FILE).name), rows)
        except ix.StaleIndex:
            self.disk = None
        self.tail, self.end, self.last = _scan(rows, tolerate_tail, self.disk.covered if self.disk else 0)
        if self.disk is not None and self.last == (0, 0):
            self.last = self.disk.last

    def rescan(self) -> None:
        """Drop the index (it did not describe rows.bin) and scan every frame."""
        self.disk = None
        self.tail, self.end, self.last = _scan(self.rows, self.tolerate_tail, 0)

    def find(self, hashes: list[int]) -> list[tuple[int, int, int] | None]:
        """(offset of the compressed bytes, compressed size, raw size) of each hash, None if not stored."""
        out = [self.tail.get(h) for h in hashes]
        todo = [i for i, w in enumerate(out) if w is None]
        if self.disk is not None and todo:
            found = self.disk.find(np.array([hashes[i] for i in todo], np.uint64))
            hit = ~ix.missing(found)
            for i, e, ok in zip(todo, found, hit):
                if ok:
                    out[i] = (int(e["offset"]) + _FRAME, int(e["clen"]), int(e["rlen"]))
        return out


class ExampleWriter:
    """Appends the rows of examples not stored yet, and keeps the index (examples_index.py) of
    them; opened by `replay.init` (resume: continues, truncating a torn last frame, rebuilding a
    stale index). It holds the set of stored hashes (8 bytes and Python's set overhead each)."""

    def __init__(self, run_path: Path, batch_axis: int, resume: bool = False):
        self.path = Path(run_path) / FILE
        self.index_path = Path(run_path) / ix.FILE
        self.batch_axis = batch_axis
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.seen: set[int] = set()
        self._disk: ix.DiskIndex | None = None
        self._new: list[tuple[int, int, int, int]] = []  # (hash, frame offset, clen, rlen) not in the index yet
        self._last = (0, 0)  # (offset, crc32 field) of the last frame
        self._pos = 0
        if self.path.exists():  # resuming (content-addressed: continuing a store is always right)
            frames = _Frames(self.path, tolerate_tail=True)
            try:
                for block in frames.disk.blocks() if frames.disk is not None else ():
                    self.seen.update(block["hash"].tolist())
            except ix.StaleIndex:  # a damaged block: rows.bin is the truth
                self.seen = set()
                frames.rescan()
            with open(self.path, "r+b") as f:
                f.truncate(frames.end)  # the frame a crash tore
            self._disk, self._pos, self._last = frames.disk, frames.end, frames.last
            self._new = [(h, off - _FRAME, c, r) for h, (off, c, r) in frames.tail.items()]
            self.seen.update(frames.tail)
            if self._disk is None and self._new:
                self._write_index()  # stale or missing: rebuilt from rows.bin now
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
            raw = b"".join(a[i].tobytes() for _, a in leaves)
            frame = _frame(h, raw, self._cctx)
            self._new.append((h, self._pos, len(frame) - _FRAME, len(raw)))
            self._last = (self._pos, struct.unpack_from("<I", frame, _HEAD.size)[0])
            self._pos += len(frame)
            out.append(frame)
        self._f.write(b"".join(out))  # one write per step: a crash tears at most the last frame
        self._f.flush()
        if len(self._new) >= max(PERIOD, (self._disk.count if self._disk else 0) // 4):
            self._write_index()

    def _write_index(self) -> None:
        """Merges the new frames into the index file; rows.bin is on disk first, so the index never
        covers bytes a power loss could take back."""
        f = getattr(self, "_f", None)
        if f is not None and not f.closed:
            f.flush()
            os.fsync(f.fileno())
        count = (self._disk.count if self._disk else 0) + len(self._new)
        ix.write(self.index_path, ix.merged(self._disk, _entries(self._new)), count, self._pos, *self._last)
        self._disk = ix.DiskIndex.open(self.index_path, self.path)
        self._new = []

    def close(self) -> None:
        if not self._f.closed:
            self._f.flush()
            os.fsync(self._f.fileno())
            if self._new or not self.index_path.exists():
                self._write_index()
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
        with self._named():
            self.frames = _Frames(self.path, tolerate_tail=not complete)  # a finished run has no torn frame
        self._dctx = zstandard.ZstdDecompressor()
        self._sizes = [int(np.prod(shape, dtype=np.int64)) * dt.itemsize for _, dt, shape in self.leaves]

    def _named(self):
        """Errors name the store as the user knows it (a bundle member, not a temporary path)."""
        @contextlib.contextmanager
        def naming():
            try:
                yield
            except ExampleStoreError as e:
                raise ExampleStoreError(str(e).replace(str(self.path), self.shown)) from None

        return naming()

    @staticmethod
    def _read(f, h: int, where: tuple[int, int, int]) -> bytes | str:
        """Example `h`'s whole frame, checked as a scan checks it; else "elsewhere" (no frame of
        `h` there: the index does not describe rows.bin) or "damaged" (its frame fails its crc)."""
        off, clen, rlen = where
        f.seek(off - _FRAME)
        data = f.read(_FRAME + clen)
        if len(data) < _FRAME + clen or _HEAD.unpack_from(data) != (MAGIC, h, clen, rlen):
            return "elsewhere"
        if crc32(data[_FRAME:], crc32(data[:_HEAD.size])) != struct.unpack_from("<I", data, _HEAD.size)[0]:
            return "damaged"
        return data

    def _frames_of(self, what: str, hashes: list[int], advice: str) -> list[bytes]:
        """The checked frames of `hashes`, in order; `what` names them in errors ("step 7"), `advice`
        says what to do when one was not stored."""
        try:
            where = self.frames.find(hashes)
        except ix.StaleIndex:  # a block of the index is damaged: rows.bin is the truth
            with self._named():
                self.frames.rescan()
            where = self.frames.find(hashes)
        for pos, (h, w) in enumerate(zip(hashes, where)):
            if w is None:
                raise ExampleStoreError(f"{self.shown}: holds no rows for example {pos} of {what} (hash {h:016x}); "
                                        f"{advice}")
        with open(self.path, "rb") as f:
            out = [self._read(f, h, w) for h, w in zip(hashes, where)]
        bad = next((i for i, c in enumerate(out) if c == "damaged"), None)
        if bad is not None:  # the frame is the example's (magic, hash, sizes) but its bytes changed
            raise ExampleStoreError(f"{self.shown}: damaged example store: the frame at byte {where[bad][0] - _FRAME} "
                                    f"(example {bad} of {what}) fails its checksum; {_DAMAGED}")
        if any(c == "elsewhere" for c in out):
            if self.frames.disk is None:  # a scan found these frames there: the file changed since
                raise ExampleStoreError(f"{self.shown}: the example store changed while it was read; {_DAMAGED}")
            with self._named():  # the index did not describe rows.bin: rows.bin is the truth
                self.frames.rescan()
            return self._frames_of(what, hashes, advice)
        return out  # type: ignore[return-value]

    def batch(self, step: int, hashes: np.ndarray) -> list[np.ndarray]:
        """The batch leaves (batch axis where it was) of the step that fed these examples."""
        keys = np.asarray(hashes, np.uint64).tolist()
        rows: list[list[np.ndarray]] = [[] for _ in self.leaves]
        frames = self._frames_of(f"step {step}", keys, "it was not stored, so replay this step with your code")
        for h, frame in zip(keys, frames):
            try:
                raw = self._dctx.decompress(frame[_FRAME:], max_output_size=_HEAD.unpack_from(frame)[3])
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
        """Copies the frames of `hashes` (all must be here) into a new store at `dest`; their count.
        (A bundle's store is small: it carries no index and is scanned when opened.)"""
        dest.parent.mkdir(parents=True, exist_ok=True)
        keys = sorted(hashes)
        frames = self._frames_of("the packed steps", keys, "pack with --lite, or a range whose examples were stored")
        with open(dest, "wb") as out:
            out.write(b"".join(frames))
        return len(keys)
