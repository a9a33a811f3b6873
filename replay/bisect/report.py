"""What `replay bisect` reports (BisectReport), the manifest differences it lists first
(ManifestDiff), and the JSON form of both (finite_json: JSON has no NaN). The search that fills
a report is replay/bisect/__init__.py's; its refinements (data.py, refine.py, cross.py) add to it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from traces.schema import TENSOR_KINDS  # fields a replay can look inside (replay/bisect/refine.py)

if TYPE_CHECKING:  # annotations only: data.py fills reports, so it is imported by, not into, this module
    from replay.bisect.data import SeenBefore
    from traces import Comparison


@dataclass
class ManifestDiff:
    key: str
    a: object
    b: object


@dataclass
class BisectReport:
    run_a: str
    run_b: str
    manifest: list[ManifestDiff]
    comparison: Comparison
    examples: list[SeenBefore] = field(default_factory=list)
    permutation: dict | None = None  # the divergent batches hold the same examples in another order (see permuted)
    refinement: dict | None = None  # from replay/bisect/refine.py when the divergent step was recomputed
    replays: int = 0  # replay probes: both runs replayed to one step and compared
    notes: list[str] = field(default_factory=list)
    method: str = "trace scan"  # or "binary search by replay", "checkpoint comparison"
    found_step: int | None = None  # the divergent step found by replay when the trace scan had none or a later one
    search: dict | None = None  # the binary search's probes (refine.Search.to_json)
    replayed_steps: int = 0  # single steps re-run, both runs together
    bits_expected: bool = True  # whether the determinism contract promises equal bits for this pair
    noise: dict | None = None  # replay/engine/noise.py's verdict when bits are not expected
    damage: dict[str, str] = field(default_factory=dict)  # "A"/"B" -> one line naming its trace's first damage
    failure: Exception | None = None  # the replay the answer needed, failed: raised by the CLI after the report
    hardware: dict | None = None  # replay/bisect/replica.py: the runs differ in one device's replica results only
    rerun_checks: dict = field(default_factory=dict)  # replica.py: "A"/"B" -> its first SDC re-run from the divergence
    checkpoints: dict | None = None  # traces agree: "A"/"B" -> listed checkpoints checked intact (_check_checkpoints)
    edits: dict | None = None  # replay/bisect/edits.py: {"run", "step", "leaves"}: a loop changed its state between steps

    @property
    def checkpoint_note(self) -> str | None:
        """What an agreeing verdict says of the checkpoints: structure checked, contents not compared."""
        c = self.checkpoints
        if not c or not (c["A"] or c["B"]):
            return None
        if c.get("unchecked"):
            return (f"checkpoints not compared: those of {' and '.join(c['unchecked'])} (on object storage) were not "
                    "checked either; copy the run to a folder to have them checked")
        return (f"checkpoints not compared: the {c['A']} of A and {c['B']} of B are present and structurally intact, "
                "their contents unread (a restore checks each against its recorded fingerprint)")

    @property
    def whole(self) -> bool:
        """Whether the verdict covers both runs: no damaged trace, no failed replay."""
        return not self.damage and self.failure is None

    @property
    def noise_only(self) -> bool:
        """The runs differ in bits, but only by rounding noise the contract allows for this pair."""
        return self.noise is not None and not self.noise["above"] and (self.noise.get("inputs") or {}).get("equal", True)

    @property
    def identical(self) -> bool:
        return self.comparison.identical and self.found_step is None

    @property
    def first_step(self) -> int | None:
        return self.found_step if self.found_step is not None else self.comparison.first_step

    @property
    def found_before_trace(self) -> bool:
        """The divergent step was found by replay before the trace's first differing step: the
        trace's fields there describe a later step, not the divergence."""
        return self.found_step is not None and self.found_step != self.comparison.first_step

    @property
    def cause(self) -> str | None:
        if self.hardware is not None:  # one replica's results: a chip, not the program or the data
            return "hardware"
        if self.edits is not None:  # the loop changed the state between steps: not a step's computation
            return "edit"
        if self.noise_only and self.noise.get("because"):  # rounding the environment's difference explains
            return "environment"
        if self.refinement and self.refinement.get("cause"):
            return self.refinement["cause"]
        first = self.comparison.first
        # A later step's first field is not the cause of this one: unknown until it is recomputed.
        return first.kind if first and not self.found_before_trace else None

    @property
    def layer(self) -> str | None:
        if self.edits is not None:
            return "state/" + self.edits["leaves"][0]
        if self.cause == "environment":  # no layer caused it: the recorded fields that differ are in `fields`
            return None
        if self.refinement and self.refinement.get("cause"):
            r = self.refinement
            return r.get("layer") if r["cause"] in TENSOR_KINDS else None
        first = self.comparison.first
        return first.name if first and first.kind in TENSOR_KINDS and not self.found_before_trace else None

    @property
    def first_layer(self) -> str | None:
        """The layer (tensor) named, as `layer` (the name the cross-framework report uses too)."""
        return self.layer

    @property
    def within_noise(self) -> bool:
        """No divergence: identical, or differing only by the noise the contract allows for this pair."""
        return (self.identical and self.whole) or (self.noise_only and self.failure is None)

    def fields(self) -> list[dict]:
        """The fields that differ at the divergent step, in causal order: the trace's record of
        it, or, for a step found by replay before the trace's first difference, what the
        recomputation found differing there (never a later step's record)."""
        c = self.comparison
        if not self.found_before_trace:
            return [{"kind": d.kind, "name": d.name, "a": d.a, "b": d.b, "distance": d.distance,
                     "positions": d.positions} for d in c.diffs]
        r = self.refinement or {}
        if r.get("cause") in ("data", "rng"):
            return [{"kind": r["cause"], "name": r.get("layer"), "a": r.get("a"), "b": r.get("b"), "distance": None,
                     "positions": r.get("positions")}]
        return [{"kind": row.get("kind", r.get("cause")), "name": row["name"], "a": None, "b": None,
                 "distance": {"abs": row.get("max_abs"), "ulp": row.get("max_ulp"), "share": row.get("share_differing")},
                 "positions": None, "recomputed": True} for row in r.get("compared", []) if not row["equal"]]

    def repeated(self, run: str) -> list[SeenBefore]:
        """Examples of `run`'s divergent batch that the same run had already fed, in the same epoch
        where the run declares its dataset's size (a later epoch feeding it again is expected)."""
        return [e for e in self.examples if e.run == run
                and any(s["run"] == run and s.get("same_epoch", True) for s in e.seen)]

    def to_json(self) -> dict:
        """Strict JSON: a NaN or infinite value is null, with its repr beside it."""
        c = self.comparison
        return finite_json({
            # "identical" is the whole runs' verdict; over the steps compared, see identical_in_compared_steps.
            "identical": self.identical and self.whole, "identical_in_compared_steps": self.identical,
            "damage": self.damage, "error": None if self.failure is None else str(self.failure),
            "first_step": self.first_step, "cause": self.cause, "layer": self.layer,
            "method": self.method, "replays": self.replays, "replayed_steps": self.replayed_steps,
            "trace_first": None if c.first is None else {
                "step": c.first_step, "kind": c.first.kind, "name": c.first.name,
                **({"fields": [{"kind": d.kind, "name": d.name} for d in c.diffs]} if self.found_before_trace else {})},
            "fields": self.fields(), "permutation": self.permutation, "hardware": self.hardware,
            "rerun_checks": self.rerun_checks, "checkpoints": self.checkpoints, "edits": self.edits,
            "manifest_diff": [{"key": m.key, "a": m.a, "b": m.b} for m in self.manifest],
            "examples": [{"run": e.run, "position": e.position, "hash": e.example_hash, "seen_before": e.seen}
                         for e in self.examples],
            "repeated_in_b": len(self.repeated("B")), "repeated_in_a": len(self.repeated("A")),
            "refinement": self.refinement, "search": self.search, "compared": list(c.compared),
            "bits_expected": self.bits_expected, "noise": self.noise, "noise_only": self.noise_only,
            "a_range": list(c.a_range), "b_range": list(c.b_range), "schema_notes": c.schema_notes, "notes": self.notes,
        })


def finite_json(obj):
    """`obj` with every NaN or infinity replaced by None (JSON has neither); in a dict, `KEY_repr`
    beside it says what it was ("nan", "inf", "-inf")."""
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if isinstance(v, float) and not math.isfinite(v):
                out[k] = None
                out.setdefault(f"{k}_repr", str(v))
            else:
                out[k] = finite_json(v)
        return out
    if isinstance(obj, (list, tuple)):
        return [None if isinstance(v, float) and not math.isfinite(v) else finite_json(v) for v in obj]
    return obj
