"""Replay-based refinement for `bisect`: look inside the divergent step, and find it when the
traces are too sparse to.

Two things live here, both built on replaying the two runs on this machine from their own
checkpoints (read-only; nothing in either run changes):

* `search_first_divergence`: binary search by replay (bisect step 5, sparse traces). The runs'
  states (parameters and optimizer state, by device fingerprints) are compared at common
  checkpoints first (restores, no steps run), then both runs are replayed to the midpoint of
  the last equal and the first differing state, reusing the lower bound's states so no probe
  starts from scratch: O(log N) probes. The divergent step is the first step whose *output*
  state differs: the step k with equal states entering it and differing states after it.
* `refine_step` (bisect step 4): at the divergent step, recompute with full instrumentation
  what that step computed for each run (its own params, batch, dropout key and, for the
  trainer's `layer-bf16` fault, its faulty program: the replayable's `recompute_step`,
  replay/engine/recompute.py) and compare element by element: inside a forward layer the block's
  intermediates (`intermediate_names(block)`) in execution order;
  for state, gradient and update fields the tensors leaf by leaf in the schema's causal order.
  It names the first intermediate (or leaf) that differs with its max abs, relative and ULP
  distance and the share of elements that differ. Without a trace field to refine (a trace
  that records no tensors at that step, or none at all) it walks the whole causal chain --
  data, rng, state, forward by layer, loss, backward, update -- and refines the first field
  that differs. Tensors are compared where they live (fingerprints, then on-device statistics
  of the leaves that differ); only the first differing leaf of each run comes to the host
  (replay/engine/tensor_distance.py DeviceDiff: at 7B a few KB plus one leaf, not ~224 GB).

Replays are counted as *probes*: one probe replays both runs to one step and compares them.
`Replayer.replayed_steps` counts the single steps actually re-run.

The recomputation is a separate jitted program from the training step (full batch; a
mesh-invariant run's microbatched gradients are recomputed the plain way), so its bits need
not equal the step's own -- but both runs go through the same program, so what differs
between them is what their inputs and configs make differ.

Layout: comparison and distances (host and device) live in replay/engine/tensor_distance.py; the Replayer, state
comparison and `search_first_divergence` in replay/engine/replayer.py; a step's inputs and its
instrumented recomputation in replay/engine/recompute.py. This module walks the intermediates
(`refine_step`) and re-exports the names the rest of `replay` and the tests import from it.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np

from replay.engine.tensor_distance import DeviceDiff, _brief, compare_tensors
from replay.engine.recompute import StepRecomputation, _LoopSide, _Side, tree_leaves
from replay.record.names import get_path
from replay.engine.replayer import (
    Replayer,
    ReplayUnavailable,
    Search,
    first_state_difference,
    open_replayable,
    search_first_divergence,
    state_fingerprints,
)
from traces import diff_records
from traces.schema import TENSOR_KINDS
from replay.bisect.first_op import first_differing_op
from replay.engine.code import call_user

__all__ = [
    "TENSOR_KINDS",
    "ReplayUnavailable",
    "Replayer",
    "Search",
    "StepRecomputation",
    "compare_tensors",
    "first_state_difference",
    "open_replayable",
    "refine_loop_step",
    "refine_step",
    "search_first_divergence",
    "state_fingerprints",
]



# ------------------------------------------------------------------------ walking the intermediates

def _walk(items: list[tuple[str, Callable[[], Any], Callable[[], Any]]],
          diff: DeviceDiff) -> tuple[str | None, tuple[Any, Any] | None, list[dict]]:
    """Compares (name, a, b) in order, where the tensors live (DeviceDiff: fingerprints of all
    in one call, statistics on device for the ones that differ; nothing fetched); returns (first
    differing name, its pair, compared rows). Keeps going after the first difference (the rows
    show what else differs); `_exact` then fetches the one pair the report details."""
    values = [(name, fa(), fb()) for name, fa, fb in items]
    fps_a = diff.fingerprints([va for _, va, _ in values])
    fps_b = diff.fingerprints([vb for _, _, vb in values])
    first, pair, rows = None, None, []
    summaries = diff.summaries([(va, vb) for _, va, vb in values], list(zip(fps_a, fps_b)))  # one program
    for (name, va, vb), d in zip(values, summaries):
        rows.append(_brief(name, d))
        if first is None and not d["equal"]:
            first, pair = name, (va, vb)
    return first, pair, rows


def _exact(diff: DeviceDiff, name: str, pair: tuple[Any, Any], rows: list[dict]) -> dict:
    """The first differing pair compared on the host (float64 distances, where the largest is):
    the one pair refinement fetches. Its row gets the exact figures too."""
    detail = diff.exact(*pair)
    for i, row in enumerate(rows):
        if row["name"] == name:
            rows[i] = {k: v for k, v in row.items() if k == "kind"} | _brief(name, detail)
            break
    return detail


def _opt_leaves(opt_state: Any) -> list[tuple[str, Any]]:
    return [("opt_state." + jax.tree_util.keystr(p, simple=True, separator="."), x)
            for p, x in jax.tree_util.tree_flatten_with_path(opt_state)[0]]


def _tensor_groups(a: _Side, b: _Side) -> list[tuple[str, str, Callable[[], list]]]:
    """(kind, schema field, lazily built [(name, a(), b())]) in causal order."""
    names = list(a.rc.param_names)
    layer_names = list(a.rc.layer_names)

    def leaves(get_a: Callable, get_b: Callable, order: list[str], pick: Callable = get_path) -> Callable[[], list]:
        return lambda: [(n, (lambda n=n: pick(get_a(), n)), (lambda n=n: pick(get_b(), n))) for n in order]

    def opt() -> list:
        la, lb = _opt_leaves(a.rc.opt_state()), _opt_leaves(b.rc.opt_state())
        if [n for n, _ in la] != [n for n, _ in lb]:
            raise ReplayUnavailable("the runs' optimizer states have different structures")
        return [(n, (lambda x=x: x), (lambda y=y: y)) for (n, x), (_, y) in zip(la, lb)]

    def loss() -> list:
        return [(n, (lambda n=n: a.rc.loss_and_grads()[0][n]), (lambda n=n: b.rc.loss_and_grads()[0][n]))
                for n in a.rc.loss_names]

    return [
        ("state", "state/params", leaves(a.rc.params, b.rc.params, names)),
        ("state", "state/opt_state", opt),
        ("forward", "layers", leaves(a.rc.layers, b.rc.layers, layer_names, pick=lambda d, n: d[n])),
        ("loss", "loss", loss),
        ("backward", "grad", leaves(lambda: a.rc.loss_and_grads()[1], lambda: b.rc.loss_and_grads()[1],
                                    list(reversed(names)))),
        ("update", "param", leaves(lambda: a.rc.params_of(a.after()[0]), lambda: b.rc.params_of(b.after()[0]),
                                   names)),
    ]


def _target_group(kind: str, name: str) -> str:
    if kind == "forward":
        return "layers"
    if name.startswith("grad/"):
        return "grad"
    if name.startswith("param/"):
        return "param"
    return name  # state/params, state/opt_state


def _layer_of(group: str, item: str) -> str:
    """The schema field an item of a group belongs to."""
    if group == "grad":
        return f"grad/{item}"
    if group == "param":
        return f"param/{item}"
    if group == "layers":
        return item
    return group


def refine_step(ra: Replayer, rb: Replayer, step: int, states: tuple[Any, Any],
                focus: tuple[str, str] | None = None) -> dict:
    """Recompute step `step` of both runs from their states entering it (before faults) and
    name the first intermediate that differs.

    focus: (kind, schema field) the trace named (e.g. ("forward", "block_01.attn")); None to
      walk the causal chain and refine the first field that differs.
    Returns a JSON-able dict (bisect's report.refinement): cause and layer (the schema field),
    first_intermediate (inside a block: a block_capture_names entry; for state, gradient and
    update fields: the parameter or optimizer-state leaf), distances (max_abs, max_rel,
    max_ulp), share_differing, compared ([{name, equal, ...}] in causal/execution order),
    reproduces_trace ({A, B}: whether replaying the step gave the recorded record).
    Both runs' replayables must provide `recompute_step` (replay/engine/recompute.py); ReplayUnavailable if not.
    """
    a, b = _Side(ra, states[0], step), _Side(rb, states[1], step)
    if list(a.rc.param_names) != list(b.rc.param_names):
        raise ReplayUnavailable("the runs' models have different parameters; nothing to compare inside a layer")
    out: dict = {"step": step, "found_by": "trace" if focus else "replay", "cause": None, "layer": None,
                 "first_intermediate": None, "programs": {"A": _program_name(a), "B": _program_name(b)},
                 "reproduces_trace": {"A": _reproduces(a), "B": _reproduces(b)}, "notes": []}
    for label, ok in out["reproduces_trace"].items():
        if ok is False:
            out["notes"].append(f"replaying step {step} of {label} here does not give its recorded record: "
                                "the recomputation may not show what the run computed")
    if focus is None:
        # Inputs of the step first: the batch and the dropout key.
        ha, hb = np.asarray(a.rc.hashes, np.uint64), np.asarray(b.rc.hashes, np.uint64)
        if not np.array_equal(ha, hb):
            n = min(len(ha), len(hb))
            pos = [int(i) for i in np.nonzero(ha[:n] != hb[:n])[0]]
            pos += list(range(n, max(len(ha), len(hb))))
            out.update(cause="data", layer="example_hashes", positions=pos, share_differing=len(pos) / max(1, n))
            return out
        wa, wb = np.asarray(a.rc.rng()), np.asarray(b.rc.rng())
        if not np.array_equal(wa, wb):
            out.update(cause="rng", layer="rng", a=[int(x) for x in wa], b=[int(x) for x in wb])
            return out
    groups = _tensor_groups(a, b)
    if focus is not None:
        target = _target_group(*focus)
        groups = [g for g in groups if g[1] == target]
        if not groups:
            raise ReplayUnavailable(f"no recomputation for the field {focus[1]!r}")
    out["chain"] = []  # [{kind, field, equal}]: each field of the causal chain compared, up to the first differing
    diff = DeviceDiff()
    out["fetched"] = fetched = {"leaves": 0, "bytes": 0}  # from device to host, to compare (DeviceDiff)
    for kind, group, items in groups:
        first, pair, rows = _walk(items(), diff)
        fetched.update(leaves=diff.fetched_leaves, bytes=diff.fetched_bytes)
        out["chain"].append({"kind": kind, "field": group, "equal": first is None})
        if first is None:
            if focus is not None:
                out["notes"].append(f"recomputed, {focus[1]} is equal in both runs at step {step}: the recorded "
                                    "difference did not reproduce here")
                out.update(cause=focus[0], layer=focus[1], compared=rows)
                return out
            continue
        detail = None
        layer = _layer_of(group, first)
        if focus is not None and layer != focus[1]:
            out["notes"].append(f"recomputed, the first {group} field to differ is {layer}; the trace's is {focus[1]}")
            layer = focus[1]  # the trace's field stays the layer; refinement looks inside it
        out.update(cause=kind, layer=layer, first_intermediate=first, compared=rows)
        if kind == "forward":
            block = layer.split(".")[0]
            if block in a.rc.block_names:
                # Inside the block: every intermediate, in execution order.
                fine = a.rc.intermediate_names(block)
                inner, inner_pair, inner_rows = _walk(
                    [(n, (lambda n=n: a.rc.intermediates(block)[n]), (lambda n=n: b.rc.intermediates(block)[n]))
                     for n in fine], diff)
                out.update(first_intermediate=inner, compared=inner_rows)
                if inner is None:
                    out["notes"].append(f"the intermediates of {block} are equal in both runs, yet {layer} differs")
                else:
                    detail = _exact(diff, inner, inner_pair, inner_rows)
            else:
                out["first_intermediate"] = layer
                detail = diff.exact(a.rc.layers()[layer], b.rc.layers()[layer])
        if detail is None:
            detail = _exact(diff, first, pair, rows)
        fetched.update(leaves=diff.fetched_leaves, bytes=diff.fetched_bytes)
        out.update(distances={k: detail.get(k) for k in ("max_abs", "max_rel", "max_ulp")},
                   share_differing=detail["share_differing"], differing=detail["differing"],
                   elements=detail["elements"], shape=detail["shape"], dtype_a=detail["dtype_a"],
                   dtype_b=detail["dtype_b"], at=detail.get("at"), a_value=detail.get("a_value"),
                   b_value=detail.get("b_value"))
        return out
    out["notes"].append(f"everything step {step} computes is equal in both runs")
    return out


def _reproduces(side: _Side) -> bool | None:
    """Whether replaying the step gives the run's recorded record (None: the step is not recorded)."""
    run = side.r.run
    if side.step not in run.trace:
        return None
    from replay.record.recorder import to_record

    _, metrics, hashes = side.after()
    try:
        rec = to_record(side.r.rep.schema, side.step, metrics, hashes)
    except KeyError:  # a recording level without the step fields
        return None
    return not diff_records(run.schema, run.trace.read(side.step), side.r.rep.schema, rec)


def _program_name(side: _Side) -> str:
    return str(getattr(side.rc, "program", None) or "the run's own")


# ------------------------------------------------------------------------ a loop without recompute_step

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
    detail = _exact(diff, first[1], pair, rows) if first is not None else None
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
