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
from traces import columns

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
        head = f"{self.distinct} examples seen {self.examples_seen} times over {self.examples_seen / self.dataset_size:.3g} epochs"
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
    """(N, "declared" | "manifest") or (None, None). A declared size is the loop's promise:
    its N examples, each once per epoch, epochs of N slots from the run's first example."""
    declared = manifest.get("dataset_size")
    if isinstance(declared, int) and not isinstance(declared, bool) and declared > 0:
        return declared, "declared"
    try:
        n = int(manifest["data"]["n_tokens"]) // (int(manifest["config"]["model"]["seq_len"]) + 1)
    except (KeyError, TypeError, ValueError):
        return None, None
    return (n, "manifest") if n > 0 else (None, None)


def source_copies(manifest: dict, force: bool = False) -> tuple[tuple[np.ndarray, np.ndarray] | None, str | None]:
    """(sorted distinct window hashes, copies of each) of the run's data source, or (None, why not).

    Optional: needs trainer.data, the source at its recorded path with the recorded
    fingerprint, and (unless forced) a source small enough to hash in about a second.
    """
    try:
        from trainer import data as tdata
    except ImportError:
        return None, "the data source was not checked for duplicate windows (trainer.data is not importable)"
    info, n = manifest.get("data") or {}, dataset_size(manifest)
    spec = info.get("path")
    if not spec or n is None:
        return None, "the data source was not checked for duplicate windows (the manifest does not name it)"
    if not force and n > AUTO_SOURCE_MAX_EXAMPLES:
        return None, f"the data source ({n} examples) was not checked for duplicate windows; pass --source to check it"
    if not spec.startswith(tdata.EMBEDDED_PREFIX) and not os.path.isfile(spec):
        return None, f"the data source {spec} is not here, so duplicate windows are judged from the trace alone"
    try:
        source = tdata.open_source(spec, info.get("dtype", "uint16"))
    except tdata.DataError as e:
        return None, f"the data source could not be opened ({e}); duplicate windows are judged from the trace alone"
    if info.get("fingerprint") not in (None, source.fingerprint()):
        return None, f"the data source {spec} changed since the run (fingerprint differs); not used"
    seq_len = int(manifest["config"]["model"]["seq_len"])
    rows = max(1, _WINDOW_CHUNK_TOKENS // (seq_len + 1))
    hashes = np.concatenate([tdata.example_hashes(tdata.load_batch(source, np.arange(i, min(i + rows, n)), seq_len))
                             for i in range(0, n, rows)])
    distinct, copies = np.unique(hashes, return_counts=True)
    return (distinct, copies), None


# ------------------------------------------------------------------------------ the audit


def audit(run: traces.Run | str | os.PathLike, steps: tuple[int | None, int | None] = (None, None),
          source: bool | None = None) -> AuditReport:
    """Audits steps [a, b) of a run. source: True to hash the data source, False never, None when cheap."""
    run = run if isinstance(run, traces.Run) else traces.Run.open(run)
    if run.schema.examples_per_step == 0:
        raise traces.SchemaError(f"{run.path}: the trace records no per-example hashes, so there is nothing to audit")
    reader = run.trace
    start, stop = audited_steps(run, steps)
    hashes = read_example_hashes(run, start, stop)
    # one note however many segments the damage made unreachable
    notes = ([f"the trace is damaged, only steps up to {reader.end - 1} were audited: {traces.describe_damage(reader.damage)}"]
             if reader.damage else [])
    copies, why = (None, None) if source is False else source_copies(run.manifest, force=bool(source))
    n, origin = dataset_size_and_origin(run.manifest)
    report = audit_hashes(hashes, start, n, copies, size_from=origin or "manifest")
    report.notes[:0] = notes + ([why] if why else [])
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
    """The audit of a (steps, B) uint64 block recorded from `start_step` on.

    One stable argsort groups equal hashes with their slots ascending; everything after is
    vectorised, and the per-duplicate work only runs on entries that repeat in an epoch.
    """
    S, B = hashes_SxB.shape
    M = S * B
    if M == 0:
        raise ValueError("no examples to audit")
    flat = np.ascontiguousarray(hashes_SxB, dtype=np.uint64).ravel()
    base = start_step * B
    gs, hs = _stable_argsort(flat)
    gs += base  # the order becomes the global slots, in place
    new_h = np.r_[True, hs[1:] != hs[:-1]]
    h_start = np.flatnonzero(new_h)
    seen = np.diff(np.r_[h_start, M])
    D = int(h_start.size)
    notes: list[str] = []
    if copies is not None:
        N, size_from = dataset_size or D, "source"
    elif dataset_size is not None:
        N = dataset_size
    else:
        N, size_from = D, "trace"
        notes.append(f"the dataset size is unknown (not declared: replay.init(dataset_size=N) records it); epochs are "
                     f"taken as the {D} distinct examples the trace shows, which undercounts: an example fed again "
                     f"more than {D} examples after it was first fed, before the whole dataset was, is not counted "
                     "as early, and with repeats in the trace D is smaller than the dataset")
    if D > N:
        notes.append(f"the trace holds {D} distinct examples, more than the dataset's {N}: "
                     "its data is not (only) the recorded source")
    es = gs // N
    new_he = new_h | np.r_[True, es[1:] != es[:-1]]
    again = np.flatnonzero(~new_he)  # sorted positions of second-or-later sightings within an epoch
    starts = np.flatnonzero(new_he)
    he_start = starts[np.searchsorted(starts, again) - 1]  # the (hash, epoch) group each repeat belongs to
    rank = again - he_start
    allowed, duplicates = _allowed_copies(hs, gs, again, B, copies)
    early = rank >= allowed
    replayed, replay_first = _replayed_batches(flat.reshape(S, B), base, N)
    # np.unique keeps the first index of each slot: an in-epoch first sighting wins over a replay's.
    early_slots, keep = np.unique(np.r_[gs[again[early]], replayed], return_index=True)
    first_seen = np.r_[gs[he_start[early]], replay_first][keep]
    dup_slots = np.setdiff1d(gs[again[~early]], early_slots)
    e0, e1 = base // N, (base + M - 1) // N
    epochs = np.arange(e0, e1 + 1)
    lo, hi = np.maximum(epochs * N, base), np.minimum((epochs + 1) * N, base + M)
    count = lambda slots: np.bincount(slots // N - e0, minlength=epochs.size)  # noqa: E731
    per_epoch = {
        "epoch": epochs, "first_step": lo // B, "last_step": (hi - 1) // B, "slots": hi - lo,
        "complete": (hi - lo) == N, "distinct": hi - lo - count(gs[again]),
        "early": count(early_slots), "duplicate": count(dup_slots),
    }
    times, how_many = np.unique(seen, return_counts=True)
    return AuditReport(
        start=start_step, end=start_step + S, examples_per_step=B, dataset_size=int(N), dataset_size_from=size_from,
        examples_seen=M, distinct=D, times_seen={int(t): int(c) for t, c in zip(times, how_many)},
        early_slots=early_slots, first_seen_slots=first_seen, duplicate_slots=dup_slots, duplicates=duplicates,
        replayed_batches=replayed.size // B, per_epoch=per_epoch, notes=notes,
    )


def _stable_argsort(flat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """np.argsort(flat, kind="stable") and flat in that order, about 3x faster.

    A stable argsort of 16M uint64 is numpy's slow merge sort. Instead the slot index is
    packed into the low bits of each hash and the keys go through numpy's SIMD value sort.
    Different hashes that agree on the remaining high bits can interleave; those few
    buckets are re-sorted exactly afterwards.
    """
    bits = max(1, (flat.size - 1).bit_length())
    if bits > 40:  # the key would keep fewer than 24 hash bits: too many clashes to fix up
        order = np.argsort(flat, kind="stable")
        return order, flat[order]
    low = np.uint64((1 << bits) - 1)
    key = flat & ~low
    key |= np.arange(flat.size, dtype=np.uint64)
    key.sort()
    order = (key & low).view(np.int64)  # slots < 2**40: the bits are the same as int64
    hs = flat[order]
    high = key
    high &= ~low  # in place: fresh full-size arrays are a large part of the cost
    clash = np.flatnonzero((high[1:] == high[:-1]) & (hs[1:] != hs[:-1]))
    if clash.size:
        bucket = np.cumsum(np.r_[True, high[1:] != high[:-1]]) - 1
        at = np.flatnonzero(np.isin(bucket, bucket[clash]))
        fix = np.lexsort((order[at], hs[at]))  # by full hash, then slot; buckets keep their place
        order[at], hs[at] = order[at][fix], hs[at][fix]
    return order, hs


def _replayed_batches(H: np.ndarray, base: int, N: int) -> tuple[np.ndarray, np.ndarray]:
    """Slots of steps whose whole batch repeats an earlier step's in order, and the slots they repeat.

    A fresh permutation per epoch practically never deals the same ordered batch twice, so
    this catches replayed data even across an epoch boundary, and when N is unknown and the
    epochs are only a guess. Skipped when the data is so small that it could happen by
    chance: (pairs of steps) / (N)_B, the expected count, above 1e-6.
    """
    S, B = H.shape
    none = np.empty(0, np.int64), np.empty(0, np.int64)
    if S < 2 or B > N or 2 * np.log10(S) - np.log10(N - np.arange(B, dtype=np.float64)).sum() > -6:
        return none
    mix = np.random.default_rng(B).integers(0, 2**63, B, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    key = np.zeros(S, np.uint64)
    for j in range(B):  # a wrapping weighted sum: equal rows give equal keys; rare clashes are checked below
        key += H[:, j] * mix[j]
    order, ks = _stable_argsort(key)
    again = np.flatnonzero(ks[1:] == ks[:-1]) + 1
    if not again.size:
        return none
    starts = np.flatnonzero(np.r_[True, ks[1:] != ks[:-1]])
    later, first = order[again], order[starts[np.searchsorted(starts, again) - 1]]
    same = (H[later] == H[first]).all(axis=1)
    cols = np.arange(B)
    return (base + later[same, None] * B + cols).ravel(), (base + first[same, None] * B + cols).ravel()


def _allowed_copies(hs, gs, again, B, copies) -> tuple[np.ndarray, list[dict]]:
    """How many sightings per epoch each repeated entry's hash may have, and the evidence.

    From the source: its exact number of copies. From the trace: copies of a hash seen at
    several positions of one batch. A batch where many different examples repeat is not
    taken as evidence: that is the signature of hosts reading the same slice (a sampler
    bug), while duplicate windows are rare, or one window (padding) repeated many times.
    """
    allowed = np.ones(again.size, dtype=np.int64)
    if again.size == 0:
        return allowed, []
    if copies is not None:
        distinct, n = copies
        at = np.clip(np.searchsorted(distinct, hs[again]), 0, max(distinct.size - 1, 0))
        found = distinct[at] == hs[again] if distinct.size else np.zeros(again.size, bool)
        allowed[found] = n[at[found]]
        known = np.unique(hs[again][allowed > 1])
        at = np.searchsorted(distinct, known)
        return allowed, [{"hash": int(h), "copies": int(c), "evidence": "source"} for h, c in zip(known, n[at])]
    same_step = again[gs[again] // B == gs[again - 1] // B]  # new_he is False there, so same hash and epoch
    if same_step.size == 0:
        return allowed, []
    # A (hash, epoch, step) group of k sits at k adjacent sorted places, k - 1 of them in same_step.
    run_start = np.flatnonzero(np.r_[True, np.diff(same_step) != 1])
    run_ends = np.r_[run_start[1:], same_step.size]
    first, size = same_step[run_start], run_ends - run_start + 1
    run_steps = gs[first] // B
    steps_u, per_step = np.unique(run_steps, return_counts=True)
    plausible = per_step[np.searchsorted(steps_u, run_steps)] <= max(1, B // 8)
    if not plausible.any():
        return allowed, []
    qh, qsize, qstep = hs[first][plausible], size[plausible], run_steps[plausible]
    sort = np.lexsort((-qsize, qh))
    qh, qsize, qstep = qh[sort], qsize[sort], qstep[sort]
    keep = np.r_[True, qh[1:] != qh[:-1]]  # the largest same-step count per hash
    qh, qsize, qstep = qh[keep], qsize[keep], qstep[keep]
    at = np.clip(np.searchsorted(qh, hs[again]), 0, qh.size - 1)
    hit = qh[at] == hs[again]
    allowed[hit] = qsize[at[hit]]
    return allowed, [{"hash": int(h), "copies": int(c), "evidence": f"{int(c)} copies in the batch of step {int(s)}"}
                     for h, c, s in zip(qh, qsize, qstep)]


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
