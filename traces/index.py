"""The segment index: a sidecar file written when a segment is sealed (FORMAT.md, "Segment index").

It holds what commands scan, so they need not read the segment: each record's frame offset
and checksum, its fixed scalar fields (flags, rng, batch hash, metrics) and a key of its
example hashes, each column checksummed alone, a summary of the columns (how two runs'
segments are compared without reading them), every example hash of the segment sorted,
with its slot, in checksummed blocks (the hash's top bits in a bucket table:
traces/index_table.py), and a filter of those hashes (traces/filter.py):
"where was this example fed" is one 64-byte filter block a segment, and a table block
where the filter says "maybe". It is derived data: a missing, stale or damaged index is
rebuilt in memory from its segment (`MemoryIndex`), which costs reading the segment once;
`IndexBuilder.write` persists one. traces/index_file.py reads the files. A compacted segment's
index (version 4, traces/compaction.py) is the exception: its records no longer hold their
example hashes, so it holds their only copy, with each slot's hash top bits in slot order and
a leaner filter (8 bits an example), and cannot be rebuilt.

Sizes at 1,024 examples a step and 16,384 records a segment: ~50 bytes a step of columns,
9 bytes an example in the table (12 before version 3) and 1.6 in the filter (version 4: 2 more
of slot order, 1 of filter, and the records 8 smaller); ~1.4 MB of
columns and block heads and 27 MB of filter a segment; writing one costs ~3-4 s on the
writer's seal thread (not the loop's), in ~6 bytes an example of working memory beyond the
hashes the builder holds (which become the sort key): less than the file it writes.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from traces.checksum import crc32
from traces import filter as example_filter
from traces import index_table
from traces.errors import SchemaError, TraceCorruptError
from traces.schema import METRIC_DTYPES, Schema
from traces.sorting import sorted_chunks, stable_argsort

INDEX_SUFFIX = ".idx"
INDEX_MAGIC = b"RPLYIDX1"
INDEX_VERSION = 4  # the newest read. 4: a compacted segment's (its only copy of the example hashes: the table,
# the slot order's top bits, a leaner filter); 3: the table's hash top bits in a bucket table
# (traces/index_table.py), what a segment holding its hashes gets; 2 and 1 are still read
DERIVED_INDEX_VERSION = 3  # what an uncompacted segment's index is written as
BLOCK_ENTRIES = 256
TABLE_CHUNK_BLOCKS = 256  # blocks built at once when writing (0.8 MB)
_SCAN_CHUNK = 1 << 20  # examples searched at once in memory (bounds the working arrays to ~20 MB)
# magic, version, k (version 3: the hash bits the bucket table stands for; 0 before), schema digest, first
# step, record count, segment content crc, block entries,
# segment size, crc of the columns, crc of the block heads, reserved; then a crc of these 60 bytes
_IHEAD = struct.Struct("<8sHHIQQIIQIII")
INDEX_HEADER_SIZE_V1 = _IHEAD.size + 4
# version 2 goes on: crc32 of each column, the segment summary (16 bytes), the filter's block count, 0;
# then a crc of all the preceding 116 bytes
_IHEAD_EXT = struct.Struct("<7I16sQI")
INDEX_HEADER_SIZE = _IHEAD.size + _IHEAD_EXT.size + 4
COLUMN_NAMES = ("offsets", "frame_crc", "flags", "rng", "batch_hash", "metric_bits", "examples_key")
SUMMARY_COLUMNS = COLUMN_NAMES[1:]  # what traces.compare compares; offsets only say where frames lie
_MIX_SEED = 0x5EED1DE8  # examples_key's per-position multipliers: splitmix64(j + seed) | 1


class IndexUnusable(TraceCorruptError):
    """An index file that cannot stand in for its segment (stale, damaged, newer). The reader
    catches it and rebuilds the index from the segment; it reaches no user (if it did, it would
    be what it is: a damaged file of the run, exit 2)."""


def index_path(segment: Path) -> Path:
    return segment.with_suffix(INDEX_SUFFIX)


def record_prefix(schema: Schema) -> np.dtype:
    """The fixed fields every record starts with, whatever its flags (FORMAT.md, Record)."""
    bits = METRIC_DTYPES[schema.metric_dtype][1]
    return np.dtype([("step", "<u8"), ("flags", "u1"), ("rng", "<u4", (schema.rng_words,)), ("batch_hash", "<u8"),
                     ("example_hashes", "<u8", (schema.examples_per_step,)), ("metrics", bits, (len(schema.metrics),))])


def splitmix64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def examples_key(hashes_nxB: np.ndarray) -> np.ndarray:
    """sum_j hash_j * (splitmix64(j + seed) | 1) mod 2**64 per row: equal rows, equal keys."""
    n, B = hashes_nxB.shape
    mix = splitmix64(np.arange(B, dtype=np.uint64) + np.uint64(_MIX_SEED)) | np.uint64(1)
    out = np.empty(n, np.uint64)
    for lo in range(0, n, 1024):
        out[lo : lo + 1024] = (hashes_nxB[lo : lo + 1024] * mix).sum(axis=1, dtype=np.uint64)
    return out


@dataclass
class StepColumns:
    """The scalar columns of a segment's records (row i is step first_step + i)."""

    first_step: int
    offsets: np.ndarray  # uint64 (n + 1): frame i's byte offset; the last is where the seal (or the file) ends
    frame_crc: np.ndarray  # uint32 (n)
    flags: np.ndarray  # uint8 (n)
    rng: np.ndarray  # uint32 (n, rng_words)
    batch_hash: np.ndarray  # uint64 (n)
    metric_bits: np.ndarray  # uint32 or uint64 (n, metrics): exact bits
    examples_key: np.ndarray  # uint64 (n)

    def __len__(self) -> int:
        return int(self.frame_crc.size)


def _column_layout(schema: Schema, n: int) -> tuple[list[tuple[str, np.dtype, tuple, int]], int]:
    bits = METRIC_DTYPES[schema.metric_dtype][1]
    fields = [("offsets", np.dtype("<u8"), (n + 1,)), ("frame_crc", np.dtype("<u4"), (n,)), ("flags", np.dtype("u1"), (n,)),
              ("rng", np.dtype("<u4"), (n, schema.rng_words)), ("batch_hash", np.dtype("<u8"), (n,)),
              ("metric_bits", bits, (n, len(schema.metrics))), ("examples_key", np.dtype("<u8"), (n,))]
    out, pos = [], 0
    for name, dtype, shape in fields:
        out.append((name, dtype, shape, pos))
        pos += index_table.pad8(dtype.itemsize * int(np.prod(shape)))
    return out, pos


def encode_columns(schema: Schema, cols: StepColumns) -> bytes:
    layout, size = _column_layout(schema, len(cols))
    buf = bytearray(size)
    for name, dtype, shape, pos in layout:
        raw = np.ascontiguousarray(getattr(cols, name), dtype).tobytes()
        buf[pos : pos + len(raw)] = raw
    return bytes(buf)


def column_spans(schema: Schema, n: int) -> dict[str, tuple[np.dtype, tuple, int, int]]:
    """name -> (dtype, shape, offset in the columns, bytes) of each column (without its padding)."""
    layout, _ = _column_layout(schema, n)
    return {name: (dtype, shape, pos, dtype.itemsize * int(np.prod(shape))) for name, dtype, shape, pos in layout}


def summary(schema: Schema, columns: bytes, n: int) -> bytes:
    """The segment summary: blake2b-128 of the SUMMARY_COLUMNS' bytes, in order. Two segments
    with equal summaries hold records that traces.compare cannot tell apart by their columns."""
    spans = column_spans(schema, n)
    h = hashlib.blake2b(digest_size=16)
    for name in SUMMARY_COLUMNS:
        _, _, pos, size = spans[name]
        h.update(memoryview(columns)[pos : pos + size])
    return h.digest()


def decode_columns(schema: Schema, data: bytes, first_step: int, n: int) -> StepColumns:
    layout, _ = _column_layout(schema, n)
    parts = {name: np.frombuffer(data, dtype, int(np.prod(shape)), pos).reshape(shape) for name, dtype, shape, pos in layout}
    return StepColumns(first_step, **parts)


def _rows_in_small_pages(rows: int, width: int) -> np.ndarray:
    """An uninitialised uint64 [rows, width] array whose memory the kernel backs 4 KB at a time
    as the rows fill. numpy asks for transparent huge pages for arrays of 4 MB or more, and then
    the first write into each 2 MB zeroes a whole huge page on the thread that writes it: the
    training loop's, for the builder of the segment being appended to (20-70 ms a fault on this
    project's VM, every 256 records at 1,024 examples a step: bench.seal_pause)."""
    if rows * width == 0:
        return np.empty((rows, width), np.uint64)
    pages = mmap.mmap(-1, rows * width * 8, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:  # also where transparent huge pages are on for every mapping
        pages.madvise(mmap.MADV_NOHUGEPAGE)
    except (AttributeError, OSError):  # not Linux, or a kernel without them
        pass
    return np.frombuffer(pages, np.uint64).reshape(rows, width)


class IndexBuilder:
    """Collects a segment's records (their fixed fields) as they are written or re-read.

    Holds ~50 bytes a record, plus 8 bytes an example when `keep_hashes` (what the sorted
    table and the in-memory search need; 134 MB for a full segment of 1,024-example steps).
    """

    def __init__(self, schema: Schema, first_step: int, capacity: int = 64, keep_hashes: bool = True):
        self.schema, self.first_step, self.keep_hashes = schema, first_step, keep_hashes
        B = schema.examples_per_step
        self.prefix = record_prefix(schema)
        self._hash_at = self.prefix.fields["example_hashes"][1]
        self._hash_end = self._hash_at + 8 * B
        self.small = np.dtype([(n, self.prefix.fields[n][0]) for n in self.prefix.names if n != "example_hashes"])
        self._buf = bytearray()
        self._hashes = _rows_in_small_pages(max(capacity, 1) if keep_hashes else 0, B)  # pages used as filled
        self._keys: list[int] = []
        self._mix = splitmix64(np.arange(B, dtype=np.uint64) + np.uint64(_MIX_SEED)) | np.uint64(1)
        self._offsets: list[int] = []
        self._crcs: list[int] = []
        self.crc = 0  # set by TraceReader.index_builder: crc32 of the segment's bytes it read

    def __len__(self) -> int:
        return len(self._offsets)

    def add(self, raw, offset: int, crc: int) -> None:
        """`raw`: the record's uncompressed bytes (at least its fixed fields)."""
        n = len(self)
        if len(raw) < self.prefix.itemsize:
            raise SchemaError(f"step {self.first_step + n}: record is shorter than its schema's fixed fields")
        self._buf += raw[: self._hash_at]
        self._buf += raw[self._hash_end : self.prefix.itemsize]
        row = np.frombuffer(raw, np.uint64, self.schema.examples_per_step, self._hash_at)
        if self.keep_hashes:
            if n == self._hashes.shape[0]:
                grown = _rows_in_small_pages(2 * n, self._hashes.shape[1])
                grown[:n] = self._hashes
                self._hashes = grown
            self._hashes[n] = row
        else:
            self._keys.append(int((row * self._mix).sum(dtype=np.uint64)))
        self._offsets.append(offset)
        self._crcs.append(crc)

    def hashes(self) -> np.ndarray:
        return self._hashes[: len(self)]

    def columns(self, end_offset: int) -> StepColumns:
        rows = np.frombuffer(self._buf, self.small, len(self))
        keys = examples_key(self.hashes()) if self.keep_hashes else np.array(self._keys, np.uint64)
        return StepColumns(
            self.first_step, np.array(self._offsets + [end_offset], np.uint64), np.array(self._crcs, np.uint32),
            rows["flags"].copy(), rows["rng"].copy(), rows["batch_hash"].copy(), rows["metrics"].copy(), keys)

    def memory_index(self, end_offset: int) -> "MemoryIndex":
        return MemoryIndex(self.columns(end_offset), self.hashes() if self.keep_hashes else None)

    def frames(self, end_offset: int) -> tuple[list[int], list[int]]:
        """(the records' frame offsets and where the last ends, their frame checksums)."""
        return self._offsets + [end_offset], list(self._crcs)

    def rebind(self, offsets: list[int], crcs: list[int]) -> None:
        """The frames' new offsets and checksums (a compacted segment's: traces/compaction.py)."""
        self._offsets, self._crcs = list(offsets), list(crcs)

    def write(self, path: Path, end_offset: int, content_crc: int, segment_size: int, consume: bool = False,
              compacted: bool = False) -> None:
        """Writes the index file atomically (tmp, fsync, rename): a reader sees all of it or none.
        The sorted table comes TABLE_CHUNK_BLOCKS blocks at a time (traces.sorting.sorted_chunks),
        each written, counted into the bucket table and added to the filter as it comes: 12 bytes
        an example of working memory (the sort key, and the low bits of each hash it drops) and
        the filter, less than the file. consume=True: the builder's own hashes become the key (8
        of the 12), and the builder cannot be used after (the writer's seal). compacted=True: the
        index of a compacted segment (version 4: its records hold no hashes), with each slot's top
        bits after the table and the leaner filter."""
        schema, K = self.schema, BLOCK_ENTRIES
        columns = encode_columns(schema, self.columns(end_offset))  # before the hashes are consumed
        flat = np.ascontiguousarray(self.hashes()).reshape(-1)
        if consume:
            self._hashes = None
        E = flat.size
        version = INDEX_VERSION if compacted else DERIVED_INDEX_VERSION
        lay = index_table.TableLayout(E, K, index_table.prefix_bits(E))
        tops = index_table.encode_tops(lay, flat) if compacted else np.zeros((0, 1), np.uint8)  # before the sort
        block_crc = np.zeros(lay.blocks, "<u4")
        counts = np.zeros(lay.buckets, np.int64)
        bloom = example_filter.Builder(E, version)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.seek(INDEX_HEADER_SIZE + len(columns) + lay.heads_size)
            b0 = 0
            for part_h, part_s in sorted_chunks(flat, TABLE_CHUNK_BLOCKS * K, consume):
                table = index_table.encode_blocks(lay, part_h, part_s)
                block_crc[b0 : b0 + table.shape[0]] = example_filter.crc_rows(table, lay.block_bytes)
                counts += index_table.count_buckets(lay, part_h)
                f.write(memoryview(table).cast("B"))
                bloom.add(part_h)
                b0 += table.shape[0]
            del flat  # consumed: the sort key goes before the filter's checksums and the fsync
            if tops.size:
                f.write(memoryview(tops).cast("B"))
            f.write(b"\0" * (index_table.pad8(tops.size) - tops.size))
            del tops
            f.write(memoryview(bloom.finish()).cast("B"))
            heads = block_crc.tobytes() + index_table.bucket_starts(counts).tobytes()
            heads += b"\0" * (lay.heads_size - len(heads))
            spans = column_spans(schema, len(self))
            head = _IHEAD.pack(INDEX_MAGIC, version, lay.k, schema.digest(), self.first_step, len(self), content_crc,
                               K, segment_size, crc32(columns), crc32(heads), 0)
            head += _IHEAD_EXT.pack(*[crc32(memoryview(columns)[pos : pos + size]) for _, _, pos, size in
                                      (spans[name] for name in COLUMN_NAMES)],
                                    summary(schema, columns, len(self)), bloom.blocks, 0)
            f.seek(0)
            for part in (head, struct.pack("<I", crc32(head)), columns, heads):
                f.write(part)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)


# ------------------------------------------------------------------------------ using an index


def _hits(table_hashes: np.ndarray, table_slots: np.ndarray, queries: np.ndarray, limit: int):
    """(query index, slot) of up to `limit` occurrences of each query in a table sorted by (hash, slot)."""
    lo = np.searchsorted(table_hashes, queries, "left")
    hi = np.minimum(np.searchsorted(table_hashes, queries, "right"), lo + limit)
    found = np.flatnonzero(hi > lo)
    if not found.size:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    counts = hi[found] - lo[found]
    qi = np.repeat(found, counts)
    starts = np.repeat(lo[found] - np.r_[0, np.cumsum(counts)[:-1]], counts)
    return qi, table_slots[starts + np.arange(qi.size)].astype(np.int64)


class MemoryIndex:
    """An index held in memory: built from a segment's records (an unsealed tail, or a sealed
    segment whose index file is missing or unusable). Costs 8 bytes an example, and a sort
    (about 1 s for 16M examples) the first time the sorted table is asked for."""

    def __init__(self, columns: StepColumns, hashes_nxB: np.ndarray | None):
        self._columns, self.hashes = columns, hashes_nxB  # hashes None: columns only (see TraceReader.columns)
        self._table: tuple[np.ndarray, np.ndarray] | None = None

    def columns(self) -> StepColumns:
        return self._columns

    def _sorted(self) -> tuple[np.ndarray, np.ndarray]:
        if self._table is None:
            order, hs = stable_argsort(np.ascontiguousarray(self.hashes).reshape(-1))
            self._table, self.hashes = (hs, order.astype(np.uint32)), None  # 12 bytes an example from now on
        return self._table

    def find(self, queries: np.ndarray, limit: int, advised: bool = False):
        """(query index, slot) of the first `limit` occurrences of each sorted unique query
        (`advised`: FileIndex.find's; held in memory, there is nothing to ask the kernel for)."""
        if self._table is not None:
            return _hits(*self._table, queries, limit)
        # One search needs no sort: a scan of the hashes, a chunk at a time, is cheaper and bounded.
        flat = self.hashes.reshape(-1)
        slots, vals = [], []
        for lo in range(0, flat.size, _SCAN_CHUNK):
            chunk = flat[lo : lo + _SCAN_CHUNK]
            at = np.minimum(np.searchsorted(queries, chunk), queries.size - 1)
            hit = np.flatnonzero(queries[at] == chunk)
            slots.append(hit + lo)
            vals.append(chunk[hit])
        slots, vals = np.concatenate(slots), np.concatenate(vals)
        order = np.argsort(vals, kind="stable")
        return _hits(vals[order], slots[order], queries, limit)

    def sample(self) -> np.ndarray:
        """Every BLOCK_ENTRIES-th sorted hash: where to cut the hash space into even ranges."""
        return self._sorted()[0][::BLOCK_ENTRIES]

    def table(self, lo: int, hi: int | None) -> tuple[np.ndarray, np.ndarray]:
        """The (hash, slot) entries with lo <= hash < hi (hi None: no upper bound), sorted; slots uint32."""
        hs, slots = self._sorted()
        a = np.searchsorted(hs, np.uint64(lo), "left")
        b = hs.size if hi is None else np.searchsorted(hs, np.uint64(hi), "left")
        return hs[a:b], slots[a:b]  # uint32, as FileIndex.table's
