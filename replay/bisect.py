"""`bisect`: where two runs first part, and why, in causal order.

1. Manifest diff: what differs before any step ran (config, environment, data, program).
2. Trace scan (traces.compare): the first step where any recorded field differs, and the
   first field in causal order: data -> rng -> state -> forward -> loss -> backward -> update.
3. Refine data: which example positions differ, and for each differing example of either
   run whether that exact example was already seen, and where (run, step, position):
   repeated data makes a loss look better than it is.
4. Refine a layer (replay/refine.py): replay the step of both runs and name the first
   intermediate inside the layer that differs, with its distances.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from replay.audit import read_example_hashes
from traces import Comparison, Run, compare

ENV_KEYS = ("backend", "device_kind", "device_count", "process_count", "cpu_count", "xla_flags")


@dataclass
class ManifestDiff:
    key: str
    a: object
    b: object


@dataclass
class SeenBefore:
    """Where an example of the first divergent batch had already been fed."""

    run: str  # "A" or "B": the run whose batch holds the example
    position: int  # its position in the divergent step's batch
    example_hash: str
    seen: list[dict] = field(default_factory=list)  # [{run, step, position}] earlier occurrences


@dataclass
class BisectReport:
    run_a: str
    run_b: str
    manifest: list[ManifestDiff]
    comparison: Comparison
    examples: list[SeenBefore] = field(default_factory=list)
    refinement: dict | None = None  # from replay/refine.py when a layer was refined
    replays: int = 0  # replays done to refine or search
    notes: list[str] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return self.comparison.identical

    @property
    def cause(self) -> str | None:
        first = self.comparison.first
        return first.kind if first else None

    @property
    def layer(self) -> str | None:
        first = self.comparison.first
        return first.name if first and first.kind in ("state", "forward", "backward", "update") else None

    def repeated(self, run: str) -> list[SeenBefore]:
        """Examples of `run`'s divergent batch that the same run had already fed."""
        return [e for e in self.examples if e.run == run and any(s["run"] == run for s in e.seen)]

    def to_json(self) -> dict:
        c = self.comparison
        return {
            "identical": self.identical, "first_step": c.first_step, "cause": self.cause, "layer": self.layer,
            "fields": [{"kind": d.kind, "name": d.name, "a": d.a, "b": d.b, "distance": d.distance,
                        "positions": d.positions} for d in c.diffs],
            "manifest_diff": [{"key": m.key, "a": m.a, "b": m.b} for m in self.manifest],
            "examples": [{"run": e.run, "position": e.position, "hash": e.example_hash, "seen_before": e.seen}
                         for e in self.examples],
            "repeated_in_b": len(self.repeated("B")), "repeated_in_a": len(self.repeated("A")),
            "refinement": self.refinement, "replays": self.replays, "compared": list(c.compared),
            "a_range": list(c.a_range), "b_range": list(c.b_range), "schema_notes": c.schema_notes, "notes": self.notes,
        }


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def manifest_diff(a: dict, b: dict) -> list[ManifestDiff]:
    """Config, environment, data and program differences, in that order."""
    diffs: list[ManifestDiff] = []
    fa, fb = _flatten(a.get("config", {}), "config."), _flatten(b.get("config", {}), "config.")
    for key in list(fa) + [k for k in fb if k not in fa]:
        if key != "config.steps" and fa.get(key) != fb.get(key):
            diffs.append(ManifestDiff(key, fa.get(key), fb.get(key)))
    ea, eb = a.get("environment", {}), b.get("environment", {})
    for key in ENV_KEYS:
        if ea.get(key) != eb.get(key):
            diffs.append(ManifestDiff(f"environment.{key}", ea.get(key), eb.get(key)))
    va, vb = _flatten(ea.get("versions", {}), "versions."), _flatten(eb.get("versions", {}), "versions.")
    va.update(_flatten(ea.get("random", {}), "random."))
    vb.update(_flatten(eb.get("random", {}), "random."))
    for key in sorted(set(va) | set(vb)):
        if va.get(key) != vb.get(key):
            diffs.append(ManifestDiff(f"environment.{key}", va.get(key), vb.get(key)))
    da, db = a.get("data", {}), b.get("data", {})
    if da.get("fingerprint") != db.get("fingerprint"):
        diffs.append(ManifestDiff("data.fingerprint", da.get("fingerprint"), db.get("fingerprint")))
    if a.get("program_hash") != b.get("program_hash"):
        diffs.append(ManifestDiff("program_hash", (a.get("program_hash") or "")[:16], (b.get("program_hash") or "")[:16]))
    if a.get("faults") != b.get("faults"):
        diffs.append(ManifestDiff("faults", a.get("faults"), b.get("faults")))
    return diffs


def seen_before(runs: dict[str, Run], step: int, positions: list[int]) -> list[SeenBefore]:
    """For each differing example of each run at `step`: where it was fed earlier, in either run."""
    hashes = {name: read_example_hashes(run, stop=step + 1) for name, run in runs.items()}
    starts = {name: run.trace.start for name, run in runs.items()}
    found: list[SeenBefore] = []
    for name, table in hashes.items():
        row = table[step - starts[name]]
        for pos in positions:
            if pos >= len(row):
                continue
            target = row[pos]
            seen = []
            for other, other_table in hashes.items():
                flat = other_table.reshape(-1)
                width = other_table.shape[1]
                # Earlier than (step, pos) in the run itself; earlier than `step` in the other run.
                limit = (step - starts[other]) * width + (pos if other == name else 0)
                for idx in np.flatnonzero(flat[:limit] == target)[:5]:
                    seen.append({"run": other, "step": int(idx // width) + starts[other], "position": int(idx % width)})
            found.append(SeenBefore(name, pos, f"{int(target):016x}", seen))
    return found


def bisect(run_a: Run, run_b: Run) -> BisectReport:
    """Steps 1-3: manifest diff, first divergence in the traces, and the data refinement."""
    report = BisectReport(str(run_a.path), str(run_b.path), manifest_diff(run_a.manifest, run_b.manifest),
                          compare(run_a.trace, run_b.trace))
    first = report.comparison.first
    if first is not None and first.kind == "data":
        report.examples = seen_before({"A": run_a, "B": run_b}, report.comparison.first_step, first.positions or [])
    return report
