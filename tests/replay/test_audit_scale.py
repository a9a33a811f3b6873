"""The audit and bisect's repeated-data search at scale (issue 12): the audit of a trace, read a
hash range at a time from the segments' indexes, is the in-memory audit; seen_before finds what
a scan of every record finds."""

from __future__ import annotations

import numpy as np
import pytest

from replay.audit import scan as audit_scan
from replay.audit import tables as audit_tables
from replay.audit import audit, audit_hashes, audit_trace, read_example_hashes
from replay.bisect.data import seen_before
from tests.replay.test_audit import B, make_run, mix, order_ids, resume_repeat
from tests.replay.test_cli_show import assert_one_error_line, invoke, tree_digest
from traces import Run


def assert_same(a, b) -> None:
    for name in ("start", "end", "examples_per_step", "dataset_size", "dataset_size_from", "examples_seen", "distinct",
                 "times_seen", "duplicates", "replayed_batches"):
        assert getattr(a, name) == getattr(b, name), (name, getattr(a, name), getattr(b, name))
    for name in ("early_slots", "first_seen_slots", "duplicate_slots"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert a.per_epoch.keys() == b.per_epoch.keys()
    for key in a.per_epoch:
        assert np.array_equal(a.per_epoch[key], b.per_epoch[key]), key


def scenarios():
    clean = mix(order_ids(100, 60))
    dup_window = clean.copy()
    dup_window[30, 3] = dup_window[30, 5]  # one window twice in a batch: duplicate content
    sampler_bug = clean.copy()
    sampler_bug[40, :6] = sampler_bug[39, :6]  # many repeats in one batch: not evidence
    replayed = mix(order_ids(100_000, 300))
    replayed[200:210] = replayed[100:110]  # whole batches dealt again, in order
    return {"clean-multi-epoch": (clean, 100), "resume-repeat": (resume_repeat(), 1000),
            "unknown-size": (resume_repeat(), None), "duplicate-window": (dup_window, 100),
            "sampler-bug": (sampler_bug, 100), "replayed-batches": (replayed, 100_000)}


def small_sorts(monkeypatch) -> None:
    """Many ranges, each sorted in several sub-ranges, even for a small trace."""
    monkeypatch.setattr(audit_tables, "PARTITION_ENTRIES", 40)
    monkeypatch.setattr(audit_scan, "SORT_ENTRIES", 8)
    monkeypatch.setattr(audit_scan, "_SAMPLE_EVERY", 2)


@pytest.mark.parametrize("name", list(scenarios()))
def test_the_audit_of_a_trace_in_hash_ranges_is_the_in_memory_audit(tmp_path, monkeypatch, name):
    small_sorts(monkeypatch)
    hashes, n = scenarios()[name]
    run = make_run(tmp_path / "run", hashes, n, segment_records=16)
    in_memory = audit_hashes(read_example_hashes(Run.open(run)), 0, n, None, "manifest")
    assert_same(audit(run, source=False), in_memory)
    streamed = audit_trace(Run.open(run).trace, 0, hashes.shape[0], n, None, "manifest")
    assert_same(streamed, in_memory)
    assert streamed.notes == in_memory.notes
    part = audit(run, steps=(5, 27), source=False)
    assert_same(part, audit_hashes(hashes[5:27], 5, n, None, "manifest"))


def test_the_comparison_of_audits_sees_a_planted_repeat(tmp_path, monkeypatch):
    small_sorts(monkeypatch)
    clean = mix(order_ids(100, 60))
    planted = clean.copy()
    planted[45, 2] = planted[44, 1]
    a = audit(make_run(tmp_path / "a", clean, 100, segment_records=16), source=False)
    b = audit(make_run(tmp_path / "b", planted, 100, segment_records=16), source=False)
    assert a.ok and not b.ok and b.first_early_repeat_step == 45
    with pytest.raises(AssertionError):
        assert_same(a, b)


def test_each_range_of_index_tables_is_asked_of_the_kernel_before_it_is_read(tmp_path, monkeypatch):
    """The audit's reader thread advises (FileIndex.advise_table) exactly the bytes each sealed
    segment's table(lo, hi) then reads, before reading them."""
    from traces import index as index_mod, index_file

    small_sorts(monkeypatch)
    monkeypatch.setattr(index_mod, "BLOCK_ENTRIES", 4)  # many table blocks a segment: each range reads a few
    run = make_run(tmp_path / "run", mix(order_ids(100, 60)), 100, segment_records=16)
    events = []
    monkeypatch.setattr(index_file, "_willneed", lambda path, spans: events.append(("advice", path.name, *spans)))
    table = index_file.FileIndex.table
    monkeypatch.setattr(index_file.FileIndex, "table", lambda self, lo, hi: events.append(
        ("read", self.path.name, self.table_span(lo, hi))) or table(self, lo, hi))
    ranges = list(audit_tables.trace_pieces(Run.open(run).trace, 0, 60))
    reads = [k for k, e in enumerate(events) if e[0] == "read"]
    assert len(ranges) > 1 and len(reads) == 3 * len(ranges)  # three sealed segments (60 steps, 16 a segment)
    for k in reads:
        advised = [e for e in events[:k] if e[0] == "advice" and e[1] == events[k][1]]
        assert advised and advised[-1][2] == events[k][2], (events[k], advised[-1:])


def test_source_copies_give_the_same_audit_streamed(tmp_path, monkeypatch):
    small_sorts(monkeypatch)
    hashes = mix(order_ids(100, 60))
    hashes[10, 1] = hashes[10, 2]
    distinct = np.unique(hashes)
    copies = (distinct, np.where(distinct == hashes[10, 1], 2, 1))
    run = Run.open(make_run(tmp_path / "run", hashes, 100, segment_records=16))
    assert_same(audit_trace(run.trace, 0, 60, 100, copies), audit_hashes(hashes, 0, 100, copies))


def _flip(path, at: float) -> None:
    raw = bytearray(path.read_bytes())
    raw[int(len(raw) * at)] ^= 0x40
    path.write_bytes(bytes(raw))


def test_damaged_record_bytes_do_not_change_the_verdict_and_are_reported_by_verify(tmp_path):
    """The audit reads the hashes from the segments' checksummed indexes, not the records: a
    record damaged after its segment was sealed leaves the verdict what it was (it rests on no
    damaged byte), the report says the records were not read, and `audit(verify=True)` and
    `replay show --verify` report the damage, naming the segment."""
    from tests.replay.test_audit import invoke

    run = make_run(tmp_path / "run", resume_repeat(), 1000, segment_records=8)
    clean = audit(run, source=False)
    seg = sorted((run / "trace").glob("*.seg"))[0]  # steps 0..7: no record the audit reads (replayed ones: 10..29)
    _flip(seg, 0.5)
    damaged = audit(run, source=False)
    assert_same(damaged, clean)
    assert not damaged.ok and damaged.first_early_repeat_step == 20
    assert any("not the records" in n and "--verify" in n for n in damaged.notes)
    with pytest.raises(Exception, match=seg.name):
        audit(run, source=False, verify=True)
    result = invoke("show", str(run), "--verify")
    assert result.exit_code == 2 and seg.name in result.stderr, result.stderr


def test_a_damaged_index_is_rebuilt_from_its_records_and_their_damage_stops_the_audit(tmp_path):
    """Never a verdict on damaged bytes: a damaged index table block sends the audit to the
    segment's records, every checksum checked; when they are damaged too, the audit refuses."""
    from traces.index import index_path

    run = make_run(tmp_path / "run", resume_repeat(), 1000, segment_records=8, compact=False)
    clean = audit(run, source=False)
    seg = sorted((run / "trace").glob("*.seg"))[1]
    idx = index_path(seg)
    table_at = len(idx.read_bytes()) - 2 * 64  # inside the sorted table, before the filter's blocks
    raw = bytearray(idx.read_bytes())
    raw[table_at - 200] ^= 0x40
    idx.write_bytes(bytes(raw))
    rebuilt = audit(run, source=False)
    assert_same(rebuilt, clean)
    _flip(seg, 0.5)
    with pytest.raises(Exception, match=seg.name):
        audit(run, source=False)


def test_a_damaged_index_of_a_compacted_segment_stops_the_audit_naming_it(tmp_path):
    """A compacted segment's index is its hashes' only copy (traces/compaction.py): damaged, the
    audit refuses, naming it, rather than rebuild it from records that no longer hold them."""
    from traces.index import index_path

    run = make_run(tmp_path / "run", resume_repeat(), 1000, segment_records=8)
    seg = sorted((run / "trace").glob("*.seg"))[1]
    idx = index_path(seg)
    raw = bytearray(idx.read_bytes())
    raw[len(raw) - 2 * 64 - 300] ^= 0x40  # inside the sorted table
    idx.write_bytes(bytes(raw))
    with pytest.raises(Exception, match=f"{idx.name}.*only copy"):
        audit(run, source=False)
    # and the command says it in one line, exit 2 (bad input), the run untouched
    before = tree_digest(run)
    line = assert_one_error_line(invoke("audit", str(run)))
    assert idx.name in line and "only copy" in line and "restore" in line, line
    assert tree_digest(run) == before


def _scan_seen(runs, step, positions, limit=5):
    """seen_before as it was: every record of both runs up to `step`, scanned."""
    tables = {name: np.array([r.example_hashes for r in run.trace.records(stop=step + 1)]) for name, run in runs.items()}
    out = []
    for name, table in tables.items():
        for pos in positions:
            target, seen = table[step, pos], []
            for other, t in tables.items():
                upto = step * t.shape[1] + (pos if other == name else 0)
                for idx in np.flatnonzero(t.reshape(-1)[:upto] == target)[:limit]:
                    seen.append({"run": other, "step": int(idx // t.shape[1]), "position": int(idx % t.shape[1])})
            out.append((name, pos, f"{int(target):016x}", seen))
    return out


def test_seen_before_finds_what_a_scan_of_every_record_finds(tmp_path):
    a_hashes = mix(order_ids(1000, 70))
    b_hashes = a_hashes.copy()
    b_hashes[50:] = a_hashes[30:50]  # B resumed at 50 re-feeding steps 30..49
    b_hashes[50, 0] = b_hashes[50, 3]  # a copy within the step itself, after an earlier place
    runs = {"A": Run.open(make_run(tmp_path / "a", a_hashes, 1000, segment_records=16)),
            "B": Run.open(make_run(tmp_path / "b", b_hashes, 1000, segment_records=16))}
    positions = list(range(B))
    got = [(e.run, e.position, e.example_hash, e.seen) for e in seen_before(runs, 50, positions)]
    assert got == _scan_seen(runs, 50, positions)
    assert any(s["run"] == "B" and s["step"] == 30 for _, _, _, seen in got for s in seen)


def test_bisects_repeated_data_search_reads_b_only_where_its_batches_part(tmp_path, monkeypatch):
    """Counted from the moment the runs are opened: the steps where both runs fed the same
    batches (0..49 here) are searched in A's indexes alone; B's filters are read only from the
    segment where its batches part from A's (traces.fed.fed_in_both)."""
    from tests.traces.helpers import FileReads
    from traces.index import index_path

    a_hashes = mix(order_ids(1000, 70))
    b_hashes = a_hashes.copy()
    b_hashes[50:] = a_hashes[30:50]
    paths = make_run(tmp_path / "a", a_hashes, 1000, segment_records=16), make_run(tmp_path / "b", b_hashes, 1000,
                                                                                  segment_records=16)
    reads = FileReads(monkeypatch)
    runs = {"A": Run.open(paths[0]), "B": Run.open(paths[1])}
    got = [(e.run, e.position, e.example_hash, e.seen) for e in seen_before(runs, 50, list(range(B)))]
    assert got == _scan_seen(runs, 50, list(range(B)))
    searched = {name: [s.first_step for s in run.trace.segments if reads.filter_blocks.get(str(index_path(s.path)))]
                for name, run in runs.items()}
    assert searched == {"A": [0, 16, 32, 48], "B": [48]}
