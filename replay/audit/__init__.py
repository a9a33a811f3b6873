"""`replay audit`: does a run's data order keep its promise, judged from its trace alone?

The trainer deals a fresh permutation of the N examples per epoch (trainer/data.py): slot
g = step*B + j is in epoch g // N, and in one epoch every example appears once. An example
seen again in the same epoch "came back early", as with a sampler that re-reads data after
a resume, which makes a loss look better than it is. A whole batch dealt again in the same
order counts too: a permutation practically never does that, so it is caught across epoch
boundaries and when N is unknown. Identical token windows in the corpus share a hash and may
legitimately appear c times per epoch; c comes from the data source when it is here and
unchanged, else from the trace (copies that land in one batch).

Only the recorded per-example hashes are needed: numpy and traces, no JAX.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

import traces
from replay.audit import scan as audit_scan
from replay.audit import tables as audit_tables
from traces import columns
from traces.sorting import stable_argsort
from replay import rundata

AUTO_SOURCE_MAX_EXAMPLES = 1 << 20  # hashing the source costs ~1 us per window: auto only when cheap
_WINDOW_CHUNK_TOKENS = 1 << 24


class NothingToAudit(traces.TraceError):
    """The run (or the asked step range) holds no recorded step; a user error like any bad run."""


@dataclass(frozen=True)
class EarlyRepeat:
    step: int
    epoch: int
    positions: tuple[int, ...]
    first_seen: tuple[tuple[int, int], ...]  # (step, position) of the same example earlier in the epoch


@dataclass
class AuditReport:
    start: int  # first audited step
    end: int  # one past the last
    examples_per_step: int
    dataset_size: int  # N used for epochs (inferred from the trace when dataset_size_from == "trace")
    dataset_size_from: str  # "source", "declared" (replay.init), "manifest" (trainer data section) or "trace"
    examples_seen: int
    distinct: int
    times_seen: dict[int, int]  # times seen -> how many distinct examples were seen that often
    early_slots: np.ndarray  # int64 global slots that came back early, ascending
    first_seen_slots: np.ndarray  # int64, same length: that example's first slot in the epoch
    duplicate_slots: np.ndarray  # int64 slots excused as duplicate content in the data
    duplicates: list[dict]  # {"hash", "copies", "evidence"} of each hash known to have copies
    replayed_batches: int  # steps whose whole ordered batch equals an earlier step's
    per_epoch: dict[str, np.ndarray]  # epoch, first_step, last_step, slots, complete, distinct, early, duplicate
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.early_slots.size == 0

    @property
    def epochs(self) -> int:
        return int(self.per_epoch["epoch"].size)

    @property
    def first_early_repeat_step(self) -> int | None:
        return int(self.early_slots[0]) // self.examples_per_step if self.early_slots.size else None

    @property
    def early_repeat_steps(self) -> int:
        return int(np.unique(self.early_slots // self.examples_per_step).size)

    def early_repeats(self, limit: int | None = None) -> list[EarlyRepeat]:
        """Grouped by step, the first `limit` steps; built on demand as a broken run can have millions."""
        B, slots = self.examples_per_step, self.early_slots
        if not slots.size:
            return []
        bounds = np.flatnonzero(np.diff(slots // B)) + 1
        return [
            EarlyRepeat(int(slots[lo]) // B, int(slots[lo]) // self.dataset_size, tuple(int(s) % B for s in slots[lo:hi]),
                        tuple((int(f) // B, int(f) % B) for f in self.first_seen_slots[lo:hi]))
            for lo, hi in list(zip(np.r_[0, bounds], np.r_[bounds, slots.size]))[:limit]
        ]

    def summary(self) -> str:
        head = f"{self.distinct} examples seen {self.examples_seen} times"
        if self.dataset_size_from != "trace":  # an epoch count only from a known size, never from the trace alone
            head += f" over {self.examples_seen / self.dataset_size:.3g} epochs"
        n_dup = self.duplicate_slots.size
        dup = f"; {_n(n_dup, 'repeat')} {'is' if n_dup == 1 else 'are'} duplicate content in the data" if n_dup else ""
        if self.ok:
            return f"{head}; no example came back early: the data order is as promised{dup}"
        return (f"{head}; {self.early_slots.size} came back early (in {_n(self.early_repeat_steps, 'step')}), "
                f"first at step {self.first_early_repeat_step}{dup}")


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


# ------------------------------------------------------------------------------ reading


def read_example_hashes(run: traces.Run, start: int | None = None, stop: int | None = None) -> np.ndarray:
    """uint64 (steps, B) of steps start..stop-1 of a run, in global example order (traces.columns)."""
    return columns.read_example_hashes(run.trace, start, stop)


# ------------------------------------------------------------------------------ the data


def dataset_size(manifest: dict) -> int | None:
    """N, the examples of one epoch: what `replay.init(dataset_size=N)` declared, else
    n_tokens // (seq_len + 1) when the manifest records both (a trainer/ run's data section)."""
    return dataset_size_and_origin(manifest)[0]


def dataset_size_and_origin(manifest: dict) -> tuple[int | None, str | None]:
    """(N, "declared" | "tokens" | "manifest") or (None, None). A declared size is the loop's promise:
    its N examples, each once per epoch, epochs of N slots from the run's first example. One
    declared in tokens (replay.Tokens(T), packed LM rows of L tokens) gives epochs of T // L rows."""
    declared = manifest.get("dataset_size")
    if isinstance(declared, int) and not isinstance(declared, bool) and declared > 0:
        return declared, "declared"
    tokens, per_row = manifest.get("dataset_tokens"), manifest.get("example_tokens")  # replay.Tokens(T): packed rows
    if all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in (tokens, per_row)):
        return (tokens // per_row, "tokens") if tokens >= per_row else (None, None)
    try:
        n = int(manifest["data"]["n_tokens"]) // (int(manifest["config"]["model"]["seq_len"]) + 1)
    except (KeyError, TypeError, ValueError):
        return None, None
    return (n, "manifest") if n > 0 else (None, None)


def source_copies(manifest: dict, force: bool = False, run_path: str | os.PathLike = ".") -> tuple[
        tuple[np.ndarray, np.ndarray] | None, str | None]:
    """(sorted distinct window hashes, copies of each) of the run's data source, or (None, why not).

    Optional: needs the data-only entry of the run's loop (replay/rundata.py: the trainer's reads
    the manifest's data section without JAX), the source at its recorded path with the recorded
    fingerprint, and (unless forced) a source small enough to hash in about a second. Cost: one
    pass over the source (~1 us a window), never the run.
    """
    info, n = manifest.get("data") or {}, dataset_size(manifest)
    spec = info.get("path")
    if not spec or n is None:
        return None, "the data source was not checked for duplicate windows (the manifest does not name it)"
    if not force and n > AUTO_SOURCE_MAX_EXAMPLES:
        return None, f"the data source ({n} examples) was not checked for duplicate windows; pass --source to check it"
    try:
        describe = rundata.capability(rundata.data_of(manifest, run_path), "described_source",
                                      "described_source(data section) -> the source, to hash its windows")
    except rundata.NoDataEntry as e:
        return None, f"the data source was not checked for duplicate windows ({e})"
    except ImportError as e:
        return None, f"the data source was not checked for duplicate windows ({e.name or 'its data module'} is not importable)"
    try:
        source = describe(info)
    except FileNotFoundError:
        return None, f"the data source {spec} is not here, so duplicate windows are judged from the trace alone"
    except ValueError as e:  # trainer.data.DataError and its kind
        return None, f"the data source could not be opened ({e}); duplicate windows are judged from the trace alone"
    if info.get("fingerprint") not in (None, source.fingerprint()):
        return None, f"the data source {spec} changed since the run (fingerprint differs); not used"
    seq_len = int(manifest["config"]["model"]["seq_len"])
    rows = max(1, _WINDOW_CHUNK_TOKENS // (seq_len + 1))
    hashes = np.concatenate([source.window_hashes(np.arange(i, min(i + rows, n)), seq_len) for i in range(0, n, rows)])
    distinct, copies = np.unique(hashes, return_counts=True)
    return (distinct, copies), None


# ------------------------------------------------------------------------------ the audit


def audit(run: traces.Run | str | os.PathLike, steps: tuple[int | None, int | None] = (None, None),
          source: bool | None = None, verify: bool = False) -> AuditReport:
    """Audits steps [a, b) of a run. source: True to hash the data source, False never, None when cheap.

    The verdict rests on the example hashes of the segments' index tables, each block checked
    against its own checksum; an index was built from the records when its segment was sealed,
    and one missing or damaged is rebuilt from its segment with every record's checksum checked
    (a damaged record then stops the audit). So no verdict rests on damaged bytes. `verify` also
    reads every audited record's checksum (as much again as the tables: ~17 GB at 1.4M steps),
    for damage the hashes do not show (another field of a record); `replay show --verify` does
    that too. Without it the report says the records were not read."""
    run = run if isinstance(run, traces.Run) else traces.Run.open(run)
    if run.schema.examples_per_step == 0:
        raise traces.SchemaError(f"{run.path}: the trace records no per-example hashes, so there is nothing to audit")
    reader = run.trace
    start, stop = audited_steps(run, steps)
    # one note however many segments the damage made unreachable
    notes = ([f"the trace is damaged, only steps up to {reader.end - 1} were audited: {traces.describe_damage(reader.damage)}"]
             if reader.damage else [])
    copies, why = (None, None) if source is False else source_copies(run.manifest, force=bool(source), run_path=run.path)
    n, origin = dataset_size_and_origin(run.manifest)
    report = audit_trace(reader, start, stop, n, copies, size_from=origin or "manifest", verify=verify)
    report.notes[:0] = notes + ([why] if why else [])
    if not verify:
        report.notes.append("the example hashes were read from the segments' checksummed indexes, not the records: "
                            f"`replay audit --verify` (or `replay show --verify {run.path}`) checks every record")
    if not report.ok and copies is None:
        report.notes.append("without the data source, an example seen twice may also be a window the corpus holds "
                            "twice; `--source` on a machine that has the data tells them apart")
    return report


def audited_steps(run: traces.Run, steps: tuple[int | None, int | None]) -> tuple[int, int]:
    """[start, stop) of the asked range; a side left out is the trace's. A range reaching past what
    the trace holds is refused, not clipped: an audit of 0..19 reported as one of 0:500 would
    vouch for steps nobody looked at."""
    reader = run.trace
    start = reader.start if steps[0] is None else steps[0]
    stop = reader.end if steps[1] is None else steps[1]
    if reader.start <= start < stop <= reader.end:
        return start, stop
    if not len(reader):
        raise NothingToAudit(f"{run.path}: no recorded step to audit: its trace holds no step yet")
    asked = ":".join("" if x is None else str(x) for x in steps)
    held = f"{reader.start}..{reader.end - 1}"
    held = f"readable steps {held} (the rest is damaged: {traces.describe_damage(reader.damage)})" if reader.damage \
        else f"recorded steps {held}"
    raise NothingToAudit(f"{run.path}: steps {asked} are outside the {held}; give a range within "
                         f"{reader.start}:{reader.end}")


def audit_hashes(hashes_SxB: np.ndarray, start_step: int = 0, dataset_size: int | None = None,
                 copies: tuple[np.ndarray, np.ndarray] | None = None, size_from: str = "manifest") -> AuditReport:
    """The audit of a (steps, B) uint64 block recorded from `start_step` on, held in memory.

    One stable argsort groups equal hashes with their slots ascending; everything after is
    vectorised (replay/audit/scan.py), and the per-duplicate work only runs on entries that
    repeat in an epoch. `audit_trace` is the same audit of a trace, in bounded memory.
    """
    S, B = hashes_SxB.shape
    if S * B == 0:
        raise ValueError("no examples to audit")
    H = np.ascontiguousarray(hashes_SxB, dtype=np.uint64)
    base = start_step * B
    distinct = lambda: int(np.unique(H).size)  # noqa: E731
    N, size_from, notes = _epoch_size(distinct, dataset_size, copies, size_from)
    parts = audit_scan.memory_parts(H, base, N, copies)
    replayed = audit_scan.replayed_batches(audit_scan.memory_keys(H), lambda steps: H[steps], base, N, B)
    return _report(start_step, S, B, N, size_from, notes, parts, replayed, copies)


def audit_trace(reader: traces.TraceReader, start: int, stop: int, dataset_size: int | None = None,
                copies: tuple[np.ndarray, np.ndarray] | None = None, size_from: str = "manifest",
                verify: bool = False) -> AuditReport:
    """`audit_hashes` of steps start..stop-1 of a trace, read a hash range at a time from the
    segments' indexes: memory bounded by the range, not the run (replay/audit/scan.py). With
    `verify`, every record's checksum over those steps is checked too (see `audit`)."""
    B = reader.schema.examples_per_step
    S = stop - start
    if S * B == 0:
        raise ValueError("no examples to audit")

    def distinct() -> int:
        return sum(audit_scan.judged(audit_scan.range_distinct, audit_tables.trace_pieces(reader, start, stop)))

    # With verify the records' checksums are checked in a thread beside the analysis (crc32 and
    # numpy's sorts release the GIL), and the report waits for them.
    with audit_scan.BytesCheck(reader, start, stop, enabled=verify) as checked:
        N, size_from, notes = _epoch_size(distinct, dataset_size, copies, size_from)
        parts = list(audit_scan.judged(lambda pieces: audit_scan.range_part(pieces, N, B, copies),
                                       audit_tables.trace_pieces(reader, start, stop)))
        replayed = audit_scan.replayed_batches(audit_scan.trace_keys(reader, start, stop),
                                               audit_scan.trace_rows(reader, start), start * B, N, B)
    checked.result()
    return _report(start, S, B, N, size_from, notes, parts, replayed, copies)


def _epoch_size(distinct, dataset_size: int | None, copies, size_from: str) -> tuple[int, str, list[str]]:
    """(N, where it came from, notes): the source's, the declared or manifest's, else the
    distinct examples the trace shows (`distinct()`, computed only then)."""
    if copies is not None:
        return dataset_size or distinct(), "source", []
    if dataset_size is not None:
        return dataset_size, size_from, []
    D = distinct()
    return D, "trace", [f"the dataset size is unknown (not declared: replay.init(dataset_size=N) records it); epochs are "
                        f"taken as the {D} distinct examples the trace shows, which undercounts: an example fed again "
                        f"more than {D} examples after it was first fed, before the whole dataset was, is not counted "
                        "as early, and with repeats in the trace D is smaller than the dataset"]


def _report(start: int, S: int, B: int, N: int, size_from: str, notes: list[str], parts, replayed, copies) -> AuditReport:
    fields = audit_scan.combine(parts, B, N, start * B, S * B, *replayed, copies)
    if fields["distinct"] > N:
        notes.append(f"the trace holds {fields['distinct']} distinct examples, more than the dataset's {N}: "
                     "its data is not (only) the recorded source")
    return AuditReport(start=start, end=start + S, examples_per_step=B, dataset_size=int(N), dataset_size_from=size_from,
                       examples_seen=S * B, notes=notes, **fields)


_stable_argsort = stable_argsort  # tests pin its clash handling


def permutation(a: np.ndarray, b: np.ndarray) -> dict | None:
    """When two batches hold the same multiset of example hashes in another order: how B's
    examples were moved ({"examples", "moved", "moves": [[position in A, position in B], ...]}),
    else None (a batch with other examples, or the same batch in the same order). Copies of one
    example are matched in order, so a move is never invented between two copies."""
    a, b = np.asarray(a, np.uint64), np.asarray(b, np.uint64)
    if a.shape != b.shape or np.array_equal(a, b) or not np.array_equal(np.sort(a), np.sort(b)):
        return None
    order_a, order_b = np.argsort(a, kind="stable"), np.argsort(b, kind="stable")
    where_in_a = np.empty_like(order_a)
    where_in_a[order_b] = order_a  # B's position -> the position of the same (k-th) copy in A
    moves = [[int(where_in_a[j]), int(j)] for j in range(b.size) if where_in_a[j] != j]
    return {"examples": int(b.size), "moved": len(moves), "moves": moves[:64]}
