"""Reading an index file (traces/index.py writes them; FORMAT.md, "Segment index").

Opening one reads its header (120 bytes; 64 in version 1). What a command asks for is read
and checked alone: one column (version 2: its own checksum; version 1: all columns), the block
heads, table blocks, filter blocks. The segment summary in the header lets two segments be
compared without reading their columns.

At 1.4M steps (86 segments): a metric column is 64 KB a segment; a search for 1,024 hashes
touches 1,024 filter blocks of 64 bytes a segment, and the block heads (0.5 MB) and the one or
two 2.3 KB table blocks of the hash's bucket only where the filter says "maybe" (version 3;
versions 1 and 2: a 3 KB block found through the fences).
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path

import numpy as np

from traces.checksum import crc32
from traces import filter as example_filter
from traces import index_table
from traces.errors import TraceCorruptError
from traces.index import (
    _IHEAD, _IHEAD_EXT, COLUMN_NAMES, INDEX_HEADER_SIZE, INDEX_HEADER_SIZE_V1, INDEX_MAGIC, INDEX_VERSION, IndexUnusable,
    StepColumns, _column_layout, _hits, column_spans, decode_columns,
)
from traces.schema import Schema
from traces.segment import SegmentFile
from traces.storage import is_remote

PAGE = mmap.PAGESIZE
_SLOT_CHUNK_BLOCKS = 4096  # table blocks decoded at once when rebuilding many slots' hashes (~9 MB)
# slot_hashes of more than 1/WHOLE_TABLE_SHARE of a segment decodes its whole table: each slot read
# alone costs its bucket's blocks (~2-5 KB), so past this share the whole table is fewer bytes
WHOLE_TABLE_SHARE = 64


class FileIndex:
    """An index file, bound to its segment by first step, record count, size and the seal's
    checksum; each part is checked when first read (a column, block heads, each block)."""

    def __init__(self, path: Path, schema: Schema, first_step: int, count: int | None, content_crc: int | None,
                 segment_size: int | None):
        """count, content_crc and segment_size None: the index of a segment whose seal is damaged
        (a compacted one's: its hashes' only copy), bound to it by the caller through its frames;
        its own record count then stands."""
        self.path, self.schema = path, schema
        with SegmentFile(path) as f:
            head = f.read(0, INDEX_HEADER_SIZE)
            size = f.size
        if len(head) < INDEX_HEADER_SIZE_V1 or head[:8] != INDEX_MAGIC:
            raise IndexUnusable("not an index file (bad magic or too short)")
        version = struct.unpack_from("<H", head, 8)[0]
        if version > INDEX_VERSION:
            raise IndexUnusable(f"written by a newer replay (index version {version})")
        self.version, self.header_size = version, INDEX_HEADER_SIZE_V1 if version == 1 else INDEX_HEADER_SIZE
        if len(head) < self.header_size:
            raise IndexUnusable("it is shorter than its header")
        at = self.header_size - 4
        if struct.unpack_from("<I", head, at)[0] != crc32(head[:at]):
            raise IndexUnusable("its header checksum does not match")
        (_, _, k, digest, first, n, crc, K, seg_size, self._columns_crc, self._heads_crc, _) = _IHEAD.unpack_from(head)
        self.column_crc: dict[str, int] = {}
        self.summary: bytes | None = None  # version 1 has none
        self.filter_blocks = 0
        if version >= 2:
            *crcs, self.summary, self.filter_blocks, _ = _IHEAD_EXT.unpack_from(head, _IHEAD.size)
            self.column_crc = dict(zip(COLUMN_NAMES, crcs))
        if count is None:
            count, content_crc, segment_size = n, crc, seg_size
        if (digest, first, n, crc, seg_size) != (schema.digest(), first_step, count, content_crc, segment_size):
            raise IndexUnusable("it describes another version of its segment (stale)")
        if K < 1:
            raise IndexUnusable("its block size is 0")
        self.first_step, self.count, self.K = first_step, count, K
        self.entries = count * schema.examples_per_step
        self.blocks = -(-self.entries // K)
        _, self._columns_size = _column_layout(schema, count)
        # version 3: the bucketed table (traces/index_table.py); before it, whole u64 hashes and u32 slots
        self.layout: index_table.TableLayout | None = None
        if version >= 3:
            if k not in index_table.PREFIX_CHOICES:
                raise IndexUnusable(f"its table's prefix is {k} bits (0, 8, 16 or 24 are written)")
            self.layout = index_table.TableLayout(self.entries, K, k)
        self._block_size = self.layout.block_bytes if self.layout else 12 * K
        self._heads_size = self.layout.heads_size if self.layout else index_table.pad8(12 * self.blocks)
        self._table_at = self.header_size + self._columns_size + self._heads_size
        self._tops_at = self._table_at + self.blocks * self._block_size  # version 4: each slot's top bits
        self._tops_size = index_table.tops_bytes(self.layout) if version >= 4 else 0
        self._filter_at = self._tops_at + index_table.pad8(self._tops_size)
        bits, self._filter_k = example_filter.params(version)
        if version >= 2 and self.filter_blocks != example_filter.filter_blocks(self.entries, bits):
            raise IndexUnusable(f"its filter has {self.filter_blocks} blocks, {self.entries} examples need "
                                f"{example_filter.filter_blocks(self.entries, bits)}")
        implied = self._filter_at + self.filter_blocks * example_filter.BLOCK_BYTES
        if size != implied:
            raise IndexUnusable(f"it is {size} bytes, its header implies {implied}")
        self._cols: StepColumns | None = None
        self._column: dict[str, np.ndarray] = {}
        self._fence: np.ndarray | None = None  # versions 1 and 2: each block's first hash
        self._starts: np.ndarray | None = None  # version 3: where each bucket starts
        self._block_crc: np.ndarray | None = None

    def _read(self, offset: int, size: int) -> bytes:
        try:
            with SegmentFile(self.path) as f:
                data = f.read(offset, size)
        except Exception as e:  # noqa: BLE001 - unreadable now: the segment still answers
            raise IndexUnusable(str(e)) from None
        if len(data) != size:
            raise IndexUnusable("it was truncated after it was opened")
        return data

    def columns(self) -> StepColumns:
        if self._cols is None:
            data = self._read(self.header_size, self._columns_size)
            if crc32(data) != self._columns_crc:
                raise IndexUnusable("its columns' checksum does not match")
            self._cols = decode_columns(self.schema, data, self.first_step, self.count)
        return self._cols

    def column(self, name: str) -> np.ndarray:
        """One column (StepColumns' field `name`), read and checked alone in version 2: a metric
        column is 4 bytes a record instead of ~50."""
        if self._cols is not None or not self.column_crc:
            return getattr(self.columns(), name)
        if name not in self._column:
            dtype, shape, _, _ = column_spans(self.schema, self.count)[name]
            data = self._read(*self.column_span(name))
            if crc32(data) != self.column_crc[name]:
                raise IndexUnusable(f"its {name} column's checksum does not match")
            self._column[name] = np.frombuffer(data, dtype, int(np.prod(shape))).reshape(shape)
        return self._column[name]

    def maybe(self, queries: np.ndarray) -> np.ndarray | None:
        """bool per query, False where the hash is certainly not in the segment (the filter;
        version 2), or None (version 1: no filter)."""
        if not self.filter_blocks or is_remote(self.path):  # remote: no map; the table answers (as for version 1)
            return None
        # Mapped for this search only: the kernel maps pages around each one touched, which
        # would count against the process's RSS if every segment's filter stayed mapped.
        try:
            with open(self.path, "rb") as f:
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:
            raise IndexUnusable(str(e)) from None
        try:  # one 64-byte block a query: no readahead of the whole filter (27 MB a segment) from disk
            mapped.madvise(mmap.MADV_RANDOM)
        except (AttributeError, OSError):  # no madvise here: only slower from a cold cache
            pass
        try:
            if len(mapped) != self._filter_at + self.filter_blocks * example_filter.BLOCK_BYTES:
                raise IndexUnusable("it changed size after it was opened")
            blocks = np.frombuffer(mapped, np.uint8, self.filter_blocks * example_filter.BLOCK_BYTES,
                                   self._filter_at).reshape(self.filter_blocks, example_filter.BLOCK_BYTES)
            try:
                found, damage = example_filter.maybe(blocks, queries, self._filter_k), None
            except example_filter.FilterDamaged as e:  # its traceback holds the map: let it go first
                found, damage = None, str(e)
            del blocks
        finally:
            mapped.close()
        if damage is not None:
            raise IndexUnusable(damage)
        return found

    def prefetch(self, queries: np.ndarray) -> None:
        """Asks the kernel for the pages maybe(queries) will touch (each 4 KB page a query's
        filter block lies in), without waiting for them: from a cold page cache the map then
        faults on pages read or in flight, instead of reading ~1,024 pages a segment one fault
        at a time (~75 us each on this VM's disk: 1.6 s of the 1.9 s search of a 350k-step
        bisect of repeated data; 0.11 s with this). Merging nearby pages into longer reads was
        no faster there (bandwidth, not requests, is then the limit). Advice only
        (posix_fadvise WILLNEED): nothing is read or checked here."""
        if not self.blocks or is_remote(self.path) or not hasattr(os, "posix_fadvise"):
            return
        q = np.asarray(queries, np.uint64)
        if self.filter_blocks and q.size:
            at = self._filter_at + example_filter.block_of(q, self.filter_blocks).astype(np.int64) * example_filter.BLOCK_BYTES
            first, last = at // PAGE, (at + example_filter.BLOCK_BYTES - 1) // PAGE
            reach = (example_filter.BLOCK_BYTES - 1) // PAGE + 1  # pages past its first a block may reach
            pages = np.unique(np.concatenate([np.minimum(first + d, last) for d in range(reach + 1)]))
            _willneed(self.path, _page_runs(pages))

    def advise_table(self, lo: int, hi: int | None) -> None:
        """Asks the kernel for the bytes table(lo, hi) will read (posix_fadvise WILLNEED), without
        waiting: the audit's reader thread asks for a whole range's tables before reading them."""
        _willneed(self.path, [self.table_span(lo, hi)])

    def _heads(self) -> np.ndarray:
        """The block checksums (and the fences, or version 3's bucket starts), read and checked once."""
        if self._block_crc is None:
            data = self._read(*self.heads_span())
            if crc32(data) != self._heads_crc:
                raise IndexUnusable("its block heads' checksum does not match")
            if self.layout is None:
                self._fence = np.frombuffer(data, "<u8", self.blocks)
                self._block_crc = np.frombuffer(data, "<u4", self.blocks, 8 * self.blocks)
            else:
                starts = np.frombuffer(data, "<u4", self.layout.buckets + 1, 4 * self.blocks)
                why = index_table.check_starts(self.layout, starts)
                if why:
                    raise IndexUnusable(why)
                self._starts, self._block_crc = starts, np.frombuffer(data, "<u4", self.blocks)
        return self._block_crc

    def _decode(self, data: bytes, first_block: int) -> tuple[np.ndarray, np.ndarray]:
        """(hashes, slots) of consecutive blocks read from first_block, without the padding."""
        K, size = self.K, self._block_size
        rows = np.frombuffer(data, np.uint8).reshape(-1, size)
        if self.layout is not None:
            return index_table.decode_blocks(self.layout, rows, first_block * K, self._starts)
        n = min(rows.shape[0] * K, self.entries - first_block * K)
        return rows[:, : 8 * K].copy().view("<u8").reshape(-1)[:n], rows[:, 8 * K :].copy().view("<u4").reshape(-1)[:n]

    def _blocks(self, wanted: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Entries of the given blocks (ascending; adjacent ones read at once), each block's
        checksum checked: one pread of 2-3 KB a block (all asked of the kernel first, so a cold
        disk serves them together), and a numpy decode a run of adjacent blocks."""
        size = self._block_size
        crcs = self._heads()
        spans, runs, i = [], [], 0
        while i < len(wanted):
            j = i + 1
            while j < len(wanted) and wanted[j] == wanted[j - 1] + 1:
                j += 1
            spans.append((self._table_at + wanted[i] * size, (j - i) * size))
            runs.append(wanted[i])
            i = j
        if len(spans) > 1:
            _willneed(self.path, spans)
        try:
            with SegmentFile(self.path) as f:
                pieces = [f.read(at, n) for at, n in spans]
        except TraceCorruptError as e:  # unreadable now: the segment still answers
            raise IndexUnusable(str(e)) from None
        data = b"".join(pieces)
        if len(data) != len(wanted) * size:
            raise IndexUnusable("it was truncated after it was opened")
        view = memoryview(data)
        for k, block in enumerate(wanted):
            if crc32(view[k * size : (k + 1) * size]) != crcs[block]:
                raise IndexUnusable(f"block {block}'s checksum does not match")
        if self.layout is not None:  # one decode for all of them
            rows = np.frombuffer(data, np.uint8).reshape(-1, size)
            return index_table.decode_scattered(self.layout, rows, np.asarray(wanted, np.int64), self._starts)
        parts = [self._decode(piece, first) for piece, first in zip(pieces, runs)]
        if not parts:
            return np.zeros(0, np.uint64), np.zeros(0, np.uint32)
        return np.concatenate([h for h, _ in parts]), np.concatenate([s for _, s in parts])

    # Where each part lies, (offset, size) as _read asks for it: a remote scan requests the parts
    # of several segments at once (View.prefetch matches a read by its exact range).
    def column_span(self, name: str) -> tuple[int, int]:
        _, _, pos, size = column_spans(self.schema, self.count)[name]
        return self.header_size + pos, size

    def heads_span(self) -> tuple[int, int]:
        return self.header_size + self._columns_size, self._heads_size

    def _table_blocks(self, lo: int, hi: int | None) -> tuple[int, int]:
        self._heads()
        if self.layout is not None:  # the buckets the range touches
            a, b = self.layout.entry_span(self._starts, lo, hi)
            return a // self.K, -(-b // self.K)
        fence = self._fence
        first = max(int(np.searchsorted(fence, np.uint64(lo), "left")) - 1, 0)
        return first, self.blocks if hi is None else max(int(np.searchsorted(fence, np.uint64(hi), "left")), first + 1)

    def table_span(self, lo: int, hi: int | None) -> tuple[int, int]:
        """The bytes table(lo, hi) reads (its block heads read first, to know them)."""
        first, stop = self._table_blocks(lo, hi) if self.blocks else (0, 0)
        return self._table_at + first * self._block_size, (stop - first) * self._block_size

    def sample(self) -> np.ndarray:
        """Every block's first hash (every BLOCK_ENTRIES-th sorted hash); version 3: its top bits
        (a lower bound of it, from the bucket table: enough to cut the hash space into ranges)."""
        if not self.blocks:
            return np.zeros(0, np.uint64)
        self._heads()
        return self._fence if self.layout is None else index_table.first_hashes(self.layout, self._starts)

    def find(self, queries: np.ndarray, limit: int, advised: bool = False):
        """(query index, slot) of the first `limit` occurrences of each sorted unique query.
        The filter first (version 2): only the queries it does not rule out go on. Then the
        block that can hold each one's first occurrence (and the next ones while they start
        with it) is read: one read of 3 KB a query. `advised`: prefetch(queries) was called
        already (traces.fed advises the next segment while it searches this one)."""
        none = np.zeros(0, np.int64), np.zeros(0, np.int64)
        if not self.blocks:
            return none
        if not advised:
            self.prefetch(queries)
        kept = self.maybe(queries)
        if kept is not None:
            sub = np.flatnonzero(kept)
            if not sub.size:
                return none
            qi, slots = self._find(queries[sub], limit)
            return sub[qi], slots
        return self._find(queries, limit)

    def _find(self, queries: np.ndarray, limit: int):
        self._heads()
        if self.layout is not None:  # the blocks of each query's bucket, which holds all its entries
            buckets = self.layout.bucket(queries)
            a, b = self._starts[buckets].astype(np.int64), self._starts[buckets + 1].astype(np.int64)
            keep = b > a
            first, last = a[keep] // self.K, (b[keep] - 1) // self.K + 1  # last exclusive
        else:
            fence = self._fence
            left = np.searchsorted(fence, queries, "left")
            right = np.searchsorted(fence, queries, "right")
            first = np.maximum(left - 1, 0)
            last = np.minimum(np.maximum(right, first + 1), first + 2 + limit // self.K)  # exclusive
        if not first.size:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        wanted = np.unique(np.concatenate([np.arange(a, b) for a, b in zip(first.tolist(), last.tolist())]))
        hashes, slots = self._blocks(wanted.tolist())
        return _hits(hashes, slots, queries, limit)

    def reads_whole_table(self, slots: int) -> bool:
        """Whether slot_hashes of `slots` slots decodes the whole table (more than 1/64 of them, or
        no slot order bits to find their buckets by)."""
        return self.layout.k == 0 or WHOLE_TABLE_SHARE * slots >= self.entries

    def slot_hashes(self, lo: int, hi: int) -> np.ndarray:
        """uint64 [hi - lo]: the example hashes of slots lo..hi-1 (version 4, a compacted segment's
        only copy). A few steps: their slots' top bits name their buckets, whose blocks are read
        (at most one bucket a slot: ~2-5 KB a hash at 2**24 examples, 2.3-4.6 MB a 1,024-example
        step); a range of more than 1/64 of the segment: the whole table, a chunk at a time.
        Every slot must be found exactly once, else the index is unusable (the caller also checks
        each step's examples key)."""
        if self.version < 4:
            raise IndexUnusable(f"it is version {self.version}: it does not hold its segment's slot order")
        lay, n = self.layout, hi - lo
        if n <= 0:
            return np.zeros(0, np.uint64)
        self._heads()
        if self.reads_whole_table(n):
            parts = []
            for first in range(0, self.blocks, _SLOT_CHUNK_BLOCKS):
                stop = min(self.blocks, first + _SLOT_CHUNK_BLOCKS)
                hs, slots = self._blocks(list(range(first, stop)))
                keep = (slots >= lo) & (slots < hi)
                parts.append((hs[keep], slots[keep]))
            hashes, slots = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
        else:
            width = lay.k // 8
            buckets = np.unique(index_table.decode_tops(lay, self._read(self._tops_at + lo * width, n * width)))
            if buckets.size and int(buckets[-1]) >= lay.buckets:
                raise IndexUnusable("its slot order names a bucket past its table")
            a, b = self._starts[buckets].astype(np.int64), self._starts[buckets + 1].astype(np.int64)
            keep = b > a
            spans = [np.arange(x // self.K, (y - 1) // self.K + 1) for x, y in zip(a[keep].tolist(), b[keep].tolist())]
            wanted = np.unique(np.concatenate(spans)) if spans else np.zeros(0, np.int64)
            hashes, slots = self._blocks(wanted.tolist())
        out, landed = index_table.place(hashes, slots, lo, hi)
        if landed != n:
            raise IndexUnusable(f"its table holds {landed} entries for slots {lo}..{hi - 1}, not {n}")
        return out

    def slot_hashes_spans(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """The reads slot_hashes(lo, hi) starts with, (offset, size) each: the whole table's chunks,
        or the slots' top bits (their buckets' blocks follow from those). A remote scan requests
        them ahead."""
        if self.version < 4 or hi <= lo or not self.blocks:
            return []
        if self.reads_whole_table(hi - lo):
            size = self._block_size
            return [(self._table_at + first * size, (min(self.blocks, first + _SLOT_CHUNK_BLOCKS) - first) * size)
                    for first in range(0, self.blocks, _SLOT_CHUNK_BLOCKS)]
        width = self.layout.k // 8
        return [(self._tops_at + lo * width, (hi - lo) * width)]

    def table(self, lo: int, hi: int | None) -> tuple[np.ndarray, np.ndarray]:
        """The (hash, slot) entries with lo <= hash < hi (hi None: no upper bound), sorted; slots
        uint32 (offsets in the segment). The audit reads the whole table this way, a hash range
        at a time: the blocks are one read, each block's checksum checked, and each column copied
        out once (no join, no widening: at 1.4M steps that is 1.43G entries)."""
        if not self.blocks:
            return np.zeros(0, np.uint64), np.zeros(0, np.uint32)
        first, stop = self._table_blocks(lo, hi)
        if stop <= first:
            return np.zeros(0, np.uint64), np.zeros(0, np.uint32)
        size = self._block_size
        data = self._read(self._table_at + first * size, (stop - first) * size)
        view = memoryview(data)
        crcs = self._heads()[first:stop].tolist()
        bad = [k for k, c in enumerate(crcs) if crc32(view[k * size : (k + 1) * size]) != c]
        if bad:
            raise IndexUnusable(f"block {first + bad[0]}'s checksum does not match")
        hs, slots = self._decode(data, first)  # copies: the rows interleave hashes and slots
        a = int(np.searchsorted(hs, np.uint64(lo), "left"))
        b = hs.size if hi is None else int(np.searchsorted(hs, np.uint64(hi), "left"))
        return hs[a:b], slots[a:b]


def _page_runs(pages: np.ndarray) -> list[tuple[int, int]]:
    """(offset, size) of each run of consecutive page numbers (sorted, unique)."""
    if not pages.size:
        return []
    cut = np.flatnonzero(np.diff(pages) != 1) + 1
    starts, stops = pages[np.r_[0, cut]], pages[np.r_[cut - 1, pages.size - 1]] + 1
    return [(a * PAGE, (b - a) * PAGE) for a, b in zip(starts.tolist(), stops.tolist())]


def _willneed(path: Path, spans: list[tuple[int, int]]) -> None:
    """posix_fadvise WILLNEED of each (offset, size): the kernel queues the reads and returns, so
    the disk serves them together. Advice only: a file that cannot be opened now is left to
    the read that follows (which says so)."""
    if not spans or is_remote(path) or not hasattr(os, "posix_fadvise"):
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        for at, size in spans:
            os.posix_fadvise(fd, at, size, os.POSIX_FADV_WILLNEED)
    except OSError:
        pass
    finally:
        os.close(fd)
