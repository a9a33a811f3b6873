"""The example store's index (replay/record/examples_index.py): opening a store reads the index,
not rows.bin; a step's examples are found through it; a missing, stale or damaged index is
never believed (the reader scans rows.bin instead, the resumed writer rebuilds it), and the
rows a replay gets are the stored ones in every case. Small blocks (BLOCK = 4) so a few dozen
examples span many blocks, and periodic writes (PERIOD = 8) so merges happen."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

from replay.record import examples_index as ix
from replay.record import examples_store as store
from replay.record.hashing import example_hashes

ENTRY = {"format": 1, "file": store.FILE, "batch_axis": 0,
         "leaves": [{"path": "x", "dtype": "float32", "shape": [3]}, {"path": "y", "dtype": "int32", "shape": []}]}
STEPS, B = 12, 5


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(ix, "BLOCK", 4)
    monkeypatch.setattr(store, "PERIOD", 8)


def batch_at(k: int) -> dict:
    """Step k feeds examples k..k+4: each step repeats four of the step before's."""
    ids = np.arange(k, k + B)
    return {"x": np.stack([ids * 0.5, ids * 2.0, -ids]).T.astype(np.float32), "y": ids.astype(np.int32)}


def record(root: Path, steps: int = STEPS, close: bool = True) -> store.ExampleWriter:
    writer = store.ExampleWriter(root, 0)
    for k in range(steps):
        b = batch_at(k)
        writer.add(b, example_hashes(b))
    if close:
        writer.close()
    return writer


def check_every_step(root: Path, steps: int = STEPS) -> store.ExampleReader:
    reader = store.ExampleReader(root, ENTRY)
    for k in range(steps):
        b = batch_at(k)
        got = reader.batch(k, example_hashes(b))
        assert np.array_equal(got[0], b["x"]) and np.array_equal(got[1], b["y"])
    return reader


def frame_of(root: Path, h: int) -> tuple[int, int]:
    off, clen, _ = store.scan(root / store.FILE)[0][h]
    return off, clen


def test_the_index_holds_every_frame_sorted_in_checked_blocks(tmp_path):
    record(tmp_path)
    disk = ix.DiskIndex.open(tmp_path / ix.FILE, tmp_path / store.FILE)
    frames = store.scan(tmp_path / store.FILE)[0]
    entries = np.concatenate(list(disk.blocks()))
    assert disk.count == len(frames) == STEPS + B - 1 and len(disk.table) == -(-disk.count // 4)  # merged, not appended
    assert list(entries["hash"]) == sorted(frames)
    assert all(frames[int(e["hash"])] == (int(e["offset"]) + store._FRAME, int(e["clen"]), int(e["rlen"]))
               for e in entries)
    assert disk.covered == (tmp_path / store.FILE).stat().st_size


def test_opening_reads_the_index_not_rows_bin(tmp_path):
    """A damaged frame that no replayed step reads is not read at open (the old store scanned, and
    checked, every frame when opened); the steps that do read it refuse it."""
    record(tmp_path)
    h = int(example_hashes(batch_at(STEPS - 1))[-1])  # fed first, and only, by the last step
    off, clen = frame_of(tmp_path, h)
    data = bytearray((tmp_path / store.FILE).read_bytes())
    data[off + clen // 2] ^= 1
    (tmp_path / store.FILE).write_bytes(bytes(data))
    reader = store.ExampleReader(tmp_path, ENTRY)
    assert reader.frames.disk is not None and not reader.frames.tail
    check_every_step(tmp_path, STEPS - 1)
    with pytest.raises(store.ExampleStoreError, match=f"frame at byte {off - store._FRAME} .*example 4 of step 11"):
        reader.batch(STEPS - 1, example_hashes(batch_at(STEPS - 1)))
    with pytest.raises(store.ExampleStoreError, match="fails its checksum"):
        store.scan(tmp_path / store.FILE)  # what opening cost before: every frame


def test_periodic_writes_and_a_crash_leave_an_index_of_a_prefix_and_a_scanned_tail(tmp_path):
    steps = STEPS - 1  # 15 examples: the index is written at 8 (PERIOD), the next write would be at 16
    writer = record(tmp_path, steps, close=False)  # a crash: never closed
    disk = ix.DiskIndex.open(tmp_path / ix.FILE, tmp_path / store.FILE)
    assert disk.count == 8 and 0 < disk.covered < (tmp_path / store.FILE).stat().st_size and len(writer._new) == 7
    reader = check_every_step(tmp_path, steps)
    assert reader.frames.disk is not None and len(reader.frames.tail) == 7


def _damage(root: Path, damage: str) -> None:
    index, rows = root / ix.FILE, root / store.FILE
    data = bytearray(index.read_bytes())
    disk = ix.DiskIndex.open(index, rows)
    table_end = ix._HEAD_SIZE + len(disk.table) * ix._TABLE.itemsize
    if damage == "missing":
        index.unlink()
    elif damage == "header":
        data[12] ^= 1  # the entry count
        index.write_bytes(bytes(data))
    elif damage == "block":
        data[table_end + 30] ^= 1  # an offset in block 0
        index.write_bytes(bytes(data))
    elif damage == "entry":  # entry 0 points at entry 1's frame, every checksum redone
        e = np.frombuffer(bytes(data[table_end:]), ix.ENTRY).copy()
        e["offset"][0], e["clen"][0], e["rlen"][0] = e["offset"][1], e["clen"][1], e["rlen"][1]
        ix.write(index, iter([e]), disk.count, disk.covered, *disk.last)
    elif damage == "other rows":  # rows.bin of the same length whose last frame is another, valid one
        raw = bytearray(rows.read_bytes())
        off, clen, _ = store.scan(rows)[0][int(example_hashes(batch_at(STEPS - 1))[-1])]
        raw[off + clen // 2] ^= 1
        crc = zlib.crc32(bytes(raw[off:off + clen]), zlib.crc32(bytes(raw[off - 24:off - 4])))
        raw[off - 4:off] = struct.pack("<I", crc)  # a valid frame of its own
        rows.write_bytes(bytes(raw))
    elif damage == "truncated rows":  # its last frame lost (rows.bin restored from an older copy)
        off, _, _ = store.scan(rows)[0][int(example_hashes(batch_at(STEPS - 1))[-1])]
        with open(rows, "r+b") as f:
            f.truncate(off - store._FRAME)


@pytest.mark.parametrize("damage", ["missing", "header", "other rows", "truncated rows", "block", "entry"])
def test_a_missing_stale_or_damaged_index_is_never_believed(tmp_path, damage):
    record(tmp_path)
    _damage(tmp_path, damage)
    index, rows = tmp_path / ix.FILE, tmp_path / store.FILE
    if damage in ("block", "entry"):  # found only when that block, or that frame, is read
        disk = ix.DiskIndex.open(index, rows)
        if damage == "block":
            with pytest.raises(ix.StaleIndex, match="block 0"):
                disk.find(np.asarray(sorted(store.scan(rows)[0]), np.uint64))
    else:
        with pytest.raises(ix.StaleIndex):
            ix.DiskIndex.open(index, rows)
    steps = STEPS - 1 if damage in ("other rows", "truncated rows") else STEPS
    reader = check_every_step(tmp_path, steps)  # the reader scanned rows.bin instead: every row right
    assert reader.frames.disk is None
    if damage == "other rows":  # and the rows that are not the recorded ones are refused
        with pytest.raises(store.ExampleStoreError, match="hash to"):
            reader.batch(STEPS - 1, example_hashes(batch_at(STEPS - 1)))
    store.ExampleWriter(tmp_path, 0).close()  # resumed: a stale index is rebuilt (an entry is checked when read)
    disk = ix.DiskIndex.open(index, rows)
    assert disk.count == len(store.scan(rows)[0]) and disk.covered == rows.stat().st_size
    assert store.ExampleReader(tmp_path, ENTRY).frames.disk is not None
    check_every_step(tmp_path, steps)
