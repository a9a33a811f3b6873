"""`refine_loop_step`: bisect's refinement (replay/bisect/refine.py `refine_step`) for a loop whose
replayable gives no `recompute_step` (a user's loop through replay.Loop, or its exported program):
its own step is re-run on both runs' states entering the divergent step, and what it computes
(state, taps, metrics, the new state) is compared field by field in causal order; the first op
whose outputs differ is then named with each run's own code (replay/bisect/first_op.py).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from replay.bisect.first_op import first_differing_op
from replay.bisect.refine import exact_pair
from replay.engine.code import call_user
from replay.engine.recompute import _LoopSide, tree_leaves
from replay.engine.replayer import Replayer
from replay.engine.tensor_distance import DeviceDiff, _brief
from traces import diff_records


def _loop_fields(s: _LoopSide) -> list[tuple[str, str, Callable[[], Any]]]:
    """(kind, name, value) of everything one step of a loop computes, in causal order: the state
    entering it, forward (taps, then outputs), loss (its metrics, then per-example ones),
    backward (gradient taps), update (the new state's leaves); each kind's recorded metrics before
    its tensors, as the trace orders a record's fields (traces/compare.py diff_records), so the
    field named agrees with the trace's first (a learning rate `lr` before the parameters it moves). Taps come from the user's code; without it (an exported program), a layer-level
    record's fingerprints stand in for them."""
    sch = s.schema
    rec = lambda: s.own()[1]  # noqa: E731
    by_kind: dict[str, list] = {k: [] for k in ("state", "forward", "loss", "backward", "update")}
    by_kind["state"] = [("state", n, (lambda x=x: x)) for n, x in tree_leaves(s.raw, "state")]
    taps = s.taps()
    if taps is not None:
        for name, kind, tree in taps:
            if kind == "output":
                by_kind["forward"].append(("forward", name, (lambda x=tree: x)))
            elif kind in ("forward", "backward"):
                by_kind[kind] += [(kind, n, (lambda x=x: x)) for n, x in tree_leaves(tree, name)]
        recorded = {name: i for i, name in enumerate(sch.tensor_names)}
        for kind in ("forward", "backward"):  # in the trace's order (execution order, replay/record/taps.py)
            by_kind[kind].sort(key=lambda f: recorded.get(f[1], len(recorded)))
    else:
        for i, (name, kind) in enumerate(sch.tensors):
            if kind in ("forward", "backward"):
                by_kind[kind].append((kind, f"{name} (fingerprint)",
                                      (lambda i=i: None if rec().fingerprints is None else np.uint64(rec().fingerprints[i]))))
    by_kind["update"] = [("update", n, (lambda x=x: x)) for n, x in tree_leaves(s.own()[0], "update")]
    metrics: dict[str, list] = {k: [] for k in by_kind}
    for i, (name, kind) in enumerate(sch.metrics):
        metrics[kind if kind in metrics else "update"].append((kind, name, (lambda i=i: rec().metrics[i])))
    for i, name in enumerate(sch.example_metrics):
        by_kind["loss"].append(("loss", f"example_{name}", (lambda i=i: rec().example_metrics[i])))
    return [f for k in ("state", "forward", "loss", "backward", "update") for f in metrics[k] + by_kind[k]]


def refine_loop_step(ra: Replayer, rb: Replayer, step: int, states: tuple[Any, Any],
                     focus: tuple[str, str] | None = None) -> dict:
    """`refine_step` for a loop whose replayable gives no `recompute_step`: recompute step `step` of both
    runs from their states entering it and name the first field, in causal order, that differs
    (data, rng, state, forward, loss, backward, update), with its distances. The result has
    refine_step's keys; its `compared` rows also carry each field's kind."""
    a, b = _LoopSide(ra, states[0], step), _LoopSide(rb, states[1], step)
    out: dict = {"step": step, "found_by": "trace" if focus else "replay", "cause": None, "layer": None,
                 "first_intermediate": None, "programs": {"A": "the run's own", "B": "the run's own"},
                 "reproduces_trace": {"A": _loop_reproduces(a), "B": _loop_reproduces(b)}, "notes": []}
    for label, ok in out["reproduces_trace"].items():
        if ok is False:
            out["notes"].append(f"replaying step {step} of {label} here does not give its recorded record: "
                                "the recomputation may not show what the run computed")
    ha, hb = a.own()[1].example_hashes, b.own()[1].example_hashes
    if not np.array_equal(ha, hb):
        n = min(len(ha), len(hb))
        pos = [int(i) for i in np.nonzero(ha[:n] != hb[:n])[0]] + list(range(n, max(len(ha), len(hb))))
        out.update(cause="data", layer="example_hashes", positions=pos, share_differing=len(pos) / max(1, n))
        return out
    wa, wb = a.own()[1].rng, b.own()[1].rng
    if not np.array_equal(wa, wb):
        out.update(cause="rng", layer="rng", a=[int(x) for x in wa], b=[int(x) for x in wb])
        return out
    fa, fb = _loop_fields(a), {name: (kind, get) for kind, name, get in _loop_fields(b)}
    only = [name for _, name, _ in fa if name not in fb]
    if only:
        out["notes"].append(f"{len(only)} field(s) of A's step have no counterpart in B's (e.g. {only[0]}): "
                            "compared only what both compute")
    items = [(kind, name, get, fb[name][1]) for kind, name, get in fa if name in fb]
    values = [(kind, name, va, vb) for kind, name, get_a, get_b in items
              for va, vb in [(get_a(), get_b())] if va is not None and vb is not None]
    # Where the tensors live (replay/engine/tensor_distance.py DeviceDiff): fingerprints, then statistics
    # of the ones that differ; only the first differing pair is fetched.
    diff = DeviceDiff()
    fps_a, fps_b = diff.fingerprints([v[2] for v in values]), diff.fingerprints([v[3] for v in values])
    first, pair, rows = None, None, []
    summaries = diff.summaries([(va, vb) for _, _, va, vb in values], list(zip(fps_a, fps_b)))  # one program
    for (kind, name, va, vb), d in zip(values, summaries):
        rows.append({"kind": kind, **_brief(name, d)})
        if first is None and not d["equal"]:
            first, pair = (kind, name), (va, vb)
    detail = exact_pair(diff, first[1], pair, rows) if first is not None else None
    out["fetched"] = {"leaves": diff.fetched_leaves, "bytes": diff.fetched_bytes}
    out["compared"] = rows
    out["chain"] = []
    for row in rows:  # one entry per kind compared, up to the first that differs
        if not out["chain"] or out["chain"][-1]["kind"] != row["kind"]:
            out["chain"].append({"kind": row["kind"], "field": row["kind"], "equal": True})
        out["chain"][-1]["equal"] &= row["equal"]
        if not row["equal"]:
            break
    if first is None:
        out["notes"].append(f"everything step {step} computes is equal in both runs")
        return out
    kind, name = first
    out.update(cause=kind, layer=name, first_intermediate=name)
    _summarize_global(out, rows)
    out["op"] = _first_op(a, b, out["notes"])
    if focus is not None and focus[1] != name.removesuffix(" (fingerprint)"):
        out["notes"].append(f"recomputed, the first field to differ at step {step} is {name}; the trace's is {focus[1]}")
    out.update(distances={k: detail.get(k) for k in ("max_abs", "max_rel", "max_ulp")},
               share_differing=detail["share_differing"], differing=detail["differing"], elements=detail["elements"],
               shape=detail["shape"], dtype_a=detail["dtype_a"], dtype_b=detail["dtype_b"], at=detail.get("at"),
               a_value=detail.get("a_value"), b_value=detail.get("b_value"))
    return out


def _summarize_global(out: dict, rows: list[dict]) -> None:
    """Every leaf of a part of the new state differs (update/params.*: a change every parameter
    shares, the learning rate, the optimizer's settings, a scaled gradient): say so, not just the
    first leaf's name. A part is the state's top-level entry (params, opt_state, ...)."""
    parts: dict[str, list[bool]] = {}
    for r in rows:
        if r.get("kind") == "update" and r["name"].startswith("update/"):
            part = r["name"][len("update/"):].split(".", 1)[0]
            parts.setdefault(part, []).append(r["equal"])
    for part, equal in parts.items():
        if len(equal) > 1 and not any(equal):
            out["global"] = {"kind": "update", "part": part, "differing": len(equal), "of": len(equal)}
            out["notes"].append(f"all {len(equal)} leaves of the new state's {part} differ: a change they all share "
                                "(the learning rate, the optimizer's settings, a scaled gradient), not one layer's")
            return


def _first_op(a: _LoopSide, b: _LoopSide, notes: list[str]) -> dict | None:
    """The first op of the step whose outputs differ (replay/bisect/first_op.py), each run with its own
    code; None (with a note) when a run replays without its code or the comparison fails."""
    sa, sb = a.step_and_inputs(), b.step_and_inputs()
    if sa is None or sb is None:
        notes.append("the first differing op is not named: a run replays from its exported program, without its code")
        return None
    try:
        return call_user(first_differing_op, sa[0], sb[0], sa[1], sb[1])
    except Exception as e:  # noqa: BLE001 - the finding above stands without the op
        notes.append(f"the first differing op could not be found ({type(e).__name__}: {' '.join(str(e).split())[:160]})")
        return None


def _loop_reproduces(side: _LoopSide) -> bool | None:
    run = side.r.run
    if side.step not in run.trace:
        return None
    return not diff_records(run.schema, run.trace.read(side.step), side.schema, side.own()[1])
