"""The example store's index: where each stored example's frame lies in RUN/examples/rows.bin.

Without it, opening the store reads every frame of rows.bin (the distinct examples fed,
compressed: at pretraining scale the dataset). With it, opening reads a header and one small
entry per block of the index, and finding a step's examples reads the blocks that hold their
hashes. rows.bin stays the truth: the index is a cache of it, checked before it is believed,
and rebuilt from rows.bin (by a scan) when it is missing, damaged or stale.

File RUN/examples/index.bin, format 1 (integers little-endian):

    header, 44 bytes:
      4s  magic b"RXMI"
      u32 format (1)
      u64 N, the number of entries
      u64 covered: the index describes every frame of rows.bin in bytes [0, covered)
      u64 last: offset of the last frame in [0, covered) (0 when N = 0)
      u32 that frame's crc32 field (binds the index to these rows.bin bytes, not just a length)
      u32 B, entries per block (the last block may hold fewer)
      u32 crc32 of the 40 header bytes before it and of the block table
    block table, ceil(N / B) entries of 12 bytes:
      u64 the first (smallest) hash in the block | u32 crc32 of the block's entry bytes
    entries, N of 24 bytes, sorted by hash (each hash once), in blocks of B:
      u64 example hash | u64 offset of its frame in rows.bin | u32 compressed size | u32 raw size

Stale means: the header or table fails its crc, the file's size is not the one N gives, `covered`
is past the end of rows.bin, or the
frame at `last` is not a frame ending at `covered` with that crc. Frames after `covered` (those
appended since the index was last written, e.g. before a crash) are scanned at open. A block
whose crc fails when it is first read, or an entry that points at a frame of another hash,
makes the reader drop the index and scan rows.bin instead: a damaged index costs time, never a
wrong row. Every frame read through the index is checked as the scan checks it (magic, hash,
sizes, crc32) and its rows re-hashed against the trace (examples_store.py).

Written by the recording run's ExampleWriter at close and whenever the frames appended since the
last write reach a quarter of the index (at least 65,536), as a streaming merge of the old
index with the new entries into a temporary file renamed over the old one, after rows.bin is
fsynced. A reader never writes it (a replay changes nothing in the run); a resumed writer
rebuilds a stale one at once.

Cost at a million steps of 1,024 examples, all distinct (1.0e9 entries): the index is 24 GB
(24 bytes an example, beside rows.bin's compressed rows); opening reads the 44-byte header and
a 12 MB block table (B = 1,024: 12 bytes per 1,024 examples); a step's lookup reads at most its
1,024 examples' blocks (24 KB each, cached), O(examples in the step); a rewrite streams the old
index once (24 GB) with O(B + new entries) memory, amortized O(1) per example by the quarter
rule (plus one at close). The writer also holds the set of stored hashes to skip examples fed
again (O(distinct examples) memory, as before the index; a resume reads it from the index, not
from rows.bin). A bundle's small store carries no index: it is scanned on open. Measured here
with 100,000 examples of 1 KB (71 MB of rows): opening 0.2 ms with the index, 198 ms by scan.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import Iterator

import numpy as np

from traces.errors import TraceError
from replay.record.examples_frames import frame_check

FORMAT = 1
FILE = "examples/index.bin"
MAGIC = b"RXMI"
BLOCK = 1024
_HEAD = struct.Struct("<4sIQQQII")  # the 40 bytes the header crc covers, then u32 crc
_HEAD_SIZE = _HEAD.size + 4
_TABLE = np.dtype([("first", "<u8"), ("crc", "<u4")])
ENTRY = np.dtype([("hash", "<u8"), ("offset", "<u8"), ("clen", "<u4"), ("rlen", "<u4")])
_CACHED_BLOCKS = 4096


class StaleIndex(TraceError):
    """The index does not describe rows.bin (or is damaged): rebuild it from rows.bin. Always caught
    here (the store falls back to a scan); a TraceError, exit 2, should one ever escape."""


class DiskIndex:
    """The index file, opened: header and block table in memory, blocks read (and checked) on demand."""

    def __init__(self, path: Path, count: int, covered: int, last: tuple[int, int], block: int, table: np.ndarray):
        self.path, self.count, self.covered, self.last, self.block = path, count, covered, last, block
        self.table = table
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()

    @classmethod
    def open(cls, path: Path, rows: Path) -> "DiskIndex":
        """The index at `path` for the store `rows`; StaleIndex when it is missing or does not fit."""
        if not path.is_file():
            raise StaleIndex(f"{path}: missing")
        with open(path, "rb") as f:
            head = f.read(_HEAD_SIZE)
            if len(head) < _HEAD_SIZE:
                raise StaleIndex(f"{path}: truncated header")
            magic, fmt, count, covered, last, last_crc, block = _HEAD.unpack_from(head)
            if magic != MAGIC or fmt != FORMAT or block <= 0:
                raise StaleIndex(f"{path}: not an index of format {FORMAT}")
            blocks = -(-count // block)
            table_bytes = f.read(blocks * _TABLE.itemsize)
        if len(table_bytes) != blocks * _TABLE.itemsize or path.stat().st_size != (
                _HEAD_SIZE + len(table_bytes) + count * ENTRY.itemsize):
            raise StaleIndex(f"{path}: truncated")
        if zlib.crc32(table_bytes, zlib.crc32(head[:_HEAD.size])) != struct.unpack_from("<I", head, _HEAD.size)[0]:
            raise StaleIndex(f"{path}: header checksum")
        if not frame_check(rows, last, covered, last_crc):
            raise StaleIndex(f"{path}: describes other rows.bin bytes")
        return cls(path, count, covered, (last, last_crc), block, np.frombuffer(table_bytes, _TABLE))

    def _block(self, b: int) -> np.ndarray:
        got = self._cache.get(b)
        if got is not None:
            self._cache.move_to_end(b)
            return got
        n = min(self.block, self.count - b * self.block)
        with open(self.path, "rb") as f:
            f.seek(_HEAD_SIZE + len(self.table) * _TABLE.itemsize + b * self.block * ENTRY.itemsize)
            data = f.read(n * ENTRY.itemsize)
        if len(data) != n * ENTRY.itemsize or zlib.crc32(data) != int(self.table["crc"][b]):
            raise StaleIndex(f"{self.path}: block {b} fails its checksum")
        entries = np.frombuffer(data, ENTRY)
        self._cache[b] = entries
        if len(self._cache) > _CACHED_BLOCKS:
            self._cache.popitem(last=False)
        return entries

    def find(self, hashes: np.ndarray) -> np.ndarray:
        """ENTRY rows for `hashes` (`missing` where the index has none)."""
        out = np.zeros(len(hashes), ENTRY)
        out["offset"] = np.iinfo(np.uint64).max
        if self.count == 0 or len(hashes) == 0:
            return out
        hashes = np.asarray(hashes, np.uint64)
        where = np.searchsorted(self.table["first"], hashes, side="right").astype(np.int64) - 1
        for b in np.unique(where[where >= 0]).tolist():
            at = np.flatnonzero(where == b)
            entries = self._block(b)
            i = np.minimum(np.searchsorted(entries["hash"], hashes[at]), len(entries) - 1)
            hit = entries["hash"][i] == hashes[at]
            out[at[hit]] = entries[i[hit]]
        return out

    def blocks(self) -> Iterator[np.ndarray]:
        for b in range(len(self.table)):
            yield self._block(b)


def missing(found: np.ndarray) -> np.ndarray:
    return found["offset"] == np.iinfo(np.uint64).max


def write(path: Path, chunks: Iterator[np.ndarray], count: int, covered: int, last: int, last_crc: int,
          block: int | None = None) -> None:
    """Writes the index of `count` entries, given as sorted chunks of ENTRY rows, atomically."""
    block = block or BLOCK
    blocks = -(-count // block)
    table = np.zeros(blocks, _TABLE)
    tmp = path.with_name(path.name + ".tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    written, pending, previous = 0, [], None
    with open(tmp, "wb") as f:
        f.seek(_HEAD_SIZE + blocks * _TABLE.itemsize)

        def flush(entries: np.ndarray) -> None:
            nonlocal written
            b = written // block
            table[b] = (int(entries["hash"][0]), zlib.crc32(entries.tobytes()))
            f.write(entries.tobytes())
            written += len(entries)

        for chunk in chunks:
            if len(chunk) == 0:
                continue
            if previous is not None and chunk["hash"][0] <= previous:
                raise ValueError("index entries out of order")  # a bug in the merge, never the user's
            previous = int(chunk["hash"][-1])
            pending.append(chunk)
            buf = np.concatenate(pending)
            full = len(buf) // block * block
            for start in range(0, full, block):
                flush(buf[start:start + block])
            pending = [buf[full:]] if full < len(buf) else []
        if pending:
            flush(np.concatenate(pending))
        if written != count:
            raise ValueError(f"index of {count} entries given {written}")
        head = _HEAD.pack(MAGIC, FORMAT, count, covered, last, last_crc, block)
        f.seek(0)
        f.write(head + struct.pack("<I", zlib.crc32(table.tobytes(), zlib.crc32(head))) + table.tobytes())
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def merged(old: DiskIndex | None, new: np.ndarray) -> Iterator[np.ndarray]:
    """The old index's entries and `new` (sorted, no hash of the old one), as sorted chunks."""
    new = np.sort(new, order="hash")
    j = 0
    if old is not None:
        for entries in old.blocks():
            upto = int(np.searchsorted(new["hash"], entries["hash"][-1], side="right"))
            if upto > j:
                both = np.concatenate([entries, new[j:upto]])
                yield both[np.argsort(both["hash"], kind="stable")]
                j = upto
            else:
                yield entries
    yield new[j:]
