"""A segment's example filter: a blocked Bloom filter of its example hashes (FORMAT.md, "Segment index").

"Was this example fed in this segment?" is answered by one 64-byte block a hash, read through
a memory map; only a "maybe" goes on to the sorted table, which confirms it exactly. So a
search that finds nothing in a segment (most segments, for most hashes) costs one cache
line a hash there, not a 2.3 KB table block and the 0.5 MB of block heads.

Each block is 480 filter bits and the crc32 of its 60 bytes: a damaged block is found when
it is read, never believed. A hash's block comes from its high 32 bits (multiply-shift), so
a table sorted by hash fills the blocks in order, a chunk at a time, in cache; its 6 bits
come from splitmix64(hash). 12 bits an example (1.5 bytes): a "maybe" for a hash not there
about 0.7% of the time for uniformly distributed hashes (the format's example hashes are
64-bit digests; skewed ones only cost more table reads, never a wrong answer).

At 16,384 records of 1,024 examples: 25 MB a segment, built in ~0.5 s at seal, on the writer's
seal thread, a chunk of the sorted table at a time (`Builder`).
"""

from __future__ import annotations

import time

import numpy as np

from traces.checksum import crc32
from traces.errors import TraceCorruptError

BLOCK_BYTES = 64
BLOCK_BITS = 480  # 60 bytes of bits, then a u32 crc32 of them
BITS_PER_EXAMPLE = 12
K_BITS = 6
# Index version 4 (a compacted segment: its index holds the only copy of its example hashes, and the
# filter is what is left of ~4 bytes an example beyond the record): 8 bits an example and 5 bits a
# hash, a "maybe" for ~2-3% of absent uniform hashes (each then costs one bucket's table blocks; 6
# bits and 4 made it ~6%, and bench.scale's bisect of repeated data 1.4-2.2 s at 1.4M steps).
LEAN_BITS_PER_EXAMPLE = 8
LEAN_K_BITS = 5


def params(index_version: int) -> tuple[int, int]:
    """(bits an example, bits a hash) of an index version's filter."""
    return (LEAN_BITS_PER_EXAMPLE, LEAN_K_BITS) if index_version >= 4 else (BITS_PER_EXAMPLE, K_BITS)
_BUILD_ENTRIES = 1 << 15  # sorted hashes turned into bits at once (~5 MB of bit positions and bools)
_CRC_ROWS = 2048  # rows checksummed between yields of the GIL (~1 ms)
_YIELD_S = 50e-6


class FilterDamaged(TraceCorruptError):
    """A filter block whose checksum does not match. The index reader turns it into IndexUnusable
    (and rebuilds the index from its segment), so it reaches no user; if it did, it would be
    what it is, a damaged file of the run (exit 2)."""


def filter_blocks(entries: int, bits: int = BITS_PER_EXAMPLE) -> int:
    return max(1, -(-entries * bits // BLOCK_BITS))


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def block_of(hashes: np.ndarray, blocks: int) -> np.ndarray:
    """The block of each hash: (hash >> 32) * blocks >> 32, monotone in the hash."""
    return ((hashes >> np.uint64(32)) * np.uint64(blocks)) >> np.uint64(32)


def bit_positions(hashes: np.ndarray, k: int = K_BITS) -> np.ndarray:
    """(n, k) bit positions in 0..479 of each hash's block: 10-bit fields of splitmix64(hash)."""
    g = _splitmix64(hashes)
    fields = (g[:, None] >> (np.arange(k, dtype=np.uint64) * np.uint64(10))) & np.uint64(1023)
    fields *= np.uint64(BLOCK_BITS)
    fields >>= np.uint64(10)
    return fields.view(np.int64)  # < 480: the same bits


class Builder:
    """A filter filled a sorted chunk at a time (the index table's chunks, as they are written):
    the bits of a hash do not depend on the others, so the bytes equal `build`'s of the whole."""

    def __init__(self, entries: int, index_version: int = 3):
        bits, self.k = params(index_version)
        self.blocks = filter_blocks(entries, bits)
        self._out = np.zeros((self.blocks, BLOCK_BYTES), np.uint8)

    def add(self, sorted_hashes: np.ndarray) -> None:
        hs, nb = np.asarray(sorted_hashes, np.uint64), self.blocks
        for lo in range(0, hs.size, _BUILD_ENTRIES):
            part = hs[lo : lo + _BUILD_ENTRIES]
            blocks = block_of(part, nb).view(np.int64)  # < 2**32
            b0, b1 = int(blocks[0]), int(blocks[-1]) + 1
            local = np.zeros((b1 - b0) * BLOCK_BITS, bool)
            local[((blocks - b0) * BLOCK_BITS)[:, None] + bit_positions(part, self.k)] = True
            self._out[b0:b1, : BLOCK_BITS // 8] |= np.packbits(local.reshape(b1 - b0, BLOCK_BITS), axis=1,
                                                               bitorder="little")

    def finish(self) -> np.ndarray:
        """uint8 (blocks, 64): the filter's bytes, each block's crc32 set."""
        self._out[:, BLOCK_BITS // 8 :] = crc_rows(self._out, BLOCK_BITS // 8).view(np.uint8).reshape(-1, 4)
        return self._out


def crc_rows(rows: np.ndarray, width: int) -> np.ndarray:
    """'<u4' crc32 of the first `width` bytes of each row of a C-contiguous uint8 (n, stride) array.

    Run on the writer's seal thread beside the training loop: a row's crc32 is too short to
    release the GIL, so every _CRC_ROWS rows the thread sleeps a moment, letting a loop that
    waits for the GIL have it within ~1 ms instead of the interpreter's 5 ms switch interval."""
    mv, stride = memoryview(rows).cast("B"), rows.shape[1]
    out = np.empty(rows.shape[0], "<u4")
    for lo in range(0, rows.shape[0], _CRC_ROWS):
        hi = min(rows.shape[0], lo + _CRC_ROWS)
        out[lo:hi] = [crc32(mv[a : a + width]) for a in range(lo * stride, hi * stride, stride)]
        time.sleep(_YIELD_S)
    return out


def build(sorted_hashes: np.ndarray) -> bytes:
    """The filter of a segment's example hashes, given sorted (the index table's order)."""
    hs = np.asarray(sorted_hashes, np.uint64)
    builder = Builder(hs.size)
    builder.add(hs)
    return builder.finish().tobytes()


def maybe(blocks_view: np.ndarray, queries: np.ndarray, k_bits: int = K_BITS) -> np.ndarray:
    """bool per query: False when the hash is certainly not in the filtered set.

    `blocks_view`: uint8 (blocks, 64), typically a memory map; touches one block a query and
    checks the crc32 of every block it touches (raises FilterDamaged)."""
    q = np.asarray(queries, np.uint64)
    if not q.size:
        return np.zeros(0, bool)
    nb = blocks_view.shape[0]
    which = block_of(q, nb).view(np.int64)
    rows = np.asarray(blocks_view[which])  # one gather: the pages come from the cache or the disk
    stored = rows[:, BLOCK_BITS // 8 :].copy().view("<u4").reshape(-1)
    bits = np.ascontiguousarray(rows[:, : BLOCK_BITS // 8])
    first = np.unique(which, return_index=True)[1]
    for k in first.tolist():
        if crc32(bits[k]) != int(stored[k]):
            raise FilterDamaged(f"filter block {int(which[k])}'s checksum does not match")
    pos = bit_positions(q, k_bits)
    got = (bits[np.arange(q.size)[:, None], pos >> 3] >> (pos & 7).astype(np.uint8)) & 1
    return got.all(axis=1)
