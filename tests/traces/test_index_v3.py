"""Index version 3 (issue 34): the sorted table keeps each hash's low bytes and its slot, the top
bits in a bucket table (traces/index_table.py). Every layout answers exactly as the index built
in memory from the segment does; version 2 and 1 files (a trace version 2 wrote) still read."""

from __future__ import annotations

import shutil
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

from traces import Schema, TraceReader, TraceWriter, index_table
from traces import filter as example_filter
from traces.index import (
    _IHEAD, DERIVED_INDEX_VERSION, INDEX_HEADER_SIZE, INDEX_VERSION, MemoryIndex, _column_layout, index_path,
)
from traces.index_file import FileIndex
from tests.traces.helpers import make_record, make_schema
from tests.traces.test_seal import fixture_record, write_trace

V2_FIXTURE = Path(__file__).parent / "fixtures" / "v2_index"  # seal_bytes as version 2 wrote it


def _bounds(hashes: np.ndarray, k: int) -> list[tuple[int, int | None]]:
    """Hash ranges to cut tables at: everything, halves, each side of held hashes (exact values,
    one past them), and bucket edges of the layout."""
    held = np.unique(hashes)
    picks = [int(h) for h in held[:: max(1, held.size // 7)]] + [int(held[-1])]
    edges = [0, 1 << 62, 1 << 63, (1 << 64) - 1]
    if k:
        edges += [(int(h) >> (64 - k)) << (64 - k) for h in picks]
    cuts = sorted(set(picks + [p + 1 for p in picks if p + 1 < 1 << 64] + edges))
    return [(0, None)] + [(a, b) for a, b in zip(cuts, cuts[1:])] + [(c, None) for c in cuts[-3:]]


def answers(index, hashes: np.ndarray, k: int) -> dict:
    """What commands ask of an index: its table in hash ranges, and searches of held and absent
    hashes with several limits."""
    out = {}
    for lo, hi in _bounds(hashes, k):
        hs, slots = index.table(lo, hi)
        out[("table", lo, hi)] = (hs.tolist(), slots.tolist())
    held = np.unique(hashes)
    absent = np.setdiff1d(held ^ np.uint64(0x5A5A), held)
    for limit in (1, 2, 5):
        for queries in (held, np.unique(np.concatenate([held[::3], absent]))):
            qi, slots = index.find(queries, limit)
            out[("find", limit, queries.size)] = (qi.tolist(), slots.tolist())
    return out


def memory_answers(reader: TraceReader, i: int, hashes: np.ndarray, k: int) -> dict:
    """The answers of the index built in memory from the hashes as written (fixture_record's: a
    compacted segment's records no longer hold them, and reading them back goes through its index)."""
    seg = reader.segments[i]
    rows = np.stack([fixture_record(reader.schema, s).example_hashes for s in range(seg.first_step, seg.first_step + seg.count)])
    return answers(MemoryIndex(None, rows), hashes, k)


def segment_hashes(reader: TraceReader, i: int) -> np.ndarray:
    seg = reader.segments[i]
    return np.concatenate([reader.read(s).example_hashes for s in range(seg.first_step, seg.first_step + seg.count)])


@pytest.fixture(params=[(k, c) for c in (False, True) for k in (0, 8, 16)],
                ids=lambda p: f"k{p[0]}" + ("-compacted" if p[1] else ""))
def written(tmp_path, monkeypatch, request):
    """seal_bytes' trace (hashes that clash in their high bits and repeat) written with the
    bucket table standing for k bits, whatever the size would choose (24, for segments of 2**26
    examples and more, is checked on the layout alone below: its bucket table is 64 MB); its
    sealed segments as they are, or compacted (index version 4: traces/compaction.py)."""
    k, compact = request.param
    monkeypatch.setattr(index_table, "prefix_bits", lambda entries: k)
    write_trace(tmp_path / "trace", compact)
    return TraceReader(tmp_path / "trace", make_schema()), k, compact


def test_every_layout_answers_as_the_index_built_in_memory(written):
    reader, k, compact = written
    sealed = [i for i, s in enumerate(reader.segments) if s.sealed]
    assert len(sealed) == 2
    for i in sealed:
        index = reader.index(i)
        version = INDEX_VERSION if compact else DERIVED_INDEX_VERSION
        assert isinstance(index, FileIndex) and index.version == version and index.layout.k == k
        hashes = segment_hashes(reader, i)
        assert answers(index, hashes, k) == memory_answers(reader, i, hashes, k)
        if compact:  # the records' hashes come back through the slot order, a step or the segment at once
            seg, B = reader.segments[i], reader.schema.examples_per_step
            rows = np.stack([fixture_record(reader.schema, s).example_hashes
                             for s in range(seg.first_step, seg.first_step + seg.count)])
            assert np.array_equal(hashes.reshape(rows.shape), rows)
            assert np.array_equal(index.slot_hashes(3 * B, 5 * B), rows[3:5].reshape(-1))
        sample = index.sample()  # each block's first hash, to its top k bits
        exact = MemoryIndex(None, np.stack([fixture_record(reader.schema, s).example_hashes for s in
                                            range(reader.segments[i].first_step,
                                                  reader.segments[i].first_step + reader.segments[i].count)])).sample()
        mask = np.uint64(0) if k == 0 else ~np.uint64((1 << (64 - k)) - 1)
        assert np.array_equal(sample, exact & mask)
    assert not reader.notes  # read from the files, nothing rebuilt


@pytest.mark.parametrize("path", ["table", "search"])
def test_the_comparison_catches_a_table_decoded_without_its_top_bits(tmp_path, monkeypatch, path):
    """The check above fails on a reader that drops the bucket table's bits, in the audit's
    contiguous reads (table) or in a search's scattered blocks."""
    k = 16
    monkeypatch.setattr(index_table, "prefix_bits", lambda entries: k)
    write_trace(tmp_path / "trace")
    reader = TraceReader(tmp_path / "trace", make_schema())
    hashes = segment_hashes(reader, 0)
    want = memory_answers(reader, 0, hashes, k)
    assert answers(reader.index(0), hashes, k) == want
    if path == "table":
        monkeypatch.setattr(index_table, "_high_bits", lambda lay, starts, a, b: np.zeros(b - a, np.uint64))
    else:
        real, low = index_table.decode_scattered, np.uint64((1 << (64 - k)) - 1)
        monkeypatch.setattr(index_table, "decode_scattered", lambda *args: (lambda h, s: (h & low, s))(*real(*args)))
    got = answers(reader.index(0), hashes, k)
    differ = {key[0] for key in want if got[key] != want[key]}
    assert differ == {"table" if path == "table" else "find"}


def test_a_damaged_bucket_table_or_block_is_rebuilt_and_answers_the_same(tmp_path, monkeypatch):
    monkeypatch.setattr(index_table, "prefix_bits", lambda entries: 8)
    write_trace(tmp_path / "trace")
    reader = TraceReader(tmp_path / "trace", make_schema())
    lay = reader.index(0).layout
    hashes = segment_hashes(reader, 0)
    want = memory_answers(reader, 0, hashes, 8)
    idx = index_path(reader.segments[0].path)
    clean = idx.read_bytes()
    table_at = len(clean) - example_filter.filter_blocks(lay.entries) * 64 - lay.blocks * lay.block_bytes
    last_start = table_at - lay.heads_size + 4 * (lay.blocks + lay.buckets)
    for at in (last_start, table_at + 5):  # the bucket table's end; a low byte in block 0
        data = bytearray(clean)
        data[at] ^= 0x10
        idx.write_bytes(bytes(data))
        again = TraceReader(tmp_path / "trace", make_schema())
        assert again.with_index(0, lambda index: answers(index, hashes, 8)) == want
        assert any("cannot be used" in n for n in again.notes), again.notes


def test_the_prefix_follows_the_segment_s_size():
    assert [index_table.prefix_bits(n) for n in (300, 1 << 12, 1 << 17, 1 << 24, 1 << 27)] == [0, 8, 8, 16, 24]


@pytest.mark.parametrize("k", index_table.PREFIX_CHOICES)
def test_blocks_decode_to_the_entries_encoded_whole_in_pieces_and_scattered(k):
    rng = np.random.default_rng(k)
    n, K = 1000, 64
    hs = rng.integers(0, 2**64 - 1, n, dtype=np.uint64, endpoint=True)
    hs[:300] &= np.uint64(0xFF) << np.uint64(56) | np.uint64(0xFFFF)  # clustered in few buckets
    hs[300:310] = hs[5]  # repeated
    hs.sort()
    slots = rng.permutation(n).astype(np.uint32)
    lay = index_table.TableLayout(n, K, k)
    rows = index_table.encode_blocks(lay, hs, slots)
    starts = index_table.bucket_starts(index_table.count_buckets(lay, hs))
    assert index_table.check_starts(lay, starts) is None
    got = index_table.decode_blocks(lay, rows, 0, starts)
    assert np.array_equal(got[0], hs) and np.array_equal(got[1], slots)
    tail = index_table.decode_blocks(lay, rows[7:], 7 * K, starts)  # the last block padded past the entries
    assert np.array_equal(tail[0], hs[7 * K :]) and np.array_equal(tail[1], slots[7 * K :])
    picked = np.array([1, 4, 5, lay.blocks - 1])
    part = index_table.decode_scattered(lay, rows[picked], picked, starts)
    at = np.concatenate([np.arange(b * K, min((b + 1) * K, n)) for b in picked])
    assert np.array_equal(part[0], hs[at]) and np.array_equal(part[1], slots[at])
    if k:  # the decode is sensitive to the bucket table
        wrong = index_table.decode_blocks(lay, rows, 0, np.zeros_like(starts) + np.uint32(n) * (np.arange(starts.size) > 0))
        assert not np.array_equal(wrong[0], hs)


def test_at_a_full_segment_s_size_an_example_costs_9_bytes_of_table():
    """1,024 examples a step, 16,384 records: 6 low bytes and a 3-byte slot (12 bytes in version 2),
    and a bucket table of 256 KB where version 2 kept 0.5 MB of fences."""
    entries = 1024 * 16384
    lay = index_table.TableLayout(entries, 256, index_table.prefix_bits(entries))
    assert (lay.k, lay.low_bytes, lay.slot_bytes) == (16, 6, 3)
    per_example = (lay.blocks * lay.block_bytes + lay.heads_size) / entries
    assert 9.0 < per_example < 9.05  # version 2: 12 + 12 / 256


def test_a_written_index_of_1024_examples_a_step_chooses_16_bits_and_finds_every_example(tmp_path):
    schema = Schema(examples_per_step=1024, rng_words=2, metrics=(("loss", "loss"),))
    w = TraceWriter(tmp_path / "trace", schema, segment_records=256)
    records = [make_record(schema, step) for step in range(257)]
    for rec in records:
        w.append(rec)
    w.close()
    reader = TraceReader(tmp_path / "trace", schema)
    index = reader.index(0)
    assert isinstance(index, FileIndex) and (index.layout.k, index.layout.low_bytes) == (16, 6)
    lay, columns = index.layout, _column_layout(schema, 256)[1]
    size = index_path(reader.segments[0].path).stat().st_size
    filter_size = example_filter.filter_blocks(lay.entries) * 64
    assert size == INDEX_HEADER_SIZE + columns + lay.heads_size + lay.blocks * lay.block_bytes + filter_size
    version_2 = INDEX_HEADER_SIZE + columns + (12 * lay.blocks + 7) // 8 * 8 + lay.blocks * 12 * 256 + filter_size
    assert size < 0.86 * version_2  # the 256 KB bucket table is 1 byte an example at this size, 0.016 at 16,384 records
    for step in (0, 100, 255):
        queries = np.unique(records[step].example_hashes)
        qi, slots = index.find(queries, 1)
        assert qi.tolist() == list(range(queries.size))
        at = {int(h): p for p, h in enumerate(records[step].example_hashes.tolist())}
        assert slots.tolist() == [step * 1024 + at[int(h)] for h in queries]


@pytest.fixture
def v2_trace(tmp_path):
    shutil.copytree(V2_FIXTURE, tmp_path / "trace")
    return tmp_path / "trace"


def test_a_version_2_index_is_read_as_written(v2_trace):
    reader = TraceReader(v2_trace, make_schema())
    for i in (0, 1):
        index = reader.index(i)
        assert isinstance(index, FileIndex) and index.version == 2 and index.layout is None
        hashes = segment_hashes(reader, i)
        assert answers(index, hashes, 0) == memory_answers(reader, i, hashes, 0)
    assert not reader.notes


def test_a_version_1_index_is_read_as_written(v2_trace):
    """No filter, no summary, its columns read together: version 2's files cut back to version 1."""
    schema = make_schema()
    for idx in v2_trace.glob("*.idx"):
        data = idx.read_bytes()
        filter_at = len(data) - example_filter.filter_blocks(30 * schema.examples_per_step) * 64
        head = bytearray(data[: _IHEAD.size])
        struct.pack_into("<H", head, 8, 1)
        idx.write_bytes(bytes(head) + struct.pack("<I", zlib.crc32(head)) + data[INDEX_HEADER_SIZE:filter_at])
    reader = TraceReader(v2_trace, schema)
    assert reader.index(0).version == 1 and reader.summary(0) is None
    for i in (0, 1):
        hashes = segment_hashes(reader, i)
        assert answers(reader.index(i), hashes, 0) == memory_answers(reader, i, hashes, 0)
    assert not reader.notes
