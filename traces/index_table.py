"""The sorted example table of a segment index, version 3 (FORMAT.md, "Segment index").

Version 2 stored each entry whole: the 8-byte hash and a u32 slot, 12 bytes an example. In
version 3 the table is cut into 2**k buckets by the hashes' top k bits, and a bucket table
(u32 where each bucket starts) stands for those bits: an entry keeps the hash's low 64 - k
bits and its slot, each in as few whole bytes as they need. At 1,024 examples a step and
16,384 records a segment (2**24 entries) k is 16: 6 + 3 = 9 bytes an example, and a bucket
table of 256 KB (0.016 bytes an example), where version 2 had 0.5 MB of block fences.

A bucket is also where a search looks: the entries of a hash all lie in its bucket (~256 at
that size), so a search reads the bucket table's two starts and the one or two 2.3 KB blocks
that hold the bucket, as version 2 read its fences and one 3 KB block.

Entries still come in blocks of K (256), each block checksummed, so a reader checks what it
reads and nothing more; this module is the layout alone (the index files are written by
traces/index.py and read by traces/index_file.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PREFIX_CHOICES = (0, 8, 16, 24)  # whole bytes, so the low parts are whole bytes too


def pad8(n: int) -> int:
    """n rounded up to a multiple of 8: where the index file's next array starts."""
    return (n + 7) & ~7


def prefix_bits(entries: int) -> int:
    """The k that makes the table smallest (entries x low bytes + the bucket table), the larger
    on a tie (smaller buckets search faster): 16 from ~2**18 entries to ~2**26, 8 below."""
    sizes = [(entries * (8 - k // 8) + 4 * ((1 << k) + 1), -k) for k in PREFIX_CHOICES]
    return -min(sizes)[1]


@dataclass(frozen=True)
class TableLayout:
    """Where a version-3 table's parts lie, from its entry count, block size and k."""

    entries: int  # the segment's examples: records x examples a step
    K: int  # entries a block (the last block is padded with zeros past the entries)
    k: int  # the hash bits the bucket table stands for (0, 8, 16 or 24)

    @property
    def low_bytes(self) -> int:
        return (64 - self.k) // 8

    @property
    def slot_bytes(self) -> int:
        return max(1, -(-max(self.entries - 1, 0).bit_length() // 8))

    @property
    def block_bytes(self) -> int:
        return self.K * (self.low_bytes + self.slot_bytes)

    @property
    def blocks(self) -> int:
        return -(-self.entries // self.K)

    @property
    def buckets(self) -> int:
        return 1 << self.k

    @property
    def heads_size(self) -> int:
        """u32 block_crc[blocks] | u32 bucket_start[buckets + 1], padded to 8 bytes."""
        return pad8(4 * (self.blocks + self.buckets + 1))

    def bucket(self, hashes) -> np.ndarray:
        """int64: each hash's bucket (its top k bits)."""
        h = np.asarray(hashes, np.uint64)
        if self.k == 0:
            return np.zeros(h.shape, np.int64)
        return (h >> np.uint64(64 - self.k)).astype(np.int64)

    def entry_span(self, starts: np.ndarray, lo: int, hi: int | None) -> tuple[int, int]:
        """[a, b): the entries that can hold a hash h with lo <= h < hi (hi None: no bound); whole
        buckets, so the caller cuts the exact range from the decoded hashes."""
        a = int(starts[int(self.bucket(np.uint64(lo)))])
        b = self.entries if hi is None else int(starts[min(int(self.bucket(np.uint64(hi))) + 1, self.buckets)])
        return a, max(a, b)


def encode_blocks(lay: TableLayout, sorted_hashes: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """uint8 (blocks, block_bytes) of whole blocks of entries (the last zero-padded): K low parts
    (low_bytes each, little-endian), then K slots (slot_bytes each)."""
    n = sorted_hashes.size
    nb = -(-n // lay.K)
    lows = np.zeros(nb * lay.K, np.uint64)
    lows[:n] = sorted_hashes
    wide = np.zeros(nb * lay.K, np.uint32)
    wide[:n] = slots
    out = np.empty((nb, lay.block_bytes), np.uint8)
    split = lay.K * lay.low_bytes
    out[:, :split] = lows.view(np.uint8).reshape(-1, 8)[:, : lay.low_bytes].reshape(nb, split)
    out[:, split:] = wide.view(np.uint8).reshape(-1, 4)[:, : lay.slot_bytes].reshape(nb, -1)
    return out


def count_buckets(lay: TableLayout, sorted_hashes: np.ndarray) -> np.ndarray:
    """int64 [buckets]: how many of these hashes fall in each bucket (summed over a table's chunks)."""
    return np.bincount(lay.bucket(sorted_hashes), minlength=lay.buckets)


def bucket_starts(counts: np.ndarray) -> np.ndarray:
    """'<u4' [buckets + 1]: where each bucket starts in the table; the last is the entry count."""
    return np.concatenate([[0], np.cumsum(counts)]).astype("<u4")


def decode_blocks(lay: TableLayout, rows: np.ndarray, first_entry: int, starts: np.ndarray):
    """(hashes uint64, slots uint32) of consecutive blocks `rows` (uint8 (m, block_bytes), C order)
    whose first entry is `first_entry`, without the padding past the table's entries: the audit's
    whole table comes through here."""
    n = min(rows.shape[0] * lay.K, lay.entries - first_entry)
    hashes, slots = _lows_and_slots(lay, rows)
    hashes, slots = hashes[:n], slots[:n]
    if lay.k and n > 0:
        hashes |= _high_bits(lay, starts, first_entry, first_entry + n)
    return hashes, slots


def decode_scattered(lay: TableLayout, rows: np.ndarray, blocks: np.ndarray, starts: np.ndarray):
    """decode_blocks of blocks that need not be consecutive (`blocks`: their numbers, ascending):
    what a search reads. Each entry's bucket is searched for (a search reads few blocks)."""
    at = (np.asarray(blocks, np.int64)[:, None] * lay.K + np.arange(lay.K)).reshape(-1)
    keep = at < lay.entries
    hashes, slots = _lows_and_slots(lay, rows)
    hashes, slots, at = hashes[keep], slots[keep], at[keep]
    if lay.k and at.size:
        hashes |= (np.searchsorted(starts, at, "right") - 1).astype(np.uint64) << np.uint64(64 - lay.k)
    return hashes, slots


def _lows_and_slots(lay: TableLayout, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(low parts uint64, slots uint32) of every entry of the blocks, padding included.

    Each low part is read as the 8 bytes from where it starts and masked: a strided view of the
    rows, one masked copy (~10x faster than widening the bytes apiece). A window runs past its
    low part into the next one, the last one's into the slots; each slot's window starts 4 - S
    bytes before it (in the low parts for the first) and is shifted down: never outside the block."""
    m, L, S, size = rows.shape[0], lay.low_bytes, lay.slot_bytes, lay.block_bytes
    if not m:
        return np.zeros(0, np.uint64), np.zeros(0, np.uint32)
    rows = np.ascontiguousarray(rows)
    windows = np.ndarray((m, lay.K), "<u8", rows, 0, (size, L))
    lows = windows.copy() if L == 8 else windows & np.uint64((1 << (8 * L)) - 1)
    slot_windows = np.ndarray((m, lay.K), "<u4", rows, lay.K * L - (4 - S), (size, S))
    slots = slot_windows.copy() if S == 4 else slot_windows >> np.uint32(8 * (4 - S))
    return lows.reshape(-1), slots.reshape(-1)


def _high_bits(lay: TableLayout, starts: np.ndarray, a: int, b: int) -> np.ndarray:
    """uint64 [b - a]: the top k bits of entries a..b-1, from the bucket starts: each bucket's
    step up placed where it starts, summed up (one pass after a zero fill). np.repeat of each
    bucket's bits was slower where buckets are small (204,800 entries in 65,536 buckets: 0.7 ms
    against ~0.35)."""
    if b <= a:
        return np.zeros(0, np.uint64)
    shift = np.uint64(64 - lay.k)
    first = int(np.searchsorted(starts, a, "right")) - 1  # entry a's bucket
    last = int(np.searchsorted(starts, b - 1, "right")) - 1
    inner = starts[first + 1 : last + 1].astype(np.int64) - a  # in 1..b-a-1; an empty bucket repeats one
    at, count = np.unique(inner, return_counts=True)
    out = np.zeros(b - a, np.uint64)
    out[0] = np.uint64(first) << shift
    out[at] = count.astype(np.uint64) << shift
    return np.cumsum(out, out=out)


def check_starts(lay: TableLayout, starts: np.ndarray) -> str | None:
    """Why a bucket table cannot be this table's (None: it can): starts at 0, never falls, ends at
    the entry count. A checksummed table that fails this was written wrong, not damaged."""
    if starts.size != lay.buckets + 1 or int(starts[0]) != 0 or int(starts[-1]) != lay.entries:
        return "its bucket table does not span its entries"
    if lay.buckets > 1 and bool((np.diff(starts.astype(np.int64)) < 0).any()):
        return "its bucket table is not in order"
    return None


def first_hashes(lay: TableLayout, starts: np.ndarray) -> np.ndarray:
    """A lower bound of each block's first hash: its bucket's top bits (the low bits are in the
    block, which a sample for cutting the hash space into ranges does not need to read)."""
    if lay.k == 0:
        return np.zeros(lay.blocks, np.uint64)
    at = np.arange(lay.blocks, dtype=np.int64) * lay.K
    buckets = np.searchsorted(starts, at, "right") - 1
    return buckets.astype(np.uint64) << np.uint64(64 - lay.k)


# ------------------------------------------------------------------------------ version 4: slot order
# A compacted segment's records hold no example hashes (FORMAT.md, "Compacted segments"): its index is
# their only copy. The table answers "where is hash h" (by bucket); the top k bits of each slot's hash,
# in slot order, answer "which hashes did step s feed": slot t's entry lies in bucket tops[t], so a
# step's B hashes are found in at most B buckets. k / 8 bytes a slot (2 at k = 16), no checksum: a
# reader checks what it rebuilds against the step's examples key (traces/index.py).


def tops_bytes(lay: TableLayout) -> int:
    """Bytes of the slot-order top bits (unpadded): k / 8 a slot."""
    return lay.entries * (lay.k // 8)


_TOPS_CHUNK = 1 << 20  # slots encoded at once (their uint64 shift is the working memory: 8 MB)


def encode_tops(lay: TableLayout, hashes_in_slot_order: np.ndarray) -> np.ndarray:
    """uint8 [slots, k / 8]: each slot's top k bits, little-endian, in slot order; built a chunk at
    a time, so the writer's seal holds k / 8 bytes a slot beyond the hashes (32 MB at 2**24)."""
    h = np.asarray(hashes_in_slot_order, np.uint64).reshape(-1)
    width = lay.k // 8
    out = np.empty((h.size, width), np.uint8)
    for lo in range(0, h.size if width else 0, _TOPS_CHUNK):
        tops = (h[lo : lo + _TOPS_CHUNK] >> np.uint64(64 - lay.k)).astype("<u4")
        out[lo : lo + _TOPS_CHUNK] = tops.view(np.uint8).reshape(-1, 4)[:, :width]
    return out


def decode_tops(lay: TableLayout, data: bytes) -> np.ndarray:
    """int64 buckets of the slots whose encode_tops bytes `data` holds."""
    width = lay.k // 8
    n = len(data) // width if width else 0
    wide = np.zeros((n, 4), np.uint8)
    wide[:, :width] = np.frombuffer(data, np.uint8, n * width).reshape(n, width)
    return wide.view("<u4").reshape(-1).astype(np.int64)


def place(hashes: np.ndarray, slots: np.ndarray, lo: int, hi: int) -> tuple[np.ndarray, int]:
    """(uint64 [hi - lo] of the entries' hashes at their slots lo..hi-1, how many entries landed
    there): a caller compares the count with hi - lo (each slot holds exactly one entry)."""
    out = np.zeros(hi - lo, np.uint64)
    at = slots.astype(np.int64) - lo
    keep = (at >= 0) & (at < hi - lo)
    out[at[keep]] = hashes[keep]
    return out, int(np.count_nonzero(keep))
