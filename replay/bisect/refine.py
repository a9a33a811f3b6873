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
(`refine_step`) and re-exports the names the rest of `replay` and the tests import from it; a loop
without `recompute_step` is refined in replay/bisect/refine_loop.py.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np

from replay.engine.tensor_distance import DeviceDiff, _brief, compare_tensors
from replay.engine.recompute import StepRecomputation, _Side
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

__all__ = [
    "TENSOR_KINDS",
    "ReplayUnavailable",
    "Replayer",
    "Search",
    "StepRecomputation",
    "compare_tensors",
    "first_state_difference",
    "open_replayable",
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
    show what else differs); `exact_pair` then fetches the one pair the report details."""
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


def exact_pair(diff: DeviceDiff, name: str, pair: tuple[Any, Any], rows: list[dict]) -> dict:
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
                    detail = exact_pair(diff, inner, inner_pair, inner_rows)
            else:
                out["first_intermediate"] = layer
                detail = diff.exact(a.rc.layers()[layer], b.rc.layers()[layer])
        if detail is None:
            detail = exact_pair(diff, first, pair, rows)
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
