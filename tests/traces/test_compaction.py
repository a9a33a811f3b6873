"""Compacted segments (traces/compaction.py): sealed segments whose records hold no example hashes,
their index (version 4) the hashes' only copy. Records read back bit for bit, searches and scans
find the hashes, damage to the only copy is named (never guessed or rebuilt wrong), a kill at any
point of compaction loses nothing, and an older run resumed keeps its format."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest

from tests.traces.helpers import make_record, make_schema
from traces import Run, TraceCorruptError, columns, same_bits
from traces import compaction, index_table
from traces import filter as example_filter
from traces.fed import fed, first_fed
from traces.index import INDEX_HEADER_SIZE, _column_layout, index_path
from traces.index_file import FileIndex
from traces.manifest import write_manifest
from traces.segment import COMPACT_VERSION, HASHED_VERSION, header_version, read_at

PER, STEPS = 7, 30  # four sealed segments of 7 and a tail of 2


def _write(path, schema, steps=STEPS, start=0, resume=False):
    run = Run.resume(path) if resume else Run.create(path, schema, {"config": {"name": "compaction"}})
    w = run.writer(segment_records=PER)
    for k in range(start, steps):
        w.append(make_record(schema, k))
    run.finish()
    return [make_record(schema, k) for k in range(steps)]


def _raw_records(path, seg):
    """The decompressed bodies of a segment's frames, as stored."""
    from traces.segment import FRAME_HEAD, SegmentFile, _decompressor, walk_frames

    with SegmentFile(seg) as f:
        walk = walk_frames(f)
        data = f.read(0, f.size)
    d = _decompressor()
    return [d.decompress(data[a + FRAME_HEAD : b]) for a, b in zip(walk.offsets, walk.offsets[1:])]


@pytest.fixture(scope="module")
def compacted(tmp_path_factory):
    schema = make_schema()
    path = tmp_path_factory.mktemp("compaction") / "run"
    return path, schema, _write(path, schema)


def test_sealed_segments_are_compacted_and_every_record_reads_back_bit_exactly(compacted):
    path, schema, recs = compacted
    trace = Run.open(path).trace
    assert [(s.version, s.sealed) for s in trace.segments] == [(COMPACT_VERSION, True)] * 4 + [(HASHED_VERSION, False)]
    for seg in trace.segments:
        assert header_version(read_at(seg.path, 0, 28)) == seg.version
    assert not list((path / "trace").glob("*.tmp"))
    for rec in recs:
        assert same_bits(schema, rec, trace.read(rec.step)), rec.step
    assert np.array_equal(columns.read_example_hashes(trace), np.stack([r.example_hashes for r in recs]))
    assert trace.verify() == [] and trace.notes == []
    # The hashes read back came from the index: the compacted records do not hold them.
    B = schema.examples_per_step
    for seg in trace.segments[:4]:
        bodies = _raw_records(path, seg.path)
        assert len(bodies) == PER
        for k, body in enumerate(bodies):
            rec = recs[seg.first_step + k]
            assert rec.example_hashes.tobytes()[:16] not in body
            assert len(body) + 8 * B == len(trace.raw_record(rec.step))
    tail = _raw_records(path, trace.segments[4].path)
    assert recs[28].example_hashes.tobytes() in tail[0]  # the unsealed tail keeps its hashes


def test_the_index_file_is_exactly_its_layout_with_the_slot_order_and_the_lean_filter(compacted):
    path, schema, _ = compacted
    trace = Run.open(path).trace
    seg = trace.segments[1]
    index = FileIndex(index_path(seg.path), schema, seg.first_step, seg.count, seg.content_crc, seg.size)
    lay = index.layout
    assert index.version == 4 and lay.entries == PER * schema.examples_per_step
    bits, k = example_filter.params(4)
    assert (bits, k) == (8, 5)
    size = (INDEX_HEADER_SIZE + _column_layout(schema, PER)[1] + lay.heads_size + lay.blocks * lay.block_bytes
            + index_table.pad8(index_table.tops_bytes(lay)) + example_filter.filter_blocks(lay.entries, bits) * 64)
    assert index_path(seg.path).stat().st_size == size
    flat = np.concatenate([make_record(schema, s).example_hashes for s in range(7, 14)])
    assert np.array_equal(index.slot_hashes(0, flat.size), flat)  # the whole table, a chunk at a time
    assert np.array_equal(index.slot_hashes(16, 48), flat[16:48])  # a few steps: their buckets only
    assert index.maybe(flat).all()
    absent = np.random.default_rng(5).integers(0, 2**64 - 1, 4000, dtype=np.uint64, endpoint=True)
    assert 0.002 < index.maybe(absent).mean() < 0.1  # 8 bits an example, 5 a hash: ~2-3% expected


def test_searches_find_hashes_fed_in_compacted_segments(compacted):
    path, schema, recs = compacted
    run = Run.open(path)
    want = {int(recs[s].example_hashes[p]): (s, p) for s, p in ((0, 0), (9, 3), (20, 15), (27, 7), (29, 1))}
    found = fed(run, np.array(list(want), np.uint64))
    assert {h: places[0] for h, places in found.items()} == want
    assert first_fed(run, np.array(list(want), np.uint64), before_step=10) == {h: s for h, (s, _) in want.items() if s < 10}


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_a_flipped_slot_top_is_caught_by_the_steps_examples_key(tmp_path):
    """Segments of 128 records of 16 examples (2,048 entries: the bucket table stands for 8 bits,
    so each slot's top byte is stored). One flipped top byte sends that slot to another bucket."""
    schema = make_schema()
    B, per = schema.examples_per_step, 128
    path = tmp_path / "run"
    run = Run.create(path, schema, {"config": {"name": "tops"}})
    w = run.writer(segment_records=per)
    for k in range(2 * per):
        w.append(make_record(schema, k))
    run.finish()
    seg = Run.open(path).trace.segments[1]
    idx = index_path(seg.path)
    lay = FileIndex(idx, schema, seg.first_step, seg.count, seg.content_crc, seg.size).layout
    assert lay.k == 8
    bits = example_filter.params(4)[0]
    tops_at = idx.stat().st_size - example_filter.filter_blocks(lay.entries, bits) * 64 - index_table.pad8(index_table.tops_bytes(lay))
    data = bytearray(idx.read_bytes())
    data[tops_at + 9 * B + 5] ^= 0x5A  # step 137, position 5
    idx.write_bytes(bytes(data))
    trace = Run.open(path).trace
    assert same_bits(schema, make_record(schema, 136), trace.read(136))  # the other steps' slots are untouched
    with pytest.raises(TraceCorruptError, match="only copy") as e:
        trace.read(137)
    assert "000000000128.idx" in str(e.value)
    # A rebuild of the whole segment reads the table alone (not the slot order): every hash right.
    whole = columns.read_example_hashes(Run.open(path).trace, 128, 256)
    assert np.array_equal(whole, np.stack([make_record(schema, k).example_hashes for k in range(128, 256)]))


def test_damage_to_the_only_copy_is_named_and_never_read_as_hashes(compacted, tmp_path):
    path, schema, recs = compacted
    # A damaged table block: its checksum; the hashes cannot be had, and that is what is said.
    run = _copy(path, tmp_path / "block")
    seg = Run.open(run).trace.segments[1]
    idx = index_path(seg.path)
    index = FileIndex(idx, schema, seg.first_step, seg.count, seg.content_crc, seg.size)
    data = bytearray(idx.read_bytes())
    data[index._table_at + 3] ^= 0x01
    idx.write_bytes(bytes(data))
    trace = Run.open(run).trace
    with pytest.raises(TraceCorruptError, match="only copy of the example hashes of steps 7..13") as e:
        trace.read(9)
    assert "000000000007.idx" in str(e.value) and "checksum" in str(e.value)
    # The index deleted: the hashes are gone, and said so; the other segments read as before.
    run = _copy(path, tmp_path / "deleted")
    os.unlink(index_path(Run.open(run).trace.segments[2].path))
    trace = Run.open(run).trace
    with pytest.raises(TraceCorruptError, match="only copy of the example hashes of steps 14..20"):
        trace.read(15)
    with pytest.raises(TraceCorruptError, match="only copy"):
        fed(Run.open(run), recs[16].example_hashes[:1])
    assert same_bits(schema, recs[21], trace.read(21)) and same_bits(schema, recs[3], trace.read(3))
    assert any(d.step == 14 for d in Run.open(run).trace.verify())
    with pytest.raises(TraceCorruptError, match="only copy"):
        _resume_segment_lost(run, schema)


def _resume_segment_lost(run, schema):
    """A resumed writer whose last sealed segment lost its index refuses to append past it."""
    os.unlink(index_path(Run.open(run).trace.segments[3].path))
    Run.resume(run).writer(segment_records=PER)


def _uncompacted_state(tmp_path, schema, with_index: bool):
    """A run whose last sealed segment (steps 7..13) was sealed and compacted up to the rename: the
    segment in place still holds its hashes; the compacted copy beside it (and, with_index, its
    version-4 index) written. What a kill between those steps leaves."""
    path = tmp_path / "run"
    run = Run.create(path, schema, {"config": {"name": "kill"}})
    w = run.writer(segment_records=PER)
    w.compact = False  # seal the old way, then do compaction's steps by hand
    for k in range(16):
        w.append(make_record(schema, k))
    w.close()
    run.close()
    trace = Run.open(path).trace
    seg = trace.segments[1]
    builder, end = trace.index_builder(1)
    new_end, new_crc, new_size = compaction.compact(seg.path, schema, builder, end)
    if with_index:
        builder.write(index_path(seg.path), new_end, new_crc, new_size, compacted=True)
    else:
        os.truncate(compaction.tmp_path(seg.path), new_size // 2)  # killed while writing the copy
    return path


@pytest.mark.parametrize("with_index", [False, True])
def test_a_kill_during_compaction_loses_nothing_and_the_resumed_writer_compacts(tmp_path, with_index):
    schema = make_schema()
    path = _uncompacted_state(tmp_path, schema, with_index)
    seg_path = path / "trace" / "000000000007.seg"
    assert compaction.tmp_path(seg_path).exists()
    trace = Run.open(path).trace
    assert trace.segments[1].version == HASHED_VERSION
    for k in range(16):
        assert same_bits(schema, make_record(schema, k), trace.read(k))
    if with_index:  # stale for the segment in place: rebuilt in memory from it, and said so
        assert any("cannot be used" in n for n in trace.notes)
    _write(path, schema, steps=24, start=16, resume=True)
    trace = Run.open(path).trace
    assert [s.version for s in trace.segments] == [HASHED_VERSION, COMPACT_VERSION, COMPACT_VERSION, HASHED_VERSION]
    assert not compaction.tmp_path(seg_path).exists()
    for k in range(24):
        assert same_bits(schema, make_record(schema, k), trace.read(k)), k
    assert trace.verify() == [] and trace.notes == []


def test_an_older_run_resumed_keeps_its_format(tmp_path):
    schema = make_schema()
    path = tmp_path / "old"
    run = Run.create(path, schema, {"config": {"name": "old"}})
    run.close()
    manifest = json.loads((path / "run.json").read_text())
    manifest["format_version"] = 2
    write_manifest(path / "run.json", manifest)
    _write(path, schema, steps=16, resume=True)
    trace = Run.open(path).trace
    assert [s.version for s in trace.segments] == [HASHED_VERSION] * 3
    assert struct.unpack_from("<H", index_path(trace.segments[0].path).read_bytes(), 8)[0] == 3
    os.unlink(index_path(trace.segments[0].path))  # derived: rebuilt from the records that hold the hashes
    assert same_bits(schema, make_record(schema, 3), Run.open(path).trace.read(3))


def test_a_truncated_compacted_segment_reads_its_whole_records_and_no_writer_cuts_it(compacted, tmp_path):
    """What a damaged disk leaves: the records before the cut read with their hashes (its index
    still holds them, bound to the frames that remain by their offsets and checksums); the trace
    ends there, and a resuming writer refuses it (a compacted segment is never a torn tail)."""
    path, schema, recs = compacted
    run = _copy(path, tmp_path / "cut")
    seg = run / "trace" / "000000000007.seg"
    os.truncate(seg, seg.stat().st_size * 2 // 3)
    trace = Run.open(run).trace
    assert 7 < trace.end < 14 and trace.damage[0].path == str(seg)
    for k in range(trace.end):
        assert same_bits(schema, recs[k], trace.read(k)), k
    assert np.array_equal(columns.read_example_hashes(trace), np.stack([r.example_hashes for r in recs[: trace.end]]))
    with pytest.raises(TraceCorruptError, match="cannot append"):
        Run.resume(run).writer(segment_records=PER)
    assert seg.stat().st_size == (path / "trace" / "000000000007.seg").stat().st_size * 2 // 3  # not cut


def test_a_step_read_again_reads_its_hashes_from_the_index_once(tmp_path, monkeypatch):
    """A command that looks at one step several ways (bisect: compare, read, seen-before) reads
    its hashes from the index once; the last STEPS_HASHES_HELD steps are held, no more. Segments
    of 128 records of 16 examples: one step is under 1/64 of one, so read by its buckets."""
    from traces import trace as trace_mod

    schema = make_schema()
    path = tmp_path / "run"
    run = Run.create(path, schema, {"config": {"name": "held"}})
    w = run.writer(segment_records=128)
    for k in range(160):
        w.append(make_record(schema, k))
    run.finish()
    calls = []
    real = FileIndex.slot_hashes
    monkeypatch.setattr(FileIndex, "slot_hashes", lambda self, lo, hi: calls.append((lo, hi)) or real(self, lo, hi))
    monkeypatch.setattr(trace_mod, "STEPS_HASHES_HELD", 2)
    trace = Run.open(path).trace
    for _ in range(4):
        assert same_bits(schema, make_record(schema, 9), trace.read(9))
    assert len(calls) == 1
    for step in (10, 11, 9):  # 9 pushed out by two others: read again
        assert same_bits(schema, make_record(schema, step), trace.read(step))
    assert len(calls) == 4
    assert not trace.segment_hashes(0, 9, 10).flags.writeable  # what the next reader gets cannot be changed


def _swap_in(src, dst, first_step):
    """What a live run's writer does to a segment once sealed: its compacted copy's index
    written, then the copy renamed over the segment (here copied from `src`, the same records
    compacted)."""
    import shutil

    name = f"{first_step:012d}"
    for suffix in (".idx", ".seg"):
        tmp = dst / "trace" / f"{name}{suffix}.swap"
        shutil.copyfile(src / "trace" / f"{name}{suffix}", tmp)
        os.replace(tmp, dst / "trace" / f"{name}{suffix}")


def _live(root, schema, steps):
    """A run being written, not compacting (so its writer leaves the sealed segments as they were
    before compaction), open; with a reader that already read segment 1's frame offsets."""
    run = Run.create(root, schema, {"config": {"name": "compaction"}})
    w = run.writer(segment_records=PER, compact=False)
    for k in range(steps):
        w.append(make_record(schema, k))
    w.flush()
    w._wait_seal()  # segment 7..13's index written (else it could land after the swap below)
    trace = Run.open(root).trace
    trace.offsets(1)
    return w, trace


READS = {"read": lambda t: [t.read(step) for step in range(7, 10)],
         "columns": lambda t: columns.read_example_hashes(t, 7, 10),
         "check_bytes": lambda t: t.check_bytes(),
         "verify": lambda t: t.verify()}


@pytest.mark.parametrize("opened_as", ["sealed", "tail"])
@pytest.mark.parametrize("how", sorted(READS))
def test_a_reader_of_a_live_run_reads_a_segment_compacted_since_it_opened_it(compacted, tmp_path, opened_as, how):
    """A reader that opened a segment before its writer compacted it (sealed and not compacted
    yet, or still the tail) reads the compacted file the writer renamed over it: its records,
    their hashes, its checksums, never a false "damaged"."""
    path, schema, recs = compacted
    w, trace = _live(tmp_path / "live", schema, 14 if opened_as == "sealed" else 10)  # 7..13 sealed, or a tail of 3
    assert (trace.segments[1].version, trace.segments[1].sealed) == (HASHED_VERSION, opened_as == "sealed")
    _swap_in(path, tmp_path / "live", 7)
    got = READS[how](trace)
    if how == "read":
        assert all(same_bits(schema, recs[r.step], r) for r in got)
    elif how == "columns":
        assert np.array_equal(got, np.stack([recs[k].example_hashes for k in range(7, 10)]))
    elif how == "verify":
        assert got == []
    assert trace.segments[1].version == COMPACT_VERSION and trace.segments[1].sealed
    w.close()
